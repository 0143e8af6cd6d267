"""The native kernels' other paths. Attention, the packed matmul, RMSNorm and argmax choose
their vector path when compiled (-march=native), so on this machine the ordinary tests run only
the widest one it has. Here the library is built with WELD_CPU_MARCH=x86-64 (no AVX2, FMA or
F16C: the scalar paths) and, on a CPU with AVX-512, x86-64-v3 (AVX2 without AVX-512: attention's
8-lane path) in a fresh cache, and those kernels' tests run again in a subprocess against the same
references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from weld.kernels import cpu as cpu_kernels
from weld.utils.errors import InvalidInputError

ROOT = Path(__file__).resolve().parents[2]
# (the attention tests that run the kernel: its jnp forms do not depend on the build)
KERNEL_TESTS = ["tests/kernels/test_cpu_argmax.py", "tests/models/test_attention.py",
                "tests/kernels/test_batch_invariant_ops.py",
                *(f"tests/models/test_layers.py::{name}" for name in (
                    "test_packed_matmul_matches_numpy", "test_packed_matmul_gradients_match_numpy",
                    "test_linear_on_packed_weights")), "-k", "kernel or not test_attention.py"]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def test_the_native_build_takes_the_vector_paths_where_the_cpu_has_them():
    assert cpu_kernels.available(), cpu_kernels._state.get("error")  # the test machine has a compiler
    assert cpu_kernels.built_with_avx2() == ({"avx2", "fma", "f16c"} <= cpu_flags())
    assert cpu_kernels.built_with_avx512() == ({"avx2", "fma", "f16c", "avx512f"} <= cpu_flags())


# (march, built with AVX2, built with AVX-512, tests): the paths -march=native does not build
# here; AVX-512 changes attention's kernel only (not the jnp forms its tests also run)
ATTENTION_TESTS = ["tests/models/test_attention.py", "-k", "kernel"]
OTHER_BUILDS = [("x86-64", False, False, KERNEL_TESTS)] + (
    [("x86-64-v3", True, False, ATTENTION_TESTS)] if {"avx2", "fma", "f16c", "avx512f"} <= cpu_flags() else [])


def test_a_bad_march_is_refused(monkeypatch):
    """An error, not the warning and jnp fallback of a failed build."""
    monkeypatch.setenv("WELD_CPU_MARCH", "native -O0")
    with pytest.raises(InvalidInputError, match="WELD_CPU_MARCH must be a -march target"):
        cpu_kernels.available()


@pytest.mark.parametrize("march,avx2,avx512,tests", OTHER_BUILDS, ids=[build[0] for build in OTHER_BUILDS])
def test_the_other_paths_pass_the_kernel_tests(tmp_path, march, avx2, avx512, tests):
    env = {**os.environ, "WELD_CPU_MARCH": march, "WELD_KERNEL_CACHE_DIR": str(tmp_path), "WELD_CPU_KERNELS": "1"}
    probe = subprocess.run([sys.executable, "-c", "from weld.kernels import cpu; assert cpu.available(), "
                            "cpu._state.get('error'); print(cpu.built_with_avx2(), cpu.built_with_avx512())"],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split() == [str(avx2), str(avx512)]  # the paths this build is for
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout
