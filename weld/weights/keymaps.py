"""Declarative checkpoint key maps: checkpoint tensor name -> path in a family's weight tree.

One table per family and per format. `{i}` stands for a layer index. A name that matches no
pattern and no ignore pattern is an error (the loaders list all such names at once), so a new
tensor in a checkpoint can never be dropped silently.
"""

from __future__ import annotations

import functools
import re

from weld.models.common.spec import Path

# HF safetensors (transformers' module names).
HF_KEYS: dict[str, dict[str, tuple]] = {
    "llama": {
        "model.embed_tokens.weight": ("embed",),
        "model.norm.weight": ("final_norm",),
        "lm_head.weight": ("lm_head",),
        "model.layers.{i}.input_layernorm.weight": ("layers", "{i}", "attn_norm"),
        "model.layers.{i}.self_attn.q_proj.weight": ("layers", "{i}", "wq"),
        "model.layers.{i}.self_attn.k_proj.weight": ("layers", "{i}", "wk"),
        "model.layers.{i}.self_attn.v_proj.weight": ("layers", "{i}", "wv"),
        "model.layers.{i}.self_attn.o_proj.weight": ("layers", "{i}", "wo"),
        "model.layers.{i}.self_attn.q_proj.bias": ("layers", "{i}", "bq"),
        "model.layers.{i}.self_attn.k_proj.bias": ("layers", "{i}", "bk"),
        "model.layers.{i}.self_attn.v_proj.bias": ("layers", "{i}", "bv"),
        "model.layers.{i}.self_attn.o_proj.bias": ("layers", "{i}", "bo"),
        "model.layers.{i}.self_attn.q_norm.weight": ("layers", "{i}", "q_norm"),
        "model.layers.{i}.self_attn.k_norm.weight": ("layers", "{i}", "k_norm"),
        "model.layers.{i}.post_attention_layernorm.weight": ("layers", "{i}", "mlp_norm"),
        "model.layers.{i}.mlp.gate_proj.weight": ("layers", "{i}", "w_gate"),
        "model.layers.{i}.mlp.up_proj.weight": ("layers", "{i}", "w_up"),
        "model.layers.{i}.mlp.down_proj.weight": ("layers", "{i}", "w_down"),
    },
}

# Tensors that carry nothing weld needs: rotary tables that old checkpoints saved as buffers
# (weld recomputes them from the config).
HF_IGNORE: dict[str, tuple[str, ...]] = {
    "llama": ("model.rotary_emb.inv_freq", "model.layers.{i}.self_attn.rotary_emb.inv_freq"),
}

# GGUF (llama.cpp's tensor names). rope_freqs.weight is not a weight of the tree: it is read
# before the Config is built (GGUF_CONFIG_TENSORS) and becomes Config.rope_freq_factors.
GGUF_KEYS: dict[str, dict[str, tuple]] = {
    "llama": {
        "token_embd.weight": ("embed",),
        "output_norm.weight": ("final_norm",),
        "output.weight": ("lm_head",),
        "blk.{i}.attn_norm.weight": ("layers", "{i}", "attn_norm"),
        "blk.{i}.attn_q.weight": ("layers", "{i}", "wq"),
        "blk.{i}.attn_k.weight": ("layers", "{i}", "wk"),
        "blk.{i}.attn_v.weight": ("layers", "{i}", "wv"),
        "blk.{i}.attn_output.weight": ("layers", "{i}", "wo"),
        "blk.{i}.attn_q.bias": ("layers", "{i}", "bq"),
        "blk.{i}.attn_k.bias": ("layers", "{i}", "bk"),
        "blk.{i}.attn_v.bias": ("layers", "{i}", "bv"),
        "blk.{i}.attn_output.bias": ("layers", "{i}", "bo"),
        "blk.{i}.attn_q_norm.weight": ("layers", "{i}", "q_norm"),
        "blk.{i}.attn_k_norm.weight": ("layers", "{i}", "k_norm"),
        "blk.{i}.ffn_norm.weight": ("layers", "{i}", "mlp_norm"),
        "blk.{i}.ffn_gate.weight": ("layers", "{i}", "w_gate"),
        "blk.{i}.ffn_up.weight": ("layers", "{i}", "w_up"),
        "blk.{i}.ffn_down.weight": ("layers", "{i}", "w_down"),
    },
}
GGUF_IGNORE: dict[str, tuple[str, ...]] = {"llama": ("rope_freqs.weight",)}
GGUF_ROPE_FREQS = "rope_freqs.weight"

# llama.cpp's converter interleaves the rows of Q and K (and their biases) for these GGUF
# architectures, per head: see `unpermute_rows` in weld.weights.gguf. Value: which head count.
GGUF_PERMUTED_ARCHITECTURES = ("llama", "mistral")
GGUF_PERMUTED_LEAVES = {"wq": "num_heads", "bq": "num_heads", "wk": "num_kv_heads", "bk": "num_kv_heads"}


@functools.lru_cache(maxsize=None)
def _compile(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)") + r"\Z")


def match(keymap: dict[str, tuple], name: str) -> Path | None:
    """The tree path for a checkpoint tensor name, or None if no pattern matches it."""
    for pattern, path in keymap.items():
        m = _compile(pattern).match(name)
        if m:
            layer = m.groupdict().get("i")
            return tuple(int(layer) if part == "{i}" else part for part in path)
    return None


def ignored(patterns: tuple[str, ...], name: str) -> bool:
    return any(_compile(p).match(name) for p in patterns)


def family_name(family) -> str:
    """The key of a family module in these tables ("weld.models.llama" -> "llama")."""
    return family.__name__.rsplit(".", 1)[-1]
