"""Host scheduling for the engine: plain Python and numpy, no JAX (tests/test_scheduler.py runs it
without a device or a compile).

The `Scheduler` decides, the engine's loop (hybridjax.engine) carries out on the device:
  - the waiting queue and the idle-time wishes (`enqueue`, `wish`, `take`);
  - admission: which request gets a free row, which waits for a prefix another row is about to
    snapshot (`wait_for_shared_prefix`), which pages it gets (`reserve`: the snapshot's full pages
    by id, fresh ones for the rest, evicting snapshots by the store's policy when short);
  - prefill: which rows share the next call and how many tokens each (`prefill_call`), cut at the
    snapshot points (`checkpoint_positions`);
  - decode: which rows the next step feeds (`decode_rows`) and where a row's cache will be once
    the dispatched steps have run (`ends`);
  - delivery: a drawn token's text, stop strings and the finish (`Slot.accept`);
  - speculation: whether a step drafts (`SpecPolicy`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from collections import Counter, deque
from typing import Iterable, Sequence

import numpy as np

from hybridjax.engine_requests import GenerationRequest, QueueFull, RequestHandle
from hybridjax.pages import PagePool, PoolExhausted, pages_for

SHARE_MIN_TOKENS = 16  # a request waits for another's shared-prefix snapshot only past this many tokens

# A prefill call's fixed cost in tokens of its width, by backend: on CPU a call costs about its
# padded width times a per-token time plus ~10-20 ms (the embedded default, 2-core AVX2, widths
# 16-256: benchmarks/profile_agent_turn.py), about 32 tokens' worth. Elsewhere a call's width is
# close to free: one call per piece, as large as needed (None).
PREFILL_CALL_TOKENS = {"cpu": 32}


def checkpoint_positions(start: int, end: int, interval: int, extra: Iterable[int] = ()) -> list[int]:
    """Where to cut a prefill from `start` to `end`: multiples of `interval` and `extra`
    positions strictly inside (start, end), then `end`."""
    cuts = set(p for p in extra if start < p < end)
    if interval > 0:
        cuts |= set(range((start // interval + 1) * interval, end, interval))
    return sorted(cuts) + [end]


@functools.lru_cache(maxsize=4096)
def first_piece(n: int, widths: tuple[int, ...], call_tokens: int) -> int:
    """The width of the first call of the cheapest split of n prompt tokens into calls of the
    compiled `widths` (ascending), a call costing its width + `call_tokens`: a piece of 153 tokens
    runs as 128 + 32 (2 calls, 160 padded) rather than in one call of 256."""
    cost = [0] * (n + 1)
    for m in range(1, n + 1):
        cost[m] = min(w + call_tokens + cost[max(0, m - w)] for w in widths)
    # the largest width on a cheapest path (fewest calls among equals)
    return max(w for w in widths if w + call_tokens + cost[max(0, n - w)] == cost[n])


def buckets(n: int, cap: int | None = None) -> list[int]:
    """Batch buckets up to n rows: powers of two below n, then n (at most `cap`)."""
    top = min(n, cap or n)
    out = [1]
    while out[-1] * 2 < top:
        out.append(out[-1] * 2)
    return sorted(set(out + [top]))


def bucket(n: int, sizes: Sequence[int]) -> int:
    """The smallest of `sizes` (ascending) that holds n."""
    return next(b for b in sizes if b >= n)


def common_prefix(a: Sequence[int], b: Sequence[int], block: int = 1024) -> int:
    """Length of the longest common prefix; compares slices a block at a time (in C: two 32k-token
    prompts compare in well under a millisecond), then the differing block one id at a time."""
    a, b = (x if isinstance(x, list) else list(x) for x in (a, b))  # a slice of a list equals only a list
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + block] == b[i : i + block]:
        i += block
    end = min(i + block, n)
    return next((j for j in range(i, end) if a[j] != b[j]), end)


def shared_prefix(others: Sequence[GenerationRequest], req: GenerationRequest) -> int:
    """The longest prefix `req`'s prompt shares with a prompt of `others` in its namespace."""
    return max((common_prefix(o.prompt_ids, req.prompt_ids) for o in others if o.namespace == req.namespace),
               default=0)


def safe_split(text: str, stops: Sequence[str]) -> tuple[str, str]:
    """(text that can be sent, tail that may still grow into a stop string)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return (text[: len(text) - hold], text[len(text) - hold :]) if hold else (text, "")


@dataclasses.dataclass(eq=False)
class Slot:
    """A request in a row: its pages, its prefill's progress and what it has drawn."""

    handle: RequestHandle
    row: int
    decoder: object  # tokenizer.StreamDecoder, or None without a tokenizer
    pages: list[int]  # this row's KV pages, in order
    pos: int  # tokens in the row's cache (the prefill's progress)
    cuts: list[int]  # snapshot points of the prompt still ahead (the prompt's end last)
    seq: int  # admission order
    drawn: list[int] = dataclasses.field(default_factory=list)  # every token drawn (sent or not)
    held_text: str = ""  # decoded text not yet sent (it may be the start of a stop string)
    last_step: int = -1  # the last decode step this row was dispatched in
    last_drafting: bool = False  # and whether that step drafts (`steps.spec_decode`)
    finished: bool = False
    constraint: object = None  # grammar.Constraint of a constrained request

    @property
    def prompt(self) -> list[int]:
        return self.handle.request.prompt_ids

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt)

    @property
    def background(self) -> bool:
        """Prefill-only work of idle time (`Engine.prefill_in_background`): no token, no client."""
        return self.handle.request.max_tokens == 0

    def advance(self, n: int) -> bool:
        """n more prompt tokens are in the cache; True if that reached a snapshot point."""
        self.pos += n
        if self.pos != self.cuts[0]:
            return False
        self.cuts.pop(0)
        return True

    def snapshot_kind(self) -> str:
        """What a snapshot at the prefill's position is to the store."""
        if self.pos == len(self.prompt):
            return "history" if self.background else "prompt"  # background work: kept like a history
        return "history" if self.pos == self.handle.request.history_len else "checkpoint"

    def accept(self, token: int) -> tuple[str, str | None]:
        """Add a drawn token: (the text that can be sent now, the finish reason or None). A stop
        token ends the response (once min_tokens are drawn) and is not part of its text; so does a
        grammar that has matched a whole value (only the end may follow) or rejects the token. Text
        that may be the start of a stop string waits for the next token."""
        h, req = self.handle, self.handle.request
        self.drawn.append(token)
        h.token_ids.append(token)
        stopped = token in req.stop_ids and len(h.token_ids) > req.min_tokens
        text = self.held_text + (self.decoder.push(token) if self.decoder and not stopped else "")
        matched = self.constraint is not None and not stopped and (not self.constraint.advance(token)
                                                                     or self.constraint.finished)
        done = stopped or matched or len(h.token_ids) >= req.max_tokens
        if done and self.decoder:
            text += self.decoder.flush()
        cut = min((text.find(s) for s in req.stop_strings if s in text), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        else:
            finish = "stop" if stopped or matched else ("length" if done else None)
        send, self.held_text = (text, "") if finish else safe_split(text, req.stop_strings)
        h.text += send
        return send, finish


@dataclasses.dataclass
class Reservation:
    """The pages a request gets at admission (`Scheduler.reserve`)."""

    start: int  # tokens its cache starts with (from the snapshot)
    pages: list[int]  # the snapshot's full pages (held), then fresh ones
    copy: tuple[int, int] | None  # (the snapshot's partial last page, the fresh page it is copied to)
    snapshot: object  # the store's snapshot it starts from, or None


@dataclasses.dataclass
class PrefillCall:
    """One prefill call (`Scheduler.prefill_call`): `chosen` rows, each its next `count` tokens."""

    chosen: list[tuple[int, Slot, int]]  # (row, slot, tokens this call)
    rows: np.ndarray  # [bucket] rows of the call (padding: out of range)
    tokens: np.ndarray  # [bucket rows, width] int32
    counts: np.ndarray  # [bucket rows] int32
    last: np.ndarray  # [bucket rows] bool: the prompt's last chunk (its first token is drawn)
    table: np.ndarray  # [bucket rows, pages per row] the page tables


class Scheduler:
    """The host side of the engine: queue, rows, pages and the plan of each call (module doc).
    The queue is shared with the callers' threads (under `wake`); the rest is the engine thread's."""

    def __init__(self, slots: int, pool: PagePool, pages_per_row: int, *, store=None, checkpoint_interval: int = 0,
                 max_queue: int = 64, prefill_chunk: int = 256, prefill_buckets: Sequence[int] = (1,),
                 speculative_tokens: int = 0, prefill_call_tokens: int | None = None,
                 counters: Counter | None = None):
        self.slots, self.pool, self.pages_per_row = slots, pool, pages_per_row
        self.store, self.checkpoint_interval, self.max_queue = store, checkpoint_interval, max_queue
        self.prefill_chunk, self.prefill_buckets = prefill_chunk, list(prefill_buckets)
        self.speculative_tokens = speculative_tokens
        self.prefill_call_tokens = prefill_call_tokens  # a call's fixed cost in tokens (`first_piece`), or None
        self.counters = Counter() if counters is None else counters
        self.waiting: deque[RequestHandle] = deque()
        self.background: deque[RequestHandle] = deque()  # prefill-only work for idle time
        self.wake = threading.Condition()  # guards the two queues; notified when work arrives
        self.rows: list[Slot | None] = [None] * slots
        self.table = np.full((slots, pages_per_row), pool.num_pages, np.int32)  # num_pages: no page
        self._seq = itertools.count()

    # --- the queue (any thread) ---------------------------------------------------------
    def enqueue(self, handle: RequestHandle) -> None:
        with self.wake:
            if len(self.waiting) >= self.max_queue:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull(f"the queue is full ({self.max_queue} waiting requests)")
            self._supersede_background(handle.request)
            self.waiting.append(handle)
            self.counters["requests"] += 1
            self.wake.notify()

    def _supersede_background(self, req: GenerationRequest) -> None:
        """(Under `wake`.) A request overtakes the idle-time work that has not started: work whose
        prompt the request's starts with runs now, just before it (the request needs it); other
        work is dropped: the engine was not idle after all, and by the time it would start, the
        snapshot it was to continue may be evicted (measured: a 6-token guess became a 3,000-token
        prefill that held the next request for 2 s)."""
        while self.background:
            h = self.background.popleft()
            if shared_prefix([h.request], req) == len(h.request.prompt_ids):
                h.not_before = 0.0
                self.waiting.append(h)
            else:
                self.counters["background_superseded"] += 1
                h.finish("cancelled")

    def wish(self, handle: RequestHandle) -> None:
        """Idle-time work (from `handle.not_before` on); past the queue's bound the oldest wish
        goes (nobody waits for it); a request that comes first overtakes it (`enqueue`)."""
        with self.wake:
            if len(self.background) >= self.max_queue:
                self.background.popleft()
            self.background.append(handle)
            self.wake.notify()

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.rows)

    def has_work(self) -> bool:
        return bool(self.waiting or self.background or self.active)

    def work_due(self) -> bool:
        """Work the loop can do now (idle-time work only once its time has come)."""
        return bool(self.waiting or self.background_due() or self.active)

    def background_due(self) -> bool:
        return bool(self.background) and self.background[0].not_before <= time.perf_counter()

    def next_due_in(self) -> float | None:
        """Seconds until the idle-time work next in line may start (None: there is none)."""
        return self.background[0].not_before - time.perf_counter() if self.background else None

    def reset(self) -> None:
        """Forget every row and page (the engine's device state starts over)."""
        self.rows = [None] * self.slots
        self.pool.reset()
        self.table.fill(self.pool.num_pages)

    # --- admission ------------------------------------------------------------------------
    def free_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is None]

    def take(self, n: int) -> list[RequestHandle]:
        """Up to n waiting requests, oldest first; with none left waiting and a row to spare, one
        idle-time wish (unless a prompt is being prefilled: background work never delays one)."""
        with self.wake:
            batch = [self.waiting.popleft() for _ in range(min(n, len(self.waiting)))]
            if not self.waiting and len(batch) < n and self.background_due() and not self.prefilling():
                batch.append(self.background.popleft())
        return batch

    def yield_idle_work(self) -> None:
        """With every row taken and a request waiting, idle-time work still being prefilled gives
        its row up (at a call's end) unless that request continues it."""
        if self.free_rows() or not self.waiting:
            return
        first = self.waiting[0].request
        for slot in self.rows:
            if slot.background and slot.prefilling and shared_prefix([slot.handle.request], first) < len(slot.prompt):
                self.counters["background_superseded"] += 1
                slot.finished = True
                slot.handle.finish("cancelled")
                self.free(slot)

    def put_back(self, deferred: list[RequestHandle]) -> None:
        """Requests that could not start yet go back to the queue's front, in order."""
        with self.wake:
            self.waiting.extendleft(reversed(deferred))

    def wait_for_shared_prefix(self, req: GenerationRequest, hit) -> bool:
        """True if a prompt being prefilled shares more of `req`'s prefix than the store has: it is
        given a snapshot point there, and `req` waits for that snapshot instead of recomputing it."""
        if self.store is None:
            return False
        best = None
        for slot in self.rows:
            if slot is not None and slot.prefilling:
                n = shared_prefix([slot.handle.request], req)
                if n >= SHARE_MIN_TOKENS and n > hit.reused and slot.pos < n and (best is None or n > best[0]):
                    best = (n, slot)
        if best is None:
            return False
        n, slot = best
        if n not in slot.cuts:
            slot.cuts = sorted(slot.cuts + [n])
        return True

    def reserve(self, req: GenerationRequest, hit) -> Reservation | None:
        """Pages for `req` starting from the store's `hit`; None (nothing changed) when the pool
        cannot hold it yet. The snapshot's full pages are shared; its partial last page is copied
        (the row writes past it)."""
        size = self.pool.page_size
        snap = hit.snapshot if hit is not None else None
        start = hit.reused if snap is not None else 0
        shared = list(snap.pages[: start // size]) if snap is not None else []
        fresh = self.alloc(pages_for(len(req.prompt_ids) + req.max_tokens, size) - len(shared), keep=snap)
        if fresh is None:
            return None
        self.pool.retain(shared)
        copy = (snap.pages[start // size], fresh[0]) if start % size else None
        return Reservation(start, shared + fresh, copy, snap)

    def place(self, handle: RequestHandle, row: int, res: Reservation, decoder, constraint=None) -> Slot:
        """Put an admitted request in `row` with its reserved pages. Its prefill is cut at the
        checkpoints, at the end of its chat history and where a waiting request's prompt parts
        from it (that request then starts from the snapshot there)."""
        req = handle.request
        self.table[row] = self.pool.num_pages
        self.table[row, : len(res.pages)] = res.pages
        extra = [p for p in (req.history_len,) if p]
        with self.wake:
            waiting = [h.request for h in self.waiting]
        extra += [n for n in (shared_prefix(waiting, req),) if n >= SHARE_MIN_TOKENS]
        cuts = checkpoint_positions(res.start, len(req.prompt_ids), self.checkpoint_interval, extra)
        slot = Slot(handle, row, decoder, res.pages, res.start, cuts, next(self._seq), constraint=constraint)
        self.rows[row] = slot
        return slot

    def alloc(self, n: int, keep=None) -> list[int] | None:
        """n fresh pages, evicting snapshots by the store's policy (never `keep`) if the pool is short."""
        if n > self.pool.free and self.store is not None:
            held = keep.pages if keep is not None else ()
            self.pool.retain(held)  # the snapshot being restored must survive the eviction
            try:
                self.store.evict_until(lambda: self.pool.free >= n)
            finally:
                self.pool.release(held)
        try:
            return self.pool.alloc(n)
        except PoolExhausted:
            return None

    # --- prefill --------------------------------------------------------------------------
    def prefilling(self) -> bool:
        return any(s is not None and s.prefilling for s in self.rows)

    def prefill_call(self, widths: dict[int, list[int]]) -> PrefillCall | None:
        """The next prefill call: a chunk of each prompt being prefilled, oldest first and
        background work last, as many rows as a compiled bucket takes. `widths`: rows -> the chunk
        widths (ascending) a program exists for. A long prompt shares the token budget with short
        ones; each row's chunk ends at its next snapshot point."""
        live = [(slot.background, slot.seq, row, slot) for row, slot in enumerate(self.rows)
                if slot is not None and slot.prefilling]
        if not live:
            return None
        live.sort(key=lambda x: x[:2])
        n = max(r for r in widths if r <= len(live))  # rows this call: a whole bucket
        cap = min(self.prefill_chunk // n, widths[n][-1])
        chosen = [(row, slot, min(slot.cuts[0], slot.pos + cap) - slot.pos) for _, _, row, slot in live[:n]]
        if self.prefill_call_tokens is not None:  # no more padding than a call's fixed cost is worth
            fits = tuple(t for t in widths[n] if t <= cap)
            top = max(first_piece(c, fits, self.prefill_call_tokens) for _, _, c in chosen)
            chosen = [(row, slot, min(c, top)) for row, slot, c in chosen]
        need = max(c for _, _, c in chosen)
        width = next(t for t in widths[n] if t >= need)  # the smallest compiled width that holds it
        tokens = np.zeros((n, width), np.int32)
        counts = np.zeros((n,), np.int32)
        last = np.zeros((n,), bool)
        for i, (row, slot, c) in enumerate(chosen):
            tokens[i, :c] = slot.prompt[slot.pos : slot.pos + c]
            counts[i], last[i] = c, slot.pos + c == len(slot.prompt) and not slot.background
        rows = self.rows_array([row for row, _, _ in chosen], self.prefill_buckets)
        return PrefillCall(chosen, rows, tokens, counts, last, self.table_rows(rows))

    # --- decode ---------------------------------------------------------------------------
    def decode_rows(self, in_flight: int | None) -> list[int]:
        """The rows the next decode step feeds. A row whose last token (by max_tokens) the step in
        flight (`in_flight`: its index) draws sits it out: feeding that token would only add it to
        the response snapshot, and a request arriving next would wait for the step on the device."""
        def drawing_last(slot: Slot) -> bool:
            pending = in_flight is not None and slot.last_step == in_flight
            return len(slot.handle.token_ids) + pending >= slot.handle.request.max_tokens

        return [r for r, slot in enumerate(self.rows) if slot is not None and not slot.prefilling
                and not drawing_last(slot)]

    def constrained_decoding(self) -> bool:
        return any(s is not None and s.constraint is not None and not s.prefilling for s in self.rows)

    def ends(self, slot: Slot, step: int, n: int, idle: bool, done: bool) -> tuple[int, int]:
        """(least, most) tokens in the row's cache once every dispatched step has run, from step
        `step`'s outputs (n: the row's length after it; idle: its last token is fed; done: it draws
        no more, on the device). Only the step after it (dispatched before these outputs were read)
        can move the row: a row it feeds that is done or that it does not draft for takes one token
        (its pending one); one it drafts for takes 1 to K + 1."""
        if slot.last_step <= step or idle:
            return n, n
        if done or not slot.last_drafting:
            return n + 1, n + 1
        return n + 1, n + 1 + self.speculative_tokens

    # --- rows and pages -----------------------------------------------------------------
    def free(self, slot: Slot) -> None:
        """Free the row and its pages (a snapshot taken before keeps its own hold). Safe while a
        dispatched step still runs on the row: device work runs in dispatch order."""
        self.rows[slot.row] = None
        self.pool.release(slot.pages)

    def rows_array(self, rows: list[int], sizes: Sequence[int]) -> np.ndarray:
        """`rows` padded to a bucket of `sizes` with an out-of-range row (the device skips it)."""
        out = np.full((bucket(len(rows), sizes),), self.slots, np.int32)
        out[: len(rows)] = rows
        return out

    def table_rows(self, rows: np.ndarray) -> np.ndarray:
        """The page tables of `rows` (padding rows: no pages)."""
        out = np.full((len(rows), self.pages_per_row), self.pool.num_pages, np.int32)
        real = rows < self.slots
        out[real] = self.table[rows[real]]
        return out

    def snapshot_pages(self, slot: Slot, length: int, copy_partial: bool) -> tuple[list[int], tuple | None] | None:
        """The pages a snapshot of the row's first `length` tokens holds: its full pages by id and
        a partial last page either copied to a fresh page (the row still writes into it: returned
        as (source, copy)) or, when the row is done writing, by id. None: no page for the copy."""
        size = self.pool.page_size
        pages = slot.pages[: length // size]
        if not length % size:
            return pages, None
        if not copy_partial:
            return slot.pages[: pages_for(length, size)], None
        fresh = self.alloc(1)
        if fresh is None:
            return None
        return pages + fresh, (slot.pages[length // size], fresh[0])


class SpecPolicy:
    """Adaptive speculation: a drafting step runs only while it pays. A drafting step of a batch
    bucket costs more than a plain one (K + 1 tokens verified per row, the MTP head) and gains
    1 + accepted drafts per row against 1: which wins depends on the acceptance and on the batch
    (measured on the embedded default on CPU, benchmarks/bench_speculative.py, drafting every
    step: 1.2-1.5x the plain engine at one stream, 0.6-1.0x at four). So the host keeps, per bucket, a moving average of
    each kind's step time (dispatch to outputs, or previous outputs to outputs while the device
    is busy) and of the tokens a drafting row gains, drafts when gain / t_draft >= 1 / t_plain,
    and runs the other kind now and then so that both estimates stay current: after PROBE steps,
    then after twice as many each time the probe leaves the choice as it was (up to MAX_PROBE),
    back to PROBE when the choice flips (as `speculative`'s library mode backs off). A probe
    costs (t_draft / t_plain - 1) plain steps: with a fixed gap of 16 and drafting steps of
    1.4-2.3 plain ones (CPU time, benchmarks/bench_speculative.py --model wide --head random,
    K = 1..4, one stream) that is 3-8% at low acceptance, against the 5% allowed; backing off to
    64 bounds it by 1-2% once the choice has settled (measured: 0.96x K = 0 at every K, 2% of
    steps drafting), and still notices within 64 steps that drafting began to pay."""

    PROBE, MAX_PROBE = 16, 64

    def __init__(self):
        self.time: dict = {}  # (speculative, bucket) -> seconds per step
        self.gain = 2.0  # tokens per drafting row per step (optimistic start: try drafting)
        self.best: bool | None = None  # the kind the estimates chose last
        self.since = 0  # steps since the last probe (or since the choice flipped)
        self.gap = self.PROBE

    def draft(self, bucket: int) -> bool:
        t_spec, t_plain = self.time.get((True, bucket)), self.time.get((False, bucket))
        if t_spec is None or t_plain is None:  # measure both kinds first
            return t_spec is None
        best = self.gain / t_spec >= 1.0 / t_plain
        if best != self.best:
            self.best, self.since, self.gap = best, 0, self.PROBE
        self.since += 1
        if self.since < self.gap:
            return best
        self.since, self.gap = 0, min(2 * self.gap, self.MAX_PROBE)  # probe the other kind
        return not best

    def record(self, speculative: bool, bucket: int, seconds: float, gain: float | None) -> None:
        key = (speculative, bucket)
        self.time[key] = seconds if key not in self.time else 0.8 * self.time[key] + 0.2 * seconds
        if gain is not None:
            self.gain = 0.8 * self.gain + 0.2 * gain
