"""The engine's fused decode loop on a TPU, the megakernel backend against the XLA one.

    python benchmarks/megakernel_engine_tpu.py [--model PATH] [--quantization none int8_channel]
        [--batches 1 8] [--output-len 128] [--input-len 64] [--runs 3] [--out FILE.json]

Each backend is a whole `LLM` (`steps_per_call` decode steps per device call, sampling on the
device), so the host's dispatch is paid once a call, not once a step: what a served model gets.
Decode tok/s at batch B is B * (out - 1) / (t(out tokens) - t(1 token)), as in `weld bench`; the
backends' runs alternate within each repetition, medians of `--runs`. Both are fed the same
random prompt ids, greedy, exactly `--output-len` tokens; the report says how many rows' tokens
agree between the backends (a bf16 near-tie may tip a row either way; see docs/megakernel.md).
Warm-up time (the programs compiled for the batch's shapes, the kernel's Mosaic compile
included) is reported apart. Off a TPU the kernel runs in interpret mode, so the script stops
unless `--interpret` asks for a smoke run (its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import numpy as np

from weld import LLM, SamplingParams

BACKENDS = ("xla", "megakernel")


def timed(llm: LLM, prompts: list[dict], tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8_channel"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", default=None)
    parser.add_argument("--interpret", action="store_true", help="off a TPU: run anyway (a smoke test)")
    args = parser.parse_args()
    if jax.default_backend() != "tpu" and not args.interpret:
        raise SystemExit(f"needs a TPU (JAX's backend is {jax.default_backend()}): the kernel would run interpreted")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": str(jax.devices()[0].device_kind),
              "host": platform.processor() or platform.machine(), "jax": jax.__version__,
              "model": args.model or "bundled", "input_len": args.input_len, "output_len": args.output_len,
              "runs": args.runs, "cases": []}
    rng = np.random.default_rng(0)
    for quant in args.quantization:
        engines = {}
        for backend in BACKENDS:
            start = time.perf_counter()
            engines[backend] = LLM(model=args.model, backend=backend, quantization=quant,
                                   max_model_len=args.max_model_len, max_num_seqs=max(args.batches))
            print(f"{quant} {backend}: loaded in {time.perf_counter() - start:.1f} s, "
                  f"steps_per_call {engines[backend].config.scheduler.steps_per_call}", flush=True)
        vocab = engines["xla"].cfg.vocab_size
        for batch in args.batches:
            prompts = [{"prompt_token_ids": rng.integers(0, vocab, args.input_len).tolist()} for _ in range(batch)]
            case = {"quantization": quant, "batch": batch, "warmup_s": {}, "t_full": {b: [] for b in BACKENDS},
                    "t_one": {b: [] for b in BACKENDS}}
            tokens = {}
            for backend, llm in engines.items():
                start = time.perf_counter()
                timed(llm, prompts, 1)
                timed(llm, prompts, args.output_len)
                case["warmup_s"][backend] = round(time.perf_counter() - start, 1)
            for run in range(args.runs):
                order = BACKENDS if run % 2 == 0 else BACKENDS[::-1]
                for backend in order:
                    t_one, _ = timed(engines[backend], prompts, 1)
                    t_full, tokens[backend] = timed(engines[backend], prompts, args.output_len)
                    case["t_one"][backend].append(round(t_one, 4))
                    case["t_full"][backend].append(round(t_full, 4))
            case["decode_tok_s"] = {
                b: round(batch * (args.output_len - 1)
                         / (statistics.median(case["t_full"][b]) - statistics.median(case["t_one"][b])), 1)
                for b in BACKENDS}
            case["ms_per_step"] = {b: round(1e3 * batch / v, 3) for b, v in case["decode_tok_s"].items()}
            case["megakernel_over_xla"] = round(case["decode_tok_s"]["megakernel"] / case["decode_tok_s"]["xla"], 3)
            case["rows_equal"] = sum(a == b for a, b in zip(tokens["xla"], tokens["megakernel"]))
            case["first_difference"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                        for a, b in zip(tokens["xla"], tokens["megakernel"])]
            result["cases"].append(case)
            print(json.dumps({k: case[k] for k in ("quantization", "batch", "warmup_s", "decode_tok_s", "ms_per_step",
                                                   "megakernel_over_xla", "rows_equal", "first_difference")}),
                  flush=True)
        del engines
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
