"""weld's tokenizer for the SmolLM2 GGUF (byte-level BPE, pre "smollm") against HF transformers.

Finding (transformers 5.24): HF's GGUF loader does not know the pre-tokenizer name "smollm", so it
falls back to GPT-2's plain byte-level regex and skips the split of every digit that SmolLM2's own
tokenizer.json does (`Digits(individual_digits=True)` then `ByteLevel`), and llama.cpp does too
(pre type SMOLLM: `\\p{N}`, then the GPT-2 regex). The vocabulary has no multi-digit tokens, so
"12345" still comes out digit by digit, but whitespace before a number and non-ASCII numerals
differ: "x  1" is [x, "ĠĠ", 1] for the real tokenizer and [x, "Ġ", "Ġ", 1] for HF's GGUF one.
So the reference here is HF's GGUF tokenizer with SmolLM2's original pre-tokenizer put back, and a
separate test pins down the deviation of the unpatched one.
"""

import random

import pytest
import tokenizers
from tokenizers import pre_tokenizers

from weld.tokenizer import Tokenizer
from weld.utils.errors import InvalidInputError, UnsupportedModelError


@pytest.fixture(scope="module")
def reference(hf_smollm2):
    """HF's GGUF tokenizer with SmolLM2's original pre-tokenizer (from its tokenizer.json)."""
    backend = tokenizers.Tokenizer.from_str(hf_smollm2.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


def _fuzz_texts(seed, count):
    rng = random.Random(seed)
    pieces = list("abcXYZ 0123456789\n\t.,!?'\"()[]{}<>_-+=/\\") + list("éüñß你好世界😀🎉²½Ⅻ①٣\u00a0")
    pieces += ["<|im_start|>", "<|im_end|>", "'s", "'LL", "  ", "   ", "\r\n", "\n\n"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def test_metadata_facts(weld_smollm2, smollm2_meta):
    assert smollm2_meta["tokenizer.ggml.pre"] == "smollm"
    assert weld_smollm2.vocab_size == 49152
    assert weld_smollm2.bos_token_id == 1 and weld_smollm2.bos_token == "<|im_start|>"
    # eos from the file first; <|endoftext|> is control and ends generation in llama.cpp too.
    assert weld_smollm2.eos_token_ids == (2, 0) and weld_smollm2.eos_token == "<|im_end|>"
    assert weld_smollm2.pad_token_id == 2
    assert weld_smollm2.all_special_ids == tuple(range(17))
    assert weld_smollm2.id_to_token(19556) == "Hello"


def test_ids_match_original_tokenizer(weld_smollm2, reference, corpus):
    for text in corpus + _fuzz_texts(0, 500):
        assert weld_smollm2.encode(text) == reference.encode(text).ids, text


def test_ids_match_hf_gguf_where_digits_do_not_matter(weld_smollm2, hf_smollm2, corpus):
    # add_bos_token is False in the file: neither side adds BOS.
    for text in corpus:
        if any(c.isnumeric() for c in text):
            continue
        assert weld_smollm2.encode(text) == hf_smollm2(text)["input_ids"], text


def test_hf_gguf_deviation_on_digits_is_known(weld_smollm2, hf_smollm2, reference):
    text = "x  1"
    assert weld_smollm2.encode(text) == reference.encode(text).ids == [104, 256, 33]
    assert hf_smollm2(text)["input_ids"] == [104, 216, 216, 33]  # HF's GGUF loader: no digit split


def test_special_tokens_in_text_are_one_token(weld_smollm2):
    ids = weld_smollm2.encode("a<|im_start|>user\nb<|im_end|>")
    assert ids[1] == 1 and ids[-1] == 2 and ids.count(1) == 1
    assert weld_smollm2.encode("<|im_start|>", add_special_tokens=False) == [1]


def test_decode_round_trip_and_matches_hf(weld_smollm2, hf_smollm2, corpus):
    for text in corpus + _fuzz_texts(1, 200):
        ids = weld_smollm2.encode(text)
        assert weld_smollm2.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert weld_smollm2.decode(ids, skip_special_tokens=skip) == hf_smollm2.decode(
                ids, skip_special_tokens=skip
            ), text
    assert weld_smollm2.decode([1, 19556, 2]) == "Hello"


def test_decode_rejects_out_of_range_ids(weld_smollm2):
    with pytest.raises(InvalidInputError):
        weld_smollm2.decode([5, 49152])


def test_unknown_pre_tokenizer_is_an_error(smollm2_meta):
    meta = dict(smollm2_meta, **{"tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(UnsupportedModelError, match="no-such-pre"):
        Tokenizer.from_gguf_metadata(meta)


def test_token_bytes_spell_partial_characters(weld_smollm2, corpus):
    """OpenAI's logprob `bytes`: each token's own bytes, so a character split over tokens (an
    emoji, CJK) has the UTF-8 of its pieces, and the tokens' bytes concatenate to the text's."""
    for text in corpus + ["naïve café 😀 日本語 \u200b"]:
        ids = weld_smollm2.encode(text, add_special_tokens=False)
        assert b"".join(weld_smollm2.token_bytes(i) for i in ids) == text.encode(), text
    emoji = weld_smollm2.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1 and "\ufffd" in weld_smollm2.decode(emoji[:1])  # a partial character alone
    assert weld_smollm2.token_bytes(emoji[0]) == "😀".encode()[:len(weld_smollm2.token_bytes(emoji[0]))]
