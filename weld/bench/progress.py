"""What `weld bench` is doing while it runs, on stderr: every warm-up and timed measurement is a
step (which engine, which batch size, warm-up or timed repetition i of n), with the time since
the bench started and the decode tok/s of the last timed run.

Where it shows (`weld.utils.progress.progress_enabled`): on a terminal, one live bar whose text
is the step now running; with WELD_PROGRESS=1 and stderr not a terminal (a CI log, a file), one
line per finished step; with WELD_PROGRESS=0, or stderr not a terminal and not asked, nothing.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

from weld.utils.progress import Progress, progress_enabled


class BenchProgress:
    """`begin(what)` when a step starts, `finish(what, seconds, ...)` when it ends."""

    def __init__(self, total: int, enabled: bool | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        enabled = progress_enabled() if enabled is None else enabled
        tty = sys.stderr.isatty() if tty is None else tty
        self.mode = None if not enabled else "bar" if tty else "lines"
        self.total = total
        self.done = 0
        self._clock = clock
        self._start = clock()
        self._rates: dict[tuple[str, int], list[float]] = {}  # (engine label, batch) -> tok/s of its timed runs
        self._bar = Progress(total, "weld bench", unit="step", enabled=self.mode == "bar")

    def begin(self, what: str) -> None:
        self._bar.set_description(what)

    def finish(self, what: str, seconds: float, decode: tuple[str, int, float | None] | None = None,
               prefill_tok_s: float | None = None) -> None:
        """A step ended after `seconds`. `decode`: (engine label, batch, this run's decode tok/s)
        of a timed run (the line adds the median of that engine and batch so far);
        `prefill_tok_s`: the prompt tokens per second of a timed prefill."""
        self.done += 1
        figures = [f"{seconds:.2f}s"]
        if decode is not None:
            label, batch, tok_s = decode
            if tok_s is None:
                figures.append("decode tok/s n/a (the full run was not slower than the 1-token run)")
            else:
                rates = self._rates.setdefault((label, batch), [])
                rates.append(tok_s)
                figures.append(f"decode {tok_s:.1f} tok/s" + (f" (median {statistics.median(rates):.1f})"
                                                               if len(rates) > 1 else ""))
                self._bar.set_postfix(tok_s=f"{tok_s:.1f}")
        if prefill_tok_s is not None:
            figures.append(f"prefill {prefill_tok_s:.1f} tok/s")
        self._bar.update(1)
        if self.mode == "lines":
            elapsed = self._clock() - self._start
            print(f"[{elapsed:7.1f}s {self.done:>3}/{self.total}] {what}: {', '.join(figures)}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> "BenchProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
