"""The megakernel compiles for a TPU (v5e) on this machine, with libtpu and no TPU: Mosaic's own
passes (vector layouts, the (8, 128) tiling of every DMA and slice, operand types) run here,
which the lowering test cannot (tests/kernels/test_megakernel_lowering.py) and interpret mode
never does. Everything these compile also ran on a v5e chip and matched XLA
(benchmarks/megakernel_tpu.py; docs/megakernel.md). libtpu lives in .venv/libtpu
(`make install-test`), used by a subprocess only (`megakernel_compile_run.py`)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
LIBTPU = pathlib.Path(sys.prefix) / "libtpu"

pytestmark = pytest.mark.skipif(not (LIBTPU / "libtpu").is_dir(),
                                reason=f"no libtpu in {LIBTPU} (`make install-test` installs it)")


def compile_all(*names: str) -> dict[str, dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",  # no TPU: no lock to hold
               PYTHONPATH=f"{LIBTPU}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(HERE / "megakernel_compile_run.py"), *names], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {r["name"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert sorted(results) == sorted(names), proc.stderr[-4000:]
    return results


COMPILED = ("llama", "llama-verify", "llama-int8", "deepseek_v3", "gpt_oss-wide", "smollm2-int8", "qwen3_next")


def test_mosaic_compiles_the_kernel_and_rejects_an_off_tile_copy():
    """Llama (a decode step, a 4-token verify block, int8 weights with a 64-row last tile),
    DeepSeek-V3 (MLA + MoE), gpt-oss's and SmolLM2's widths off the lane tiles (int8 for SmolLM2)
    and Qwen3-Next (Gated DeltaNet) compile, and XLA hands the kernel every weight and cache pool
    as it lies (`relayouts`: matrices TPU keeps column-major stream from their transposes,
    `plan.stored_transposed`; the engine keeps the page pools row-major,
    `sharding.cache_placement`, 1,024 pages each here; the conv windows go in as XLA lays them
    out, [K - 1, slots, C], 256 slots here). The
    controls: a DMA into 200 of a buffer's 256 lanes does not compile, gpt-oss's matrices
    streamed row-major make XLA relayout some every call, and so do SmolLM2's pools (3 KV heads
    of 64) in XLA's default layout: each check can fail."""
    results = compile_all("control", "gpt_oss-rowmajor", "smollm2-defaultpools", *COMPILED)
    control = results["control"]
    assert not control["ok"], "Mosaic compiled a DMA off the lane tiles: the check cannot fail"
    assert "Mosaic failed" in control["error"], f"the control failed before Mosaic saw it: {control['error']}"
    for name in COMPILED:
        assert results[name]["ok"], f"{name}: {results[name]['error']}"
        assert results[name]["relayouts"] == [], name
    assert "w['lm_head']" in results["gpt_oss-rowmajor"]["relayouts"], results["gpt_oss-rowmajor"]
    pools = results["smollm2-defaultpools"]["relayouts"]
    assert {"c.layers[0].k", "c.layers[0].v", "c.layers[1].k", "c.layers[1].v"} <= set(pools), pools


def test_the_layout_rule_is_libtpus():
    """`plan.stored_transposed` says which matrices (and expert stacks) libtpu keeps column-major,
    on v5e and v6e, in bf16 and int8: with a last dimension off the 128 lanes and the one before
    it on them."""
    from weld.kernels.megakernel import plan

    rows = compile_all("layouts")["layouts"]["layouts"]
    assert {column_major for *_, column_major in rows} == {True, False}
    for generation, dtype, shape, column_major in rows:
        assert plan.stored_transposed(*shape[-2:]) == column_major, (generation, dtype, shape)


def test_page_bytes_count_the_row_major_padding():
    """`sharding.page_bytes` (what the engine sizes its cache by when the pools lie row-major, the
    megakernel on a TPU) is what libtpu gives a cache of 1,000 pages placed as the engine
    places it, K and V, to the allocation's small header; tile-dense pages (8 KV heads of
    128) cost their logical bytes, SmolLM2's (3 of 64: rows of 192 lanes) more, at most the
    next lane tile's (256 / 192)."""
    rows = compile_all("page_bytes")["page_bytes"]["page_bytes"]
    padded = set()
    for shape, dtype, logical, measured, cache_bytes in rows:
        assert 0 <= cache_bytes - 2 * 1000 * measured < 4096, (shape, dtype, measured, cache_bytes)
        assert logical <= measured <= logical * 4 // 3, (shape, dtype, measured)
        padded.add((tuple(shape), dtype, measured > logical))
    assert ((16, 8, 128), "bfloat16", False) in padded and ((16, 3, 64), "bfloat16", True) in padded, padded


def test_the_xla_backend_keeps_its_pools_in_the_layouts_its_step_wants():
    """On a TPU the XLA backend creates the cache in the layouts XLA picks for a decode step
    (`runner.auto_cache_layouts`): compiled for v5e, neither a batch-8 decode step nor a prefill
    chunk copies a whole pool, for SmolLM2's widths (3 KV heads of 64) or Gemma 3 (one KV head of
    128); one-row steps copy no more than with XLA's defaults. The control: with XLA's default
    layouts SmolLM2's steps copy every pool in and out."""
    copies = compile_all("xla_cache_copies")["xla_cache_copies"]["copies"]
    for model in ("smollm2", "gemma3"):
        assert copies[f"{model}_auto"] == copies[f"{model}_auto_prefill"] == 0, copies
        assert copies[f"{model}_auto_one_row"] <= copies[f"{model}_default_one_row"], copies
    assert copies["smollm2_default"] > 0 and copies["smollm2_default_prefill"] > 0, copies


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "kimi_linear", "gemma3", "gpt_oss"])
def test_every_family_compiles(family):
    result = compile_all(family)[family]
    assert result["ok"], result["error"]
    assert result["relayouts"] == [], result["relayouts"]
