"""Every kind of model (dense, MoE, MLA, hybrid linear attention) through the engine over 8
virtual CPU devices: tensor parallel 2 and 4, tensor x expert and tensor x data parallel give
the one-device greedy tokens, with logprobs and prompt logprobs within 1e-4, with the fused
decode, prefix-cache hits and n-gram speculative verification, and the weights really are
split (device 0 holds a fraction of their bytes). The tensor-parallel megakernel (with expert
parallelism inside the kernel) runs the same checks for the dense, MoE, MLA and hybrid
linear-attention models.

Each model runs in a subprocess (`sharded_run.py`): the device count is fixed when JAX starts.
The default suite runs one model of each kind; `-m slow` runs the rest of the families.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TOL = 1e-4

TP2, TP4 = {"tensor_parallel_size": 2}, {"tensor_parallel_size": 4}
TP2_DP2 = {"tensor_parallel_size": 2, "data_parallel_size": 2}
TP2_EP = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
DP2 = {"data_parallel_size": 2}
TP2_DP2_EP = {"tensor_parallel_size": 2, "data_parallel_size": 2, "enable_expert_parallel": True}
TP4_EP_ETP2 = {"tensor_parallel_size": 4, "enable_expert_parallel": True, "expert_tensor_parallel_size": 2}
SPEC = {"spec": True}
MEGAKERNEL = {"backend": "megakernel"}  # the Pallas kernel (interpret mode here) over the tp mesh

# variant -> layouts, each compared with the variant's one-device run (plain: speculation keeps
# greedy tokens, and its logprobs, the same). The default suite runs a few per kind of model.
CASES = {
    "llama": [TP4, {**TP2_DP2, **SPEC}],
    "qwen3_moe": [TP2_EP, TP4_EP_ETP2, TP2_DP2, {**TP2_EP, **MEGAKERNEL}],
    "deepseek_v3": [{**TP2_DP2_EP, **SPEC}],
    "qwen3_next": [{**TP2, **SPEC}, DP2],
}
SLOW_CASES = {
    "llama": [TP2, TP2_DP2, {**TP2, **SPEC}, {"data_parallel_size": 4, **SPEC}, {**TP2, **MEGAKERNEL, **SPEC},
              {**TP2_DP2, **MEGAKERNEL, **SPEC},
              {"data_parallel_size": 4, **MEGAKERNEL}],
    "qwen3_moe": [TP2, TP2_DP2_EP, {**TP2_EP, **SPEC}, {**TP2, **MEGAKERNEL, **SPEC}],
    "deepseek_v3": [TP2, TP4_EP_ETP2, {**TP2_EP, **MEGAKERNEL, **SPEC}, {**TP2_DP2, **MEGAKERNEL},
                    {**TP2_DP2_EP, **MEGAKERNEL}],
    "qwen3_next": [TP2_DP2_EP, TP4, {**TP2_EP, **MEGAKERNEL, **SPEC}, {**TP2_DP2, **MEGAKERNEL, **SPEC}],
    "mistral": [TP2, TP2_DP2],  # sliding window
    "gemma3_text": [TP2, {**TP2_DP2, **SPEC}, {**TP2, **MEGAKERNEL}],
    "gpt_oss": [TP2, TP2_DP2_EP, TP4_EP_ETP2, {**TP2_DP2_EP, **MEGAKERNEL, **SPEC}],
    "kimi_linear": [TP2, {**TP2_DP2_EP, **SPEC}, {**TP2, **MEGAKERNEL}, {**TP2_DP2_EP, **MEGAKERNEL}],
    "qwen3_5_moe_text": [TP2, TP2_DP2_EP],
    "deepseek_v2": [TP4, TP2_DP2_EP],
}


def run_layouts(model_dir: pathlib.Path, layouts: list[dict]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(WELD_PROGRESS="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(HERE / "sharded_run.py"), str(model_dir), json.dumps(layouts)],
                          capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


def check(variant: str, results: list[dict]) -> None:
    base = results[0]
    assert base["layout"] == {}
    for r in results:
        layout = r["layout"]
        what = f"{variant} {layout}"
        assert r["tokens"] == base["tokens"], what
        assert r["again"] == r["tokens"], what  # the prefix-cache hits change nothing
        assert r["prefix_hits"] > 0 and r["pages_freed"], what
        assert max_diff(r["logprobs"], base["logprobs"]) < TOL, what
        assert max_diff(r["prompt_logprobs"], base["prompt_logprobs"]) < TOL, what
        assert max_diff(r["again_logprobs"], r["logprobs"]) < TOL, what
        assert r["verified"] == bool(layout.get("spec")), what  # speculation ran through the verify program
        # the megakernel's decode (and verify) steps ran tensor parallel, not the XLA forward
        assert (r["sharded_kernel_traces"] > 0) == (layout.get("backend") == "megakernel"), what
        dp = layout.get("data_parallel_size", 1)
        # data-parallel attention: each rank holds its own pages and state slots (1/dp of every
        # pool, less when the heads split too) and serves its own sequences
        assert r["pool_share"] <= 1 / dp + 1e-9, (what, r["pool_share"])
        assert r["ranks_used"] == (list(range(min(dp, r["num_prompts"]))) if dp > 1 else []), what
        if layout.get("tensor_parallel_size", 1) == 1 and not layout.get("enable_expert_parallel"):
            assert r["weight_share"] == pytest.approx(1.0), what  # data parallel: every rank has the weights
        else:  # split: device 0 holds clearly less than the whole model
            assert r["weight_share"] < 0.75, (what, r["weight_share"])


@pytest.mark.parametrize("variant", list(CASES))
def test_layouts_match_one_device(variant, tiny_family_dir):
    directory, _ = tiny_family_dir(variant)
    check(variant, run_layouts(directory, [{}] + CASES[variant]))


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(SLOW_CASES))
def test_more_families_match_one_device(variant, tiny_family_dir):
    directory, _ = tiny_family_dir(variant)
    check(variant, run_layouts(directory, [{}] + SLOW_CASES[variant]))
