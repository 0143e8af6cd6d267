"""`Tokenizer.from_hf_dir` on folders written by HF's `save_pretrained`."""

import json
import os

import pytest
import tokenizers

from weld.tokenizer import Tokenizer
from weld.utils.errors import ModelNotFoundError

from test_tokenizer_chat_template import CONVERSATION


@pytest.fixture(scope="module")
def hf_dir(hf_smollm2, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2_hf")
    hf_smollm2.save_pretrained(folder)
    return folder


def test_ids_and_template_match_hf(hf_dir, hf_smollm2, corpus):
    weld = Tokenizer.from_hf_dir(hf_dir)
    # tokenizer.json is HF's GGUF conversion, without the digit split: weld follows the file.
    for text in corpus:
        ids = weld.encode(text)
        assert ids == hf_smollm2(text)["input_ids"], text
        assert weld.decode(ids) == hf_smollm2.decode(ids, skip_special_tokens=True)
    assert weld.bos_token_id == 1 and weld.eos_token_ids == (2,) and weld.pad_token_id == 2
    assert weld.vocab_size == 49152 and set(range(17)) <= set(weld.all_special_ids)
    assert os.path.isfile(os.path.join(hf_dir, "chat_template.jinja"))
    for add in (True, False):
        expected = hf_smollm2.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add)
        assert weld.apply_chat_template(CONVERSATION, add_generation_prompt=add) == expected


def test_eos_ids_from_generation_config_and_bos_from_post_processor(hf_dir, tmp_path):
    for name in os.listdir(hf_dir):
        with open(os.path.join(hf_dir, name), "rb") as src, open(tmp_path / name, "wb") as dst:
            dst.write(src.read())
    backend = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    weld = Tokenizer.from_hf_dir(tmp_path)
    assert weld.eos_token_ids == (2, 0)
    assert weld.encode("hi there") == [1, 6004, 665]
    assert weld.encode("hi there", add_special_tokens=False) == [6004, 665]
    assert weld.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"


def test_missing_folder(tmp_path):
    with pytest.raises(ModelNotFoundError):
        Tokenizer.from_hf_dir(tmp_path)
