"""Shared layers of the dense decoder family: RMSNorm, linear, SwiGLU, rotary embeddings.

Einsum letters used everywhere: b batch, t query tokens, s key/value tokens, d model dim,
h query heads, k kv heads, g query heads per kv head, e head dim, f MLP dim, v vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from weld.kernels import cpu as cpu_kernels
from weld.utils.errors import InvalidInputError


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in f32, cast back to x's dtype, then scaled (as HF Llama does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


# For matrices the native kernel does not take (unpacked: a drafter's weights, or all of them with
# the kernels off): XLA:CPU's dot runs matrix-vector products near memory speed, but
# at 2..64 rows it packs the whole weight matrix on every call and streams only 2-6 GB/s on the
# 2-core AVX2 box. Written as a multiply + reduction over the contiguous `in` axis, XLA:CPU hands
# it to YNNPACK, which streams the weights once: 1.1-2x faster from 4 to 32 rows on SmolLM2's shapes, about even at 64
# (benchmarks/results/cpu_decode_2026-11-30.md). WELD_CPU_SMALL_MATMUL=dot turns it off (read
# when a program is traced: set it before starting).
SMALL_MATMUL_ROWS = (2, 64)


def _reduce_matmul(rows: int, x: jax.Array, w: jax.Array) -> bool:
    form = os.environ.get("WELD_CPU_SMALL_MATMUL", "reduce")
    if form not in ("reduce", "dot"):
        raise InvalidInputError(f"WELD_CPU_SMALL_MATMUL must be 'reduce' or 'dot', got {form!r}")
    lo, hi = SMALL_MATMUL_ROWS
    # f32 only: a bf16 reduction could accumulate in bf16, where the dot accumulates in f32.
    return (form == "reduce" and lo <= rows <= hi and x.dtype == w.dtype == jnp.float32
            and jax.default_backend() == "cpu")


PANEL = 16  # outputs per panel of a packed weight


@jax.tree_util.register_pytree_node_class
class PackedWeight:
    """A weight [n, k] (HF's [out, in]) stored as panels [ceil(n / 16), k, 16]: for each input
    feature, 16 consecutive outputs lie side by side (zero rows pad the last panel).

    The native CPU kernel (weld/kernels/cpu/matmul.cc) streams the panels front to back, and
    multiplies each 16-wide weight vector by up to 6 broadcast input rows at once, with no
    horizontal sums. `shape` and `dtype` are the logical [n, k] matrix's; `pack_weight` makes one
    at load time, `linear` takes either form, and indexing gathers rows (a packed tied embedding
    still serves lookups: each element is one strided read, which a decode step's few tokens
    never notice).
    """

    def __init__(self, panels: jax.Array, n: int):
        self.panels, self.n = panels, n

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.panels.shape[1])

    @property
    def dtype(self):
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    def tree_flatten(self):
        return (self.panels,), self.n

    @classmethod
    def tree_unflatten(cls, n, children):
        return cls(children[0], n)

    def __getitem__(self, ids) -> jax.Array:
        """Rows of the [n, k] matrix: an embedding lookup when the packed weight is a tied
        embedding / LM head. ids: an int array; returns ids.shape + (k,)."""
        ids = jnp.asarray(ids)
        return self.panels[ids // PANEL, :, ids % PANEL]

    def unpacked(self) -> jax.Array:
        """The [n, k] matrix."""
        num, k, _ = self.panels.shape
        return jnp.swapaxes(self.panels, 1, 2).reshape(num * PANEL, k)[:self.n]


def unpacked(w: jax.Array | PackedWeight) -> jax.Array:
    """The [n, k] matrix of either form."""
    return w.unpacked() if isinstance(w, PackedWeight) else w


def pack_weight(w: jax.Array) -> PackedWeight:
    n, k = w.shape
    padded = jnp.pad(w, ((0, -n % PANEL), (0, 0)))
    return PackedWeight(jnp.swapaxes(padded.reshape(-1, PANEL, k), 1, 2), n)


def linear(x: jax.Array, w: jax.Array | PackedWeight, b: jax.Array | None = None) -> jax.Array:
    """x @ w.T for w stored [out, in] (the HF / GGUF layout, so loading copies nothing) or packed."""
    rows = math.prod(x.shape[:-1])
    if isinstance(w, PackedWeight):
        x2 = x.reshape(rows, x.shape[-1])
        if x.dtype == w.dtype == jnp.float32 and cpu_kernels.available():
            y = cpu_kernels.packed_matmul(x2, w.panels, w.n)
        else:  # kernels turned off after packing, or another dtype: XLA reads the panels
            y = jnp.einsum("mk,pkj->mpj", x2, w.panels.astype(x.dtype)).reshape(rows, -1)[:, :w.n]
        y = y.reshape(x.shape[:-1] + (w.n,))
    elif _reduce_matmul(rows, x, w):
        # The barrier over (x, w) gives every call its own x: without it XLA merges the
        # broadcasts of an x shared by two projections (q/k/v, gate/up) and materializes
        # an [out, rows, in] tensor, which is ~100x slower.
        xs, ws = jax.lax.optimization_barrier((x.reshape(rows, x.shape[-1]), w))
        y = jnp.sum(ws[:, None, :] * xs[None], axis=-1).T.reshape(x.shape[:-1] + (w.shape[0],))
    else:
        y = jax.lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))
    if b is not None:
        y = y + b.astype(y.dtype)
    return y


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    return linear(jax.nn.silu(linear(x, w_gate)) * linear(x, w_up), w_down)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling. `kind` is one of default, linear, llama3, yarn."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    SUPPORTED = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling,
                  max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim // 2] and the factor applied to cos/sin (yarn's mscale)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = scaling.kind
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        old_ctx = scaling.original_max_position_embeddings or 8192
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        old_ctx = scaling.original_max_position_embeddings or max_position_embeddings
        factor = scaling.factor
        mscale = scaling.attention_factor
        if mscale is None:
            mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

        def correction_dim(num_rotations: float) -> float:
            return (head_dim * math.log(old_ctx / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

        low = correction_dim(scaling.beta_fast)
        high = correction_dim(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv, mscale
    raise ValueError(f"unsupported rope scaling {kind!r}; weld supports {RopeScaling.SUPPORTED}")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, mscale: float) -> jax.Array:
    """Rotates x [b, t, heads, e] by positions [b, t] in HF's rotate-half (NeoX) layout."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [b,t,e/2]
    cos = (jnp.cos(freqs) * mscale)[:, :, None, :]
    sin = (jnp.sin(freqs) * mscale)[:, :, None, :]
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
