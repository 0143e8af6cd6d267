"""Page bookkeeping for the paged caches, with prefix caching. Pure Python.

A model's paged layers fall into page groups (`CacheSpec.page_groups`): group 0 holds every
layer that attends to the whole context (and MLA's latent layers), then one group per sliding
window. Each group has a pool of its own, and a sequence has one block table per group; token at
position p lives in page `block_tables[g][p // page_size]` of group g. A sliding group's pages
that fell out of the window (every position in them <= the next position - window) go back to
their pool as the sequence advances (`release_outside_window`); their slots in the table become
-1, which the runner sends as page 0 (never written, never visible through the mask).

A sequence's block tables grow a page at a time as its tokens need room; freeing returns each
page whose reference count drops to zero. A page that is full of computed tokens gets a hash
chained from its predecessor's, (previous hash, its tokens), so equal prefixes have equal hashes.
A new prompt reuses the cached pages of its longest full-page prefix (confirmed by comparing
tokens, never by hash alone) for which every group has what the rest of the prompt will read (a
sliding group: the pages of the window before the hit), and starts computing after them. Free
pages keep their contents and hash until they are handed out again, least recently freed first
(LRU), so a finished request's prefix stays reusable for as long as the pool allows.
"""

from __future__ import annotations

from collections import OrderedDict

from weld.engine.sequence import Sequence


class _Pool:
    """One page group's pages: free list (LRU first), reference counts, the prefix cache."""

    def __init__(self, num_pages: int, window: int | None):
        self.num_pages = num_pages
        self.window = window
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self.refs = [0] * num_pages
        self.page_hash: list[int | None] = [None] * num_pages
        self.page_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self.by_hash: dict[int, int] = {}

    def take(self) -> int:
        page, _ = self.free.popitem(last=False)  # least recently freed
        self.forget(page)
        self.refs[page] = 1
        return page

    def release(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free[page] = None

    def share(self, page: int) -> None:
        if self.refs[page] == 0:
            del self.free[page]
        self.refs[page] += 1

    def forget(self, page: int) -> None:
        h = self.page_hash[page]
        if h is not None and self.by_hash.get(h) == page:
            del self.by_hash[h]
        self.page_hash[page] = None
        self.page_tokens[page] = None

    def cached(self, h: int, tokens: tuple[int, ...]) -> int | None:
        page = self.by_hash.get(h)
        return page if page is not None and self.page_tokens[page] == tokens else None

    def register(self, page: int, h: int, tokens: tuple[int, ...]) -> None:
        if h not in self.by_hash and self.page_hash[page] is None:
            self.by_hash[h] = page
            self.page_hash[page] = h
            self.page_tokens[page] = tokens


class BlockManager:
    """num_pages: one pool size, or one per page group (`windows`: each group's sliding window,
    None for the group of full-context layers)."""

    def __init__(self, num_pages: int | list[int] | tuple[int, ...], page_size: int,
                 enable_prefix_caching: bool = True, windows: tuple[int | None, ...] = (None,)):
        sizes = [num_pages] if isinstance(num_pages, int) else list(num_pages)
        if len(sizes) != len(windows):
            raise ValueError(f"{len(sizes)} pool sizes for {len(windows)} page groups")
        if min(sizes) < 1 or page_size < 1:
            raise ValueError(f"need at least one page of one token per group, got {sizes} pages of {page_size}")
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [_Pool(n, w) for n, w in zip(sizes, windows)]
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_pages(self) -> int:
        return sum(p.num_pages for p in self.pools)

    @property
    def full_context_pages(self) -> int | None:
        """Pages of the smallest pool whose layers see the whole context: the most one sequence
        can hold (None when every paged layer has a window, which frees pages as it goes)."""
        sizes = [p.num_pages for p in self.pools if p.window is None]
        return min(sizes) if sizes else None

    @property
    def num_free_pages(self) -> int:
        return sum(len(p.free) for p in self.pools)

    def holds_only(self, seq: Sequence) -> bool:
        """Whether every page in use belongs to `seq` (nothing else could free any)."""
        return all(len(pool.free) == pool.num_pages - sum(page >= 0 for page in table)
                   for pool, table in zip(self.pools, self._tables(seq)))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        while len(seq.block_tables) < len(self.pools):
            seq.block_tables.append([])
        return seq.block_tables

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """How many more pages of group 0 `seq` needs for its first `num_tokens` tokens to have a slot."""
        return max(0, self.pages_for(num_tokens) - len(self._tables(seq)[0]))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        want = self.pages_for(num_tokens)
        return all(max(0, want - len(table)) <= len(pool.free) for pool, table in zip(self.pools, self._tables(seq)))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grows `seq`'s block tables with fresh pages to hold `num_tokens` tokens."""
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError(f"out of KV pages: need {self.pages_needed(seq, num_tokens)}, have "
                               f"{[len(p.free) for p in self.pools]}")
        want = self.pages_for(num_tokens)
        for pool, table in zip(self.pools, self._tables(seq)):
            while len(table) < want:
                table.append(pool.take())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back the pages `seq` holds beyond those its first `num_tokens` tokens need (the
        slots of rejected speculative drafts). Only pages past every computed token go: they are
        the sequence's own, never shared or cached."""
        keep = max(self.pages_for(num_tokens), self.pages_for(seq.num_computed_tokens))
        for pool, table in zip(self.pools, self._tables(seq)):
            while len(table) > keep:
                page = table.pop()
                if page >= 0:
                    pool.release(page)

    def release_outside_window(self, seq: Sequence) -> None:
        """Frees the pages of each sliding group that no query from the next position on can see:
        pages whose positions all lie <= next position - window (they stay cached until reused)."""
        for pool, table in zip(self.pools, self._tables(seq)):
            if pool.window is None:
                continue
            first_visible = max(0, seq.num_computed_tokens - pool.window + 1)
            for i in range(min(first_visible // self.page_size, len(table))):
                if table[i] >= 0:
                    pool.release(table[i])
                    table[i] = -1

    def free(self, seq: Sequence) -> None:
        self.cache_full_pages(seq)  # what it computed stays reusable after it finishes
        for pool, table in zip(self.pools, self._tables(seq)):
            for page in reversed(table):  # the prefix's first pages are reused last
                if page >= 0:
                    pool.release(page)
        seq.block_tables = [[] for _ in self.pools]
        seq.num_computed_tokens = 0
        seq.num_hashed_pages = 0
        seq.last_page_hash = None

    # ----- prefix caching -----

    @staticmethod
    def _chain(previous: int | None, tokens: tuple[int, ...]) -> int:
        return hash((previous, tokens))

    def _window_start(self, pool: _Pool, hit_pages: int) -> int:
        """The first page a sliding group needs after a hit of hit_pages pages (0: full context)."""
        if pool.window is None:
            return 0
        return max(0, hit_pages * self.page_size - pool.window + 1) // self.page_size

    def match_prefix(self, seq: Sequence) -> int:
        """Reuses cached pages for `seq`'s longest full-page prefix; returns the tokens covered.

        At least the last token is left to compute (its logits are needed), so a page holding
        it is never shared. A request for prompt logprobs computes its whole prompt (as in vLLM).
        """
        tables = self._tables(seq)
        if (not self.enable_prefix_caching or any(tables) or seq.num_computed_tokens
                or seq.params.prompt_logprobs is not None):
            return 0
        tokens = seq.token_ids()
        usable = (len(tokens) - 1) // self.page_size
        self.prefix_queries += len(tokens)
        chunks, hashes, previous = [], [], None
        for i in range(usable):
            chunks.append(tuple(tokens[i * self.page_size:(i + 1) * self.page_size]))
            previous = self._chain(previous, chunks[-1])
            hashes.append(previous)

        def pages(pool: _Pool, hit: int) -> list[int] | None:
            """The group's pages for a hit of `hit` pages (-1 where it needs none), or None."""
            start = self._window_start(pool, hit)
            found = [pool.cached(hashes[i], chunks[i]) for i in range(start, hit)]
            return None if None in found else [-1] * start + found

        hit = 0
        while hit < usable and self.pools[0].cached(hashes[hit], chunks[hit]) is not None:
            hit += 1
        while hit and any(pages(pool, hit) is None for pool in self.pools[1:]):
            hit -= 1  # a sliding group lacks the window before this point: try a shorter prefix
        for pool, table in zip(self.pools, tables):
            for page in pages(pool, hit) if hit else []:
                if page >= 0:
                    pool.share(page)
                table.append(page)
        seq.num_hashed_pages, seq.last_page_hash = hit, hashes[hit - 1] if hit else None
        seq.num_computed_tokens = hit * self.page_size
        self.prefix_hits += seq.num_computed_tokens
        return seq.num_computed_tokens

    def cache_full_pages(self, seq: Sequence) -> None:
        """Registers the pages of `seq` that have become full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        tables = self._tables(seq)
        full = min(seq.num_computed_tokens // self.page_size, len(tables[0]))
        if seq.num_hashed_pages >= full:
            return
        tokens = seq.token_ids()
        for i in range(seq.num_hashed_pages, full):
            chunk = tuple(tokens[i * self.page_size:(i + 1) * self.page_size])
            h = self._chain(seq.last_page_hash, chunk)
            for pool, table in zip(self.pools, tables):
                if i < len(table) and table[i] >= 0:
                    pool.register(table[i], h, chunk)
            seq.last_page_hash = h
        seq.num_hashed_pages = full
