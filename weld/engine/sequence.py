"""A sequence: one prompt and one of its completions, as the scheduler sees it. Pure Python."""

from __future__ import annotations

import enum
import itertools

from weld.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    """Token ids (prompt then output), the pages holding their K/V, and how far they are computed.

    `num_computed_tokens` tokens already have K/V in the pages of `block_tables` (one table per
    page group, `BlockManager`; `block_table` is group 0's); the rest are to be fed to the model.
    A preempted sequence drops its pages and starts again from 0 (recompute), keeping the tokens
    it had generated. A model with linear-attention layers also keeps a recurrent state per
    sequence, in slot `state_slot` of the cache's slot pools (-1: none), held from the sequence's
    first scheduled chunk until its pages are freed.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 index: int = 0, seed: int = 0):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.params = params
        self.seed = seed  # the sampling key is derived from (seed, position)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.block_tables: list[list[int]] = [[]]
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # of its prompt, found in the prefix cache when first scheduled
        self.num_hashed_pages = 0  # leading pages registered in the prefix cache
        self.last_page_hash: int | None = None  # hash of the last of them (the chain continues from it)
        self.state_slot = -1  # its recurrent-state slot (`BlockManager`), -1: none
        self.dp_rank = 0  # the data-parallel rank whose pages it holds (`DataParallelBlockManager`; -1: none yet)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def block_table(self) -> list[int]:
        """Group 0's block table (the only one of a model without sliding-window layers)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, pages: list[int]) -> None:
        self.block_tables[0] = pages

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_limit(self, max_model_len: int | None) -> int:
        """The length at which the sequence must stop: prompt + max_tokens, or the context,
        whichever comes first."""
        limit = max_model_len or (1 << 62)
        if self.params.max_tokens is not None:
            limit = min(limit, self.num_prompt_tokens + self.params.max_tokens)
        return limit

    def stop(self, reason: str, stop_reason: int | str | None = None) -> None:
        """Records why the sequence ends ("stop", "length", "abort"); the scheduler frees its
        pages when it next updates (`Scheduler.update_from_output`) or at once (`finish`)."""
        self.finish_reason, self.stop_reason = reason, stop_reason

    @property
    def stopping(self) -> bool:
        """The sequence has a finish reason (it is finished, or will be after this step)."""
        return self.finish_reason is not None

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, pages={len(self.block_table)}, {self.status.value})")
