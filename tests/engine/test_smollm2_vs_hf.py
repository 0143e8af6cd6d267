"""Real weights: weld's greedy tokens on the bundled SmolLM2 GGUF equal HF transformers' on the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weld import LLM, SamplingParams
from weld.weights import default_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colors of the rainbow:",
]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", quantization="none", max_model_len=512, kv_cache_memory_gb=0.05)


def test_greedy_32_tokens_equal_hf(llm, hf_model):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = out.prompt_token_ids
        with torch.no_grad():
            # No EOS for HF either (weld runs with ignore_eos); min_new_tokens would instead
            # suppress EOS logits and change the argmax.
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert len(ref) == 32
        assert out.outputs[0].token_ids == ref, prompt


def test_prompt_logprobs_equal_hf_log_softmax(llm, hf_model):
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    got = np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    want = np.array([ref[i - 1, ids[i]] for i in range(1, len(ids))])
    np.testing.assert_allclose(got, want, atol=1e-4)
