"""Shared layers: RMSNorm, linear over plain or packed weights, SwiGLU, GELU.

Einsum letters used everywhere: b batch, t query tokens, s key/value tokens, d model dim,
h query heads, k kv heads, g query heads per kv head, e head dim, f MLP dim, v vocabulary.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from weld.kernels import cpu as cpu_kernels
from weld.models.common import sharding
from weld.models.common.quant import QuantWeight, concat_rows
from weld.models.common.spec import WeightSpec
from weld.utils.errors import InvalidInputError


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, plus_one: bool = False) -> jax.Array:
    """RMSNorm over the last axis, computed in f32.

    Plain (Llama, DeepSeek): cast back to x's dtype, then scaled by weight. plus_one (Gemma,
    Qwen3-Next): scaled by (1 + weight) in f32, then cast; such weights are stored around 0.
    f32 on the CPU with the native kernels: `cpu_kernels.rms_norm` (batch invariant).
    """
    if x.dtype == jnp.float32 and cpu_kernels.available() and sharding.active_mesh() is None:
        # the native kernel: the same result for a row whatever else is in the batch
        y = cpu_kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, plus_one)
        return y.reshape(x.shape).astype(x.dtype)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
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
    rows = sharding.local_rows(rows)  # data-parallel ranks each multiply their own rows
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


def unpacked(w: jax.Array | PackedWeight | QuantWeight) -> jax.Array:
    """The [n, k] matrix of any form."""
    return w.unpacked() if isinstance(w, (PackedWeight, QuantWeight)) else w


def pack_if_f32(w):
    """The packed form of an f32 matrix [n, k] (what the native CPU kernel reads); anything else
    (another dtype, an expert stack, an already packed weight) as it is."""
    if (w is not None and not isinstance(w, (PackedWeight, QuantWeight)) and w.ndim == 2
            and w.dtype == jnp.float32):
        return jax.block_until_ready(pack_weight(w))
    return w


def prepared_matrix(w, target):
    """One matrix [n, k] in the form `target` (a `weld.models.family.WeightTarget`) runs it in:
    packed in panels when f32 on the CPU with the native kernels, else as it is. Quantized
    matrices (`quant.QuantWeight`, made at load: `weld.weights.tree.finished`), packed ones,
    expert stacks and 1-D weights stay as they are."""
    if w is None or isinstance(w, (PackedWeight, QuantWeight)) or w.ndim != 2:
        return w
    return pack_if_f32(w) if target.pack_for_cpu_kernels else w


def prepare_matrices(weights: dict, names: tuple[str, ...], target) -> None:
    """The matrices `names` of a weight dict in `prepared_matrix`'s form for target, in place."""
    for name in names:
        if name in weights:
            weights[name] = prepared_matrix(weights[name], target)


def prepare_head(weights: dict, target) -> None:
    """The LM head in `prepared_matrix`'s form (the tied embedding when there is no lm_head;
    lookups gather its rows from the panels or blocks), in place; an untied input embedding only
    serves lookups and stays as it is."""
    prepare_matrices(weights, ("lm_head",) if "lm_head" in weights else ("embed",), target)


def fuse_gate_up(mlp: dict) -> None:
    """Concatenates a gated MLP's `w_gate` and `w_up` [f, d] into one `w_gate_up` [2 f, d], in
    place (one matmul instead of two; `gated_mlp` takes either form)."""
    if "w_gate" in mlp:
        fused = concat_rows([mlp["w_gate"], mlp["w_up"]])
        if fused is not None:  # matrices of different forms (a GGUF's mixed types) stay apart
            del mlp["w_gate"], mlp["w_up"]
            mlp["w_gate_up"] = fused


def pack_weight(w: jax.Array) -> PackedWeight:
    n, k = w.shape
    padded = jnp.pad(w, ((0, -n % PANEL), (0, 0)))
    return PackedWeight(jnp.swapaxes(padded.reshape(-1, PANEL, k), 1, 2), n)


def linear(x: jax.Array, w: jax.Array | PackedWeight | QuantWeight, b: jax.Array | None = None) -> jax.Array:
    """x @ w.T for w stored [out, in] (the HF / GGUF layout, so loading copies nothing), packed
    in panels, or quantized (`quant.QuantWeight`: in blocks, the native integer kernel on the CPU,
    else dequantized in XLA; per channel, its int8 codes go into the matmul as they are and the
    scales multiply its output, which XLA on GPU and TPU fuses into one int8-weight matmul)."""
    rows = math.prod(x.shape[:-1])
    if isinstance(w, QuantWeight) and w.fmt == "int8_channel":  # int8 codes into the matmul, scales on its output
        y = jax.lax.dot_general(x, w.codes.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        y = (y * w.scales).astype(x.dtype)
    elif isinstance(w, QuantWeight) and w.rows:  # int4 rows: dequantized into the matmul (XLA fuses it)
        y = jax.lax.dot_general(x, w.unpacked().astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))
    elif isinstance(w, QuantWeight):
        x2 = x.reshape(rows, x.shape[-1])
        if cpu_kernels.available() and sharding.active_mesh() is None:
            y = cpu_kernels.quant_matmul(x2, w.codes, w.scales, w.mins, w.n, w.bits, w.offset,
                                         digits=w.activation_digits, sub=w.sub, lut=w.lut,
                                         group=w.group).astype(x.dtype)
        else:
            y = jax.lax.dot_general(x2, w.unpacked().astype(x.dtype), (((1,), (1,)), ((), ())))
        y = y.reshape(x.shape[:-1] + (w.n,))
    elif isinstance(w, PackedWeight):
        x2 = x.reshape(rows, x.shape[-1])
        if x.dtype == w.dtype == jnp.float32 and cpu_kernels.available() and sharding.active_mesh() is None:
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


def gated_mlp_specs(d: int, f: int) -> dict:
    """A gated MLP's matrices [out, in] (what `gated_mlp` reads): w_gate, w_up [f, d], w_down [d, f]."""
    return {"w_gate": WeightSpec((f, d), ("mlp", "embed"), quantize="linear"),
            "w_up": WeightSpec((f, d), ("mlp", "embed"), quantize="linear"),
            "w_down": WeightSpec((d, f), ("embed", "mlp"), quantize="linear")}


def gated_mlp(lw: dict, y: jax.Array, activation=jax.nn.silu) -> jax.Array:
    """down(act(gate y) * up y) of the normed input y, from a fused `w_gate_up` [2 f, d] (gate
    rows, then up rows) or separate `w_gate`, `w_up` [f, d]; `w_down` [d, f]. SwiGLU by default."""
    if "w_gate_up" in lw:
        gate_up = linear(y, lw["w_gate_up"])
        f = gate_up.shape[-1] // 2
        return linear(activation(gate_up[..., :f]) * gate_up[..., f:], lw["w_down"])
    return linear(activation(linear(y, lw["w_gate"])) * linear(y, lw["w_up"]), lw["w_down"])


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`)."""
    return jax.nn.gelu(x, approximate=True)


