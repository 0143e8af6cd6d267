"""The DeepSeek family: DeepSeek-V3 and Kimi K2 (`deepseek_v3`), DeepSeek-V2 (`deepseek_v2`, also
V2-Lite without q LoRA); llama.cpp calls them all `deepseek2`.

Pre-norm blocks of multi-head latent attention (`common.mla`: q and kv LoRA, decoupled RoPE
with YaRN, a latent paged cache of 512 + 64 values per token instead of per-head K/V, absorbed
decode) and an MLP that is dense for the first `first_k_dense_replace` layers and a mixture of
experts after: V3's router scores with a sigmoid, picks experts by score + a correction bias
(selection only) within the `topk_group` best of `n_group` groups, renormalises and scales by
`routed_scaling_factor`; V2's uses softmax scores and group-limited greedy selection. Shared
experts run on every token.

Not covered, refused at load naming the field: DeepSeek-V3.2's sparse indexer (`index_topk`),
`attention_bias`, `moe_layer_freq` other than 1, FP8 checkpoints (their dtype is refused).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import numpy as np

from weld.models.common import moe as moe_lib
from weld.models.common.cache import AttentionBatch, Cache, CacheSpec, LatentPages, PagedLatent
from weld.models.common.checkpoint import Convert, KeyMap
from weld.models.common import decoder
from weld.models.common.decoder import Rows, finish, run_layers
from weld.models.common.layers import fuse_gate_up, gated_mlp, rms_norm
from weld.models.common.metadata import config_check, gguf_eos_ids, gguf_reader, hf_bos_id, hf_eos_ids, hf_field
from weld.models.common.mla import MLA, mla_attention, mla_hf_keys, mla_scale, mla_specs, split_kv_b
from weld.models.common.rope import Rope, RopeScaling, rope_from_hf
from weld.models.common.spec import iter_specs

NAME = "deepseek"
HF_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "deepseek_v3", "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2", "deepseek_v2": "deepseek_v2",
}
GGUF_ARCHITECTURES = {"deepseek2": "deepseek_v3"}
# Config fields of variants weld does not implement -> what they are.
UNSUPPORTED_FIELDS = {"index_topk": "DeepSeek-V3.2's sparse attention indexer",
                      "index_n_heads": "DeepSeek-V3.2's sparse attention indexer"}


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters of one model. Frozen and hashable: it is a static argument of jit."""

    architecture: str  # deepseek_v3 | deepseek_v2
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    num_layers: int
    mla: MLA
    moe: moe_lib.MoE | None
    first_k_dense_replace: int = 0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 0  # multi-token-prediction layers stored after the model's (ignored, as HF does)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        config_check(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "max_position_embeddings"))
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(f"invalid {self.architecture} config: first_k_dense_replace "
                             f"({self.first_k_dense_replace}) must lie in [0, {self.num_layers}]")
        if self.moe is None and self.first_k_dense_replace < self.num_layers:
            raise ValueError(f"invalid {self.architecture} config: MoE layers without expert settings")

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace, self.num_layers)) if self.moe is not None else ()

    def num_params(self) -> int:
        return sum(math.prod(s.shape) for _, s in iter_specs(weight_specs(self)))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "Config":
        archs = config.get("architectures") or []
        arch = next((HF_ARCHITECTURES[a] for a in [*archs, config.get("model_type")] if a in HF_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or config.get('model_type')!r} for the deepseek family")
        text = config.get("text_config") or config
        for field, what in UNSUPPORTED_FIELDS.items():
            if text.get(field) is not None:
                raise ValueError(f"config.json sets {field!r}: {what} is not supported by weld")
        if text.get("attention_bias"):
            raise ValueError("config.json sets 'attention_bias': biases on MLA projections are not supported by weld")
        if int(text.get("moe_layer_freq", 1)) != 1:
            raise ValueError(f"config.json sets 'moe_layer_freq' to {text['moe_layer_freq']}: only 1 is supported")
        theta, scaling = rope_from_hf(text)
        nope, rope_dim = int(hf_field(text, "qk_nope_head_dim")), int(hf_field(text, "qk_rope_head_dim"))
        layers = int(hf_field(text, "num_hidden_layers"))
        v3 = arch == "deepseek_v3"
        mla = MLA(num_heads=int(hf_field(text, "num_attention_heads")), q_lora_rank=text.get("q_lora_rank"),
                  kv_lora_rank=int(hf_field(text, "kv_lora_rank")), nope_dim=nope, rope_dim=rope_dim,
                  v_dim=int(hf_field(text, "v_head_dim")),
                  rope=Rope(rope_dim, theta, scaling, int(text.get("max_position_embeddings", 4096)),
                            interleaved=bool(text.get("rope_interleave", True)) or not v3),
                  scale=mla_scale(nope, rope_dim, scaling))
        experts = text.get("n_routed_experts") or text.get("num_local_experts") or text.get("num_experts")
        moe = None
        if experts:
            if v3:
                router = "sigmoid_group"
            elif text.get("topk_method", "greedy") in ("greedy", "group_limited_greedy"):
                router = "softmax_group"
            else:
                raise ValueError(f"config.json sets 'topk_method' to {text['topk_method']!r}; weld supports greedy "
                                 "and group_limited_greedy for deepseek_v2")
            limited = v3 or text.get("topk_method") == "group_limited_greedy"
            moe = moe_lib.MoE(num_experts=int(experts), top_k=int(hf_field(text, "num_experts_per_tok")),
                              intermediate_size=int(hf_field(text, "moe_intermediate_size")), router=router,
                              norm_topk_prob=bool(text.get("norm_topk_prob", v3)) and v3,
                              routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
                              n_group=int(text.get("n_group") or 1) if limited else 1,
                              topk_group=int(text.get("topk_group") or 1) if limited else 1,
                              shared_intermediate_size=int(hf_field(text, "moe_intermediate_size"))
                              * int(text.get("n_shared_experts") or 0),
                              score_bias=v3)
        return cls(architecture=arch, vocab_size=int(hf_field(text, "vocab_size")),
                   hidden_size=int(hf_field(text, "hidden_size")),
                   intermediate_size=int(hf_field(text, "intermediate_size")), num_layers=layers, mla=mla, moe=moe,
                   first_k_dense_replace=int(text.get("first_k_dense_replace") or 0) if moe else layers,
                   rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                   max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   num_mtp_layers=int(text.get("num_nextn_predict_layers") or text.get("num_mtp_layers") or 0),
                   bos_token_id=hf_bos_id(config, text),
                   eos_token_ids=hf_eos_ids(config, text))

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                  read: Callable[[str], np.ndarray] | None = None) -> "Config":
        """llama.cpp's `deepseek2` metadata. Its converter writes MLA as one "MQA" head (key_length
        = r + dr, head_count_kv 1) and the per-head sizes as key/value_length_mla."""
        arch = metadata.get("general.architecture")
        if arch != "deepseek2":
            raise ValueError(f"unsupported GGUF architecture {arch!r} for the deepseek family")
        key = gguf_reader(metadata, arch)
        heads = int(key("attention.head_count"))
        r, dr = int(key("attention.kv_lora_rank")), int(key("rope.dimension_count"))
        qk_head = int(key("attention.key_length_mla", None) or key("attention.key_length"))
        v_dim = int(key("attention.value_length_mla", None) or key("attention.value_length"))
        nope = qk_head - dr
        scaling = RopeScaling()
        if key("rope.scaling.type", "none") == "yarn":
            log_mul = float(key("rope.scaling.yarn_log_multiplier", 0.0))
            scaling = RopeScaling(kind="yarn", factor=float(key("rope.scaling.factor")),
                                  original_max_position_embeddings=key("rope.scaling.original_context_length", None),
                                  beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
                                  beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)),
                                  mscale=log_mul / 0.1 if log_mul else None,
                                  mscale_all_dim=log_mul / 0.1 if log_mul else None)
        ctx = int(key("context_length", 4096))
        layers = int(key("block_count"))
        mla = MLA(num_heads=heads, q_lora_rank=key("attention.q_lora_rank", None), kv_lora_rank=r, nope_dim=nope,
                  rope_dim=dr, v_dim=v_dim,
                  rope=Rope(dr, float(key("rope.freq_base", 10000.0)), scaling, ctx, interleaved=True),
                  scale=mla_scale(nope, dr, scaling))
        moe = None
        if key("expert_count", 0):
            gating = int(key("expert_gating_func", 1))  # llama.cpp: 1 softmax, 2 sigmoid
            groups = int(key("expert_group_count", 1) or 1)
            moe = moe_lib.MoE(num_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
                              intermediate_size=int(key("expert_feed_forward_length")),
                              router="sigmoid_group" if gating == 2 else "softmax_group",
                              norm_topk_prob=bool(key("expert_weights_norm", False)) and gating == 2,
                              routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
                              n_group=groups, topk_group=int(key("expert_group_used_count", 1) or 1),
                              shared_intermediate_size=int(key("expert_feed_forward_length"))
                              * int(key("expert_shared_count", 0)),
                              score_bias="blk.{}.exp_probs_b.bias".format(layers - 1) in shapes)
        vocab = key("vocab_size", None) or len(metadata.get("tokenizer.ggml.tokens") or ())
        return cls(architecture="deepseek_v3" if moe is None or moe.router == "sigmoid_group" else "deepseek_v2",
                   vocab_size=int(vocab), hidden_size=int(key("embedding_length")),
                   intermediate_size=int(key("feed_forward_length")), num_layers=layers, mla=mla, moe=moe,
                   first_k_dense_replace=int(key("leading_dense_block_count", 0)) if moe else layers,
                   rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)), max_position_embeddings=ctx,
                   tie_word_embeddings="output.weight" not in shapes,
                   bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"), eos_token_ids=gguf_eos_ids(metadata))


# ----- weights -----

def weight_specs(cfg: Config) -> dict:
    return decoder.decoder_specs(cfg, lambda i: mla_specs(cfg.mla, cfg.hidden_size))


def hf_keymap(cfg: Config) -> KeyMap:
    layer, path = "model.layers.{i}.", ("layers", "{i}")
    attn = layer + "self_attn."
    keys: dict = {
        "model.embed_tokens.weight": ("embed",), "model.norm.weight": ("final_norm",), "lm_head.weight": ("lm_head",),
        layer + "input_layernorm.weight": path + ("attn_norm",),
        layer + "post_attention_layernorm.weight": path + ("mlp_norm",),
        **mla_hf_keys(attn, path, cfg.mla),
        layer + "mlp.gate_proj.weight": path + ("w_gate",), layer + "mlp.up_proj.weight": path + ("w_up",),
        layer + "mlp.down_proj.weight": path + ("w_down",),
        **moe_lib.hf_moe_keys(layer + "mlp.", path + ("moe",)),
    }
    # Multi-token-prediction layers follow the model's; transformers ignores them too.
    ignore = tuple(f"model.layers.{n}.*" for n in range(cfg.num_layers, cfg.num_layers + cfg.num_mtp_layers))
    ignore += ("model.rotary_emb.inv_freq",) + (("lm_head.weight",) if cfg.tie_word_embeddings else ())
    return KeyMap(keys, ignore)


def gguf_keymap(cfg: Config) -> KeyMap:
    """llama.cpp's deepseek2 names. Newer converters split kv_b into k_b [nh, r, dn] (transposed)
    and v_b [nh, dv, r]; older ones keep attn_kv_b."""
    blk, path = "blk.{i}.", ("layers", "{i}")
    keys: dict = {
        "token_embd.weight": ("embed",), "output_norm.weight": ("final_norm",), "output.weight": ("lm_head",),
        blk + "attn_norm.weight": path + ("attn_norm",), blk + "ffn_norm.weight": path + ("mlp_norm",),
        blk + "attn_q.weight": path + ("wq",), blk + "attn_q_a.weight": path + ("wq_a",),
        blk + "attn_q_a_norm.weight": path + ("q_a_norm",), blk + "attn_q_b.weight": path + ("wq_b",),
        blk + "attn_kv_a_mqa.weight": path + ("wkv_a",), blk + "attn_kv_a_norm.weight": path + ("kv_a_norm",),
        blk + "attn_kv_b.weight": Convert(split_kv_b(cfg.mla), path + ("w_uk",), path + ("w_uv",)),
        blk + "attn_k_b.weight": Convert(lambda w, _: np.swapaxes(w, 1, 2), path + ("w_uk",)),
        blk + "attn_v_b.weight": path + ("w_uv",),
        blk + "attn_output.weight": path + ("wo",),
        blk + "ffn_gate.weight": path + ("w_gate",), blk + "ffn_up.weight": path + ("w_up",),
        blk + "ffn_down.weight": path + ("w_down",),
        **moe_lib.gguf_moe_keys(blk, path + ("moe",)),
    }
    return KeyMap(keys)


def cache_spec(cfg: Config) -> CacheSpec:
    return CacheSpec(tuple(PagedLatent(cfg.mla.kv_lora_rank, cfg.mla.rope_dim) for _ in range(cfg.num_layers)))


PROJECTIONS = ("wq", "wq_a", "wq_b", "wkv_a", "wo", "w_gate_up", "w_down")


def prepare_weights(weights: dict, cfg: Config, target: Any) -> dict:
    """On the XLA backend: gate/up fused (dense MLPs, shared experts, expert stacks), and on the
    CPU with the native kernels, f32 projections and the LM head packed in panels."""
    if target.backend != "xla":
        return decoder.megakernel_weights(weights)
    return decoder.prepare_layers(weights, target, PROJECTIONS, fuse_gate_up)


# ----- forward -----

embed_tokens = decoder.embed_tokens  # plain embedding rows
lm_head = decoder.lm_head  # the lm_head or the tied embedding


def forward(weights: dict, cfg: Config, tokens, positions, cache: Cache, batch: AttentionBatch,
            logits_indices=None, capture_layers: tuple[int, ...] = ()):
    """The family contract (`weld.models.family.ModelFamily.forward`) on the latent paged cache."""
    rows, ids = Rows.of(tokens, positions, batch, logits_indices)

    def block(i: int, lw: dict, x: jax.Array, pages: LatentPages):
        attn, pages = mla_attention(cfg.mla, lw, rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps), rows, pages)
        x = x + attn
        y = rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps)
        return x + (moe_lib.moe_block(cfg.moe, lw["moe"], y) if "moe" in lw else gated_mlp(lw, y)), pages

    x, cache, streams = run_layers(embed_tokens(weights, cfg, ids), weights["layers"], cache, block)
    logits, states = finish(rows, x, streams, capture_layers,
                            lambda h: rms_norm(h, weights["final_norm"], cfg.rms_norm_eps),
                            lambda h: lm_head(weights, cfg, h))
    return logits, states, cache


megakernel = decoder.megakernel  # the TPU decode megakernel's forward (ValueError for what it does not cover)
