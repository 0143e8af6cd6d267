"""Shared test fixtures: tiny HF models (the numerical oracle) saved to disk for weld to load."""

from __future__ import annotations

import os

os.environ.setdefault("WELD_PROGRESS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pathlib

import pytest

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)

# family name -> extra HF config fields; each one exercises a switch of the llama family.
TINY_VARIANTS = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(head_dim=32, tie_word_embeddings=False),
    "mistral": dict(sliding_window=6, tie_word_embeddings=False),
}


def make_tiny_hf_model(model_type: str, directory: pathlib.Path, seed: int = 0, **overrides):
    """Builds a tiny random HF model, perturbs every weight (norms and biases too), saves it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    kwargs = {**TINY, **TINY_VARIANTS.get(model_type, {}), **overrides}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    if model_type == "mistral":
        cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A function family -> (directory, HF torch model), built once per session per family."""
    cache: dict[str, tuple[pathlib.Path, object]] = {}

    def get(model_type: str):
        if model_type not in cache:
            d = tmp_path_factory.mktemp(f"tiny-{model_type}")
            cache[model_type] = (d, make_tiny_hf_model(model_type, d))
        return cache[model_type]

    return get
