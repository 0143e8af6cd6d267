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


@pytest.mark.parametrize("devices", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_all_reduce_equals_the_sum_on_every_device(devices):
    """2 devices: one round of whole partials; 4 and 8: reduce-scatter then all-gather (chunks of
    whole lane tiles, the 256 columns padded to 512 over 4 devices, to 1024 over 8). Both sum in
    device order: exactly numpy's sum."""
    cases = [None, "skip_recv_wait", "same_slot"] + (["skip_gather_wait"] if devices == 4 else []) \
        if devices < 8 else [None]
    result = _run(devices, cases)
    good = result[None]
    assert good["max_err"] == 0.0 and good["replicas_equal"] and not good["races"], good
    if devices < 8:
        assert result["skip_recv_wait"]["max_err"] > 1e-3  # summed before the partials landed: NaN
        bad = result["same_slot"]
        assert bad["max_err"] > 1e-3 and bad["races"], bad
    if devices == 4:  # the gathered sums read before they landed
        assert result["skip_gather_wait"]["max_err"] > 1e-3 and not result["skip_gather_wait"]["replicas_equal"]


def test_bytes_each_device_sends():
    from weld.kernels.megakernel import collectives

    assert collectives.sent_bytes(8, 7168, 1) == 0
    assert collectives.sent_bytes(8, 7168, 2) == 8 * 7168 * 4  # one whole partial to the one peer
    # Kimi K2's hidden over 32 devices: chunks of 256 columns (7168 padded to 8192), sent twice to 31 peers
    assert collectives.padded_cols(7168, 32) == 8192
    assert collectives.sent_bytes(8, 7168, 32) == 2 * 31 * 8 * 256 * 4
    assert collectives.sent_bytes(8, 7168, 32) <= 31 * 8 * 7168 * 4 / 14  # one round: 31 whole partials, 14x
