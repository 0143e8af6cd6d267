"""Kimi Linear (`kimi_linear`): Kimi Delta Attention layers between MLA layers without RoPE.

    h  = x + Mixer(RMSNorm(x))      Mixer: KDA ("linear_attention") or MLA ("full_attention")
    x' = h + MLP(RMSNorm(h))        a SwiGLU (the first layers) or DeepSeek-V3's experts

KDA (`common.linear_attention`, kind "kda") is the gated delta rule with a decay per key channel
from a low-rank projection, separate short convs on q, k and v, and a sigmoid-gated RMSNorm on
the output. The full layers are MLA (`common.mla`, absorbed, on the latent cache) with NoPE: the
k_rot slice stays un-rotated and shared by the heads, the scale is (dn + dr)^-1/2. The MoE is
DeepSeek-V3's (sigmoid scores, a selection-only correction bias, group-limited top-k,
renormalised, times routed_scaling_factor) plus shared experts. Layer and MLP kinds come from
`layer_types` / `mlp_layer_types`, or the checkpoint's `linear_attn_config` (1-indexed layer
lists) and `first_k_dense_replace`; config.json may use the checkpoint's alias keys
(num_experts, num_experts_per_token, num_expert_group, moe_renormalize, num_shared_experts,
model_max_length).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import numpy as np

from weld.models.common import decoder
from weld.models.common import linear_attention as la
from weld.models.common import moe as moe_lib
from weld.models.common.cache import AttentionBatch, Cache, CacheSpec, PagedLatent
from weld.models.common.checkpoint import Convert, KeyMap
from weld.models.common.decoder import Rows, finish, run_layers
from weld.models.common.layers import fuse_gate_up, gated_mlp, rms_norm
from weld.models.common.metadata import (config_check, gguf_eos_ids, gguf_reader, gguf_vocab_size, hf_bos_id, hf_eos_ids,
                                          hf_field)
from weld.models.common.mla import MLA, mla_attention, mla_hf_keys, mla_specs
from weld.models.common.spec import iter_specs

NAME = "kimi_linear"
HF_ARCHITECTURES = {"KimiLinearForCausalLM": "kimi_linear", "kimi_linear": "kimi_linear"}
GGUF_ARCHITECTURES = {"kimi-linear": "kimi_linear"}
LINEAR, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters of one model. Frozen and hashable: it is a static argument of jit."""

    architecture: str  # kimi_linear
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense MLPs
    num_layers: int
    layer_types: tuple[str, ...]
    linear: la.DeltaNet
    mla: MLA
    moe: moe_lib.MoE | None = None
    sparse_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check = config_check(self, ("vocab_size", "hidden_size", "num_layers", "max_position_embeddings"))
        check(len(self.layer_types) == self.num_layers,
              f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {LINEAR, FULL})
        check(not bad, f"unknown layer types {bad} (known: {LINEAR}, {FULL})")
        check(self.linear.kind == "kda", "the linear layers are KDA")
        check(all(0 <= i < self.num_layers for i in self.sparse_layers),
              f"sparse layers {self.sparse_layers} must lie in [0, {self.num_layers})")
        check(self.moe is not None or not self.sparse_layers, "sparse layers without an MoE config")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "Config":
        text = config.get("text_config") or config
        layers = int(hf_field(text, "num_hidden_layers"))
        linear_cfg = text.get("linear_attn_config") or {}
        layer_types = text.get("layer_types")
        if not layer_types and "full_attn_layers" in linear_cfg:
            full = {int(n) - 1 for n in linear_cfg["full_attn_layers"]}  # 1-indexed in the checkpoint
            layer_types = [FULL if i in full else LINEAR for i in range(layers)]
        if not layer_types:
            layer_types = [FULL if i and i % 4 == 0 else LINEAR for i in range(layers)]
        head_dim = int(linear_cfg.get("head_dim") or hf_field(text, "linear_head_dim"))
        heads = int(linear_cfg.get("num_heads") or hf_field(text, "linear_num_heads"))
        eps = float(text.get("rms_norm_eps", 1e-5))
        net = la.DeltaNet(num_k_heads=heads, num_v_heads=heads, k_dim=head_dim, v_dim=head_dim,
                          conv_width=int(linear_cfg.get("short_conv_kernel_size")
                                         or text.get("linear_conv_kernel_dim", 4)),
                          norm_eps=eps, kind="kda",
                          gate_lower_bound=_optional_float(linear_cfg.get("lower_bound", text.get("linear_lower_bound"))))
        nope, rope_dim = int(hf_field(text, "qk_nope_head_dim")), int(hf_field(text, "qk_rope_head_dim"))
        mla = MLA(num_heads=int(hf_field(text, "num_attention_heads")), q_lora_rank=text.get("q_lora_rank"),
                  kv_lora_rank=int(hf_field(text, "kv_lora_rank")), nope_dim=nope, rope_dim=rope_dim,
                  v_dim=int(hf_field(text, "v_head_dim")), rope=None, scale=(nope + rope_dim) ** -0.5)
        experts = text.get("num_experts") or text.get("num_local_experts")
        moe, sparse = None, ()
        if experts:
            inter = int(hf_field(text, "moe_intermediate_size"))
            moe = moe_lib.MoE(num_experts=int(experts),
                              top_k=int(hf_field(text, "num_experts_per_token", "num_experts_per_tok")),
                              intermediate_size=inter, router="sigmoid_group",
                              norm_topk_prob=bool(text.get("moe_renormalize", text.get("norm_topk_prob", True))),
                              routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
                              n_group=int(text.get("num_expert_group") or text.get("n_group") or 1),
                              topk_group=int(text.get("topk_group") or 1),
                              shared_intermediate_size=inter * int(text.get("num_shared_experts")
                                                                   or text.get("n_shared_experts") or 0),
                              score_bias=True)
            kinds = text.get("mlp_layer_types")
            if kinds:
                sparse = tuple(i for i, kind in enumerate(kinds) if kind == "sparse")
            else:
                sparse = tuple(range(int(text.get("first_k_dense_replace", 1)), layers))
        return cls(architecture="kimi_linear", vocab_size=int(hf_field(text, "vocab_size")),
                   hidden_size=int(hf_field(text, "hidden_size")),
                   intermediate_size=int(text.get("intermediate_size") or 0), num_layers=layers,
                   layer_types=tuple(layer_types), linear=net, mla=mla, moe=moe, sparse_layers=sparse,
                   rms_norm_eps=eps,
                   max_position_embeddings=int(text.get("model_max_length") or text.get("max_position_embeddings")
                                               or 4096),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   bos_token_id=hf_bos_id(config, text), eos_token_ids=hf_eos_ids(config, text))

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                  read: Callable[[str], np.ndarray] | None = None) -> "Config":
        """llama.cpp's `kimi-linear` metadata: a layer is MLA where attention.head_count_kv is > 0
        and KDA where it is 0; the KDA heads' size is kda.head_dim (their count follows from the
        q projection's rows); MLA's sizes as for deepseek2 (key_length_mla = nope + rope dims)."""
        arch = metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r} for the kimi_linear family")
        key = gguf_reader(metadata, arch)
        layers = int(key("block_count"))
        kv_heads = key("attention.head_count_kv")
        kv_heads = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else [kv_heads] * layers
        layer_types = tuple(FULL if int(n) > 0 else LINEAR for n in kv_heads)
        head_dim = int(key("kda.head_dim"))
        first = layer_types.index(LINEAR) if LINEAR in layer_types else None
        q_rows = shapes.get(f"blk.{first}.attn_q.weight", (0,))[0] if first is not None else head_dim
        if head_dim <= 0 or q_rows <= 0 or q_rows % head_dim:
            raise ValueError(f"GGUF {arch}: the first KDA layer's attn_q ({q_rows} rows) is not a positive multiple of "
                             f"kda.head_dim ({head_dim})")
        heads = q_rows // head_dim
        eps = float(key("attention.layer_norm_rms_epsilon", 1e-5))
        net = la.DeltaNet(num_k_heads=heads, num_v_heads=heads, k_dim=head_dim, v_dim=head_dim,
                          conv_width=int(key("ssm.conv_kernel")), norm_eps=eps, kind="kda")
        rope_dim = int(key("rope.dimension_count"))
        nope = int(key("attention.key_length_mla")) - rope_dim
        mla = MLA(num_heads=int(key("attention.head_count")), q_lora_rank=key("attention.q_lora_rank", None),
                  kv_lora_rank=int(key("attention.kv_lora_rank")), nope_dim=nope, rope_dim=rope_dim,
                  v_dim=int(key("attention.value_length_mla")), rope=None, scale=(nope + rope_dim) ** -0.5)
        moe, sparse = None, ()
        if key("expert_count", 0):
            inter = int(key("expert_feed_forward_length"))
            moe = moe_lib.MoE(num_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
                              intermediate_size=inter, router="sigmoid_group",
                              norm_topk_prob=bool(key("expert_weights_norm", True)),
                              routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
                              n_group=int(key("expert_group_count", 1) or 1),
                              topk_group=int(key("expert_group_used_count", 1) or 1),
                              shared_intermediate_size=inter * int(key("expert_shared_count", 0)),
                              score_bias=True)
            sparse = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes)
        return cls(architecture="kimi_linear", vocab_size=gguf_vocab_size(metadata, key),
                   hidden_size=int(key("embedding_length")), intermediate_size=int(key("feed_forward_length", 0)),
                   num_layers=layers, layer_types=layer_types, linear=net, mla=mla, moe=moe, sparse_layers=sparse,
                   rms_norm_eps=eps, max_position_embeddings=int(key("context_length", 4096)),
                   tie_word_embeddings="output.weight" not in shapes,
                   bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"), eos_token_ids=gguf_eos_ids(metadata))

    def num_params(self) -> int:
        return sum(math.prod(s.shape) for _, s in iter_specs(weight_specs(self)))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


# ----- weights -----

def weight_specs(cfg: Config) -> dict:
    return decoder.decoder_specs(cfg, lambda i: la.delta_net_specs(cfg.linear, cfg.hidden_size)
                                 if cfg.layer_types[i] == LINEAR else mla_specs(cfg.mla, cfg.hidden_size))


def _flat(w: np.ndarray, _cfg: Config) -> np.ndarray:
    return w.reshape(-1)


def _conv(w: np.ndarray, _cfg: Config) -> np.ndarray:
    return w.reshape(-1, w.shape[-1])  # HF [C, 1, K], GGUF [1, C, 1, K] -> [C, K]


def hf_keymap(cfg: Config) -> KeyMap:
    layer, path = "model.layers.{i}.", ("layers", "{i}")
    attn, mlp = layer + "self_attn.", layer + "block_sparse_moe."
    moe = path + ("moe",)
    keys: dict = {
        "model.embed_tokens.weight": ("embed",), "model.norm.weight": ("final_norm",), "lm_head.weight": ("lm_head",),
        layer + "input_layernorm.weight": path + ("attn_norm",),
        layer + "post_attention_layernorm.weight": path + ("mlp_norm",),
        **mla_hf_keys(attn, path, cfg.mla),
        attn + "k_proj.weight": path + ("w_k",), attn + "v_proj.weight": path + ("w_v",),
        attn + "b_proj.weight": path + ("w_b",),
        attn + "f_a_proj.weight": path + ("w_fa",), attn + "f_b_proj.weight": path + ("w_fb",),
        attn + "g_a_proj.weight": path + ("w_ga",), attn + "g_b_proj.weight": path + ("w_gb",),
        attn + "A_log": Convert(_flat, path + ("A_log",)), attn + "dt_bias": Convert(_flat, path + ("dt_bias",)),
        attn + "o_norm.weight": path + ("norm",),
        attn + "q_conv1d.weight": Convert(_conv, path + ("conv_q",)),
        attn + "k_conv1d.weight": Convert(_conv, path + ("conv_k",)),
        attn + "v_conv1d.weight": Convert(_conv, path + ("conv_v",)),
        mlp + "gate_proj.weight": path + ("w_gate",), mlp + "up_proj.weight": path + ("w_up",),
        mlp + "down_proj.weight": path + ("w_down",),
        mlp + "experts.{e}.w1.weight": moe + ("w_gate",), mlp + "experts.{e}.w3.weight": moe + ("w_up",),
        mlp + "experts.{e}.w2.weight": moe + ("w_down",),
        **moe_lib.hf_moe_keys(mlp, moe),
    }
    # KDA's q_proj and o_proj have MLA's names: each layer's type says which leaf they fill.
    for i, kind in enumerate(cfg.layer_types):
        if kind == LINEAR:
            keys[f"model.layers.{i}.self_attn.q_proj.weight"] = ("layers", i, "w_q")
            keys[f"model.layers.{i}.self_attn.o_proj.weight"] = ("layers", i, "w_out")
    keys = dict(sorted(keys.items(), key=lambda item: "{i}" in item[0]))  # the layer-specific names first
    ignore = ("model.rotary_emb.inv_freq",) + (("lm_head.weight",) if cfg.tie_word_embeddings else ())
    return KeyMap(keys, ignore)


def _neg_log(w: np.ndarray, _cfg: Config) -> np.ndarray:
    return np.log(-w).reshape(-1)  # llama.cpp stores A = -exp(A_log)


def gguf_keymap(cfg: Config) -> KeyMap:
    """llama.cpp's kimi-linear names. Its converter stores A as -exp(A_log) [1, 1, H, 1], the convs
    as [1, C, 1, K], kv_b split into k_b [nh, r, dn] (transposed) and v_b [nh, dv, r]; KDA's q and
    output projections share MLA's names (attn_q, attn_output), told apart by the layer's type."""
    blk, path = "blk.{i}.", ("layers", "{i}")
    keys: dict = {
        "token_embd.weight": ("embed",), "output_norm.weight": ("final_norm",), "output.weight": ("lm_head",),
        blk + "attn_norm.weight": path + ("attn_norm",), blk + "ffn_norm.weight": path + ("mlp_norm",),
        blk + "attn_kv_a_mqa.weight": path + ("wkv_a",), blk + "attn_kv_a_norm.weight": path + ("kv_a_norm",),
        blk + "attn_q_a.weight": path + ("wq_a",), blk + "attn_q_a_norm.weight": path + ("q_a_norm",),
        blk + "attn_q_b.weight": path + ("wq_b",),
        blk + "attn_k_b.weight": Convert(lambda w, _: np.swapaxes(w, 1, 2), path + ("w_uk",)),
        blk + "attn_v_b.weight": path + ("w_uv",),
        blk + "attn_k.weight": path + ("w_k",), blk + "attn_v.weight": path + ("w_v",),
        blk + "ssm_beta.weight": path + ("w_b",), blk + "ssm_f_a.weight": path + ("w_fa",),
        blk + "ssm_f_b.weight": path + ("w_fb",), blk + "ssm_g_a.weight": path + ("w_ga",),
        blk + "ssm_g_b.weight": path + ("w_gb",), blk + "ssm_a": Convert(_neg_log, path + ("A_log",)),
        blk + "ssm_dt.bias": path + ("dt_bias",), blk + "ssm_norm.weight": path + ("norm",),
        blk + "ffn_gate.weight": path + ("w_gate",), blk + "ffn_up.weight": path + ("w_up",),
        blk + "ffn_down.weight": path + ("w_down",),
        **moe_lib.gguf_moe_keys(blk, path + ("moe",)),
    }
    for stream in "qkv":
        keys[blk + f"ssm_conv1d_{stream}.weight"] = Convert(_conv, path + (f"conv_{stream}",))
    for i, kind in enumerate(cfg.layer_types):
        linear = kind == LINEAR
        keys[f"blk.{i}.attn_q.weight"] = ("layers", i, "w_q" if linear else "wq")
        keys[f"blk.{i}.attn_output.weight"] = ("layers", i, "w_out" if linear else "wo")
    return KeyMap(dict(sorted(keys.items(), key=lambda item: "{i}" in item[0])))


def cache_spec(cfg: Config) -> CacheSpec:
    """The latent pages for the MLA layers, a recurrent-state slot per sequence for the KDA ones."""
    return CacheSpec(tuple(cfg.linear.cache() if kind == LINEAR else PagedLatent(cfg.mla.kv_lora_rank,
                                                                                 cfg.mla.rope_dim)
                           for kind in cfg.layer_types))


PROJECTIONS = ("wq", "wq_a", "wq_b", "wkv_a", "wo", "w_gate_up", "w_gate", "w_up", "w_down", "w_in",
               *la.INPUT_NAMES, "w_out")


def prepare_weights(weights: dict, cfg: Config, target: Any) -> dict:
    """On XLA: the KDA layers' input projections and convs fused, gate/up fused (dense MLPs,
    shared and routed experts), then the projections in `layers.prepared_matrix`'s form. The
    megakernel streams them as declared, with the three convs as one (their channels grouped
    for tensor parallelism: `DeltaNet.shards`)."""
    if target.backend != "xla":
        return decoder.megakernel_weights(weights, lambda lw: la.group_channels(cfg.linear, lw))

    def fuse(lw: dict) -> None:
        if "w_out" in lw:  # a KDA layer
            la.fuse_inputs(cfg.linear, lw)
        fuse_gate_up(lw)

    return decoder.prepare_layers(weights, target, PROJECTIONS, fuse)


# ----- forward -----

embed_tokens = decoder.embed_tokens
lm_head = decoder.lm_head


def forward(weights: dict, cfg: Config, tokens, positions, cache: Cache, batch: AttentionBatch,
            logits_indices=None, capture_layers: tuple[int, ...] = ()):
    """The family contract (`weld.models.family.ModelFamily.forward`)."""
    rows, ids = Rows.of(tokens, positions, batch, logits_indices)
    eps = cfg.rms_norm_eps

    def block(i: int, lw: dict, x: jax.Array, state):
        y = rms_norm(x, lw["attn_norm"], eps)
        if cfg.layer_types[i] == LINEAR:
            out, state = la.delta_net_layer(cfg.linear, lw, y, rows, state)
        else:
            out, state = mla_attention(cfg.mla, lw, y, rows, state)
        x = x + out
        y = rms_norm(x, lw["mlp_norm"], eps)
        return x + (moe_lib.moe_block(cfg.moe, lw["moe"], y) if "moe" in lw else gated_mlp(lw, y)), state

    x, cache, streams = run_layers(embed_tokens(weights, cfg, ids), weights["layers"], cache, block)
    logits, states = finish(rows, x, streams, capture_layers, lambda h: rms_norm(h, weights["final_norm"], eps),
                            lambda h: lm_head(weights, cfg, h))
    return logits, states, cache


megakernel = decoder.megakernel  # the TPU decode megakernel's forward (ValueError for what it does not cover)
