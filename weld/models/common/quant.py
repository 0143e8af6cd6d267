"""Quantized weights as a data type: `QuantWeight`, which `layers.linear` (and embedding lookups)
take next to plain and packed f32 matrices.

A QuantWeight is a matrix [n, k] (HF's [out, in]) in blocks of 32 inputs per output: unsigned
codes c (8, 6, 5 or 4 bits), a scale d and, in formats with one, a min mn per (output, block):

    w = d * (c - offset)     "int8" / GGUF Q8_0 (offset 128), Q6_K (32), Q5_0 (16), Q4_0 (8)
    w = d * c + mn           "int4", GGUF Q4_1, Q5_1, Q4_K, Q5_K (offset 0, mins)

(Q6_K, Q3_K and Q2_K have a scale per 16 inputs: `sub` = 2 scales per block; "int4_g128" one per
128: `group` = 4 blocks share a scale and a min),
laid out in panels of 16 outputs for the native CPU kernel (weld/kernels/cpu/quant_matmul.cc has
the byte layout): codes [P, nb, 512 | 256 + 64 (bits - 4)] (8 bits, or 4, 5, 6 in nibbles plus bit
planes: a GGUF's Q5 and Q6 blocks keep their size), scales and mins f16 [P, ng, 16 sub] (ng = nb / group,
rounded up). That kernel quantizes
the activations per block of 32 to int8 and takes integer dot products (AVX-512 VNNI or AVX2).
Elsewhere (no kernels, another backend) `linear` dequantizes and multiplies in XLA.

`quantize(w, "int8" | "int4" | "int4_g128")` makes one from a float matrix (int8 symmetric,
d = max|w| / 127 as llama.cpp's Q8_0; int4 asymmetric, w = d c + mn as Q4_1, over 32 or 128 inputs,
with d and mn fitted by least squares); `from_codes` from
codes and scales already in blocks (a GGUF's tensors: `gguf_blocks`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from weld.models.common import host
from weld.models.common.rounding import rounded

BLOCK = 32
PANEL = 16
CHUNK_ROWS = 64 * PANEL  # `quantize` works through a matrix this many rows at a time
MODES = ("int8", "int4", "int4_g128", "int8_channel", "int8_channel_int4_experts")
FORMATS = {"int8": (8, 128.0, False), "int4": (4, 0.0, True), "int4_g128": (4, 0.0, True), "q8_0": (8, 128.0, False),
           "q4_0": (4, 8.0, False), "q4_1": (4, 0.0, True), "q5_0": (5, 16.0, False), "q5_1": (5, 0.0, True),
           "q4_k": (4, 0.0, True), "q5_k": (5, 0.0, True),
           "q6_k": (6, 32.0, False), "q3_k": (4, 4.0, False), "q2_k": (4, 0.0, True),
           "mxfp4": (4, 128.0, False), "iq4_nl": (4, 128.0, False), "iq4_xs": (4, 128.0, False),
           "int8_channel": (8, 0.0, False), "int4_g128_rows": (4, 0.0, True)}  # format -> (bits, offset, has mins)
# Formats laid out as plain rows rather than the CPU kernel's panels: "int8_channel", signed codes
# [..., n, k] and one f32 scale per output [..., n] (w = d * c), for the XLA backends, whose matmul
# takes the codes as they are and scales its output (GPU, TPU), and the TPU megakernel.
# "int4_g128_rows": unsigned 4-bit codes in rows [..., n, kp / 2] (kp: k padded to whole groups of
# 128; byte j holds input j in its low nibble and input j + kp / 2 in its high one, so unpacking is
# a concatenation, not an interleave), and f32 scales and mins per group [..., n, kp / 128]: w = d c
# + mn (the seeds' int4 g128 experts, for the XLA backends and the TPU megakernel).
ROWS = frozenset({"int8_channel", "int4_g128_rows"})
ROW_GROUP = 128  # inputs per scale of "int4_g128_rows"
# The mix the seeds serve MoE models in (`--quantization int8_channel_int4_experts`): matrices int8
# per output channel, expert stacks int4 per group of 128, both as rows.
MIXES = {"int8_channel_int4_experts": {"linear": "int8_channel", "head": "int8_channel", "expert": "int4_g128_rows"}}
# Formats whose 4-bit codes index a table of int8 values (non-linear grids): w = d * table[c].
_IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)  # ggml's
LUTS = {"mxfp4": np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8),  # 2 x e2m1
        "iq4_nl": _IQ4, "iq4_xs": _IQ4}
# Inputs per scale (and min) where not a block's 32: Q6_K, Q3_K and Q2_K have one per 16 inputs
# (`subblocks`: 2 per block), "int4_g128" one per 128 (`group`: 4 blocks share one).
SCALE_INPUTS = {"q6_k": 16, "q3_k": 16, "q2_k": 16, "int4_g128": 128}


def subblocks(fmt: str) -> int:
    """Scales per block of 32 inputs: 1, or 2 (one per 16)."""
    return max(1, BLOCK // SCALE_INPUTS.get(fmt, BLOCK))


def group(fmt: str) -> int:
    """Blocks of 32 that share one scale (and min): 1, or 4 (one per 128)."""
    return max(1, SCALE_INPUTS.get(fmt, BLOCK) // BLOCK)


def scales_shape(fmt: str, n: int, k: int) -> tuple[int, int, int]:
    """The panels' scales (and mins) of a matrix [n, k] in fmt: [P, ng, 16 sub]."""
    nb = -(-k // BLOCK)
    return -(-n // PANEL), -(-nb // group(fmt)), PANEL * subblocks(fmt)


# int8 digits per activation in the CPU kernel: "int8" (a mode for f32 checkpoints, held to 0.5% of
# their perplexity) also multiplies the activations' rounding residual; a GGUF's blocks use one
# digit, as llama.cpp does.
ACTIVATION_DIGITS = {"int8": 2}


@jax.tree_util.register_pytree_node_class
class QuantWeight:
    """A weight [n, k] quantized in blocks of 32 (see the module docstring). `shape` and `dtype`
    (float32) are the logical matrix's; `nbytes` is what a step reads."""

    def __init__(self, codes: jax.Array, scales: jax.Array, mins: jax.Array | None, n: int, k: int, fmt: str):
        self.codes, self.scales, self.mins = codes, scales, mins
        self.n, self.k, self.fmt = n, k, fmt

    @property
    def bits(self) -> int:
        return FORMATS[self.fmt][0]

    @property
    def offset(self) -> float:
        return FORMATS[self.fmt][1]

    @property
    def activation_digits(self) -> int:
        return ACTIVATION_DIGITS.get(self.fmt, 1)

    @property
    def sub(self) -> int:
        """Scales per block of 32 inputs (2: one per 16)."""
        return subblocks(self.fmt)

    @property
    def group(self) -> int:
        """Blocks of 32 inputs per scale (4: one per 128)."""
        return group(self.fmt)

    @property
    def lut(self) -> np.ndarray | None:
        """The int8 values 4-bit codes index (`LUTS`), or None for linear codes."""
        return LUTS.get(self.fmt)

    def _values(self, codes: jax.Array) -> jax.Array:
        """Unpacked codes as the unsigned c of w = d (c - offset): through the table, if any."""
        return codes if self.lut is None else jnp.asarray(self.lut.astype(np.int16) + 128, jnp.uint8)[codes]

    @property
    def rows(self) -> bool:
        """Laid out as rows (`ROWS`), not panels."""
        return self.fmt in ROWS

    @property
    def shape(self) -> tuple[int, ...]:
        """(n, k), after the leading axes of a stack (an MoE layer's experts: [E, n, k])."""
        return tuple(self.codes.shape[:-2 if self.rows else -3]) + (self.n, self.k)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.scales, self.mins) if a is not None)

    def tree_flatten(self):
        return (self.codes, self.scales, self.mins), (self.n, self.k, self.fmt)

    @classmethod
    def tree_unflatten(cls, meta, children):
        return cls(*children, *meta)

    def _per_block(self, v: jax.Array) -> jax.Array:
        """Scales or mins [..., ng, sub * 16] -> [..., nb, sub * 16]: each group's for its blocks."""
        if self.group == 1:
            return v
        nb = self.codes.shape[-2]
        return jnp.repeat(v, self.group, axis=-2)[..., :nb, :]

    def _per_input(self, v: jax.Array) -> jax.Array:
        """Scales or mins [..., ng, sub * 16] -> [..., nb, 16, sub, 1]: what multiplies the codes
        [..., nb, 16, sub, 32 / sub]."""
        v = self._per_block(v).astype(jnp.float32)
        v = v.reshape(v.shape[:-1] + (self.sub, PANEL))
        return jnp.swapaxes(v, -1, -2)[..., None]

    def unpacked(self) -> jax.Array:
        """The [..., n, k] f32 matrix (or stack)."""
        if self.rows:
            return _rows_values(self.fmt, self.codes, self.scales, self.mins, self.k)
        *lead, p, nb, _ = self.codes.shape
        codes = self._values(unpack_codes(self.codes, self.bits)).astype(jnp.float32)  # [..., P, nb, 16, 32]
        codes = codes.reshape(codes.shape[:-1] + (self.sub, BLOCK // self.sub))
        d = self._per_input(self.scales)
        mv = self._per_input(self.mins) if self.mins is not None else -self.offset * d
        w = jnp.swapaxes((d * codes + mv).reshape(codes.shape[:-2] + (BLOCK,)), -3, -2)  # [..., P, 16, nb, 32]
        return w.reshape(*lead, p * PANEL, nb * BLOCK)[..., :self.n, :self.k]

    def __getitem__(self, ids) -> jax.Array:
        """Rows of the matrix (a quantized embedding's lookups): ids.shape + (k,), f32."""
        ids = jnp.asarray(ids)
        if self.rows:
            return _rows_values(self.fmt, self.codes[ids], self.scales[ids],
                                None if self.mins is None else self.mins[ids], self.k)
        flat = ids.reshape(-1)
        panel, out = flat // PANEL, flat % PANEL
        codes = self._values(unpack_codes(self.codes[panel], self.bits))  # [r, nb, 16, 32]
        rows = jnp.take_along_axis(codes, out[:, None, None, None], axis=2)[:, :, 0].astype(jnp.float32)
        rows = rows.reshape(rows.shape[:-1] + (self.sub, BLOCK // self.sub))  # [r, nb, sub, 32 / sub]

        def pick(v):  # [r, ng, sub * 16] -> this row's [r, nb, sub, 1]
            v = self._per_block(v)
            v = v.reshape(v.shape[:-1] + (self.sub, PANEL)).astype(jnp.float32)
            return jnp.take_along_axis(v, out[:, None, None, None], axis=3)

        d = pick(self.scales[panel])
        # one rounding per weight in every program (`rounding`): d (c - offset) is exact but for its
        # product; with mins the product is rounded before the min is added
        if self.mins is not None:
            w = rounded(d * rows) + pick(self.mins[panel])
        else:
            w = rounded(d * (rows - self.offset))
        w = w.reshape(flat.shape[0], -1)[:, :self.k]
        return w.reshape(ids.shape + (self.k,))


def _rows_values(fmt: str, codes, scales, mins, k: int) -> jax.Array:
    """The f32 values of rows in a `ROWS` format: codes [..., n, bytes] -> [..., n, k], each
    product rounded on its own (`rounding`: one result whatever program it is fused into)."""
    if fmt == "int8_channel":
        return rounded(codes.astype(jnp.float32) * scales[..., None])
    half = codes.shape[-1]
    c = jnp.concatenate([codes & 0x0F, codes >> 4], axis=-1).astype(jnp.float32)  # [..., n, kp]
    c = c.reshape(c.shape[:-1] + (2 * half // ROW_GROUP, ROW_GROUP))
    w = rounded(c * scales[..., None].astype(jnp.float32)) + mins[..., None].astype(jnp.float32)
    return w.reshape(w.shape[:-2] + (2 * half,))[..., :k]


def rows_parts(fmt: str, n: int, k: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The arrays of a matrix [n, k] in a `ROWS` format: name -> (safetensors dtype, shape)."""
    if fmt == "int8_channel":
        return {"codes": ("I8", (n, k)), "scales": ("F32", (n,))}
    groups = -(-k // ROW_GROUP)
    return {"codes": ("U8", (n, groups * ROW_GROUP // 2)), "scales": ("F32", (n, groups)), "mins": ("F32", (n, groups))}


def is_quantized(x) -> bool:
    return isinstance(x, QuantWeight)


def block_bytes(bits: int) -> int:
    """Bytes of one block of one panel: 8-bit codes, or the 4-bit layout plus a plane per bit above 4."""
    return 512 if bits == 8 else 256 + 64 * (bits - 4)


def unpack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """Codes [..., bytes] of panels' blocks -> [..., 16, 32] (output, input) as uint8."""
    lead = codes.shape[:-1]
    if bits == 8:
        grouped = codes.reshape(lead + (8, PANEL, 4))
    else:
        raw = codes[..., :256].reshape(lead + (4, PANEL, 4))
        grouped = jnp.concatenate([raw & 0x0F, raw >> 4], axis=-3)  # groups 0..3, then 4..7
        for plane in range(bits - 4):  # bit g of byte [o][j]: this bit of input 4 g + j
            bits_of = codes[..., 256 + 64 * plane:320 + 64 * plane].reshape(lead + (1, PANEL, 4))
            groups = jnp.arange(8, dtype=codes.dtype).reshape(8, 1, 1)
            grouped = grouped | (((bits_of >> groups) & 1) << (4 + plane)).astype(grouped.dtype)
    return jnp.moveaxis(grouped, -2, -3).reshape(lead + (PANEL, BLOCK))


# ----- making them (host side, numpy, at load) -----

def from_codes(codes: np.ndarray, d: np.ndarray, mn: np.ndarray | None, fmt: str) -> QuantWeight:
    """A QuantWeight of codes [n, k] (unsigned, < 2^bits) and scales d [n, ng * sub] (and mins):
    `SCALE_INPUTS` inputs each (32 unless the format says otherwise; ng = ceil(k / 32 / group)), e.g.
    a GGUF tensor's blocks. Padded inputs and outputs get weight 0."""
    bits, offset, has_mins = FORMATS[fmt]
    sub = subblocks(fmt)
    if has_mins != (mn is not None):
        raise ValueError(f"format {fmt} {'needs' if has_mins else 'has no'} mins")
    n, k = codes.shape
    nb, p = -(-k // BLOCK), -(-n // PANEL)
    pad_code = int(offset) if not has_mins and fmt not in LUTS else 0  # weight 0 (a table's code 0 is 0)
    c = np.full((p * PANEL, nb * BLOCK), pad_code, np.uint8)
    c[:n, :k] = codes
    c = c.reshape(p, PANEL, nb, 8, 4).transpose(0, 2, 3, 1, 4)  # [P, nb, group, output, 4 inputs]
    if bits == 8:
        packed = c.reshape(p, nb, 512)
    else:
        low = c & 0x0F
        parts = [(low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(p, nb, 256)]
        weights = (1 << np.arange(8, dtype=np.uint16)).reshape(8, 1, 1)
        for plane in range(bits - 4):  # byte [o][j], bit g: bit 4 + plane of input 4 g + j
            bit = ((c >> (4 + plane)) & 1).astype(np.uint16)  # [P, nb, 8, 16, 4]
            parts.append((bit * weights).sum(axis=2).astype(np.uint8).reshape(p, nb, 64))
        packed = np.concatenate(parts, axis=-1)

    _, ng, _ = scales_shape(fmt, n, k)
    if d.shape != (n, ng * sub) or (mn is not None and mn.shape != d.shape):
        raise ValueError(f"{fmt} matrix [{n}, {k}] takes scales [{n}, {ng * sub}], got {d.shape}")

    def panels(v: np.ndarray) -> jax.Array:  # [n, ng * sub] -> [P, ng, sub * 16]
        full = np.zeros((p * PANEL, ng * sub), np.float32)
        full[:n] = v
        return host.asarray(full.reshape(p, PANEL, ng, sub).transpose(0, 2, 3, 1).reshape(p, ng, sub * PANEL)
                            .astype(np.float16))

    return QuantWeight(host.asarray(packed), panels(d), panels(mn) if mn is not None else None, n, k, fmt)


def quantize(w: np.ndarray, mode: str) -> QuantWeight:
    """Quantization of a float matrix [n, k] in blocks of 32: "int8" symmetric (Q8_0's rule),
    "int4" asymmetric per 32 inputs (a scale and a min, as Q4_1; benchmarks/perplexity.py measured
    it against the symmetric Q4_0 rule), "int4_g128" per 128 (the last group of a row whose k is
    not a multiple of 128 takes what is left): each group's scale and min fitted (`_fit_int4`),
    codes rounded against the f16 values stored.
    "int8_channel": symmetric per output row, laid out as rows (`ROWS`); "int4_g128_rows" as
    "int4_g128" (the same fit), laid out as rows."""
    if mode not in (*MODES, *ROWS) or mode in MIXES:
        raise ValueError(f"quantization must be one of {tuple(m for m in MODES if m not in MIXES) + ('int4_g128_rows',)}, "
                         f"got {mode!r}")
    n, k = np.shape(w)
    if mode in ROWS and n <= CHUNK_ROWS:
        return _quantize_rows(np.asarray(w, np.float32), mode)
    if n > CHUNK_ROWS:  # by panels of rows, so the f32 temporaries stay a chunk's, not the matrix's
        parts = [quantize(w[i:i + CHUNK_ROWS], mode) for i in range(0, n, CHUNK_ROWS)]
        mins = None if parts[0].mins is None else host.concatenate([q.mins for q in parts])
        return QuantWeight(host.concatenate([q.codes for q in parts]), host.concatenate([q.scales for q in parts]),
                           mins, n, k, mode)
    w = np.asarray(w, np.float32)
    if mode == "int8":
        codes, d16 = q8_0(w)
        return from_codes((codes.astype(np.int16) + 128).astype(np.uint8), d16.astype(np.float32), None, mode)
    per = BLOCK * group(mode)  # inputs per scale and min: 32, or 128
    ng = -(-k // per)
    groups = np.zeros((n, ng * per), np.float32)
    groups[:, :k] = w
    groups = groups.reshape(n, ng, per)
    real = np.arange(ng * per).reshape(ng, per) < k  # padding inputs do not count in a group's fit
    d16, mn16 = _fit_int4(groups, real, _INT4_LEVELS)
    codes = _round_int4(groups, d16, mn16)
    return from_codes(codes.reshape(n, ng * per)[:, :k].astype(np.uint8), d16, mn16, mode)


def q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0's rule on a float matrix [n, k]: (codes int8 [n, k] in [-127, 127], scales f16
    [n, ceil(k / 32)]), w ~ code * scale of its block of 32 inputs; the codes are rounded against
    the unrounded scale (as llama.cpp's), so quantizing `q8_0_values` again gives the same."""
    n, k = np.shape(w)
    nb = -(-k // BLOCK)
    blocks = np.zeros((n, nb * BLOCK), np.float32)
    blocks[:, :k] = w
    blocks = blocks.reshape(n, nb, BLOCK)
    d = np.abs(blocks).max(axis=-1) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    codes = np.clip(np.rint(blocks * inv[..., None]), -127, 127).reshape(n, nb * BLOCK)[:, :k]
    return codes.astype(np.int8), d.astype(np.float16)


def q8_0_values(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """f32 [n, k]: the matrix `q8_0`'s codes and scales stand for."""
    n, k = codes.shape
    per = np.repeat(scales.astype(np.float32), BLOCK, axis=1)[:, :k]
    return codes.astype(np.float32) * per


def _to_f16(v: np.ndarray) -> np.ndarray:
    """f32 values rounded to the f16 they are stored as."""
    return v.astype(np.float16).astype(np.float32)


def _round_int4(w: np.ndarray, d: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Codes of groups w [..., per] against (f16) scales and mins [...]: round((w - mn) / d) in 0..15."""
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    return np.clip(np.rint((w - mn[..., None]) * inv[..., None]), 0, 15)


# Candidate steps of the int4 fit: the min-to-max step's 15 levels widened or narrowed by up to
# 1.5 (benchmarks/results/quant_2026-12-01.md has what the fit does to perplexity).
_INT4_LEVELS = (15.0 + np.linspace(-1.5, 1.5, 7)).astype(np.float32)


def _fit_int4(w: np.ndarray, real: np.ndarray, levels=()) -> tuple[np.ndarray, np.ndarray]:
    """The f16 scale d and min mn [...] of each group w [..., per] (`real` marks the inputs that
    count) that leave the least squared error of w ~ d c + mn: Q4_1's min-to-max rule, or better,
    a least-squares (d, mn) for the codes of one of the candidate steps `levels` (numbers of steps
    from the group's min to its max; none: the rule as it is). Each candidate's error for its codes comes from the group's sums in closed form;
    rounding the codes again against the chosen (d, mn) can only lower it, so no group ends worse
    than under the min-to-max rule."""
    mask = None if real.all() else real.astype(np.float32)
    count = real.sum(axis=-1).astype(np.float64)
    lo = np.where(real, w, np.inf).min(axis=-1)
    hi = np.where(real, w, -np.inf).max(axis=-1)
    lo, hi = np.where(count > 0, lo, 0.0).astype(np.float32), np.where(count > 0, hi, 0.0).astype(np.float32)
    wm = w if mask is None else mask * w
    ones = np.ones(w.shape[-1], np.float32)
    dot = lambda a, b: np.einsum("...i,...i->...", a, b).astype(np.float64)  # noqa: E731  (per group)
    sw, sww = (wm @ ones).astype(np.float64), dot(wm, wm)

    def sums(c):  # the codes' sums the error of any (d, mn) for them takes
        c = c if mask is None else mask * c
        return (c @ ones).astype(np.float64), dot(c, c), dot(c, wm)

    def error(d, mn, sc, scc, scw):  # sum of (w - d c - mn)^2
        d, mn = d.astype(np.float64), mn.astype(np.float64)
        return sww - 2 * d * scw - 2 * mn * sw + d * d * scc + 2 * d * mn * sc + mn * mn * count

    best_mn = _to_f16(lo)
    best_d = _to_f16((hi - best_mn) / 15.0)
    best = error(best_d, best_mn, *sums(_round_int4(w, best_d, best_mn)))
    span = hi - lo
    for steps in levels:
        inv = np.divide(steps, span, out=np.zeros_like(span), where=span > 0)
        sc, scc, scw = sums(np.clip(np.rint((w - lo[..., None]) * inv[..., None]), 0, 15))
        det = count * scc - sc * sc
        ok = det > 0
        safe = np.where(ok, det, 1.0)
        d = _to_f16(np.where(ok, (count * scw - sc * sw) / safe, 0.0))
        mn = _to_f16(np.where(ok, (scc * sw - sc * scw) / safe, 0.0))
        err = error(d, mn, sc, scc, scw)
        better = ok & (d > 0) & (err < best)
        best, best_d, best_mn = np.where(better, err, best), np.where(better, d, best_d), np.where(better, mn, best_mn)
    return best_d, best_mn


def _quantize_rows(w: np.ndarray, mode: str) -> QuantWeight:
    """"int8_channel": symmetric per output row, d = max |w_row| / 127 (1 for an all-zero row),
    c = round(w / d) (half to even). "int4_g128_rows": each group of 128 inputs' scale and min
    fitted as "int4_g128"'s (`_fit_int4`), the padding inputs past k counting for nothing."""
    if mode == "int4_g128_rows":
        n, k = w.shape
        g = -(-k // ROW_GROUP)
        groups = np.zeros((n, g * ROW_GROUP), np.float32)
        groups[:, :k] = w
        groups = groups.reshape(n, g, ROW_GROUP)
        real = np.arange(g * ROW_GROUP).reshape(g, ROW_GROUP) < k
        d16, mn16 = _fit_int4(groups, real, _INT4_LEVELS)
        codes = _round_int4(groups, d16, mn16).astype(np.uint8).reshape(n, g * ROW_GROUP)
        half = g * ROW_GROUP // 2
        packed = codes[:, :half] | (codes[:, half:] << 4)
        return QuantWeight(host.asarray(packed), host.asarray(d16), host.asarray(mn16), n, k, mode)
    d = np.abs(w).max(axis=1) / np.float32(127.0)
    d = np.where(d > 0, d, np.float32(1.0)).astype(np.float32)
    codes = np.clip(np.rint(w / d[:, None]), -127, 127).astype(np.int8)
    return QuantWeight(host.asarray(codes), host.asarray(d), None, w.shape[0], w.shape[1], mode)


def quantize_stack(w: np.ndarray, mode: str) -> QuantWeight:
    """`quantize` of each matrix of a stack [E, n, k] (an MoE layer's experts), as one QuantWeight
    whose arrays carry the leading axis; indexing every leaf along it gives one expert's."""
    return stack([quantize(m, mode) for m in np.asarray(w, np.float32)])


def quantize_any(w: np.ndarray, mode: str) -> QuantWeight:
    """`quantize` of a matrix [n, k], `quantize_stack` of a stack [E, n, k]."""
    return quantize(w, mode) if np.ndim(w) == 2 else quantize_stack(w, mode)


def leaf_mode(kind: str | None, quantization: str | None) -> str | None:
    """The mode a declared weight gets under `--quantization` (`MODES`; None or "none": none):
    `WeightSpec.quantize` "linear" (and "expert": an MoE layer's stacks) takes the mode, "head" (the
    LM head) at least 8 bits (4-bit heads and embeddings cost small models most of their accuracy;
    llama.cpp's 4-bit mixes keep them wider too), None is never quantized; a mix (`MIXES`) names a
    format per kind."""
    if kind is None or quantization not in MODES:
        return None
    if quantization in MIXES:
        return MIXES[quantization][kind]
    kind = "linear" if kind == "expert" else kind
    return "int8" if kind == "head" and FORMATS[quantization][0] < 8 else quantization


class Blocks:
    """A quantized matrix on the host, before packing: codes [n, k] (unsigned), scales d [n, nb] and
    mins [n, nb] (or None), in `fmt`. Row operations (llama.cpp's Q/K permutation, splitting a fused
    matrix) apply to every part alike (`map_rows`). experts > 0: a stack [experts, n / experts, k]
    (a GGUF's `*_exps` tensor) whose rows are the experts' rows one expert after another."""

    def __init__(self, codes: np.ndarray, d: np.ndarray, mn: np.ndarray | None, fmt: str, experts: int = 0):
        self.codes, self.d, self.mn, self.fmt, self.experts = codes, d, mn, fmt, experts

    @property
    def shape(self) -> tuple[int, ...]:
        rows, k = self.codes.shape
        return (self.experts, rows // self.experts, k) if self.experts else (rows, k)

    def map_rows(self, fn) -> "Blocks | tuple[Blocks, ...]":
        """fn applied to codes, scales and mins alike (fn reorders or splits axis 0 only)."""
        if self.experts:
            raise ValueError("row conversions of a quantized expert stack are not supported")
        parts = [fn(a) for a in (self.codes, self.d, self.mn) if a is not None]
        if isinstance(parts[0], tuple):
            mins = parts[2] if self.mn is not None else (None,) * len(parts[0])
            return tuple(Blocks(c, d, m, self.fmt) for c, d, m in zip(parts[0], parts[1], mins))
        return Blocks(parts[0], parts[1], parts[2] if self.mn is not None else None, self.fmt)

    def packed(self) -> QuantWeight:
        if not self.experts:
            return from_codes(self.codes, self.d, self.mn, self.fmt)
        n = self.codes.shape[0] // self.experts
        each = [Blocks(*(None if a is None else a[e * n:(e + 1) * n] for a in (self.codes, self.d, self.mn)),
                       self.fmt).packed() for e in range(self.experts)]
        return stack(each)


def stack(parts: list[QuantWeight]) -> QuantWeight:
    """QuantWeights of one format and shape as one stack with a leading axis (an MoE layer's experts)."""
    join = lambda name: None if getattr(parts[0], name) is None else host.stack([getattr(p, name) for p in parts])  # noqa: E731
    return QuantWeight(join("codes"), join("scales"), join("mins"), parts[0].n, parts[0].k, parts[0].fmt)


def expert(w: QuantWeight, e: int) -> QuantWeight:
    """Matrix e of a stack."""
    return jax.tree_util.tree_map(lambda a: a[e], w)


# GGUF block types weld keeps quantized: name -> (format, inputs per block, bytes per block)
GGUF_KEPT = {"Q8_0": ("q8_0", 32, 34), "Q4_0": ("q4_0", 32, 18), "Q4_1": ("q4_1", 32, 20),
             "Q5_0": ("q5_0", 32, 22), "Q5_1": ("q5_1", 32, 24), "Q4_K": ("q4_k", 256, 144),
             "Q5_K": ("q5_k", 256, 176), "Q6_K": ("q6_k", 256, 210), "Q3_K": ("q3_k", 256, 110),
             "Q2_K": ("q2_k", 256, 84), "MXFP4": ("mxfp4", 32, 17), "IQ4_NL": ("iq4_nl", 32, 18),
             "IQ4_XS": ("iq4_xs", 256, 136)}
F16_MAX = 65504.0


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes [..., 2] as the f16 they hold, in f32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes [..., 16] -> 32 codes: weight j in the low nibble of byte j, j + 16 in its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's 12 bytes of 6-bit scales and mins -> (sc, m), each [..., 8]."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def _q3_k_scales(raw: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes [..., 12] -> its 16 6-bit scales [..., 16] (0..63), as ggml's kmask shuffle."""
    aux = np.ascontiguousarray(raw).view("<u4")  # [..., 3]
    a0, a1, tmp = aux[..., 0], aux[..., 1], aux[..., 2]
    low, high = np.uint32(0x0F0F0F0F), np.uint32(0x03030303)
    words = np.stack([(a0 & low) | ((tmp & high) << 4), (a1 & low) | (((tmp >> 2) & high) << 4),
                      ((a0 >> 4) & low) | (((tmp >> 4) & high) << 4), ((a1 >> 4) & low) | (((tmp >> 6) & high) << 4)],
                     axis=-1).astype("<u4")
    return np.ascontiguousarray(words).view(np.uint8).astype(np.float32)


def gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Blocks:
    """A GGUF tensor's raw blocks (uint8 [n, bytes per row]) as codes and per-32 scales (and mins).

    Blocks of 32 (f16 d, f16 m): Q8_0 int8 q, w = d q; Q4_0 nibbles, w = d (q - 8); Q4_1 nibbles,
    w = d q + m; Q5_0 / Q5_1 nibbles plus 32 high bits, w = d (q - 16) / d q + m. All lossless.
    Super-blocks of 256 (Q4_K, Q5_K): f16 d and dmin, 6-bit scale sc and min mn of each 32, then the
    4-bit codes (Q5_K: with a fifth bit), w = d sc q - dmin mn; weld stores d sc and -dmin mn as f16
    per 32, which rounds them to 11 significant bits (2^-12 relative, far below the codes' step).
    Q6_K: 6-bit codes, an int8 scale sc per 16 and f16 d, w = d sc (q - 32); d sc per 16 as f16.
    Q3_K (3-bit codes, a 6-bit scale per 16, w = d (sc - 32) (q - 4)) and Q2_K (2-bit codes, a 4-bit
    scale and min per 16, w = d sc q - dmin m) are held in 4-bit codes with those products per 16.
    MXFP4 (gpt-oss's experts: an e8m0 exponent per 32, e2m1 nibbles) keeps its nibbles, which index
    the table of 2 v (`LUTS`), under the scale 2^(e - 128), losslessly; IQ4_NL and IQ4_XS (ggml's
    non-linear 4-bit grid, a scale per 32: f16 d, or d (ls - 32) under a 256 super-block) too."""
    fmt, per_block, size = GGUF_KEPT[type_name]
    if len(shape) not in (2, 3):
        raise ValueError(f"{type_name} tensor of shape {shape}: weld keeps matrices and expert stacks only")
    experts = shape[0] if len(shape) == 3 else 0
    n, k = int(np.prod(shape[:-1])), shape[-1]  # an expert stack's rows, one expert after another
    nb = k // per_block
    if k % per_block or raw.size != n * nb * size or raw.shape[-1] != nb * size:
        raise ValueError(f"{type_name} tensor of shape {shape} holds {raw.shape} bytes, expected "
                         f"{tuple(shape[:-1]) + (nb * size,)}")
    blocks = np.ascontiguousarray(raw).reshape(n, nb, size)
    d = _f16(blocks[..., 0:2])
    mn = None
    if type_name == "MXFP4":  # e8m0 exponent e, 32 e2m1 nibbles indexing LUTS["mxfp4"] (2 v): w = 2 v 2^(e - 128)
        e = blocks[..., 0].astype(np.int32)
        if np.any(e < 104) or np.any(e > 143):
            raise ValueError(f"{type_name} block exponents beyond the f16 range (2^(e - 128) for e in 104..143)")
        d = np.ldexp(np.float32(1.0), e - 128).astype(np.float32)
        codes = _nibbles(blocks[..., 1:17])
    elif type_name == "IQ4_NL":  # f16 d, 32 nibbles indexing LUTS["iq4_nl"]: w = d table[q]
        codes = _nibbles(blocks[..., 2:18])
    elif type_name == "IQ4_XS":  # f16 d, a 6-bit scale ls per 32 (4 low bits + 2 high), nibbles
        low = blocks[..., 4:8]
        high = (blocks[..., 2].astype(np.uint16) | (blocks[..., 3].astype(np.uint16) << 8))[..., None]
        ib = np.arange(8)
        ls = ((low[..., ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 0x0F) | (((high >> (2 * ib)) & 3) << 4).astype(np.uint8)
        d = (d[..., None] * (ls.astype(np.float32) - 32)).reshape(n, nb * 8)
        codes = _nibbles(blocks[..., 8:136].reshape(n, nb, 8, 16))
        if not np.all(np.abs(d) <= F16_MAX):
            raise ValueError(f"{type_name} block scales beyond the f16 range")
    elif type_name == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    elif type_name in ("Q4_0", "Q4_1"):
        start = 2 if type_name == "Q4_0" else 4
        codes = _nibbles(blocks[..., start:start + 16])
        mn = _f16(blocks[..., 2:4]) if type_name == "Q4_1" else None
    elif type_name in ("Q5_0", "Q5_1"):
        start = 2 if type_name == "Q5_0" else 4
        high = np.unpackbits(blocks[..., start:start + 4], axis=-1, bitorder="little")  # bit j of a LE u32
        codes = _nibbles(blocks[..., start + 4:start + 20]) | (high << 4)
        mn = _f16(blocks[..., 2:4]) if type_name == "Q5_1" else None
    elif type_name in ("Q2_K", "Q3_K"):  # 2-bit planes of 32 bytes per 128 codes; scale (and min) per 16
        qs = blocks[..., 16:80] if type_name == "Q2_K" else blocks[..., 32:96]
        qs = qs.reshape(n, nb, 2, 1, 32)
        codes = (qs >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [n, nb, half, plane, 32]
        if type_name == "Q2_K":  # w = d (sc & 15) q - dmin (sc >> 4)
            sc = blocks[..., 0:16]
            d = (_f16(blocks[..., 80:82])[..., None] * (sc & 0x0F)).reshape(n, nb * 16)
            mn = (-_f16(blocks[..., 82:84])[..., None] * (sc >> 4)).reshape(n, nb * 16)
        else:  # w = d (sc - 32) (q + 4 h - 4): h from hmask bit 4 half + plane of byte l
            hmask = blocks[..., 0:32].reshape(n, nb, 1, 1, 32)
            shifts = (4 * np.arange(2, dtype=np.uint8)[:, None] + np.arange(4, dtype=np.uint8)).reshape(2, 4, 1)
            codes = codes | (((hmask >> shifts) & 1) << 2)
            d = (_f16(blocks[..., 108:110])[..., None] * (_q3_k_scales(blocks[..., 96:108]) - 32)).reshape(n, nb * 16)
        if not (np.all(np.abs(d) <= F16_MAX) and (mn is None or np.all(np.abs(mn) <= F16_MAX))):
            raise ValueError(f"{type_name} block scales beyond the f16 range")
    elif type_name == "Q6_K":  # ql [128] low nibbles, qh [64] two high bits each, int8 scales [16], f16 d
        ql = blocks[..., 0:128].reshape(n, nb, 2, 64)
        qh = blocks[..., 128:192].reshape(n, nb, 2, 32)
        low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
        high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
        codes = low | (high << 4)  # [n, nb, 2, 128]: 0..63, w = d sc (q - 32), sc per 16 inputs
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
        d = (_f16(blocks[..., 208:210])[..., None] * sc).reshape(n, nb * 16)
        if not np.all(np.abs(d) <= F16_MAX):
            raise ValueError(f"{type_name} block scales beyond the f16 range (|d sc| > {F16_MAX:g})")
    else:  # K-quants: 8 sub-blocks of 32 per super-block; 64 codes per 32 bytes (low nibbles, then high)
        dmin = _f16(blocks[..., 2:4])
        sc, m = _k_scales(blocks[..., 4:16])
        qs = blocks[..., -128:].reshape(n, nb, 4, 1, 32)
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(n, nb, 8, 32)
        if type_name == "Q5_K":  # sub-block s takes bit s of byte l of qh as its codes' fifth bit
            qh = blocks[..., 16:48]
            codes = codes | (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
        d, mn = (d[..., None] * sc).reshape(n, nb * 8), (-dmin[..., None] * m).reshape(n, nb * 8)
        if not (np.all(np.abs(d) <= F16_MAX) and np.all(np.abs(mn) <= F16_MAX)):
            raise ValueError(f"{type_name} block scales beyond the f16 range (|d sc| or |dmin m| > {F16_MAX:g})")
    return Blocks(codes.reshape(n, k).astype(np.uint8), d, mn, fmt, experts)


def to_blocks(w: QuantWeight) -> Blocks:
    """The host form of a packed QuantWeight (for re-packing, e.g. after concatenating)."""
    if w.rows:
        raise ValueError(f"{w.fmt} is laid out as rows, not blocks")
    p, nb, _ = w.codes.shape
    codes = np.asarray(unpack_codes(w.codes, w.bits))  # [P, nb, 16, 32]
    codes = codes.transpose(0, 2, 1, 3).reshape(p * PANEL, nb * BLOCK)[:w.n, :w.k]

    def rows(v):  # [P, ng, sub * 16] -> [n, ng * sub]
        if v is None:
            return None
        ng = v.shape[1]
        v = np.asarray(v).astype(np.float32).reshape(p, ng, w.sub, PANEL)
        return v.transpose(0, 3, 1, 2).reshape(p * PANEL, ng * w.sub)[:w.n]

    return Blocks(codes, rows(w.scales), rows(w.mins), w.fmt)


def take_rows(w, index: np.ndarray):
    """The rows (outputs) of a matrix [n, k] at index: an array's, or a row-layout QuantWeight's
    (codes and their per-row scales / groups); panel formats are refused."""
    if not isinstance(w, QuantWeight):
        return jnp.take(w, index, axis=-2)
    if not w.rows:
        raise ValueError(f"rows of a {w.fmt} matrix (panels) cannot be reordered; load with a per-row quantization")
    axis = -2 if w.scales.ndim == w.codes.ndim else -1
    pick = lambda v: None if v is None else jnp.take(v, index, axis=axis)  # noqa: E731
    return QuantWeight(jnp.take(w.codes, index, axis=-2), pick(w.scales), pick(w.mins), len(index), w.k, w.fmt)


def take_columns(w, index: np.ndarray):
    """The columns (inputs) of a matrix [n, k] at index: an array's, or an "int8_channel"
    QuantWeight's (a code per input, one scale per output); other formats are refused (their
    scales span blocks of inputs)."""
    if not isinstance(w, QuantWeight):
        return jnp.take(w, index, axis=-1)
    if w.fmt != "int8_channel":
        raise ValueError(f"inputs of a {w.fmt} matrix cannot be reordered; load it as floats or int8_channel")
    return QuantWeight(jnp.take(w.codes, index, axis=-1), w.scales, w.mins, w.n, len(index), w.fmt)


def concat_rows(parts: list) -> "QuantWeight | jax.Array | None":
    """Matrices [n_i, k] stacked along their outputs: arrays concatenated, QuantWeights of one
    format by their panels (re-packed when an n_i is not a multiple of 16). None when the forms
    differ (a layer whose matrices a GGUF stores in several types is left unfused)."""
    if all(not isinstance(p, QuantWeight) for p in parts):
        return host.concatenate(parts, axis=-2)
    if not all(isinstance(p, QuantWeight) and p.fmt == parts[0].fmt and p.shape[:-2] + (p.k,) ==
               parts[0].shape[:-2] + (parts[0].k,) for p in parts):
        return None
    if parts[0].rows:  # per-row scales [..., n] (int8) or per-row groups [..., n, g] (int4)
        axis = -2 if parts[0].scales.ndim == parts[0].codes.ndim else -1
        cat = lambda vs: None if vs[0] is None else host.concatenate(vs, axis=axis)  # noqa: E731
        return QuantWeight(host.concatenate([p.codes for p in parts], axis=-2), cat([p.scales for p in parts]),
                           cat([p.mins for p in parts]), sum(p.n for p in parts), parts[0].k, parts[0].fmt)
    if parts[0].ndim == 3:  # expert stacks: each expert's matrices
        return stack([concat_rows([expert(p, e) for p in parts]) for e in range(parts[0].shape[0])])
    if all(p.n % PANEL == 0 for p in parts):
        mins = None if parts[0].mins is None else host.concatenate([p.mins for p in parts])
        return QuantWeight(host.concatenate([p.codes for p in parts]), host.concatenate([p.scales for p in parts]),
                           mins, sum(p.n for p in parts), parts[0].k, parts[0].fmt)
    blocks = [to_blocks(p) for p in parts]
    cat = lambda vs: None if vs[0] is None else np.concatenate(vs)  # noqa: E731
    return Blocks(cat([b.codes for b in blocks]), cat([b.d for b in blocks]), cat([b.mn for b in blocks]),
                  parts[0].fmt).packed()
