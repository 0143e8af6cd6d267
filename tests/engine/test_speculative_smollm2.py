"""Real weights: greedy outputs of SmolLM2 with each proposer equal its outputs without speculation.

The weights are dequantized (quantization "none"): with the GGUF's blocks kept, activations are
rounded to int8 per block, which turns last-bit differences between a verification batch and a
decode step (XLA's reductions vectorize by shape) into whole rounding steps, so greedy ties may
break differently (docs/quantization.md).

Slow (SmolLM2's verification programs compile for a while): `pytest -m slow`.
"""

from __future__ import annotations

import pytest

from weld import LLM, SamplingParams
from weld.weights import default_model_path

pytestmark = pytest.mark.slow

TEXT = ("The committee met on Tuesday to discuss the budget for next year. After a long debate, the members "
        "agreed to increase funding for the public library by ten percent and to repair the roof of the town hall.")
MESSAGES = [[{"role": "user", "content": "Repeat the following text exactly:\n\n" + TEXT}],
            [{"role": "user", "content": "What is the capital of France?"}]]
ENGINE = dict(dtype="float32", quantization="none", max_model_len=512, kv_cache_memory_gb=0.05, max_num_seqs=4, progress=False)


def prompts(llm: LLM) -> list[dict]:
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.encode(tok.apply_chat_template(m, add_generation_prompt=True))} for m in MESSAGES]


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(prompts(llm), SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference():
    return greedy(LLM(**ENGINE))


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory):
    """An untrained DSpark drafter for SmolLM2: its drafts are poor, the outputs must not change."""
    from weld.engine.spec import dspark
    from weld.weights import load_model

    target = load_model(default_model_path())
    cfg = dspark.DraftConfig.for_target(target.cfg, block_size=3)
    directory = tmp_path_factory.mktemp("smollm2-dspark")
    dspark.save(directory, dspark.init_params(cfg, target_weights=target.weights), cfg)
    return directory


@pytest.mark.parametrize("method", ["ngram", "draft_model", "dspark"])
def test_smollm2_greedy_with_speculation_equals_plain(method, reference, random_drafter):
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":  # the only local model with SmolLM2's tokenizer is SmolLM2 itself
        config["model"] = str(default_model_path())
    if method == "dspark":
        config.update(model=str(random_drafter), confidence_threshold=0.0)
    llm = LLM(speculative_config=config, **ENGINE)
    assert greedy(llm) == reference
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    if method != "dspark":  # copying text (n-gram) and drafting with the target itself are accepted
        assert stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_pages"] == stats["num_pages"]
