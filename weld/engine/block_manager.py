"""Page bookkeeping for the paged KV cache, with prefix caching. Pure Python.

A sequence's block table grows a page at a time as its tokens need room; freeing it returns
each page whose reference count drops to zero. A page that is full of computed tokens gets a
hash chained from its predecessor's, (previous hash, its tokens), so equal prefixes have equal
hashes. A new prompt reuses the cached pages of its longest full-page prefix (confirmed by
comparing tokens, never by hash alone), and starts computing after them. Free pages keep their
contents and hash until they are handed out again, least recently freed first (LRU), so a
finished request's prefix stays reusable for as long as the pool allows.
"""

from __future__ import annotations

from collections import OrderedDict

from weld.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of one token, got {num_pages} pages of {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))  # LRU first
        self._refs = [0] * num_pages
        self._page_hash: list[int | None] = [None] * num_pages
        self._page_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self._by_hash: dict[int, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

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
        """Grows `seq`'s block table with fresh pages to hold `num_tokens` tokens."""
        need = self.pages_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV pages: need {need}, have {len(self._free)}")
        for _ in range(need):
            page, _ = self._free.popitem(last=False)  # least recently freed
            self._forget(page)
            self._refs[page] = 1
            seq.block_table.append(page)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back the pages `seq` holds beyond those its first `num_tokens` tokens need (the
        slots of rejected speculative drafts). Only pages past every computed token go: they are
        the sequence's own, never shared or cached."""
        keep = max(self.pages_for(num_tokens), self.pages_for(seq.num_computed_tokens))
        while len(seq.block_table) > keep:
            page = seq.block_table.pop()
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[page] = None

    def free(self, seq: Sequence) -> None:
        self.cache_full_pages(seq)  # what it computed stays reusable after it finishes
        for page in reversed(seq.block_table):  # the prefix's first pages are reused last
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[page] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_pages = 0
        seq.last_page_hash = None

    # ----- prefix caching -----

    @staticmethod
    def _chain(previous: int | None, tokens: tuple[int, ...]) -> int:
        return hash((previous, tokens))

    def _forget(self, page: int) -> None:
        h = self._page_hash[page]
        if h is not None and self._by_hash.get(h) == page:
            del self._by_hash[h]
        self._page_hash[page] = None
        self._page_tokens[page] = None

    def match_prefix(self, seq: Sequence) -> int:
        """Reuses cached pages for `seq`'s longest full-page prefix; returns the tokens covered.

        At least the last token is left to compute (its logits are needed), so a page holding
        it is never shared. A request for prompt logprobs computes its whole prompt (as in vLLM).
        """
        if (not self.enable_prefix_caching or seq.block_table or seq.num_computed_tokens
                or seq.params.prompt_logprobs is not None):
            return 0
        tokens = seq.token_ids()
        usable = (len(tokens) - 1) // self.page_size
        self.prefix_queries += len(tokens)
        previous = None
        for i in range(usable):
            chunk = tuple(tokens[i * self.page_size:(i + 1) * self.page_size])
            h = self._chain(previous, chunk)
            page = self._by_hash.get(h)
            if page is None or self._page_tokens[page] != chunk:
                break
            if self._refs[page] == 0:
                del self._free[page]
            self._refs[page] += 1
            seq.block_table.append(page)
            previous = h
        hit_pages = len(seq.block_table)
        seq.num_hashed_pages, seq.last_page_hash = hit_pages, previous
        seq.num_computed_tokens = hit_pages * self.page_size
        self.prefix_hits += seq.num_computed_tokens
        return seq.num_computed_tokens

    def cache_full_pages(self, seq: Sequence) -> None:
        """Registers the pages of `seq` that have become full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.page_size, len(seq.block_table))
        if seq.num_hashed_pages >= full:
            return
        tokens = seq.token_ids()
        for i in range(seq.num_hashed_pages, full):
            chunk = tuple(tokens[i * self.page_size:(i + 1) * self.page_size])
            h = self._chain(seq.last_page_hash, chunk)
            page = seq.block_table[i]
            if h not in self._by_hash and self._page_hash[page] is None:
                self._by_hash[h] = page
                self._page_hash[page] = h
                self._page_tokens[page] = chunk
            seq.last_page_hash = h
        seq.num_hashed_pages = full
