"""The engine's host scheduling (hybridjax.scheduler) on its own: no device, no model, no compile.
Requests are token lists, the page pool is the real one, and the snapshot store is a stand-in for
its lookups' results (the store itself is tested in test_prefix_cache; the engine on top of both,
against the cold path, in test_engine and test_pages)."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridjax.engine_requests import GenerationRequest, QueueFull, RequestHandle
from hybridjax.pages import PagePool
from hybridjax.scheduler import Scheduler, Slot, buckets, checkpoint_positions, common_prefix, first_piece, safe_split

PAGE = 16
WIDTHS = {1: [16, 32, 64], 2: [16, 32]}  # rows -> compiled prefill chunk widths


def sched(slots=2, pages=32, **kw) -> Scheduler:
    return Scheduler(slots, PagePool(pages, PAGE), pages_per_row=8, prefill_buckets=(1, 2), prefill_chunk=64, **kw)


def handle(prompt, max_tokens=4, **kw) -> RequestHandle:
    return RequestHandle(GenerationRequest(list(prompt), max_tokens, **kw))


def hit(pages, reused):
    """What the store's lookup gives: a snapshot holding `pages`, `reused` of its tokens reusable."""
    return SimpleNamespace(snapshot=SimpleNamespace(pages=pages), reused=reused, report=None)


def admit(s: Scheduler, h: RequestHandle, row: int, found=None, decoder=None) -> Slot:
    res = s.reserve(h.request, found)
    assert res is not None
    return s.place(h, row, res, decoder)


def test_the_scheduler_imports_no_jax():
    """Every hybridjax module the scheduler reaches is plain Python (+ numpy): no jax import."""
    root = Path(__file__).resolve().parents[1] / "hybridjax"
    seen, todo = set(), ["scheduler"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for m in mods:
                assert m.split(".")[0] not in ("jax", "jaxlib", "flax"), f"hybridjax/{name}.py imports {m}"
                if m.startswith("hybridjax."):
                    todo.append(m.split(".")[1])
    assert {"scheduler", "engine_requests", "pages"} <= seen


def test_buckets_and_cuts():
    assert buckets(1) == [1] and buckets(6) == [1, 2, 4, 6] and buckets(8, cap=4) == [1, 2, 4]
    assert checkpoint_positions(17, 50, 16) == [32, 48, 50]
    assert checkpoint_positions(0, 40, 16, extra=[32, 20]) == [16, 20, 32, 40]


def test_the_queue_is_bounded_and_keeps_its_order():
    s = sched(max_queue=2)
    a, b = handle([1, 2]), handle([3, 4])
    s.enqueue(a)
    s.enqueue(b)
    with pytest.raises(QueueFull):
        s.enqueue(handle([5]))
    assert s.counters["rejected_queue_full"] == 1 and s.counters["requests"] == 2
    assert s.take(1) == [a]
    s.put_back([a])
    assert s.take(5) == [a, b]


def test_background_work_waits_for_idle_time():
    s = sched()
    wish, req = handle([1] * 40, max_tokens=0), handle([2] * 40)
    s.enqueue(req)
    s.wish(wish)
    assert s.take(1) == [req]  # requests first
    admit(s, req, 0)
    assert s.take(1) == []  # a prompt is being prefilled: background work never delays it
    s.free(s.rows[0])
    assert s.take(1) == [wish]


def test_a_cold_request_gets_fresh_pages_for_prompt_and_response():
    s = sched()
    slot = admit(s, handle(range(20), max_tokens=20), 1)
    assert len(slot.pages) == 3 and s.pool.free == 29  # 40 tokens: 3 pages of 16
    assert list(s.table[1, :3]) == slot.pages and (s.table[1, 3:] == 32).all() and (s.table[0] == 32).all()
    assert slot.pos == 0 and slot.cuts == [20] and slot.prefilling


def test_a_hit_shares_full_pages_and_copies_the_partial_one():
    s = sched()
    snap_pages = s.pool.alloc(3)  # a snapshot of 40 tokens: two full pages and a partial third
    res = s.reserve(GenerationRequest(list(range(50)), 10), hit(snap_pages, 40))
    assert res.start == 40 and res.pages[:2] == snap_pages[:2] and res.copy == (snap_pages[2], res.pages[2])
    assert len(res.pages) == 4  # 60 tokens
    assert [s.pool.refcount(p) for p in snap_pages] == [2, 2, 1]  # the row holds the full pages too


def test_a_request_that_does_not_fit_changes_nothing():
    s = sched(pages=4)
    taken = s.pool.alloc(2)
    assert s.reserve(GenerationRequest(list(range(40)), 20), None) is None  # 4 pages wanted, 2 free
    assert s.pool.free == 2 and [s.pool.refcount(p) for p in taken] == [1, 1]


def test_a_short_pool_evicts_through_the_store_but_never_the_snapshot_being_restored():
    pool_pages = {}

    class Store:  # evicts its snapshots one at a time while the pool is short
        def evict_until(self, enough):
            for name in list(pool_pages):
                if enough():
                    return
                s.pool.release(pool_pages.pop(name))

    s = sched(pages=6, store=Store())
    pool_pages["old"] = s.pool.alloc(3)
    restored = s.pool.alloc(2)
    pool_pages["restored"] = restored
    res = s.reserve(GenerationRequest(list(range(32)), 32), hit(restored, 32))  # 4 pages: 2 shared, 2 fresh
    assert res is not None and res.pages[:2] == restored and "old" not in pool_pages
    assert all(s.pool.refcount(p) >= 1 for p in restored)  # evicted from the store, still held by the row


def test_a_request_waits_for_the_prefix_a_running_prompt_is_about_to_snapshot():
    s = sched(store=object())
    shared = list(range(100, 140))
    running = admit(s, handle(shared + [1] * 30), 0)
    later = GenerationRequest(shared + [2] * 10, 4)
    assert s.wait_for_shared_prefix(later, SimpleNamespace(reused=0))
    assert running.cuts == [40, 70]  # the running prompt is cut where they part
    assert not s.wait_for_shared_prefix(later, SimpleNamespace(reused=40))  # the store has it already


def test_admission_cuts_at_the_history_and_where_a_waiting_prompt_parts():
    s = sched(checkpoint_interval=32)
    waiting = handle(list(range(50)) + [7] * 5)
    s.enqueue(waiting)
    slot = admit(s, handle(list(range(80)), history_len=70), 0)
    assert slot.cuts == [32, 50, 64, 70, 80]


def test_a_prefill_call_shares_the_budget_and_ends_each_chunk_at_a_cut():
    s = sched(checkpoint_interval=0)
    long = admit(s, handle(range(100)), 0)
    short = admit(s, handle(range(200, 210)), 1)
    call = s.prefill_call(WIDTHS)
    assert [(row, c) for row, _, c in call.chosen] == [(0, 32), (1, 10)]  # 64 tokens over 2 rows
    assert call.tokens.shape == (2, 32) and list(call.counts) == [32, 10] and list(call.last) == [False, True]
    assert list(call.tokens[1, :10]) == list(range(200, 210)) and (call.tokens[1, 10:] == 0).all()
    assert (call.table == s.table).all()
    for _, slot, c in call.chosen:
        slot.advance(c)
    assert long.pos == 32 and not short.prefilling
    call = s.prefill_call(WIDTHS)  # one row left: it takes the one-row budget, in the widest chunk
    assert [(row, c) for row, _, c in call.chosen] == [(0, 64)] and call.tokens.shape == (1, 64)
    assert list(call.rows) == [0]


def test_a_prefill_chunk_stops_at_the_next_snapshot_point_and_fits_the_compiled_widths():
    s = sched(checkpoint_interval=16)
    slot = admit(s, handle(range(40), history_len=21), 0)
    sizes = []
    while slot.prefilling:
        call = s.prefill_call({1: [16, 64]})  # no 32-wide program yet: 5 tokens pad to 16
        (_, _, c), = call.chosen
        sizes.append((c, call.tokens.shape[1], slot.advance(c) and slot.snapshot_kind()))
    assert sizes == [(16, 16, "checkpoint"), (5, 16, "history"), (11, 16, "checkpoint"), (8, 16, "prompt")]


def test_background_prefill_goes_last_and_draws_no_token():
    s = sched()
    wish = admit(s, handle(range(30), max_tokens=0), 0)
    req = admit(s, handle(range(50, 60)), 1)
    call = s.prefill_call({1: [16, 32, 64]})
    assert [slot for _, slot, _ in call.chosen] == [req]
    call = s.prefill_call({1: [16, 32], 2: [16, 32]})
    assert [slot for _, slot, _ in call.chosen] == [req, wish] and list(call.last) == [True, False]
    wish.advance(30)
    assert wish.snapshot_kind() == "history"


def test_decode_rows_skip_prefills_and_a_row_whose_last_token_is_in_flight():
    s = sched(slots=3)
    a, b, c = (admit(s, handle(range(i, i + 4), max_tokens=2), i) for i in range(3))
    a.advance(4), b.advance(4)
    assert s.decode_rows(None) == [0, 1]  # c is prefilling
    a.handle.token_ids.append(9)  # one of two drawn; the step in flight (index 5) draws its last
    a.last_step = 5
    assert s.decode_rows(5) == [1] and s.decode_rows(6) == [0, 1]


def test_ends_of_a_row_after_the_dispatched_steps():
    s = sched(speculative_tokens=3)
    slot = admit(s, handle(range(4)), 0)
    slot.last_step = 7
    assert s.ends(slot, 7, 10, idle=False, done=False) == (10, 10)  # no later step feeds it
    assert s.ends(slot, 6, 10, idle=True, done=False) == (10, 10)
    assert s.ends(slot, 6, 10, idle=False, done=True) == (11, 11)
    slot.last_drafting = True
    assert s.ends(slot, 6, 10, idle=False, done=False) == (11, 14)


class Letters:
    """A stream decoder whose token t is the character chr(t)."""

    def push(self, token):
        return chr(token)

    def flush(self):
        return ""


def _accept_all(slot, text):
    return [slot.accept(ord(ch)) for ch in text]


def test_text_that_may_start_a_stop_string_is_held_back_and_the_stop_string_is_cut():
    s = sched()
    slot = admit(s, handle([1, 2], max_tokens=20, stop_strings=("END",)), 0, decoder=Letters())
    out = _accept_all(slot, "abEN")
    assert out == [("a", None), ("b", None), ("", None), ("", None)]
    assert slot.accept(ord("x")) == ("ENx", None)  # it was not the stop string after all
    _accept_all(slot, "yEN")
    assert slot.accept(ord("D")) == ("", "stop") and slot.handle.text == "abENxy"
    assert safe_split("abcE", ["END", "Ex"]) == ("abc", "E")


def test_stop_ids_min_tokens_and_the_length_limit():
    s = sched()
    slot = admit(s, handle([1], max_tokens=3, stop_ids=(ord("!"),), min_tokens=1), 0, decoder=Letters())
    assert slot.accept(ord("!")) == ("!", None)  # before min_tokens a stop id is an ordinary token
    assert slot.accept(ord("!")) == ("", "stop")  # then it ends the response and is not its text
    slot = admit(s, handle([1], max_tokens=2), 1, decoder=Letters())
    assert _accept_all(slot, "ab") == [("a", None), ("b", "length")] and slot.drawn == [97, 98]


def test_snapshot_pages_share_full_pages_and_copy_a_partial_one_only_while_the_row_writes():
    s = sched()
    slot = admit(s, handle(range(40), max_tokens=10), 0)  # 50 tokens: 4 pages
    assert s.snapshot_pages(slot, 32, True) == (slot.pages[:2], None)
    pages, copy = s.snapshot_pages(slot, 40, True)
    assert pages[:2] == slot.pages[:2] and copy == (slot.pages[2], pages[2]) and pages[2] not in slot.pages
    assert s.snapshot_pages(slot, 40, False) == (slot.pages[:3], None)


def test_a_prefill_piece_runs_in_the_calls_that_cost_least():
    widths = (16, 32, 64, 128, 256)
    assert first_piece(232, widths, 32) == 256  # one call, 24 tokens of padding
    assert first_piece(153, widths, 32) == 128  # then 32: 160 tokens in 2 calls, not 256 in one
    assert first_piece(25, widths, 32) == 32
    assert first_piece(5, widths, 32) == 16
    assert first_piece(153, widths, 10**6) == 256  # calls dear, tokens cheap: one call


def test_with_a_call_cost_a_prefill_call_is_cut_to_the_cheapest_first_piece():
    widths = {1: [16, 32, 64, 128, 256]}
    s = Scheduler(1, PagePool(32, PAGE), pages_per_row=16, prefill_chunk=256, prefill_call_tokens=32)
    slot = admit(s, handle(range(153)), 0)
    sizes = []
    while slot.prefilling:
        call = s.prefill_call(widths)
        (_, _, c), = call.chosen
        sizes.append((c, call.tokens.shape[1]))
        slot.advance(c)
    assert sizes == [(128, 128), (25, 32)]  # 160 tokens in 2 calls, not 256 in one
    s.prefill_call_tokens = None  # a backend where a call's width is close to free: one call
    slot = admit(s, handle(range(153)), 0)
    assert s.prefill_call(widths).tokens.shape == (1, 256)


def test_a_request_overtakes_idle_time_work_it_runs_what_it_continues_and_drops_the_rest():
    s = sched()
    continued, other = handle([1, 2, 3], max_tokens=0), handle([9, 9], max_tokens=0)
    continued.not_before = other.not_before = float("inf")  # not due: the loop would not start them
    s.wish(continued)
    s.wish(other)
    assert s.has_work() and not s.work_due()
    req = handle([1, 2, 3, 4])
    s.enqueue(req)
    assert list(s.waiting) == [continued, req] and continued.not_before == 0.0
    assert other.finish_reason == "cancelled" and s.counters["background_superseded"] == 1 and not s.background


def test_idle_time_work_being_prefilled_yields_its_row_to_a_waiting_request():
    s = sched(slots=2)
    busy = admit(s, handle(range(10)), 0)
    wish = admit(s, handle(range(100, 150), max_tokens=0), 1)
    wish.advance(16)
    s.enqueue(handle(range(100, 160)))  # continues the idle-time work: it keeps its row
    s.yield_idle_work()
    assert s.rows[1] is wish
    s.waiting.clear()
    s.enqueue(handle(range(300, 310)))  # does not continue it: the row goes
    s.yield_idle_work()
    assert s.rows == [busy, None] and wish.handle.finish_reason == "cancelled"


def test_common_prefix_matches_the_element_loop():
    import random

    rng = random.Random(1)
    for _ in range(2000):
        a = [rng.randint(0, 3) for _ in range(rng.randint(0, 3000))]
        b = a[: rng.randint(0, len(a))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 40))]
        want = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        for block in (1, 7, 1024):
            assert common_prefix(a, b, block) == common_prefix(tuple(b), a, block) == want
