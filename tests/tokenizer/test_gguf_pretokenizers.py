"""The pre-tokenizer chosen from tokenizer.ggml.pre splits text like the model's own tokenizer.json.

References: HF transformers' regexes for these models (llama3, qwen2, tekken, gpt-4o) and the
`tokenizers` pre-tokenizers GPT-2 and SmolLM2 ship with.
"""

import pytest
from tokenizers import Regex, pre_tokenizers
from transformers.integrations.gguf import gguf_tokenizer_mapping as hf_gguf

from weld.tokenizer import ggml_vocab

TEXT = (
    "I'm  HERE'S 12345 678\n\n  x²½ 3.14 \t\r\n foo_bar(1,2) 日本語テキスト CamelCaseWORD 😀😀  !!?? "
    "Ünïcödé  ﬁne ٣٤٥   \n end  "
)


def _toy_meta(pre):
    alphabet = sorted(set(ggml_vocab.bytes_to_unicode().values()))
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": alphabet,
            "tokenizer.ggml.merges": []}


def _split(pre_tokenizer, text):
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


def _regex_then_bytes(regex):
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


@pytest.mark.parametrize(
    "pre, reference",
    [
        ("gpt-2", pre_tokenizers.ByteLevel(add_prefix_space=False)),
        ("smollm", pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])),
        ("llama-bpe", _regex_then_bytes(hf_gguf._LLAMA3_SPLIT)),
        ("qwen2", _regex_then_bytes(hf_gguf.GGUF_PRE_TOKENIZER_SPLITS["qwen2"])),
        ("qwen35", _regex_then_bytes(hf_gguf.GGUF_PRE_TOKENIZER_SPLITS["qwen35"])),
        ("tekken", _regex_then_bytes(hf_gguf._TEKKEN_SPLIT)),
        ("gpt-4o", _regex_then_bytes(hf_gguf._GPT4O_SPLIT)),
    ],
)
def test_split_matches_reference(pre, reference):
    weld = ggml_vocab.build_tokenizer(_toy_meta(pre))
    assert _split(weld.pre_tokenizer, TEXT) == _split(reference, TEXT)


def test_llama3_and_qwen2_group_digits_differently():
    llama3 = _split(ggml_vocab.build_tokenizer(_toy_meta("llama-bpe")).pre_tokenizer, "12345")
    qwen2 = _split(ggml_vocab.build_tokenizer(_toy_meta("qwen2")).pre_tokenizer, "12345")
    assert llama3 == ["123", "45"] and qwen2 == list("12345")
