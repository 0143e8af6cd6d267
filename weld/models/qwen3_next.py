"""Hybrid Gated DeltaNet models: Qwen3-Next (`qwen3_next`) and Qwen3.5, dense (`qwen3_5_text`)
and MoE (`qwen3_5_moe_text`).

    h  = x + Mixer(RMSNorm_(1+w)(x))        Mixer: Gated DeltaNet ("linear_attention") or gated
    x' = h + MLP(RMSNorm_(1+w)(h))          full attention ("full_attention"), per `layer_types`

Linear layers: `common.linear_attention` (the gated delta rule over a per-sequence state, a
short causal conv on q/k/v, a gated RMSNorm on the output). Full layers: GQA with (1 + w) q/k
norms, RoPE over the first head_dim * partial_rotary_factor dims, and an output gate
(`o ∘ sigmoid(gate)`, the gate's rows interleaved per head with the query's in W_q). The MLP is
a SwiGLU, or experts (softmax top-k router, renormalised when norm_topk_prob) plus a shared
expert scaled by sigmoid(x w_gateᵀ). Qwen3.5's M-RoPE equals the 1-D rope for text (its three
position streams are equal). Qwen3-Next stores the linear layers' input projections grouped per
key head (`in_proj_qkvz`, `in_proj_ba`); the key map reorders them to Qwen3.5's flat layout.
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
from weld.models.common.cache import AttentionBatch, Cache, CacheSpec, PagedKV
from weld.models.common.checkpoint import Convert, KeyMap, minus_one
from weld.models.common.decoder import Rows, finish, run_layers
from weld.models.common.gqa import GQA, fuse_qkv, gqa_specs, self_attention
from weld.models.common.layers import fuse_gate_up, gated_mlp, rms_norm
from weld.models.common.metadata import (config_check, gguf_eos_ids, gguf_reader, gguf_vocab_size, hf_bos_id, hf_eos_ids,
                                          hf_field, single)
from weld.models.common.rope import Rope, RopeScaling, rope_from_hf
from weld.models.common.spec import iter_specs

NAME = "qwen3_next"
HF_ARCHITECTURES = {
    "Qwen3NextForCausalLM": "qwen3_next", "qwen3_next": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5_text", "qwen3_5_text": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5_text", "qwen3_5": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "qwen3_5_moe_text": "qwen3_5_moe_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text", "qwen3_5_moe": "qwen3_5_moe_text",
}
GGUF_ARCHITECTURES = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}
LINEAR, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters of one model. Frozen and hashable: it is a static argument of jit."""

    architecture: str  # qwen3_next | qwen3_5_text | qwen3_5_moe_text
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense MLPs
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear: la.DeltaNet
    rotary_dim: int  # RoPE covers the first rotary_dim dims of each head
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    moe: moe_lib.MoE | None = None
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is `moe`
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check = config_check(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                    "max_position_embeddings", "rotary_dim"))
        check(self.num_heads % self.num_kv_heads == 0,
              f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        check(self.rotary_dim % 2 == 0 and self.rotary_dim <= self.head_dim,
              f"the rotary dims ({self.rotary_dim}) must be even and at most head_dim ({self.head_dim})")
        check(len(self.layer_types) == self.num_layers,
              f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {LINEAR, FULL})
        check(not bad, f"unknown layer types {bad} (known: {LINEAR}, {FULL})")
        check(all(0 <= i < self.num_layers for i in self.sparse_layers),
              f"sparse layers {self.sparse_layers} must lie in [0, {self.num_layers})")
        check(self.moe is not None or not self.sparse_layers, "sparse layers without an MoE config")
        dense = set(range(self.num_layers)) - set(self.sparse_layers)
        check(not dense or self.intermediate_size > 0, "dense layers need intermediate_size > 0")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "Config":
        """Parses a HF `config.json` (a text model's, or a Qwen3.5 VLM's `text_config`)."""
        archs = config.get("architectures") or []
        model_type = config.get("model_type")
        arch = next((HF_ARCHITECTURES[a] for a in [*archs, model_type] if a in HF_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or model_type!r}; the qwen3_next family covers "
                             f"{sorted(a for a in HF_ARCHITECTURES if a[0].isupper())}")
        text = config.get("text_config") or config
        layers = int(hf_field(text, "num_hidden_layers"))
        heads = int(hf_field(text, "num_attention_heads"))
        hidden = int(hf_field(text, "hidden_size"))
        head_dim = int(text.get("head_dim") or hidden // heads)
        layer_types = text.get("layer_types")
        if not layer_types:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
        theta, scaling = rope_from_hf(text)
        params = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
        factor = float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        rotary = int(head_dim * factor)
        rotary -= rotary % 2
        eps = float(text.get("rms_norm_eps", 1e-6))
        net = la.DeltaNet(num_k_heads=int(hf_field(text, "linear_num_key_heads")),
                          num_v_heads=int(hf_field(text, "linear_num_value_heads")),
                          k_dim=int(hf_field(text, "linear_key_head_dim")),
                          v_dim=int(hf_field(text, "linear_value_head_dim")),
                          conv_width=int(text.get("linear_conv_kernel_dim", 4)), norm_eps=eps)
        moe, sparse = None, ()
        if arch != "qwen3_5_text" and int(text.get("num_experts") or 0) > 0:
            moe = moe_lib.MoE(num_experts=int(text["num_experts"]), top_k=int(hf_field(text, "num_experts_per_tok")),
                              intermediate_size=int(hf_field(text, "moe_intermediate_size")),
                              # Qwen3.5-MoE always renormalises; Qwen3-Next when norm_topk_prob
                              norm_topk_prob=arch == "qwen3_5_moe_text" or bool(text.get("norm_topk_prob", True)),
                              shared_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
                              shared_gate=bool(text.get("shared_expert_intermediate_size")))
            step = int(text.get("decoder_sparse_step", 1))
            dense = set(text.get("mlp_only_layers") or ())
            sparse = tuple(i for i in range(layers) if i not in dense and step > 0 and (i + 1) % step == 0)
        return cls(
            architecture=arch,
            vocab_size=int(hf_field(text, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size") or 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            layer_types=tuple(layer_types),
            linear=net,
            rotary_dim=rotary,
            rms_norm_eps=eps,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            attention_bias=bool(text.get("attention_bias", False)),
            moe=moe,
            sparse_layers=sparse,
            bos_token_id=hf_bos_id(config, text),
            eos_token_ids=hf_eos_ids(config, text),
        )

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                  read: Callable[[str], np.ndarray] | None = None) -> "Config":
        """llama.cpp's `qwen3next` / `qwen35` / `qwen35moe` metadata: the linear layers' sizes under
        ssm.* (state_size = key head dim, group_count = key heads, time_step_rank = value heads,
        inner_size = value heads x dim), which layers are linear in attention.recurrent_layers.
        The Qwen3.5 converter stores the value heads tiled over the key heads (when they differ
        in number), which the model then keeps (`DeltaNet.tiled_v_heads`)."""
        arch = metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r} for the qwen3_next family")
        key = gguf_reader(metadata, arch)
        layers = int(key("block_count"))
        recurrent = key("attention.recurrent_layers", None)
        if recurrent is None:
            interval = int(key("full_attention_interval", 4))
            recurrent = [(i + 1) % interval != 0 for i in range(layers)]
        v_heads, k_heads = int(key("ssm.time_step_rank")), int(key("ssm.group_count"))
        if v_heads <= 0 or int(key("ssm.inner_size")) % v_heads:
            raise ValueError(f"GGUF {arch}: ssm.inner_size ({key('ssm.inner_size')}) is not a positive multiple of "
                             f"ssm.time_step_rank (the value heads, {v_heads})")
        eps = float(key("attention.layer_norm_rms_epsilon", 1e-6))
        net = la.DeltaNet(num_k_heads=k_heads, num_v_heads=v_heads,
                          k_dim=int(key("ssm.state_size")), v_dim=int(key("ssm.inner_size")) // v_heads,
                          conv_width=int(key("ssm.conv_kernel")), norm_eps=eps,
                          tiled_v_heads=arch != "qwen3next" and v_heads != k_heads)
        moe, sparse = None, ()
        if key("expert_count", 0):
            shared = int(key("expert_shared_feed_forward_length", 0))
            moe = moe_lib.MoE(num_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
                              intermediate_size=int(key("expert_feed_forward_length")),
                              norm_topk_prob=bool(key("expert_weights_norm", True)),
                              shared_intermediate_size=shared, shared_gate=bool(shared))
            sparse = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes)
        return cls(
            architecture=GGUF_ARCHITECTURES[arch], vocab_size=gguf_vocab_size(metadata, key),
            hidden_size=int(key("embedding_length")), intermediate_size=int(key("feed_forward_length", 0)),
            num_layers=layers, num_heads=int(key("attention.head_count")),
            num_kv_heads=single(key("attention.head_count_kv"), "head_count_kv"),
            head_dim=int(key("attention.key_length")),
            layer_types=tuple(LINEAR if r else FULL for r in recurrent), linear=net,
            rotary_dim=int(key("rope.dimension_count")), rms_norm_eps=eps,
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings="output.weight" not in shapes, attention_bias="blk.0.attn_q.bias" in shapes,
            moe=moe, sparse_layers=sparse, bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=gguf_eos_ids(metadata))

    @property
    def attention(self) -> GQA:
        return GQA(self.num_heads, self.num_kv_heads, self.head_dim, qkv_bias=self.attention_bias,
                   o_bias=self.attention_bias, qk_norm=True, norm_eps=self.rms_norm_eps, norm_plus_one=True,
                   output_gate=True)

    @property
    def rope(self) -> Rope:
        return Rope(self.rotary_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)

    def num_params(self) -> int:
        return sum(math.prod(s.shape) for _, s in iter_specs(weight_specs(self)))


# ----- weights -----

def weight_specs(cfg: Config) -> dict:
    """The weight tree; its norms are (1 + w), stored around 0."""
    return decoder.decoder_specs(cfg, lambda i: la.delta_net_specs(cfg.linear, cfg.hidden_size)
                                 if cfg.layer_types[i] == LINEAR else gqa_specs(cfg.attention, cfg.hidden_size),
                                 norm_init="zeros")


def _ungroup_qkvz(w: np.ndarray, cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's in_proj_qkvz, rows per key head j [q_j | k_j | v_j (r dv) | z_j (r dv)] ->
    (w_qkv [q_all | k_all | v_all], w_z)."""
    net = cfg.linear
    r = net.num_v_heads // net.num_k_heads
    g = w.reshape((net.num_k_heads, -1) + w.shape[1:])
    q, k, v, z = np.split(g, np.cumsum([net.k_dim, net.k_dim, r * net.v_dim]), axis=1)
    flat = lambda a: a.reshape((-1,) + w.shape[1:])
    return np.concatenate([flat(q), flat(k), flat(v)]), flat(z)


def _ungroup_ba(w: np.ndarray, cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's in_proj_ba, rows per key head j [b_j (r) | a_j (r)] -> (w_b, w_a) [Hv, d]."""
    net = cfg.linear
    g = w.reshape((net.num_k_heads, 2, -1) + w.shape[1:])
    return g[:, 0].reshape((-1,) + w.shape[1:]), g[:, 1].reshape((-1,) + w.shape[1:])


def hf_keymap(cfg: Config) -> KeyMap:
    """transformers' tensor names (text models under `model.`, Qwen3.5 VLM checkpoints under
    `model.language_model.`, whose vision tower and MTP head are skipped) -> the weight tree."""
    keys: dict = {"lm_head.weight": ("lm_head",)}
    for base in ("model.", "model.language_model."):
        layer = base + "layers.{i}."
        at = lambda *leaf: ("layers", "{i}") + leaf
        keys.update({
            base + "embed_tokens.weight": ("embed",),
            base + "norm.weight": ("final_norm",),
            layer + "input_layernorm.weight": at("attn_norm"),
            layer + "post_attention_layernorm.weight": at("mlp_norm"),
            layer + "self_attn.q_norm.weight": at("q_norm"),
            layer + "self_attn.k_norm.weight": at("k_norm"),
            layer + "mlp.gate_proj.weight": at("w_gate"),
            layer + "mlp.up_proj.weight": at("w_up"),
            layer + "mlp.down_proj.weight": at("w_down"),
            layer + "linear_attn.in_proj_qkvz.weight": Convert(_ungroup_qkvz, at("w_qkv"), at("w_z"), rows_only=True),
            layer + "linear_attn.in_proj_ba.weight": Convert(_ungroup_ba, at("w_b"), at("w_a"), rows_only=True),
            layer + "linear_attn.in_proj_qkv.weight": at("w_qkv"),
            layer + "linear_attn.in_proj_z.weight": at("w_z"),
            layer + "linear_attn.in_proj_b.weight": at("w_b"),
            layer + "linear_attn.in_proj_a.weight": at("w_a"),
            layer + "linear_attn.conv1d.weight": Convert(lambda w, _: w.reshape(w.shape[0], -1), at("conv")),
            layer + "linear_attn.A_log": at("A_log"),
            layer + "linear_attn.dt_bias": at("dt_bias"),
            layer + "linear_attn.norm.weight": at("norm"),
            layer + "linear_attn.out_proj.weight": at("w_out"),
        })
        for hf, ours in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
            keys[layer + f"self_attn.{hf}.weight"] = at(ours)
            keys[layer + f"self_attn.{hf}.bias"] = at("b" + ours[1:])
        keys.update(moe_lib.hf_moe_keys(layer + "mlp.", at("moe")))
    ignore = ("mtp.*", "model.visual.*", "model.rotary_emb.inv_freq")
    if cfg.tie_word_embeddings:
        ignore += ("lm_head.weight",)
    return KeyMap(keys, ignore)


def _a_log(w: np.ndarray, _cfg: Config) -> np.ndarray:
    return np.log(-w)  # llama.cpp stores A = -exp(A_log)


def gguf_keymap(cfg: Config) -> KeyMap:
    """llama.cpp's qwen3next / qwen35 / qwen35moe names. Its converter stores the (1 + w) norms as
    1 + w (the linear layers' output norm excepted), A as -exp(A_log), the conv squeezed to
    [C, K], Qwen3-Next's in_proj_qkvz split into the flat attn_qkv and attn_gate (z) while
    ssm_ba keeps HF's grouped rows; Qwen3.5's b and a as ssm_beta and ssm_alpha."""
    blk, at = "blk.{i}.", lambda *leaf: ("layers", "{i}") + leaf
    keys: dict = {
        "token_embd.weight": ("embed",), "output.weight": ("lm_head",),
        "output_norm.weight": Convert(minus_one, ("final_norm",)),
        blk + "attn_norm.weight": Convert(minus_one, at("attn_norm")),
        blk + "post_attention_norm.weight": Convert(minus_one, at("mlp_norm")),
        blk + "attn_q_norm.weight": Convert(minus_one, at("q_norm")),
        blk + "attn_k_norm.weight": Convert(minus_one, at("k_norm")),
        blk + "attn_q.weight": at("wq"), blk + "attn_k.weight": at("wk"), blk + "attn_v.weight": at("wv"),
        blk + "attn_output.weight": at("wo"),
        blk + "attn_qkv.weight": at("w_qkv"), blk + "attn_gate.weight": at("w_z"),
        blk + "ssm_ba.weight": Convert(_ungroup_ba, at("w_b"), at("w_a"), rows_only=True),
        blk + "ssm_beta.weight": at("w_b"), blk + "ssm_alpha.weight": at("w_a"),
        blk + "ssm_conv1d.weight": at("conv"), blk + "ssm_a": Convert(_a_log, at("A_log")),
        blk + "ssm_dt.bias": at("dt_bias"), blk + "ssm_norm.weight": at("norm"), blk + "ssm_out.weight": at("w_out"),
        blk + "ffn_gate.weight": at("w_gate"), blk + "ffn_up.weight": at("w_up"), blk + "ffn_down.weight": at("w_down"),
        **moe_lib.gguf_moe_keys(blk, at("moe")),
    }
    return KeyMap(keys)


def cache_spec(cfg: Config) -> CacheSpec:
    """Paged K/V for the full-attention layers, a recurrent-state slot per sequence for the others."""
    return CacheSpec(tuple(cfg.linear.cache() if kind == LINEAR else PagedKV(cfg.num_kv_heads, cfg.head_dim)
                           for kind in cfg.layer_types))


PROJECTIONS = ("wqkv", "wq", "wk", "wv", "wo", "w_gate_up", "w_gate", "w_up", "w_down", "w_in", *la.INPUT_NAMES, "w_out")


def prepare_weights(weights: dict, cfg: Config, target: Any) -> dict:
    """On XLA: each layer's input projections fused (q/k/v, the linear layers' four, gate/up and
    the experts'), then put in `layers.prepared_matrix`'s form (packed for the CPU kernels, or
    quantized at load), layer by layer; the LM head too. The megakernel streams them as declared
    (the linear layers' q/k/v channels grouped for tensor parallelism: `DeltaNet.shards`)."""
    if target.backend != "xla":
        return decoder.megakernel_weights(weights, lambda lw: la.group_channels(cfg.linear, lw))

    def fuse(lw: dict) -> None:
        fuse_qkv(lw)
        la.fuse_inputs(cfg.linear, lw)
        fuse_gate_up(lw)

    return decoder.prepare_layers(weights, target, PROJECTIONS, fuse)


# ----- forward -----

embed_tokens = decoder.embed_tokens
lm_head = decoder.lm_head


def forward(weights: dict, cfg: Config, tokens, positions, cache: Cache, batch: AttentionBatch,
            logits_indices=None, capture_layers: tuple[int, ...] = ()):
    """The family contract (`weld.models.family.ModelFamily.forward`): full-attention layers
    write and read their pages, linear layers read and write each row's state slot
    (`AttentionBatch.state_slots`)."""
    spec = cache_spec(cfg)
    rows, ids = Rows.of(tokens, positions, batch, logits_indices, num_page_groups=len(spec.page_groups()))
    attention, rope, eps = cfg.attention, cfg.rope, cfg.rms_norm_eps

    def block(i: int, lw: dict, x: jax.Array, state):
        y = rms_norm(x, lw["attn_norm"], eps, plus_one=True)
        if cfg.layer_types[i] == LINEAR:
            out, state = la.delta_net_layer(cfg.linear, lw, y, rows, state)
        else:
            out, state = self_attention(attention, lw, y, rows, state, rope=rope, page_group=spec.group_of(i))
        x = x + out
        y = rms_norm(x, lw["mlp_norm"], eps, plus_one=True)
        return x + (moe_lib.moe_block(cfg.moe, lw["moe"], y) if "moe" in lw else gated_mlp(lw, y)), state

    x, cache, streams = run_layers(embed_tokens(weights, cfg, ids), weights["layers"], cache, block)
    logits, states = finish(rows, x, streams, capture_layers, lambda h: rms_norm(h, weights["final_norm"], eps,
                                                                                  plus_one=True),
                            lambda h: lm_head(weights, cfg, h))
    return logits, states, cache


megakernel = decoder.megakernel  # the TPU decode megakernel's forward (ValueError for what it does not cover)
