"""The snapshot store alone: lookup rules, budgets and eviction, supersession, persistence,
and the helpers that choose snapshot points. No model calls: caches are tiny `init_cache`
values (or any pytrees of arrays), logits small arrays, time a fake clock."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.cache import init_cache, nbytes
from hybridjax.default_model import tiny_test_model
from hybridjax.prefix_cache import FILE_SUFFIX, MAGIC, SnapshotStore, history_boundary
from hybridjax.scheduler import checkpoint_positions

VOCAB = 8  # logits length: only their bytes and values matter here


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def cfg():
    return tiny_test_model()[0]


@pytest.fixture(scope="module")
def tok():
    return tiny_test_model()[2]


def make_cache(cfg, fill: float = 0.0):
    """A fresh batch-of-one cache (every leaf its own buffer), optionally filled with a value."""
    c = init_cache(cfg, 1, 64)
    return jax.tree_util.tree_map(lambda x: x + jnp.asarray(fill, x.dtype), c) if fill else c


def logits(v: float = 0.0):
    return jnp.full((VOCAB,), v, jnp.float32)


def tiny(v: float = 0.0):
    """A minimal cache-like pytree (the store accepts any pytree of arrays)."""
    return {"a": jnp.full((4,), v, jnp.float32), "b": jnp.full((2, 2), v, jnp.float32)}


TINY_BYTES = 4 * 4 + 4 * 4 + VOCAB * 4  # tiny() leaves + logits


# --- lookup ---------------------------------------------------------------------------


def test_longest_exact_prefix_wins_and_diverging_is_never_returned():
    s = SnapshotStore("m")
    # checkpoint kind: nothing is superseded, all four stay
    for toks in ([1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9]):
        s.insert(toks, tiny(len(toks)), logits(len(toks)), kind="checkpoint")
    assert len(s) == 4

    h = s.lookup([1, 2, 3, 4, 5, 7])  # [1,2,3,4,5,6] diverges at 5, [1,2,3,9,9] at 3
    assert h.snapshot.tokens == (1, 2, 3, 4) and h.reused == 4 and h.request_len == 6 and not h.exact

    h = s.lookup([1, 2, 3, 9])  # the longer [1,2,3,9,9] is not a prefix of a shorter request
    assert h.snapshot.tokens == (1, 2) and h.reused == 2

    h = s.lookup([1, 2, 3, 4])
    assert h.exact and h.snapshot.tokens == (1, 2, 3, 4)
    np.testing.assert_array_equal(np.asarray(h.snapshot.logits), np.full(VOCAB, 4.0))

    h = s.lookup([2, 1, 2])  # shares tokens but not a prefix
    assert h.snapshot is None and h.reused == 0 and not h.exact

    h = s.lookup([1])  # shorter than every snapshot
    assert h.snapshot is None


def test_lookup_many_is_one_pass_with_per_request_results():
    s = SnapshotStore("m")
    s.insert([1, 2, 3], tiny(), logits(), namespace="a", kind="checkpoint")
    s.insert([4, 5], tiny(), logits(), namespace="b", kind="checkpoint")
    hits = s.lookup_many([[1, 2, 3, 7], [4, 5], [4, 5, 6], [1, 2, 3]], ["a", "b", "a", "b"])
    assert [h.reused for h in hits] == [3, 2, 0, 0]
    assert [h.exact for h in hits] == [False, True, False, False]


def test_namespace_isolation():
    s = SnapshotStore("m")
    s.insert([1, 2, 3], tiny(), logits(), namespace="a")
    assert s.lookup([1, 2, 3], namespace="a").exact
    for ns in ("b", ""):
        assert s.lookup([1, 2, 3], namespace=ns).snapshot is None
        assert s.lookup([1, 2, 3, 4], namespace=ns).snapshot is None
    s.insert([7], tiny(), logits(), namespace="b")
    assert s.lookup([1, 2, 3], namespace="b").snapshot is None  # "b" has entries, none of "a"'s
    # an identical token sequence in two namespaces is two entries with their own values
    s.insert([1, 2, 3], tiny(5.0), logits(5.0), namespace="b")
    assert len(s) == 3
    assert float(s.lookup([1, 2, 3], namespace="a").snapshot.logits[0]) == 0.0
    assert float(s.lookup([1, 2, 3], namespace="b").snapshot.logits[0]) == 5.0


def test_counters():
    s = SnapshotStore("m")
    s.lookup([1, 2])  # empty namespace
    s.insert([1, 2, 3], tiny(), logits(), kind="checkpoint")
    s.insert([1, 2, 3, 4, 5], tiny(), logits(), kind="checkpoint")
    s.lookup([1, 2, 3, 4, 5])  # exact, 5 reused
    s.lookup([1, 2, 3, 9])  # partial, 3 reused
    s.lookup([9, 9])  # no prefix in a non-empty namespace
    s.lookup([1, 2, 3], namespace="other")  # empty namespace
    st = s.stats()
    assert st["lookups"] == 5
    assert st["hits"] == 2
    assert st["exact_hits"] == 1
    assert st["tokens_reused"] == 8
    assert st["misses_empty_namespace"] == 2
    assert st["misses_no_prefix"] == 1
    assert st["inserts"] == 2 and st["entries"] == 2 and st["bytes"] == s.nbytes == 2 * TINY_BYTES


def test_insert_same_tokens_keeps_one_entry_and_rejects_unknown_kind():
    s = SnapshotStore("m")
    first = s.insert([1, 2], tiny(1.0), logits(1.0))
    again = s.insert([1, 2], tiny(2.0), logits(2.0))
    assert again is first and len(s) == 1 and s.stats()["inserts"] == 1 and s.nbytes == TINY_BYTES
    with pytest.raises(ValueError, match="kind"):
        s.insert([3], tiny(), logits(), kind="bogus")


# --- bytes, entries, TTL ----------------------------------------------------------------


def test_shared_buffers_are_counted_once(cfg):
    s = SnapshotStore("m")
    cache, lg = make_cache(cfg), logits()
    s.insert([1, 2, 3], cache, lg, kind="checkpoint")
    s.insert([4, 5, 6], cache, lg, kind="checkpoint")  # the very same arrays under other tokens
    assert len(s) == 2
    assert s.nbytes == nbytes(cache) + lg.nbytes
    s.insert([7, 8], cache, logits(1.0), kind="checkpoint")  # shares the cache, not the logits
    assert s.nbytes == nbytes(cache) + 2 * lg.nbytes
    # removing one holder keeps the shared buffers counted; removing the last frees them
    s.clear()
    assert s.nbytes == 0 and len(s) == 0 and s.stats()["evictions_cleared"] == 3



def test_page_bytes_count_once_while_any_snapshot_names_the_page(cfg):
    """The store counts a page's bytes once while any snapshot names it, and holds it in the
    pool as often as snapshots name it (random inserts and removals against a recount)."""
    import random

    from hybridjax.pages import PagePool

    rng = random.Random(1)
    pool = PagePool(64, 16)
    s = SnapshotStore("m", max_entries=1000, max_bytes=1 << 40)
    s.use_pages(pool, 1000)
    mine = pool.alloc(64)  # the test's own hold on every page
    cache, lg = make_cache(cfg), logits()
    for step in range(200):
        if rng.random() < 0.6 or not len(s):
            pages = [rng.randrange(64) for _ in range(rng.randint(1, 12))]
            s.insert([step, rng.randrange(5)], cache, lg, kind="checkpoint", pages=pages)
        else:
            snap = rng.choice(s.snapshots())
            s._remove((snap.namespace, snap.key), "entries")
        named = [p for x in s.snapshots() for p in x.pages]
        assert s.pages_held == len(set(named))
        assert s.nbytes == (nbytes(cache) + lg.nbytes if len(s) else 0) + 1000 * len(set(named))
        assert [pool.refcount(p) for p in mine] == [1 + named.count(p) for p in mine]
    s.clear()
    assert s.nbytes == 0 and s.pages_held == 0 and all(pool.refcount(p) == 1 for p in mine)


def test_byte_budget_evicts_least_recently_used(cfg):
    one = nbytes(make_cache(cfg)) + VOCAB * 4
    clock = FakeClock()
    s = SnapshotStore("m", max_bytes=2 * one + 16, clock=clock, policy="lru")
    s.insert([1], make_cache(cfg), logits(), kind="checkpoint")
    s.insert([2], make_cache(cfg), logits(), kind="checkpoint")
    assert s.nbytes == 2 * one
    assert s.lookup([1, 5]).reused == 1  # refreshes [1]: [2] is now the least recently used
    s.insert([3], make_cache(cfg), logits(), kind="checkpoint")
    assert sorted(x.tokens for x in s.snapshots()) == [(1,), (3,)]
    assert s.nbytes == 2 * one <= s.max_bytes
    assert s.stats()["evictions_bytes"] == 1
    s.insert([4], make_cache(cfg), logits(), kind="checkpoint")  # [1] is now the oldest use
    assert sorted(x.tokens for x in s.snapshots()) == [(3,), (4,)]
    assert s.stats()["evictions_bytes"] == 2


def test_shared_buffers_do_not_count_against_the_budget_twice(cfg):
    one = nbytes(make_cache(cfg)) + VOCAB * 4
    s = SnapshotStore("m", max_bytes=one + 16)
    cache, lg = make_cache(cfg), logits()
    s.insert([1], cache, lg, kind="checkpoint")
    s.insert([2], cache, lg, kind="checkpoint")  # fits: the bytes are already held
    assert len(s) == 2 and s.stats().get("evictions_bytes", 0) == 0


def test_max_entries_evicts_least_recently_used():
    s = SnapshotStore("m", max_entries=2, policy="lru")
    s.insert([1], tiny(), logits())
    s.insert([2], tiny(), logits())
    s.lookup([1])
    s.insert([3], tiny(), logits())
    assert sorted(x.tokens for x in s.snapshots()) == [(1,), (3,)]
    assert s.stats()["evictions_entries"] == 1 and len(s) == 2


def test_ttl_expiry_with_a_fake_clock():
    clock = FakeClock(0.0)
    s = SnapshotStore("m", ttl_s=10.0, clock=clock)
    s.insert([1], tiny(), logits())
    clock.t = 5.0
    s.insert([2], tiny(), logits())
    clock.t = 10.0
    assert s.lookup([1]).exact  # age 10: not older than the TTL yet; the hit refreshes it
    clock.t = 16.0
    assert s.lookup([2]).snapshot is None  # age 11: expired, and removed
    assert s.lookup([1]).exact  # used at 10: age 6
    assert s.stats()["evictions_ttl"] == 1 and len(s) == 1
    clock.t = 100.0
    s.insert([3], tiny(), logits())  # insertion expires old entries too
    assert [x.tokens for x in s.snapshots()] == [(3,)]
    assert s.stats()["evictions_ttl"] == 2
    assert s.nbytes == TINY_BYTES


# --- supersession -------------------------------------------------------------------------


def test_a_new_prompt_supersedes_what_it_strictly_extends():
    s = SnapshotStore("m")
    s.insert([1, 2, 3], tiny(), logits(), kind="prompt")
    s.insert([1, 2, 3, 4, 5], tiny(), logits(), kind="response")
    # a response supersedes nothing: the prompt stays for an exact repeat (a retry, a regenerate)
    assert sorted(x.tokens for x in s.snapshots()) == [(1, 2, 3), (1, 2, 3, 4, 5)]
    # the next turn resumes from the response, and its prompt proves the chat moved past both
    assert s.lookup([1, 2, 3, 4, 5, 6, 7]).reused == 5
    s.insert([1, 2, 3, 4, 5, 6, 7], tiny(), logits(), kind="prompt")
    assert [x.tokens for x in s.snapshots()] == [(1, 2, 3, 4, 5, 6, 7)]
    assert s.stats()["evictions_superseded"] == 2 and s.nbytes == TINY_BYTES
    # a prompt never supersedes a longer or a diverging snapshot
    s.insert([1, 2, 3, 4], tiny(), logits(), kind="prompt")
    s.insert([1, 2, 3, 4, 5, 6, 8], tiny(), logits(), kind="prompt")
    assert len(s) == 3


def test_supersession_keeps_snapshots_used_by_others_and_other_namespaces():
    s = SnapshotStore("m")
    s.insert([1, 2, 3], tiny(), logits(), kind="prompt")
    s.lookup([1, 2, 3, 4])
    s.lookup([1, 2, 3, 8])  # two requests resumed from [1,2,3]: it is shared
    s.insert([1, 2, 3, 4], tiny(), logits(), kind="prompt")
    assert sorted(x.tokens for x in s.snapshots()) == [(1, 2, 3), (1, 2, 3, 4)]
    s.insert([7, 8], tiny(), logits(), namespace="a", kind="response")
    s.insert([7, 8, 9], tiny(), logits(), namespace="b", kind="prompt")
    assert s.lookup([7, 8], namespace="a").exact


def test_a_branch_point_survives():
    s = SnapshotStore("m")
    s.insert([1, 2, 3, 7], tiny(), logits(), kind="prompt")  # one continuation of [1,2,3]
    s.insert([1, 2, 3], tiny(), logits(), kind="response")
    s.insert([1, 2, 3, 4], tiny(), logits(), kind="prompt")  # another continuation
    assert sorted(x.tokens for x in s.snapshots()) == [(1, 2, 3), (1, 2, 3, 4), (1, 2, 3, 7)]
    # a snapshot on one path only is still superseded
    s.insert([1, 2, 3, 4, 5], tiny(), logits(), kind="prompt")
    assert sorted(x.tokens for x in s.snapshots()) == [(1, 2, 3), (1, 2, 3, 4, 5), (1, 2, 3, 7)]


def test_history_and_checkpoint_are_never_superseded():
    s = SnapshotStore("m")
    s.insert([1, 2], tiny(), logits(), kind="history")
    s.insert([1, 2, 3], tiny(), logits(), kind="checkpoint")
    s.insert([1, 2, 3, 4], tiny(), logits(), kind="response")
    s.insert([1, 2, 3, 4, 5], tiny(), logits(), kind="prompt")
    assert sorted(x.tokens for x in s.snapshots()) == [(1, 2), (1, 2, 3), (1, 2, 3, 4, 5)]
    kinds = {x.tokens: x.kind for x in s.snapshots()}
    assert kinds[(1, 2)] == "history" and kinds[(1, 2, 3)] == "checkpoint"


# --- persistence --------------------------------------------------------------------------


def _leaves(snap):
    return [np.asarray(x) for x in snap.leaves()]


def test_save_and_load_round_trip(cfg, tmp_path):
    s = SnapshotStore("model-1")
    s.insert([1, 2, 3], make_cache(cfg, 0.25), logits(1.5), namespace="a", kind="prompt")
    s.insert([1, 2], make_cache(cfg, -3.0), logits(-2.0), namespace="b", kind="history")
    s.insert([5, 6, 7, 8], make_cache(cfg, 7.0), jnp.arange(VOCAB, dtype=jnp.float32), kind="checkpoint")
    assert s.save(tmp_path) == 3
    assert len(list(tmp_path.glob("*" + FILE_SUFFIX))) == 3

    t = SnapshotStore("model-1")
    assert t.load(tmp_path) == 3
    want = {(x.namespace, x.tokens): x for x in s.snapshots()}
    got = {(x.namespace, x.tokens): x for x in t.snapshots()}
    assert set(got) == set(want)
    for key, snap in got.items():
        assert snap.kind == want[key].kind
        assert jax.tree_util.tree_structure(snap.cache) == jax.tree_util.tree_structure(want[key].cache)
        assert snap.cache.max_len == want[key].cache.max_len
        for x, y in zip(_leaves(snap), _leaves(want[key])):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes()  # bitwise
    assert t.lookup([1, 2, 3], namespace="a").exact
    assert t.lookup([1, 2, 3], namespace="b").reused == 2
    assert t.nbytes == s.nbytes

    # a later save drops the files of snapshots evicted since
    t.clear()
    t.insert([9], make_cache(cfg), logits(), kind="prompt")
    assert t.save(tmp_path) == 1 and len(list(tmp_path.glob("*" + FILE_SUFFIX))) == 1


def test_another_model_loads_nothing(cfg, tmp_path, caplog):
    s = SnapshotStore("model-1")
    s.insert([1, 2, 3], make_cache(cfg), logits())
    s.save(tmp_path)
    other = SnapshotStore("model-2")
    with caplog.at_level(logging.WARNING, logger="hybridjax.prefix_cache"):
        assert other.load(tmp_path) == 0
    assert len(other) == 0 and "another model" in caplog.text


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _sealed(payload) -> bytes:
    """A file with a valid header and checksum around any pickle: what an attacker who can write
    the directory could make. The checksum is against corruption; the unpickler against this."""
    body = pickle.dumps(payload)
    return MAGIC + hashlib.sha256(body).digest() + body


def test_corrupt_files_are_skipped_with_a_warning(cfg, tmp_path, caplog):
    s = SnapshotStore("model-1")
    s.insert([1, 2, 3], make_cache(cfg), logits(), kind="checkpoint")
    s.insert([4, 5], make_cache(cfg), logits(2.0), kind="checkpoint")
    s.save(tmp_path)
    good, flipped = sorted(tmp_path.glob("*" + FILE_SUFFIX))
    data = bytearray(flipped.read_bytes())
    data[-40] ^= 0x01  # one flipped bit in the stored arrays
    flipped.write_bytes(bytes(data))
    marker = tmp_path / "pwned"
    (tmp_path / ("garbage" + FILE_SUFFIX)).write_bytes(b"\x00\x01not a pickle at all\xff" * 10)
    (tmp_path / ("truncated" + FILE_SUFFIX)).write_bytes(good.read_bytes()[:100])
    (tmp_path / ("evil" + FILE_SUFFIX)).write_bytes(_sealed({"version": 2, "payload": _Evil(marker)}))
    (tmp_path / ("system" + FILE_SUFFIX)).write_bytes(_sealed(os.system))
    (tmp_path / ("list" + FILE_SUFFIX)).write_bytes(_sealed([1, 2, 3]))
    (tmp_path / ("empty" + FILE_SUFFIX)).write_bytes(b"")
    (tmp_path / ("a-directory" + FILE_SUFFIX)).mkdir()

    t = SnapshotStore("model-1")
    with caplog.at_level(logging.WARNING, logger="hybridjax.prefix_cache"):
        assert t.load(tmp_path) == 1  # only the intact one
    assert not marker.exists()
    assert len(t) == 1
    kept = t.snapshots()[0]
    assert t.lookup(list(kept.tokens)).exact
    for name in ("garbage", "truncated", "evil", "system", "list", "empty", flipped.stem):
        assert name + FILE_SUFFIX in caplog.text, name
    assert "forbidden" in caplog.text and "checksum mismatch" in caplog.text
    # a missing directory is not an error, and a directory named like a snapshot breaks nothing
    assert SnapshotStore("model-1").load(tmp_path / "missing") == 0
    assert t.save(tmp_path) == 1


def test_save_writes_owner_only_files_and_deletes_only_its_own(cfg, tmp_path):
    other = SnapshotStore("model-2")
    other.insert([7, 7], make_cache(cfg), logits(), kind="checkpoint")
    other.save(tmp_path)
    theirs = set(tmp_path.glob("*" + FILE_SUFFIX))
    (tmp_path / ("stranger" + FILE_SUFFIX)).write_bytes(b"someone else's file")

    s = SnapshotStore("model-1")
    s.insert([1, 2, 3], make_cache(cfg), logits(), kind="checkpoint")
    s.save(tmp_path)
    ours = set(tmp_path.glob("*" + FILE_SUFFIX)) - theirs - {tmp_path / ("stranger" + FILE_SUFFIX)}
    assert len(ours) == 1
    for path in ours:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # snapshots hold prompts
    s.clear()
    assert s.save(tmp_path) == 0
    left = set(tmp_path.glob("*" + FILE_SUFFIX))
    assert not (ours & left)  # ours, evicted since the last save: deleted
    assert theirs <= left and (tmp_path / ("stranger" + FILE_SUFFIX)) in left  # never another's


# --- where snapshots are taken ------------------------------------------------------------


def test_checkpoint_positions():
    assert checkpoint_positions(0, 50, 16) == [16, 32, 48, 50]
    assert checkpoint_positions(0, 48, 16) == [16, 32, 48]
    assert checkpoint_positions(16, 50, 16) == [32, 48, 50]
    assert checkpoint_positions(17, 50, 16) == [32, 48, 50]
    assert checkpoint_positions(40, 47, 16) == [47]
    assert checkpoint_positions(0, 50, 0) == [50]
    assert checkpoint_positions(10, 40, 0, extra=[5, 10, 20, 40, 99]) == [20, 40]
    assert checkpoint_positions(0, 40, 16, extra=[32, 20]) == [16, 20, 32, 40]


def test_history_boundary_on_a_three_turn_chat(tok):
    chat = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
        {"role": "assistant", "content": "Fine, thanks."},
        {"role": "user", "content": "Bye"},
    ]
    prompt = tok.encode_chat(chat)
    n = history_boundary(tok, chat, prompt)
    history = tok.render_chat(chat[:4], add_generation_prompt=False)
    assert history.endswith("Fine, thanks.<|im_end|>\n")
    assert n == len(tok.encode(history)) and 0 < n < len(prompt)
    assert prompt[:n] == tok.encode(history)
    assert tok.decode(prompt[n:]) == "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"

    # with a system message first the history still ends before the last user message
    sys_chat = [{"role": "system", "content": "Be brief."}] + chat
    assert history_boundary(tok, sys_chat, tok.encode_chat(sys_chat)) == len(
        tok.encode(tok.render_chat(sys_chat[:5], add_generation_prompt=False)))

    assert history_boundary(tok, chat[:1], tok.encode_chat(chat[:1])) is None  # no history
    assert history_boundary(tok, chat, tok.encode("something else entirely, long enough")) is None
    assert history_boundary(tok, [{"role": "assistant", "content": "x"}], [1, 2, 3]) is None


def test_random_operations_keep_lru_order_longest_prefix_and_byte_count():
    """Against a plain model of the store: its LRU order after hits and re-inserts, the longest
    stored prefix on every lookup, and its running byte count equal to a recount."""
    import random

    rng = random.Random(0)
    shared = [tiny(float(i)) for i in range(3)]  # some snapshots share their buffers
    s = SnapshotStore("m", max_entries=12, policy="lru", max_bytes=10 * TINY_BYTES)
    order: list[tuple[int, ...]] = []  # the model: keys, least recently used first
    for _ in range(600):
        base = rng.choice([t for t in order] or [()])
        toks = base[: rng.randint(0, len(base))] + tuple(rng.randint(0, 2) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.5:
            s.insert(list(toks), rng.choice(shared + [tiny(rng.random())]), logits(), kind="checkpoint")
            if toks in order:
                order.remove(toks)
            order.append(toks)
        else:
            hit = s.lookup(np.asarray(toks))
            want = max((t for t in order if toks[: len(t)] == t), key=len, default=None)
            assert (hit.snapshot.tokens if hit.snapshot else None) == want
            if want is not None:
                order.remove(want)
                order.append(want)
        kept = {x.tokens for x in s.snapshots()}
        order = [t for t in order if t in kept]  # evictions take the least recently used
        assert [x.tokens for x in s.snapshots()] == order
        assert s.nbytes == sum(b for _, b, _ in s._buffers.values()) + s.pages_held * s._page_bytes


# --- keys that share one token array ----------------------------------------------------


def test_tokens_keys_compare_by_content_whatever_array_they_share():
    from hybridjax.token_ids import Tokens, frozen_ids

    a, b = frozen_ids([5, 6, 7, 8]), frozen_ids([5, 6, 9])
    assert Tokens(a, 2) == Tokens(b, 2) == Tokens.of([5, 6]) and hash(Tokens(a, 2)) == hash(Tokens.of((5, 6)))
    assert Tokens(a, 3) != Tokens(b, 3) and Tokens(a, 3) != Tokens(a, 2)
    assert Tokens(a, 2).prefix_of(Tokens(b)) and Tokens(a, 1).prefix_of(Tokens(a, 3))
    assert not Tokens(a, 3).prefix_of(Tokens(b)) and not Tokens(a, 3).prefix_of(Tokens(a, 2))
    assert Tokens(a, 3).as_tuple() == (5, 6, 7) and type(Tokens(a).as_tuple()[0]) is int
    with pytest.raises(ValueError):
        Tokens(np.array([1, 2], np.int32))  # writable: its owner could change a stored key


def test_random_operations_on_shared_arrays_match_a_store_of_copies():
    """Keys that are prefixes of a few shared arrays (the engine's checkpoints of one prompt)
    against the same operations with every key a copy of its tokens: the same hits, reports,
    supersessions and evictions, in the same order."""
    import random

    from hybridjax.token_ids import Tokens, frozen_ids

    rng = random.Random(1)
    shared, copied = (SnapshotStore("m", max_entries=10, policy=p) for p in ("lru", "lru"))
    shared.checkpoint_interval = copied.checkpoint_interval = 3
    convs: list[np.ndarray] = []  # the shared arrays: conversations that branch and grow
    for step in range(500):
        if not convs or rng.random() < 0.15:
            old = rng.choice(convs).tolist() if convs and rng.random() < 0.7 else []
            tail = [rng.randint(0, 2) for _ in range(rng.randint(1, 9))]
            convs.append(frozen_ids(old[: rng.randint(0, len(old))] + tail))
        conv = rng.choice(convs)
        key = Tokens(conv, rng.randint(1, len(conv)))
        ns = rng.choice(["a:x", "a:y", "b:x"])
        if rng.random() < 0.5:
            kind = rng.choice(["prompt", "response", "checkpoint", "history"])
            for s, k in ((shared, key), (copied, key.as_tuple())):
                s.insert(k, tiny(step), logits(), namespace=ns, kind=kind)
        else:
            hits = [s.lookup(k, ns) for s, k in ((shared, key), (copied, list(key.as_tuple())))]
            assert [(h.reused, h.report, h.snapshot and h.snapshot.kind) for h in hits[:1]] == \
                   [(h.reused, h.report, h.snapshot and h.snapshot.kind) for h in hits[1:]], step
        assert [(x.namespace, x.tokens, x.kind) for x in shared.snapshots()] == \
               [(x.namespace, x.tokens, x.kind) for x in copied.snapshots()], step
    assert shared.counters == copied.counters and shared.counters["evictions_superseded"] > 0
