"""The megakernel's in-kernel all-reduce by remote DMA (`weld.kernels.megakernel.collectives`:
the tensor-parallel partial sums and the expert-parallel combine) in Pallas TPU interpret mode
on 4 and 8 virtual CPU devices, each run in a subprocess (`collectives_run.py`): equal to the
sum of the partials on every device, the replicas bit-identical, no race; planted bugs (a
receive not waited for, two peers writing one slot) are caught."""

from __future__ import annotations

import json
import pytest
from json_runs import run_script


def _run(devices: int, cases: list) -> dict:
    return {row["bug"]: row for row in run_script("collectives_run.py", str(devices), json.dumps(cases))}


@pytest.mark.parametrize("devices", [4, 8])
def test_all_reduce_equals_the_sum_on_every_device(devices):
    cases = [None, "skip_recv_wait", "same_slot"] if devices == 4 else [None]
    result = _run(devices, cases)
    good = result[None]
    assert good["max_err"] == 0.0 and good["replicas_equal"] and not good["races"], good
    if devices == 4:
        assert result["skip_recv_wait"]["max_err"] > 1e-3  # summed before the partials landed: NaN
        bad = result["same_slot"]
        assert bad["max_err"] > 1e-3 and bad["races"], bad
