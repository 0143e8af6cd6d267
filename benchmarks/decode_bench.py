"""Batch-1 greedy decode benchmark: weld vs HF transformers on SmolLM2-135M-Instruct, side by side.

For each weight dtype it measures load time, compile time (weld) / first-call warm-up (HF),
time to first token, and decode tokens/s (median of --runs), plus the fraction of the
memory-bandwidth floor (bytes read per decode step over a bandwidth measured in this run).

    python benchmarks/decode_bench.py                       # f32 + bf16, weld + HF, 3 runs
    python benchmarks/decode_bench.py --dtypes float32 --no-hf --runs 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

# A fresh persistent XLA cache, set before weld is imported, so compile time is measured cold.
os.environ["WELD_CACHE_DIR"] = tempfile.mkdtemp(prefix="weld-bench-xla-")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from weld import LLM, SamplingParams  # noqa: E402
from weld.weights import default_model_path  # noqa: E402

PROMPT = ("The old lighthouse keeper climbed the stairs every evening to light the lamp. "
          "One stormy night, he saw a small boat struggling against the waves, and")
HF_THREADS = 2  # the benchmark machine has 2 cores (--hf-threads changes it)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def measure_bandwidth(gb: float = 1.0, reps: int = 5) -> dict:
    """Median GB/s of a ~1 GB numpy copy (read + write bytes counted) and sum (read bytes)."""
    a = np.ones(int(gb * 1e9) // 4, np.float32)
    b = np.empty_like(a)
    b.fill(0)  # fault the pages in before timing
    copy = [2 * a.nbytes / timed(lambda: np.copyto(b, a))[0] / 1e9 for _ in range(reps)]
    summ = [a.nbytes / timed(a.sum)[0] / 1e9 for _ in range(reps)]
    res = {"copy_gb_s": statistics.median(copy), "sum_gb_s": statistics.median(summ),
           "copy_raw": copy, "sum_raw": summ}
    res["used_gb_s"] = max(res["copy_gb_s"], res["sum_gb_s"])  # the best rate this run reached
    return res


def bytes_per_step(weight_bytes: int, cfg, itemsize: int, prompt_len: int, new_tokens: int) -> dict:
    """Weights (all of them: the tied embedding is read whole as the lm_head) + the mean KV read
    per decode step (K and V of every layer for the tokens in context, averaged over the run)."""
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    mean_context = prompt_len + new_tokens / 2
    kv = kv_per_token * mean_context
    return {"weights": weight_bytes, "kv_mean": kv, "total": weight_bytes + kv}


def bench_rows(dtype: str, ids: list[int] | None, args, bw: float) -> tuple[dict, dict | None, list[int]]:
    n = args.new_tokens
    log(f"[weld {dtype}] loading")
    t_load, llm = timed(lambda: LLM(model=None, dtype=dtype))
    ids = ids or llm.tokenizer.encode(PROMPT)  # weld's tokenizer; the same ids go to both engines
    full = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    gen = lambda sp: llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)  # noqa: E731
    log(f"[weld {dtype}] first generate (compiles prefill + decode)")
    t_first, out = timed(lambda: gen(full))
    weld_tokens = list(out[0].outputs[0].token_ids)
    gen(one)  # untimed: anything max_tokens=1 alone would compile
    weld = {"engine": "weld", "dtype": dtype, "load_s": t_load, "first_generate_s": t_first,
            "t_full": [], "t_one": [], "tokens": weld_tokens}
    leaves = jax.tree_util.tree_leaves(llm.model.weights)
    weight_bytes = sum(x.nbytes for x in leaves)
    itemsize = leaves[0].dtype.itemsize
    bps = bytes_per_step(weight_bytes, llm.cfg, itemsize, len(ids), n)
    weld["bytes_per_step"] = bps
    hf = model = None
    if not args.no_hf:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(args.hf_threads)
        path = default_model_path()
        tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        log(f"[HF {dtype}] loading (dequantizes the GGUF)")
        t_hf_load, model = timed(lambda: AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=tdtype).eval())
        x = torch.tensor([ids])
        mask = torch.ones_like(x)

        def hf_gen(k: int) -> list[int]:
            with torch.inference_mode():
                o = model.generate(x, attention_mask=mask, max_new_tokens=k, min_new_tokens=k,
                                   do_sample=False, pad_token_id=model.config.eos_token_id)
            return o[0, len(ids):].tolist()

        log(f"[HF {dtype}] first generate (warm-up)")
        t_hf_first, hf_tokens = timed(lambda: hf_gen(n))
        hf = {"engine": "hf", "dtype": dtype, "load_s": t_hf_load, "first_generate_s": t_hf_first,
              "t_full": [], "t_one": [], "tokens": hf_tokens,
              "bytes_per_step": bytes_per_step(sum(p.numel() * p.element_size() for p in model.parameters()),
                                               llm.cfg, itemsize, len(ids), n)}
    # Interleave the engines per repetition so background load drifts hit both alike.
    for r in range(args.runs):
        log(f"[{dtype}] run {r + 1}/{args.runs}")
        weld["t_full"].append(timed(lambda: gen(full))[0])
        weld["t_one"].append(timed(lambda: gen(one))[0])
        if hf is not None:
            hf["t_full"].append(timed(lambda: hf_gen(n))[0])
            hf["t_one"].append(timed(lambda: hf_gen(1))[0])
    for row in (weld, hf):
        if row is not None:
            summarize(row, n, bw)
    weld["compile_s"] = weld["first_generate_s"] - statistics.median(weld["t_full"])
    if hf is not None:
        hf["compile_s"] = hf["first_generate_s"] - statistics.median(hf["t_full"])  # HF warm-up, no compile
        match = next((i for i, (a, b) in enumerate(zip(weld_tokens, hf["tokens"])) if a != b),
                     min(len(weld_tokens), len(hf["tokens"])))
        weld["hf_matching_prefix"] = hf["hf_matching_prefix"] = match
    del llm, model
    return weld, hf, ids


def summarize(row: dict, n: int, bw: float) -> None:
    t_full, t_one = statistics.median(row["t_full"]), statistics.median(row["t_one"])
    row["ttft_s"] = t_one
    row["decode_tok_s"] = (n - 1) / (t_full - t_one)
    row["decode_tok_s_per_run"] = [(n - 1) / (f - o) for f, o in zip(row["t_full"], row["t_one"])]
    row["floor_tok_s"] = bw * 1e9 / row["bytes_per_step"]["total"]
    row["floor_fraction"] = row["decode_tok_s"] / row["floor_tok_s"]


def print_table(rows: list[dict], args, bw: dict, ids: list[int]) -> None:
    print(f"\nSmolLM2-135M-Instruct (bundled Q4_1 GGUF, dequantized), batch 1, greedy, prompt {len(ids)} "
          f"tokens, {args.new_tokens} new, median of {args.runs}; HF torch threads={args.hf_threads}")
    print(f"memory bandwidth: copy {bw['copy_gb_s']:.1f} GB/s (r+w), sum {bw['sum_gb_s']:.1f} GB/s; "
          f"floor uses {bw['used_gb_s']:.1f} GB/s")
    head = f"{'':10} {'load s':>8} {'compile s':>10} {'TTFT ms':>8} {'decode tok/s':>13} {'floor tok/s':>12} {'% floor':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        name = f"{'weld' if r['engine'] == 'weld' else 'HF'} {'f32' if r['dtype'] == 'float32' else 'bf16'}"
        compile_s = f"{r['compile_s']:.2f}" + ("" if r["engine"] == "weld" else "*")
        print(f"{name:10} {r['load_s']:8.2f} {compile_s:>10} {r['ttft_s'] * 1e3:8.1f} {r['decode_tok_s']:13.1f} "
              f"{r['floor_tok_s']:12.1f} {100 * r['floor_fraction']:7.1f}%")
    if any(r["engine"] == "hf" for r in rows):
        print("* HF has no compile step: first-call warm-up minus a steady run")
    for dtype in args.dtypes:
        w = next((r for r in rows if r["engine"] == "weld" and r["dtype"] == dtype), None)
        h = next((r for r in rows if r["engine"] == "hf" and r["dtype"] == dtype), None)
        if w and h:
            print(f"weld/HF {dtype}: decode {w['decode_tok_s'] / h['decode_tok_s']:.2f}x, "
                  f"TTFT {h['ttft_s'] / w['ttft_s']:.2f}x faster, load {w['load_s'] / h['load_s']:.2f}x the time; "
                  f"greedy tokens agree on the first {w['hf_matching_prefix']}/{args.new_tokens}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--hf-threads", type=int, default=HF_THREADS,
                   help="torch threads for HF; with another process busy on a 2-core machine, 2 threads "
                        "oversubscribe the cores and OpenMP slows HF by 5-10x, so also try 1")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_<date>.json)")
    args = p.parse_args()
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]

    started = datetime.datetime.now()
    load_start = os.getloadavg()
    log("measuring memory bandwidth")
    bw = measure_bandwidth()
    t_import = time.perf_counter()
    ids = None
    rows = []
    for dtype in args.dtypes:
        weld_row, hf_row, ids = bench_rows(dtype, ids, args, bw["used_gb_s"])
        rows += [r for r in (weld_row, hf_row) if r is not None]
    rows.sort(key=lambda r: (r["engine"] != "weld", args.dtypes.index(r["dtype"])))
    bw_after = measure_bandwidth(reps=3)
    print_table(rows, args, bw, ids)
    print(f"load average (1 min) at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} cores: above ~0.5 other work was running and the figures are pessimistic")
    print(f"bandwidth re-measured at the end: copy {bw_after['copy_gb_s']:.1f}, sum {bw_after['sum_gb_s']:.1f} GB/s")

    import torch
    import transformers
    out = pathlib.Path(args.out or pathlib.Path(__file__).parent / "results" / f"decode_{started:%Y-%m-%d_%H%M}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "started": started.isoformat(timespec="seconds"), "elapsed_s": time.perf_counter() - t_import,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
                    "loadavg_start_end": [load_start, os.getloadavg()], "python": platform.python_version(), "jax": jax.__version__,
                    "jax_backend": jax.default_backend(), "numpy": np.__version__, "torch": torch.__version__,
                    "transformers": transformers.__version__, "hf_threads": args.hf_threads},
        "note": "shared 2-core machine; other work may have run concurrently (see loadavg and bandwidth)",
        "model": str(default_model_path()), "prompt": PROMPT, "prompt_token_ids": ids,
        "new_tokens": args.new_tokens, "runs": args.runs, "weld_cache_dir": os.environ["WELD_CACHE_DIR"],
        "bandwidth_start": bw, "bandwidth_end": bw_after, "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
