"""Which sequences run in the next model call, and how many of their tokens. Pure Python.

Policy (vLLM v1 style, with weld's fused decode):
- While prompts wait, each step is mixed: every running sequence decodes one token, and the
  rest of the `max_num_batched_tokens` budget goes to waiting prompts, in chunks (a long
  prompt takes several steps; the running sequences keep producing a token per step meanwhile).
- When nothing waits (or nothing waiting fits), every running sequence decodes up to
  `steps_per_call` tokens in one fused device call; pages for them are allocated up front, as
  far as the sequence's token limit allows. A sequence with structured outputs decodes one
  token per call (its grammar's token mask is recomputed on the host after every token).
- With speculative decoding (`num_spec_tokens` k > 0), that call is a verification instead:
  every running sequence gets slots for `spec_rounds` rounds of k + 1 tokens (its last token
  and up to k drafts each; a sequence with structured outputs one round, whose masks the host
  computes along its drafts), and the engine gives back the slots of rejected drafts
  afterwards (`BlockManager.trim`).
- When pages run out for even one decode step, the newest running sequence is preempted by
  recompute (under data-parallel attention, the newest on the same rank: only its pages are
  of use): its pages are freed and it goes back to the waiting queue, keeping its tokens.
  A step that preempted admits no new prompt.
- A model with linear-attention layers snapshots a sequence's recurrent state for the prefix
  cache only between calls, so while snapshots are on every call ends a sequence's tokens at its
  next snapshot point at the latest (`BlockManager.next_snapshot_point`): a prompt chunk stops
  there (and the next prompt may still start in the same step), a decode row takes no more
  steps. Each plan carries the slot copies queued since the last one
  (`SchedulerOutput.slot_copies`), which the runner makes before the call.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from weld.engine.block_manager import BlockManager
from weld.engine.sequence import Sequence, SequenceStatus


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum): the runner pads batch shapes to these."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


MIN_TOKEN_BUCKET = 16  # prompt chunks are padded to at least this many tokens


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first token fed this step
    num_tokens: int  # tokens fed this step
    sample: bool  # whether the last fed token's logits produce the next token
    max_steps: int = 1  # decode: how many tokens this row may produce in the call


@dataclasses.dataclass
class SchedulerOutput:
    """One model call. kind "prefill": prompt chunks only; "mixed": prompt chunks, then decode
    rows of one token each; "decode": a fused multi-step decode; "verify": a speculative step
    (each row's last token and up to max_steps - 1 drafts scored in one pass). The first
    `num_prefill` entries are prompt chunks."""

    kind: str  # "prefill" | "mixed" | "decode" | "verify"
    entries: list[ScheduledSeq]
    num_prefill: int = 0
    spec_width: int = 0  # verify: drafts each row may send per round
    # recurrent-state slot copies (source, destination) to make before the call, wave after wave
    # (`BlockManager.take_copies`)
    slot_copies: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, steps_per_call: int = 1, num_spec_tokens: int = 0,
                 spec_rounds: int = 1):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.steps_per_call = steps_per_call
        self.num_spec_tokens = num_spec_tokens
        self.spec_rounds = spec_rounds
        # Drafts per round of the next decode call (at most num_spec_tokens; 0: a plain fused
        # decode). The engine sets it before each call (`weld.engine.spec.policy`).
        self.spec_width = num_spec_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput | None:
        """The next call, carrying the slot copies queued since the last one (they stay queued
        while there is no call to make)."""
        plan = self._plan()
        if plan is not None:
            plan.slot_copies = self.block_manager.take_copies()
        return plan

    def _plan(self) -> SchedulerOutput | None:
        if self.waiting:
            preemptions = self.num_preemptions
            decode = self._schedule_decode(max_steps=1)
            prefill = []
            if self.num_preemptions == preemptions:
                prefill = self._schedule_prefill(self.max_num_batched_tokens - len(decode))
            if prefill:
                return SchedulerOutput("mixed" if decode else "prefill", prefill + decode, len(prefill))
        width = min(self.spec_width, self.num_spec_tokens)
        if width:
            decode = self._schedule_decode(max_steps=self.spec_rounds * (width + 1), constrained_steps=width + 1)
            if decode:
                return SchedulerOutput("verify", decode, spec_width=width)
        else:
            decode = self._schedule_decode(max_steps=self.steps_per_call)
            if decode:
                return SchedulerOutput("decode", decode)
        prefill = self._schedule_prefill(self.max_num_batched_tokens)  # preemption freed pages
        return SchedulerOutput("prefill", prefill, len(prefill)) if prefill else None

    def _schedule_prefill(self, budget: int) -> list[ScheduledSeq]:
        """Prompt chunks for this step, within `budget` tokens, in queue order. The runner pads
        the chunks to [bucket(rows), bucket(longest chunk)]; unless every chunk is short (one
        minimal token bucket), that padded size is kept within bucket(max_num_batched_tokens), so
        a long chunk never drags many short rows along.

        A prompt whose chunk the budget cuts short is the last one this step. One cut at a
        snapshot point takes the pages of its whole prompt now and lets the next prompt start:
        it continues in a later step without needing a page more, so the prompts part-way
        through their prefill (the front of the queue) can always finish."""
        entries: list[ScheduledSeq] = []
        slots = bucket(self.max_num_batched_tokens, MIN_TOKEN_BUCKET)
        longest = 0
        bm = self.block_manager
        i = 0  # the waiting sequence to look at next: those before it have a chunk this step
        # sequences this step's chunks keep waiting (part-way through their prompt); the others
        # join self.running as their prompt finishes
        partial = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) + partial < self.max_num_seqs:
            seq = self.waiting[i]
            if seq.index > 0 and self._sibling_computes_prompt(seq, entries):
                break  # next step, n > 1 siblings reuse the prompt pages this step computes
            first = seq.num_cached_tokens is None and seq.num_computed_tokens == 0
            bm.match_prefix(seq)  # a fresh (or recomputed) sequence skips its cached prefix
            if first:
                seq.num_cached_tokens = seq.num_computed_tokens
            remaining = seq.num_tokens - seq.num_computed_tokens
            chunk = min(remaining, budget)
            point = bm.next_snapshot_point(seq, seq.num_computed_tokens)
            at_point = point is not None and point - seq.num_computed_tokens < chunk
            if at_point:
                chunk = point - seq.num_computed_tokens
            width = bucket(max(longest, chunk), MIN_TOKEN_BUCKET)
            if entries and width > MIN_TOKEN_BUCKET and bucket(len(entries) + 1) * width > slots:
                break
            if not bm.can_allocate(seq, seq.num_computed_tokens + chunk):
                if not entries and not self.running and bm.holds_only(seq):
                    raise RuntimeError(
                        f"a sequence of {seq.num_tokens} tokens needs {bm.pages_for(seq.num_tokens)} pages "
                        f"but the KV cache has only {bm.num_pages}")
                break
            holds_prompt = at_point and bm.can_allocate(seq, seq.num_tokens)
            bm.allocate(seq, seq.num_tokens if holds_prompt else seq.num_computed_tokens + chunk)
            finishes_prompt = chunk == remaining
            entries.append(ScheduledSeq(seq, seq.num_computed_tokens, chunk, sample=finishes_prompt))
            budget -= chunk
            longest = max(longest, chunk)
            if holds_prompt:
                i += 1  # the rest of this prompt goes in a later step, the next prompt may start now
                partial += 1
                continue
            if not finishes_prompt:
                break  # the rest of this prompt goes in the next step
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return entries

    def _sibling_computes_prompt(self, seq: Sequence, entries: list[ScheduledSeq]) -> bool:
        """Whether an entry of this step computes prompt pages that `seq` (a sibling of an n > 1
        request) could take from the prefix cache from the next step on. Siblings that hit the
        cache go together in one step."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return False
        shareable = (seq.num_prompt_tokens - 1) // bm.page_size * bm.page_size
        return any(e.seq.request_id == seq.request_id and e.start < shareable for e in entries)

    def _schedule_decode(self, max_steps: int, constrained_steps: int = 1) -> list[ScheduledSeq]:
        """Decode rows for every running sequence, with up to max_steps tokens each
        (constrained_steps for a sequence with structured outputs)."""
        bm = self.block_manager
        scheduled: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted to make room for an older sequence
            # k steps feed the last token and k - 1 sampled ones: k positions from num_tokens - 1,
            # and produce k tokens, no more than the sequence may still have.
            # A constrained sequence decodes one token per call (its mask changes after each one),
            # or verifies one round of host drafts, whose masks the host computed along them.
            limit = constrained_steps if seq.params.structured_outputs is not None else max_steps
            steps = max(1, min(limit, seq.token_limit(self.max_model_len) - seq.num_tokens))
            point = bm.next_snapshot_point(seq, seq.num_tokens - 1)
            if point is not None:  # the call computes positions num_tokens - 1 .. num_tokens + steps - 2
                steps = min(steps, point - seq.num_tokens + 1)
            if not bm.can_allocate(seq, seq.num_tokens + steps - 1):
                steps = 1
            while not bm.can_allocate(seq, seq.num_tokens):
                # the newest sequence whose pages seq could use (data parallel: on its rank)
                victim = next(s for s in reversed(self.running) if bm.shares_pages(seq, s))
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                bm.allocate(seq, seq.num_tokens + steps - 1)
                scheduled.append((seq, steps))
        return [ScheduledSeq(s, s.num_tokens - 1, 1, sample=True, max_steps=k) for s, k in scheduled]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        # Only the front of the queue may hold pages while waiting: prompts part-way through
        # their chunked prefill, all but the last holding every page their prompt needs
        # (`_schedule_prefill`). Queueing the victim behind them keeps that true, so they can
        # always get the pages they need once running sequences finish: no deadlock.
        ahead = 0
        while ahead < len(self.waiting) and any(self.waiting[ahead].block_tables):
            ahead += 1
        self.waiting.insert(ahead, seq)
        self.num_preemptions += 1

    def update_from_output(self, plan: SchedulerOutput, num_new_tokens: list[int]) -> None:
        """Page bookkeeping after a call. Entry i fed its tokens and produced num_new_tokens[i]
        (each one after the first was fed back, so its K/V is written too). A sequence that
        stopped is finished (its pages freed); the others give back the slots of rejected
        drafts (verify), register their pages that became full in the prefix cache and snapshot
        their recurrent state at a snapshot point. (Not a stopped one: a stop string found on the
        host may leave its state past the tokens it keeps.)"""
        for entry, new in zip(plan.entries, num_new_tokens):
            seq = entry.seq
            seq.num_computed_tokens = entry.start + entry.num_tokens + max(new - 1, 0)
            if seq.stopping:
                self.finish(seq, seq.finish_reason, seq.stop_reason)
                continue
            if plan.kind == "verify":
                self.block_manager.trim(seq, seq.num_tokens)
            self.block_manager.cache_full_pages(seq)
            self.block_manager.snapshot(seq)
            self.block_manager.release_outside_window(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Marks `seq` finished (or aborted) and frees its pages and state slot, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.stop(reason, stop_reason)
