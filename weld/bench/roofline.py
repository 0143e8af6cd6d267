"""The floor a decode step cannot beat, and the machine it was measured on.

Decode is memory-bound: a step must read its weights and the KV in context (`floor_bytes`), so it
takes at least those bytes over the memory bandwidth (`measure_bandwidth`, measured in the same
run). `machine_info` and `versions` record where and with what the numbers were taken.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import pathlib
import platform
import statistics
import subprocess
import time
from typing import Any, Callable

import numpy as np


def measure_bandwidth(gb: float = 1.0, reps: int = 5) -> dict:
    """Median GB/s of numpy passes over a ~`gb` GB float32 array: a copy (read + write bytes
    counted) and a sum (read bytes). The higher of the two is what the floor uses."""
    a = np.ones(int(gb * 1e9) // 4, np.float32)
    b = np.empty_like(a)
    b.fill(0)  # fault the pages in before timing

    def rate(fn: Callable[[], Any], nbytes: int) -> float:
        start = time.perf_counter()
        fn()
        return nbytes / (time.perf_counter() - start) / 1e9

    copy = [rate(lambda: np.copyto(b, a), 2 * a.nbytes) for _ in range(reps)]
    total = [rate(a.sum, a.nbytes) for _ in range(reps)]
    res = {"array_gb": a.nbytes / 1e9, "copy_gb_s": statistics.median(copy), "sum_gb_s": statistics.median(total),
           "copy_raw": copy, "sum_raw": total}
    res["used_gb_s"] = max(res["copy_gb_s"], res["sum_gb_s"])
    return res


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """What one engine's weights cost a decode step, in its own storage format."""

    total: int  # every weight tensor once (a tied embedding is stored, and counted, once)
    untied_embedding: int  # the input embedding table when a separate lm_head exists, else 0
    embedding_row: int  # bytes of one embedding row (a step gathers one per sequence)
    experts: int = 0  # the routed experts' weights (part of total); a token reads top_k of num_experts
    top_k: int = 0
    num_experts: int = 0

    def expert_share(self, batch: int) -> float:
        """The expected share of the routed experts a step of `batch` tokens reads: each expert
        that at least one token chose, under uniform routing: 1 - (1 - k / E)^batch."""
        if not self.experts:
            return 1.0
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** batch


def floor_bytes(weights: WeightBytes, kv_bytes_per_token: int, batch: int, input_len: int,
                output_len: int) -> dict:
    """Bytes one decode step at batch `batch` must read.

    Weights: all of them, once per step (the batch shares them), but of a mixture of experts only
    the experts the batch's tokens chose (`WeightBytes.expert_share`: at batch 1, top_k of
    num_experts). The lm_head is read whole, so a tied embedding counts in full; an untied input
    embedding is only gathered, one row per sequence. KV: every sequence reads its K and V of every
    layer for the tokens in context. The decode steps j = 1 .. out-1 run at context input_len + j,
    whose mean is input_len + out/2.
    """
    weight = weights.total - weights.untied_embedding - weights.experts * (1 - weights.expert_share(batch))
    if weights.untied_embedding:
        weight += batch * weights.embedding_row
    mean_context = input_len + output_len / 2
    kv = batch * kv_bytes_per_token * mean_context
    return {"weights": weight, "kv_mean": kv, "total": weight + kv, "mean_context": mean_context,
            "all_weights": weights.total, "expert_share": weights.expert_share(batch)}


# The CPU flags the native kernels choose their paths by (recorded with every result).
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_int8")


def machine_info(load_start: tuple[float, float, float]) -> dict:
    cpu, flags = platform.processor(), []
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.readlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        have = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
        flags = [flag for flag in KERNEL_FLAGS if flag in have]
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal")), None)
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpu_flags": flags, "cpu_count": os.cpu_count(),
            "memory_bytes": mem,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "hostname": platform.node()}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for package in ("weld", "jax", "jaxlib", "numpy", "torch", "transformers", "llama_cpp_python"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    try:
        root = pathlib.Path(__file__).resolve().parents[2]  # weld/bench/roofline.py -> the checkout
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            out["weld_git"] = commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return out
