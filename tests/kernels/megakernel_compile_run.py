"""Compiles megakernel decode steps for a TPU with libtpu and no TPU, in a process of its own:
libtpu must be importable (`make install-test` puts it in .venv/libtpu, off the main
site-packages so that every other JAX start stays quiet) and JAX must stay on the CPU.

    JAX_PLATFORMS=cpu PYTHONPATH=.venv/libtpu python tests/kernels/megakernel_compile_run.py NAME...

NAME is a family of benchmarks/megakernel_lowering.py's TPU-width configs ("llama",
"deepseek_v3", ...; `megakernel.compile_for_tpu`, batch 8, bf16, v5e), "llama-verify" (a
4-token verify block), "llama-int8" (int8 weights with a short last row tile), "gpt_oss-wide"
(gpt-oss-20b's widths, 2,880 off the lane tiles, one layer and a 32,768-row vocabulary),
"gpt_oss-rowmajor" (the same, every matrix streamed row-major: XLA must relayout some),
"smollm2-int8" (SmolLM2-135M's widths, 576, two layers, int8),
"layouts" (the layout libtpu gives plain matrices and expert stacks: `LAYOUT_SHAPES`), or
"control": a kernel whose DMA writes a slice off the 128-lane tiles, which Mosaic rejects (the
check can fail). Prints one JSON line per name: {"name", "ok", "seconds", "error"}, with a
compiled step's "relayouts" (`relayouts`) and the "layouts" rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))


def control() -> None:
    """A DMA into a VMEM buffer's first 200 of 256 lanes: interpret mode and the lowering take
    it, Mosaic does not (the shape of the bug that SmolLM2's 576-wide tiles hit in a 1536-wide
    ring)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental import topologies
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    def kernel(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf.at[:, pl.ds(0, 200)], sem.at[0])
        copy.start()
        copy.wait()
        o_ref[...] = buf[...]

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 256), jnp.float32),
                          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                          scratch_shapes=[pltpu.VMEM((8, 256), jnp.float32), pltpu.SemaphoreType.DMA((1,))])
    device = topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]
    sharding = NamedSharding(Mesh([device], ("one",)), PartitionSpec())
    jax.jit(call).trace(jax.ShapeDtypeStruct((8, 200), jnp.float32, sharding=sharding)).lower().compile()


# [rows, cols] matrices and [experts, rows, cols] stacks, a last dimension on or off the lane tiles
LAYOUT_SHAPES = [(4096, 2880), (128, 576), (1000, 2880), (2880, 4096), (64, 2880), (4096, 2944),
                 (8, 768, 2880), (32, 2880, 2880), (128, 768, 2048)]


def layouts() -> list:
    """[generation, dtype, shape, column-major] for LAYOUT_SHAPES in bf16 and int8 on v5e and v6e:
    whether libtpu's default layout puts the last two dimensions in the other order."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    rows = []
    for generation in ("v5e", "v6e"):
        device = topologies.get_topology_desc(f"{generation}:2x2", "tpu").devices[0]
        sharding = NamedSharding(Mesh([device], ("one",)), PartitionSpec())
        for dtype in (jnp.bfloat16, jnp.int8):
            for shape in LAYOUT_SHAPES:
                arg = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                layout = jax.jit(lambda x: x + 1).trace(arg).lower().compile().input_formats[0][0].layout
                order = tuple(layout.major_to_minor)
                rows.append([generation, jnp.dtype(dtype).name, list(shape), order[-2:] == (len(shape) - 1, len(shape) - 2)])
    return rows


PAGE_SHAPES = ((16, 8, 128), (16, 3, 64), (16, 1, 576), (32, 2, 64))  # [page, kv heads, head dim]: rows kv x e wide


def page_bytes() -> list:
    """[shape, dtype, logical bytes, `sharding.page_bytes` row-major, bytes XLA gives a cache of
    1,000 such pages created as the engine creates it] on v5e, bf16 and f32."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    from weld.models.common import sharding
    from weld.models.common.cache import Cache, KVPages

    device = topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]
    rows = []
    for dtype in (jnp.bfloat16, jnp.float32):
        for page, heads, head_dim in PAGE_SHAPES:
            shape = (page, heads * head_dim)
            pool = jax.ShapeDtypeStruct((1000,) + shape, dtype)
            cache = Cache(layers=[KVPages(k=pool, v=pool, kv_heads=heads)])
            placement = sharding.cache_placement(cache, None, row_major_pools=True, device=device)
            make = lambda: Cache(layers=[KVPages(k=jnp.zeros(pool.shape, dtype),  # noqa: E731
                                                 v=jnp.zeros(pool.shape, dtype), kv_heads=heads)])
            made = jax.jit(make, out_shardings=placement).lower().compile()
            rows.append([[page, heads, head_dim], jnp.dtype(dtype).name, math.prod(shape) * jnp.dtype(dtype).itemsize,
                         sharding.page_bytes(shape, dtype, heads, layout="row_major", device=device),
                         made.memory_analysis().output_size_in_bytes])
    return rows


def xla_cache_copies() -> dict:
    """The XLA backend's step on a TPU (v5e), compiled here: for SmolLM2's widths (2 layers) and
    Gemma 3 (tiny: one KV head), how many whole-pool copies (copy, transpose, fusion or
    copy-start producing an array of a pool's shape) a decode step (batch 8) and a prefill
    chunk (2 x 256 tokens) make, with the cache in the layouts `runner.auto_cache_layouts`
    picks ("auto", as the engine places it) and in XLA's defaults ("default", the control)."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.experimental.layout import Format
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from megakernel_lowering import GEMMA3
    from megakernel_tpu import WIDE, family_of

    import weld.kernels.cpu as cpu_kernels
    from weld.engine.runner import auto_cache_layouts
    from weld.models.common.cache import AttentionBatch
    from weld.models.common.spec import abstract_weights
    from weld.models.family import WeightTarget

    cpu_kernels.available = lambda: False  # the program is a TPU's: no native CPU kernels in it
    device = topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]
    one = NamedSharding(Mesh(np.array([device]), ("one",)), PartitionSpec())
    out = {}
    for name, cfg in (("smollm2", dataclasses.replace(WIDE["SmolLM2-135M, 30 layers"], num_layers=2)),
                      ("gemma3", GEMMA3)):
        family = family_of(cfg)
        weights = jax.eval_shape(lambda w: family.prepare_weights(w, cfg, WeightTarget(backend="xla")),
                                 abstract_weights(family.weight_specs(cfg), jnp.bfloat16))
        spec = family.cache_spec(cfg)
        cache = jax.eval_shape(lambda: spec.create(1024, 16, jnp.bfloat16))
        layouts = auto_cache_layouts(family, cfg, weights, cache, device=device)
        pools = {(tuple(x.shape), x.dtype) for x in jax.tree.leaves(cache)}
        place = lambda tree, s: jax.tree.map(lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p),  # noqa: E731
                                             tree, s)
        for kind in ("auto", "default"):
            placed = (jax.tree.map(lambda layout: Format(layout, one), layouts) if kind == "auto"
                      else jax.tree.map(lambda _: one, cache))
            step = jax.jit(lambda w, t, p, c, bt: family.forward(w, cfg, t, p, c, AttentionBatch(bt))[2],
                           donate_argnums=(3,), out_shardings=placed)
            for shape, what in (((8, 1), ""), ((1, 1), "_one_row"), ((2, 256), "_prefill")):
                rows = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=one)
                tables = jax.ShapeDtypeStruct((shape[0], 32 * len(spec.page_groups())), jnp.int32, sharding=one)
                hlo = step.trace(place(weights, jax.tree.map(lambda _: one, weights)), rows, rows,
                                 place(cache, placed), tables).lower().compile().as_text().split("ENTRY")[1]
                copies = 0
                for dims, dtype in pools:
                    kind_name = {"bfloat16": "bf16", "float32": "f32"}[jnp.dtype(dtype).name]
                    copies += len(re.findall(r"= %s\[%s\]\{[^}]*\} (?:copy|transpose|fusion|copy-start)\("
                                             % (kind_name, ",".join(map(str, dims))), hlo))
                out[f"{name}_{kind}{what}"] = copies
    return out


def relayouts(hlo: str, least_bytes: int = 1 << 20) -> list[str]:
    """The weights and cache pools (entry parameters named w[...] and c.layers[i].k / .v / .pool /
    .conv / .state, of at least least_bytes) that a compiled step's XLA program lays out anew before the kernel
    reads them, every call: each must reach the kernel's custom call through bitcasts and moves
    between memory spaces only (XLA may stage a small operand in VMEM: slice-start / -done,
    copy-start / -done, ConcatBitcast), never a copy, transpose or fusion. The embedding is not
    one: XLA gathers the tokens' rows from it as it lies."""
    import re

    params = {}
    for m in re.finditer(r"%(\S+) = (\w+)\[([\d,]*)\]\{[^}]*\} parameter\(\d+\).*?"
                         r"op_name=\"(w\[[^\"]*|c\.layers\[\d+\]\.(?:k|v|pool|conv|state))\"", hlo):
        size = {"bf16": 2, "f32": 4, "s8": 1, "u8": 1}.get(m.group(2), 4)
        for dim in filter(None, m.group(3).split(",")):
            size *= int(dim)
        name = m.group(4).replace("\\'", "'")
        if size >= least_bytes and not name.startswith(("w['embed']", "w['embed_table']")):
            params[m.group(1)] = name
    users: dict[str, list[tuple[str, str, str]]] = {}  # operand -> (user, opcode, the line)
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .*? ([a-z][\w-]*)\((.*)", line)  # (a shape may be a tuple)
        if m:
            for operand in re.findall(r"%([^\s,)]+)", m.group(3)):
                users.setdefault(operand, []).append((m.group(1), m.group(2), line))
    moves = ("bitcast", "slice-start", "slice-done", "copy-start", "copy-done", "get-tuple-element")
    moved = set()
    for param, name in params.items():
        todo, seen = [param], set()
        while todo:
            for user, opcode, line in users.get(todo.pop(), []):
                if user in seen:
                    continue
                seen.add(user)
                if opcode in moves or (opcode == "custom-call" and "ConcatBitcast" in line):
                    todo.append(user)
                elif not (opcode == "custom-call" and "tpu_custom_call" in line):
                    moved.add(name)
    return sorted(moved)


def compile_one(name: str):
    from megakernel_lowering import CASES
    from megakernel_tpu import WIDE

    from weld.models import megakernel

    if name == "control":
        return control()
    family, _, variant = name.partition("-")
    if variant == "rowmajor":  # the control of `relayouts`: every matrix streamed row-major
        from weld.kernels.megakernel import plan

        kept, plan.stored_transposed = plan.stored_transposed, lambda rows, cols: False
        try:
            return compile_one(f"{family}-wide")
        finally:
            plan.stored_transposed = kept
    if family == "gpt_oss" and variant == "wide":  # gpt-oss-20b's widths, one layer, a smaller vocabulary
        cfg = dataclasses.replace(WIDE["gpt-oss-20b-like, 2 layers"], num_layers=1, vocab_size=32768,
                                  layer_types=WIDE["gpt-oss-20b-like, 2 layers"].layer_types[:1])
    elif family == "smollm2":  # SmolLM2-135M's widths (576 off the lane tiles), two layers; int8 below
        cfg = dataclasses.replace(WIDE["SmolLM2-135M, 30 layers"], num_layers=2)
    else:
        cfg = next(c for key, (c, _) in CASES.items() if key.split(" ")[0] == family)
    weights = None
    if variant == "int8":  # int8 per channel (Llama's: an MLP of 320 rows, a last row tile of 64, its
        # scales under one lane tile, as SmolLM2's 576 outputs make)
        if family == "llama":
            cfg = dataclasses.replace(cfg, intermediate_size=320)
        weights = _int8_weights(cfg)
    # "defaultpools" (the control of the pools' check): the cache in XLA's default layouts
    return megakernel.compile_for_tpu(cfg, batch=8, generation="v5e", weights=weights,
                                      tokens_per_row=4 if variant == "verify" else 1,
                                      row_major_pools=variant != "defaultpools")


def _int8_weights(cfg):
    """cfg's tree as `--quantization int8_channel` prepares it for the kernel (random values: only
    the shapes and dtypes reach the compiler)."""
    import jax.numpy as jnp
    import numpy as np
    from megakernel_tpu import family_of, int8_weights

    from weld.models.common.spec import map_specs
    from weld.models.family import WeightTarget

    family, rng = family_of(cfg), np.random.default_rng(0)
    raw = map_specs(lambda _, spec: jnp.asarray(rng.normal(0, 0.1, spec.shape), jnp.bfloat16), family.weight_specs(cfg))
    return family.prepare_weights(int8_weights(cfg, raw), cfg, WeightTarget(backend="megakernel"))


def main() -> None:
    for name in sys.argv[1:]:
        start = time.perf_counter()
        extra = {}
        try:
            if name == "layouts":
                extra["layouts"] = layouts()
            elif name == "page_bytes":
                extra["page_bytes"] = page_bytes()
            elif name == "xla_cache_copies":
                extra["copies"] = xla_cache_copies()
            else:
                compiled = compile_one(name)
                if compiled is not None:
                    extra["relayouts"] = relayouts(compiled.as_text())
            error = None
        except Exception as e:  # reported, not raised: the test names the family and Mosaic's message
            text = str(e)
            at = text.find("Mosaic failed")
            error = f"{type(e).__name__}: {text[at:at + 2000] if at >= 0 else text[:2000]}"
        print(json.dumps({"name": name, "ok": error is None, "seconds": round(time.perf_counter() - start, 1),
                          "error": error, **extra}), flush=True)


if __name__ == "__main__":
    main()
