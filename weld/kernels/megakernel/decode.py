"""The decode megakernel: a whole dense-decoder step (every layer, the LM head) as one Pallas call.

Covers the dense family's switches (any layer count, GQA, any even head dim, qkv / o biases,
q / k RMSNorm, tied embeddings, rope frequencies given as a table), B rows of T tokens each
(decode: T = 1; a speculative verify block: T = k + 1 consecutive positions, causal within the
block), f32 / bf16 weights or int8 weights with per-output-channel scales, a paged KV cache of
one [P, page, KV, E] pool pair per layer. Not covered: sliding windows (Mistral's window, Qwen's
sliding layers), MoE, MLA, linear attention.

One `pallas_call` with no grid:
  - SMEM (scalar prefetch): token ids [N], positions [N] (N = B x T, -1 = padding), block tables [B, M];
  - VMEM inputs: the small vectors (norms, biases, rope frequencies), held whole;
  - HBM (`memory_space=pl.ANY`): the embedding table (only the N rows fetched by DMA), every
    weight matrix, the KV pools (aliased to outputs: the new K/V is written in place);
  - outputs: f32 logits [N, V] and greedy ids [N] in VMEM, the pools in HBM.
The weights flow through a ring of VMEM slots on the static schedule of `plan.stream_schedule`
(q, k, v, o, gate, up, down per layer, then the LM head in vocabulary tiles), one DMA semaphore
per slot: before tile n computes, tile n + depth - 1 starts into the slot tile n - 1 freed, so
the stream never stops at a matrix or layer boundary: while layer i's attention runs, layer i's
o-projection tiles are landing; while its down projection computes, layer i+1's first q tiles
are in flight; after the last layer the stream runs on into the LM head. Attention is
`attention.attend_rows` (KV tiles double-buffered under an online softmax). The layers are
unrolled in Python: every layer's matrices and pools are their own buffers (the engine's
per-layer layout, so the kernel reads the arrays the XLA path uses, with no stacked copy).

The pure-jnp twin of this kernel is the model's XLA forward (`weld.models.llama.forward`; the
adapter is `weld.models.megakernel`): the tests compare the two. Activations stay in f32; with
bf16 weights the MXU is fed bf16 activations with f32 accumulation.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from weld.kernels.megakernel.attention import attend_rows, kv_scratch
from weld.kernels.megakernel.plan import MegakernelSpec, Plan, fit_plan, make_plan

MATRICES = ("q", "k", "v", "o", "gate", "up", "down")  # per layer, in stream order (plan.matrices)
BUGS = (None, "skip_wait", "wrong_slot")  # planted weight-stream bugs, for the tests
_OPTIONAL_VECTORS = (("qkv_bias", "qkv_bias"), ("o_bias", "o_bias"), ("q_norm", "qk_norm"), ("k_norm", "qk_norm"))


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


def tpu_generation(device_kind: str) -> str:
    """The `plan.TPU_GENERATIONS` key of a TPU's `device_kind` ("TPU v5 lite" -> "v5e")."""
    kind = device_kind.lower()
    for pattern, generation in ((r"v5 ?(lite|e)", "v5e"), (r"v6", "v6e"), (r"tpu ?7|v7", "v7")):
        if re.search(pattern, kind):
            return generation
    raise ValueError(f"no VMEM table for TPU {device_kind!r}; pass generation= one of v5e, v6e, v7")


def _vector_names(spec: MegakernelSpec) -> list[str]:
    names = ["attn_norm", "mlp_norm", "final_norm", "inv_freq"]
    return names + [name for name, flag in _OPTIONAL_VECTORS if getattr(spec, flag)]


def _validate(spec, params, tokens, positions, block_tables, k_pools, v_pools):
    b, t = spec.batch, spec.tokens_per_row
    q, kv, d, e = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden, spec.head_dim
    n_layers = spec.num_layers
    for name, a in (("tokens", tokens), ("positions", positions)):
        if a.shape != (b, t):
            raise ValueError(f"{name} must be [B, T] = {(b, t)} (spec.batch, spec.tokens_per_row), got {a.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [B, max_pages] with B = {b}, got {block_tables.shape}")
    if len(params["layers"]) != n_layers or len(k_pools) != n_layers or len(v_pools) != n_layers:
        raise ValueError(f"spec.num_layers is {n_layers} but got {len(params['layers'])} weight layers, "
                         f"{len(k_pools)} K pools and {len(v_pools)} V pools")
    pool_shape = (k_pools[0].shape[0], spec.page_size, spec.num_kv_heads, e)
    for i, (kp, vp) in enumerate(zip(k_pools, v_pools)):
        if kp.shape != pool_shape or vp.shape != pool_shape:
            raise ValueError(f"pools of layer {i} must be [P, page, KV, E] = {pool_shape}, got {kp.shape} and {vp.shape}")
    expected = {"embed": (spec.vocab, d), "lm_head": (spec.vocab, d), "attn_norm": (n_layers, d),
                "mlp_norm": (n_layers, d), "final_norm": (d,), "inv_freq": (e // 2,), "qkv_bias": (n_layers, q + 2 * kv),
                "o_bias": (n_layers, d), "q_norm": (n_layers, e), "k_norm": (n_layers, e)}
    for name in ["embed", "lm_head"] + _vector_names(spec):
        if name not in params:
            raise ValueError(f"params has no {name!r} (the spec's switches need it)")
        if tuple(params[name].shape) != expected[name]:
            raise ValueError(f"params[{name!r}] must be {expected[name]}, got {tuple(params[name].shape)}")
    shapes = {name: (rows, cols) for name, rows, cols in spec.matrices()}
    int8 = isinstance(params["lm_head"], Int8Matrix)
    for i, layer in enumerate(params["layers"]):
        for name in MATRICES:
            w = layer[name]
            if tuple(w.shape) != shapes[name]:
                raise ValueError(f"layers[{i}][{name!r}] must be [out, in] = {shapes[name]}, got {tuple(w.shape)}")
            if isinstance(w, Int8Matrix) != int8:
                raise ValueError(f"layers[{i}][{name!r}]: mix of int8 and float matrices (lm_head int8: {int8})")


def decode_step(spec: MegakernelSpec, params: dict, tokens, positions, block_tables, k_pools, v_pools, *,
                tile_rows: int = 256, vocab_tile_rows: int = 256, ring_depth: int = 4, generation: str | None = None,
                interpret=False, _bug: str | None = None):
    """One call of the megakernel.

    spec: the model's shapes and switches, `batch` = B rows of `tokens_per_row` = T tokens.
    params: "embed" [V, d] (HBM, rows fetched by DMA), "lm_head" [V, d] (the embedding itself
      when tied), "layers": L dicts of MATRICES, each [out, in] or an `Int8Matrix` (all or none,
      the LM head too),
      "attn_norm" / "mlp_norm" [L, d], "final_norm" [d], "inv_freq" [E / 2] (the model's rope
      table, f32), and per the spec's switches "qkv_bias" [L, q + 2 kv], "o_bias" [L, d],
      "q_norm" / "k_norm" [L, E].
    tokens, positions: int32 [B, T] (position -1: padding; a row is padding when its first is).
    block_tables: int32 [B, M]. k_pools, v_pools: L arrays [P, page, KV, E], updated in place.
    generation: a TPU generation whose VMEM budget the plan must fit (the ring shrinks to fit,
      else `plan.VmemBudgetError`); None: detected on a TPU, not checked in interpret mode.
    interpret: False on a TPU; a `pltpu.InterpretParams` (or True) to run on CPU.
    Returns (logits f32 [B, T, V], greedy ids int32 [B, T], k_pools, v_pools).
    """
    _validate(spec, params, tokens, positions, block_tables, k_pools, v_pools)
    if _bug not in BUGS:
        raise ValueError(f"_bug must be one of {BUGS}, got {_bug!r}")
    if generation is None and not interpret:
        generation = tpu_generation(jax.devices()[0].device_kind)
    plan: Plan = (fit_plan(spec, generation, ring_depth=ring_depth, tile_rows=tile_rows, vocab_tile_rows=vocab_tile_rows)
                  if generation else
                  make_plan(spec, ring_depth=ring_depth, tile_rows=tile_rows, vocab_tile_rows=vocab_tile_rows))
    depth, tiles = plan.ring_depth, plan.tiles
    b, t, n_tok = spec.batch, spec.tokens_per_row, spec.tokens
    h, kvh, e, d, n_layers = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden, spec.num_layers
    q_dim, kv_dim = h * e, kvh * e

    # HBM matrices in one list, indexed by (layer, name); the LM head is (-1, "lm_head").
    matrices, index = [], {}
    for i, layer in enumerate(params["layers"]):
        for name in MATRICES:
            index[(i, name)] = len(matrices)
            matrices.append(layer[name])
    index[(-1, "lm_head")] = len(matrices)
    matrices.append(params["lm_head"])
    int8 = isinstance(params["lm_head"], Int8Matrix)
    weight_ops = [m.q for m in matrices] if int8 else list(matrices)
    scale_ops = [m.scale.astype(jnp.float32).reshape(1, -1) for m in matrices] if int8 else []
    weight_dtype = weight_ops[0].dtype
    vector_names = _vector_names(spec)
    vectors = [params[name].astype(jnp.float32).reshape(-1, params[name].shape[-1]) for name in vector_names]
    kv_dtype = k_pools[0].dtype
    max_rows, max_cols = max(x.rows for x in tiles), max(x.cols for x in tiles)
    n_vec, n_mat, n_scale = len(vectors), len(weight_ops), len(scale_ops)

    def kernel(tok_ref, pos_ref, bt_ref, *refs):
        # inputs
        vec = dict(zip(vector_names, refs[:n_vec]))  # VMEM, f32 [L or 1, width]
        embed_ref = refs[n_vec]  # HBM [V, d]
        w_refs = refs[n_vec + 1:n_vec + 1 + n_mat]  # HBM [out, in] each
        s_refs = refs[n_vec + 1 + n_mat:n_vec + 1 + n_mat + n_scale]  # HBM [1, out] each (int8 only)
        rest = refs[n_vec + 1 + n_mat + n_scale + 2 * n_layers:]  # (input pools: aliased, use the outputs)
        # outputs
        logits_ref, ids_ref = rest[0], rest[1]  # VMEM [N, V] f32, [N, 1] int32
        k_out, v_out = rest[2:2 + n_layers], rest[2 + n_layers:2 + 2 * n_layers]  # HBM pools [P, page, KV, E]
        # scratch (see scratch_shapes)
        ring, ring_sems, emb_buf, emb_sems, x_ref, delta_ref, qa_ref, ka_ref, va_ref = rest[2 + 2 * n_layers:11 + 2 * n_layers]
        q_heads, kn_ref, vn_ref, att_ref, gate_ref, up_ref = rest[11 + 2 * n_layers:17 + 2 * n_layers]
        attn_scratch = rest[17 + 2 * n_layers:21 + 2 * n_layers]
        scale_ring = rest[21 + 2 * n_layers] if int8 else None

        def tile_copies(i):
            tile = tiles[i]
            m, slot, rows = index[(tile.layer, tile.matrix)], i % depth, pl.ds(0, tile.rows)
            copies = [pltpu.make_async_copy(w_refs[m].at[pl.ds(tile.row_start, tile.rows)],
                                            ring.at[slot, rows, pl.ds(0, tile.cols)], ring_sems.at[slot])]
            if int8:  # the tile's scales ride on the same semaphore
                copies.append(pltpu.make_async_copy(s_refs[m].at[pl.ds(0, 1), pl.ds(tile.row_start, tile.rows)],
                                                    scale_ring.at[slot, pl.ds(0, 1), rows], ring_sems.at[slot]))
            return copies

        cursor = [0]  # the next tile to compute (the schedule is consumed strictly in order)

        def gemv(layer, name, x, write):
            """x [N, in] f32 @ the matrix^T, tile by tile; write(first_row, rows, y [N, rows])."""
            i = first = cursor[0]
            while i < len(tiles) and (tiles[i].layer, tiles[i].matrix) == (layer, name):
                tile = tiles[i]
                if i + depth - 1 < len(tiles):  # its slot held tile i - 1, which has finished computing
                    for c in tile_copies(i + depth - 1):
                        c.start()
                if _bug != "skip_wait":
                    for c in tile_copies(i):
                        c.wait()
                slot = (i + 1) % depth if _bug == "wrong_slot" else i % depth
                w = ring[slot, :tile.rows, :tile.cols]  # [rows, in]
                if int8:
                    w, lhs = w.astype(jnp.float32), x
                else:
                    lhs = x.astype(w.dtype)
                y = jax.lax.dot_general(lhs, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                        precision=jax.lax.Precision.HIGHEST)  # [N, rows]
                if int8:
                    y = y * scale_ring[slot, :, :tile.rows]  # [1, rows]
                write(tile.row_start, tile.rows, y)
                i += 1
            if i == first:
                raise AssertionError(f"schedule out of order: wanted {(layer, name)}, next tile is {tiles[first]}")
            cursor[0] = i

        def into(ref):
            def write(start, rows, y):
                ref[:, start:start + rows] = y
            return write

        def rms_norm(x, weight):  # x [N, w] f32, weight [1, w]
            return weight * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + spec.rms_norm_eps))

        def row(name, layer):  # [1, width] of a per-layer vector
            return vec[name][layer:layer + 1, :]

        # The stream starts first: its prologue is in flight while the embedding rows land.
        for i in range(min(depth - 1, len(tiles))):
            for c in tile_copies(i):
                c.start()
        emb_copies = [pltpu.make_async_copy(embed_ref.at[pl.ds(jnp.clip(tok_ref[n], 0, spec.vocab - 1), 1)],
                                            emb_buf.at[pl.ds(n, 1)], emb_sems.at[n]) for n in range(n_tok)]
        for c in emb_copies:
            c.start()
        for c in emb_copies:
            c.wait()
        x_ref[...] = emb_buf[...].astype(jnp.float32)

        # Rotary tables for the N tokens, as the XLA path computes them (rotate-half layout).
        pos = jnp.stack([pos_ref[n] for n in range(n_tok)]).astype(jnp.float32).reshape(n_tok, 1)
        freqs = pos * vec["inv_freq"][...]  # [N, E/2]
        cos = (jnp.cos(freqs) * spec.rope_mscale)[:, None, :]  # [N, 1, E/2]
        sin = (jnp.sin(freqs) * spec.rope_mscale)[:, None, :]

        def rope(z):  # [N, heads, E]
            z1, z2 = z[..., :e // 2], z[..., e // 2:]
            return jnp.concatenate([z1 * cos - z2 * sin, z2 * cos + z1 * sin], axis=-1)

        for layer in range(n_layers):
            y = rms_norm(x_ref[...], row("attn_norm", layer))  # [N, d]
            for name, ref in (("q", qa_ref), ("k", ka_ref), ("v", va_ref)):
                gemv(layer, name, y, into(ref))
            q, k, v = qa_ref[...], ka_ref[...], va_ref[...]  # [N, q], [N, kv], [N, kv]
            if spec.qkv_bias:
                bias = row("qkv_bias", layer)
                q, k, v = q + bias[:, :q_dim], k + bias[:, q_dim:q_dim + kv_dim], v + bias[:, q_dim + kv_dim:]
            q, k = q.reshape(n_tok, h, e), k.reshape(n_tok, kvh, e)
            if spec.qk_norm:
                q = rms_norm(q, row("q_norm", layer)[None])
                k = rms_norm(k, row("k_norm", layer)[None])
            q_heads[...] = rope(q)
            kn_ref[...] = rope(k).astype(kv_dtype)
            vn_ref[...] = v.reshape(n_tok, kvh, e).astype(kv_dtype)
            attend_rows(pos_ref, bt_ref, q_heads, kn_ref, vn_ref, k_out[layer], v_out[layer], att_ref, *attn_scratch,
                        rows=b, tokens=t, pages_per_tile=spec.pages_per_kv_tile, scale=e ** -0.5)
            gemv(layer, "o", att_ref[...].reshape(n_tok, q_dim), into(delta_ref))
            delta = delta_ref[...] + (row("o_bias", layer) if spec.o_bias else 0.0)
            x_ref[...] = x_ref[...] + delta
            y = rms_norm(x_ref[...], row("mlp_norm", layer))
            gemv(layer, "gate", y, into(gate_ref))
            gemv(layer, "up", y, into(up_ref))
            gemv(layer, "down", jax.nn.silu(gate_ref[...]) * up_ref[...], into(delta_ref))
            x_ref[...] = x_ref[...] + delta_ref[...]
        gemv(-1, "lm_head", rms_norm(x_ref[...], vec["final_norm"][...]), into(logits_ref))
        if cursor[0] != len(tiles):
            raise AssertionError(f"{len(tiles) - cursor[0]} weight tiles were never computed")
        if _bug == "skip_wait":  # drain the semaphores so the kernel still ends cleanly
            for i in range(len(tiles)):
                for c in tile_copies(i):
                    c.wait()
        ids_ref[...] = jnp.argmax(logits_ref[...], axis=-1).astype(jnp.int32)[:, None]

    vmem, f32 = pltpu.MemorySpace.VMEM, jnp.float32
    scratch = [
        pltpu.VMEM((depth, max_rows, max_cols), weight_dtype),  # the weight ring
        pltpu.SemaphoreType.DMA((depth,)),  # one DMA semaphore per ring slot
        pltpu.VMEM((n_tok, d), params["embed"].dtype),  # the N embedding rows, as fetched
        pltpu.SemaphoreType.DMA((n_tok,)),  # one per embedding row
        pltpu.VMEM((n_tok, d), f32),  # x: the residual stream
        pltpu.VMEM((n_tok, d), f32),  # the o / down projection's output, added to x
        pltpu.VMEM((n_tok, q_dim), f32),  # q
        pltpu.VMEM((n_tok, kv_dim), f32),  # k
        pltpu.VMEM((n_tok, kv_dim), f32),  # v
        pltpu.VMEM((n_tok, h, e), f32),  # q by head, normed and roped: attention's input
        pltpu.VMEM((n_tok, kvh, e), kv_dtype),  # the new K, as the pools store it (DMA source)
        pltpu.VMEM((n_tok, kvh, e), kv_dtype),  # the new V
        pltpu.VMEM((n_tok, h, e), f32),  # attention output
        pltpu.VMEM((n_tok, spec.intermediate), f32),  # gate
        pltpu.VMEM((n_tok, spec.intermediate), f32),  # up
    ] + kv_scratch(spec.pages_per_kv_tile, spec.page_size, kvh, e, kv_dtype)  # KV tiles and their semaphores
    if int8:
        scratch.append(pltpu.VMEM((depth, 1, max_rows), f32))  # the scale ring, one row of scales per slot
    n_in = n_vec + 1 + n_mat + n_scale
    first_pool = 3 + n_in  # operand indices count the three scalar-prefetch operands
    aliases = {first_pool + i: 2 + i for i in range(2 * n_layers)}
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        in_specs=[pl.BlockSpec(memory_space=vmem)] * n_vec + [pl.BlockSpec(memory_space=pl.ANY)] * (
            1 + n_mat + n_scale + 2 * n_layers),
        out_specs=[pl.BlockSpec(memory_space=vmem)] * 2 + [pl.BlockSpec(memory_space=pl.ANY)] * (2 * n_layers),
        scratch_shapes=scratch,
    )
    pool_structs = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in list(k_pools) + list(v_pools)]
    compiler_params = None
    if not interpret and plan.vmem_limit_bytes is not None:
        compiler_params = pltpu.CompilerParams(vmem_limit_bytes=plan.vmem_limit_bytes)
    logits, ids, *pools = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((n_tok, spec.vocab), f32), jax.ShapeDtypeStruct((n_tok, 1), jnp.int32)]
        + pool_structs,
        grid_spec=grid_spec,
        input_output_aliases=aliases,
        compiler_params=compiler_params,
        interpret=interpret,
    )(tokens.reshape(-1).astype(jnp.int32), positions.reshape(-1).astype(jnp.int32), block_tables.astype(jnp.int32),
      *vectors, params["embed"], *weight_ops, *scale_ops, *k_pools, *v_pools)
    return (logits.reshape(b, t, spec.vocab), ids.reshape(b, t), list(pools[:n_layers]), list(pools[n_layers:]))
