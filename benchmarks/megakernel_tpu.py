"""The decode megakernel on a real TPU: each family's kernel compiled by Mosaic and run on the
chip against the XLA path on the same weights and cache, and both steps timed against the chip's
HBM floor.

    python benchmarks/megakernel_tpu.py [--only 'NAME|NAME'] [--steps 12] [--context 256] [--out FILE.json]
        [--set 'hidden_size=3072,moe.intermediate_size=3072' ...]

Runs on a TPU only (interpret mode never compiles the kernel: `megakernel_lowering.py` checks the
lowering anywhere, this checks Mosaic's own passes and the numbers). Weights are random, made on
the chip (`device_random_weights`), the KV pools and recurrent states random too, every row at
`--context` tokens: both paths read the same cache, so one step's logits compare directly (the
relative error of the kernel's logits to XLA's and whether the greedy ids agree), then each path
decodes `--steps` greedy steps on its own copy of the cache (how many greedy tokens agree) and
the median of those steps' wall times is the step time (one jitted call per step, synchronized).

Cases: the tiny configs of every family at TPU-friendly widths (`megakernel_lowering.py`'s: f32
weights, compared at the XLA path's highest matmul precision), then real models' widths at a few
layers in bf16 (and int8 per channel, quantized at load as `--quantization int8_channel` does),
whose step times are set against the HBM floor of the bytes the step must move
(`plan.step_floor_seconds`). Each `--set` runs the chosen cases once more with those config
fields changed (`override`): which part of a case costs (a smaller vocabulary, lane-whole
widths, another head width) is measured side by side with the case itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from weld.engine.runner import auto_cache_layouts
from weld.kernels.megakernel import plan
from weld.kernels.megakernel.decode import tpu_generation
from weld.models import FAMILIES, megakernel
from weld.models.common import moe as moe_lib
from weld.models.common import quant, sharding
from weld.models.common.cache import AttentionBatch
from weld.models.common.spec import map_specs
from weld.models.family import WeightTarget

import megakernel_lowering as shapes

PAGE = 16
TINY = {name: cfg for name, (cfg, _) in shapes.CASES.items() if cfg.hidden_size <= 256}
# real models' widths, a few layers deep (one chip's 16 GiB holds both paths' weights)
WIDE = {
    "Llama-3-8B, 4 layers": dataclasses.replace(shapes.LLAMA_8B, num_layers=4),
    "Qwen3-30B-A3B, 4 layers": dataclasses.replace(shapes.QWEN3_30B, num_layers=4, sparse_layers=tuple(range(4))),
    # the bundled models' shapes: SmolLM2-135M (hidden 576, head dim 64) and Gemma 3 270M
    "SmolLM2-135M, 30 layers": dataclasses.replace(
        shapes.LLAMA, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, tie_word_embeddings=True),
    "Gemma-3-270M, 18 layers": dataclasses.replace(
        shapes.GEMMA3, vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4,
        num_kv_heads=1, head_dim=256, layer_types=((shapes.gemma3.SLIDING,) * 5 + (shapes.gemma3.FULL,)) * 3),
    "Kimi-K2-like, 2 layers, 16 experts": dataclasses.replace(
        shapes.KIMI_K2, num_layers=2, moe=dataclasses.replace(shapes.KIMI_K2.moe, num_experts=16)),
    # gpt-oss-20b's widths (2,880: no multiple of 128 lanes), 2 layers (one sliding, one full)
    "gpt-oss-20b-like, 2 layers": dataclasses.replace(
        shapes.GPT_OSS, vocab_size=201088, hidden_size=2880, num_heads=64, num_kv_heads=8, head_dim=64,
        moe=dataclasses.replace(shapes.GPT_OSS.moe, num_experts=32, top_k=4, intermediate_size=2880),
        rope=dataclasses.replace(shapes.GPT_OSS.rope, dim=64)),
}
INT8 = ("Llama-3-8B, 4 layers", "SmolLM2-135M, 30 layers")  # also run int8 per channel


def override(cfg, assignments: str):
    """cfg with fields set from 'name=value,sub.name=value' (ints, floats, else strings; a dotted
    name sets a field of a nested config, e.g. moe.num_experts)."""
    for item in filter(None, assignments.split(",")):
        name, _, text = item.partition("=")
        value: object = text
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                pass
        *outer, field = name.strip().split(".")
        cfg = _set(cfg, outer, field, value)
    return cfg


def _set(cfg, outer, field, value):
    if not outer:
        if not any(f.name == field for f in dataclasses.fields(cfg)):
            raise SystemExit(f"--set: {type(cfg).__name__} has no field {field!r}")
        return dataclasses.replace(cfg, **{field: value})
    return dataclasses.replace(cfg, **{outer[0]: _set(getattr(cfg, outer[0]), outer[1:], field, value)})


def family_of(cfg):
    return next(f for f in FAMILIES if isinstance(cfg, f.Config))


def device_random_weights(cfg, dtype, seed=0):
    """The family's weight tree, random, made on the default device (fan-in scaled normals; norm
    scales near 1 and biases near 0, perturbed so that none hides a bug)."""
    key = iter(jax.random.split(jax.random.key(seed), 4096))

    def init(_, spec):
        noise = jax.random.normal(next(key), spec.shape, jnp.float32)
        if spec.init == "ones":
            x = 1.0 + 0.1 * noise
        elif spec.init == "zeros":
            x = 0.1 * noise
        else:
            x = noise / np.sqrt(spec.shape[-1] if len(spec.shape) > 1 else 1)
        return x.astype(dtype)
    return map_specs(init, family_of(cfg).weight_specs(cfg))


def int8_weights(cfg, weights):
    """The tree as `--quantization int8_channel` loads it (what the declaration marks)."""
    def leaf(path, spec):
        value = weights
        for key in path:
            value = value[key]
        mode = quant.leaf_mode(spec.quantize, "int8_channel")
        return quant.quantize_any(np.asarray(value, np.float32), mode) if mode else value
    return map_specs(leaf, family_of(cfg).weight_specs(cfg))


def random_cache(cfg, batch, context, dtype, seed=1, pool_pages=0):
    """Pools of `batch` rows of `context` tokens (each row its own pages, scattered among at
    least pool_pages pages: a served model's pools hold far more than one batch's context) and
    random contents; returns (cache, block tables for every page group, positions of the next token)."""
    spec = family_of(cfg).cache_spec(cfg)
    per_row = -(-(context + 32) // PAGE)
    num_pages = max(batch * per_row + 1, pool_pages)
    cache = spec.create(num_pages, PAGE, dtype, num_slots=batch)
    keys = iter(jax.random.split(jax.random.key(seed), 1024))
    cache = jax.tree.map(lambda x: (0.5 * jax.random.normal(next(keys), x.shape, jnp.float32)).astype(x.dtype), cache)
    order = np.random.default_rng(seed).permutation(num_pages - 1)[:batch * per_row].reshape(batch, per_row) + 1
    tables = spec.tables(jnp.asarray(order, jnp.int32))
    return cache, tables, jnp.full((batch,), context, jnp.int32)


def _timed_steps(step, weights, cache, tables, tokens, positions, steps):
    """Greedy steps on `cache` (donated); returns (first logits, tokens per step, step seconds)."""
    out_tokens, seconds, first = [], [], None
    for i in range(steps):
        start = time.perf_counter()
        logits, cache = step(weights, tokens[:, None], positions[:, None], cache, tables)
        tokens = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        tokens.block_until_ready()
        seconds.append(time.perf_counter() - start)
        if first is None:
            first = np.asarray(logits[:, 0], np.float32)
        out_tokens.append(np.asarray(tokens))
        positions = positions + 1
    return first, np.stack(out_tokens, 1), seconds


def _rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _f32_reference(family, cfg, raw, tokens, batch, context, dtype, pool_pages=0):
    """One step's logits from the XLA path with the same weights and cache upcast to f32 inside
    the program (each matrix as it is used, not a second copy of the model) at the highest matmul
    precision: the yardstick for both paths' bf16 / int8 rounding, where near-tied router scores
    or logits can send two correct bf16 programs apart. Also each row's router margin: the
    smallest gap, over the MoE layers, between the k-th and the (k+1)-th largest router score
    (logits plus any bias; None for a dense model), the distance a rounding must cross to send
    the row to another expert."""
    weights = family.prepare_weights(jax.tree.map(lambda x: x, raw), cfg, WeightTarget(backend="xla"))
    cache, tables, positions = random_cache(cfg, batch, context, dtype, pool_pages=pool_pages)
    upcast = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == dtype else x, tree)  # noqa: E731
    route = moe_lib.route

    @jax.jit
    def step(w, c):
        gaps = []

        def margin_route(moe, logits, bias=None):  # records the margin, then routes as before
            scores = logits.astype(jnp.float32) + (0.0 if bias is None else bias.astype(jnp.float32))
            top = jax.lax.top_k(scores, moe.top_k + 1)[0]
            gaps.append(top[:, -2] - top[:, -1])
            return route(moe, logits, bias)
        moe_lib.route = margin_route
        try:
            with jax.default_matmul_precision("highest"):
                out = family.forward(upcast(w), cfg, tokens[:, None], positions[:, None], upcast(c),
                                     AttentionBatch(tables))
        finally:
            moe_lib.route = route
        return out[0], (jnp.min(jnp.stack(gaps), axis=0) if gaps else None)
    logits, gaps = step(weights, cache)
    return np.asarray(logits[:, 0], np.float32), None if gaps is None else np.asarray(gaps)


def run_case(name, cfg, *, batch, dtype, context, steps, int8=False, pool_pages=0, default_pools=False,
             backends=("megakernel", "xla")):
    family = family_of(cfg)
    generation = tpu_generation(jax.devices()[0].device_kind) if jax.default_backend() == "tpu" else "v5e"
    row = dict(case=name, batch=batch, weights="int8_channel" if int8 else jnp.dtype(dtype).name, context=context,
               layers=cfg.num_layers, pool_pages=pool_pages, default_pools=default_pools)
    raw = device_random_weights(cfg, dtype)
    if int8:
        raw = int8_weights(cfg, raw)
    options = megakernel.KernelOptions()  # interpret mode off a TPU (--interpret)
    forwards = {"megakernel": lambda w, t, p, c, bt: megakernel.forward(w, cfg, t, p, c, AttentionBatch(bt),
                                                                        options=options),
                "xla": lambda w, t, p, c, bt: family.forward(w, cfg, t, p, c, AttentionBatch(bt))}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, batch), jnp.int32)
    results = {}
    for backend in backends:
        weights = family.prepare_weights(jax.tree.map(lambda x: x, raw), cfg, WeightTarget(backend=backend))
        cache, tables, positions = random_cache(cfg, batch, context, dtype, pool_pages=pool_pages)
        # the cache placed as the engine places it (`sharding.pool_layouts`: the megakernel's
        # pools row-major on a TPU, the XLA backend's in the layouts XLA picks for a decode step);
        # default_pools: XLA's default layouts for both, as before the engine placed them
        policy = None if default_pools else sharding.pool_layouts(backend, None)
        layouts = (auto_cache_layouts(family, cfg, weights, cache) if policy == "auto" else None)
        placement = sharding.cache_placement(cache, None, row_major_pools=policy == "row_major", layouts=layouts)
        placed = {}
        if placement is not None:
            cache = jax.device_put(cache, placement)
            placed = {"out_shardings": (SingleDeviceSharding(jax.devices()[0]), placement)}
        step = jax.jit(lambda w, t, p, c, bt, fwd=forwards[backend]: (lambda out: (out[0], out[2]))(
            fwd(w, t, p, c, bt)), donate_argnums=(3,), **placed)
        start = time.perf_counter()
        compiled = step.lower(weights, tokens[:, None], positions[:, None], cache, tables).compile()
        row[f"{backend}_compile_s"] = round(time.perf_counter() - start, 2)
        results[backend] = _timed_steps(compiled, weights, cache, tables, tokens, positions, steps)
        del weights, cache
    if len(results) == 1:  # one path timed alone
        (backend, (_, _, seconds)), = results.items()
        row[f"{backend}_step_ms"] = round(1e3 * statistics.median(seconds[2:]), 3)
        return row
    (k_logits, k_tokens, k_seconds), (x_logits, x_tokens, x_seconds) = results["megakernel"], results["xla"]
    row["logits_rel_err"] = _rel_err(k_logits, x_logits)
    # whose rounding is it: both paths set against f32 maths at the highest precision on the same
    # weights (an f32 XLA step on a TPU multiplies in bf16 passes by default)
    reference, gaps = _f32_reference(family, cfg, raw, tokens, batch, context, dtype, pool_pages)
    row["f32_ref_rel_err"] = {"megakernel": _rel_err(k_logits, reference), "xla": _rel_err(x_logits, reference)}
    # per row: one row far off (a near-tied router sending it to another expert) reads
    # differently from every row off (a wrong kernel)
    row["f32_ref_row_errs"] = {name: [round(_rel_err(got[i], reference[i]), 4) for i in range(batch)]
                               for name, got in (("megakernel", k_logits), ("xla", x_logits))}
    if gaps is not None:
        row["f32_ref_router_margin"] = [float(f"{g:.3g}") for g in gaps]
    row["f32_ref_greedy_equal"] = {"megakernel": int(np.sum(k_tokens[:, 0] == reference.argmax(-1))),
                                   "xla": int(np.sum(x_tokens[:, 0] == reference.argmax(-1)))}
    row["first_greedy_equal"] = bool(np.array_equal(k_tokens[:, 0], x_tokens[:, 0]))
    row["greedy_steps_equal"] = int(np.sum(np.all(k_tokens == x_tokens, axis=0).cumprod()))
    row["steps"] = steps
    row["megakernel_step_ms"] = round(1e3 * statistics.median(k_seconds[2:]), 3)
    row["xla_step_ms"] = round(1e3 * statistics.median(x_seconds[2:]), 3)
    spec = megakernel.spec_for(cfg, batch=batch, page_size=PAGE, weight_dtype=dtype, kv_dtype=dtype, int8=int8,
                               float_matrices=megakernel.float_matrices(
                                   megakernel.kernel_params(cfg, family.prepare_weights(
                                       raw, cfg, WeightTarget(backend="megakernel")))) if int8 else ())
    floor = plan.step_floor_seconds(spec, generation, context + 1)
    row["hbm_floor_ms"] = round(1e3 * floor, 3)
    row["megakernel_of_floor"] = round(floor / (row["megakernel_step_ms"] / 1e3), 3)
    row["xla_of_floor"] = round(floor / (row["xla_step_ms"] / 1e3), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None,
                        help="cases whose name contains one of these, separated by '|' (names hold commas: "
                             "'SmolLM2-135M, 30 layers, int8')")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--pool-pages", type=int, default=0, metavar="N",
                        help="each layer's pools hold at least N pages of %d tokens, as a served model's do "
                             "(default: just the batch's)" % PAGE)
    parser.add_argument("--default-pools", action="store_true",
                        help="also run each case with the megakernel's pools in XLA's default layouts (the "
                             "engine keeps them row-major on a TPU)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--interpret", action="store_true", help="off a TPU: interpret mode (checks this script)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE,...",
                        help="also run the chosen cases with these config fields changed (repeatable)")
    args = parser.parse_args()
    if not 0 <= args.pool_pages <= 1 << 20:
        parser.error(f"--pool-pages must be in [0, {1 << 20}], got {args.pool_pages}")
    if jax.default_backend() != "tpu" and not args.interpret:
        raise SystemExit("megakernel_tpu.py runs on a TPU (megakernel_lowering.py checks the lowering anywhere)")
    device = jax.devices()[0]
    print(f"{device.device_kind}, jax {jax.__version__}", flush=True)
    runs = [(name, cfg, jnp.float32, False) for name, cfg in TINY.items()]
    runs += [(name, cfg, jnp.bfloat16, False) for name, cfg in WIDE.items()]
    runs += [(name + ", int8", WIDE[name], jnp.bfloat16, True) for name in INT8]
    runs = [run for run in runs if not args.only or any(part in run[0] for part in args.only.split("|"))]
    runs += [(f"{name} [{change}]", override(cfg, change), dtype, int8) for change in args.set
             for name, cfg, dtype, int8 in list(runs)]
    rows = []
    for name, cfg, dtype, int8 in runs:
        for batch in [int(b) for b in args.batches.split(",")]:
            try:
                with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
                    for default_pools in (False, True) if args.default_pools else (False,):
                        row = run_case(name, cfg, batch=batch, dtype=dtype, context=args.context, steps=args.steps,
                                       int8=int8, pool_pages=args.pool_pages, default_pools=default_pools)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
            except Exception as err:  # a Mosaic compile error: report it whole, go on
                text = "".join(traceback.format_exception(err))
                rows.append(dict(case=name, batch=batch, ok=False, error=text[-4000:]))
                print(f"FAILED {name} batch {batch}:\n{text[-6000:]}", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"date": time.strftime("%Y-%m-%d"), "device": device.device_kind,
                               "host": platform.processor() or platform.machine(), "jax": jax.__version__,
                               "context": args.context, "pool_pages": args.pool_pages, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
