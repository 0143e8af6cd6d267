"""The Llama decoder family: Llama 1/2/3, SmolLM2, Mistral, Qwen2, Qwen3, and their MoE kin
Qwen3-MoE and Mixtral.

They differ only in switches on one architecture: RMSNorm pre-norm blocks, GQA attention with
rotary embeddings (optionally llama3/linear/yarn scaled), a SwiGLU MLP or a mixture of SwiGLU
experts. Qwen2 adds biases to q/k/v, Qwen3 RMS-normalises q and k per head, Mistral may use a
sliding window, small models tie the LM head to the embedding; Qwen3-MoE's layers are sparse
where `(i + 1) % decoder_sparse_step == 0` and i is not in `mlp_only_layers` (softmax top-k
router, renormalised when `norm_topk_prob`), Mixtral's all are (renormalised always).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import numpy as np

from weld.models.common import moe as moe_lib
from weld.models.common.cache import AttentionBatch, Cache, CacheSpec, KVPages, PagedKV
from weld.models.common.checkpoint import Convert, KeyMap, unpermute_rows
from weld.models.common import decoder
from weld.models.common.decoder import Rows, finish, run_layers
from weld.models.common.gqa import GQA, fuse_qkv, gqa_specs, self_attention
from weld.models.common.layers import fuse_gate_up, gated_mlp, prepare_head, prepare_matrices, rms_norm
from weld.models.common.metadata import (config_check, gguf_eos_ids, gguf_reader, gguf_vocab_size, hf_bos_id, hf_eos_ids,
                                          hf_field, single)
from weld.models.common.rope import Rope, RopeScaling, rope_from_hf
from weld.models.common.spec import iter_specs

NAME = "llama"
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "llama": "llama",
    "MistralForCausalLM": "mistral", "mistral": "mistral",
    "Qwen2ForCausalLM": "qwen2", "qwen2": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "qwen3": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe", "qwen3_moe": "qwen3_moe",
    "MixtralForCausalLM": "mixtral", "mixtral": "mixtral",
}
# llama.cpp's architecture names; a Mixtral GGUF is a "llama" one with expert tensors.
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen3moe": "qwen3_moe"}
# llama.cpp's converter interleaves the rows of Q and K (and their biases) for these: see
# `checkpoint.unpermute_rows`; qwen GGUFs are not permuted.
GGUF_PERMUTED = ("llama", "mistral", "mixtral")


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters of one model. Frozen and hashable: it is a static argument of jit."""

    architecture: str  # llama | mistral | qwen2 | qwen3 | qwen3_moe | mixtral
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF's rope_freqs (llama3), divides inv_freq
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # "full_attention" | "sliding_attention" per layer
    moe: moe_lib.MoE | None = None
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is `moe`
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check = config_check(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                    "num_kv_heads", "head_dim", "max_position_embeddings"))
        check(self.num_heads % self.num_kv_heads == 0,
              f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        check(self.head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        check(self.rope_scaling.kind in RopeScaling.SUPPORTED,
              f"rope scaling {self.rope_scaling.kind!r} is not supported (supported: {RopeScaling.SUPPORTED})")
        if self.rope_freq_factors is not None:
            check(len(self.rope_freq_factors) == self.head_dim // 2,
                  f"rope_freqs has {len(self.rope_freq_factors)} entries, expected {self.head_dim // 2}")
        if self.layer_types is not None:
            check(len(self.layer_types) == self.num_layers,
                  f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        check(all(0 <= i < self.num_layers for i in self.sparse_layers),
              f"sparse layers {self.sparse_layers} must lie in [0, {self.num_layers})")
        check(self.moe is not None or not self.sparse_layers, "sparse layers without an MoE config")

    # ----- parsing -----

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "Config":
        """Parses a HF `config.json` dict (both the rope_theta/rope_scaling and rope_parameters spellings)."""
        archs = config.get("architectures") or []
        model_type = config.get("model_type")
        arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
        if arch is None and model_type in HF_ARCHITECTURES:
            arch = HF_ARCHITECTURES[model_type]
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or model_type!r}; the llama family covers "
                             f"{sorted(a for a in HF_ARCHITECTURES if a[0].isupper())}")
        text = config.get("text_config") or config

        def req(key: str):
            if key not in text:
                raise ValueError(f"config.json has no {key!r} (architecture {arch})")
            return text[key]

        hidden = int(req("hidden_size"))
        heads = int(req("num_attention_heads"))
        layers = int(req("num_hidden_layers"))
        head_dim = text.get("head_dim") or hidden // heads
        theta, scaling = rope_from_hf(text)
        window = None
        layer_types = None
        if arch in ("mistral", "mixtral"):
            window = text.get("sliding_window")
        elif arch in ("qwen2", "qwen3", "qwen3_moe") and text.get("use_sliding_window"):
            window = text.get("sliding_window")
            max_window_layers = text.get("max_window_layers", 0)
            layer_types = tuple("sliding_attention" if i >= max_window_layers else "full_attention"
                                for i in range(layers))
        if text.get("layer_types") and window is not None:
            layer_types = tuple(text["layer_types"])
        if text.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported by weld's llama family")
        moe, sparse = _moe_from_hf(arch, text, layers)
        attention_bias = bool(text.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size") or (moe.intermediate_size if moe else 0)),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch in ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral") and attention_bias,
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            sliding_window=int(window) if window else None,
            layer_types=layer_types,
            moe=moe,
            sparse_layers=sparse,
            bos_token_id=hf_bos_id(config, text),
            eos_token_ids=hf_eos_ids(config, text),
        )

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                  read: Callable[[str], np.ndarray] | None = None) -> "Config":
        """Parses GGUF metadata; the tensors' `shapes` tell tied embeddings, biases, q/k norms and
        experts apart, and `read` fetches rope_freqs (llama3) when the file has it."""
        gguf_arch = metadata.get("general.architecture")
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; the llama family covers "
                             f"{sorted(GGUF_ARCHITECTURES)}")
        arch = GGUF_ARCHITECTURES[gguf_arch]
        key = gguf_reader(metadata, gguf_arch)
        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        kv_heads = single(key("attention.head_count_kv", heads), "head_count_kv")
        head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // heads)))
        scaling = RopeScaling()
        kind = key("rope.scaling.type", "none")
        if kind in ("linear", "yarn"):
            scaling = RopeScaling(kind=kind, factor=float(key("rope.scaling.factor")),
                                  original_max_position_embeddings=key("rope.scaling.original_context_length", None),
                                  beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
                                  beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)))
        elif kind not in ("none", None):
            raise ValueError(f"unsupported GGUF rope scaling {kind!r}")
        freqs = None
        if "rope_freqs.weight" in shapes and read is not None:
            freqs = tuple(float(x) for x in read("rope_freqs.weight").ravel())
        layers = int(key("block_count"))
        moe, sparse = None, ()
        experts = key("expert_count", 0)
        if experts:
            if arch == "llama":
                arch = "mixtral"
            moe = moe_lib.MoE(num_experts=int(experts), top_k=int(key("expert_used_count")),
                              intermediate_size=int(key("expert_feed_forward_length", key("feed_forward_length"))),
                              norm_topk_prob=bool(key("expert_weights_norm", True)))
            sparse = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes)
        return cls(
            architecture=arch,
            vocab_size=gguf_vocab_size(metadata, key),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length") if moe is None
                                  else key("feed_forward_length", moe.intermediate_size)),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rope_freq_factors=freqs,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings="output.weight" not in shapes,
            qkv_bias="blk.0.attn_q.bias" in shapes,
            o_bias="blk.0.attn_output.bias" in shapes,
            qk_norm="blk.0.attn_q_norm.weight" in shapes,
            sliding_window=key("attention.sliding_window", None) or None,
            moe=moe,
            sparse_layers=sparse,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=gguf_eos_ids(metadata),
        )

    # ----- derived -----

    @property
    def attention(self) -> GQA:
        return GQA(self.num_heads, self.num_kv_heads, self.head_dim, qkv_bias=self.qkv_bias, o_bias=self.o_bias,
                   qk_norm=self.qk_norm, norm_eps=self.rms_norm_eps)

    @property
    def rope(self) -> Rope:
        return Rope(self.head_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings,
                    self.rope_freq_factors)

    def window_for(self, layer: int) -> int | None:
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def num_params(self) -> int:
        return sum(math.prod(s.shape) for _, s in iter_specs(weight_specs(self)))


def _moe_from_hf(arch: str, text: Mapping[str, Any], layers: int) -> tuple[moe_lib.MoE | None, tuple[int, ...]]:
    if arch == "mixtral":
        moe = moe_lib.MoE(num_experts=int(hf_field(text, "num_local_experts", "num_experts")),
                          top_k=int(hf_field(text, "num_experts_per_tok")),
                          intermediate_size=int(hf_field(text, "intermediate_size")), norm_topk_prob=True)
        return moe, tuple(range(layers))
    if arch == "qwen3_moe":
        moe = moe_lib.MoE(num_experts=int(hf_field(text, "num_experts", "num_local_experts")),
                          top_k=int(hf_field(text, "num_experts_per_tok")),
                          intermediate_size=int(hf_field(text, "moe_intermediate_size")),
                          norm_topk_prob=bool(text.get("norm_topk_prob", False)))
        step = int(text.get("decoder_sparse_step", 1))
        dense = set(text.get("mlp_only_layers") or ())
        return moe, tuple(i for i in range(layers) if i not in dense and step > 0 and (i + 1) % step == 0)
    return None, ()


# ----- weights -----

def weight_specs(cfg: Config) -> dict:
    """The weight tree, declared once. Matrices are [out, in] as in HF and GGUF files; experts
    are stacked [experts, out, in]."""
    return decoder.decoder_specs(cfg, lambda i: gqa_specs(cfg.attention, cfg.hidden_size))


_ATTENTION_HF = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}


def hf_keymap(cfg: Config) -> KeyMap:
    """transformers' tensor names -> the weight tree."""
    layer = "model.layers.{i}."
    keys: dict = {
        "model.embed_tokens.weight": ("embed",),
        "model.norm.weight": ("final_norm",),
        "lm_head.weight": ("lm_head",),
        layer + "input_layernorm.weight": ("layers", "{i}", "attn_norm"),
        layer + "post_attention_layernorm.weight": ("layers", "{i}", "mlp_norm"),
        layer + "self_attn.q_norm.weight": ("layers", "{i}", "q_norm"),
        layer + "self_attn.k_norm.weight": ("layers", "{i}", "k_norm"),
        layer + "mlp.gate_proj.weight": ("layers", "{i}", "w_gate"),
        layer + "mlp.up_proj.weight": ("layers", "{i}", "w_up"),
        layer + "mlp.down_proj.weight": ("layers", "{i}", "w_down"),
    }
    for hf, ours in _ATTENTION_HF.items():
        keys[layer + f"self_attn.{hf}.weight"] = ("layers", "{i}", ours)
        keys[layer + f"self_attn.{hf}.bias"] = ("layers", "{i}", "b" + ours[1:])
    moe = ("layers", "{i}", "moe")
    if cfg.architecture == "mixtral":
        keys.update({
            layer + "block_sparse_moe.gate.weight": moe + ("router",),
            layer + "block_sparse_moe.experts.{e}.w1.weight": moe + ("w_gate",),
            layer + "block_sparse_moe.experts.{e}.w3.weight": moe + ("w_up",),
            layer + "block_sparse_moe.experts.{e}.w2.weight": moe + ("w_down",),
        })
    keys.update(moe_lib.hf_moe_keys(layer + "mlp.", moe))
    # Rotary tables that old checkpoints saved as buffers (weld recomputes them from the config).
    ignore = ("model.rotary_emb.inv_freq", layer + "self_attn.rotary_emb.inv_freq")
    if cfg.tie_word_embeddings:  # some tied checkpoints still store a copy of the embedding
        ignore += ("lm_head.weight",)
    return KeyMap(keys, ignore)


def gguf_keymap(cfg: Config) -> KeyMap:
    """llama.cpp's tensor names -> the weight tree (Q/K rows unpermuted where llama.cpp permutes them)."""
    blk = "blk.{i}."
    keys: dict = {
        "token_embd.weight": ("embed",),
        "output_norm.weight": ("final_norm",),
        "output.weight": ("lm_head",),
        blk + "attn_norm.weight": ("layers", "{i}", "attn_norm"),
        blk + "attn_v.weight": ("layers", "{i}", "wv"),
        blk + "attn_output.weight": ("layers", "{i}", "wo"),
        blk + "attn_v.bias": ("layers", "{i}", "bv"),
        blk + "attn_output.bias": ("layers", "{i}", "bo"),
        blk + "attn_q_norm.weight": ("layers", "{i}", "q_norm"),
        blk + "attn_k_norm.weight": ("layers", "{i}", "k_norm"),
        blk + "ffn_norm.weight": ("layers", "{i}", "mlp_norm"),
        blk + "ffn_gate.weight": ("layers", "{i}", "w_gate"),
        blk + "ffn_up.weight": ("layers", "{i}", "w_up"),
        blk + "ffn_down.weight": ("layers", "{i}", "w_down"),
        **moe_lib.gguf_moe_keys(blk, ("layers", "{i}", "moe")),
    }
    permuted = cfg.architecture in GGUF_PERMUTED
    for name, leaf, heads in (("attn_q", "q", "num_heads"), ("attn_k", "k", "num_kv_heads")):
        for kind in ("weight", "bias"):
            path = ("layers", "{i}", ("w" if kind == "weight" else "b") + leaf)
            keys[blk + f"{name}.{kind}"] = Convert(_unpermuter(heads), path, rows_only=True) if permuted else path
    # rope_freqs.weight is not a weight of the tree: `Config.from_gguf` reads it (rope_freq_factors).
    return KeyMap(keys, ("rope_freqs.weight",))


def _unpermuter(heads: str) -> Callable[[np.ndarray, Config], np.ndarray]:
    return lambda w, cfg: unpermute_rows(w, getattr(cfg, heads))


def cache_spec(cfg: Config) -> CacheSpec:
    return CacheSpec(tuple(PagedKV(cfg.num_kv_heads, cfg.head_dim, cfg.window_for(i)) for i in range(cfg.num_layers)))


def prepare_weights(weights: dict, cfg: Config, target: Any) -> dict:
    """The weight forms for where the model runs (`target`: a `weld.models.family.WeightTarget`):
    on the XLA backend, fused q/k/v and gate/up matrices (and expert stacks), then projections and
    the LM head (quantized at load) or, f32 on the CPU with the native kernels, packed
    in panels (`layers.prepared_matrix`). The megakernel reads the tree as declared, plus, when a
    tied embedding was quantized as the LM head, a float copy of it for its row lookups
    ("embed_table": the kernel fetches embedding rows by DMA)."""
    if target.backend == "xla":
        if target.fuse:
            fuse_projections(weights)
        prepare_projections(weights, target)
    else:
        decoder.megakernel_weights(weights)
    return weights


def fuse_projections(weights: dict) -> dict:
    """Concatenates each layer's q/k/v projections (and biases) into one `wqkv` [q + 2 kv, d]
    (`bqkv`) and gate/up into one `w_gate_up` [2 f, d] (experts: [E, 2 i, d]), in place, layer
    by layer (the old matrices are dropped as the new ones are made, so memory peaks one layer
    above the model).

    Same model, fewer and wider matmuls: on the 2-core CPU box a batch-1 decode step is ~12%
    faster (benchmarks/results/cpu_decode_2026-11-30.md). `forward` and the helpers below take
    either form. Not for the megakernel, whose weight stream names the separate matrices, nor
    for weights sharded along their output dimension (q, k and v would mix across shards).
    """
    for lw in weights["layers"]:
        fuse_qkv(lw)
        fuse_gate_up(lw)
        if "moe" in lw:
            moe_lib.fuse_experts(lw["moe"])
        jax.block_until_ready(lw)
    return weights


PROJECTIONS = ("wqkv", "w_gate_up", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def prepare_projections(weights: dict, target: Any) -> dict:
    """Each layer's projection matrices and the LM head in `layers.prepared_matrix`'s form for
    target, in place, layer by layer. A tied embedding is converted too (lookups gather its rows
    from the panels or blocks); an untied one only serves lookups and stays as it is. Expert
    stacks stay as loaded (float, or quantized at load)."""
    for lw in weights["layers"]:
        prepare_matrices(lw, PROJECTIONS, target)
        if "moe" in lw:
            moe_lib.prepare_experts(lw["moe"], target)
    prepare_head(weights, target)
    return weights


# ----- forward -----

embed_tokens = decoder.embed_tokens  # plain embedding rows
lm_head = decoder.lm_head  # the lm_head or the tied embedding


def forward(weights: dict, cfg: Config, tokens, positions, cache: Cache, batch: AttentionBatch,
            logits_indices=None, capture_layers: tuple[int, ...] = ()):
    """One forward pass over padded token chunks on the paged cache (the family contract,
    `weld.models.family.ModelFamily.forward`).

    tokens, positions: int32 [b, t]; position -1 marks padding. Each token's K/V is written
    to its page, then every token attends causally over its row's pages.
    logits_indices: int32 [b, n] picks which of the t tokens get logits (None: all).
    Returns logits f32 [b, n, v], final hidden states [b, t, d] and the updated cache; with
    capture_layers, the hidden states are instead the residual streams after those layers,
    concatenated [b, t, len(capture_layers) * d]. Row groups (tuples): see `decoder.Rows`.
    """
    spec = cache_spec(cfg)
    rows, ids = Rows.of(tokens, positions, batch, logits_indices, num_page_groups=len(spec.page_groups()))
    attention, rope = cfg.attention, cfg.rope

    def block(i: int, lw: dict, x: jax.Array, pages: KVPages):
        attn, pages = self_attention(attention, lw, rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps), rows, pages,
                                     rope=rope, window=cfg.window_for(i),
                                     page_group=spec.group_of(i))
        x = x + attn
        y = rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps)
        x = x + (moe_lib.moe_block(cfg.moe, lw["moe"], y) if "moe" in lw else gated_mlp(lw, y))
        return x, pages

    x, cache, streams = run_layers(embed_tokens(weights, cfg, ids), weights["layers"], cache, block)
    logits, states = finish(rows, x, streams, capture_layers,
                            lambda h: rms_norm(h, weights["final_norm"], cfg.rms_norm_eps),
                            lambda h: lm_head(weights, cfg, h))
    return logits, states, cache


megakernel = decoder.megakernel  # the TPU decode megakernel's forward (ValueError for what it does not cover)
