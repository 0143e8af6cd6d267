"""Gemma 3 text models (`gemma3_text`; llama.cpp's `gemma3`).

    x  = embed[ids] * sqrt(d)
    h  = x + RMSNorm_post_attn(Attn(RMSNorm_in(x)))          sandwich norms, all (1 + w)
    x' = h + RMSNorm_post_ff(MLP(RMSNorm_pre_ff(h)))         MLP = down(gelu_tanh(gate x) * up x)

Attention is GQA with q/k RMSNorm (1 + w) before RoPE and a softmax scale of
query_pre_attn_scalar^-1/2. Layers are "sliding_attention" (a window of the last
`sliding_window` positions, RoPE base 1e4) or "full_attention" (RoPE base 1e6, with the
checkpoint's scaling), five sliding to one full by default. The LM head is the embedding; the
final logits may be soft-capped (c tanh(l / c)). llama.cpp's converter stores the norms as 1 + w,
which the GGUF key map undoes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from weld.models.common.cache import AttentionBatch, Cache, CacheSpec, KVPages, PagedKV
from weld.models.common.checkpoint import Convert, KeyMap, minus_one
from weld.models.common import decoder
from weld.models.common.decoder import Rows, finish, run_layers
from weld.models.common.gqa import GQA, fuse_qkv, gqa_specs, self_attention
from weld.models.common.layers import fuse_gate_up, gated_mlp, gated_mlp_specs, gelu_tanh, linear, prepare_head, prepare_matrices, rms_norm
from weld.models.common.metadata import config_check, gguf_eos_ids, gguf_reader, hf_bos_id, hf_eos_ids, hf_field
from weld.models.common.rope import Rope, RopeScaling, rope_from_hf
from weld.models.common.spec import WeightSpec, iter_specs

NAME = "gemma3"
HF_ARCHITECTURES = {"Gemma3ForCausalLM": "gemma3_text", "gemma3_text": "gemma3_text"}
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}
SLIDING, FULL = "sliding_attention", "full_attention"
LOCAL_THETA = 10000.0  # llama.cpp's default for sliding layers when a GGUF does not say


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters of one model. Frozen and hashable: it is a static argument of jit."""

    architecture: str  # gemma3_text
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope_global: Rope
    rope_local: Rope
    query_pre_attn_scalar: float
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    moe: None = None  # a dense family
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check = config_check(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                                    "head_dim", "sliding_window", "max_position_embeddings"))
        check(self.num_heads % self.num_kv_heads == 0,
              f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        check(len(self.layer_types) == self.num_layers,
              f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        check(not bad, f"unknown layer types {bad}")
        check(self.tie_word_embeddings, "an untied LM head is not a Gemma 3 checkpoint")

    @property
    def attention(self) -> GQA:
        return GQA(self.num_heads, self.num_kv_heads, self.head_dim, qk_norm=True, norm_eps=self.rms_norm_eps,
                   norm_plus_one=True, scale=self.query_pre_attn_scalar ** -0.5)

    def window_for(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def rope_for(self, layer: int) -> Rope:
        return self.rope_local if self.layer_types[layer] == SLIDING else self.rope_global

    def num_params(self) -> int:
        return sum(math.prod(s.shape) for _, s in iter_specs(weight_specs(self)))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "Config":
        archs = config.get("architectures") or []
        if not any(a in HF_ARCHITECTURES for a in [*archs, config.get("model_type")]):
            raise ValueError(f"unsupported architecture {archs or config.get('model_type')!r} for the gemma3 family")
        text = config.get("text_config") or config
        if text.get("use_bidirectional_attention"):
            raise ValueError("config.json sets 'use_bidirectional_attention' (an embedding model): not supported")
        if text.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"config.json sets 'hidden_activation' to {text['hidden_activation']!r}; weld's gemma3 "
                             "supports gelu_pytorch_tanh")
        layers = int(hf_field(text, "num_hidden_layers"))
        pattern = int(text.get("sliding_window_pattern") or 6)
        layer_types = tuple(text.get("layer_types") or (SLIDING if (i + 1) % pattern else FULL for i in range(layers)))
        ctx = int(text.get("max_position_embeddings", 32768))
        head_dim = int(text.get("head_dim") or 256)
        params = text.get("rope_parameters") or {}
        global_theta, global_scaling = rope_from_hf(text, FULL)
        if not isinstance(params.get(SLIDING), dict):  # hub spelling: rope_local_base_freq, rope_scaling for global
            local_theta, local_scaling = float(text.get("rope_local_base_freq", LOCAL_THETA)), RopeScaling()
        else:
            local_theta, local_scaling = rope_from_hf(text, SLIDING)
        return cls(architecture="gemma3_text", vocab_size=int(hf_field(text, "vocab_size")),
                   hidden_size=int(hf_field(text, "hidden_size")),
                   intermediate_size=int(hf_field(text, "intermediate_size")), num_layers=layers,
                   num_heads=int(hf_field(text, "num_attention_heads")),
                   num_kv_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
                   head_dim=head_dim, layer_types=layer_types, sliding_window=int(text.get("sliding_window") or 4096),
                   rope_global=Rope(head_dim, global_theta, global_scaling, ctx),
                   rope_local=Rope(head_dim, local_theta, local_scaling, ctx),
                   query_pre_attn_scalar=float(text.get("query_pre_attn_scalar") or head_dim),
                   rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                   final_logit_softcapping=text.get("final_logit_softcapping"), max_position_embeddings=ctx,
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
                   bos_token_id=hf_bos_id(config, text),
                   eos_token_ids=hf_eos_ids(config, text))

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                  read: Callable[[str], np.ndarray] | None = None) -> "Config":
        """llama.cpp's gemma3 metadata, read as llama.cpp reads it: a pattern of 6 unless the file
        says, a sliding RoPE base of 1e4 unless it says, and query_pre_attn_scalar = head_dim
        except for the 27B model (62 layers), where it is hidden / heads."""
        arch = metadata.get("general.architecture")
        if arch != "gemma3":
            raise ValueError(f"unsupported GGUF architecture {arch!r} for the gemma3 family")
        key = gguf_reader(metadata, arch)
        layers, hidden, heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden // heads))
        window = key("attention.sliding_window", None)
        pattern = key("attention.sliding_window_pattern", 6)
        if isinstance(pattern, (list, tuple)):  # per-layer flags
            layer_types = tuple(SLIDING if p else FULL for p in pattern)
        else:
            layer_types = tuple(SLIDING if window and (i + 1) % int(pattern) else FULL for i in range(layers))
        scaling = RopeScaling()
        if key("rope.scaling.type", "none") == "linear":
            scaling = RopeScaling(kind="linear", factor=float(key("rope.scaling.factor")))
        ctx = int(key("context_length", 32768))
        vocab = (key("vocab_size", None) or len(metadata.get("tokenizer.ggml.tokens") or ())
                 or shapes["token_embd.weight"][0])
        kv_heads = key("attention.head_count_kv", heads)
        return cls(architecture="gemma3_text", vocab_size=int(vocab), hidden_size=hidden,
                   intermediate_size=int(key("feed_forward_length")), num_layers=layers, num_heads=heads,
                   num_kv_heads=int(kv_heads[0] if isinstance(kv_heads, (list, tuple)) else kv_heads),
                   head_dim=head_dim, layer_types=layer_types, sliding_window=int(window or ctx),
                   rope_global=Rope(head_dim, float(key("rope.freq_base", 1_000_000.0)), scaling, ctx),
                   rope_local=Rope(head_dim, float(key("rope.freq_base_swa", LOCAL_THETA)), RopeScaling(), ctx),
                   query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
                   rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
                   final_logit_softcapping=key("final_logit_softcapping", None) or None, max_position_embeddings=ctx,
                   tie_word_embeddings=True, bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=gguf_eos_ids(metadata))


# ----- weights -----

def weight_specs(cfg: Config) -> dict:
    d, f = cfg.hidden_size, cfg.intermediate_size
    norm = lambda: WeightSpec((d,), ("embed",), init="zeros")  # noqa: E731  (1 + w): stored around 0

    def layer() -> dict:
        return {"attn_norm": norm(), **gqa_specs(cfg.attention, d), "post_attn_norm": norm(),
                "mlp_norm": norm(), "post_mlp_norm": norm(),
                **gated_mlp_specs(d, f)}

    return {**decoder.embedding_specs(cfg.vocab_size, d, tied=True),
            "layers": [layer() for _ in range(cfg.num_layers)], "final_norm": norm()}


_HF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
             "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm",
             "self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
             "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm",
             "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up", "mlp.down_proj": "w_down"}
_GGUF_LAYER = {"attn_norm": "attn_norm", "post_attention_norm": "post_attn_norm", "ffn_norm": "mlp_norm",
               "post_ffw_norm": "post_mlp_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
               "attn_output": "wo", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "ffn_gate": "w_gate",
               "ffn_up": "w_up", "ffn_down": "w_down"}


def hf_keymap(cfg: Config) -> KeyMap:
    keys: dict = {"model.embed_tokens.weight": ("embed",), "model.norm.weight": ("final_norm",)}
    keys.update({f"model.layers.{{i}}.{hf}.weight": ("layers", "{i}", ours) for hf, ours in _HF_LAYER.items()})
    return KeyMap(keys, ("lm_head.weight",))  # tied: some checkpoints store a copy


def gguf_keymap(cfg: Config) -> KeyMap:
    keys: dict = {"token_embd.weight": ("embed",), "output_norm.weight": Convert(minus_one, ("final_norm",))}
    for name, ours in _GGUF_LAYER.items():
        path = ("layers", "{i}", ours)
        keys[f"blk.{{i}}.{name}.weight"] = Convert(minus_one, path) if ours.endswith("norm") else path
    return KeyMap(keys, ("output.weight",))


def cache_spec(cfg: Config) -> CacheSpec:
    return CacheSpec(tuple(PagedKV(cfg.num_kv_heads, cfg.head_dim, cfg.window_for(i)) for i in range(cfg.num_layers)))


PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


def prepare_weights(weights: dict, cfg: Config, target: Any) -> dict:
    """On XLA: q/k/v and gate/up fused; on the CPU with the native kernels, f32 projections and the
    tied embedding (the LM head; lookups gather rows from its panels) packed. The megakernel
    streams the declared matrices (`decoder.megakernel_weights`)."""
    if target.backend != "xla":
        return decoder.megakernel_weights(weights)
    for lw in weights["layers"]:
        if target.fuse:
            fuse_qkv(lw)
            fuse_gate_up(lw)
        prepare_matrices(lw, PROJECTIONS, target)
        jax.block_until_ready(lw)
    prepare_head(weights, target)
    return weights


# ----- forward -----

def embed_tokens(weights: dict, cfg: Config, tokens: jax.Array) -> jax.Array:
    x = weights["embed"][tokens]
    return x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)  # the scale in the model's dtype, as HF


def lm_head(weights: dict, cfg: Config, hidden: jax.Array) -> jax.Array:
    logits = linear(hidden, weights["embed"])
    if cfg.final_logit_softcapping:
        cap = cfg.final_logit_softcapping
        logits = (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)
    return logits


def forward(weights: dict, cfg: Config, tokens, positions, cache: Cache, batch: AttentionBatch,
            logits_indices=None, capture_layers: tuple[int, ...] = ()):
    """The family contract (`weld.models.family.ModelFamily.forward`)."""
    spec = cache_spec(cfg)
    rows, ids = Rows.of(tokens, positions, batch, logits_indices, num_page_groups=len(spec.page_groups()))
    attention, eps = cfg.attention, cfg.rms_norm_eps
    norm = lambda x, w: rms_norm(x, w, eps, plus_one=True)  # noqa: E731

    def block(i: int, lw: dict, x: jax.Array, pages: KVPages):
        attn, pages = self_attention(attention, lw, norm(x, lw["attn_norm"]), rows, pages, rope=cfg.rope_for(i),
                                     window=cfg.window_for(i),
                                     page_group=spec.group_of(i))
        x = x + norm(attn, lw["post_attn_norm"])
        x = x + norm(gated_mlp(lw, norm(x, lw["mlp_norm"]), activation=gelu_tanh), lw["post_mlp_norm"])
        return x, pages

    x, cache, streams = run_layers(embed_tokens(weights, cfg, ids), weights["layers"], cache, block)
    logits, states = finish(rows, x, streams, capture_layers, lambda h: norm(h, weights["final_norm"]),
                            lambda h: lm_head(weights, cfg, h))
    return logits, states, cache


megakernel = decoder.megakernel  # the TPU decode megakernel's forward (ValueError for what it does not cover)
