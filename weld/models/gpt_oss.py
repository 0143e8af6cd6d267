"""gpt-oss (`gpt_oss`; llama.cpp's `gpt-oss`).

Pre-norm blocks (plain RMSNorm) of GQA attention with biases on q/k/v/o, a learned sink logit
per head in every softmax (attention mass that weighs no value), sliding-window and full layers
alternating, YaRN RoPE (truncate False); and a mixture of experts in every layer: the router
takes the top-k of x Wᵀ + b and softmaxes over the k; each expert is a clamped SwiGLU with
biases,

    gate = min(g, 7),  up = clip(u, -7, 7),  out = ((up + 1) * gate * sigmoid(1.702 gate)) W_downᵀ + b_down.

transformers stores the experts x-major, gate_up_proj [E, d, 2 i] with gate and up interleaved
(even and odd columns) and down_proj [E, i, d]; the key map turns them into the [E, out, in]
stacks every family uses. Real checkpoints are MXFP4 (`*_blocks`, `*_scales`), refused as an
unsupported dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import numpy as np

from weld.models.common import moe as moe_lib
from weld.models.common.cache import AttentionBatch, Cache, CacheSpec, KVPages, PagedKV
from weld.models.common.checkpoint import Convert, KeyMap
from weld.models.common import decoder
from weld.models.common.decoder import Rows, finish, run_layers
from weld.models.common.gqa import GQA, fuse_qkv, gqa_specs, self_attention
from weld.models.common.layers import prepare_head, prepare_matrices, rms_norm
from weld.models.common.metadata import config_check, gguf_eos_ids, gguf_reader, hf_bos_id, hf_eos_ids, hf_field
from weld.models.common.rope import Rope, RopeScaling, rope_from_hf
from weld.models.common.spec import WeightSpec, iter_specs

NAME = "gpt_oss"
HF_ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss", "gpt_oss": "gpt_oss"}
GGUF_ARCHITECTURES = {"gpt-oss": "gpt_oss"}
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters of one model. Frozen and hashable: it is a static argument of jit."""

    architecture: str  # gpt_oss
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe: moe_lib.MoE
    layer_types: tuple[str, ...]
    sliding_window: int
    rope: Rope
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        config_check(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                            "sliding_window", "max_position_embeddings"))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"invalid gpt_oss config: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"invalid gpt_oss config: layer_types {self.layer_types} for {self.num_layers} layers")

    @property
    def attention(self) -> GQA:
        return GQA(self.num_heads, self.num_kv_heads, self.head_dim, qkv_bias=True, o_bias=True, sinks=True)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))

    def window_for(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def num_params(self) -> int:
        return sum(math.prod(s.shape) for _, s in iter_specs(weight_specs(self)))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "Config":
        text = config.get("text_config") or config
        if not text.get("attention_bias", True):
            raise ValueError("config.json sets 'attention_bias' to false: weld's gpt_oss expects biases")
        layers = int(hf_field(text, "num_hidden_layers"))
        hidden, heads = int(hf_field(text, "hidden_size")), int(hf_field(text, "num_attention_heads"))
        head_dim = int(text.get("head_dim") or hidden // heads)
        ctx = int(text.get("max_position_embeddings", 131072))
        if text.get("rope_parameters") is None and text.get("rope_scaling") is None:  # transformers' default
            theta, scaling = float(text.get("rope_theta", 150000.0)), RopeScaling(
                kind="yarn", factor=32.0, original_max_position_embeddings=4096, truncate=False)
        else:
            theta, scaling = rope_from_hf(text)
        moe = moe_lib.MoE(num_experts=int(hf_field(text, "num_local_experts", "num_experts")),
                          top_k=int(hf_field(text, "num_experts_per_tok", "experts_per_token")),
                          intermediate_size=int(hf_field(text, "intermediate_size")), router="topk_softmax",
                          activation="clamped_swiglu", expert_bias=True, router_bias=True,
                          swiglu_limit=float(text.get("swiglu_limit", 7.0)),
                          swiglu_alpha=float(text.get("swiglu_alpha", 1.702)))
        layer_types = tuple(text.get("layer_types") or (SLIDING if (i + 1) % 2 else FULL for i in range(layers)))
        return cls(architecture="gpt_oss", vocab_size=int(hf_field(text, "vocab_size")), hidden_size=hidden,
                   num_layers=layers, num_heads=heads, num_kv_heads=int(text.get("num_key_value_heads") or heads),
                   head_dim=head_dim, moe=moe, layer_types=layer_types,
                   sliding_window=int(text.get("sliding_window") or 128), rope=Rope(head_dim, theta, scaling, ctx),
                   rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)), max_position_embeddings=ctx,
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   bos_token_id=hf_bos_id(config, text),
                   eos_token_ids=hf_eos_ids(config, text))

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                  read: Callable[[str], np.ndarray] | None = None) -> "Config":
        arch = metadata.get("general.architecture")
        if arch != "gpt-oss":
            raise ValueError(f"unsupported GGUF architecture {arch!r} for the gpt_oss family")
        key = gguf_reader(metadata, arch)
        layers, hidden, heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden // heads))
        ctx = int(key("context_length", 131072))
        scaling = RopeScaling()
        if key("rope.scaling.type", "none") == "yarn":
            scaling = RopeScaling(kind="yarn", factor=float(key("rope.scaling.factor")), truncate=False,
                                  original_max_position_embeddings=key("rope.scaling.original_context_length", None),
                                  beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
                                  beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)))
        moe = moe_lib.MoE(num_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
                          intermediate_size=int(key("expert_feed_forward_length")), router="topk_softmax",
                          activation="clamped_swiglu", expert_bias=True, router_bias=True)
        vocab = key("vocab_size", None) or len(metadata.get("tokenizer.ggml.tokens") or ())
        kv_heads = key("attention.head_count_kv", heads)
        return cls(architecture="gpt_oss", vocab_size=int(vocab), hidden_size=hidden, num_layers=layers,
                   num_heads=heads, num_kv_heads=int(kv_heads[0] if isinstance(kv_heads, (list, tuple)) else kv_heads),
                   head_dim=head_dim, moe=moe,
                   layer_types=tuple(SLIDING if (i + 1) % 2 else FULL for i in range(layers)),
                   sliding_window=int(key("attention.sliding_window", 128)),
                   rope=Rope(head_dim, float(key("rope.freq_base", 150000.0)), scaling, ctx),
                   rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)), max_position_embeddings=ctx,
                   tie_word_embeddings="output.weight" not in shapes,
                   bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"), eos_token_ids=gguf_eos_ids(metadata))


# ----- weights -----

def weight_specs(cfg: Config) -> dict:
    d = cfg.hidden_size

    def layer() -> dict:
        return {"attn_norm": WeightSpec((d,), ("embed",), init="ones"), **gqa_specs(cfg.attention, d),
                "mlp_norm": WeightSpec((d,), ("embed",), init="ones"), "moe": moe_lib.moe_specs(cfg.moe, d)}

    return {**decoder.embedding_specs(cfg.vocab_size, d, cfg.tie_word_embeddings),
            "layers": [layer() for _ in range(cfg.num_layers)],
            "final_norm": WeightSpec((d,), ("embed",), init="ones")}


def _x_major_gate_up(w: np.ndarray, _cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """gate_up_proj [E, d, 2 i] (gate even columns, up odd) -> gate, up [E, i, d]."""
    w = np.swapaxes(w, 1, 2)
    return w[:, 0::2], w[:, 1::2]


def _interleaved_bias(b: np.ndarray, _cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    return b[..., 0::2], b[..., 1::2]


def hf_keymap(cfg: Config) -> KeyMap:
    layer, path = "model.layers.{i}.", ("layers", "{i}")
    moe = path + ("moe",)
    keys: dict = {
        "model.embed_tokens.weight": ("embed",), "model.norm.weight": ("final_norm",), "lm_head.weight": ("lm_head",),
        layer + "input_layernorm.weight": path + ("attn_norm",),
        layer + "post_attention_layernorm.weight": path + ("mlp_norm",),
        layer + "self_attn.sinks": path + ("sinks",),
        layer + "mlp.router.weight": moe + ("router",), layer + "mlp.router.bias": moe + ("router_bias",),
        layer + "mlp.experts.gate_up_proj": Convert(_x_major_gate_up, moe + ("w_gate",), moe + ("w_up",)),
        layer + "mlp.experts.gate_up_proj_bias": Convert(_interleaved_bias, moe + ("b_gate",), moe + ("b_up",)),
        layer + "mlp.experts.down_proj": Convert(lambda w, _: np.swapaxes(w, 1, 2), moe + ("w_down",)),
        layer + "mlp.experts.down_proj_bias": moe + ("b_down",),
    }
    for hf, ours in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o")):
        keys[layer + f"self_attn.{hf}.weight"] = path + (f"w{ours}",)
        keys[layer + f"self_attn.{hf}.bias"] = path + (f"b{ours}",)
    return KeyMap(keys, ("lm_head.weight",) if cfg.tie_word_embeddings else ())


def gguf_keymap(cfg: Config) -> KeyMap:
    blk, path = "blk.{i}.", ("layers", "{i}")
    moe = path + ("moe",)
    keys: dict = {
        "token_embd.weight": ("embed",), "output_norm.weight": ("final_norm",), "output.weight": ("lm_head",),
        blk + "attn_norm.weight": path + ("attn_norm",), blk + "post_attention_norm.weight": path + ("mlp_norm",),
        blk + "attn_sinks.weight": path + ("sinks",),
        blk + "ffn_gate_inp.weight": moe + ("router",), blk + "ffn_gate_inp.bias": moe + ("router_bias",),
    }
    for name, ours in (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v"), ("attn_output", "o")):
        keys[blk + f"{name}.weight"] = path + (f"w{ours}",)
        keys[blk + f"{name}.bias"] = path + (f"b{ours}",)
    for name, ours in (("gate", "gate"), ("up", "up"), ("down", "down")):
        keys[blk + f"ffn_{name}_exps.weight"] = moe + (f"w_{ours}",)
        keys[blk + f"ffn_{name}_exps.bias"] = moe + (f"b_{ours}",)
    return KeyMap(keys)


def cache_spec(cfg: Config) -> CacheSpec:
    return CacheSpec(tuple(PagedKV(cfg.num_kv_heads, cfg.head_dim, cfg.window_for(i)) for i in range(cfg.num_layers)))


def prepare_weights(weights: dict, cfg: Config, target: Any) -> dict:
    """On XLA: q/k/v fused, expert gate/up stacked together; on the CPU with the native kernels,
    f32 attention projections and the LM head packed. The megakernel streams the declared
    matrices (`decoder.megakernel_weights`)."""
    if target.backend != "xla":
        return decoder.megakernel_weights(weights)
    for lw in weights["layers"]:
        if target.fuse:
            fuse_qkv(lw)
            moe_lib.fuse_experts(lw["moe"])
        prepare_matrices(lw, ("wqkv", "wo"), target)
        moe_lib.prepare_experts(lw["moe"], target)
        jax.block_until_ready(lw)
    prepare_head(weights, target)
    return weights


# ----- forward -----

embed_tokens = decoder.embed_tokens  # plain embedding rows
lm_head = decoder.lm_head  # the lm_head or the tied embedding


def forward(weights: dict, cfg: Config, tokens, positions, cache: Cache, batch: AttentionBatch,
            logits_indices=None, capture_layers: tuple[int, ...] = ()):
    """The family contract (`weld.models.family.ModelFamily.forward`)."""
    spec = cache_spec(cfg)
    rows, ids = Rows.of(tokens, positions, batch, logits_indices, num_page_groups=len(spec.page_groups()))
    attention = cfg.attention

    def block(i: int, lw: dict, x: jax.Array, pages: KVPages):
        attn, pages = self_attention(attention, lw, rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps), rows, pages,
                                     rope=cfg.rope, window=cfg.window_for(i),
                                     page_group=spec.group_of(i))
        x = x + attn
        return x + moe_lib.moe_block(cfg.moe, lw["moe"], rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps)), pages

    x, cache, streams = run_layers(embed_tokens(weights, cfg, ids), weights["layers"], cache, block)
    logits, states = finish(rows, x, streams, capture_layers,
                            lambda h: rms_norm(h, weights["final_norm"], cfg.rms_norm_eps),
                            lambda h: lm_head(weights, cfg, h))
    return logits, states, cache


megakernel = decoder.megakernel  # the TPU decode megakernel's forward (ValueError for what it does not cover)
