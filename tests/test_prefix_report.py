"""The cache report (hybridjax.prefix_report) and the eviction policy (hybridjax.eviction), on the
snapshot store alone: no model calls, caches are small arrays, logits a few floats."""

from __future__ import annotations

import numpy as np
import pytest

from hybridjax.pages import PagePool
from hybridjax.prefix_cache import SnapshotStore
from hybridjax.prefix_report import CACHE_OFF, EvictionRecord

STATE = 4096  # floats of "recurrent state" per snapshot: a fixed cost, as a hybrid model's GDN state


def state():
    return {"gdn": np.zeros((STATE,), np.float32)}


def logits():
    return np.zeros((4,), np.float32)


def put(s: SnapshotStore, tokens, kind="prompt", ns=""):
    return s.insert(list(tokens), state(), logits(), namespace=ns, kind=kind)


def report(s: SnapshotStore, tokens, ns=""):
    hit = s.lookup(list(tokens), ns)
    return hit.report.as_dict()


A = list(range(100, 140))  # 40 tokens


def test_reasons_hit_and_new_prefix():
    s = SnapshotStore("m")
    assert report(s, A) == {"matched_tokens": 0, "source": "none", "reason": "new_prefix"}
    put(s, A)
    assert report(s, A) == {"matched_tokens": 40, "source": "prompt", "reason": "hit"}  # exact repeat
    put(s, A + [7, 8], kind="response")
    # The next turn: everything the store has in common with it was reused, the rest is new.
    assert report(s, A + [7, 8, 9, 10]) == {"matched_tokens": 42, "source": "response", "reason": "hit"}
    assert report(s, [1, 2, 3])["reason"] == "new_prefix"


def test_reasons_diverged_and_below_checkpoint_grid():
    s = SnapshotStore("m")
    put(s, A)
    edited = A[:25] + [1] + A[26:]
    assert report(s, edited) == {"matched_tokens": 0, "source": "none", "reason": "diverged_at:25"}
    grid = SnapshotStore("m")
    grid.checkpoint_interval = 16
    put(grid, A[:16], kind="checkpoint")
    put(grid, A[:32], kind="checkpoint")
    put(grid, A)
    # Shares 25 tokens; the grid point at or below is 16: a finer grid would reuse more.
    assert report(grid, edited) == {"matched_tokens": 16, "source": "checkpoint", "reason": "below_checkpoint_grid"}
    # Without the grid point the same divergence is just a divergence.
    grid.checkpoint_interval = 0
    assert report(grid, edited)["reason"] == "diverged_at:25"


def test_reason_evicted_and_forgotten_when_stored_again():
    s = SnapshotStore("m", max_entries=1, policy="lru")
    put(s, A)
    put(s, [1, 2, 3])  # evicts A (the entry bound; the least recently used)
    assert s.stats()["evictions_entries"] == 1
    assert report(s, A + [5]) == {"matched_tokens": 0, "source": "none", "reason": "evicted"}
    put(s, A)  # back: no longer reported as evicted
    assert report(s, A + [5])["reason"] == "hit"


def test_the_eviction_record_keeps_a_copy_not_the_request_array_it_viewed():
    from hybridjax.token_ids import Tokens, frozen_ids

    long_prompt = frozen_ids(list(range(1000)))
    record = EvictionRecord(max_tokens=10)
    record.add("ns", Tokens(long_prompt, 3).array)  # 3 tokens counted: must not hold 1000
    (_, kept), = record._items
    assert kept.base is None and kept.tolist() == [0, 1, 2] and record.longest_prefix("ns", long_prompt) == 3


def test_superseded_entries_are_not_reported_as_evicted():
    s = SnapshotStore("m")
    put(s, A[:20])
    put(s, A)  # supersedes A[:20]
    assert s.stats()["evictions_superseded"] == 1
    assert report(s, A[:20] + [9]) == {"matched_tokens": 0, "source": "none", "reason": "diverged_at:20"}


def test_reason_other_namespace_only_within_one_tenant():
    s = SnapshotStore("m")
    put(s, A, ns="key1:salt-a")
    assert report(s, A + [5], ns="key1:salt-b")["reason"] == "other_namespace"  # same key, another salt
    # Another key's prompts are never hinted at: to key2 this is a new prefix.
    assert report(s, A + [5], ns="key2:")["reason"] == "new_prefix"


def test_cache_off_report_and_labels():
    assert CACHE_OFF.as_dict() == {"matched_tokens": 0, "source": "none", "reason": "cache_off"}
    s = SnapshotStore("m")
    put(s, A)
    assert s.lookup(A[:10] + [0]).report.label == "diverged"


def test_eviction_record_is_bounded_by_tokens():
    r = EvictionRecord(max_tokens=100)
    for i in range(5):
        r.add("", np.arange(i * 1000, i * 1000 + 40))
    assert len(r) == 2  # 40 + 40 <= 100 < 120
    assert r.longest_prefix("", np.arange(4000, 4050)) == 40
    assert r.longest_prefix("", np.arange(0, 50)) == 0  # forgotten


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="eviction policy"):
        SnapshotStore("m", policy="fifo")


# --- the eviction policy on a small replay -----------------------------------------------------
PAGE = 16


def replay(policy: str) -> tuple[SnapshotStore, int]:
    """An agent whose context grows from 320 tokens by 32 a turn, with 4 one-off prompts of 32
    tokens between its turns, under a budget that holds the agent context and two one-offs. Per
    snapshot a fixed 16 KB of recurrent state (as in a hybrid model) plus 1 KB per 16-token page.
    Returns the store and the prefill tokens its hits saved."""
    pool = PagePool(4096, PAGE)
    s = SnapshotStore("m", max_bytes=80_000, policy=policy)
    s.use_pages(pool, 1024)
    saved = 0
    one_off = iter(range(10_000, 10**6, 32))

    def request(tokens):
        nonlocal saved
        hit = s.lookup(tokens)
        saved += hit.reused
        pages = pool.alloc(-(-len(tokens) // PAGE))  # the request's pages; the snapshot holds them after
        s.insert(tokens, state(), logits(), kind="prompt", pages=pages)
        pool.release(pages)

    for turn in range(6):
        request(list(range(1000, 1320 + 32 * turn)))
        for _ in range(4):
            start = next(one_off)
            request(list(range(start, start + 32)))
    return s, saved


def test_gdsf_keeps_the_long_agent_context_that_lru_drops():
    lru, lru_saved = replay("lru")
    gdsf, gdsf_saved = replay("gdsf")
    agent = tuple(range(1000, 1320 + 32 * 5))
    assert agent not in {x.tokens for x in lru.snapshots()}  # LRU: the one-offs after it pushed it out
    assert agent in {x.tokens for x in gdsf.snapshots()}
    assert lru_saved == 0  # every agent turn was a miss (one-offs never repeat)
    assert gdsf_saved == sum(320 + 32 * t for t in range(5))  # every later agent turn reused the previous whole
    assert gdsf.nbytes <= 80_000 and lru.nbytes <= 80_000
