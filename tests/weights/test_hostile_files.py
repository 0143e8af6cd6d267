"""Adversarial checkpoint files: headers that claim billions of tensors or entries, strings and
headers of petabytes, tensor shapes whose byte count overflows 64 bits. Each is a one-line
error naming the file, found before anything is allocated from the claimed sizes (the test
runs under an address-space limit far below what any claim would take)."""

from __future__ import annotations

import json
import resource
import struct

import pytest

from weld.weights import CheckpointError, ModelSource, load_model

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
                "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                "vocab_size": 32}


def _gguf(path, tensors: int, kvs: int, tail: bytes = b""):
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, kvs) + tail)
    return ModelSource("gguf", path, path.stem)


def _safetensors(directory, header: bytes, length: int | None = None, data: bytes = b""):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header) if length is None else length)
                                                  + header + data)
    return ModelSource("hf", directory, directory.name)


CASES = {
    "gguf-2^60-tensors": lambda d: _gguf(d / "a.gguf", 2 ** 60, 0),
    "gguf-2^60-kvs": lambda d: _gguf(d / "b.gguf", 0, 2 ** 60),
    "gguf-string-of-4-EB": lambda d: _gguf(d / "c.gguf", 0, 1, struct.pack("<Q", 2 ** 62) + b"abc"),
    "safetensors-header-of-4-EB": lambda d: _safetensors(d / "st", b"{}", length=2 ** 62),
    "safetensors-shape-overflowing-int64": lambda d: _safetensors(d / "st", json.dumps({
        "model.embed_tokens.weight": {"dtype": "F32", "shape": [2 ** 40, 2 ** 40], "data_offsets": [0, 16]}}).encode(),
        data=b"\0" * 16),
    "safetensors-offsets-past-the-end": lambda d: _safetensors(d / "st", json.dumps({
        "model.embed_tokens.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 2 ** 50]}}).encode()),
    "safetensors-header-not-json": lambda d: _safetensors(d / "st", b"\xff\xfe{"),
}


@pytest.fixture
def limited_memory():
    """An address-space cap 4 GiB above what the process has mapped (whatever earlier tests left):
    any allocation from a claimed size would fail loudly."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    cap = mapped + (4 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file_is_a_one_line_error(case, tmp_path, limited_memory):
    source = CASES[case](tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_model(source, quantization="none")
    message = str(err.value)
    assert "\n" not in message and str(source.path.name) in message, message
    if "overflowing" in case:
        assert str(4 * 2 ** 80) in message  # the true byte count, not a wrapped one
