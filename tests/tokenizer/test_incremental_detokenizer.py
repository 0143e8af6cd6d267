"""`IncrementalDetokenizer`: deltas never end in half a character and add up to the full decode."""

import random

from weld.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Emoji 😀😃 👩‍👩‍👧‍👦 🇫🇷 and CJK 日本語のテキスト 你好世界 한국어",
    "Ünïcödé ∑≈∞ — “quotes” … 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
    "plain ascii, numbers 12345, code: x = f(y)\n\tz",
]


def test_deltas_are_whole_characters(weld_smollm2):
    for text in TEXTS:
        ids = weld_smollm2.encode(text)
        if not text.isascii():  # then the hold-back must be exercised: a prefix ends inside a character
            assert any("\ufffd" in weld_smollm2.decode(ids[:k]) for k in range(1, len(ids)))
        detok = IncrementalDetokenizer(weld_smollm2)
        deltas = [detok.add([i]) for i in ids]
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == detok.text == weld_smollm2.decode(ids) == text


def test_chunks_and_special_tokens(weld_smollm2):
    rng = random.Random(0)
    ids = weld_smollm2.encode("<|im_start|>assistant\n" + TEXTS[0] + "<|im_end|>")
    for skip in (True, False):
        detok = IncrementalDetokenizer(weld_smollm2, skip_special_tokens=skip)
        out, k = [], 0
        while k < len(ids):
            step = rng.randint(1, 3)
            out.append(detok.add(ids[k:k + step]))
            k += step
        out.append(detok.flush())
        assert "".join(out) == weld_smollm2.decode(ids, skip_special_tokens=skip)


def test_prompt_context_keeps_leading_space(weld_smollm2):
    prompt = weld_smollm2.encode("The answer is")
    new = weld_smollm2.encode(" 😀 yes")
    detok = IncrementalDetokenizer(weld_smollm2, prompt_ids=prompt)
    text = "".join(detok.add(i) for i in new)
    assert text == " 😀 yes"


def test_flush_returns_unfinished_character(weld_smollm2):
    ids = weld_smollm2.encode("😀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(weld_smollm2)
    assert detok.add(ids[:-1]) == ""
    assert detok.flush() == weld_smollm2.decode(ids[:-1])
    assert detok.flush() == ""
