"""Second-turn time to first token of a hybrid model, with and without the prefix cache.

    python benchmarks/hybrid_prefix.py [--prefix 4096] [--runs 3] [--out FILE.json]

A synthetic Qwen3.5 model (transformers' `qwen3_5_text` with random weights, saved to a temporary
directory with a word-level tokenizer; the shape of `benchmarks/hybrid.py`: d 1024, 16 layers,
12 Gated DeltaNet + 4 full attention) served by `weld.LLM` as a user would. Turn one: a
`--prefix`-token prompt (a system prompt and a first question, random ids) and a 32-token
answer. Turn two: turn one's prompt, its answer and a 32-token question, timed to its first new
token (`max_tokens=1`). With prefix caching the second turn restores the recurrent state
snapshot taken at the first prompt's last page and the cached pages of the full layers, and
computes only the rest (the answer and the new question); without it, the whole prompt again.
Each run uses fresh random prompts; medians of `--runs`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from hybrid import LINEAR, SHAPE, machine  # noqa: E402


def make_model(directory: pathlib.Path) -> int:
    """Writes the synthetic model and a word-level tokenizer; returns the vocabulary size."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = SHAPE["vocab_size"]
    cfg = AutoConfig.for_model("qwen3_5_text", **{**SHAPE, **{k: v for k, v in LINEAR.items()
                                                                 if k != "partial_rotary_factor"}},
                               full_attention_interval=4, bos_token_id=None, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(directory)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t0", "bos_token": None}))
    return vocab


def second_turn_ttft(llm, rng, vocab: int, prefix: int) -> tuple[float, float]:
    from weld import SamplingParams

    first = rng.integers(1, vocab, prefix).tolist()
    answer = llm.generate({"prompt_token_ids": first}, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    second = first + list(answer) + rng.integers(1, vocab, 32).tolist()
    hits = llm.engine.block_manager.prefix_hits
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": second}, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - start, llm.engine.block_manager.prefix_hits - hits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=int, default=4096)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from weld import LLM

    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
              "shape": {**SHAPE, **LINEAR}, "prefix_tokens": args.prefix, "runs": args.runs}
    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp)
        vocab = make_model(directory)
        for caching in (True, False):
            llm = LLM(str(directory), max_model_len=args.prefix + 256, max_num_seqs=2,
                      enable_prefix_caching=caching)
            llm.warmup()
            rng = np.random.default_rng(1)
            second_turn_ttft(llm, rng, vocab, 64)  # compiles the shapes a second turn uses
            times, hits = zip(*(second_turn_ttft(llm, rng, vocab, args.prefix) for _ in range(args.runs)))
            key = "prefix_cache" if caching else "no_prefix_cache"
            result[key] = {"ttft_s": list(times), "median_ttft_s": float(np.median(times)),
                           "prompt_tokens_hit": list(hits)}
            print(key, f"median TTFT {np.median(times):.3f} s, tokens from the cache {hits}", flush=True)
            del llm
    result["speedup"] = result["no_prefix_cache"]["median_ttft_s"] / result["prefix_cache"]["median_ttft_s"]
    print(f"second turn {result['speedup']:.1f}x faster with the prefix cache")
    out = args.out or str(HERE / "results" / f"hybrid_prefix_{datetime.date.today()}.json")
    pathlib.Path(out).write_text(json.dumps(result, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
