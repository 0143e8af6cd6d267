"""Tiny GGUF files written with gguf-py's GGUFWriter, for tests."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np


def write_gguf(path: pathlib.Path, arch: str, kv: dict, tensors: dict) -> pathlib.Path:
    """Writes a GGUF. kv: key -> value (str, int, float, bool or list; keys without a dot get
    the `{arch}.` prefix). tensors: name -> float array [out, in] (written F32, or F16 if float16) or
    (uint8 raw block bytes, GGMLQuantizationType)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        key = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            raw, qtype = value
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            keep = value.dtype in (np.float16, np.float32)  # F16 tests write F16; anything else as F32
            w.add_tensor(name, np.ascontiguousarray(value if keep else value.astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_kv(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=96) -> dict:
    return {"block_count": layers, "context_length": 256, "embedding_length": hidden,
            "feed_forward_length": ffn, "attention.head_count": heads, "attention.head_count_kv": kv_heads,
            "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5, "vocab_size": vocab}
