"""Hybrid linear attention, measured: decode step time against context length, and the chunked
delta rule against its recurrent twin.

    python benchmarks/hybrid.py [--contexts 1024,4096,16384] [--runs 5] [--out FILE.json]

decode: three synthetic models of one realistic shape (random weights, f32, the family code weld
serves; d 1024, 16 layers, 8 query / 2 KV heads of 128, SwiGLU 2816): every layer full attention
(`llama`), Qwen3-Next's 3 Gated DeltaNet layers to 1 full one (`qwen3_next`; 8 key / 16 value
heads of 128, conv 4: about the parameters of a full layer), and every layer Gated DeltaNet. Each runs one jitted batch-1 decode step
(`forward` on a paged cache, the program the engine's decode loop calls) at each context length:
the full-attention layers read all of their K/V, the linear ones one state per layer, whatever
the context. Times are medians of `--runs` calls after a warm-up, each run timing every model and
context once in turn; the pages hold zeros (the cost does not depend on their values).

prefill: the delta rule alone over one sequence (16 heads, dk = dv = 128) of each length in
`--prefill-lens`, chunked (chunks of 64) and token by token; tok/s, medians of `--runs`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
PAGE = 16
SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
LINEAR = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, partial_rotary_factor=0.25)


def models() -> dict:
    """name -> (family module, Config) of the three synthetic models."""
    from weld.models import llama, qwen3_next

    dense = llama.Config.from_hf({**SHAPE, "architectures": ["LlamaForCausalLM"]})
    hybrid = {**SHAPE, **LINEAR, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
    return {
        "dense (16 full)": (llama, dense),
        "hybrid (12 linear + 4 full)": (qwen3_next, qwen3_next.Config.from_hf({**hybrid, "full_attention_interval": 4})),
        "linear only (16 linear)": (qwen3_next, qwen3_next.Config.from_hf(
            {**hybrid, "layer_types": ["linear_attention"] * SHAPE["num_hidden_layers"]})),
    }


def decode_times(models: dict, contexts: list[int], runs: int) -> dict:
    """Median step times per model and context. Every run times each (model, context) once, in
    turn, so the machine's drift spreads over all of them alike."""
    from weld.kernels import cpu as cpu_kernels
    from weld.models.common.cache import AttentionBatch
    from weld.models.common.spec import random_weights
    from weld.models.family import WeightTarget

    width = max(contexts) // PAGE + 1
    token = jnp.ones((1, 1), jnp.int32)
    state = {}
    for name, (family, cfg) in models.items():
        weights = random_weights(family.weight_specs(cfg), seed=0, dtype=jnp.float32)
        weights = family.prepare_weights(weights, cfg, WeightTarget("xla", cpu_kernels.available()))
        spec = family.cache_spec(cfg)
        batch = AttentionBatch(spec.tables(jnp.arange(width, dtype=jnp.int32)[None]), jnp.zeros((1,), jnp.int32))
        step = jax.jit(family.forward, static_argnums=(1,), donate_argnums=(4,))
        state[name] = [step, weights, cfg, spec.create(width, PAGE, jnp.float32, num_slots=1), batch, spec]

    def call(name: str, ctx: int) -> float:
        step, weights, cfg, cache, batch, _ = state[name]
        start = time.perf_counter()
        logits, _, cache = step(weights, cfg, token, jnp.full((1, 1), ctx, jnp.int32), cache, batch)
        jax.block_until_ready(logits)
        state[name][3] = cache
        return time.perf_counter() - start

    times = {name: {ctx: [] for ctx in contexts} for name in models}
    for name in models:
        for ctx in contexts:
            call(name, ctx)  # warm-up (compiles once per model)
    for _ in range(runs):
        for name in models:
            for ctx in contexts:
                times[name][ctx].append(call(name, ctx))
    out = {}
    for name, (_, cfg) in models.items():
        spec = state[name][5]
        out[name] = {ctx: {"median_ms": 1e3 * float(np.median(t)), "ms": [1e3 * x for x in t]}
                     for ctx, t in times[name].items()}
        out[name].update(params=cfg.num_params(), kv_bytes_per_token=spec.bytes_per_token(jnp.float32),
                         state_bytes_per_sequence=spec.bytes_per_sequence())
    return out


def prefill_rates(lengths: list[int], runs: int) -> dict:
    from weld.models.common import linear_attention as la

    rng = np.random.default_rng(0)
    h, d = 16, 128
    out = {}
    for t in lengths:
        q = la.l2norm(jnp.asarray(rng.standard_normal((1, t, h, d)), jnp.float32)) * d ** -0.5
        k = la.l2norm(jnp.asarray(rng.standard_normal((1, t, h, d)), jnp.float32))
        v = jnp.asarray(rng.standard_normal((1, t, h, d)), jnp.float32)
        g = -jnp.asarray(rng.uniform(0.0, 0.1, (1, t, h)), jnp.float32)
        beta = jnp.asarray(rng.uniform(0.0, 1.0, (1, t, h)), jnp.float32)
        s0 = jnp.zeros((1, h, d, d), jnp.float32)
        row = {}
        for name, form in (("chunked", la.delta_rule_chunked), ("recurrent", la.delta_rule_recurrent)):
            fn = jax.jit(form)
            jax.block_until_ready(fn(q, k, v, g, beta, s0))
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                jax.block_until_ready(fn(q, k, v, g, beta, s0))
                times.append(time.perf_counter() - start)
            row[name] = {"median_s": float(np.median(times)), "tok_s": t / float(np.median(times))}
        row["chunked_over_recurrent"] = row["chunked"]["tok_s"] / row["recurrent"]["tok_s"]
        out[t] = row
    return out


def machine() -> dict:
    flags = []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = [f for f in line.split() if f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")]
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu_flags": flags, "jax": jax.__version__,
            "backend": jax.default_backend(), "load_average": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--prefill-lens", default="1024,4096")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--skip", choices=("decode", "prefill"), action="append", default=[])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
              "shape": {**SHAPE, **LINEAR}, "page_size": PAGE, "runs": args.runs}
    if "decode" not in args.skip:
        result["decode_ms"] = decode_times(models(), contexts, args.runs)
        for name, row in result["decode_ms"].items():
            print(name, f"{row['params'] / 1e6:.0f}M params", {c: round(row[c]["median_ms"], 2) for c in contexts},
                  flush=True)
    if "prefill" not in args.skip:
        result["prefill"] = prefill_rates([int(x) for x in args.prefill_lens.split(",")], args.runs)
        for t, row in result["prefill"].items():
            print(f"prefill {t}: chunked {row['chunked']['tok_s']:.0f} tok/s, recurrent "
                  f"{row['recurrent']['tok_s']:.0f} tok/s ({row['chunked_over_recurrent']:.1f}x)", flush=True)
    out = args.out or str(HERE / "results" / f"hybrid_{datetime.date.today()}.json")
    pathlib.Path(out).write_text(json.dumps(result, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
