"""Which snapshot the store evicts first.

"lru": the least recently used. "gdsf" (Greedy-Dual-Size-Frequency, Cherkasova 1998, the web-cache
policy): each snapshot carries a priority

    priority = clock + (1 + hits) * saved_tokens / bytes

set when it is stored and on every hit, and the lowest priority goes first; `clock` rises to each
evicted snapshot's priority, so entries not used for a while age below newer ones. `saved_tokens`
is the prefill a hit on it avoids (its length); `bytes` is what it holds counted as if it shared
nothing (its recurrent state and logits plus its KV pages): a hybrid model's fixed per-snapshot state
makes a thousand one-off prompts cost more per saved token than one long agent context, which LRU
drops first when the one-offs are newer.
"""

from __future__ import annotations

from typing import Mapping

POLICIES = ("gdsf", "lru")


def snapshot_bytes(snap, page_bytes: int) -> int:
    """Bytes `snap` holds, counted as if it shared nothing: its arrays plus its KV pages."""
    return sum(int(x.size) * x.dtype.itemsize for x in snap.leaves()) + len(snap.pages) * page_bytes


def gdsf(clock: float, hits: int, saved_tokens: int, nbytes: int) -> float:
    """The GDSF priority (see the module docstring); the disk tier scores its entries with it too."""
    return clock + (1 + hits) * saved_tokens / max(nbytes, 1)


def priority(snap, clock: float, page_bytes: int) -> float:
    """GDSF priority of `snap` now (see the module docstring)."""
    return gdsf(clock, snap.hits, snap.length, snapshot_bytes(snap, page_bytes))


def victim(entries: Mapping, policy: str):
    """The key to evict from `entries` (in least-recently-used order, oldest first)."""
    if policy == "lru":
        return next(iter(entries))
    # min keeps the first of equal priorities: among equals, the least recently used.
    return min(entries.items(), key=lambda kv: kv[1].priority)[0]
