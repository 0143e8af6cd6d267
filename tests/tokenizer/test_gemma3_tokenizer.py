"""The chat template weld supplies for a Gemma GGUF converted without one (gemma-3-270m-q4_k_m.gguf is):
chosen by the vocabulary's turn tokens, never over the file's own. The real file against HF is in
tests/engine/test_gemma3_gguf.py; these need no download."""

from weld.tokenizer import Tokenizer
from weld.tokenizer.chat_template import GEMMA_TEMPLATE

CONTROL, USER_DEFINED, NORMAL = 3, 4, 1


def _meta(turn_type=CONTROL, **extra):
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", "▁", "a", "b", "▁a"]
    types = [CONTROL] * 4 + [turn_type] * 2 + [USER_DEFINED] + [NORMAL] * 4
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 7 + [-1.0, -2.0, -3.0, -0.5], "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_space_prefix": False, **extra}


def test_gemma_turn_tokens_get_gemma_template():
    tok = Tokenizer.from_gguf_metadata(_meta())
    assert tok.chat_template == GEMMA_TEMPLATE
    assert tok.eos_token_ids == (1, 5)  # <end_of_turn> ends generation, as in llama.cpp
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " a "},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "a"}]
    text = tok.apply_chat_template(messages)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\na<end_of_turn>\n<start_of_turn>model\nb<end_of_turn>\n"
                    "<start_of_turn>user\na<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [2, 4] and ids.count(2) == 1 and ids.count(4) == 4 and ids.count(5) == 3


def test_file_template_wins_and_plain_vocabularies_get_none():
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert Tokenizer.from_gguf_metadata(_meta(**{"tokenizer.chat_template": own})).chat_template == own
    assert Tokenizer.from_gguf_metadata(_meta(turn_type=NORMAL)).chat_template is None
