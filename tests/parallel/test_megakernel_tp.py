"""The decode megakernel tensor-parallel (`weld.models.megakernel.sharded_forward`) on 4 and 8
virtual CPU devices in Pallas TPU interpret mode, each run in a subprocess
(`megakernel_tp_run.py`): every device streams its shard of the weights (its heads, its slice of
the MLP, expert and vocabulary rows, as the sharding rules lay them out) and its KV heads' pools,
and the kernel all-reduces by remote DMA the embedding rows and every attention's and MLP's
(experts included) partial outputs. Two greedy steps equal the one-device XLA forward (logits
within 1e-3, the same tokens, the pools); without the all-reduce (a planted bug) they do not."""

from __future__ import annotations

import json
import pytest
from json_runs import run_script


def _run(devices: int, configs: list[str]) -> dict:
    return {row["config"]: row for row in run_script("megakernel_tp_run.py", str(devices), json.dumps(configs))}


@pytest.mark.parametrize("devices,configs", [(4, ["dense", "moe", "dense_without_all_reduce"]),
                                             pytest.param(8, ["dense"], marks=pytest.mark.slow)])
def test_tensor_parallel_megakernel_equals_one_device_xla(devices, configs):
    result = _run(devices, configs)
    for name in configs:
        row = result[name]
        if name.endswith("_without_all_reduce"):
            assert row["max_rel_err"] > 1e-2 and not row["greedy_equal"], row
        else:
            assert row["max_rel_err"] < 1e-3 and row["greedy_equal"] and row["pool_err"] < 1e-4, row
            assert not row["races"], row
