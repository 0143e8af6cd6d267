"""`weld serve` on the MoE / MLA / sliding-window families: the official client gets the greedy
text transformers generates on the same tiny model, streamed and not, and /metrics counts pages
of every page group."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.server.conftest import run_server

VARIANTS = ["deepseek_v3", "gemma3_text", "gpt_oss", "qwen3_moe"]


@pytest.fixture(scope="module", params=VARIANTS)
def served(request, tiny_family_dir, tmp_path_factory):
    directory, hf = tiny_family_dir(request.param)
    with run_server("--model", str(directory), "--max-model-len", "96", "--block-size", "4",
                    "--kv-cache-memory-gb", "0.004", "--max-num-seqs", "4",
                    tmp_path=tmp_path_factory.mktemp("server")) as server:
        yield request.param, server, hf


def test_completions_equal_hf_greedy(served):
    variant, server, hf = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    prompt = "Once upon a time there was"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([tokens]), max_new_tokens=8, do_sample=False, eos_token_id=2, pad_token_id=0)
    expected = ref[0, len(tokens):].tolist()
    expected = expected[:expected.index(2)] if 2 in expected else expected  # EOS (<|im_end|>) ends it
    text = httpx.post(server.url + "/detokenize", json={"tokens": expected}, timeout=30).json()["prompt"]
    assert out.choices[0].text == text, variant
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert streamed == text
    assert server.metric("weld:kv_cache_usage_perc") == 0.0  # every page of every group came back
