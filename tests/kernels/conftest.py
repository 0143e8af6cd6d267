"""Fixtures for the kernel tests (interpret mode: see interpret_mode.py)."""

import pytest
from jax.experimental.pallas import tpu as pltpu
from interpret_mode import interpret_params


@pytest.fixture
def interpret():
    """Fresh interpreter state per test (a kernel that raised leaves it dirty)."""
    pltpu.reset_tpu_interpret_mode_state()
    yield interpret_params()
    pltpu.reset_tpu_interpret_mode_state()
