"""The paged KV pool: paged attention against contiguous attention, the host page pool, pages
shared by snapshots (by id and in the byte count), reference counts, a full pool, persistence,
prefill chunks interleaved with decode steps, and start-up compiling every shape.

Engines use the one configuration of the engine tests (`engine_helpers.ENGINE_KW`: pages of 16
tokens, prefill chunks of 32), so compiled programs are shared with test_engine.py.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import ENGINE_KW, TIMEOUT, cold, collect, covered, enc, ids, run

from hybridjax import ops
from hybridjax.default_model import tiny_test_model
from hybridjax.engine import Engine, GenerationRequest, RequestHandle
from hybridjax.pages import PagePool, PoolExhausted, pages_for
from hybridjax.prefix_cache import SnapshotStore
from hybridjax.pallas_kernels.paged_attention import paged_attention

# --- paged attention == contiguous attention ---------------------------------------------

# float32 throughout: the paged XLA path sums the same products in blocks with an online
# softmax, the contiguous path in one softmax; both accumulate in float32, so they agree to a
# few float32 ulps of values of order 1 (1e-5 leaves room for reduction-order differences).
ATOL = 1e-5


def _paged_problem(lengths, t, page, hq=4, hkv=2, dh=8, seed=0):
    """Contiguous K/V [B, S, Hkv, Dh] and the same data scattered over a shuffled page pool."""
    rng = np.random.default_rng(seed)
    b, cap = len(lengths), max(lengths) + t
    n = pages_for(cap, page)
    k = rng.standard_normal((b, n * page, hkv, dh)).astype(np.float32)
    v = rng.standard_normal((b, n * page, hkv, dh)).astype(np.float32)
    q = rng.standard_normal((b, t, hq, dh)).astype(np.float32)
    pool_pages = b * n + 3  # spare pages hold garbage that must never be read
    order = rng.permutation(pool_pages)[: b * n].reshape(b, n)  # pages out of order
    kp = rng.standard_normal((pool_pages, page, hkv, dh)).astype(np.float32)
    vp = rng.standard_normal((pool_pages, page, hkv, dh)).astype(np.float32)
    for row in range(b):
        for j in range(n):
            kp[order[row, j]] = k[row, j * page:(j + 1) * page]
            vp[order[row, j]] = v[row, j * page:(j + 1) * page]
    q_pos = np.asarray(lengths)[:, None] + np.arange(t)[None]  # the new tokens follow each row's cache
    return q, k, v, kp, vp, order.astype(np.int32), q_pos.astype(np.int32)


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("t", [1, 7])
def test_paged_attention_equals_contiguous(impl, t):
    lengths = [0, 5, 16, 130, 31]  # ragged, empty, exactly a page, many pages, one short of two
    q, k, v, kp, vp, table, q_pos = _paged_problem(lengths, t, page=16)
    want = ops.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_pos), 8**-0.5)
    got = paged_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table), jnp.asarray(q_pos),
                          scale=8**-0.5, implementation=impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=0)


def test_paged_attention_ignores_table_entries_past_a_rows_pages():
    q, k, v, kp, vp, table, q_pos = _paged_problem([3, 40], 2, page=16)
    base = paged_attention(q, kp, vp, table, q_pos, scale=0.3)
    garbage = table.copy()
    garbage[0, 1:] = [kp.shape[0] + 5, 0, 1, 2][: garbage.shape[1] - 1]  # row 0 only needs page 0
    np.testing.assert_array_equal(np.asarray(paged_attention(q, kp, vp, garbage, q_pos, scale=0.3)), np.asarray(base))


def test_paged_write_drops_pads_and_keeps_full_pages():
    pages = jnp.zeros((6, 4, 1, 2))
    table = jnp.asarray([[2, 5, 6], [6, 6, 6]], jnp.int32)  # row 1 owns no pages (id 6 = none)
    new = jnp.ones((2, 5, 1, 2))
    valid = jnp.asarray([[True, True, True, False, False], [True] * 5])
    out = np.asarray(ops.write_kv_paged(pages, new, table, jnp.asarray([3, 0], jnp.int32), valid))
    written = {(p, s) for p in range(6) for s in range(4) if out[p, s].any()}
    assert written == {(2, 3), (5, 0), (5, 1)}  # row 0 at positions 3, 4, 5; its pads and row 1 dropped


# --- the host page pool -------------------------------------------------------------------


def test_page_pool_counts_holders():
    pool = PagePool(4, 16)
    a = pool.alloc(3)
    assert pool.free == 1 and all(pool.refcount(p) == 1 for p in a)
    pool.retain(a[:2])
    pool.release(a)
    assert pool.free == 2 and [pool.refcount(p) for p in a] == [1, 1, 0]
    with pytest.raises(PoolExhausted):
        pool.alloc(3)
    with pytest.raises(ValueError, match="released more often"):
        pool.release([a[2]])
    with pytest.raises(ValueError, match="only a held page"):
        pool.retain([a[2]])
    pool.release(a[:2])
    assert pool.free == 4
    with pytest.raises(ValueError, match="power-of-two"):
        PagePool(4, 12)



def test_page_pool_matches_a_page_at_a_time_reference():
    """retain / release are vectorised: counts, the free list and its order (which pages the next
    alloc gets) stay those of the one-page-at-a-time loop, duplicates in one call included."""
    import random

    rng = random.Random(0)
    for _ in range(100):
        pool, refs, free = PagePool(24, 16), [0] * 24, list(range(23, -1, -1))
        for _ in range(30):
            held = [i for i in range(24) if refs[i] > 0]
            op = rng.random()
            if op < 0.3 and len(free) >= 3:
                want = [free.pop() for _ in range(3)]
                for i in want:
                    refs[i] = 1
                assert pool.alloc(3) == want
            elif op < 0.6 and held:
                got = [rng.choice(held) for _ in range(rng.randint(0, 6))]
                pool.retain(got)
                for i in got:
                    refs[i] += 1
            elif held:
                holds = [i for i in held for _ in range(refs[i])]
                rng.shuffle(holds)
                got = holds[: rng.randint(0, len(holds))]
                pool.release(got)
                for i in got:
                    refs[i] -= 1
                    if refs[i] == 0:
                        free.append(i)
            assert pool._free == free and pool._refs.tolist() == refs
    pool = PagePool(4, 16)
    a = pool.alloc(2)
    with pytest.raises(ValueError, match="released more often"):  # a page twice in one call, held once
        pool.release([a[0], a[1], a[1]])
    assert [pool.refcount(p) for p in a] == [1, 1]  # checked before anything changed


# --- engines ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_test_model()


def _engine(model, **kw):
    cfg, params, tok = model
    return Engine(cfg, params, tok, **{**ENGINE_KW, **kw})


def _idle(eng: Engine, timeout: float = 30.0) -> None:
    """Wait until no slot is busy (a finished row is freed a step after its finish event: the
    step that feeds its last token)."""
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if eng.active_slots == 0:
            return
        done.wait(0.01)
    raise AssertionError("the engine did not go idle")


def _all_free(eng: Engine) -> bool:
    return eng.pool.free == eng.pool.num_pages and all(eng.pool.refcount(p) == 0 for p in range(eng.pool.num_pages))


def test_snapshots_of_one_conversation_share_their_pages(model):
    eng = _engine(model, store=SnapshotStore("pages"), checkpoint_interval=16).start()
    try:
        p1 = ids("Shared pages, turn one......")
        r1 = run(eng, p1, 9)
        p2 = p1 + r1.token_ids + enc("and the second turn")
        r2 = run(eng, p2, 7)
        assert r2.cached_tokens == len(p1) + covered(r1) and r2.token_ids == cold_long(p2, 7)
        _idle(eng)
        snaps = sorted(eng.store.snapshots(), key=lambda s: len(s.tokens))
        assert len(snaps) >= 4  # checkpoints at 16, 32, ..., prompts, responses
        size = eng.pool.page_size
        for short in snaps:
            for long in snaps:
                if len(short.tokens) < len(long.tokens) and long.tokens[: len(short.tokens)] == short.tokens:
                    full = len(short.tokens) // size
                    assert short.pages[:full] == long.pages[:full], (len(short.tokens), len(long.tokens))
        # every page is counted once: bytes = distinct pages + each snapshot's own state and logits
        distinct = {p for s in snaps for p in s.pages}
        own = sum(sum(x.nbytes for x in s.leaves()) for s in snaps)
        assert eng.store.nbytes == len(distinct) * eng.page_bytes + own
        # one KV copy of the conversation plus, at most, one partial page per snapshot
        longest = max(len(s.tokens) for s in snaps)
        assert len(distinct) <= pages_for(longest, size) + len(snaps)
        assert sum(len(s.pages) for s in snaps) > len(distinct)  # really shared
        # the pool agrees: a page is held by each snapshot naming it (no slot is running)
        for p in distinct:
            assert eng.pool.refcount(p) == sum(p in s.pages for s in snaps)
        eng.store.clear()
        assert _all_free(eng)
    finally:
        eng.stop()


def test_a_full_pool_evicts_snapshots_instead_of_failing(model):
    """Snapshots fill the pool (128 pages): requests keep being served, snapshots go
    (by the store's eviction policy) to make room, and no page leaks."""
    eng = _engine(model, store=SnapshotStore("full"), checkpoint_interval=16).start()
    try:
        for i in range(200):
            p = ids(f"Fill the pool, request {i:03d}!!")
            h = run(eng, p, 4 + i % 3)
            if i % 10 == 0:  # the cold path for a sample of them
                assert h.token_ids == cold(p, 4 + i % 3), i
            assert h.finish_reason == "length"
            if eng.store.counters["evictions_pages"] >= 5:
                break
        _idle(eng)
        st = eng.store.stats()
        assert st["evictions_pages"] >= 5 and st["entries"] > 0, st
        held = {p for s in eng.store.snapshots() for p in s.pages}
        assert eng.pool.used == len(held) == st["pages"]  # nothing but the snapshots holds pages
        eng.store.clear()
        assert _all_free(eng)
    finally:
        eng.stop()


def test_paged_snapshots_persist(model, tmp_path):
    a = _engine(model, store=SnapshotStore("persist"), checkpoint_interval=16).start()
    p = ids("Persist paged snapshots, please")
    first = run(a, p, 6)
    a.stop()
    n = a.save_snapshots(tmp_path)
    held = a.store.pages_held
    assert n == len(a.store) > 0

    b = _engine(model, store=SnapshotStore("persist"), checkpoint_interval=16)
    assert b.load_snapshots(tmp_path) == n
    assert b.store.pages_held == held and b.pool.used == held  # each page loaded once, held by snapshots
    b.start()
    try:
        again = run(b, p, 6)
        assert again.cached_tokens == len(p) and again.token_ids == first.token_ids == cold(p, 6)
        more = run(b, p + first.token_ids, 3)
        assert more.cached_tokens == len(p) + covered(first) and more.token_ids == cold(p, 9)[6:]  # greedy goes on
    finally:
        b.stop()


# --- interleaving -------------------------------------------------------------------------


def test_a_running_stream_gets_a_token_after_every_prefill_chunk(model, monkeypatch):
    """A 200-token prompt arrives while a stream decodes: the prompt is prefilled in chunks of
    32 tokens, and between any two of the stream's tokens at most one chunk runs."""
    eng = _engine(model, store=None)
    log = []  # (handle id, prefill chunks run so far), in emission order (the engine thread)
    real_emit = RequestHandle._emit

    def emit(self, event):
        if event.token_id is not None:
            log.append((self.id, eng.counters["prefill_chunks"]))
        real_emit(self, event)

    monkeypatch.setattr(RequestHandle, "_emit", emit)
    stream = eng.submit(GenerationRequest(ids("A stream that keeps going"), max_tokens=60))
    long_prompt = (enc("A long prompt arrives. ") * 9)[:200]
    eng.start()
    try:
        assert stream.admitted.wait(TIMEOUT)
        while not any(h == stream.id for h, _ in log):
            threading.Event().wait(0.001)
        long = eng.submit(GenerationRequest(long_prompt, max_tokens=2))
        collect(long)
        collect(stream)
    finally:
        eng.stop()
    assert long.token_ids == cold_long(long_prompt, 2)
    chunks_seen = [c for h, c in log if h == stream.id]
    first_long = next(c for h, c in log if h == long.id)
    during = [c for c in chunks_seen if c <= first_long]
    assert max(b - a for a, b in zip(during, during[1:])) <= 1  # never more than one chunk between tokens
    assert first_long - during[0] >= 6  # the long prompt really took several chunks meanwhile


def cold_long(prompt, n):
    from hybridjax.generate import generate

    cfg, params, _ = tiny_test_model()
    return generate(params, cfg, [prompt], max_new_tokens=n, max_len=256, stop_ids=()).token_lists()[0]


# --- no compilation on a live request ---------------------------------------------------------

_lowered = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *a, **k: _lowered.append(event) if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" else None)


def test_after_warmup_serving_compiles_nothing(model):
    # 3 slots: shapes no other test compiles, so only the warm-up can have compiled them
    eng = _engine(model, store=SnapshotStore("warm"), checkpoint_interval=16, slots=3)
    before = len(_lowered)
    eng.warmup()
    assert len(_lowered) - before >= len(eng.shapes())  # it compiled every shape (eager helpers may add more)
    eng.start()
    try:
        before = len(_lowered)
        p = ids("Warm start: nothing compiles")
        run(eng, p, 5)  # cold
        run(eng, p, 5)  # exact repeat
        run(eng, p + enc("!! more"), 3, temperature=0.8, top_p=0.9, seed=3)  # a hit, sampled
        handles = [eng.submit(GenerationRequest(ids(f"Batch of three, number {i}"), max_tokens=4 + i)) for i in range(3)]
        handles.append(eng.submit(GenerationRequest((enc("Long enough to take chunks. ") * 4)[:100], max_tokens=3,
                                                    stop_strings=("zz",), repetition_penalty=1.2)))
        for h in handles:
            collect(h)
        assert len(_lowered) == before, _lowered[before:]
    finally:
        eng.stop()
