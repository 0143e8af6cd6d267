"""What every family's `forward` shares: row groups, the layer loop with captured streams, the heads.

A forward call takes one group of rows (tokens, positions [b, t]) or, in a mixed step, a tuple
of groups (e.g. prefill chunks [bp, tp] and decode rows [bd, 1]) with one block table and one
logits-index array per group. Every matmul runs once over all groups' tokens, flattened to
[N, ...] (the weights are read once); only attention runs per group (`Rows.attend`). Logits
and hidden states come back per group, as tuples when the input was grouped.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from weld.models.common.cache import AttentionBatch, Cache
from weld.models.common.layers import linear
from weld.models.common.spec import WeightSpec


@dataclasses.dataclass(frozen=True)
class Rows:
    """The row groups of one forward call."""

    shapes: tuple[tuple[int, int], ...]  # (b, t) per group
    positions: tuple[jax.Array, ...]  # int32 [b, t] per group, -1 = padding
    tables: tuple[jax.Array, ...]  # int32 [b, max_pages] per group
    indices: tuple[jax.Array | None, ...]  # int32 [b, n] per group: which tokens get logits (None: all)
    slots: tuple[jax.Array, ...]  # int32 [b] per group: each row's recurrent-state slot (-1: none)
    grouped: bool
    num_page_groups: int = 1  # the tables hold this many page groups' tables side by side
    # rope -> its angles at every token's position: computed once per forward, used by every layer
    _angles: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, tokens, positions, batch: AttentionBatch, logits_indices=None,
           num_page_groups: int = 1) -> tuple["Rows", jax.Array]:
        """The rows, and every group's token ids flattened [N]."""
        grouped = isinstance(tokens, (tuple, list))
        groups = tuple(tokens) if grouped else (tokens,)
        pos = tuple(positions) if grouped else (positions,)
        tables = tuple(batch.block_tables) if grouped else (batch.block_tables,)
        if logits_indices is None:
            indices = (None,) * len(groups)
        else:
            indices = tuple(logits_indices) if grouped else (logits_indices,)
        if batch.state_slots is None:  # row i of all groups together uses slot i
            starts = itertools.accumulate((g.shape[0] for g in groups), initial=0)
            slots = tuple(jnp.arange(g.shape[0], dtype=jnp.int32) + s for g, s in zip(groups, starts))
        else:
            slots = tuple(batch.state_slots) if grouped else (batch.state_slots,)
        rows = cls(tuple(g.shape for g in groups), pos, tables, indices, slots, grouped, num_page_groups)
        return rows, jnp.concatenate([g.reshape(-1) for g in groups])

    @property
    def splits(self) -> list[int]:
        return list(itertools.accumulate(b * t for b, t in self.shapes))[:-1]

    @property
    def flat_positions(self) -> jax.Array:
        """int32 [N]: every token's position, groups one after another."""
        return jnp.concatenate([p.reshape(-1) for p in self.positions])

    def rope_angles(self, rope) -> tuple[jax.Array, jax.Array]:
        """`rope.angles` of every token's position ([1, N] -> cos, sin [1, N, 1, dim]), computed
        the first time a layer asks (a forward's layers share one rope, or a few)."""
        if rope not in self._angles:
            self._angles[rope] = rope.angles(self.flat_positions[None])
        return self._angles[rope]

    def attend(self, fn: Callable, state: Any, *per_token: jax.Array, page_group: int = 0) -> tuple[jax.Array, Any]:
        """Runs attention row group by row group: per_token arrays [N, ...] are split and reshaped
        to [b, t, ...]; fn(state, positions [b, t], tables of `page_group`, *arrays) -> (out [b, t, ...],
        state). Returns the outputs flattened back to [N, ...] and the final state."""
        def tables(g: int) -> jax.Array:
            width = self.tables[g].shape[1] // self.num_page_groups
            return self.tables[g][:, page_group * width:(page_group + 1) * width]

        return self._per_group(fn, state, per_token, tables)

    def recur(self, fn: Callable, state: Any, *per_token: jax.Array) -> tuple[jax.Array, Any]:
        """Runs a recurrent (linear-attention) layer row group by row group, as `attend` does:
        fn(state, positions [b, t], state slots [b], *arrays [b, t, ...]) -> (out [b, t, ...], state)."""
        return self._per_group(fn, state, per_token, lambda g: self.slots[g])

    def _per_group(self, fn: Callable, state: Any, per_token, per_group: Callable) -> tuple[jax.Array, Any]:
        outs = []
        parts = [jnp.split(x, self.splits) for x in per_token]
        for g, ((b, t), pos) in enumerate(zip(self.shapes, self.positions)):
            arrays = [p[g].reshape((b, t) + p[g].shape[1:]) for p in parts]
            out, state = fn(state, pos, per_group(g), *arrays)
            outs.append(out.reshape((b * t,) + out.shape[2:]))
        return (outs[0] if len(outs) == 1 else jnp.concatenate(outs)), state

    def outputs(self, hidden: jax.Array, states: jax.Array, head: Callable[[jax.Array], jax.Array]):
        """(logits f32, hidden) per group from the final hidden states [N, d] (head applied to the
        tokens the logits indices pick) and the states to return [N, s]."""
        all_logits, all_states = [], []
        for (b, t), hg, sg, idx in zip(self.shapes, jnp.split(hidden, self.splits), jnp.split(states, self.splits),
                                       self.indices):
            hg = hg.reshape(b, t, -1)
            selected = hg if idx is None else jnp.take_along_axis(hg, idx[:, :, None], axis=1)
            all_logits.append(head(selected).astype(jnp.float32))
            all_states.append(sg.reshape(b, t, -1))
        if self.grouped:
            return tuple(all_logits), tuple(all_states)
        return all_logits[0], all_states[0]


def embedding_specs(vocab_size: int, d: int, tied: bool) -> dict:
    """The input embedding [v, d] and, unless tied, the lm_head [v, d] (what `embed_tokens` and
    `lm_head` read). Whichever serves as the LM head is declared as one (quantized to 8 bits at least)."""
    if tied:
        return {"embed": WeightSpec((vocab_size, d), ("vocab", "embed"), quantize="head")}
    return {"embed": WeightSpec((vocab_size, d), ("vocab", "embed")),
            "lm_head": WeightSpec((vocab_size, d), ("vocab", "embed"), quantize="head")}


def decoder_specs(cfg: Any, mixer: Callable[[int], dict], norm_init: str = "ones") -> dict:
    """The weight tree of a pre-norm decoder: the embeddings (`embedding_specs`), then per layer
    i its `attn_norm`, the token mixer's weights mixer(i) (attention, MLA, linear attention),
    `mlp_norm` and its MLP (the experts of cfg.moe on cfg.sparse_layers, else a SwiGLU of
    cfg.intermediate_size), and the `final_norm`. norm_init: "zeros" for (1 + w) norms."""
    from weld.models.common import moe as moe_lib
    from weld.models.common.layers import gated_mlp_specs

    d = cfg.hidden_size
    norm = lambda: WeightSpec((d,), ("embed",), init=norm_init)  # noqa: E731

    def layer(i: int) -> dict:
        spec = {"attn_norm": norm(), **mixer(i), "mlp_norm": norm()}
        if i in cfg.sparse_layers:
            spec["moe"] = moe_lib.moe_specs(cfg.moe, d)
        else:
            spec.update(gated_mlp_specs(d, cfg.intermediate_size))
        return spec

    return {**embedding_specs(cfg.vocab_size, d, cfg.tie_word_embeddings),
            "layers": [layer(i) for i in range(cfg.num_layers)], "final_norm": norm()}


def embed_tokens(weights: dict, cfg: Any, tokens: jax.Array) -> jax.Array:
    """Input embeddings [..., d] of token ids: rows of weights["embed"] (the families that scale
    or otherwise change them write their own)."""
    return weights["embed"][tokens]


def lm_head(weights: dict, cfg: Any, hidden: jax.Array) -> jax.Array:
    """Logits [..., v] of final-normed hidden states: the lm_head, or the tied embedding."""
    return linear(hidden, weights.get("lm_head", weights["embed"]))


def prepare_layers(weights: dict, target: Any, projections: tuple[str, ...],
                   fuse: Callable[[dict], None] = lambda lw: None) -> dict:
    """The XLA weight forms of a family's tree, in place, layer by layer (memory peaks one layer
    above the model): fuse(layer) (its own fused matrices), an MoE layer's experts fused (both
    unless `target.fuse` is off), the
    `projections` and the shared expert in `layers.prepared_matrix`'s form for target (packed
    for the CPU kernels, or quantized at load); then the LM head."""
    from weld.models.common import moe as moe_lib
    from weld.models.common.layers import prepare_head, prepare_matrices

    for lw in weights["layers"]:
        if target.fuse:
            fuse(lw)
        prepare_matrices(lw, projections, target)
        if "moe" in lw:
            if target.fuse:
                moe_lib.fuse_experts(lw["moe"])
            moe_lib.prepare_experts(lw["moe"], target)
        jax.block_until_ready(lw)
    prepare_head(weights, target)
    return weights


def megakernel(cfg: Any) -> Callable:
    """The forward of the TPU decode megakernel for cfg (ValueError for what it does not cover)."""
    from weld.models import megakernel as adapter

    adapter.check_supported(cfg)
    return adapter.forward


def megakernel_weights(weights: dict, fuse: Callable[[dict], None] = lambda lw: None) -> dict:
    """The tree for the TPU megakernel, which streams the declared matrices themselves: fuse(layer)
    for the few small arrays it wants whole (KDA's three convs as one), and where a tied
    embedding was quantized as the LM head, a float copy of it for the embedding lookups
    ("embed_table")."""
    from weld.models.common import quant

    for lw in weights["layers"]:
        fuse(lw)
    if quant.is_quantized(weights["embed"]):
        weights["embed_table"] = jax.block_until_ready(weights["embed"].unpacked().astype(weights["final_norm"].dtype))
    return weights


def run_layers(x: jax.Array, layers: list, cache: Cache, block: Callable) -> tuple[jax.Array, Cache, list]:
    """x [N, d] through every layer: block(i, layer_weights, x, layer_state) -> (x, layer_state).
    Returns (x, the new cache, the residual stream after each layer)."""
    states, streams = [], []
    for i, lw in enumerate(layers):
        x, state = block(i, lw, x, cache.layers[i])
        states.append(state)
        streams.append(x)
    return x, Cache(layers=states), streams


def captured(streams: list, hidden: jax.Array, capture_layers: tuple[int, ...]) -> jax.Array:
    """The states a forward returns: the final hidden states [N, d] when capture_layers is empty,
    else the residual streams after those layers (the input of the next layer, before any norm),
    concatenated in that order [N, len(capture_layers) * d]; index num_layers stands for the
    final-normed hidden states themselves (what a DSpark drafter reads, and trains against)."""
    if not capture_layers:
        return hidden
    bad = [i for i in capture_layers if not 0 <= i <= len(streams)]
    if bad:
        raise ValueError(f"capture_layers {capture_layers} must lie in [0, {len(streams)}]")
    return jnp.concatenate([hidden if i == len(streams) else streams[i] for i in capture_layers], axis=-1)


def finish(rows: Rows, x: jax.Array, streams: list, capture_layers: tuple[int, ...], norm: Callable,
           head: Callable) -> tuple[Any, Any]:
    """A forward's last part: the final norm of the residual stream x [N, d], then per row group
    the logits (head of the tokens the logits indices pick) and the states to return (the final
    hidden states, or the captured streams)."""
    hidden = norm(x)
    return rows.outputs(hidden, captured(streams, hidden, capture_layers), head)
