"""Fixtures for the kernel tests (interpret mode: see interpret_mode.py). On a TPU the same tests
compile the kernels with Mosaic and run them on the chip (`interpret` is then False)."""

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu
from interpret_mode import interpret_params


@pytest.fixture
def interpret():
    """Fresh interpreter state per test (a kernel that raised leaves it dirty); False on a TPU."""
    if jax.default_backend() == "tpu":
        yield False
        return
    pltpu.reset_tpu_interpret_mode_state()
    yield interpret_params()
    pltpu.reset_tpu_interpret_mode_state()
