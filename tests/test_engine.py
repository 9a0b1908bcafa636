"""The engine on the tiny random test model (`tiny_test_model`): greedy parity with the cold path (`generate`) with
the snapshot store off and on, turn-to-turn and checkpoint reuse, exact repeats, batching
independence, seeded sampling, stop conditions, cancellation, failures and admission errors.

JAX compiles once per shape (~1-25 s each on 2 cores), so the engines are module-scoped and
share every compiled function (one configuration, `engine_helpers.ENGINE_KW`).
"""

from __future__ import annotations

import time

import jax
import pytest
from engine_helpers import ENGINE_KW, SLOTS, TIMEOUT, cold, collect, covered, enc, ids, prefilled, run

import hybridjax.engine_steps as engine_steps
from hybridjax.default_model import tiny_test_model
from hybridjax.engine import Engine, GenerationRequest, QueueFull, RequestHandle
from hybridjax.prefix_cache import SnapshotStore


@pytest.fixture(scope="module")
def model():
    return tiny_test_model()


@pytest.fixture(scope="module")
def engine(model):
    """Store on, no checkpoint interval."""
    cfg, params, tok = model
    eng = Engine(cfg, params, tok, store=SnapshotStore("test"), **ENGINE_KW).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def engine_nostore(model):
    cfg, params, tok = model
    eng = Engine(cfg, params, tok, store=None, **ENGINE_KW).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def engine_ckpt(model):
    """Store on, a snapshot every 16 prefilled tokens."""
    cfg, params, tok = model
    eng = Engine(cfg, params, tok, store=SnapshotStore("test"), checkpoint_interval=16, **ENGINE_KW).start()
    yield eng
    eng.stop()


# --- parity with the cold path ------------------------------------------------------------


def test_greedy_equals_cold_path_with_store_off_and_on(engine, engine_nostore, model):
    tok = model[2]
    p = ids("Parity: store off, store on.")
    off = run(engine_nostore, p, 12)
    on = run(engine, p, 12)
    assert off.token_ids == on.token_ids == cold(p, 12)
    assert off.finish_reason == on.finish_reason == "length"
    assert off.cached_tokens == on.cached_tokens == 0
    assert on.prompt_tokens == len(p)
    assert on.text == tok.decode(on.token_ids)


def test_later_turns_resume_after_the_previous_response(engine):
    p1 = ids("Turn one: hi there")
    r1 = run(engine, p1, 4)
    assert r1.token_ids == cold(p1, 4) and r1.cached_tokens == 0

    p2 = p1 + r1.token_ids + enc("ok?")
    before = prefilled(engine)
    r2 = run(engine, p2, 4)
    assert r1.finish_reason == "length" and r2.cached_tokens == len(p1) + covered(r1) == len(p2) - 4
    assert prefilled(engine) - before == 4  # the new text and the response's last token
    assert r2.token_ids == cold(p2, 4)

    p3 = p2 + r2.token_ids + enc("bye")
    r3 = run(engine, p3, 4)
    assert r3.cached_tokens == len(p2) + covered(r2)
    assert r3.token_ids == cold(p3, 4)


def test_an_exact_repeat_costs_no_prefill(engine):
    p = ids("Repeat me exactly!!")
    first = run(engine, p, 8)
    before, exact = prefilled(engine), engine.store.counters["exact_hits"]
    again = run(engine, p, 8)
    assert again.cached_tokens == len(p)
    assert prefilled(engine) == before
    assert engine.store.counters["exact_hits"] == exact + 1
    assert again.token_ids == first.token_ids == cold(p, 8)

    # re-sending prompt + response resumes from the response snapshot: only the token that
    # ended it by length is prefilled
    cont = p + first.token_ids
    more = run(engine, cont, 4)
    assert more.cached_tokens == len(p) + covered(first) == len(cont) - 1 and prefilled(engine) == before + 1
    assert more.token_ids == cold(cont, 4)


def test_the_first_token_is_sent_before_the_prompt_snapshot_is_stored(engine, monkeypatch):
    """The prompt's snapshot (its pages, the row's read, the store's insert) is not part of the time
    to first token: the token is out before it is stored. A request that token ends (max_tokens=1)
    still leaves it, and a repeat is an exact hit with the cold path's token."""
    log = []
    emit, insert = RequestHandle._emit, engine.store.insert

    def logged_emit(handle, event):
        if handle.request.namespace == "first":
            log.append(("token", event.token_id) if event.finish_reason is None else ("finish", event.finish_reason))
        emit(handle, event)

    def logged_insert(tokens, *a, namespace="", kind="prompt", **k):
        if namespace == "first":
            log.append(("insert", kind, len(tokens)))
        return insert(tokens, *a, namespace=namespace, kind=kind, **k)

    monkeypatch.setattr(RequestHandle, "_emit", logged_emit)
    monkeypatch.setattr(engine.store, "insert", logged_insert)
    p = ids("Send first, then snapshot it")
    r = run(engine, p, 1, namespace="first")
    assert r.token_ids == cold(p, 1) and r.finish_reason == "length"
    assert log[:3] == [("token", r.token_ids[0]), ("insert", "prompt", len(p)), ("finish", "length")]
    before = prefilled(engine)
    again = run(engine, p, 1, namespace="first")
    assert again.cached_tokens == len(p) and prefilled(engine) == before and again.token_ids == r.token_ids

    log.clear()
    q = ids("Longer answer: first, snapshot")
    r = run(engine, q, 3, namespace="first")
    assert r.token_ids == cold(q, 3)
    assert log.index(("token", r.token_ids[0])) < log.index(("insert", "prompt", len(q)))


def test_a_response_ended_by_max_tokens_spends_no_step_after_its_last_token(engine):
    """The prefill draws the first token and each decode step one more; no step is spent feeding
    the last one (the next request, an exact repeat say, would wait for it on the device)."""
    steps = engine.counters["steps"]
    r = run(engine, ids("No step after the last token"), 5)
    assert r.finish_reason == "length" and engine.counters["steps"] - steps == 4


def test_a_prompt_diverging_in_the_middle_resumes_from_the_last_checkpoint(engine_ckpt):
    a = ids("Checkpoints every sixteen tokens")
    assert len(a) == 32
    first = run(engine_ckpt, a, 4)
    assert first.cached_tokens == 0 and first.token_ids == cold(a, 4)

    for diverge in (25, 16, 31):  # first differing position
        b = a[:diverge] + enc("#other tail for this one")[: max(30 - diverge, 1)]
        assert b[:diverge] == a[:diverge] and b[diverge] != a[diverge]
        before = prefilled(engine_ckpt)
        h = run(engine_ckpt, b, 6)
        assert h.cached_tokens == diverge // 16 * 16, diverge
        assert prefilled(engine_ckpt) - before == len(b) - h.cached_tokens
        assert h.token_ids == cold(b, 6), diverge


def test_a_snapshot_at_a_prefill_calls_end_takes_the_row_from_that_call(engine_ckpt, monkeypatch):
    """Checkpoint and prompt snapshots take the row's state from the prefill call that ends there:
    no row read of their own (a call that cost the host ~0.6 ms after a long prefill on CPU); only
    the response's snapshot reads the row. Prompts resuming from them equal the cold path."""
    reads = []
    read_row = engine_ckpt.calls.read_row
    monkeypatch.setattr(engine_ckpt.calls, "read_row", lambda *a: reads.append(a[1]) or read_row(*a))
    a = ids("Rows read by the call, 16 a time")
    assert len(a) == 32
    r = run(engine_ckpt, a, 3, namespace="reads")
    assert r.token_ids == cold(a, 3) and len(reads) == 1  # the response's snapshot
    assert engine_ckpt.store.lookup(a[:16], namespace="reads").snapshot.kind == "checkpoint"
    b = a[:20] + enc("! new tail")
    h = run(engine_ckpt, b, 4, namespace="reads")
    assert h.cached_tokens == 16 and h.token_ids == cold(b, 4)
    again = run(engine_ckpt, a, 4, namespace="reads")
    assert again.cached_tokens == len(a) and again.token_ids == cold(a, 4)


# --- batching -------------------------------------------------------------------------------


def test_concurrent_requests_equal_each_run_alone(engine, engine_nostore):
    texts = [f"Concurrent request {i}: {'xyzw'[i % 4] * (i + 1)}" for i in range(8)]
    max_tokens = [3, 16, 5, 11, 8, 2, 14, 7]
    sampled = {2: (1234, 0.9), 5: (7, 1.3), 6: (99, 0.7)}  # row -> (seed, temperature)
    reqs = []
    for i, (text, n) in enumerate(zip(texts, max_tokens)):
        seed, temp = sampled.get(i, (0, 0.0))
        reqs.append(GenerationRequest(ids(text), max_tokens=n, seed=seed, temperature=temp))
    handles = [engine.submit(r) for r in reqs]  # 8 requests, 4 slots: some wait
    for h in handles:
        collect(h)
    for i, (h, r) in enumerate(zip(handles, reqs)):
        assert h.finish_reason == "length" and len(h.token_ids) == r.max_tokens
        assert h.token_ids == cold(r.prompt_ids, r.max_tokens, seed=r.seed, temperature=r.temperature), i

    # a seeded sampled request alone (another engine, no store) draws the same tokens
    for i in sampled:
        alone = run(engine_nostore, reqs[i].prompt_ids, reqs[i].max_tokens, seed=reqs[i].seed,
                    temperature=reqs[i].temperature)
        assert alone.token_ids == handles[i].token_ids
    # and another seed draws others
    other = run(engine_nostore, reqs[6].prompt_ids, 14, seed=100, temperature=0.7)
    assert other.token_ids != handles[6].token_ids


# --- stop conditions ------------------------------------------------------------------------


def test_stop_ids_stop_strings_and_max_tokens(engine_nostore):
    p = ids("Stops: where does it end?")
    full = run(engine_nostore, p, 16)
    assert full.finish_reason == "length" and len(full.token_ids) == 16

    # stop ids: the run ends at the first occurrence, the stop token is the last token
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    h = run(engine_nostore, p, 16, stop_ids=(stop_id, 999))
    assert h.finish_reason == "stop" and h.token_ids == full.token_ids[: first + 1]
    assert full.text.startswith(h.text)

    # stop strings: the text is cut before the stop string, which is never emitted
    windows = [full.text[j:j + 2] for j in range(1, len(full.text) - 1)]
    stop = next(w for w in windows if "\ufffd" not in w)
    cut = full.text.find(stop)
    h = run(engine_nostore, p, 16, stop_strings=(stop, "never seen \u2603"))
    assert h.finish_reason == "stop"
    assert h.text == full.text[:cut] and stop not in h.text
    assert h.token_ids == full.token_ids[: len(h.token_ids)] and len(h.token_ids) < 16

    # max_tokens
    h = run(engine_nostore, p, 3)
    assert h.finish_reason == "length" and h.token_ids == full.token_ids[:3]


# --- cancellation ---------------------------------------------------------------------------


def _wait(pred, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


LONG = 200  # tokens: long enough to still be decoding when the test looks, on any machine


def test_cancel_frees_the_slot_for_a_waiting_request(engine_nostore):
    eng = engine_nostore
    assert _wait(lambda: eng.active_slots == 0 and eng.queue_depth == 0)
    # alone: cancel after the first token
    h = eng.submit(GenerationRequest(ids("Cancel me after one token"), max_tokens=LONG))
    events = h.events(timeout=TIMEOUT)
    assert next(events).token_id is not None
    h.cancel()
    rest = list(events)
    assert rest[-1].finish_reason == "cancelled" == h.finish_reason
    assert len(h.token_ids) < LONG
    assert eng.active_slots == 0  # the row is freed before the final event is sent

    # full: four long requests hold every slot, a fifth waits until one is cancelled; a sixth,
    # cancelled while it waits, is dropped when it reaches a free slot, without taking it
    # (200 tokens each, so they are still running when checked right after admission)
    longs = [eng.submit(GenerationRequest(ids(f"Long running request {i}!"), max_tokens=LONG)) for i in range(SLOTS)]
    waiting = eng.submit(GenerationRequest(ids("I wait for a free slot"), max_tokens=4))
    dropped = eng.submit(GenerationRequest(ids("Cancelled before admission"), max_tokens=4))
    dropped.cancel()
    for x in longs:
        assert x.admitted.wait(TIMEOUT)
    assert not waiting.admitted.is_set() and eng.active_slots == SLOTS and eng.queue_depth == 2
    longs[0].cancel()
    assert waiting.admitted.wait(30)
    collect(longs[0])
    assert longs[0].finish_reason == "cancelled" and len(longs[0].token_ids) < LONG
    for x in longs[1:] + [waiting]:
        assert collect(x).finish_reason == "length"
    collect(dropped)
    assert dropped.finish_reason == "cancelled" and dropped.token_ids == [] and not dropped.admitted.is_set()
    assert _wait(lambda: eng.active_slots == 0 and eng.queue_depth == 0)


# --- failures ------------------------------------------------------------------------------


def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(engine_nostore, monkeypatch, caplog):
    eng = engine_nostore
    assert _wait(lambda: eng.active_slots == 0)
    real = engine_steps.decode_model  # a decode step's model program (then its draw's)
    calls = []

    def fail_after_donating(params, state, *args):
        if not calls:  # the worst case: the donated state is gone when the error surfaces
            calls.append(1)
            for x in jax.tree_util.tree_leaves(state):
                x.delete()
            raise RuntimeError("injected step failure")
        return real(params, state, *args)

    monkeypatch.setattr(engine_steps, "decode_model", fail_after_donating)
    errors = eng.counters["errors"]
    p = ids("This step will fail, sorry")
    h = run(eng, p, 4)
    # the first token comes from the prefill, before the failing decode step
    assert h.finish_reason == "error" and len(h.token_ids) <= 1 and eng.counters["errors"] == errors + 1
    assert "engine step failed" in caplog.text
    again = run(eng, p, 4)
    assert again.finish_reason == "length" and again.token_ids == cold(p, 4)


def test_a_failed_admission_fails_that_request_only(engine, monkeypatch):
    real = engine.store.insert

    def failing_insert(*a, **kw):
        raise RuntimeError("injected store failure")

    monkeypatch.setattr(engine.store, "insert", failing_insert)
    p = ids("Admission fails for this one")
    h = run(engine, p, 4)
    # the prompt's snapshot is stored after its first token is sent
    assert h.finish_reason == "error" and h.token_ids == cold(p, 1)
    monkeypatch.setattr(engine.store, "insert", real)
    ok = run(engine, p, 4)
    assert ok.finish_reason == "length" and ok.token_ids == cold(p, 4) and ok.cached_tokens == 0


# --- admission errors -----------------------------------------------------------------------


def test_queue_bound_and_context_errors(model):
    cfg, params, tok = model
    eng = Engine(cfg, params, tok, slots=2, max_len=64, max_queue=3)  # never started: nothing is admitted
    for _ in range(3):
        eng.submit(GenerationRequest([1, 2, 3], max_tokens=4))
    with pytest.raises(QueueFull, match="queue is full"):
        eng.submit(GenerationRequest([1, 2, 3], max_tokens=4))
    assert eng.queue_depth == 3 and eng.counters["rejected_queue_full"] == 1

    with pytest.raises(ValueError, match=r"prompt \(64 tokens\).*context length 64"):
        eng.submit(GenerationRequest([1] * 64, max_tokens=1))
    with pytest.raises(ValueError, match=r"max_tokens \(20\) exceeds the context length 64"):
        eng.submit(GenerationRequest([1] * 50, max_tokens=20))
    with pytest.raises(ValueError, match="empty"):
        eng.submit(GenerationRequest([], max_tokens=4))
    assert eng.queue_depth == 3



def test_submit_prepares_the_row_and_admission_uses_it(engine, monkeypatch):
    """The prompt's array and the row's arguments are made by the submitting thread; admission
    (the engine thread) only swaps in the cached length, and the tokens stay the cold path's."""
    import hybridjax.engine as engine_mod

    made = []
    real = engine_mod.request_row_args
    monkeypatch.setattr(engine_mod, "request_row_args", lambda cfg, req, length=0: made.append(req) or
                        real(cfg, req, length))
    p1 = ids("Row args ahead: hi")
    req = GenerationRequest(p1 + collect(engine.submit(GenerationRequest(p1, max_tokens=4))).token_ids + enc("ok?"),
                            max_tokens=4)
    handle = engine.submit(req)
    assert "prompt_array" in vars(req) and handle.row_args is not None and made[-1] is req
    collect(handle)
    assert made.count(req) == 1  # admission made none
    assert handle.cached_tokens > 0 and handle.token_ids == cold(req.prompt_ids, 4)


def test_requests_admitted_together_share_their_common_prefix(model):
    """Four requests with one shared prefix arrive at once: the first snapshots the shared
    part, the other three resume from it (and still equal the cold path)."""
    cfg, params, tok = model
    eng = Engine(cfg, params, tok, store=SnapshotStore("test"), **ENGINE_KW)
    base = enc("One shared system prompt. ")
    handles = [eng.submit(GenerationRequest(ids(f"One shared system prompt. q{i}"), max_tokens=3)) for i in range(SLOTS)]
    eng.start()  # all four are waiting: one admission pass takes them together
    try:
        for h in handles:
            collect(h)
    finally:
        eng.stop()
    shared = len(base) + 1  # "q" too
    assert [h.cached_tokens for h in handles] == [0] + [shared] * (SLOTS - 1)
    for h in handles:
        assert h.token_ids == cold(h.request.prompt_ids, 3)


def test_a_request_cancelled_while_queued_counts_as_finished(model):
    cfg, params, tok = model
    eng = Engine(cfg, params, tok, store=None, **ENGINE_KW)  # not started: the request stays queued
    h = eng.submit(GenerationRequest(ids("Cancelled while it waits!!"), max_tokens=4))
    h.cancel()
    eng.start()
    try:
        collect(h)
    finally:
        eng.stop()
    assert h.finish_reason == "cancelled" and eng.counters["finished_cancelled"] == 1


def test_snapshots_expire_on_a_timer_while_the_engine_is_idle(model):
    cfg, params, tok = model
    store = SnapshotStore("ttl", ttl_s=0.3)
    eng = Engine(cfg, params, tok, store=store, **ENGINE_KW).start()
    try:
        run(eng, ids("Expire me soon, please!!"), 2)
        assert len(store) > 0
        deadline = time.monotonic() + 30
        # No request arrives meanwhile. The engine thread drops an entry and then gives back its
        # pages (under the store's lock, which len() does not take): wait for both.
        while (len(store) or eng.pool.free < eng.pool.num_pages) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(store) == 0 and store.counters["evictions_ttl"] > 0
        assert eng.pool.free == eng.pool.num_pages  # their pages went back to the pool
    finally:
        eng.stop()


def test_logprobs_come_from_the_logits_the_token_was_drawn_from(engine_nostore, model):
    """Greedy: the token is the most likely one, and its log-probability is log_softmax of the
    model's logits (checked for every token against `forward` over prompt + tokens)."""
    import jax.numpy as jnp
    import numpy as np

    from hybridjax import forward, init_cache

    cfg, params, _ = model
    p = ids("Log-probabilities, please!")
    h = run(engine_nostore, p, 5, logprobs=3)
    assert len(h.logprobs) == 5
    seq = p + h.token_ids
    logits, _ = forward(params, jnp.asarray([seq]), init_cache(cfg, 1, 64), cfg)
    want = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    for i, (tok, (lp, top)) in enumerate(zip(h.token_ids, h.logprobs)):
        assert len(top) == 3 and top[0][0] == tok and top[0][1] == lp
        assert [t for t, _ in top] == list(np.argsort(-want[len(p) - 1 + i])[:3])
        # float32 logits of order 10 through two different programs (engine step, plain forward)
        np.testing.assert_allclose(lp, want[len(p) - 1 + i, tok], atol=1e-4)
    assert run(engine_nostore, p, 2).logprobs == []  # not asked: not computed


def test_a_background_prefill_leaves_a_snapshot_and_no_tokens(engine):
    p = ids("Prefill me while idle, ok?")
    h = engine.prefill_in_background(p, namespace="bg")
    collect(h)
    assert h.finish_reason == "stop" and h.token_ids == []
    snap = engine.store.lookup(p, namespace="bg")
    assert snap.exact and snap.snapshot.kind == "history"
    r = run(engine, p, 4, namespace="bg")
    assert r.cached_tokens == len(p) and r.token_ids == cold(p, 4)


def test_a_request_drops_the_idle_time_work_it_does_not_continue(engine):
    """Work for a next turn that went another way is not run (with a delay, it has not started),
    nor is work of another namespace (the engine was not idle: it is dropped)."""
    other = engine.prefill_in_background(ids("Another conversation's guess"), namespace="elsewhere", delay_s=600)
    p = ids("A next turn going its own way")
    bg = engine.prefill_in_background(p + enc("?"), namespace="over", delay_s=600)
    assert not engine.idle  # the work is waiting
    before = engine.counters["background_superseded"]
    r = run(engine, p + enc("!"), 4, namespace="over")
    assert collect(bg).finish_reason == collect(other).finish_reason == "cancelled"
    assert engine.counters["background_superseded"] == before + 2
    assert r.token_ids == cold(p + enc("!"), 4) and r.cached_tokens == 0


def test_a_request_runs_the_idle_time_work_it_continues_first(engine):
    """Work for the next turn that the request continues runs at once, before it, and the request
    resumes from its snapshot (as if the work had started before the request came)."""
    p = ids("Idle work the next turn uses")
    bg = engine.prefill_in_background(p, namespace="cont", delay_s=600)
    r = run(engine, p + enc(" ok"), 4, namespace="cont")
    assert collect(bg).finish_reason == "stop" and bg.token_ids == []
    assert r.cached_tokens == len(p) and r.token_ids == cold(p + enc(" ok"), 4)


def test_running_idle_time_work_yields_its_slot_to_a_request(model):
    """With every slot taken, idle-time work being prefilled gives its slot up at a call's end to a
    waiting request that does not continue it (the engine's loop run by hand, one step at a time)."""
    cfg, params, tok = model
    eng = Engine(cfg, params, tok, store=SnapshotStore("yield"), **ENGINE_KW)
    try:
        busy = [eng.submit(GenerationRequest(ids(f"{i}: a busy request, this one"), max_tokens=2)) for i in range(SLOTS - 1)]
        bg = eng.prefill_in_background(enc("idle " * 40), namespace="y")  # 200 tokens: several calls
        eng.loop._admit()  # the busy requests, and the idle-time work in the last slot
        eng.loop._prefill()
        rows = eng.sched.rows
        assert all(r is not None for r in rows) and any(r.handle is bg for r in rows)
        p = ids("A request that needs the slot")
        handle = eng.submit(GenerationRequest(p, max_tokens=4, namespace="y"))
        eng.loop._admit()
        assert any(r is not None and r.handle is handle for r in eng.sched.rows) and bg.finish_reason == "cancelled"
        assert eng.counters["background_superseded"] == 1
        eng.start()
        assert collect(handle).token_ids == cold(p, 4)
        assert all(collect(h).finish_reason == "length" for h in busy)
    finally:
        eng.stop()
