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

A model with linear-attention layers also keeps a recurrent state per sequence, in one of
`num_slots` live slots (`Sequence.state_slot`): taken with the sequence's first pages, given back
with them (finish, abort, preemption). A sequence that finds no free slot waits, as for pages.
Such a state sums up the whole prefix, so a cached page only helps a hybrid model together with
a snapshot of the state at its end: `num_snapshot_slots` more slots of the same pools hold
snapshots, keyed by the chained hash of the page they end at, handed out least recently used
first and never shared (a hit copies the snapshot into the sequence's own slot). A snapshot is
taken when a call leaves a sequence's computed tokens at a snapshot point (`is_snapshot_point`:
every `snapshot_interval` pages, and the last page boundary before the prompt's last token); the
scheduler ends calls there (`next_snapshot_point`). The block manager only queues the slot copies
(snapshot and hit alike); the runner makes them, in order, before the next model call
(`take_copies`), so a copy always reads its source before any later call overwrites it.
"""

from __future__ import annotations

from collections import OrderedDict, deque

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


# The fewest pages between the recurrent-state snapshots taken along a sequence (256 tokens at
# the default page size of 16; `LLM` uses a full prefill chunk when that is more). A hit then
# recomputes at most this many pages that are cached already, a long prompt's prefill is cut
# into calls of at least this many pages (still hundreds of tokens each: the matmuls stay
# compute-bound), and a long prefix costs few snapshot slots, which are big (a sequence's whole
# recurrent state each). The prompt's own last page boundary always gets one (a repeated prompt,
# n > 1 siblings and the next turn of a chat reuse it).
SNAPSHOT_INTERVAL = 16


class BlockManager:
    """num_pages: one pool size, or one per page group (`windows`: each group's sliding window,
    None for the group of full-context layers). num_slots: live recurrent-state slots (slot ids
    0 .. num_slots - 1; 0: the model has no linear-attention layers); num_snapshot_slots: the
    snapshot slots after them (ids num_slots ..), used while prefix caching is on;
    snapshot_interval: pages between the snapshots along a sequence. first_slot moves the slot
    ids, live and snapshot alike (`DataParallelBlockManager`: each rank's own block of the
    pools)."""

    def __init__(self, num_pages: int | list[int] | tuple[int, ...], page_size: int,
                 enable_prefix_caching: bool = True, windows: tuple[int | None, ...] = (None,),
                 num_slots: int = 0, num_snapshot_slots: int = 0, snapshot_interval: int = SNAPSHOT_INTERVAL,
                 first_slot: int = 0):
        sizes = [num_pages] if isinstance(num_pages, int) else list(num_pages)
        if len(sizes) != len(windows):
            raise ValueError(f"{len(sizes)} pool sizes for {len(windows)} page groups")
        if min(sizes) < 1 or page_size < 1:
            raise ValueError(f"need at least one page of one token per group, got {sizes} pages of {page_size}")
        if num_slots < 0 or num_snapshot_slots < 0 or snapshot_interval < 1:
            raise ValueError(f"need num_slots >= 0, num_snapshot_slots >= 0 and snapshot_interval >= 1, got "
                             f"{num_slots}, {num_snapshot_slots} and {snapshot_interval}")
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [_Pool(n, w) for n, w in zip(sizes, windows)]
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(first_slot, first_slot + num_slots))
        self.num_snapshot_slots = num_snapshot_slots
        self.snapshot_interval = snapshot_interval
        # snapshot slot -> hash of the page its state ends at (None: empty), least recently used first
        first_snapshot = first_slot + num_slots
        self._snapshots: OrderedDict[int, int | None] = OrderedDict(
            (slot, None) for slot in range(first_snapshot, first_snapshot + num_snapshot_slots))
        self._snapshot_of: dict[int, int] = {}  # page hash -> the snapshot slot holding the state there
        self._copies: list[tuple[int, int]] = []  # (source slot, destination slot), in the order they must run

    @property
    def num_state_slots(self) -> int:
        """Every recurrent-state slot the cache must have: the live ones, then the snapshots."""
        return self.num_slots + self.num_snapshot_slots

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    @property
    def num_snapshots(self) -> int:
        """Snapshot slots holding a snapshot."""
        return len(self._snapshot_of)

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

    def shares_pages(self, seq: Sequence, other: Sequence) -> bool:
        """Whether freeing `other`'s pages could make room for `seq` (one pool: always)."""
        return True

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

    def has_slot_for(self, seq: Sequence) -> bool:
        """Whether `seq` holds a recurrent-state slot or can get one (always, without such layers)."""
        return not self.num_slots or seq.state_slot >= 0 or bool(self.free_slots)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `allocate(seq, num_tokens)` would succeed: pages, and a state slot if it needs one."""
        want = self.pages_for(num_tokens)
        return self.has_slot_for(seq) and all(max(0, want - len(table)) <= len(pool.free)
                                              for pool, table in zip(self.pools, self._tables(seq)))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grows `seq`'s block tables with fresh pages to hold `num_tokens` tokens, and gives it a
        recurrent-state slot if the model has such state and it holds none yet."""
        if not self.has_slot_for(seq):
            raise RuntimeError(f"out of recurrent-state slots: all {self.num_slots} are in use")
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError(f"out of KV pages: need {self.pages_needed(seq, num_tokens)}, have "
                               f"{[len(p.free) for p in self.pools]}")
        want = self.pages_for(num_tokens)
        for pool, table in zip(self.pools, self._tables(seq)):
            while len(table) < want:
                table.append(pool.take())
        if self.num_slots and seq.state_slot < 0:
            seq.state_slot = self.free_slots.popleft()

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
        """Gives back `seq`'s pages and its state slot (finish, abort, preemption); it would start
        again from position 0. A state snapshot already queued from its slot still reads it
        first: the runner makes queued copies before the next call. A sequence that ended in a
        fault (finish_reason "error": non-finite logits) leaves nothing in the prefix cache: its
        K/V may be garbage."""
        faulted = seq.finish_reason == "error"
        if not faulted:
            self.cache_full_pages(seq)  # what it computed stays reusable after it finishes
        for pool, table in zip(self.pools, self._tables(seq)):
            for page in reversed(table):  # the prefix's first pages are reused last
                if page >= 0:
                    if faulted:
                        pool.forget(page)
                    pool.release(page)
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1
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
        With recurrent state, a hit of h pages needs a snapshot of the state after them and a
        free slot: `seq` takes the slot, and the copy snapshot -> slot is queued.
        """
        tables = self._tables(seq)
        if (not self.enable_prefix_caching or any(tables) or seq.num_computed_tokens
                or seq.params.prompt_logprobs is not None):
            return 0
        self.prefix_queries += seq.num_tokens
        chunks, hashes = self.prefix_hashes(seq)
        hit = self.cached_prefix(seq, chunks, hashes)
        if hit and self.num_slots:
            snapshot = self._snapshot_of[hashes[hit - 1]]
            self._snapshots.move_to_end(snapshot)
            if seq.state_slot < 0:
                seq.state_slot = self.free_slots.popleft()
            self._copies.append((snapshot, seq.state_slot))
        for pool, table in zip(self.pools, tables):
            for page in self._group_pages(pool, hit, chunks, hashes) if hit else []:
                if page >= 0:
                    pool.share(page)
                table.append(page)
        seq.num_hashed_pages, seq.last_page_hash = hit, hashes[hit - 1] if hit else None
        seq.num_computed_tokens = hit * self.page_size
        self.prefix_hits += seq.num_computed_tokens
        return seq.num_computed_tokens

    def prefix_hashes(self, seq: Sequence) -> tuple[list[tuple[int, ...]], list[int]]:
        """The full pages of `seq`'s tokens that a prefix hit may cover (all but the page holding
        its last token) and their chained hashes."""
        tokens = seq.token_ids()
        chunks, hashes, previous = [], [], None
        for i in range((len(tokens) - 1) // self.page_size):
            chunks.append(tuple(tokens[i * self.page_size:(i + 1) * self.page_size]))
            previous = self._chain(previous, chunks[-1])
            hashes.append(previous)
        return chunks, hashes

    def _group_pages(self, pool: _Pool, hit: int, chunks: list, hashes: list[int]) -> list[int] | None:
        """A group's pages for a hit of `hit` pages (-1 where it needs none), or None."""
        start = self._window_start(pool, hit)
        found = [pool.cached(hashes[i], chunks[i]) for i in range(start, hit)]
        return None if None in found else [-1] * start + found

    def cached_prefix(self, seq: Sequence, chunks: list, hashes: list[int]) -> int:
        """How many leading pages (of `prefix_hashes`) `match_prefix` would reuse; changes nothing."""
        hit = 0
        while hit < len(chunks) and self.pools[0].cached(hashes[hit], chunks[hit]) is not None:
            hit += 1
        while hit and (any(self._group_pages(pool, hit, chunks, hashes) is None for pool in self.pools[1:])
                       or (self.num_slots and hashes[hit - 1] not in self._snapshot_of)):
            hit -= 1  # a sliding group lacks the window, or the state its snapshot: try a shorter prefix
        if hit and not self.has_slot_for(seq):
            hit = 0  # it waits for a slot anyway, and looks again then
        return hit

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

    # ----- recurrent-state snapshots -----

    @property
    def takes_snapshots(self) -> bool:
        return self.enable_prefix_caching and self.num_slots > 0 and self.num_snapshot_slots > 0

    def _prompt_point(self, seq: Sequence) -> int:
        """The last page boundary before the prompt's last token: the longest hit a request with
        the same prompt can take (`match_prefix` leaves the last token to compute)."""
        return (seq.num_prompt_tokens - 1) // self.page_size * self.page_size

    def is_snapshot_point(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq`'s state after its first `num_tokens` tokens is worth a snapshot: at every
        `snapshot_interval` pages, and at the prompt's last page boundary before its last token."""
        if not self.takes_snapshots or num_tokens <= 0 or num_tokens % self.page_size:
            return False
        return (num_tokens // self.page_size) % self.snapshot_interval == 0 or num_tokens == self._prompt_point(seq)

    def next_snapshot_point(self, seq: Sequence, start: int) -> int | None:
        """The first snapshot point after `start` tokens (None: snapshots are off): a call that
        feeds `seq`'s tokens from position `start` on ends there at the latest."""
        if not self.takes_snapshots:
            return None
        step = self.snapshot_interval * self.page_size
        point = (start // step + 1) * step
        prompt = self._prompt_point(seq)
        return prompt if start < prompt < point else point

    def snapshot(self, seq: Sequence) -> None:
        """After a call: queues a copy of `seq`'s state into a snapshot slot (evicting the least
        recently used snapshot) when its computed tokens end at a snapshot point that has none.
        The slot must hold the state after exactly `seq.num_computed_tokens` tokens."""
        n = seq.num_computed_tokens
        if seq.state_slot < 0 or not self.is_snapshot_point(seq, n):
            return
        self.cache_full_pages(seq)
        if seq.num_hashed_pages != n // self.page_size:
            return
        h = seq.last_page_hash
        if h in self._snapshot_of:
            self._snapshots.move_to_end(self._snapshot_of[h])
            return
        slot, evicted = self._snapshots.popitem(last=False)
        if evicted is not None:
            del self._snapshot_of[evicted]
        self._snapshots[slot] = h
        self._snapshot_of[h] = slot
        self._copies.append((seq.state_slot, slot))

    def take_copies(self) -> list[list[tuple[int, int]]]:
        """The queued slot copies (source, destination), emptying the queue, in waves to run one
        after another before the next model call. A wave reads all its sources before writing
        (`Cache.copy_slots`), so a copy that reads or writes a slot an earlier copy of the wave
        writes starts a new wave; one that overwrites a slot an earlier copy reads may share it."""
        waves: list[list[tuple[int, int]]] = []
        written: set[int] = set()
        for src, dst in self._copies:
            if not waves or src in written or dst in written:
                waves.append([])
                written = set()
            waves[-1].append((src, dst))
            written.add(dst)
        self._copies = []
        return waves


def _on_rank(name: str):
    """The `BlockManager` method `name`, run by the rank `seq` lives on."""
    def method(self, seq: Sequence, *args):
        return getattr(self.rank_of(seq), name)(seq, *args)

    method.__name__ = name
    method.__doc__ = f"`BlockManager.{name}` on the rank `seq` lives on."
    return method


class DataParallelBlockManager:
    """Data-parallel attention's page bookkeeping: one `BlockManager` per data-parallel rank,
    each over that rank's own shard of every pool (the pools are split along their pages over
    the "dp" mesh axis, `sharding.cache_shardings`, so page ids are local: 0 .. num_pages - 1 on
    every rank) and its own block of the recurrent-state slots, rank-major (rank r: live slots
    r * (num_slots + num_snapshot_slots) .., then its snapshot slots), so the state pools split
    over "dp" along their slots the same way (`sharding.cache_shardings`); the ids stay global
    (the XLA programs index the whole pool; the megakernel makes them local,
    `sharding.local_slots`). A sequence lives on one
    rank (`Sequence.dp_rank`) from its first page to its last: its rows of every batch are that
    rank's rows (`batch.build`), and its prefix hits come from that rank's cache.

    A sequence that holds nothing is placed when it looks up its prefix (`match_prefix`): on the
    rank holding the fewest sequences, then the one with the longest cached prefix for it, then
    the most free pages. Placing by load first keeps every rank's share of a batch within
    ceil(max_num_seqs / num_ranks) rows, so the batch shapes stay the one-device ones times the
    ranks; the prefix breaks ties (a chat's next turn on an idle server finds its history).
    Sizes (num_pages, num_slots, num_snapshot_slots) are per rank."""

    def __init__(self, num_ranks: int, num_pages: int | list[int] | tuple[int, ...], page_size: int,
                 enable_prefix_caching: bool = True, windows: tuple[int | None, ...] = (None,),
                 num_slots: int = 0, num_snapshot_slots: int = 0, snapshot_interval: int = SNAPSHOT_INTERVAL):
        if num_ranks < 1:
            raise ValueError(f"need at least one data-parallel rank, got {num_ranks}")
        self.ranks = [BlockManager(num_pages, page_size, enable_prefix_caching, windows, num_slots, num_snapshot_slots,
                                   snapshot_interval, first_slot=r * (num_slots + num_snapshot_slots))
                      for r in range(num_ranks)]
        self._holders: list[set[int]] = [set() for _ in range(num_ranks)]  # seq ids holding pages or a slot

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.ranks[0].enable_prefix_caching

    def rank_of(self, seq: Sequence) -> BlockManager:
        if seq.dp_rank < 0:
            seq.dp_rank = self._place(seq)
        return self.ranks[seq.dp_rank]

    def _place(self, seq: Sequence) -> int:
        first = self.ranks[0]
        hashes = first.prefix_hashes(seq) if first.enable_prefix_caching else ([], [])

        def key(r: int) -> tuple[int, int, int]:
            bm = self.ranks[r]
            return len(self._holders[r]), -bm.cached_prefix(seq, *hashes), -len(bm.pools[0].free)

        return min(range(self.num_ranks), key=key)

    def _track(self, seq: Sequence) -> None:
        holders = self._holders[seq.dp_rank]
        if any(seq.block_tables) or seq.state_slot >= 0:
            holders.add(seq.seq_id)
        else:
            holders.discard(seq.seq_id)

    def match_prefix(self, seq: Sequence) -> int:
        """`BlockManager.match_prefix` on the rank `seq` goes to (placed anew if it holds nothing)."""
        if not any(seq.block_tables) and seq.state_slot < 0:
            seq.dp_rank = -1
        hit = self.rank_of(seq).match_prefix(seq)
        self._track(seq)
        return hit

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        self.rank_of(seq).allocate(seq, num_tokens)
        self._track(seq)

    def free(self, seq: Sequence) -> None:
        """Frees `seq`'s pages and slot on its rank; it is placed again when it next starts."""
        if seq.dp_rank >= 0:
            self.ranks[seq.dp_rank].free(seq)
            self._holders[seq.dp_rank].discard(seq.seq_id)
        seq.dp_rank = -1

    def shares_pages(self, seq: Sequence, other: Sequence) -> bool:
        return seq.dp_rank == other.dp_rank

    holds_only = _on_rank("holds_only")
    pages_needed = _on_rank("pages_needed")
    has_slot_for = _on_rank("has_slot_for")
    can_allocate = _on_rank("can_allocate")
    trim = _on_rank("trim")
    release_outside_window = _on_rank("release_outside_window")
    cache_full_pages = _on_rank("cache_full_pages")
    is_snapshot_point = _on_rank("is_snapshot_point")
    next_snapshot_point = _on_rank("next_snapshot_point")
    snapshot = _on_rank("snapshot")

    def pages_for(self, num_tokens: int) -> int:
        return self.ranks[0].pages_for(num_tokens)

    def take_copies(self) -> list[list[tuple[int, int]]]:
        """Every rank's queued slot copies, wave i of each rank in wave i (their slots are disjoint)."""
        merged: list[list[tuple[int, int]]] = []
        for waves in (bm.take_copies() for bm in self.ranks):
            for i, wave in enumerate(waves):
                if i == len(merged):
                    merged.append([])
                merged[i].extend(wave)
        return merged

    @property
    def page_size(self) -> int:
        return self.ranks[0].page_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self.ranks[0].enable_prefix_caching

    @property
    def takes_snapshots(self) -> bool:
        return self.ranks[0].takes_snapshots

    @property
    def full_context_pages(self) -> int | None:
        """The most one sequence can hold: one rank's (every sequence's pages are on one rank)."""
        return self.ranks[0].full_context_pages

    def _sum(name: str):  # noqa: N805 -- a helper of the class body
        return property(lambda self: sum(getattr(bm, name) for bm in self.ranks),
                        doc=f"`BlockManager.{name}` summed over the ranks.")

    num_pages = _sum("num_pages")
    num_free_pages = _sum("num_free_pages")
    num_slots = _sum("num_slots")
    num_free_slots = _sum("num_free_slots")
    num_snapshot_slots = _sum("num_snapshot_slots")
    num_snapshots = _sum("num_snapshots")
    num_state_slots = _sum("num_state_slots")
    prefix_queries = _sum("prefix_queries")
    prefix_hits = _sum("prefix_hits")
    del _sum
