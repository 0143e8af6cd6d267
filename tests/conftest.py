"""Shared test fixtures: tiny HF models (the numerical oracle) saved to disk for weld to load."""

from __future__ import annotations

import os

os.environ.setdefault("WELD_PROGRESS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pathlib

import pytest

try:  # torch is the test-only oracle; one thread keeps it from fighting jax for the 2 cores
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass

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


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "def add(a, b):\n    return a + b\n\nNumbers: 0 1 2 3 4 5 6 7 8 9 10 42 1000. "
    "Once upon a time there was a small model that wrote tests. "
) * 20


def make_tiny_tokenizer(directory: pathlib.Path, vocab_size: int = 384) -> int:
    """Trains a byte-level BPE on a small corpus and saves tokenizer.json + tokenizer_config.json.

    Returns the vocabulary size (the tiny model's embedding must match it).
    """
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": CHAT_TEMPLATE}))
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A complete tiny random llama model directory (weights + tokenizer + chat template).

    Returns (directory, HF torch model). Its EOS is <|im_end|> (id 2).
    """
    d = tmp_path_factory.mktemp("tiny-llama-full")
    vocab = make_tiny_tokenizer(d)
    model = make_tiny_hf_model("llama", d, seed=3, vocab_size=vocab, bos_token_id=None, eos_token_id=2,
                               pad_token_id=0, max_position_embeddings=256)
    return d, model


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tiny_llama_dir):
    """A one-layer random llama with tiny_llama_dir's tokenizer and vocabulary: a draft model for it."""
    import shutil

    target, hf = tiny_llama_dir
    d = tmp_path_factory.mktemp("tiny-llama-draft")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, d / name)
    make_tiny_hf_model("llama", d, seed=11, vocab_size=hf.config.vocab_size, bos_token_id=None, eos_token_id=2,
                       pad_token_id=0, max_position_embeddings=256, num_hidden_layers=1)
    return d
