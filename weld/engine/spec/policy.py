"""How many drafts per round each speculative call verifies, chosen by what the calls measure.

A round of width w feeds each row's last token and up to w drafts to the target: w + 1 rows of
work for 1 + (accepted drafts) tokens. Where a forward costs about the same for 1 and 8 rows
(an accelerator, a memory-bound step) the widest rounds pay; where it does not (a CPU's integer
kernels at several rows, a large batch) narrower ones, or none, pay more: the verify-cost
benchmark measured a k = 7 round at 2.2x a one-token step for one row on a 2-core AVX2 machine,
and at 4.2x for four rows. Acceptance depends on the text as much. So the engine measures
instead of guessing: `WidthPolicy` keeps, per batch-size bucket and width (0: a plain fused
decode), a moving average of the tokens each row got per second of device call, tries every
width once, then takes the best, trying the others again now and then. Outputs never depend
on the choice (verification keeps exactly the tokens plain decoding would give,
`acceptance.coupled_accept`); only the speed does.

Pure Python: no jax.
"""

from __future__ import annotations

import dataclasses


def bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass
class WidthPolicy:
    """widths: the choices (0: plain decode; `SpeculativeConfig.widths`); a single width means no choice. explore_every:
    calls between retries of a width that is not the best; alpha: the moving averages' weight of
    a new measurement."""

    widths: tuple[int, ...]
    explore_every: int = 16
    alpha: float = 0.3
    rates: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    calls: int = 0

    def choose(self, rows: int) -> int:
        """The width of the next call, for `rows` running sequences."""
        if len(self.widths) == 1:
            return self.widths[0]
        b = bucket(rows)
        self.calls += 1
        untried = [w for w in self.widths if (b, w) not in self.rates]
        if untried:
            return max(untried)  # the widest first: the user's own num_speculative_tokens
        best = max(self.widths, key=lambda w: self.rates[(b, w)])
        if self.calls % self.explore_every == 0:
            others = [w for w in self.widths if w != best]
            return others[(self.calls // self.explore_every) % len(others)]
        return best

    def record(self, rows: int, width: int, tokens: int, seconds: float) -> None:
        """A call of `width` over `rows` rows made `tokens` tokens in `seconds`."""
        if rows <= 0 or seconds <= 0 or len(self.widths) == 1:
            return
        rate = tokens / rows / seconds
        key = (bucket(rows), width)
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else old + self.alpha * (rate - old)

    def table(self) -> dict[str, float]:
        """The measured rates, "batch b, width w" -> tokens per row per second (for stats)."""
        return {f"b{b}_w{w}": round(r, 2) for (b, w), r in sorted(self.rates.items())}
