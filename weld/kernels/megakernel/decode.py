"""The decode megakernel: a whole dense-decoder step (every layer, the LM head) as one Pallas call.

Covers the dense family's switches (any layer count, GQA, any even head dim, qkv / o biases,
q / k RMSNorm, tied embeddings, rope frequencies given as tables, one per layer kind), Gemma 3's
switches (sandwich norms, GELU-tanh MLP, a scaled embedding, soft-capped logits), B rows of T tokens each
(decode: T = 1; a speculative verify block: T = k + 1 consecutive positions, causal within the
block), f32 / bf16 weights or int8 weights with per-output-channel scales, a paged KV cache of
one [P, page, KV x E] pool pair per attention layer; MoE layers (router in the kernel, only the
chosen experts' tiles streamed), absorbed MLA on latent pages, and linear-attention layers (Gated
DeltaNet, KDA: `linear.py`, each sequence's state read into VMEM and written back in place) in
any hybrid layer schedule; sliding-window layers (Mistral's window, Qwen's and Gemma's sliding
layers), each page group of layers reading its own block table.

One `pallas_call` with no grid:
  - SMEM (scalar prefetch): token ids [N], positions [N] (N = B x T, -1 = padding), block tables
    [B, M], each row's recurrent-state slot [B] (linear layers);
  - VMEM inputs: the small vectors (norms, biases, rope frequencies), held whole, and the N
    tokens' embedding rows (gathered by XLA before the call: a gather reads any layout of the
    table, and TPU keeps a [V, d] table with d off the 128 lanes column-major, which a DMA of
    rows would make XLA copy whole on every call);
  - HBM (`memory_space=pl.ANY`): every weight matrix, the routers and convs (each read whole into VMEM as its layer starts), the KV
    pools and the linear layers' state pools (aliased to outputs: updated in place);
  - outputs: f32 logits [N, V] and greedy ids [N] in VMEM, the pools in HBM.
The weights flow through a ring of VMEM slots on the static schedule of `plan.stream_schedule`
(q, k, v, o, gate, up, down per layer, then the LM head in vocabulary tiles), one DMA semaphore
per slot: before tile n computes, tile n + depth - 1 starts into the slot tile n - 1 freed, so
the stream never stops at a matrix or layer boundary: while layer i's attention runs, layer i's
o-projection tiles are landing; while its down projection computes, layer i+1's first q tiles
are in flight; after the last layer the stream runs on into the LM head. Attention is
`attention.attend_rows` (every live row's KV tiles in one stream through a ring of buffers,
all heads scored against a tile in one product, under an online softmax). The layers are
unrolled in Python: every layer's matrices and pools are their own buffers (the engine's
per-layer layout, so the kernel reads the arrays the XLA path uses, with no stacked copy).

The pure-jnp twin of this kernel is the model's XLA forward (`weld.models.llama.forward`; the
adapter is `weld.models.megakernel`): the tests compare the two. Activations stay in f32; with
bf16 weights the MXU is fed bf16 activations with f32 accumulation.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from weld.kernels.megakernel import collectives, linear
from weld.kernels.megakernel.attention import attend_rows, kv_scratch
from weld.kernels.megakernel.plan import (INT4_GROUP, LANES, MegakernelSpec, Plan, fit_plan,
                                          lane_span, make_plan, pair_row_width, ring_key, ring_width, traced_row_width)

MATRICES = ("q", "k", "v", "o", "gate", "up", "down")  # a dense layer's, in stream order (plan.matrices)
EXPERT_BIASES = ("b_gate", "b_up", "b_down")
LOOP_TILES = 4  # a matrix of this many equal row tiles or more streams them in one loop (`gemv`)  # a sparse layer's expert biases [E, out] (spec.expert_bias)
BUGS = (None, "skip_wait", "wrong_slot", "wrong_expert", "global_expert_ids", "every_pair_computed",
        "full_window") + linear.BUGS[1:]  # planted bugs, for the tests
# the per-layer vectors a spec's switch asks for: (name, the switch)
_OPTIONAL_VECTORS = (("inv_freq", "rope"), ("qkv_bias", "qkv_bias"), ("o_bias", "o_bias"), ("q_norm", "qk_norm"),
                     ("k_norm", "qk_norm"), ("router_bias", "router_bias"), ("shared_expert_gate", "shared_expert_gate"),
                     ("kv_a_norm", "mla"), ("q_a_norm", "q_lora"), ("A_log", "linear_layers"),
                     ("dt_bias", "linear_layers"), ("linear_norm", "linear_layers"),
                     ("post_attn_norm", "sandwich_norms"), ("post_mlp_norm", "sandwich_norms"),
                     ("sinks", "attention_sinks"))
LATENT_NORM_EPS = 1e-6  # MLA's q_a and kv_a norms (transformers hard-codes it)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Matrix:
    """A weight matrix as int8 with one f32 scale per output channel: w = q * scale[:, None]. The
    kernel's view of `weld.models.common.quant.QuantWeight` "int8_channel" (its codes and scales,
    quantized at load; the model adapter wraps them, the kernel computes nothing to make them)."""

    q: jax.Array  # int8 [out, in]
    scale: jax.Array  # f32 [out]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape


@dataclasses.dataclass
class Int4Matrix:
    """A weight matrix as unsigned 4-bit codes with an f32 scale and min per group of
    `plan.INT4_GROUP` inputs and output: w = scale c + min. The kernel's view of
    `weld.models.common.quant.QuantWeight` "int4_g128_rows" (its arrays, as quantized at load):
    byte j of a row holds input j in its low nibble and input j + kp / 2 in its high one (kp: the
    inputs padded to whole groups)."""

    q: jax.Array  # uint8 [..., out, kp / 2]
    scale: jax.Array  # f32 [..., out, kp / 128]
    min: jax.Array  # f32 [..., out, kp / 128]
    k: int  # the inputs (static)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape[:-1]) + (self.k,)


jax.tree_util.register_dataclass(Int4Matrix, data_fields=["q", "scale", "min"], meta_fields=["k"])


def _kind(w) -> str:
    """How a matrix streams: "int8", "int4" or "float" (`MegakernelSpec.kind`)."""
    return "int8" if isinstance(w, Int8Matrix) else "int4" if isinstance(w, Int4Matrix) else "float"


def _unpack_int4(codes, scale, minimum, cols):
    """Codes [rows, kp / 2] (uint8), scale and min [rows, kp / 128] -> f32 [rows, cols]."""
    c = jnp.concatenate([codes & 0x0F, codes >> 4], axis=-1).astype(jnp.float32)  # [rows, kp]
    rows, kp = c.shape
    c = c.reshape(rows, kp // INT4_GROUP, INT4_GROUP)
    return (c * scale[:, :, None] + minimum[:, :, None]).reshape(rows, kp)[:, :cols]


def _lanes_whole(y):
    """y [1, n] widened with zeros to `traced_row_width(n)` columns (y itself when that wide)."""
    extra = traced_row_width(y.shape[-1]) - y.shape[-1]
    return jnp.pad(y, ((0, 0), (0, extra))) if extra else y


def _pad_lanes(x, length: int):
    """x's last dimension zero-padded to `length` (x itself when it is that long already)."""
    extra = length - x.shape[-1]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)]) if extra > 0 else x


def embed_rows(table, tokens, vocab: int, tp_axis=None, tp_size: int = 1):
    """f32 [N, d]: the embedding rows of tokens [B, T] from table [V, d] (under tensor
    parallelism this device's slice of the vocabulary, rows [i V, (i + 1) V): zeros for the
    tokens outside it, which the kernel's all-reduce fills)."""
    ids = tokens.reshape(-1).astype(jnp.int32)
    if tp_size > 1:
        ids = ids - jax.lax.axis_index(tp_axis) * vocab
    rows = jnp.take(table, jnp.clip(ids, 0, vocab - 1), axis=0).astype(jnp.float32)
    return jnp.where(((ids >= 0) & (ids < vocab))[:, None], rows, 0.0) if tp_size > 1 else rows


def _aligned(offset, multiple: int):
    """`offset`, and where it is traced (a loop's tile), Mosaic told it is a multiple of
    `multiple` (a tile of whole heads starts at a multiple of its own heads): without the hint
    Mosaic refuses a dynamic offset it cannot prove aligned."""
    return offset if isinstance(offset, int) else pl.multiple_of(offset, multiple)


def _precision(dtype):
    """A product's precision: f32 operands at full precision (Mosaic's multi-pass f32), narrower
    ones at the MXU's own (Mosaic rejects fp32 contract precision on bf16 operands)."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def tpu_generation(device_kind: str) -> str:
    """The `plan.TPU_GENERATIONS` key of a TPU's `device_kind` ("TPU v5 lite" -> "v5e")."""
    kind = device_kind.lower()
    for pattern, generation in ((r"v5 ?(lite|e)", "v5e"), (r"v6", "v6e"), (r"tpu ?7|v7", "v7")):
        if re.search(pattern, kind):
            return generation
    raise ValueError(f"no VMEM table for TPU {device_kind!r}; pass generation= one of v5e, v6e, v7")


def _vector_names(spec: MegakernelSpec) -> list[str]:
    names = ["attn_norm", "mlp_norm", "final_norm"]
    return names + [name for name, flag in _OPTIONAL_VECTORS if getattr(spec, flag)]


def _validate(spec, params, tokens, positions, block_tables, k_pools, v_pools, linear_states, state_slots):
    b, t = spec.batch, spec.tokens_per_row
    kv, d, e = spec.pool_kv_heads * spec.head_dim, spec.hidden, spec.head_dim
    n_layers, attending = spec.num_layers, spec.attention_layers
    for name, a in (("tokens", tokens), ("positions", positions)):
        if a.shape != (b, t):
            raise ValueError(f"{name} must be [B, T] = {(b, t)} (spec.batch, spec.tokens_per_row), got {a.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.shape[1] % spec.page_groups:
        raise ValueError(f"block_tables must be [B, page_groups x max_pages] with B = {b} and {spec.page_groups} "
                         f"page groups, got {block_tables.shape}")
    if state_slots is not None and tuple(state_slots.shape) != (b,):
        raise ValueError(f"state_slots must be [B] = {(b,)}, got {tuple(state_slots.shape)}")
    if spec.mla != (v_pools is None):
        raise ValueError("MLA attends over one latent pool per layer (v_pools None); GQA needs K and V pools")
    v_pools = k_pools if v_pools is None else v_pools
    if len(params["layers"]) != n_layers or len(k_pools) != len(attending) or len(v_pools) != len(attending):
        raise ValueError(f"spec.num_layers is {n_layers} with {len(attending)} attention layers, but got "
                         f"{len(params['layers'])} weight layers, {len(k_pools)} K pools and {len(v_pools)} V pools")
    pool_shape = (spec.page_size, kv)  # a page group's pools may hold their own number of pages
    for i, (kp, vp) in zip(attending, zip(k_pools, v_pools)):
        if kp.shape[1:] != pool_shape or vp.shape != kp.shape:
            raise ValueError(f"pools of layer {i} must be [P, page, KV x E] = [P, *{pool_shape}], got {kp.shape} and "
                             f"{vp.shape}")
    linear_states = linear_states or []
    if len(linear_states) != len(spec.linear_layers):
        raise ValueError(f"{len(spec.linear_layers)} linear layers need as many (window, state) pool pairs, "
                         f"got {len(linear_states)}")
    if linear_states:
        slots = linear_states[0][0].shape[0]
        shapes = ((slots, spec.conv_channels, spec.conv_width - 1),
                  (slots, spec.linear_v_heads, spec.linear_k_dim, spec.linear_v_dim))
        for i, pair in zip(spec.linear_layers, linear_states):
            if tuple(tuple(a.shape) for a in pair) != shapes or any(a.dtype != jnp.float32 for a in pair):
                raise ValueError(f"the state pools of layer {i} must be f32 [slots, C, K - 1], [slots, Hv, dk, dv] = "
                                 f"{shapes}, got {[(tuple(a.shape), str(a.dtype)) for a in pair]}")
    vd = spec.linear_value_dim
    expected = {"embed": (spec.vocab, d), "lm_head": (spec.vocab, d), "attn_norm": (n_layers, d),
                "mlp_norm": (n_layers, d), "final_norm": (d,), "inv_freq": (spec.rope_tables, spec.rope_dims // 2),
                "post_attn_norm": (n_layers, d), "post_mlp_norm": (n_layers, d), "sinks": (n_layers, spec.num_heads),
                "qkv_bias": (n_layers, spec.q_proj_dim + 2 * kv), "o_bias": (n_layers, d), "q_norm": (n_layers, e),
                "k_norm": (n_layers, e), "router_bias": (n_layers, spec.num_experts),
                "shared_expert_gate": (n_layers, d), "kv_a_norm": (n_layers, spec.kv_lora_rank),
                "q_a_norm": (n_layers, spec.q_lora_rank), "A_log": (n_layers, spec.linear_v_heads),
                "dt_bias": (n_layers, vd if spec.linear_kind == "kda" else spec.linear_v_heads),
                "linear_norm": (n_layers, spec.linear_v_dim)}
    for name in ["embed", "lm_head"] + _vector_names(spec):
        if name not in params:
            raise ValueError(f"params has no {name!r} (the spec's switches need it)")
        if tuple(params[name].shape) != expected[name]:
            raise ValueError(f"params[{name!r}] must be {expected[name]}, got {tuple(params[name].shape)}")
    int8 = isinstance(params["lm_head"], Int8Matrix)
    if int8 != bool(spec.scale_bytes):
        raise ValueError(f"the LM head is {'int8' if int8 else 'float'} but spec.scale_bytes is {spec.scale_bytes} "
                         "(int8 models stream per-channel scales)")
    for i, layer in enumerate(params["layers"]):
        shapes = {name: (rows, cols) for name, rows, cols in spec.matrices(i)}
        if i in spec.sparse_layers:  # the routed experts' stacks [E, out, in] and the router [E, d]
            shapes.update({name: (spec.num_experts, rows, cols) for name, rows, cols in spec.expert_matrices()})
        side = {"router": (spec.num_experts, d)} if i in spec.sparse_layers else {}
        if i in spec.sparse_layers and spec.expert_bias:
            side.update(b_gate=(spec.num_experts, spec.expert_intermediate),
                        b_up=(spec.num_experts, spec.expert_intermediate), b_down=(spec.num_experts, d))
        if i in spec.linear_layers:
            side["conv"] = (spec.conv_channels, spec.conv_width)
        for name, shape in side.items():
            a = layer.get(name)
            if a is None or tuple(a.shape) != shape:
                raise ValueError(f"layers[{i}][{name!r}] must be {shape}, got {None if a is None else tuple(a.shape)}")
        for name, shape in shapes.items():
            w = layer.get(name)
            if w is None or tuple(w.shape) != shape:
                axes = "[experts, out, in]" if len(shape) == 3 else "[out, in]"
                raise ValueError(f"layers[{i}][{name!r}] must be {axes} = {shape}, "
                                 f"got {None if w is None else tuple(w.shape)}")
            want = spec.kind(name, expert=len(shape) == 3)
            if _kind(w) != want:
                raise ValueError(f"layers[{i}][{name!r}] is {_kind(w)}, but the spec streams it as {want} "
                                 f"(float_matrices {spec.float_matrices}, int8 model: {int8}, "
                                 f"int4 experts: {spec.int4_experts})")


def decode_step(spec: MegakernelSpec, params: dict, tokens, positions, block_tables, k_pools, v_pools, *,
                linear_states=None, state_slots=None, tile_rows: int = 256, vocab_tile_rows: int = 256,
                ring_depth: int = 4, generation: str | None = None, interpret=False, route=None,
                capture_layers: tuple[int, ...] = (), tp_axis: str | None = None, tp_size: int = 1,
                dp_axis: str | None = None, _bug: str | None = None):
    """One call of the megakernel.

    spec: the model's shapes and switches, `batch` = B rows of `tokens_per_row` = T tokens.
    params: "embed" [V, d] (the N tokens' rows gathered before the call), "lm_head" [V, d] (the embedding itself
      when tied), "layers": L dicts of MATRICES, each [out, in] or an `Int8Matrix` (all or none,
      the LM head too),
      "attn_norm" / "mlp_norm" [L, d], "final_norm" [d], "inv_freq" [spec.rope_tables, rope dims /
      2] (the model's rope tables, f32, `spec.layer_rope` says which layer uses which; not with
      spec.rope False), and per the spec's switches "qkv_bias" [L, q + 2 kv], "o_bias" [L, d],
      "q_norm" / "k_norm" [L, E], "post_attn_norm" / "post_mlp_norm" [L, d] (sandwich norms). A sparse layer (`spec.sparse_layers`) has, in place of gate,
      up and down, the expert stacks "gate", "up" [E, I, d] and "down" [E, d, I] (float or
      `Int8Matrix` of [E, out, in] codes and [E, out] scales), the "router" [E, d] (any float
      dtype; scores in f32), and with a shared expert "shared_gate", "shared_up", "shared_down";
      per the spec's switches the vectors "router_bias" [L, E] and "shared_expert_gate" [L, d],
      and with expert biases "b_gate", "b_up" [E, I] and "b_down" [E, d] (HBM; each routed pair's
      rows fetched by DMA once the layer is routed); "sinks" [L, H] (attention sinks).
    route: with sparse layers, the model's routing rule: (scores f32 [N, E], bias f32 [1, E] or
      None) -> (weights f32 [N, top_k], expert ids int32 [N, top_k]), traced inside the kernel.
    capture_layers: layers whose output hidden states (the residual stream after the layer)
      are returned, f32 [B, T, d] each (a drafter's features).
    tokens, positions: int32 [B, T] (position -1: padding; a row is padding when its first is).
    block_tables: int32 [B, page_groups x M] (`spec.layer_groups` says which table a layer reads;
      a layer with a window (`spec.layer_windows`) reads only the pages its window spans). k_pools, v_pools: one array [P, page, KV x E] per attention layer
      (`spec.attention_layers`), updated in place (MLA: k_pools are the latent pools [P, page,
      kv_lora_rank + rope_dim], v_pools None).
      An MLA layer has "q" (or "q_a", "q_b"), "kv_a", "w_uk" [heads x nope, latent], "w_uv"
      [heads x v, latent] and "o", and the vectors "kv_a_norm" [L, latent] ("q_a_norm" [L, q_lora]).
      A linear layer (`spec.linear_layers`) has the matrices of `spec.linear_matrices()` and its
      conv "conv" [C, K] (read whole into VMEM); the vectors "A_log" [L, Hv], "dt_bias" [L, Hv]
      (KDA: [L, Hv dk]) and "linear_norm" [L, dv] (zeros for the other layers).
    linear_states: per linear layer, its pools (conv windows f32 [S, C, K - 1], states f32 [S, Hv,
      dk, dv]), updated in place. state_slots: int32 [B], each row's slot (-1: none; None: row i
      uses slot i).
    generation: a TPU generation whose VMEM budget the plan must fit (the ring shrinks to fit,
      else `plan.VmemBudgetError`); None: detected on a TPU, not checked in interpret mode.
    interpret: False on a TPU; a `pltpu.InterpretParams` (or True) to run on CPU.
    tp_axis, tp_size: tensor parallelism (called inside `jax.shard_map` over tp_axis, of tp_size
      devices): spec, params and pools are this device's shard (its heads, its slice of every
      MLP's and expert's intermediate, its slice of the vocabulary: "embed" and "lm_head" hold
      rows [i V / tp, (i + 1) V / tp)); the kernel all-reduces by remote DMA
      (`collectives.all_reduce_rows`) the embedding rows, and the partial outputs of every
      attention's o projection and every MLP (experts and shared expert included), and returns
      this device's slice of the logits (the greedy ids are then the slice's).
    dp_axis: with `spec.moe_ranks` > 1 (the experts split over that many data-parallel ranks as
      well), the ranks' mesh axis: a sparse layer gathers every rank's normed rows (an all-reduce
      of zero-padded blocks over dp_axis), routes them all, computes the pairs whose expert this
      device holds, and one all-reduce over the ranks and the tensor devices sums the experts'
      outputs with each rank's shared expert; each rank keeps its own rows.
    Returns (logits f32 [B, T, V], greedy ids int32 [B, T], k_pools, v_pools, hidden states: one
    f32 [B, T, d] per capture layer, in their order, linear_states).
    """
    _validate(spec, params, tokens, positions, block_tables, k_pools, v_pools, linear_states, state_slots)
    if _bug not in BUGS:
        raise ValueError(f"_bug must be one of {BUGS}, got {_bug!r}")
    if spec.sparse_layers and route is None:
        raise ValueError("a spec with sparse layers needs route= (the model's routing rule)")
    capture_layers = tuple(capture_layers)
    if any(not 0 <= c < spec.num_layers for c in capture_layers):
        raise ValueError(f"capture_layers {capture_layers} must lie in [0, {spec.num_layers})")
    if generation is None and not interpret:
        generation = tpu_generation(jax.devices()[0].device_kind)
    plan: Plan = (fit_plan(spec, generation, ring_depth=ring_depth, tile_rows=tile_rows, vocab_tile_rows=vocab_tile_rows)
                  if generation else
                  make_plan(spec, ring_depth=ring_depth, tile_rows=tile_rows, vocab_tile_rows=vocab_tile_rows))
    depth, tiles = plan.ring_depth, plan.tiles
    # what the MXU takes beside int8 codes: the model's float type (bf16 models: one bf16 pass
    # with f32 accumulation; f32 ones: f32 at full precision)
    mxu_dtype = jnp.bfloat16 if params["embed"].dtype == jnp.bfloat16 else jnp.float32
    b, t, n_tok = spec.batch, spec.tokens_per_row, spec.tokens
    h, kvh, e, d, n_layers = spec.num_heads, spec.pool_kv_heads, spec.head_dim, spec.hidden, spec.num_layers
    q_dim, kv_dim = h * e, kvh * e  # attention's query width; the new K (MLA: c_kv | k_pe) per token
    q_proj = spec.q_proj_dim  # the query projection's width
    attending, lin_layers = spec.attention_layers, spec.linear_layers
    pool_of = {layer: j for j, layer in enumerate(attending)}  # an attention layer's pools
    state_of = {layer: j for j, layer in enumerate(lin_layers)}  # a linear layer's state pools
    n_attn = len(attending)
    pool_list = list(k_pools) + ([] if spec.mla else list(v_pools))
    # (window, state) per linear layer; the windows as the kernel takes them, [K - 1, S, C] (`linear`)
    pool_list += [a for window, state in (linear_states or []) for a in (jnp.transpose(window, (2, 0, 1)), state)]
    n_pools = len(pool_list)
    if state_slots is None:
        state_slots = jnp.arange(b, dtype=jnp.int32)

    # HBM matrices in one list, indexed by (layer, name); the LM head is (-1, "lm_head").
    matrices, index = [], {}
    for i, layer in enumerate(params["layers"]):
        names = [name for name, _, _ in spec.matrices(i)]
        if i in spec.sparse_layers:
            names += [name for name, _, _ in spec.expert_matrices()]
        for name in names:
            index[(i, name)] = len(matrices)
            matrices.append(layer[name])
    index[(-1, "lm_head")] = len(matrices)
    matrices.append(params["lm_head"])
    kind_of = [_kind(m) for m in matrices]  # per matrix: "int8", "int4" or "float"
    int8 = "int8" in kind_of
    # a matrix TPU keeps column-major streams from its transpose [.., in, out] (`plan.stored_transposed`:
    # for XLA the same bytes, no copy)
    transposed_of = {index[(x.layer, x.matrix)]: x.transposed for x in tiles}
    weight_ops = [m if k == "float" else m.q for m, k in zip(matrices, kind_of)]
    weight_ops = [jnp.swapaxes(w, -1, -2) if transposed_of.get(m) else w for m, w in enumerate(weight_ops)]
    # int8: scales [1, out], or an expert stack's [E, 1, out] (a tile's scales are one row of them);
    # int4: scales and mins [out, groups] ([E, out, groups]), a tile's are its rows of them
    scale_of = {m: j for j, m in enumerate(i for i, k in enumerate(kind_of) if k == "int8")}  # matrix -> its scales
    # a tile's scales move in whole lane tiles (`lane_span`): a matrix with a tile of other than
    # whole ones (SmolLM2's 576 rows: 256, 256, 64) has its scales padded for the last one's reach
    ragged = {index[(x.layer, x.matrix)] for x in tiles if x.rows % LANES}

    def pair_width(name: str, width: int) -> int:  # a routed pair's buffer (`plan.pair_row_width`)
        return pair_row_width(tiles, name, width)

    scale_ops = [_pad_lanes(matrices[m].scale.astype(jnp.float32).reshape(matrices[m].scale.shape[:-1] + (1, -1)),
                            lane_span(matrices[m].scale.shape[-1]) + LANES if m in ragged else 0)
                 for m in scale_of]
    group_of = {m: j for j, m in enumerate(i for i, k in enumerate(kind_of) if k == "int4")}  # -> its (scale, min)
    group_ops = [a.astype(jnp.float32) for m in group_of for a in (matrices[m].scale, matrices[m].min)]
    # One ring of VMEM slots per weight kind present, slot for slot: tile i uses slot i % depth of
    # its kind's ring; each ring's slot fits that kind's tallest tile and widest row (and a ring
    # per width off the lane tiles: `plan.ring_key`).
    ring_of = {}  # (layer, matrix) -> its ring's key
    for x in tiles:
        ring_of[(x.layer, x.matrix)] = ring_key(kind_of[index[(x.layer, x.matrix)]], x.cols,
                                                spec.head_rows(x.matrix) > 1, x.transposed)
    keys = sorted(set(ring_of.values()), key=lambda key: (("int8", "int4", "float").index(key[0]), key[2], key[1]))
    kinds = {key[0] for key in keys}
    float_dtypes = {w.dtype for w, k in zip(weight_ops, kind_of) if k == "float"}
    if len(float_dtypes) > 1:
        raise ValueError(f"the float matrices must share one dtype, got {sorted(map(str, float_dtypes))}")
    ring_rows, ring_cols = {}, {}  # per ring, and per kind (the scale and group rings: the kind's tallest)
    for key in keys:
        kept = [x for x in tiles if ring_of[(x.layer, x.matrix)] == key]
        ring_rows[key] = max(x.rows for x in kept)
        ring_cols[key] = max(ring_width(key[0], x.cols) for x in kept)
    for kind in kinds:
        ring_rows[kind] = max(ring_rows[key] for key in keys if key[0] == kind)
        ring_cols[kind] = max(ring_cols[key] for key in keys if key[0] == kind)
    ring_dtypes = {"int8": jnp.int8, "int4": jnp.uint8, "float": next(iter(float_dtypes), jnp.float32)}
    sparse = spec.sparse_layers
    routers = [params["layers"][i]["router"] for i in sparse]  # HBM [E, d], read whole once per layer
    # HBM f32 [E, I], [E, I], [E, d] per sparse layer: the experts' biases, each pair's rows fetched
    # (a row as wide as one stored at a traced row, `traced_row_width`: gpt-oss's 2,880 padded to 2,944)
    biases = [_pad_lanes(params["layers"][i][name].astype(jnp.float32),
                         traced_row_width(params["layers"][i][name].shape[-1]))
              for i in sparse for name in EXPERT_BIASES] if spec.expert_bias else []
    convs = [params["layers"][i]["conv"] for i in lin_layers]  # HBM [C, K], read whole once per layer
    n_pairs, top_k = spec.pairs, spec.top_k
    vector_names = _vector_names(spec)
    vectors = [params[name].astype(jnp.float32).reshape(-1, params[name].shape[-1]) for name in vector_names]
    kv_dtype = k_pools[0].dtype if k_pools else jnp.float32
    n_vec, n_mat, n_scale, n_router, n_conv = len(vectors), len(weight_ops), len(scale_ops), len(routers), len(convs)
    n_group, n_bias = len(group_ops), len(biases)
    n_cap = len(capture_layers)
    if _bug is not None and _bug in linear.BUGS and not lin_layers:
        raise ValueError(f"_bug {_bug!r} needs linear layers")
    if tp_size > 1 and tp_axis is None:
        raise ValueError("the tensor-parallel megakernel runs inside shard_map over tp_axis")
    shards = spec.expert_shards if sparse else 1  # expert parallelism: this device's experts are one shard
    ranks = spec.moe_ranks if sparse else 1  # the experts over data-parallel ranks too
    if ranks > 1 and dp_axis is None:
        raise ValueError(f"experts over {ranks} data-parallel ranks need dp_axis")
    if shards > 1 and (tp_size % (shards // ranks) or tp_axis is None):
        raise ValueError(f"{shards // ranks} expert shards must divide the {tp_size} tensor-parallel devices")
    n_moe = n_tok * ranks  # the rows a sparse layer routes
    everyone = ((dp_axis,) + (tp_axis if isinstance(tp_axis, tuple) else (tp_axis,))) if ranks > 1 else tp_axis
    group = tp_size * ranks  # the devices that hold the experts
    gather_rows = n_moe + (1 if spec.router_bias else 0)  # the router scores gathered over the shards (and bias)
    table_width = block_tables.shape[1] // spec.page_groups  # each page group's table, side by side
    if spec.kv_pool_heads and tp_size == 1:
        raise ValueError("kv_pool_heads (whole KV heads on every device) is a tensor-parallel layout: give tp_axis")
    n_reduce_scratch = len(collectives.all_reduce_scratch(n_tok, d, tp_size)) if tp_size > 1 else 0
    n_gather_scratch = len(collectives.all_reduce_scratch(gather_rows, spec.routed_experts, group)) if shards > 1 else 0
    n_rank_scratch = len(collectives.all_reduce_scratch(n_moe, d, ranks)) if ranks > 1 else 0
    n_combine_scratch = len(collectives.all_reduce_scratch(n_moe, d, group)) if ranks > 1 else 0
    if spec.expert_activation == "clamped_swiglu":  # gpt-oss
        def expert_activation(gate, up):
            gate = jnp.minimum(gate, spec.swiglu_limit)
            up = jnp.clip(up, -spec.swiglu_limit, spec.swiglu_limit)
            return (up + 1) * (gate * jax.nn.sigmoid(spec.swiglu_alpha * gate))
    else:
        def expert_activation(gate, up):
            return jax.nn.silu(gate) * up
    if spec.mlp_activation == "gelu_tanh":
        activation = functools.partial(jax.nn.gelu, approximate=True)
    else:
        activation = jax.nn.silu

    def kernel(tok_ref, pos_ref, bt_ref, slot_ref, *refs):
        refs = list(refs)

        def take(count):
            taken, refs[:count] = refs[:count], []
            return taken

        # inputs
        vec = dict(zip(vector_names, take(n_vec)))  # VMEM, f32 [L or 1, width]
        (embed_ref,) = take(1)  # VMEM [N, d] f32: the tokens' embedding rows (zeros off this device's slice)
        w_refs = take(n_mat)  # HBM [out, in] each (an expert stack: [E, out, in])
        s_refs = take(n_scale)  # HBM [1, out] each, [E, 1, out] for a stack (int8 only)
        g_refs = take(n_group)  # HBM (scales, mins) [.., out, groups] of each int4 matrix
        router_refs = dict(zip(sparse, take(n_router)))  # HBM [E, d] per sparse layer
        bias_refs = {layer: take(3) for layer in sparse} if n_bias else {}  # HBM (gate, up, down) biases
        conv_refs = dict(zip(lin_layers, take(n_conv)))  # HBM [C, K] per linear layer
        take(n_pools)  # the input pools: aliased, use the outputs
        # outputs
        logits_ref, ids_ref = take(2)  # VMEM [N, V] f32, [N, 1] int32
        k_out = take(n_attn)  # HBM pools [P, page, KV x E] per attention layer
        v_out = [None] * n_attn if spec.mla else take(n_attn)  # MLA: the values are the latent keys
        state_out = [take(2) for _ in lin_layers]  # HBM (windows, states) per linear layer
        cap_refs = take(n_cap)  # VMEM [N, d] f32 per capture layer
        # scratch (see scratch_shapes)
        rings = dict(zip(keys, take(len(keys))))  # the weight rings (`plan.ring_key`)
        ring_sems, x_ref, delta_ref, qa_ref, ka_ref, va_ref = take(6)
        q_heads, kn_ref, vn_ref, att_ref, gate_ref, up_ref = take(6)
        attn_scratch = take(5)
        scale_ring = take(1)[0] if int8 else None
        group_rings = take(2) if "int4" in kinds else None  # int4 tiles' scales and mins
        if spec.mla:
            ov_ref, qlo_ref = take(2) if spec.q_lora else (take(1)[0], None)
        if sparse:
            (router_buf, router_sem, scores_ref, choice_ref, weight_ref, chosen, chosen_sem, eg_ref, eu_ref, pair_x,
             routed_ref) = take(11)
            pair_bias = take(4) if n_bias else None  # each pair's gate, up, down bias rows; their semaphore
            sg_ref, su_ref = take(2) if spec.shared_intermediate else (None, None)
        lin = dict(zip(linear.SCRATCH, take(len(linear.SCRATCH)))) if lin_layers else None
        # the summed rows and `collectives.all_reduce_scratch`; the scores' rows in and out and theirs
        reduce_scratch = take(1 + n_reduce_scratch) if tp_size > 1 else None
        gather_scratch = take(2 + n_gather_scratch) if shards > 1 else None
        # experts over the ranks: every rank's rows gathered (in, out, scratch), the routed outputs
        # and their sum over every device (in, out, scratch)
        rank_scratch = take(2 + n_rank_scratch) if ranks > 1 else None
        combine_scratch = take(2 + n_combine_scratch) if ranks > 1 else None
        # three groups of devices talk (a rank's tensor devices, the ranks, all of them): a barrier
        # semaphore of each, after one barrier of every device on the kernel's own
        group_sems = dict(zip(("tensor", "ranks", "all"), take(3))) if ranks > 1 else {}

        def expert_shard():
            """(this device's expert shard, whether it leads the shard's devices): the tensor devices
            are shard-major (`sharding.RULES`: experts over "ep", then each expert's FFN over "tp")."""
            me = jax.lax.axis_index(tp_axis)
            local = shards // ranks  # a rank's shards (its "ep" devices)
            per = tp_size // local
            rank = jax.lax.axis_index(dp_axis) if ranks > 1 else 0  # experts over ("dp", "ep"): rank-major
            return rank * local + me // per, me % per == 0

        def is_local(expert):
            """Whether this device holds the routed expert `expert` (a global id), and its local index."""
            if shards == 1:
                return None, expert
            first = expert_shard()[0] * spec.num_experts
            index = expert if _bug == "global_expert_ids" else expert - first
            return (expert >= first) & (expert < first + spec.num_experts), jnp.clip(index, 0, spec.num_experts - 1)

        def residual_add(post_norm=None, summed=False):
            """x += this layer part's output: with tensor parallelism, the sum of every device's
            partial output (an all-reduce by remote DMA; `summed`: already made); with sandwich
            norms, normed by the [1, d] weight `post_norm` (after the sum: the norm is not linear)."""
            if reduce_scratch is None or summed:
                out = delta_ref[...]
            else:
                reduced, *scratch_ = reduce_scratch
                collectives.all_reduce_rows(delta_ref, reduced, *scratch_, axis=tp_axis, devices=tp_size,
                                            barrier_semaphore=group_sems.get("tensor"))
                out = reduced[...]
            if post_norm is not None:
                out = rms_norm(out, post_norm)
            x_ref[...] = x_ref[...] + out

        def pair_expert(pair):
            """A routed pair's expert (pair: an int or traced): (whether this device holds it, None
            when every device does; its local index), read from SMEM since routing. (None, None)
            for a static tile's pair -1."""
            if isinstance(pair, int) and pair < 0:
                return None, None
            expert = chosen[pair // top_k, pair % top_k]
            if _bug == "wrong_expert":
                expert = (expert + 1) % spec.routed_experts
            return is_local(expert)

        def tile_copies(i):
            return tile_dmas(tiles[i], i % depth, tiles[i].pair)

        def tile_dmas(tile, slot, pair, row_start=None):
            """The DMAs of `tile` into ring slot `slot`, reading pair `pair`'s expert (for a routed
            expert's tile: `tile` is then any pair's tile of that place), or rows from `row_start`
            (a tile as tall as `tile`; None: the tile's own); pair, slot and row_start may be
            traced. Also whether this device holds that expert."""
            m, rows = index[(tile.layer, tile.matrix)], pl.ds(0, tile.rows)
            first = tile.row_start if row_start is None else row_start
            kind = kind_of[m]
            src_w = w_refs[m]
            src_s = s_refs[scale_of[m]] if kind == "int8" else None
            src_g = [g_refs[2 * group_of[m]], g_refs[2 * group_of[m] + 1]] if kind == "int4" else []
            held, expert = pair_expert(pair)
            if tile.pair >= 0:
                src_w = src_w.at[expert]
                src_s = src_s.at[expert] if src_s is not None else None
                src_g = [g.at[expert] for g in src_g]
            ring = rings[ring_of[(tile.layer, tile.matrix)]]
            if tile.transposed:  # columns [first, first + rows) of the transpose [in, out]
                copies = [pltpu.make_async_copy(src_w.at[:, pl.ds(first, tile.rows)],
                                                ring.at[slot, pl.ds(0, tile.cols), rows], ring_sems.at[slot])]
            else:
                width = src_w.shape[-1]  # int4: the packed bytes of a row
                copies = [pltpu.make_async_copy(src_w.at[pl.ds(first, tile.rows)], ring.at[slot, rows, pl.ds(0, width)],
                                                ring_sems.at[slot])]
            if src_s is not None:  # the tile's scales ride on the same semaphore, in whole lane tiles
                span = pl.ds(0, lane_span(tile.rows))
                copies.append(pltpu.make_async_copy(src_s.at[pl.ds(0, 1), pl.ds(first, span.size)],
                                                    scale_ring.at[slot, pl.ds(0, 1), span], ring_sems.at[slot]))
            for src, ring in zip(src_g, group_rings or []):  # and the int4 tile's scales and mins
                copies.append(pltpu.make_async_copy(src.at[pl.ds(first, tile.rows)],
                                                    ring.at[slot, rows, pl.ds(0, src.shape[-1])], ring_sems.at[slot]))
            return copies, held

        def copies_do(i, op, dmas=None):
            """Starts ("start") or waits for ("wait") tile i's DMAs (or `dmas`, `tile_dmas`' result);
            an expert another device holds is not fetched (its pair's product is then dropped,
            `sparse_mlp`)."""
            copies, held = tile_copies(i) if dmas is None else dmas

            def do():
                for c in copies:
                    getattr(c, op)()
            if held is None:
                do()
            else:
                pl.when(held)(do)

        # Trace-time bookkeeping of the stream: `cursor` is the next tile to compute, `started` the
        # next tile to start. Tiles start in order, at most depth - 1 ahead of the one computing
        # (tile j reuses the slot of tile j - depth, which must have computed); a routed expert's
        # tile cannot start before its layer is routed, so the stream waits there until `routed`.
        cursor, started, routed = [0], [0], set()

        def pump():
            limit = min(cursor[0] + depth, len(tiles))  # tile j may start once tile j - depth has computed
            while started[0] < limit:
                tile = tiles[started[0]]
                if tile.pair >= 0 and tile.layer not in routed:
                    return
                copies_do(started[0], "start")
                started[0] += 1

        def compute_tile(tile, slot, pair, x, write, compute=None, row_start=None):
            """write(first_row, rows, y) of x [rows, in] f32 @ the tile's rows^T, from ring slot
            `slot` (for a routed expert's tile, pair `pair`'s: made only where this device holds
            its expert; first_row: `row_start` when given, as in `tile_dmas`). compute(w [tile
            rows, in] f32, tile, first_row) replaces the product (MLA's per-head forms)."""
            kind = kind_of[index[(tile.layer, tile.matrix)]]
            first_row = tile.row_start if row_start is None else row_start

            def product():
                if kind == "int4":  # unpacked and dequantized in VMEM: f32 [rows, in]
                    groups = -(-tile.cols // INT4_GROUP)
                    w = _unpack_int4(rings[ring_of[(tile.layer, tile.matrix)]][slot, :tile.rows, :groups * INT4_GROUP // 2],
                                     *(ring[slot, :tile.rows, :groups] for ring in group_rings), tile.cols)
                elif tile.transposed:
                    w = rings[ring_of[(tile.layer, tile.matrix)]][slot, :tile.cols, :tile.rows]  # [in, rows]
                else:
                    w = rings[ring_of[(tile.layer, tile.matrix)]][slot, :tile.rows, :tile.cols]  # [rows, in]
                if compute is not None:  # per-row scales applied to the weights first
                    w = w.astype(jnp.float32)
                    y = compute(w * scale_ring[slot, 0, :tile.rows][:, None] if kind == "int8" else w, tile, first_row)
                else:
                    if kind == "int8":  # the codes are exact in the model's float type
                        w = w.astype(mxu_dtype)
                    lhs = x.astype(w.dtype) if kind == "float" else x.astype(mxu_dtype)
                    contract = 0 if tile.transposed else 1
                    y = jax.lax.dot_general(lhs, w, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32,
                                            precision=_precision(lhs.dtype))  # [N, rows]
                    if kind == "int8":
                        y = y * scale_ring[slot, :, :tile.rows]  # [1, rows]
                write(first_row, tile.rows, y)

            held = pair_expert(pair)[0]
            if held is None or _bug == "every_pair_computed":
                product()
            else:  # an expert another device holds: its tile was never fetched, its product is not made
                pl.when(held)(product)

        def stream_loop(count, per, dmas, body):
            """The next count x per tiles of the schedule as `count` alike units of `per` tiles (a
            routed pair's expert tiles; a matrix's equal row tiles), one `fori_loop` over the units,
            so the program does not grow with them. dmas(u, j, slot): unit u's tile j's DMAs into
            ring slot `slot` (`tile_dmas`); body(u, run) computes unit u (traced), run(j, fn) doing
            its tile j: it starts tile i + depth - 1 as `pump` would (a later unit's, or past the
            last unit the static tiles that follow, `pl.when` on u picking which), waits for tile j
            and calls fn(slot). The ring slot of a tile is then dynamic."""
            pump()
            base = cursor[0]
            end = base + count * per
            stop = end  # the first tile past the loop that may not start inside it (an unrouted pair's)
            while stop < len(tiles) and not (tiles[stop].pair >= 0 and tiles[stop].layer not in routed):
                stop += 1
            begun = started[0]  # tiles before this one are in flight already

            def run(u, j, fn):
                i = base + u * per + j
                a = i + depth - 1
                lead, offset = divmod(j + depth - 1, per)  # tile a is unit u + lead's tile `offset`
                pl.when((u + lead < count) & (a >= begun))(
                    lambda: copies_do(None, "start", dmas(u + lead, offset, a % depth)))
                for q in range(max(0, lead - count), lead):  # past the last unit: static tile end + q per + offset
                    if end + q * per + offset < stop:
                        pl.when((u == count - lead + q) & (a >= begun))(
                            lambda q=q: copies_do(end + q * per + offset, "start"))
                if _bug != "skip_wait":
                    copies_do(None, "wait", dmas(u, j, i % depth))
                fn((i + 1) % depth if _bug == "wrong_slot" else i % depth)

            jax.lax.fori_loop(0, count, lambda u, carry: body(u, functools.partial(run, u)) or carry, None)
            cursor[0] = end
            started[0] = max(begun, min(end + depth - 1, stop))

        def gemv(layer, name, x, write, compute=None):
            """A static matrix: x [rows, in] f32 @ the matrix^T, tile by tile (`compute_tile`); its
            run of equal tiles as one `stream_loop` when there are LOOP_TILES or more of them."""
            first = last = cursor[0]
            while last < len(tiles) and tiles[last].key == (layer, name, -1):
                last += 1
            if last == first:
                raise AssertionError(f"schedule out of order: wanted {(layer, name)}, next tile is {tiles[first]}")
            head = tiles[first]
            equal = next((i for i in range(first, last) if tiles[i].rows != head.rows), last) - first
            if equal >= LOOP_TILES:
                def rows_of(u):
                    return pl.multiple_of(head.row_start + u * head.rows, head.rows)

                stream_loop(equal, 1, lambda u, j, slot: tile_dmas(head, slot, -1, rows_of(u)),
                            lambda u, run: run(0, lambda slot: compute_tile(head, slot, -1, x, write, compute,
                                                                              row_start=rows_of(u))))
            for i in range(cursor[0], last):
                pump()  # starts up to tile i + depth - 1 (into the slot tile i - 1 freed)
                if _bug != "skip_wait":
                    copies_do(i, "wait")
                compute_tile(tiles[i], (i + 1) % depth if _bug == "wrong_slot" else i % depth, -1, x, write, compute)
                cursor[0] = i + 1

        def routed_pairs(layer, body):
            """The routed pairs' expert tiles of `layer`, as one `stream_loop` over the pairs (the
            tiles of a pair are alike for every pair, `plan.stream_schedule`, only the expert
            differs: read from SMEM). body(pair, run) computes pair `pair` (traced); run(name, x,
            write) streams the pair's tiles of matrix `name` through `compute_tile`."""
            base = cursor[0]
            per = 0  # tiles per pair
            while base + per < len(tiles) and tiles[base + per].layer == layer and tiles[base + per].pair == 0:
                per += 1
            template = tiles[base:base + per]
            if not template:
                raise AssertionError(f"schedule out of order: wanted layer {layer}'s routed pairs, next tile is "
                                     f"{tiles[base]}")
            first = {}
            for j, t in enumerate(template):
                first.setdefault(t.matrix, j)

            def unit(pair, run_tile):
                def run(name, x, write):
                    j = first[name]
                    while j < per and template[j].matrix == name:
                        run_tile(j, lambda slot, j=j: compute_tile(template[j], slot, pair, x, write))
                        j += 1
                body(pair, run)

            stream_loop(n_pairs, per, lambda pair, j, slot: tile_dmas(template[j], slot, pair), unit)

        def into(ref, row=None, col=0):
            """Writes a product's tiles into ref's columns from `col` on (one row of it: `row`, an int
            or traced; at a traced row a tile of other than whole lane tiles is written as whole
            ones, zeros after it: `pair_width`)."""
            def write(start, rows, y):  # start: an int or traced
                if row is None:
                    ref[:, pl.ds(col + start, rows)] = y
                else:
                    y = _lanes_whole(y)
                    ref[pl.ds(row, 1), pl.ds(col + start, y.shape[-1])] = y
            return write

        def rms_norm(x, weight, eps=spec.rms_norm_eps):  # x [N, w] f32, weight [1, w]
            return weight * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))

        def row(name, layer):  # [1, width] of a per-layer vector
            return vec[name][layer:layer + 1, :]

        def router_copy(layer):
            return pltpu.make_async_copy(router_refs[layer], router_buf, router_sem.at[0])

        def dense_mlp(layer, y):
            gemv(layer, "gate", y, into(gate_ref))
            gemv(layer, "up", y, into(up_ref))
            gemv(layer, "down", activation(gate_ref[...]) * up_ref[...], into(delta_ref))

        def sparse_mlp(layer, y):
            """The router, the shared expert, then each routed pair's expert on its token's row.
            Returns whether the output in delta_ref is already summed over the devices (experts
            over the data-parallel ranks: one all-reduce over them all)."""
            router_copy(layer).wait()
            rank = jax.lax.axis_index(dp_axis) if ranks > 1 else 0
            if ranks > 1:  # every rank's normed rows, as a sum of zero-padded blocks over the ranks
                rows_in, rows_out, *scratch_ = rank_scratch
                rows_in[...] = jnp.zeros_like(rows_in)
                rows_in[pl.ds(rank * n_tok, n_tok), :] = y
                collectives.all_reduce_rows(rows_in, rows_out, *scratch_, axis=dp_axis, devices=ranks,
                                            barrier_semaphore=group_sems["ranks"])
                pair_x[...] = rows_out[...]
            else:
                pair_x[...] = y  # the pairs read their token's row
            scores = jax.lax.dot_general(pair_x[...], router_buf[...].astype(jnp.float32), (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32,
                                         precision=jax.lax.Precision.HIGHEST)  # [N, E] (this shard's experts)
            bias = row("router_bias", layer) if spec.router_bias else None
            if shards > 1:  # every shard's scores (and bias), gathered as a sum of zero-padded blocks
                gather_in, gather_out, *scratch_ = gather_scratch
                shard, lead = expert_shard()
                local = scores if bias is None else jnp.concatenate([scores, bias], axis=0)
                gather_in[...] = jnp.concatenate([jnp.where(lead & (shard == j), local, 0.0) for j in range(shards)],
                                                 axis=1)
                collectives.all_reduce_rows(gather_in, gather_out, *scratch_, axis=everyone, devices=group,
                                            barrier_semaphore=group_sems.get("all"))
                scores = gather_out[:n_moe, :]
                bias = None if bias is None else gather_out[n_moe:, :]
            scores_ref[...] = scores
            weights, experts = route(scores_ref[...], bias)
            weight_ref[...] = weights.astype(jnp.float32)
            choice_ref[...] = experts.astype(jnp.int32)
            copy = pltpu.make_async_copy(choice_ref, chosen, chosen_sem.at[0])  # VMEM -> SMEM: DMA addresses
            copy.start()
            copy.wait()
            routed.add(layer)
            pump()  # the first experts' tiles are in flight while the shared expert computes
            bias_copies = []
            if pair_bias is not None:  # each pair's bias rows (of its local expert: any valid row when
                # another device holds it, whose product is not made)
                *bias_bufs, bias_sem = pair_bias
                for pair in range(n_pairs):
                    _, expert = is_local(chosen[pair // top_k, pair % top_k])
                    bias_copies += [pltpu.make_async_copy(src.at[pl.ds(expert, 1)], buf.at[pl.ds(pair, 1)],
                                                          bias_sem.at[0]) for src, buf in zip(bias_refs[layer], bias_bufs)]
                for c in bias_copies:
                    c.start()
            if spec.shared_intermediate:
                gemv(layer, "shared_gate", y, into(sg_ref))
                gemv(layer, "shared_up", y, into(su_ref))
                gemv(layer, "shared_down", jax.nn.silu(sg_ref[...]) * su_ref[...], into(delta_ref))
                if spec.shared_expert_gate:
                    gate = jnp.sum(y * row("shared_expert_gate", layer), axis=-1, keepdims=True)  # [N, 1]
                    delta_ref[...] = delta_ref[...] * jax.nn.sigmoid(gate)
            else:
                delta_ref[...] = jnp.zeros_like(delta_ref)
            for c in bias_copies:
                c.wait()
            out_ref = delta_ref  # the routed outputs: with experts over the ranks, every rank's rows
            if ranks > 1:
                out_ref = combine_scratch[0]
                out_ref[...] = jnp.zeros_like(out_ref)
            routed_ref[...] = jnp.zeros_like(routed_ref)  # the pairs' sums, added to out_ref after them

            def pair_body(pair, run):  # pair: traced
                n, choice = pair // top_k, pair % top_k
                x_row = pair_x[pl.ds(n, 1), :]
                run("gate", x_row, into(eg_ref, pair))
                run("up", x_row, into(eu_ref, pair))
                inter = spec.expert_intermediate  # (the buffers are wider: `pair_width`)
                gate, up = eg_ref[pl.ds(pair, 1), :][:, :inter], eu_ref[pl.ds(pair, 1), :][:, :inter]
                if pair_bias is not None:
                    gate = gate + bias_bufs[0][pl.ds(pair, 1), :][:, :inter]
                    up = up + bias_bufs[1][pl.ds(pair, 1), :][:, :inter]
                h = expert_activation(gate, up)
                choices = jax.lax.broadcasted_iota(jnp.int32, (1, top_k), 1)
                weight = jnp.sum(jnp.where(choices == choice, weight_ref[pl.ds(n, 1), :], 0.0), axis=1,
                                 keepdims=True)  # [1, 1]

                def add_row(start, rows, out):  # (only for an expert this device holds)
                    out = _lanes_whole(weight * out)
                    cols = pl.ds(start, out.shape[-1])
                    routed_ref[pl.ds(n, 1), cols] = routed_ref[pl.ds(n, 1), cols] + out
                run("down", h, add_row)
                if pair_bias is not None:  # the down bias, once per pair: by a device that holds the expert,
                    # the first of those that split its FFN
                    held = is_local(chosen[n, choice])[0]
                    adds = True if held is None else held
                    if tp_size > 1:
                        adds = adds & expert_shard()[1]
                    bias = jnp.where(adds, weight * bias_bufs[2][pl.ds(pair, 1), :], 0.0)
                    cols = pl.ds(0, bias.shape[-1])
                    routed_ref[pl.ds(n, 1), cols] = routed_ref[pl.ds(n, 1), cols] + bias
            routed_pairs(layer, pair_body)
            out_ref[...] = out_ref[...] + routed_ref[...][:, :d]
            if ranks == 1:
                return False
            # this rank's rows take its shared expert's partial; one sum over every device
            combine_in, combine_out, *scratch_ = combine_scratch
            mine = pl.ds(rank * n_tok, n_tok)
            combine_in[mine, :] = combine_in[mine, :] + delta_ref[...]
            collectives.all_reduce_rows(combine_in, combine_out, *scratch_, axis=everyone, devices=group,
                                        barrier_semaphore=group_sems["all"])
            delta_ref[...] = combine_out[mine, :]
            return True

        if ranks > 1:  # every device inside the kernel before the groups signal their own semaphores
            collectives.barrier(everyone, group)
        pump()  # the stream's prologue in flight first
        x_ref[...] = embed_ref[...] * spec.embed_scale if spec.embed_scale != 1.0 else embed_ref[...]
        if tp_size > 1:  # each device holds the rows of its vocabulary slice (the others' are zeros): summed
            delta_ref[...] = x_ref[...]
            x_ref[...] = jnp.zeros_like(x_ref)
            residual_add()

        # KV heads fewer than the devices: this device's query heads read KV head kv_start
        kv_start = None
        if spec.kv_pool_heads:
            kv_start = jax.lax.axis_index(tp_axis) * spec.kv_pool_heads // tp_size

        # Rotary tables for the N tokens, as the XLA path computes them (rotate-half layout): one
        # (cos, sin) pair [N, 1, rope dims / 2] per table of inverse frequencies.
        tables = []
        if spec.rope:
            pos = jnp.stack([pos_ref[n] for n in range(n_tok)]).astype(jnp.float32).reshape(n_tok, 1)
            for j in range(spec.rope_tables):
                freqs = pos * vec["inv_freq"][j:j + 1, :]  # [N, rope dims / 2]
                mscale = spec.rope_mscale[j] if spec.rope_mscale else 1.0
                tables.append(((jnp.cos(freqs) * mscale)[:, None, :], (jnp.sin(freqs) * mscale)[:, None, :]))

        def rope(z, layer):  # [N, heads, dims]: the first rope dims rotated; interleaved pairs de-interleaved, as HF's
            if not spec.rope:
                return z
            cos, sin = tables[spec.rope_table(layer)]
            rd = spec.rope_dims
            rest = [z[..., rd:]] if rd < z.shape[-1] else []  # partial RoPE: the dims past rd as they are
            z = z[..., :rd]
            if spec.rope_interleaved:  # pairs (2i, 2i + 1) to halves, by a 0/1 permutation matmul (exact in f32):
                # Mosaic has no strided slices
                src = jax.lax.broadcasted_iota(jnp.int32, (rd, rd), 0)
                dst = jax.lax.broadcasted_iota(jnp.int32, (rd, rd), 1)
                perm = (src == jnp.where(dst < rd // 2, 2 * dst, 2 * (dst - rd // 2) + 1)).astype(jnp.float32)
                z = jax.lax.dot_general(z.reshape(-1, rd), perm, (((1,), (0,)), ((), ())),
                                        precision=jax.lax.Precision.HIGHEST).reshape(z.shape)
            half = rd // 2
            z1, z2 = z[..., :half], z[..., half:]
            return jnp.concatenate([z1 * cos - z2 * sin, z2 * cos + z1 * sin] + rest, axis=-1)

        def gqa_attention(layer, y):
            """q, k, v, attention over the K/V pools, o: the projection's output in delta_ref."""
            for name, ref in (("q", qa_ref), ("k", ka_ref), ("v", va_ref)):
                gemv(layer, name, y, into(ref))
            q, k, v = qa_ref[...], ka_ref[...], va_ref[...]  # [N, q_proj], [N, kv], [N, kv]
            if spec.qkv_bias:
                bias = row("qkv_bias", layer)
                q, k, v = q + bias[:, :q_proj], k + bias[:, q_proj:q_proj + kv_dim], v + bias[:, q_proj + kv_dim:]
            gate = None
            if spec.output_gate:  # rows per head [q | gate]
                q, gate = q.reshape(n_tok, h, 2 * e)[..., :e], q.reshape(n_tok, h, 2 * e)[..., e:]
            q, k = q.reshape(n_tok, h, e), k.reshape(n_tok, kvh, e)
            if spec.qk_norm:
                q = rms_norm(q, row("q_norm", layer)[None])
                k = rms_norm(k, row("k_norm", layer)[None])
            q_heads[...] = rope(q, layer)
            kn_ref[...] = rope(k, layer).astype(kv_dtype)
            vn_ref[...] = v.reshape(n_tok, kvh, e).astype(kv_dtype)
            pools = pool_of[layer]
            attend_rows(pos_ref, bt_ref, q_heads, kn_ref, vn_ref, k_out[pools], v_out[pools], att_ref, *attn_scratch,
                        rows=b, tokens=t, pages_per_tile=spec.pages_per_kv_tile, scale=spec.scale,
                        window=spec.window(layer), table_offset=spec.group(layer) * table_width,
                        sinks=row("sinks", layer) if spec.attention_sinks else None, kv_start=kv_start,
                        kv_count=spec.num_kv_heads,
                        bug=_bug if _bug == "full_window" else None)
            out = att_ref[...]
            if gate is not None:
                out = out * jax.nn.sigmoid(gate)
            gemv(layer, "o", out.reshape(n_tok, q_dim), into(delta_ref))
            if spec.o_bias:  # tensor parallel: added once, by the first device, to the sum to come
                bias = row("o_bias", layer)
                if tp_size > 1:
                    bias = jnp.where(jax.lax.axis_index(tp_axis) == 0, bias, 0.0)
                delta_ref[...] = delta_ref[...] + bias

        def mla_attention(layer, y):
            """Absorbed MLA (weld.models.common.mla): the query's nope part folded through W_UK into
            the latent space, one latent key head [c_kv | k_pe] whose first r dims are the values,
            W_UV on the latent output, then o: the projection's output in delta_ref."""
            r, dn, dr, dv = spec.kv_lora_rank, spec.nope_dim, spec.rope_dim, spec.v_dim
            if spec.q_lora:
                gemv(layer, "q_a", y, into(qlo_ref))
                gemv(layer, "q_b", rms_norm(qlo_ref[...], row("q_a_norm", layer), LATENT_NORM_EPS), into(qa_ref))
            else:
                gemv(layer, "q", y, into(qa_ref))
            gemv(layer, "kv_a", y, into(ka_ref))
            kv = ka_ref[...]  # [N, r + dr]
            c_kv = rms_norm(kv[:, :r], row("kv_a_norm", layer), LATENT_NORM_EPS)
            kn_ref[...] = jnp.concatenate([c_kv[:, None, :], rope(kv[:, None, r:], layer)], axis=-1).astype(kv_dtype)
            q = qa_ref[...].reshape(n_tok, h, dn + dr)
            q_heads[:, :, r:] = rope(q[:, :, dn:], layer)

            def absorb(w, tile, start):  # a tile of whole heads of W_UK [heads x dn, r] from row `start`
                # (traced in a loop): q_abs = W_UK[h]^T q_nope[h], q_nope read from the projection's heads
                hh, width = tile.rows // dn, dn + dr
                q_nope = qa_ref[:, pl.ds(_aligned(start // dn * width, hh * width), hh * width)]
                q_nope = q_nope.reshape(n_tok, hh, width)[:, :, :dn]
                return jnp.einsum("nhe,her->nhr", q_nope, w.reshape(hh, dn, r), precision=jax.lax.Precision.HIGHEST)

            def into_heads(start, rows, y):
                q_heads[:, pl.ds(_aligned(start // dn, rows // dn), rows // dn), :r] = y
            gemv(layer, "w_uk", None, into_heads, compute=absorb)
            attend_rows(pos_ref, bt_ref, q_heads, kn_ref, None, k_out[pool_of[layer]], None, att_ref, *attn_scratch,
                        rows=b, tokens=t, pages_per_tile=spec.pages_per_kv_tile, scale=spec.scale,
                        table_offset=spec.group(layer) * table_width)
            def expand(w, tile, start):  # a tile of whole heads of W_UV [heads x dv, r]: o[h] = W_UV[h] o_lat[h]
                hh = tile.rows // dv
                o_lat = att_ref[:, pl.ds(_aligned(start // dv, hh), hh), :r]  # the values: c_kv, the keys' first r dims
                out = jnp.einsum("nhr,hvr->nhv", o_lat, w.reshape(hh, dv, r), precision=jax.lax.Precision.HIGHEST)
                return out.reshape(n_tok, tile.rows)
            gemv(layer, "w_uv", None, into(ov_ref), compute=expand)
            gemv(layer, "o", ov_ref[...], into(delta_ref))

        def conv_copy(layer):
            return pltpu.make_async_copy(conv_refs[layer], lin["conv"], lin["conv_sem"].at[0])

        def linear_attention(layer, y):
            """The gated delta rule (`linear.py`): the input projections, the log-decays and betas,
            each row's conv and recurrence over its state, the gated norm, the output projection
            into delta_ref. The conv weights and row 0's state were started as the layer began."""
            windows, states = state_out[state_of[layer]]
            if spec.linear_kind == "gdn":
                for name, ref in (("w_qkv", lin["qkv"]), ("w_z", lin["gate"]), ("w_b", lin["beta"]),
                                  ("w_a", lin["decay"])):
                    gemv(layer, name, y, into(ref))
            else:
                kd = spec.linear_key_dim
                for name, ref, col in (("w_q", lin["qkv"], 0), ("w_k", lin["qkv"], kd), ("w_v", lin["qkv"], 2 * kd),
                                       ("w_b", lin["beta"], 0), ("w_fa", lin["fa"], 0), ("w_ga", lin["ga"], 0)):
                    gemv(layer, name, y, into(ref, col=col))
                gemv(layer, "w_fb", lin["fa"][...], into(lin["decay"]))
                gemv(layer, "w_gb", lin["ga"][...], into(lin["gate"]))
            lin["decay"][...] = linear.log_decay(spec, lin["decay"][...], row("A_log", layer), row("dt_bias", layer))
            lin["beta"][...] = jax.nn.sigmoid(lin["beta"][...])
            conv_copy(layer).wait()
            linear.recur_rows(spec, pos_ref, slot_ref, lin, windows, states,
                              bug=_bug if _bug in linear.BUGS else None)
            out = linear.gated_output(spec, lin["out"][...], lin["gate"][...], row("linear_norm", layer))
            gemv(layer, "w_out", out, into(delta_ref))

        for layer in range(n_layers):
            if layer in sparse:  # the router lands while attention runs
                router_copy(layer).start()
            if layer in lin_layers:  # the conv and row 0's state land while the projections stream
                conv_copy(layer).start()
                linear.start_first_read(spec, pos_ref, slot_ref, lin, *state_out[state_of[layer]])
            y = rms_norm(x_ref[...], row("attn_norm", layer))  # [N, d]
            if layer in lin_layers:
                linear_attention(layer, y)
            else:
                (mla_attention if spec.mla else gqa_attention)(layer, y)
            residual_add(row("post_attn_norm", layer) if spec.sandwich_norms else None)
            y = rms_norm(x_ref[...], row("mlp_norm", layer))
            summed = (sparse_mlp if layer in sparse else dense_mlp)(layer, y)
            residual_add(row("post_mlp_norm", layer) if spec.sandwich_norms else None, summed=bool(summed))
            if layer in capture_layers:
                cap_refs[capture_layers.index(layer)][...] = x_ref[...]
        gemv(-1, "lm_head", rms_norm(x_ref[...], vec["final_norm"][...]), into(logits_ref))
        if spec.logit_softcap:
            cap = spec.logit_softcap
            logits_ref[...] = cap * jnp.tanh(logits_ref[...] / cap)
        if cursor[0] != len(tiles):
            raise AssertionError(f"{len(tiles) - cursor[0]} weight tiles were never computed")
        if _bug == "skip_wait":  # drain the semaphores so the kernel still ends cleanly
            for i in range(len(tiles)):
                copies_do(i, "wait")
        ids_ref[...] = jnp.argmax(logits_ref[...], axis=-1).astype(jnp.int32)[:, None]

    vmem, f32 = pltpu.MemorySpace.VMEM, jnp.float32
    scratch = [pltpu.VMEM((depth,) + ((ring_cols[k], ring_rows[k]) if k[2] else (ring_rows[k], ring_cols[k])),
                          ring_dtypes[k[0]]) for k in keys] + [  # the weight rings ([cols, rows] slots: transposed)
        pltpu.SemaphoreType.DMA((depth,)),  # one DMA semaphore per ring slot (shared by the rings)
        pltpu.VMEM((n_tok, d), f32),  # x: the residual stream
        pltpu.VMEM((n_tok, d), f32),  # the o / down projection's output, added to x
        pltpu.VMEM((n_tok, q_proj), f32),  # q, as projected
        pltpu.VMEM((n_tok, kv_dim), f32),  # k
        pltpu.VMEM((n_tok, kv_dim), f32),  # v
        pltpu.VMEM((n_tok, h, e), f32),  # q by head, normed and roped: attention's input
        pltpu.VMEM((n_tok, kvh, e), kv_dtype),  # the new K, as the pools store it (DMA source)
        pltpu.VMEM((n_tok, kvh, e), kv_dtype),  # the new V
        pltpu.VMEM((n_tok, h, e), f32),  # attention output
        pltpu.VMEM((n_tok, spec.intermediate), f32),  # gate
        pltpu.VMEM((n_tok, spec.intermediate), f32),  # up
    ] + kv_scratch(spec.pages_per_kv_tile, spec.page_size, kv_dim, kv_dtype, b,
                   spec.kv_ring_depth)  # the KV tiles' rings, their semaphores, the live rows
    if int8:
        scratch.append(pltpu.VMEM((depth, 1, lane_span(ring_rows["int8"])), f32))  # the scale ring: a row per slot
    if "int4" in kinds:  # the int4 tiles' scales and mins, per group
        scratch += [pltpu.VMEM((depth, ring_rows["int4"], ring_cols["int4"] * 2 // INT4_GROUP), f32)] * 2
    if spec.mla:
        scratch.append(pltpu.VMEM((n_tok, h * spec.v_dim), f32))  # W_UV's output: o's input
        if spec.q_lora:
            scratch.append(pltpu.VMEM((n_tok, spec.q_lora_rank), f32))  # q_a's output
    if sparse:
        scratch += [
            pltpu.VMEM((spec.num_experts, d), routers[0].dtype),  # the layer's router, read whole
            pltpu.SemaphoreType.DMA((1,)),
            pltpu.VMEM((n_moe, spec.routed_experts), f32),  # router scores (every shard's)
            pltpu.VMEM((n_moe, top_k), jnp.int32),  # the chosen experts (VMEM) ...
            pltpu.VMEM((n_moe, top_k), f32),  # ... and their weights
            pltpu.SMEM((n_moe, top_k), jnp.int32),  # the chosen experts as DMA addresses
            pltpu.SemaphoreType.DMA((1,)),
            pltpu.VMEM((n_pairs, pair_width("gate", spec.expert_intermediate)), f32),  # each pair's expert gate
            pltpu.VMEM((n_pairs, pair_width("up", spec.expert_intermediate)), f32),  # and up
            pltpu.VMEM((n_moe, d), f32),  # the layer's normed input (every rank's), rows read by pair
            pltpu.VMEM((n_moe, pair_width("down", d)), f32),  # the routed outputs, summed per row
        ]
        if n_bias:  # each pair's bias rows and their semaphore
            scratch += [pltpu.VMEM((n_pairs, traced_row_width(spec.expert_intermediate)), f32)] * 2 + [
                pltpu.VMEM((n_pairs, traced_row_width(d)), f32), pltpu.SemaphoreType.DMA((1,))]  # padded as the biases
        if spec.shared_intermediate:
            scratch += [pltpu.VMEM((n_tok, spec.shared_intermediate), f32)] * 2  # the shared expert's gate, up
    if lin_layers:
        scratch += linear.linear_scratch(spec, convs[0].dtype)
    if tp_size > 1:
        scratch += [pltpu.VMEM((n_tok, d), f32)] + collectives.all_reduce_scratch(n_tok, d, tp_size)
    if shards > 1:
        scratch += [pltpu.VMEM((gather_rows, spec.routed_experts), f32)] * 2 + collectives.all_reduce_scratch(
            gather_rows, spec.routed_experts, group)
    if ranks > 1:  # every rank's rows gathered; the routed outputs summed over every device
        scratch += [pltpu.VMEM((n_moe, d), f32)] * 2 + collectives.all_reduce_scratch(n_moe, d, ranks)
        scratch += [pltpu.VMEM((n_moe, d), f32)] * 2 + collectives.all_reduce_scratch(n_moe, d, group)
        scratch += [pltpu.SemaphoreType.REGULAR] * 3  # the groups' barrier semaphores
    n_in = n_vec + 1 + n_mat + n_scale + n_group + n_router + n_bias + n_conv
    first_pool = 4 + n_in  # operand indices count the four scalar-prefetch operands
    aliases = {first_pool + i: 2 + i for i in range(n_pools)}
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        in_specs=[pl.BlockSpec(memory_space=vmem)] * (n_vec + 1) + [pl.BlockSpec(memory_space=pl.ANY)] * (
            n_mat + n_scale + n_group + n_router + n_bias + n_conv + n_pools),
        out_specs=[pl.BlockSpec(memory_space=vmem)] * 2 + [pl.BlockSpec(memory_space=pl.ANY)] * n_pools
        + [pl.BlockSpec(memory_space=vmem)] * n_cap,
        scratch_shapes=scratch,
    )
    pool_structs = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pool_list]
    compiler_params = None
    limit = None if interpret else plan.vmem_limit_bytes
    if limit is not None or tp_size > 1:  # the all-reduces' barrier semaphore needs a collective id
        compiler_params = pltpu.CompilerParams(vmem_limit_bytes=limit, collective_id=0 if tp_size > 1 else None)
    logits, ids, *rest = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((n_tok, spec.vocab), f32), jax.ShapeDtypeStruct((n_tok, 1), jnp.int32)]
        + pool_structs + [jax.ShapeDtypeStruct((n_tok, d), f32)] * n_cap,
        grid_spec=grid_spec,
        input_output_aliases=aliases,
        compiler_params=compiler_params,
        interpret=interpret,
    )(tokens.reshape(-1).astype(jnp.int32), positions.reshape(-1).astype(jnp.int32), block_tables.astype(jnp.int32),
      jnp.asarray(state_slots, jnp.int32), *vectors, embed_rows(params["embed"], tokens, spec.vocab, tp_axis, tp_size),
      *weight_ops, *scale_ops, *group_ops, *routers, *biases, *convs,
      *pool_list)
    pools, hidden = rest[:n_pools], [hs.reshape(b, t, d) for hs in rest[n_pools:]]
    n_kv = n_attn if spec.mla else 2 * n_attn
    states = pools[n_kv:]
    return (logits.reshape(b, t, spec.vocab), ids.reshape(b, t), list(pools[:n_attn]),
            None if spec.mla else list(pools[n_attn:n_kv]), hidden,
            [(jnp.transpose(states[2 * j], (1, 2, 0)), states[2 * j + 1]) for j in range(len(lin_layers))])
