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


def test_mosaic_compiles_the_kernel_and_rejects_an_off_tile_copy():
    """Llama (a decode step, a 4-token verify block, int8 weights with a 64-row last tile) and
    DeepSeek-V3 (MLA + MoE) compile; the control, a DMA into 200 of a buffer's 256 lanes, does
    not: the check can fail."""
    results = compile_all("control", "llama", "llama-verify", "llama-int8", "deepseek_v3")
    control = results["control"]
    assert not control["ok"], "Mosaic compiled a DMA off the lane tiles: the check cannot fail"
    assert "Mosaic failed" in control["error"], f"the control failed before Mosaic saw it: {control['error']}"
    for name in ("llama", "llama-verify", "llama-int8", "deepseek_v3"):
        assert results[name]["ok"], f"{name}: {results[name]['error']}"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "kimi_linear", "gemma3", "gpt_oss"])
def test_every_family_compiles(family):
    result = compile_all(family)[family]
    assert result["ok"], result["error"]
