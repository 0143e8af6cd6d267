"""Perplexity of a fixed text under weld's weight forms and under llama.cpp, on the same token ids.

    python benchmarks/perplexity.py [--model FILE.gguf] [--modes kept,none,int8,int4] [--vs-llamacpp]
                                    [--text benchmarks/data/perplexity.txt] [--ctx 512] [--out FILE.json]

The text is tokenized once (weld's tokenizer, no BOS unless the model adds one) and cut into
non-overlapping windows of `--ctx` tokens; each window is scored from its second token on, with
the window before it as context only through the window itself (every window starts fresh), so
both engines see exactly the same tokens and context. weld scores through its public API
(`SamplingParams(prompt_logprobs=0)`: the log probability of every prompt token); llama.cpp
through llama-cpp-python with logits for every position. Modes: kept (a GGUF's Q8_0/Q4_0/Q4_1
blocks as stored, the default), none (dequantized to f32), or any `--quantization` mode (int8, int4,
int4_g128, int8_channel).

Result: perplexity per engine and mode, and the ratios the issue's targets are stated in
(int8 vs f32, kept vs llama.cpp).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent


def windows(ids: list[int], ctx: int) -> list[list[int]]:
    return [ids[i:i + ctx] for i in range(0, len(ids) - 1, ctx) if len(ids[i:i + ctx]) > 1]


def weld_engine(model: str | None, mode: str, ctx: int):
    from weld import LLM

    return LLM(model, quantization=None if mode == "kept" else mode, max_model_len=ctx + 1, max_num_seqs=4,
               kv_cache_memory_gb=0.25, enable_prefix_caching=False)


def weld_nll(llm, chunks: list[list[int]]) -> tuple[float, int, float]:
    """(sum of -log p, tokens scored, seconds) of weld's engine `llm`."""
    from weld import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    total, count = 0.0, 0
    for chunk, out in zip(chunks, outs):
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            total -= entry[chunk[pos]].logprob
            count += 1
    return total, count, seconds


def llamacpp_nll(path: pathlib.Path, chunks: list[list[int]], ctx: int, threads: int) -> tuple[float, int, float]:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    total, count, seconds = 0.0, 0, 0.0
    for chunk in chunks:
        llm.reset()
        start = time.perf_counter()
        llm.eval(chunk)
        seconds += time.perf_counter() - start
        logits = np.asarray(llm.scores[:len(chunk)], np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        total -= float(sum(logp[pos - 1, chunk[pos]] for pos in range(1, len(chunk))))
        count += len(chunk) - 1
    return total, count, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    ap.add_argument("--modes", default="kept,none,int8,int4")
    ap.add_argument("--vs-llamacpp", action="store_true")
    ap.add_argument("--text", default=str(HERE / "data" / "perplexity.txt"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out")
    args = ap.parse_args()

    from weld.weights import resolve_model

    source = resolve_model(args.model)
    results: dict[str, dict] = {}
    chunks = None
    for mode in args.modes.split(","):
        llm = weld_engine(args.model, mode, args.ctx)
        if chunks is None:
            chunks = windows(llm.get_tokenizer().encode(pathlib.Path(args.text).read_text()), args.ctx)
        total, count, seconds = weld_nll(llm, chunks)
        del llm
        results[f"weld {mode}"] = {"ppl": math.exp(total / count), "tokens": count, "seconds": seconds}
        print(f"weld {mode:>5}: perplexity {results[f'weld {mode}']['ppl']:.4f} over {count} tokens ({seconds:.1f} s)")
    if args.vs_llamacpp:
        total, count, seconds = llamacpp_nll(source.path, chunks, args.ctx, args.threads)
        results["llama.cpp"] = {"ppl": math.exp(total / count), "tokens": count, "seconds": seconds}
        print(f"llama.cpp : perplexity {results['llama.cpp']['ppl']:.4f} over {count} tokens ({seconds:.1f} s)")
    ratios = {}
    if "weld int8" in results and "weld none" in results:
        ratios["int8 / f32"] = results["weld int8"]["ppl"] / results["weld none"]["ppl"]
    if "weld int4" in results and "weld none" in results:
        ratios["int4 / f32"] = results["weld int4"]["ppl"] / results["weld none"]["ppl"]
    if "weld kept" in results and "llama.cpp" in results:
        ratios["kept / llama.cpp"] = results["weld kept"]["ppl"] / results["llama.cpp"]["ppl"]
    if "weld kept" in results and "weld none" in results:
        ratios["kept / f32 of the same blocks"] = results["weld kept"]["ppl"] / results["weld none"]["ppl"]
    for name, value in ratios.items():
        print(f"{name}: {value:.4f}")
    from weld.bench.roofline import machine_info

    out = {"date": datetime.date.today().isoformat(), "model": str(source.path), "text": args.text, "ctx": args.ctx,
           "windows": len(chunks), "results": results, "ratios": ratios, "machine": machine_info(os.getloadavg())}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
