"""Page bookkeeping for the paged KV cache: which pages are free, which a sequence holds. Pure Python."""

from __future__ import annotations

from collections import deque

from weld.engine.sequence import Sequence


class BlockManager:
    """Hands out page ids from a fixed pool and takes them back.

    A sequence's block table grows a page at a time as its tokens need room; freeing a
    sequence returns all its pages. The engine checks `num_free_pages == num_pages` when idle:
    a page that never comes back is a leak.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of one token, got {num_pages} pages of {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """How many more pages `seq` needs for its first `num_tokens` tokens to have a slot."""
        return max(0, self.pages_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grows `seq`'s block table to hold `num_tokens` tokens (raises if the pool is short)."""
        need = self.pages_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV pages: need {need}, have {len(self._free)}")
        for _ in range(need):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
