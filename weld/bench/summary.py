"""From raw times and counters to the reported figures: decode tok/s and the fraction of the floor
per batch size, prefill tok/s and TTFT per engine (`summarize_engine`), weld over the other
engines (`ratios`), and the speculative engine over plain weld (`speculative_summary`, with the
acceptance of its drafts from the engine's counters: `spec_delta`, `spec_add`, `acceptance`).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from weld.bench.engines import SPEC_ENGINE
from weld.bench.flags import BenchConfig
from weld.bench.roofline import floor_bytes

SPEC_COUNTERS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
SPEC_LISTS = ("spec_drafted_per_position", "spec_accepted_per_position")


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the engine's cumulative speculative counters gained between two snapshots."""
    delta: dict[str, Any] = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    for key in SPEC_LISTS:
        delta[key] = [a - b for a, b in zip(after[key], before[key])]
    return delta


def spec_add(total: dict[str, Any] | None, delta: dict[str, Any]) -> dict[str, Any]:
    if total is None:
        return delta
    return {key: [a + b for a, b in zip(total[key], delta[key])] if key in SPEC_LISTS else total[key] + delta[key]
            for key in delta}


def acceptance(counts: dict[str, Any]) -> dict[str, Any]:
    """Rates from summed counters. A draft is a row-step that verified >= 1 drafted token; its
    acceptance length is 1 + the drafts accepted (the target's own token always comes out), so the
    mean acceptance length is 1 + accepted / drafts. Position j's rate is accepted / drafted in
    slot j (an n-gram proposal may send fewer than k drafts)."""
    drafts, drafted, accepted = (counts[key] for key in SPEC_COUNTERS)
    return {
        "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
        "drafted_per_position": counts["spec_drafted_per_position"],
        "accepted_per_position": counts["spec_accepted_per_position"],
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_rate": [a / d if d else None for a, d in zip(counts["spec_accepted_per_position"],
                                                                    counts["spec_drafted_per_position"])],
    }


def decode_rate(t_full: float, t_one: float, tokens_full: int, tokens_one: int) -> float | None:
    """Decode tok/s of one repetition: the tokens after the first over the time they took, (tokens
    of the full runs - tokens of the 1-token runs) / (t_full - t_one); None when noise made
    t_full <= t_one."""
    return (tokens_full - tokens_one) / (t_full - t_one) if t_full > t_one else None


def summarize_engine(engine, raw: dict, cfg: BenchConfig, input_len: int, prefill_len: int, bw_gb_s: float) -> dict:
    """One engine's figures from its raw times (which the result keeps alongside)."""
    decode = {}
    for batch, times in raw["decode"].items():
        if not times["t_full"]:
            continue
        per_run = [decode_rate(*run) for run in zip(times["t_full"], times["t_one"], times["tokens_full"],
                                                      times["tokens_one"])]
        valid = [r for r in per_run if r is not None]
        tok_s = statistics.median(valid) if valid else None
        step_bytes = floor_bytes(engine.weight_bytes, engine.kv_bytes_per_token, batch, input_len, cfg.output_len)
        floor_tok_s = batch * bw_gb_s * 1e9 / step_bytes["total"]
        decode[str(batch)] = {
            "t_full_s": times["t_full"], "t_one_s": times["t_one"], "tokens_full": times["tokens_full"],
            "tokens_one": times["tokens_one"], "groups": times["groups"], "tok_s_per_run": per_run, "tok_s": tok_s,
            "bytes_per_step": step_bytes, "floor_tok_s": floor_tok_s,
            "floor_fraction": tok_s / floor_tok_s if tok_s else None,
        }
    prefill_s = statistics.median(raw["prefill_s"]) if raw["prefill_s"] else None
    first = raw["decode"].get(1)
    # Batch 1 runs one group per prompt: the mean 1-token time of a prompt.
    ttft = statistics.median(first["t_one"]) / first["groups"] if first and first["t_one"] else None
    return {
        "label": engine.label, **engine.info,
        "weight_bytes": dataclasses.asdict(engine.weight_bytes),
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "decode": decode,
        "prefill": {"tokens": prefill_len, "t_s": raw["prefill_s"], "median_s": prefill_s,
                    "tok_s": prefill_len / prefill_s if prefill_s else None},
        "ttft_s": ttft,
    }


def ratios(results: dict, batch_sizes: tuple[int, ...]) -> dict:
    """weld / other, as speeds (above 1: weld is faster); TTFT as other's time / weld's. The
    speculative engine is compared in `speculative_summary`, not here."""
    weld = results["weld"]
    out = {}
    for name, other in results.items():
        if name in ("weld", SPEC_ENGINE):
            continue

        def ratio(a, b):
            return a / b if a and b else None

        out[f"weld/{name}"] = {
            "decode": {b: ratio(weld["decode"][b]["tok_s"], other["decode"][b]["tok_s"])
                       for b in map(str, batch_sizes) if b in other["decode"]},
            "prefill": ratio(weld["prefill"]["tok_s"], other["prefill"]["tok_s"]),
            "ttft": ratio(other["ttft_s"], weld["ttft_s"]),
        }
    return out


def speculative_summary(results: dict, spec_counts: dict, outputs: dict, cfg: BenchConfig) -> dict:
    """Per batch size: plain and speculative decode tok/s, their ratio, the acceptance counted over
    the timed full runs (every repetition), and whether the greedy outputs were identical."""
    plain, spec = results["weld"]["decode"], results[SPEC_ENGINE]["decode"]
    per_batch = {}
    for b in cfg.batch_sizes:
        plain_tok_s, spec_tok_s = plain[str(b)]["tok_s"], spec[str(b)]["tok_s"]
        per_batch[str(b)] = {
            "plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s,
            "speedup": spec_tok_s / plain_tok_s if plain_tok_s and spec_tok_s else None,
            "acceptance": acceptance(spec_counts[b]) if spec_counts[b] else None,
            "outputs_equal": outputs["weld"][b] == outputs[SPEC_ENGINE][b],
        }
    return {"config": cfg.spec, "per_batch": per_batch}
