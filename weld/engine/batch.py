"""Host batching: a scheduler plan as numpy arrays of bucketed shapes. No jax here.

Shapes are rounded up to a small set of buckets (powers of two for batch rows and tokens per
row); block tables always have the width of the longest sequence the model allows (attention
loops only over the pages in use), so sequences growing never change a program's shape. The
device programs (`weld.engine.programs`) take these arrays as they are: the dataclasses below
are registered as pytrees by `weld.engine.sampler`.

Row layout: a "decode" or "verify" plan puts entry i in row i of a bucket of rows; a "prefill"
or "mixed" plan puts prompt chunks in rows [0, bp) and the decode rows riding along in
[bp, bp + bd), each group bucketed on its own. Every row also names its sequence's
recurrent-state slot (`Sequence.state_slot`; -1 for padding rows and models without such state).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from weld.engine.sampling_params import SamplingParams
from weld.engine.scheduler import MIN_TOKEN_BUCKET, ScheduledSeq, SchedulerOutput, bucket
from weld.engine.sequence import Sequence


@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling parameters, each [b]."""

    temperature: np.ndarray  # f32; 0 = greedy
    top_k: np.ndarray  # i32; <= 0 = off
    top_p: np.ndarray  # f32; 1 = off
    min_p: np.ndarray  # f32; 0 = off
    seed_hi: np.ndarray  # u32, high and low words of the request's seed
    seed_lo: np.ndarray  # u32
    position: np.ndarray  # i32, position of the token being sampled


@dataclasses.dataclass
class PenaltyArrays:
    """Per-row penalties and biases; counts / prompt_mask cover the whole vocabulary."""

    presence: np.ndarray  # f32 [b]
    frequency: np.ndarray  # f32 [b]
    repetition: np.ndarray  # f32 [b]; 1 = off
    counts: np.ndarray  # i32 [b, v]: how often each token was generated so far
    prompt_mask: np.ndarray  # bool [b, v]: tokens in the prompt
    bias_ids: np.ndarray  # i32 [b, m], padded with -1
    bias_values: np.ndarray  # f32 [b, m]


@dataclasses.dataclass
class StopArrays:
    """What ends a row on the device, besides its step budget (`programs.stop_hit`)."""

    max_steps: np.ndarray  # i32 [b]: tokens the row may still produce in this call (0 = padding row)
    num_output: np.ndarray  # i32 [b]: tokens the row had produced before this call
    min_tokens: np.ndarray  # i32 [b]: EOS and stop ids cannot be sampled before this many tokens
    ignore_eos: np.ndarray  # bool [b]
    stop_ids: np.ndarray  # i32 [b, s]: the row's stop token ids, padded with -1
    eos_ids: np.ndarray  # i32 [e]: the model's end-of-sequence ids


@dataclasses.dataclass
class HostBatch:
    """Everything one device call takes, for plan entry i in batch row rows[i]."""

    kind: str  # the plan's kind
    rows: list[int]
    block_tables: np.ndarray  # i32 [b, page groups * max_pages]
    sampling: SamplingArrays
    stop: StopArrays
    penalties: PenaltyArrays | None  # None: no row uses any (the programs skip them)
    bitmask: np.ndarray | None  # i32 [b, ceil(v / 32)] (verify: [b, k + 1, ceil(v / 32)]); None: no row is constrained
    state_slots: np.ndarray  # i32 [b]: each row's recurrent-state slot, -1: none
    # decode and verify: each row's last token (not yet in the cache) and its position [b]
    tokens: np.ndarray | None = None  # verify: [b, k + 1], the last token then host drafts
    positions: np.ndarray | None = None
    num_drafts: np.ndarray | None = None  # verify: i32 [b]
    host_drafted: np.ndarray | None = None  # verify: bool [b], rows that send the host's drafts (one round)
    history: np.ndarray | None = None  # verify with a drafter that reads it: i32 [b, w], tokens by position
    # prefill / mixed: (tokens, positions, block tables, last index, state slots) per row group
    groups: tuple[tuple[np.ndarray, ...], ...] = ()
    prompt_targets: np.ndarray | None = None  # i32 [bp, tp]: the token after each fed token

    @property
    def num_prefill_rows(self) -> int:
        return self.groups[0][0].shape[0] if self.groups else 0


def build(plan: SchedulerOutput, *, max_pages_per_seq: int, vocab_size: int, eos_ids: np.ndarray,
          num_page_groups: int = 1, num_ranks: int = 1,
          num_spec_tokens: int = 0, want_prompt_logprobs: bool = False, token_bitmask: np.ndarray | None = None,
          drafts: np.ndarray | None = None, num_drafts: np.ndarray | None = None,
          host_drafted: np.ndarray | None = None, history_width: int = 0) -> HostBatch:
    """The host arrays of `plan`. token_bitmask int32 [len(plan.entries), ceil(vocab / 32)], row i
    for entry i (a "verify" plan: [n, k + 1, ceil(vocab / 32)], one mask per slot), or None. A
    "verify" plan takes each entry's host drafts (int32 [n, k], padded), how many it may send
    (num_drafts [n]), which entries send the host's drafts rather than the device drafter's
    (host_drafted bool [n]; None: none), and, with history_width > 0, each entry's tokens by
    position in a [b, history_width] history. num_ranks > 1: rows grouped by data-parallel rank
    (`rank_rows`)."""
    entries = plan.entries
    if plan.kind in ("decode", "verify"):
        b, rows = rank_rows(entries, num_ranks)
        bp = 0
    else:
        bp, rows = rank_rows(entries[:plan.num_prefill], num_ranks)
        decodes = entries[plan.num_prefill:]
        bd, decode_rows = rank_rows(decodes, num_ranks, base=bp) if decodes else (0, [])
        b, rows = bp + bd, rows + decode_rows
    # Each page group's table side by side; pages a sliding window freed (-1) read as page 0,
    # which they never write and the window's mask never shows.
    block_tables = np.zeros((b, num_page_groups * max_pages_per_seq), np.int32)
    for r, e in zip(rows, entries):
        for g, table in enumerate(e.seq.block_tables[:num_page_groups]):
            block_tables[r, g * max_pages_per_seq:g * max_pages_per_seq + len(table)] = np.maximum(table, 0)
    state_slots = np.full((b,), -1, np.int32)
    state_slots[np.asarray(rows)] = [e.seq.state_slot for e in entries]
    if plan.kind == "verify" and token_bitmask is not None and token_bitmask.shape[1] != num_spec_tokens + 1:
        raise ValueError(f"a verify step of {num_spec_tokens} drafts needs {num_spec_tokens + 1} masks a row, "
                         f"got {token_bitmask.shape[1]}")
    host = HostBatch(plan.kind, rows, block_tables, sampling_arrays(entries, rows, b),
                     stop_arrays(entries, rows, b, eos_ids), penalty_arrays(entries, rows, b, vocab_size),
                     bitmask_rows(token_bitmask, rows, b, vocab_size), state_slots)
    if plan.kind == "decode":
        host.tokens, host.positions = last_tokens(entries, rows, b)
    elif plan.kind == "verify":
        last, host.positions = last_tokens(entries, rows, b)
        host.tokens = np.zeros((b, num_spec_tokens + 1), np.int32)
        host.tokens[:, 0] = last
        host.num_drafts = np.zeros((b,), np.int32)
        host.host_drafted = np.zeros((b,), bool)
        for i, r in enumerate(rows):
            sent = min(int(num_drafts[i]) if num_drafts is not None else 0, num_spec_tokens)
            host.num_drafts[r] = sent
            if drafts is not None:
                host.tokens[r, 1:1 + sent] = drafts[i, :sent]
            host.host_drafted[r] = host_drafted is not None and bool(host_drafted[i])
        if history_width:
            host.history = histories(entries, rows, b, history_width)
    else:
        host.groups, host.prompt_targets = prefill_groups(plan, rows, bp, block_tables, state_slots,
                                                          want_prompt_logprobs)
    return host


def rank_rows(entries: list[ScheduledSeq], num_ranks: int = 1, base: int = 0) -> tuple[int, list[int]]:
    """(rows of a row group, each entry's row in the batch). One rank: bucket(n) rows, entry i in
    row base + i. Data-parallel ranks split a group's rows evenly (`sharding.shard_rows`): rank
    r's entries go, in order, to rows base + r * per .., per = bucket(most entries on one rank)."""
    if num_ranks == 1:
        return bucket(len(entries)), [base + i for i in range(len(entries))]
    taken = [0] * num_ranks
    index = []
    for e in entries:
        r = e.seq.dp_rank
        if not 0 <= r < num_ranks:
            raise ValueError(f"sequence {e.seq.request_id!r} is on data-parallel rank {r}, not one of {num_ranks}")
        index.append((r, taken[r]))
        taken[r] += 1
    per = bucket(max(taken))
    return num_ranks * per, [base + r * per + i for r, i in index]


def last_tokens(entries: list[ScheduledSeq], rows: list[int], b: int) -> tuple[np.ndarray, np.ndarray]:
    """Each decode row's last token (not yet in the cache) and its position, [b] each (0 in padding rows)."""
    tokens = np.zeros((b,), np.int32)
    positions = np.zeros((b,), np.int32)
    for r, e in zip(rows, entries):
        tokens[r] = e.seq.token_at(e.start)
        positions[r] = e.start
    return tokens, positions


def prefill_groups(plan: SchedulerOutput, rows: list[int], bp: int, block_tables: np.ndarray,
                   state_slots: np.ndarray, want_prompt_logprobs: bool):
    """Row groups (tokens, positions, tables, last index, state slots) of a prefill or mixed plan:
    prompt chunks [bp, tp], then any decode rows [bd, 1]; and the prompt-logprob targets [bp, tp].
    rows: each entry's batch row (chunks in [0, bp), decode rows from bp)."""
    chunks, decodes = plan.entries[:plan.num_prefill], plan.entries[plan.num_prefill:]
    t = bucket(max(e.num_tokens for e in chunks), MIN_TOKEN_BUCKET)
    tokens = np.zeros((bp, t), np.int32)
    positions = np.full((bp, t), -1, np.int32)
    last_index = np.zeros((bp,), np.int32)
    targets = np.zeros((bp, t), np.int32)
    for i, e in zip(rows, chunks):
        seq = e.seq
        tokens[i, :e.num_tokens] = seq.token_ids()[e.start:e.start + e.num_tokens]
        positions[i, :e.num_tokens] = np.arange(e.start, e.start + e.num_tokens)
        last_index[i] = e.num_tokens - 1
        if want_prompt_logprobs:
            # The target of fed token j is the token after it, where that is known.
            targets[i, :e.num_tokens] = [seq.token_at(pos + 1) if pos + 1 < seq.num_tokens else 0
                                         for pos in range(e.start, e.start + e.num_tokens)]
    groups = [(tokens, positions, block_tables[:bp], last_index, state_slots[:bp])]
    bd = block_tables.shape[0] - bp
    if bd:  # decode rows of a mixed step: one token each, at the end of the batch
        decode_rows = [r - bp for r in rows[plan.num_prefill:]]
        d_tokens, d_positions = last_tokens(decodes, decode_rows, bd)
        padding = np.ones((bd,), bool)
        padding[decode_rows] = False
        d_positions[padding] = -1
        groups.append((d_tokens[:, None], d_positions[:, None], block_tables[bp:], np.zeros((bd,), np.int32),
                       state_slots[bp:]))
    return tuple(groups), targets


def histories(entries: list[ScheduledSeq], rows: list[int], b: int, width: int) -> np.ndarray:
    """Each row's tokens by position, int32 [b, width], -1 past its length (and in padding rows)."""
    out = np.full((b, width), -1, np.int32)
    for r, e in zip(rows, entries):
        tokens = e.seq.token_ids()
        if len(tokens) > width:
            raise ValueError(f"sequence {e.seq.request_id!r} has {len(tokens)} tokens, more than the history's {width}")
        out[r, :len(tokens)] = tokens
    return out


def bitmask_rows(token_bitmask: np.ndarray | None, rows: list[int], b: int, vocab_size: int) -> np.ndarray | None:
    """The entries' bitmask rows placed at their batch rows [b, (slots,) w]; padding rows allow everything."""
    if token_bitmask is None:
        return None
    width = -(-vocab_size // 32)
    if (token_bitmask.ndim not in (2, 3) or token_bitmask.shape[0] != len(rows) or token_bitmask.shape[-1] != width
            or token_bitmask.dtype != np.int32):
        raise ValueError(f"token_bitmask must be int32 [{len(rows)}, (slots,) {width}], "
                         f"got {token_bitmask.dtype} {token_bitmask.shape}")
    out = np.full((b,) + token_bitmask.shape[1:], -1, np.int32)
    out[np.asarray(rows)] = token_bitmask
    return out


def stop_arrays(entries: list[ScheduledSeq], rows: list[int], b: int, eos_ids: np.ndarray) -> StopArrays:
    max_steps = np.zeros((b,), np.int32)
    num_output = np.zeros((b,), np.int32)
    min_tokens = np.zeros((b,), np.int32)
    ignore_eos = np.zeros((b,), bool)
    s = bucket(max(len(e.seq.params.stop_token_ids) for e in entries))
    stop_ids = np.full((b, s), -1, np.int32)
    for i, e in zip(rows, entries):
        p = e.seq.params
        max_steps[i] = e.max_steps if e.sample else 0
        num_output[i] = e.seq.num_output_tokens
        min_tokens[i] = p.min_tokens
        ignore_eos[i] = p.ignore_eos
        stop_ids[i, :len(p.stop_token_ids)] = p.stop_token_ids
    return StopArrays(max_steps, num_output, min_tokens, ignore_eos, stop_ids, eos_ids)


def penalty_arrays(entries: list[ScheduledSeq], rows: list[int], b: int, vocab_size: int) -> PenaltyArrays | None:
    """Penalty inputs, or None when no row uses any (then the programs skip them entirely)."""
    if not any(e.seq.params.penalized for e in entries):
        return None
    presence = np.zeros((b,), np.float32)
    frequency = np.zeros((b,), np.float32)
    repetition = np.ones((b,), np.float32)
    counts = np.zeros((b, vocab_size), np.int32)
    prompt_mask = np.zeros((b, vocab_size), bool)
    m = bucket(max(len(e.seq.params.logit_bias or {}) for e in entries))
    bias_ids = np.full((b, m), -1, np.int32)
    bias_values = np.zeros((b, m), np.float32)
    for i, e in zip(rows, entries):
        p, seq = e.seq.params, e.seq
        if not p.penalized:
            continue
        presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        if seq.output_token_ids:
            counts[i] = np.bincount(np.asarray(seq.output_token_ids), minlength=vocab_size)[:vocab_size]
        prompt_mask[i, np.asarray(seq.prompt_token_ids)] = True
        for j, (token, value) in enumerate((p.logit_bias or {}).items()):
            bias_ids[i, j], bias_values[i, j] = token, value
    return PenaltyArrays(presence, frequency, repetition, counts, prompt_mask, bias_ids, bias_values)


def sampling_arrays(entries: list[ScheduledSeq], rows: list[int], b: int) -> SamplingArrays:
    """Per-row sampling parameters; `position` is that of the first token sampled this call."""
    temperature = np.zeros((b,), np.float32)
    top_k = np.zeros((b,), np.int32)
    top_p = np.ones((b,), np.float32)
    min_p = np.zeros((b,), np.float32)
    seed_hi = np.zeros((b,), np.uint32)
    seed_lo = np.zeros((b,), np.uint32)
    position = np.zeros((b,), np.int32)
    for i, e in zip(rows, entries):
        seq, p = e.seq, e.seq.params
        temperature[i] = 0.0 if p.greedy else p.temperature
        top_k[i] = max(p.top_k, 0)
        top_p[i] = p.top_p
        min_p[i] = p.min_p
        seed_hi[i] = (seq.seed >> 32) & 0xFFFFFFFF
        seed_lo[i] = seq.seed & 0xFFFFFFFF
        position[i] = e.start + e.num_tokens
    return SamplingArrays(temperature, top_k, top_p, min_p, seed_hi, seed_lo, position)


def warmup_plans(max_num_seqs: int, max_num_batched_tokens: int, page_size: int,
                 spec_widths: tuple[int, ...] = (), num_page_groups: int = 1, num_slots: int = 0,
                 num_ranks: int = 1, max_seq_len: int | None = None) -> list[SchedulerOutput]:
    """One dummy plan per bucketed shape the scheduler can produce: fused decodes and, for each
    speculation width w > 0 in `spec_widths`, verification steps of w drafts a round, of bd rows,
    and prefills of bp rows x tp tokens with bd decode rows riding along (bd = 0: none). The
    dummies of a plan use recurrent-state slots 0, 1, ... (modulo num_slots; none if it is 0), as
    they use pages 0, 1, ...: run them while no sequence holds any.

    A shape is feasible when its smallest content fits the limits (a bucket of n > 1 holds at
    least n/2 + 1 items, a token bucket tp > 16 a chunk of at least tp/2 + 1 tokens, which one
    sequence of at most max_seq_len tokens must hold) and, with
    several prompt rows longer than the minimal bucket, bp * tp stays within the scheduler's
    padded-slot limit.

    num_ranks > 1 (data-parallel attention): the dummies are rank 0's, each rank's share of a
    group's rows (`rank_rows`) bucketed up to ceil(max_num_seqs / num_ranks), the most
    `DataParallelBlockManager` places on one rank while it balances them.
    """
    def least_rows(n: int) -> int:
        return n if n <= 1 else n // 2 + 1

    params = SamplingParams(max_tokens=1, temperature=0)
    row_buckets = [1 << i for i in range(bucket(-(-max_num_seqs // num_ranks)).bit_length())]
    slots = bucket(max_num_batched_tokens, MIN_TOKEN_BUCKET)
    token_buckets = [1 << i for i in range(MIN_TOKEN_BUCKET.bit_length() - 1, slots.bit_length())]

    def dummy(num_tokens: int, chunk: int, decode: bool) -> ScheduledSeq:
        seq = Sequence("warmup", [0] * num_tokens, params)
        seq.block_tables = [list(range(-(-num_tokens // page_size)))] * num_page_groups
        if decode:
            return ScheduledSeq(seq, num_tokens - 1, 1, sample=True, max_steps=1)
        return ScheduledSeq(seq, 0, chunk, sample=True)

    def plan(kind: str, entries: list[ScheduledSeq], num_prefill: int = 0) -> SchedulerOutput:
        for i, e in enumerate(entries):
            e.seq.state_slot = i % num_slots if num_slots else -1
        return SchedulerOutput(kind, entries, num_prefill)

    plans = []
    for width in sorted(set(spec_widths) | {0}):
        for bd in row_buckets:
            plans.append(plan("verify" if width else "decode", [dummy(2, 1, True) for _ in range(least_rows(bd))]))
            plans[-1].spec_width = width
    for tp in token_buckets:
        for bp in row_buckets:
            for bd in [0] + row_buckets:
                rows_p, rows_d = least_rows(bp), least_rows(bd)
                chunk = 1 if tp == MIN_TOKEN_BUCKET else tp // 2 + 1
                if (rows_p + rows_d > max_num_seqs or chunk + rows_p - 1 + rows_d > max_num_batched_tokens
                        or (max_seq_len is not None and chunk > max_seq_len)
                        or (rows_p > 1 and tp > MIN_TOKEN_BUCKET and bp * tp > slots)):
                    continue
                chunks = [dummy(chunk, chunk, False)] + [dummy(1, 1, False) for _ in range(rows_p - 1)]
                decodes = [dummy(2, 1, True) for _ in range(rows_d)]
                plans.append(plan("mixed" if decodes else "prefill", chunks + decodes, len(chunks)))
    return plans
