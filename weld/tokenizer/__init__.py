"""Tokenizers, chat templates and streaming detokenization.

`Tokenizer` is built from a GGUF's metadata (rebuilt with llama.cpp's semantics) or from a HF
model folder; `IncrementalDetokenizer` turns generated ids into UTF-8-safe text deltas. This layer
imports only `weld.utils` and the `tokenizers` / `jinja2` libraries.
"""

from weld.tokenizer.detokenizer import IncrementalDetokenizer
from weld.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
