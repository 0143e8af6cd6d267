"""Progress bars on stderr for long work (weight loading, compiling)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Iterator


def progress_enabled() -> bool:
    """Bars are shown when stderr is a terminal, unless WELD_PROGRESS=0; WELD_PROGRESS=1 forces them."""
    env = os.environ.get("WELD_PROGRESS")
    if env is not None:
        return env not in ("0", "false", "no", "")
    return sys.stderr.isatty()


class Progress:
    """A thin wrapper over tqdm that does nothing when bars are disabled."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", enabled: bool | None = None):
        self._bar = None
        if enabled is None:
            enabled = progress_enabled()
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                             dynamic_ncols=True, unit_scale=unit == "B")

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def set_description(self, desc: str) -> None:
        """Replaces the text before the bar (e.g. the step now running)."""
        if self._bar is not None:
            self._bar.set_description(desc)

    def set_postfix(self, **values) -> None:
        """Shows values after the bar (e.g. a training loss)."""
        if self._bar is not None:
            self._bar.set_postfix(**values)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def status(message: str, enabled: bool | None = None) -> Iterator[None]:
    """Shows `message ...` on stderr while the block runs, then how long it took."""
    if enabled is None:
        enabled = progress_enabled()
    start = time.perf_counter()
    if enabled:
        print(f"{message} ...", end="", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        if enabled:
            print(f" {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
