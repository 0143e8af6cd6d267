"""`weld serve --spec ngram` on a tiny random llama: /metrics exports the speculative counters
under vLLM's names, and their values are those of the traffic sent (an engine with the same
speculative config, given the same requests one at a time, counts the same and replies the same)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import run_server
from weld import LLM, SamplingParams
from weld.server.metrics import Metrics

MAX_MODEL_LEN = 256
ENGINE_ARGS = dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory_gb=0.01, steps_per_call=4)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False}
# Text the tiny tokenizer was trained on, repeated: n-gram lookup finds the continuation in the prompt.
COPY_PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3 + "The quick brown fox",
                "def add(a, b):\n    return a + b\n\n" * 3 + "def add(a,"]
COUNTERS = ("weld:spec_decode_num_drafts_total", "weld:spec_decode_num_draft_tokens_total",
            "weld:spec_decode_num_accepted_tokens_total")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    directory, _ = tiny_llama_dir
    with run_server("--model", str(directory), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gb",
                    "0.01", "--steps-per-call", "4", "--served-model-name", "tiny", "--spec", "ngram", "--spec-k", "3",
                    "--no-spec-adaptive",
                    tmp_path=tmp_path_factory.mktemp("srv-spec")) as srv:
        yield srv


def scrape(server) -> dict:
    """The spec series of /metrics: plain samples by name, per-position ones by (name, position)."""
    samples = {}
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("weld:spec_decode"):
            head, value = line.rsplit(" ", 1)
            name = head.split("{", 1)[0]
            position = head.split('position="')[1].split('"')[0] if 'position="' in head else None
            samples[(name, int(position)) if position is not None else name] = float(value)
    return samples


def per_position(samples: dict, name: str) -> list[float]:
    positions = sorted(p for key, p in (k for k in samples if isinstance(k, tuple)) if key == name)
    assert positions == list(range(len(positions))), positions  # contiguous from 0
    return [samples[name, p] for p in positions]


def test_metrics_count_the_speculation_of_real_traffic(server, tiny_llama_dir):
    before = scrape(server)  # after the server's own warm-up request
    for name in (*COUNTERS, "weld:spec_decode_mean_acceptance_length"):
        assert name in before, name
    texts = []
    for prompt in COPY_PROMPTS:  # one at a time: the batches are those of the reference below
        resp = httpx.post(server.url + "/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0})
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["text"])
    after = scrape(server)
    drafts, drafted, accepted = (after[n] - before[n] for n in COUNTERS)
    assert drafts > 0 and accepted > 0, "copy-heavy prompts must get drafts accepted"
    assert drafted >= accepted
    accepted_pp = [a - b for a, b in zip(per_position(after, "weld:spec_decode_num_accepted_tokens_per_pos_total"),
                                         per_position(before, "weld:spec_decode_num_accepted_tokens_per_pos_total"))]
    drafted_pp = per_position(after, "weld:spec_decode_num_draft_tokens_per_pos_total")
    assert len(accepted_pp) == len(drafted_pp) == 3 and sum(accepted_pp) == accepted
    total_drafts = after["weld:spec_decode_num_drafts_total"]
    total_accepted = after["weld:spec_decode_num_accepted_tokens_total"]
    assert after["weld:spec_decode_mean_acceptance_length"] == pytest.approx(1 + total_accepted / total_drafts)

    directory, _ = tiny_llama_dir
    reference = LLM(model=str(directory), speculative_config=SPEC, **ENGINE_ARGS)
    params = SamplingParams(max_tokens=24, temperature=0)  # (greedy = plain decoding: tests/engine)
    assert texts == [reference.generate(p, params)[0].outputs[0].text for p in COPY_PROMPTS]
    stats = reference.engine.spec_stats()
    assert (drafts, drafted, accepted) == (stats["spec_num_drafts"], stats["spec_num_draft_tokens"],
                                           stats["spec_num_accepted_tokens"])
    assert accepted_pp == stats["spec_accepted_per_position"]


def test_metrics_without_speculation_have_no_spec_series():
    """The registry mirrors the engine's cumulative stats: the spec series appear with the first
    stats that carry them, counters only move up, the gauge follows the engine's mean."""
    metrics = Metrics("m")
    base = {"running": 0, "waiting": 0, "num_pages": 8, "num_free_pages": 8, "prefix_cache_queries": 0,
            "prefix_cache_hits": 0, "num_preemptions": 0}
    metrics.update_from_stats(base)
    assert b"spec_decode" not in metrics.render()
    spec = {"spec_num_drafts": 4, "spec_num_draft_tokens": 10, "spec_num_accepted_tokens": 5,
            "spec_accepted_per_position": [3, 1, 1], "spec_drafted_per_position": [4, 3, 3],
            "spec_mean_acceptance_length": 2.25}
    metrics.update_from_stats(base | spec)
    metrics.update_from_stats(base | spec)  # the same totals again: nothing counted twice
    text = metrics.render().decode()
    assert 'weld:spec_decode_num_draft_tokens_total{model_name="m"} 10.0' in text
    assert 'weld:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3.0' in text
    assert 'weld:spec_decode_num_draft_tokens_per_pos_total{model_name="m",position="2"} 3.0' in text
    assert 'weld:spec_decode_mean_acceptance_length{model_name="m"} 2.25' in text
