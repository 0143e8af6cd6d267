"""lm-eval's `local-completions` and `local-chat-completions` clients against a real `weld serve`,
compared sample by sample with lm-eval's own HF backend (transformers, torch CPU, float32) on the
same model: the loglikelihood of every choice, whether it is the greedy continuation, and every
generated text.

The tasks are local files (tests/data/lm_eval, loaded with `dataset_path: json`, no hub):
weld_capitals is multiple choice (lm-eval sends each question + choice as token ids with `echo`,
`logprobs: 1`, `max_tokens: 1` and sums the choice's prompt logprobs) and weld_arithmetic is
generate_until with stops ("\\n", "Question:"). The default suite runs them on a tiny random
llama (~25 s, most of it starting the server); `-m slow` runs them on the bundled
SmolLM2-135M-Instruct as well (~3 min: transformers' GGUF loader is slow).
"""

from __future__ import annotations

import contextlib
import json
import pathlib

import httpx
import lm_eval
import pytest
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from tests.server.conftest import run_server
from weld.weights import default_model_path

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "data" / "lm_eval"  # the YAMLs name their jsonl relative to ROOT
STOPS = ["\n", "Question:"]  # weld_arithmetic.yaml's
MAX_GEN_TOKS = 16  # weld_arithmetic.yaml's
# Per-token logprobs agree to ~1e-5 in f32 (weld's XLA/CPU forward vs torch's: the same maths,
# another summation order); a choice's loglikelihood sums up to ~10 of them (the tiny tokenizer
# spells an unknown word byte by byte). Measured: 7e-6 at most on the tiny llama, 6.5e-5 on
# SmolLM2. 1e-3 leaves an order of magnitude, while a wrong position (an off-by-one in the
# echoed logprobs) moves a sum by whole nats.
LOGLIKELIHOOD_ABS = 1e-3


def evaluate(model, tasks: list[str], **kwargs) -> dict:
    """lm_eval.simple_evaluate from the repository root; {task: [sample, ...] in doc order}."""
    # only our tasks: indexing lm-eval's ~15,000 bundled task files takes ~10 s a time
    task_manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    with contextlib.chdir(ROOT):
        out = lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=task_manager, log_samples=True,
                                      **kwargs)
    return {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in out["samples"].items()}


def local_client(kind: str, url: str, model: str, **args):
    """lm-eval's API model, built as `--model kind --model_args ...` would build it."""
    path = "/v1/completions" if kind == "local-completions" else "/v1/chat/completions"
    return lm_eval.api.registry.get_model(kind)(model=model, base_url=url + path, **args)


def loglikelihoods(samples: list[dict]) -> list[list[tuple[float, bool]]]:
    """Per doc, per choice: (sum of the choice's token logprobs, is it the greedy continuation)."""
    return [[(float(r[0][0]), bool(r[0][1])) for r in s["resps"]] for s in samples]


def generations(samples: list[dict]) -> list[str]:
    return [s["resps"][0][0] for s in samples]


def check_loglikelihoods(weld: list[dict], hf: list[dict]):
    ours, theirs = loglikelihoods(weld), loglikelihoods(hf)
    assert len(ours) == len(theirs) == 8
    for doc, (a, b) in enumerate(zip(ours, theirs)):
        assert [ll for ll, _ in a] == pytest.approx([ll for ll, _ in b], abs=LOGLIKELIHOOD_ABS), doc
        assert [g for _, g in a] == [g for _, g in b], doc
    assert [s["acc"] for s in weld] == [s["acc"] for s in hf]


def check_generations(weld: list[dict], hf: list[dict], stops: list[str]):
    ours = generations(weld)
    assert ours == generations(hf)
    assert not any(stop in text for text in ours for stop in stops)


def questions() -> list[str]:
    return [json.loads(line)["question"] for line in (TASKS / "arithmetic.jsonl").read_text().splitlines()]


def run_all(url: str, model: str, hf: HFLM, stops: list[str]):
    """Loglikelihood and generation through local-completions (the remote tokenizer, found by
    itself, and batches of 4 token-id prompts), generation through local-chat-completions with
    the chat template (2 requests at a time), each against the HF backend; generation stops at
    `stops`."""
    gen_kwargs = {"until": stops}
    # the premise: greedy decoding meets a stop in some of these answers (else stops go untested)
    body = {"model": model, "prompt": [f"Question: {q}\nAnswer:" for q in questions()], "max_tokens": MAX_GEN_TOKS,
            "temperature": 0, "stop": stops}
    choices = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"]
    assert any(c["finish_reason"] == "stop" for c in choices)

    completions = local_client("local-completions", url, model, batch_size=4)
    assert completions.tokenizer_backend == "remote"  # /tokenizer_info + /tokenize answered
    weld = evaluate(completions, ["weld_capitals", "weld_arithmetic"], gen_kwargs=gen_kwargs)
    ref = evaluate(hf, ["weld_capitals", "weld_arithmetic"], gen_kwargs=gen_kwargs)
    check_loglikelihoods(weld["weld_capitals"], ref["weld_capitals"])
    check_generations(weld["weld_arithmetic"], ref["weld_arithmetic"], stops)

    chat = local_client("local-chat-completions", url, model, num_concurrent=2)  # lm-eval's aiohttp path
    weld = evaluate(chat, ["weld_arithmetic"], apply_chat_template=True, gen_kwargs=gen_kwargs)
    ref = evaluate(hf, ["weld_arithmetic"], apply_chat_template=True, gen_kwargs=gen_kwargs)
    check_generations(weld["weld_arithmetic"], ref["weld_arithmetic"], stops)
    return completions


def check_greedy_flag(completions, hf: HFLM, torch_model):
    """lm-eval's is_greedy (every continuation token the top-1 of its position: weld's
    top_logprobs must hold the top-1 with the very logprob it gives the chosen token), which the
    tasks' choices never are: a greedy continuation from torch, and one with its last token changed."""
    import torch

    context = completions.tok_encode("Paris is the capital of")
    ids = list(context)
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(torch_model(torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = ids[len(context):]
    other = greedy[:-1] + [3 if greedy[-1] != 3 else 4]
    requests = [(None, context, greedy), (None, context, other)]
    ours, theirs = completions._loglikelihood_tokens(requests), hf._loglikelihood_tokens(requests)
    assert [g for _, g in ours] == [g for _, g in theirs] == [True, False]
    assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in theirs], abs=LOGLIKELIHOOD_ABS)


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir, tmp_path_factory):
    directory, _ = tiny_llama_dir
    # float32 asked for, so the KV cache is float32 too and the scores are HF's to 1e-3
    with run_server("--model", str(directory), "--dtype", "float32", "--max-model-len", "256",
                    "--kv-cache-memory-gb", "0.01", "--served-model-name", "tiny",
                    tmp_path=tmp_path_factory.mktemp("srv")) as srv:
        yield srv


def test_tokenizer_info_names_the_special_tokens_and_template(tiny_server, tiny_llama_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_llama_dir[0])
    info = httpx.get(tiny_server.url + "/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (hf.eos_token, hf.bos_token, hf.pad_token)
    assert info["chat_template"] == hf.chat_template and info["model_max_length"] == 256


def test_tiny_llama_matches_hf(tiny_server, tiny_llama_dir):
    hf = HFLM(pretrained=str(tiny_llama_dir[0]), dtype="float32", device="cpu", batch_size=1)
    # the random model writes no newline, but often "it"
    completions = run_all(tiny_server.url, "tiny", hf, STOPS + ["it"])
    check_greedy_flag(completions, hf, tiny_llama_dir[1])


@pytest.mark.slow  # SmolLM2 through transformers' GGUF loader (~45 s) and weld (~40 s)
def test_smollm2_matches_hf(tmp_path_factory):
    """The bundled model, dequantized to f32 on both sides (`--quantization none`; transformers
    always dequantizes a GGUF), with its own tokenizer and chat template."""
    gguf = default_model_path()
    with run_server("--dtype", "float32", "--max-model-len", "512", "--quantization", "none",
                    "--kv-cache-memory-gb", "0.1", tmp_path=tmp_path_factory.mktemp("srv")) as srv:
        hf = HFLM(pretrained=str(gguf.parent), gguf_file=gguf.name, dtype="float32",
                  device="cpu", batch_size=1)
        run_all(srv.url, "SmolLM2-135M-Instruct", hf, STOPS)
