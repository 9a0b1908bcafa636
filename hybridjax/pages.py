"""The KV page pool, host side: which pages are free, who holds each one.

The engine keeps every attention layer's KV in one pool of fixed-size pages on the device
(`hybridjax.cache.PagedKV`, `[P, S, Hkv, Dh]` per layer); this module only does the
bookkeeping. A page has holders: the slot whose row names it in its page table, and every
snapshot that names it. It returns to the free list when the last holder lets go.

The write-once rule makes sharing safe: a row writes only its own pages, at positions at or
past its length, so a page that is full is never written again; a snapshot names the full
pages of its row (shared, by id) and a private copy of a partial last page. Many snapshots of
one conversation then hold one copy of its KV.

Page size: 64 tokens by default. Smaller pages waste less of a partial page and copy less when a
snapshot ends mid-page, but the cost a snapshot pays is dominated by the recurrent (GDN) state,
which is per snapshot whatever the page size (on the 0.3B benchmark model: 2.6 MB of GDN state
against 0.4 MB for a whole 64-token page of KV); larger pages mean fewer gathers per attention
block on CPU and tensor-core sized tiles (64 keys x head_dim) for a GPU kernel.
"""

from __future__ import annotations

import threading

import numpy as np

from hybridjax.config import FULL

DEFAULT_PAGE_SIZE = 64


def page_bytes(cfg, page_size: int, dtype, mtp: bool = False) -> int:
    """Bytes of one page over every attention layer (k and v); mtp: and the MTP layer's (a
    speculative engine keeps its KV in pages of the same ids)."""
    n_attn = sum(t == FULL for t in cfg.layer_types) + int(mtp)
    return 2 * n_attn * page_size * cfg.num_key_value_heads * cfg.head_dim * np.dtype(dtype).itemsize


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


class PoolExhausted(Exception):
    """Not enough free pages (after evicting what could be evicted)."""


class PagePool:
    """Free list and reference counts of `num_pages` pages of `page_size` tokens.

    Thread-safe: the engine thread allocates and releases; the snapshot store (which releases on
    eviction) may run on HTTP threads too.
    """

    def __init__(self, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE):
        if num_pages < 1 or page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page pool: need >= 1 page and a power-of-two page size, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._refs = np.zeros(num_pages, np.int32)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low ids first
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    def alloc(self, n: int) -> list[int]:
        """n fresh pages, each held once by the caller; PoolExhausted if fewer are free."""
        with self._lock:
            if n > len(self._free):
                raise PoolExhausted(f"{n} pages wanted, {len(self._free)} free")
            ids = [self._free.pop() for _ in range(n)]
            self._refs[ids] = 1
            return ids

    def retain(self, ids) -> None:
        """One more hold on each of `ids` (all held already). Vectorised: a snapshot at 30k tokens
        names ~470 pages, and a per-page Python loop cost ~0.2 ms per snapshot and admission."""
        ids = _id_array(ids)
        with self._lock:
            bad = ids[self._refs[ids] <= 0]
            if len(bad):
                raise ValueError(f"page {bad[0]} is free; only a held page can be retained")
            np.add.at(self._refs, ids, 1)

    def release(self, ids) -> None:
        """One hold fewer on each of `ids`; a page nobody holds any more goes back to the free list
        (in the order the per-page loop freed them: a page at its last occurrence in `ids`).
        Checked before anything changes."""
        ids = _id_array(ids)
        with self._lock:
            pages, counts = np.unique(ids, return_counts=True)
            bad = pages[self._refs[pages] < counts]
            if len(bad):
                raise ValueError(f"page {bad[0]} released more often than held")
            np.subtract.at(self._refs, ids, 1)
            self._free.extend(freed_order(ids, self._refs).tolist())

    def reset(self) -> None:
        """Every page free again (after a failure that lost the device pool)."""
        with self._lock:
            self._refs[:] = 0
            self._free = list(range(self.num_pages - 1, -1, -1))


def _id_array(ids) -> np.ndarray:
    """Page ids as a 1-d int64 array (a list, tuple or array of ints; empty allowed)."""
    return np.asarray(ids, np.int64).reshape(-1)


def freed_order(ids: np.ndarray, refs: np.ndarray) -> np.ndarray:
    """The ids of `ids` whose count `refs` is now 0, each once, ordered by its last occurrence in
    `ids` (where a one-page-at-a-time release would have freed it)."""
    last = len(ids) - 1 - np.unique(ids[::-1], return_index=True)[1]  # last occurrence of each id
    last = np.sort(last)
    out = ids[last]
    return out[refs[out] == 0]
