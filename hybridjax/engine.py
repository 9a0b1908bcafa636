"""The engine: continuous batching over a fixed number of slots, KV in a shared page pool,
prompts prefilled in chunks between decode steps, and exact-prefix snapshot reuse.

One background thread owns the device state (`hybridjax.engine_steps.EngineState`: every
slot's recurrent state, sampler and logits, and the KV page pool) and carries out what the host
scheduler (`hybridjax.scheduler`: the queue, the rows, the pages, the plan of each call; no JAX)
decides. Each loop iteration
  1. admits waiting requests into free slots: one pass over the snapshot store finds each
     one's longest cached prefix; the slot gets the snapshot's full KV pages by id, a copy of
     its partial last page, its recurrent state and logits, and fresh pages for the rest of
     the prompt and the response; an exact hit draws its first token at once, no model call;
  2. runs one prefill call of at most `prefill_chunk` tokens, shared by the prompts being
     prefilled (several rows when their chunks fit together); a chunk ends at a snapshot
     point (checkpoint, end of the chat history, a prefix shared with another request, the end
     of the prompt) where the row's snapshot is taken: full pages shared, the partial page
     copied, the row's state as the call returned it; a prompt's last chunk draws its first
     token, which is sent at once, before the call's snapshots are stored;
  3. dispatches one decode step for the rows that are decoding (a batch bucket of them: idle
     slots cost nothing; a row whose last token by max_tokens is being drawn sits out), then,
     while it runs, delivers the previous step's tokens: text, stop strings, finishes. A
     finished row leaves its response snapshot (its pages, by id) and frees its slot.
So a running stream waits at most one prefill chunk for a long prompt, and the host's work
overlaps the device's. With `speculative_tokens` K, step 3 is a speculative step
(`engine_steps.spec_decode`: K drafts of the MTP head verified in one forward), and a row
delivers 1 to K + 1 tokens per step (docs/architecture.md, "Speculative decoding in the engine").

Every shape the loop runs is an executable of `hybridjax.engine_programs`, compiled ahead or
loaded from disk; a live request never compiles. Started with `warmup`, the engine serves as soon
as a covering set exists (`engine_startup.Shapes.covering`: one decode bucket, the smallest prefill
chunk, the largest draw, the per-request helpers) and compiles the rest behind, in a thread; until
a bucket exists, its work runs padded to a larger compiled bucket or split into smaller chunks.
A decode step or prefill chunk is two programs: the model's, then the draw's (the sampler, compiled
once per row count rather than into each model program).
Requests are independent rows: greedy output does not depend on the batch or on cache hits.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import functools
import itertools
import logging
import threading
import time
import weakref
from collections import Counter
from typing import Sequence

import jax
import numpy as np

from hybridjax import compile_cache
from hybridjax import engine_programs as programs
from hybridjax import engine_steps as steps
from hybridjax.config import Config
from hybridjax.engine_requests import (Event, GenerationRequest, InvalidRequest, QueueFull,  # noqa: F401 (API)
                                       RequestHandle, check_request)
from hybridjax.engine_startup import Compiles, Shapes
from hybridjax.pages import DEFAULT_PAGE_SIZE, PagePool, page_bytes, pages_for
from hybridjax.params import Params
from hybridjax.prefix_cache import SnapshotStore
from hybridjax.token_ids import Tokens
from hybridjax.sampling import bias_row, sampling_params
from hybridjax.scheduler import PREFILL_CALL_TOKENS, Scheduler, Slot, SpecPolicy, bucket, buckets
from hybridjax.tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger(__name__)

_WARMUP_LOCK = threading.Lock()
_STARTED: "weakref.WeakSet[Engine]" = weakref.WeakSet()  # engines whose threads may be compiling


@atexit.register
def _end_compiles() -> None:
    """XLA aborts a process that finalizes while another thread compiles: at exit, cancel the
    engines' compiling and wait for the compile under way (a process in a hurry leaves by
    os._exit, as the server's CLI does on an interrupt)."""
    for eng in list(_STARTED):
        eng._cancel.set()
        for t in eng._compiling_threads():
            t.join()


@dataclasses.dataclass
class _Step:
    """A dispatched decode step whose outputs the host has not read yet."""

    index: int
    slots: list  # Slot per row of the call (None for padding)
    outputs: tuple  # device arrays: tokens, done, lengths [R] (a speculative step: see spec_decode)
    speculative: bool = False  # a drafting step (`steps.spec_decode`)
    started: float = 0.0  # perf_counter at dispatch
    after_prefill: bool = False  # a prefill chunk ran just before it (its time is not the step's own)


def _draw_of(drawn: "steps.Drawn", i: int, slot: Slot) -> tuple[int, tuple]:
    """(token, (logprob, top alternatives) or ()) of row i of a step's draws, read from the device
    (the log-probabilities only when the request asked for them)."""
    token = int(np.asarray(drawn.tokens)[i])
    k = slot.handle.request.logprobs
    if k is None:
        return token, ()
    top = zip(np.asarray(drawn.top_ids)[i, :k].tolist(), np.asarray(drawn.top_logprobs)[i, :k].tolist())
    return token, (float(np.asarray(drawn.logprob)[i]), tuple(top))


def snapshot_tokens(prompt: np.ndarray, drawn: list[int], length: int) -> Tokens:
    """The first `length` tokens of prompt + drawn as the store's key: within the prompt a prefix
    of the request's one read-only array (no copy of the context per checkpoint); past it (a
    response) a new array."""
    if length <= len(prompt):
        return Tokens(prompt, length)
    return Tokens.of(np.concatenate([prompt, np.asarray(drawn[: length - len(prompt)], np.int32)]))


def request_row_args(cfg: Config, req: GenerationRequest, length: int = 0) -> tuple:
    """What `engine_steps.setup_row` takes after (state, row, gdn, logits) for a request whose
    row starts at `length` cached tokens: length, sampling parameters, seed, seen tokens,
    budget, stop ids, wants log-probabilities, logit bias [vocab], min tokens."""
    sp = sampling_params(1, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                         repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                         frequency_penalty=req.frequency_penalty)
    seen = np.zeros((cfg.vocab_size,), bool)
    seen[req.prompt_array] = True
    stops = np.full((steps.MAX_STOPS,), -1, np.int32)
    ids = list(dict.fromkeys(req.stop_ids))[: steps.MAX_STOPS]
    stops[: len(ids)] = ids
    return (np.int32(length), sp, np.uint32(req.seed % 2**32), seen, np.int32(req.max_tokens), stops,
            np.bool_(req.logprobs is not None), bias_row(cfg.vocab_size, req.logit_bias), np.int32(req.min_tokens))



def setup_row(calls, cfg: Config, state, row: int, gdn, logits, length: int, req: GenerationRequest,
              row_args: tuple | None = None):
    """`engine_steps.setup_row` for a request whose row starts at `length` cached tokens (from the
    snapshot's recurrent state `gdn` and `logits`, or None: a fresh row). `row_args`: the
    request's `request_row_args` made ahead (any length: it is replaced), else made here."""
    args = request_row_args(cfg, req, length) if row_args is None else (np.int32(length),) + tuple(row_args[1:])
    return calls.setup_row(state, np.int32(row), gdn, logits, *args)


# A first run off the loop pays ahead, by running the program whole, the 0.1-0.4 s an executable's
# first run adds. Worth it for a call of about that cost or less. A wider prefill or scoring piece
# (a forward of seconds on a large model) gets no first run ahead: the loop runs it when a request
# needs it, and that request pays the extra (0.2-0.4 s for the 0.23B model's prefills, whose 1x256
# takes ~0.9 s a call: measured from disk, first and later calls, benchmarks/README.md; it is
# XLA:CPU's YNNPACK building its fusions' runtime at the first run. Compiled without those fusions,
# the first run was as the later ones, but every later call ran ~7% slower: bench_first_run.py). Made
# ahead, its first runs took the cores from the requests being served (the XLA threads that run a
# program are not the compiling thread's, which yields the CPU) for 25 s and more after a warm
# restart, and before, a long prompt went in 16-token chunks while the 1x256's ran (2.70x the later
# ones). The line: parameters x tokens of one call, 2e10 FLOPs, ~0.15 s at this CPU's ~150 GFLOP/s
# in float32 (the default model's widest prefill is 0.2x it, the 0.23B's 1x64 1.5x).
EAGER_PREFILL_WORK = 1e10


def runs_before_its_first_run(n_params: int, shape: tuple) -> bool:
    """Whether `shape` runs without a first run made ahead (a wide prefill or scoring piece)."""
    name, rows, tokens = shape
    return name in ("prefill", "score") and n_params * rows * tokens > EAGER_PREFILL_WORK


# The scoring program's first run keeps its max_len cache for the first echo when it is at most
# this large: made once at start-up instead of by that echo (device_put of zeros and fresh pages:
# ~10 ms of a 45 ms echo on the default model, 8 MB). A larger one (a long context of a large
# model: a GB and more) is made when a client first echoes, and not held for clients who never do.
KEEP_FIRST_SCORE_CACHE_BYTES = 64 << 20


def first_runs_off_the_loop(state_bytes: int) -> bool:
    """Whether the programs made behind take their first runs on the compiling thread, on a
    scratch engine state (`Engine._first_run_on_scratch`), rather than on the loop: on CPU, where a
    first run costs 0.1-0.4 s, when a second state of `state_bytes` takes at most a quarter of the
    memory available now (it lives while the programs behind are made)."""
    if jax.default_backend() != "cpu":
        return False
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):  # not Linux: keep them on the loop
        return False
    return state_bytes <= available // 4


class DeviceLoop:
    """What the engine thread does, one iteration at a time (`step`): admit the waiting requests,
    run one prefill call, dispatch one decode step and deliver the previous one's tokens. It owns
    the device state (`state`) and carries out what the `Scheduler` plans; every call goes through
    `calls` on a shape of `shapes` that `has` says exists (None: any)."""

    def __init__(self, cfg: Config, params: Params, tokenizer: Tokenizer | None, calls, sched: Scheduler,
                 shapes: Shapes, state, *, store: SnapshotStore | None, counters: Counter, speculative_tokens: int,
                 implementation, policy: SpecPolicy | None):
        self.cfg, self.params, self.tokenizer, self.calls = cfg, params, tokenizer, calls
        self.sched, self.shapes, self.state = sched, shapes, state
        self.store, self.counters, self.speculative_tokens = store, counters, speculative_tokens
        self.implementation, self.policy = implementation, policy
        self.has = None  # which shapes may run: None (all), or the compiled programs' `has`
        self._every_prefill = shapes.ready_prefill(None)  # rows -> every prefill width, once all exist
        self.inflight: _Step | None = None
        self._steps = itertools.count()
        self._waiting_snapshots: dict[int, list] = {}  # step index -> response snapshots its outputs decide
        self._prefilled = False  # a prefill chunk was dispatched since the last decode step
        self._last_done: float | None = None  # when the host last read a step's outputs

    def step(self) -> None:
        """One iteration: the host's work overlaps the device's (the decode step dispatched here
        runs while the previous one's tokens are delivered)."""
        self._admit()
        self._prefill()
        if self.inflight is not None and self.sched.constrained_decoding():
            # A constrained row's next mask needs the token in flight: no overlap.
            self._process(self.inflight)
            self.inflight = None
        step = self._dispatch()
        if self.inflight is not None:
            self._process(self.inflight)
        self.inflight = step

    def drain(self) -> None:
        """The engine stops: deliver the step in flight, cancel every running request."""
        if self.inflight is not None:
            self._process(self.inflight)
            self.inflight = None
        for slot in self.sched.rows:
            if slot is not None:
                self._end(slot, "cancelled")

    def fail(self) -> None:
        """Fail every running request and forget every row and page: a failed step may have
        consumed (donated) the pool, so the snapshots that name its pages go too. The caller
        starts over with a fresh device state."""
        self.counters["errors"] += 1
        for slot in self.sched.rows:
            if slot is not None:
                self.counters["finished_error"] += 1
                slot.handle.finish("error")  # the server reads it (500, not a 200 with no reason)
        self.inflight = None
        if self.store is not None:
            self.store.clear()
        self._waiting_snapshots.clear()
        self.sched.reset()

    def run_on_padding(self, shape: tuple) -> None:
        """Run `shape`'s program once on rows that do not exist (row `slots`: every write is
        dropped, nothing changes) and wait for it: compiles a jitted call, and pays an
        executable's first-run cost (0.1-0.4 s more on CPU) before any request would."""
        self.state = self.padding_run(shape, self.state)

    def padding_run_needs(self, shape: tuple) -> tuple[tuple, ...]:
        """The other programs `padding_run(shape)` calls: a row read, for a set-up from a snapshot;
        a draw, after a decode step (the largest: it serves any)."""
        if shape[0] == "setup_row_snapshot":
            return (("read_row", 1, 0),)
        return (("draw", self.shapes.draw_buckets[-1], 0),) if shape[0] == "decode" else ()

    def padding_run(self, shape: tuple, state):
        """`run_on_padding` on `state` (the engine's, or a scratch one of its shapes: the
        engine's first runs off its thread): returns the state after it."""
        name, r, t = shape
        slots, pages = self.sched.slots, self.sched.pages_per_row
        pad = np.full((r,), slots, np.int32)
        table = np.full((r, pages), self.sched.pool.num_pages, np.int32)
        s = state
        if name == "decode":
            out, s = self.calls.decode(self.params, s, pad, table, self.cfg, self.implementation)
        elif name == "spec_decode":
            out, s = self.calls.spec_decode(self.params, s, pad, table, self.cfg, self.speculative_tokens,
                                            self.implementation)
        elif name == "draw":  # its own program of r rows, where calls are executables; else the steps'
            draw = getattr(self.calls, "draw", None)
            out, *_, s = (draw(s, pad, np.ones((r,), bool), exact=True) if draw is not None
                          else self.calls.sample_first(s, pad))
        elif name == "set_bits":
            out = s = self.calls.set_bits(s, pad, np.full((r, steps.mask_words(self.cfg.vocab_size)), -1, np.int32))
        elif name == "prefill":
            _, out, s = self.calls.prefill_chunk(self.params, s, pad, np.zeros((r, t), np.int32), np.zeros((r,), np.int32),
                                                 table, np.zeros((r,), bool), self.cfg, self.implementation)
        elif name.startswith("setup_row"):
            gdn, logits = self.calls.read_row(s, 0) if name.endswith("snapshot") else (None, None)
            s = setup_row(self.calls, self.cfg, s, slots, gdn, logits, 0, GenerationRequest([0], 1))
            out = s.lengths
        elif name == "read_row":
            out = self.calls.read_row(s, 0)
        elif name == "copy_page":
            out = s = self.calls.copy_page(s, self.sched.pool.num_pages, self.sched.pool.num_pages)
        else:
            raise ValueError(f"no padding run for {name}")
        jax.block_until_ready(out)
        return s

    # --- admission ------------------------------------------------------------------------
    def _admit(self) -> None:
        self.sched.yield_idle_work()
        free = self.sched.free_rows()
        batch = [h for h in self.sched.take(len(free)) if not self._drop_if_cancelled(h)]
        if not batch:
            return
        reqs = [h.request for h in batch]
        hits = (self.store.lookup_many([Tokens(r.prompt_array) for r in reqs], [r.namespace for r in reqs])
                if self.store is not None else [None] * len(batch))
        deferred, blocked = [], False
        for handle, hit in zip(batch, hits):
            # Waiting for pages keeps the queue's order; waiting for a shared prefix's snapshot
            # (which another row is about to take) holds back only this request.
            if blocked or self.sched.wait_for_shared_prefix(handle.request, hit):
                deferred.append(handle)
                continue
            try:
                if not self._start(handle, hit, free[0]):
                    deferred.append(handle)
                    blocked = True
                else:
                    free.pop(0)
            except Exception:
                log.exception("admission failed")
                self.counters["errors"] += 1
                self.counters["finished_error"] += 1
                handle.finish("error")  # as in `fail`: the handle must say how it ended
        self.sched.put_back(deferred)

    def _drop_if_cancelled(self, handle: RequestHandle) -> bool:
        if handle.cancelled.is_set():
            self.counters["finished_cancelled"] += 1
            handle.finish("cancelled")
            return True
        return False

    def _start(self, handle: RequestHandle, hit, row: int) -> bool:
        """Set up `row` for a request; False (nothing changed) when the pool cannot hold it yet."""
        req = handle.request
        res = self.sched.reserve(req, hit)
        if res is None:
            return False
        if res.copy is not None:  # the snapshot's partial last page: copied, since this row writes past it
            self.state = self.calls.copy_page(self.state, *res.copy)
        snap = res.snapshot
        self.state = setup_row(self.calls, self.cfg, self.state, row, snap.cache if snap else None,
                               snap.logits if snap else None, res.start, req, handle.row_args)
        constraint = None
        if req.grammar is not None:
            constraint = self.grammars.matcher(req.grammar)
            self._set_masks([row], [constraint])
        handle.cached_tokens = res.start
        if hit is not None and hit.report is not None:
            handle.cache_report = hit.report
        if req.max_tokens:  # a request someone sent (not a background prefill): counted by its report
            self.counters[f"cache_reason_{handle.cache_report.label}"] += 1
        # Special tokens stay in the text (stop tokens never reach it), so a client re-sending
        # the response re-encodes it to the same ids and hits the response snapshot.
        decoder = StreamDecoder(self.tokenizer, skip_special_tokens=False) if self.tokenizer else None
        slot = self.sched.place(handle, row, res, decoder, constraint)
        handle.admitted.set()
        if slot.background and not slot.prefilling:  # background work whose snapshot exists already
            self._end_background(slot)
        elif not slot.prefilling:  # an exact hit: the stored logits give the first token, no model call
            drawn, _, self.state = self.calls.sample_first(self.state,
                                                           self.sched.rows_array([row], self.shapes.decode_buckets))
            self._deliver(slot, *_draw_of(drawn, 0, slot), res.start, moving=False, ends=(res.start, res.start))
        return True

    @functools.cached_property
    def grammars(self):
        """The grammar compiler of this engine's tokenizer and vocabulary (hybridjax.grammar)."""
        from hybridjax.grammar import Compiler

        if self.tokenizer is None:
            raise ValueError("constrained decoding needs a tokenizer")
        return Compiler(self.tokenizer.backend.to_str(), self.cfg.vocab_size,
                        tuple(self.tokenizer.eos_token_ids) + tuple(self.cfg.eos_token_id))

    def _set_masks(self, rows: list[int], constraints: list) -> None:
        """Each constrained row's mask for the token it draws next (padding rows allow everything)."""
        sizes = self.shapes.ready_buckets("set_bits", 0, self.has)
        bits = np.full((bucket(len(rows), sizes), steps.mask_words(self.cfg.vocab_size)), -1, np.int32)
        for i, c in enumerate(constraints):
            bits[i] = c.bits
        self.state = self.calls.set_bits(self.state, self.sched.rows_array(rows, sizes), bits)

    # --- prefill --------------------------------------------------------------------------
    def _prefill(self) -> None:
        """One prefill call: a chunk of each prompt being prefilled, as many rows as fit the budget."""
        for slot in [s for s in self.sched.rows if s is not None and s.prefilling and s.handle.cancelled.is_set()]:
            self._end(slot, "cancelled")
        widths = self.shapes.ready_prefill(self.has)
        call = self.sched.prefill_call(widths)
        if call is None:
            return
        self._prefilled = True
        drawn, reads, self.state = self.calls.prefill_chunk(self.params, self.state, call.rows, call.tokens,
                                                             call.counts, call.table, call.last, self.cfg,
                                                             self.implementation)
        if widths != self._every_prefill:
            # Some widths are still being made (start-up): one call on the device at a time, so
            # that the rest of a long prompt takes a wider chunk as soon as one exists, instead of
            # all of it queued in 16-token calls (the 0.23B model's first 600-token prompt after a
            # restart: 10-13 s, ~4 s paced; benchmarks/README.md).
            jax.block_until_ready(self.state)
        self.counters["prefill_chunks"] += 1
        self.counters["tokens_prefilled"] += int(call.counts.sum())
        due = [slot.advance(c) for _, slot, c in call.chosen]
        if self.store is not None:
            self.store.counters["tokens_prefilled"] += int(call.counts.sum())
        # Each prompt's first token is sent before any snapshot is stored: the snapshots' host
        # work is not the client's wait. A row that token ends is closed only after, since its
        # snapshot holds its pages; no device work runs in between, so it reads this call's state.
        finishes = [self._send(slot, *_draw_of(drawn, i, slot)) if call.last[i] else None
                    for i, (_, slot, _) in enumerate(call.chosen)]
        for i, ((row, slot, _), snapshot, finish) in enumerate(zip(call.chosen, due, finishes)):
            if snapshot:
                self._snapshot(slot, row, slot.snapshot_kind(), read=reads[i])
            if not slot.prefilling and slot.background:
                self._end_background(slot)
            elif finish:
                self._finish(slot, finish, slot.pos, moving=False, ends=(slot.pos, slot.pos))

    def _end_background(self, slot: Slot) -> None:
        """A background prefill ends: counted apart, not as a finished request (nobody sent it)."""
        slot.finished = True
        self.counters["background_prefills"] += 1
        slot.handle.finish("stop")
        self.sched.free(slot)

    def _snapshot(self, slot: Slot, row: int, kind: str, length: int | None = None, copy_partial: bool = True,
                  ends: tuple[int, int] | None = None, read: tuple | None = None) -> None:
        """Store the row's state after its first `length` tokens: full pages by id; a partial
        last page copied (the row still writes into it) unless the row is done writing.
        ends: a response's (least, most) cache length once the dispatched steps have run
        (`Scheduler.ends`): a speculative engine snapshots a response only if that is `length`.
        read: the row's (gdn, logits) now, from the prefill call that ended here (else read)."""
        if self.store is None:
            return
        length = slot.pos if length is None else length
        wait = False  # a speculative response: the step in flight decides (below)
        if self.speculative_tokens and kind == "response":
            if not ends[0] <= length <= ends[1]:
                # The row ran past the response's end (a stop string seen by the host after the
                # row accepted more drafts): the state at `length` is gone, so no snapshot.
                self.counters["snapshots_skipped_speculative"] += 1
                return
            wait = ends[0] != ends[1]
        held = self.sched.snapshot_pages(slot, length, copy_partial)
        if held is None:
            self.counters["snapshots_skipped_no_pages"] += 1
            return
        pages, copy = held
        if copy is not None:
            self.state = self.calls.copy_page(self.state, *copy)
        gdn, logits = read if read is not None else self.calls.read_row(self.state, row)
        tokens = snapshot_tokens(slot.handle.request.prompt_array, slot.drawn, length)
        insert = functools.partial(self.store.insert, tokens, gdn, logits, namespace=slot.handle.request.namespace,
                                   kind=kind, pages=pages)
        if wait:
            # A drafting step in flight feeds the row (the host saw a stop the device did not):
            # it ends at `length` only if it accepts no draft, which its outputs will say. The
            # state read now is the state after it (device work runs in dispatch order); its
            # pages are held until then. Asking the device now would wait for the step.
            self.sched.pool.retain(pages)
            self._waiting_snapshots.setdefault(slot.last_step, []).append((slot, length, insert, pages))
            self.counters["spec_snapshots_waiting"] += 1
        else:
            insert()
        if copy is not None:
            self.sched.pool.release([copy[1]])  # the store holds it now (or nobody, if it kept an equal older entry)

    def _settle_snapshots(self, step: _Step, lengths: np.ndarray) -> None:
        """The response snapshots that waited for `step` (`_snapshot`): stored if the step left
        the row's cache at the response's end, else skipped."""
        for slot, length, insert, pages in self._waiting_snapshots.pop(step.index, ()):
            if int(lengths[step.slots.index(slot)]) == length:
                insert()
            else:
                self.counters["snapshots_skipped_speculative"] += 1
            self.sched.pool.release(pages)

    # --- decode ---------------------------------------------------------------------------
    def _dispatch(self) -> _Step | None:
        """Dispatch one decode step for the rows `Scheduler.decode_rows` names (asynchronous:
        returns at once)."""
        rows = self.sched.decode_rows(self.inflight.index if self.inflight is not None else None)
        if not rows:
            return None
        index = next(self._steps)
        has, k = self.has, self.speculative_tokens
        arr = self.sched.rows_array(rows, self.shapes.ready_buckets("spec_decode" if k else "decode", k + 1, has))
        constrained = [r for r in rows if self.sched.rows[r].constraint is not None]
        if constrained:  # each constrained row's mask for the token this step draws
            self._set_masks(constrained, [self.sched.rows[r].constraint for r in constrained])
        # Constrained rows decode without drafts: a draft would need the mask after tokens not drawn yet.
        draft = k > 0 and not constrained and (self.policy is None or self.policy.draft(len(arr)))
        if not draft and k:  # the adaptive policy's plain step: its own buckets
            arr = self.sched.rows_array(rows, self.shapes.ready_buckets("decode", 1, has))
        started = time.perf_counter()
        table = self.sched.table_rows(arr)
        if draft:
            outputs, self.state = self.calls.spec_decode(self.params, self.state, arr, table, self.cfg, k,
                                                          self.implementation)
            self.counters["spec_verify_steps"] += 1
        else:
            outputs, self.state = self.calls.decode(self.params, self.state, arr, table, self.cfg, self.implementation)
        slots = [self.sched.rows[r] if r < self.sched.slots else None for r in arr]
        for s in slots:
            if s is not None:
                s.last_step, s.last_drafting = index, draft
        self.counters["steps"] += 1
        step = _Step(index, slots, outputs, draft, started, self._prefilled)
        self._prefilled = False
        return step

    def _process(self, step: _Step) -> None:
        """Deliver a finished step's tokens (the next step may already be running)."""
        if step.speculative:
            return self._process_speculative(step)
        drawn, done, lengths = step.outputs[0], np.asarray(step.outputs[1]), np.asarray(step.outputs[2])
        self._timed(step, None)
        self._settle_snapshots(step, lengths)
        for i, slot in enumerate(step.slots):
            if slot is None or slot.finished:
                continue
            if slot.handle.cancelled.is_set():
                self._end(slot, "cancelled")
                continue
            n = int(lengths[i])
            self._deliver(slot, *_draw_of(drawn, i, slot), n, moving=slot.last_step > step.index,
                          ends=self.sched.ends(slot, step.index, n, False, bool(done[i])))  # it drew: not idle

    def _process_speculative(self, step: _Step) -> None:
        """`_process` for a speculative step: each row drew 0 .. K+1 tokens. Those before the
        last are accepted drafts, already in the row's cache; the last is too when the row went
        idle (it stopped on a draft), else it is the pending token the next step feeds."""
        drawn, count, accepted, drafting, lengths, idle, done = jax.device_get(step.outputs)
        self._settle_snapshots(step, lengths)
        k = self.speculative_tokens
        rows = int(drafting.sum())
        self._timed(step, 1 + int(accepted.sum()) / rows if rows else None)
        for i, slot in enumerate(step.slots):
            if slot is None:
                continue
            self.counters["spec_drafted_tokens"] += k * int(drafting[i])
            self.counters["spec_accepted_tokens"] += int(accepted[i])
            if slot.finished:
                continue
            if slot.handle.cancelled.is_set():
                self._end(slot, "cancelled")
                continue
            c, n = int(count[i]), int(lengths[i])
            fed = c if idle[i] else c - 1  # tokens drawn this step that the cache now covers
            ends = self.sched.ends(slot, step.index, n, bool(idle[i]), bool(done[i]))
            want = slot.handle.request.logprobs
            for j in range(c):
                lp = ()
                if want is not None:
                    top = zip(drawn.top_ids[i, j, :want].tolist(), drawn.top_logprobs[i, j, :want].tolist())
                    lp = (float(drawn.logprob[i, j]), tuple(top))
                if j < fed:  # in the cache at position n - fed + j
                    self._deliver(slot, int(drawn.tokens[i, j]), lp, n - fed + j, moving=True, ends=ends)
                else:
                    self._deliver(slot, int(drawn.tokens[i, j]), lp, n, moving=slot.last_step > step.index, ends=ends)
                if slot.finished:
                    break

    def _timed(self, step: _Step, gain: float | None) -> None:
        """Tell the adaptive policy what the step cost (its outputs are on the host now)."""
        done = time.perf_counter()
        if self.policy is not None and not step.after_prefill:
            start = max(step.started, self._last_done) if self._last_done is not None else step.started
            self.policy.record(step.speculative, len(step.slots), done - start, gain)
        self._last_done = done

    # --- delivery and the end of a request -------------------------------------------------
    def _deliver(self, slot: Slot, token: int, logprobs: tuple, length: int, moving: bool,
                 ends: tuple[int, int]) -> None:
        """Send one drawn token. `length`: the row's cache length when it was drawn; `moving`: a
        step already dispatched feeds it (the next step feeds a finished row's last token too);
        `ends`: the row's (least, most) cache length once the dispatched steps have run."""
        finish = self._send(slot, token, logprobs)
        if finish:
            self._finish(slot, finish, length, moving, ends)

    def _send(self, slot: Slot, token: int, logprobs: tuple) -> str | None:
        """Send one drawn token to the client; the finish reason it brings, or None."""
        if logprobs:
            slot.handle.logprobs.append(logprobs)
        self.counters["tokens_generated"] += 1
        send, finish = slot.accept(token)
        slot.handle._emit(Event(token, send, None, *logprobs))
        return finish

    def _finish(self, slot: Slot, reason: str, length: int, moving: bool, ends: tuple[int, int]) -> None:
        """The response ends (`_deliver`'s arguments): close it, store its snapshot, free the row."""
        self._close(slot, reason)
        # The response snapshot covers what the row's cache will cover: every token sent when
        # a dispatched step feeds the last one (a response that ends while decoding), else
        # all but the last (one that ends at its first token: the prompt's snapshot already).
        # The snapshot is read after that step: device work runs in dispatch order.
        self._snapshot(slot, slot.row, "response", length=length + int(moving), copy_partial=False, ends=ends)
        self.sched.free(slot)

    def _close(self, slot: Slot, reason: str) -> None:
        """The client gets its finish event."""
        slot.finished = True
        self.counters[f"finished_{reason}"] += 1
        slot.handle.finish(reason)

    def _end(self, slot: Slot, reason: str) -> None:
        """Close and free the row (a cancelled or stopped request: no response snapshot)."""
        self._close(slot, reason)
        self.sched.free(slot)


class Engine:
    def __init__(self, cfg: Config, params: Params, tokenizer: Tokenizer | None, *, slots: int = 4,
                 max_len: int = 4096, store: SnapshotStore | None = None, checkpoint_interval: int = 0,
                 max_queue: int = 64, page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None,
                 prefill_chunk: int = 256, prefill_rows: int = 4, speculative_tokens: int = 0,
                 speculative_adaptive: bool = False, calls=None, executable_dir: str | None = None):
        """`calls`: where the steps come from; by default the executables of this configuration
        (`engine_programs.CompiledCalls`), kept on disk under `executable_dir` when given. Every
        device program the engine runs goes through it (the seam a multi-process server uses to
        replay process 0's steps on the others: hybridjax.multihost, whose calls are jitted
        functions compiled by running them)."""
        if slots < 1 or max_len < 2:
            raise ValueError("engine: slots must be >= 1 and max_len >= 2")
        if prefill_chunk < 16 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"engine: prefill_chunk must be a power of two >= 16, got {prefill_chunk}")
        if speculative_tokens:
            from hybridjax.speculative import check_speculative

            check_speculative(params, speculative_tokens)
        self.speculative_tokens = speculative_tokens  # K drafts per decode step (0: plain decoding)
        # adaptive: plain steps while drafting does not pay (`SpecPolicy`); else every step drafts.
        # Off by default: its choices follow measured times, so a seeded sampled request is no
        # longer reproducible, and on the shared CPU it did not beat drafting every step clearly.
        policy = SpecPolicy() if speculative_tokens and speculative_adaptive else None
        self.cfg, self.params, self.tokenizer = cfg, params, tokenizer
        self.slots, self.max_len, self.prefill_chunk = slots, max_len, prefill_chunk
        self.store, self.checkpoint_interval, self.max_queue = store, checkpoint_interval, max_queue
        self.calls = steps if calls is None else calls
        if speculative_tokens and not hasattr(self.calls, "spec_decode"):
            raise ValueError("speculative decoding is not available with these engine calls "
                             "(serving across processes replays plain decode steps only)")
        self.pages_per_row = pages_for(max_len, page_size)
        self.pool = PagePool(num_pages or 2 * slots * self.pages_per_row, page_size)
        self.dtype = params.embed.dtype
        self.implementation = steps.host_implementation()
        self.decode_buckets = buckets(slots)
        self.prefill_buckets = [r for r in buckets(slots, prefill_rows) if prefill_chunk // r >= 16]
        self.programs_of = Shapes(tuple(self.decode_buckets), tuple(self.prefill_buckets), prefill_chunk,
                                  speculative_tokens, max_len)
        if store is not None:
            store.use_pages(self.pool, self.page_bytes)
            store.checkpoint_interval = checkpoint_interval  # the cache report names the grid
        self.counters: Counter = Counter()
        self.sched = Scheduler(slots, self.pool, self.pages_per_row, store=store,
                               checkpoint_interval=checkpoint_interval, max_queue=max_queue,
                               prefill_chunk=prefill_chunk, prefill_buckets=self.prefill_buckets,
                               speculative_tokens=speculative_tokens, counters=self.counters,
                               prefill_call_tokens=PREFILL_CALL_TOKENS.get(jax.default_backend()))
        self._thread: threading.Thread | None = None
        self._running = False
        self.ready = threading.Event()  # set once the worker serves (after any warm-up)
        self.served = False  # it was ready once (its state is worth saving)
        self._cancel = threading.Event()  # stop compiling (the engine stops)
        self._worker: threading.Thread | None = None  # the last worker started (kept after stop)
        self._score_caches: list = []  # one-row caches of max_len positions for the scorer, free to take
        self._score_lock = threading.Lock()
        self._scratch: dict[int, object] = {}  # thread id -> its engine state for first runs off the loop
        state = self._fresh_state()
        self._runs_off_the_loop = first_runs_off_the_loop(  # decided once: start-up and behind agree
            sum(x.nbytes for x in jax.tree_util.tree_leaves(state)))
        self.programs: programs.ProgramSet | None = None
        self.compiles: Compiles | None = None
        if calls is None:
            self.programs = self._program_set(executable_dir, state)
            n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
            self.calls = programs.CompiledCalls(self.programs, functools.partial(runs_before_its_first_run, n_params),
                                                self.programs_of.draw_buckets)
            self.compiles = Compiles(self.programs, self._cancel, made=self._program_made)
        self.loop = DeviceLoop(cfg, params, tokenizer, self.calls, self.sched, self.programs_of, state, store=store,
                               counters=self.counters, speculative_tokens=speculative_tokens,
                               implementation=self.implementation, policy=policy)

    def _program_set(self, directory, state) -> "programs.ProgramSet":
        params, state = programs.abstract(self.params), programs.abstract(state)
        settings = dict(slots=self.slots, num_pages=self.pool.num_pages, page_size=self.pool.page_size,
                        pages_per_row=self.pages_per_row, prefill_chunk=self.prefill_chunk, max_len=self.max_len,
                        prefill_buckets=tuple(self.prefill_buckets), decode_buckets=tuple(self.decode_buckets),
                        speculative_tokens=self.speculative_tokens, implementation=self.implementation)
        lowerers = programs.engine_lowerers(
            self.cfg, params, state, slots=self.slots, pages_per_row=self.pages_per_row, num_pages=self.pool.num_pages,
            implementation=self.implementation, speculative_tokens=self.speculative_tokens,
            row_args=programs.abstract(request_row_args(self.cfg, GenerationRequest([0], 1))))
        # the prompt-scoring programs (echo with logprobs: `prompt_logprobs`), by piece width
        from hybridjax.generate import _score_piece, score_piece_inputs

        lowerers["score"] = lambda r, t, tag: compile_cache.renamed(_score_piece, tag).lower(
            params, *score_piece_inputs(params, self.cfg, t, self.max_len), cfg=self.cfg)
        return programs.program_set(programs.program_key(self.cfg, params, state, settings), lowerers, directory)

    def _fresh_state(self):
        return self.calls.init_state(self.cfg, self.slots, self.pool.num_pages, self.pool.page_size, self.dtype,
                                     mesh=self.params.mesh, mtp=self.speculative_tokens > 0)

    def _reset_device(self) -> None:
        self.loop.state = self._fresh_state()

    @property
    def _state(self):
        """The device state (`engine_steps.EngineState`), the loop's."""
        return self.loop.state

    @_state.setter
    def _state(self, state) -> None:
        self.loop.state = state

    @property
    def grammars(self):
        """The grammar compiler of this engine's tokenizer and vocabulary (hybridjax.grammar)."""
        return self.loop.grammars

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every attention layer (k and v)."""
        return page_bytes(self.cfg, self.pool.page_size, self.dtype, mtp=self.speculative_tokens > 0)

    # --- public API (any thread) ----------------------------------------------------
    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n + max(request.max_tokens, 1) > self.max_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) exceeds the context length {self.max_len}")
        check_request(request, self.cfg.vocab_size, steps.MAX_TOP_LOGPROBS)
        if pages_for(n + request.max_tokens, self.pool.page_size) > self.pool.num_pages:
            raise ValueError(f"prompt + max_tokens ({n + request.max_tokens} tokens) exceeds the KV pool "
                             f"({self.pool.num_pages} pages of {self.pool.page_size} tokens)")
        request.prompt_array  # made here, on the caller's thread: ~1 ms at 30k tokens the engine thread spares
        handle = RequestHandle(request, loop)
        handle.row_args = request_row_args(self.cfg, request)  # the same for its admission (~0.7 ms there)
        self.sched.enqueue(handle)
        return handle

    def prefetch(self, prompt_ids: Sequence[int], namespace: str = "") -> bool:
        """Before submitting: read, on the calling thread, a disk-tier hit of this prompt
        (`SnapshotStore.prefetch`), so the engine thread does not read files. True if one was read."""
        store = self.store
        if store is None or store.disk is None or not prompt_ids:
            return False
        return store.prefetch(prompt_ids, namespace)

    def prefill_in_background(self, prompt_ids: Sequence[int], namespace: str = "",
                              delay_s: float = 0.0) -> RequestHandle | None:
        """Have a snapshot of `prompt_ids` ready for a later request (e.g. the next chat turn as
        its template will render it): prefilled, from the longest snapshot, in idle time only (no
        request waits), ending in a snapshot and no token. None when there is no store.
        `delay_s`: start no sooner; a request that comes first overtakes it (runs it first if it
        continues it, else drops it: `Scheduler.enqueue`), so that a client that sends its next
        request at once does not find the engine busy with work that request makes useless."""
        if self.store is None or not prompt_ids or len(prompt_ids) > self.max_len:
            return None
        handle = RequestHandle(GenerationRequest(list(prompt_ids), max_tokens=0, namespace=namespace))
        handle.request.prompt_array  # made on the caller's thread, not the engine's (as in `submit`)
        handle.row_args = request_row_args(self.cfg, handle.request)
        handle.not_before = time.perf_counter() + delay_s
        self.sched.wish(handle)
        return handle

    def start(self, warmup: bool = False, progress: bool = False) -> "Engine":
        """Start the worker thread; with `warmup` it first has the covering programs (compiled or
        loaded from disk), sets `ready` and serves while the rest compile behind; requests
        submitted meanwhile wait in the queue. `progress`: a log line per program at INFO."""
        if self._thread is None:
            _STARTED.add(self)
            self._cancel.clear()
            self._running = True
            self._thread = self._worker = threading.Thread(target=self._loop, args=(warmup, progress),
                                                           name="hybridjax-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """Stop the worker and any compiling. A compile under way cannot be interrupted: with
        `wait` this waits for it to end; without, a thread still compiling is left to end by
        itself (a daemon thread: a process that exits now must leave by `os._exit`, as the CLI
        does, since XLA aborts a process that finalizes beside a running compile)."""
        self._cancel.set()
        with self.sched.wake:
            self._running = False
            self.sched.wake.notify()
        for t in (self._thread, self._compiler):
            if t is not None and t is not threading.current_thread():
                t.join(None if wait or (t is self._thread and self.ready.is_set()) else 1.0)
        self._thread = None
        self.ready.clear()

    @property
    def compiling(self) -> bool:
        """A thread of this engine is still compiling (start-up or behind)."""
        return bool(self._compiling_threads())

    @property
    def _compiler(self) -> threading.Thread | None:
        return self.compiles.thread if self.compiles is not None else None

    def _compiling_threads(self) -> list[threading.Thread]:
        starting = self._worker if not self.served else None  # the worker compiles before it serves
        behind = self.compiles.threads() if self.compiles is not None else []
        return behind + [t for t in (starting,) if t is not None and t.is_alive()]

    @property
    def queue_depth(self) -> int:
        return len(self.sched.waiting)

    @property
    def _waiting(self):  # the queue (tests watch it)
        return self.sched.waiting

    @property
    def active_slots(self) -> int:
        return self.sched.active

    @property
    def startup(self) -> dict:
        """How start-up went: seconds, programs loaded / compiled, ready_s, behind."""
        return self.compiles.startup if self.compiles is not None else {}

    @property
    def idle(self) -> bool:
        """Nothing waiting, running or prefilling in the background."""
        return not self.sched.has_work() and self.loop.inflight is None

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> RequestHandle:
        """Submit and wait for the end (tests, scripts)."""
        handle = self.submit(request)
        for _ in handle.events(timeout=timeout):
            pass
        return handle

    def shapes(self) -> list[tuple]:
        """Every program the loop runs, as (step name, rows, tokens): what `warmup` compiles."""
        return self.programs_of.all()

    def covering_shapes(self) -> list[tuple]:
        """What `start(warmup=True)` has before it serves (`Shapes.covering`); the rest compile behind."""
        return self.programs_of.covering()

    def score_shapes(self) -> list[tuple]:
        return self.programs_of.score()

    def background_shapes(self) -> list[tuple]:
        return self.programs_of.background()

    def warmup(self, progress: bool = False, shapes: Sequence[tuple] | None = None) -> float:
        """Compile (or load from disk) every shape the loop can run (`shapes`: these only), so that
        no request waits for XLA. Call before `start`. Returns the seconds it took. One engine of a
        process warms up at a time: engines of one configuration share the programs, so the
        second finds them compiled instead of compiling them again beside the first."""
        with _WARMUP_LOCK:
            if self.compiles is None:
                return self._warmup_by_running(progress)
            after = None
            if self._runs_off_the_loop:  # each runs once where it was made
                after = functools.partial(self._first_run_where_made, threading.current_thread())
            try:
                return self.compiles.prepare(shapes or self.shapes(), progress, after)
            finally:
                self._scratch.clear()  # the helpers' (they have ended)

    def _compile_behind(self, shapes: list[tuple]) -> None:
        """Compile `shapes` in a thread while the engine serves; a request meanwhile runs on a
        larger compiled bucket or in smaller calls."""
        self.compiles.behind(shapes)

    def prompt_logprobs(self, prompt_ids: Sequence[int], sp=None, top: int = 0) -> list[tuple[float, tuple]]:
        """`generate.prompt_logprobs` on the compiled scoring programs: the prompt in pieces
        (`generate.score_in_pieces`) of the widths compiled so far, over a one-row cache of max_len
        positions. The narrowest is in the covering set, so any prompt is scored without waiting;
        where it is missing (a warm-up the caller skipped) it compiles at once on a thread of its
        own (`Compiles.first`) and this waits for it: the caller's thread never compiles."""
        from hybridjax.generate import check_score_top, prompt_logprobs, score_list

        n = len(prompt_ids)
        if self.programs is None or n < 2 or n > self.max_len:
            return prompt_logprobs(self.params, prompt_ids, self.cfg, sp, top)
        check_score_top(top)
        scorers = {s[2]: self.programs.get(s) for s in self.score_shapes() if self.programs.has(s)}
        if not scorers:
            narrowest = self.score_shapes()[0]
            self.compiles.first(narrowest)
            scorers = {narrowest[2]: self.programs.get(narrowest)}
        return score_list(*self._score(prompt_ids, sp, scorers), n, top)

    def _score(self, prompt_ids, sp, scorers: dict, keep_below: int | None = None):
        """`generate.score_in_pieces` over a free scoring cache (made on first need; several
        threads may score at once, each with its own), kept after for the next one if it holds
        at most `keep_below` bytes (None: kept)."""
        from hybridjax.generate import score_in_pieces

        with self._score_lock:
            cache = self._score_caches.pop() if self._score_caches else None
        if cache is None:
            cache = self._empty_score_cache()
        scores, cache = score_in_pieces(self.params, self.cfg, prompt_ids, sampling_params(1) if sp is None else sp,
                                        scorers, cache)  # (a failure loses the donated cache: a new one is made)
        if keep_below is None or sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)) <= keep_below:
            with self._score_lock:
                self._score_caches.append(cache)
        return scores

    def _empty_score_cache(self):
        """An empty scoring cache of max_len positions (`generate.score_cache`), made from host zeros
        (jnp.zeros would run a program each, and tracing its shapes would trace on the engine thread),
        committed to the device as the scoring programs' outputs are (lowered with the params'
        shardings): a fresh cache and a reused one make one call signature."""
        from hybridjax.generate import score_cache

        devices = self.params.embed.devices()
        return jax.device_put(score_cache(self.cfg, self.max_len, self.params.embed.dtype, zeros=np.zeros),
                              next(iter(devices)) if len(devices) == 1 else None)

    def save_snapshots(self, directory) -> int:
        """Persist the snapshot store (its pages read from the pool). Call with the loop stopped."""
        def read(ids):
            ks, vs = self.calls.read_pages(self._state, np.asarray(ids, np.int32))
            return [np.asarray(k) for k in ks], [np.asarray(v) for v in vs]

        return self.store.save(directory, read_pages=read) if self.store is not None else 0

    def load_snapshots(self, directory) -> int:
        """Load persisted snapshots, their pages into the pool. Call before `start`."""
        def write(ks, vs):
            ids = self.pool.alloc(len(ks[0]) if ks else 0)
            self._state = self.calls.write_pages(self._state, np.asarray(ids, np.int32), tuple(ks), tuple(vs))
            return ids

        return self.store.load(directory, write_pages=write) if self.store is not None else 0

    def read_pages_async(self, ids):
        """K, V of pool pages `ids` (tuples over attention pools of [n, S, Hkv, Dh]), as device arrays:
        dispatched now, in order with the steps, so no later step changes what they hold (the disk
        tier reads them on its own thread). Engine thread only, or with the loop stopped."""
        return self.calls.read_pages(self._state, np.asarray(ids, np.int32))

    def write_pages(self, ids, ks, vs) -> None:
        """Pool pages `ids` := ks, vs (numpy). Engine thread only, or with the loop stopped."""
        self._state = self.calls.write_pages(self._state, np.asarray(ids, np.int32), tuple(ks), tuple(vs))

    def _warmup_by_running(self, progress: bool) -> float:
        """Warm-up for calls that are jitted functions (hybridjax.multihost): run every shape
        once on padding rows (`DeviceLoop.run_on_padding`), which compiles it."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        # Jitted steps draw inside their decode and prefill programs: only an exact hit's draw runs alone.
        shapes = [s for s in self.shapes() if s[0] != "draw" or s[1] == 1]
        for shape in tqdm(shapes, desc="compiling", unit="program", disable=not progress):
            self.loop.run_on_padding(shape)
        seconds = time.perf_counter() - t0
        log.info("compiled %d programs in %.1f s", len(shapes), seconds)
        return seconds

    # --- the loop (engine thread) ----------------------------------------------------
    def _loop(self, warmup: bool = False, progress: bool = False) -> None:
        if warmup:
            self._start_up(progress)
            if self._cancel.is_set():
                return
        self.served = True
        self.ready.set()
        ttl = self.store.ttl_s if self.store is not None else None
        tick = min(5.0, max(ttl / 2, 0.05)) if ttl else None  # TTL runs on a timer too, not only on lookups
        wake = self.sched.wake
        while True:
            first_run = None
            with wake:
                while self._running and not self.sched.work_due() and self.loop.inflight is None:
                    first_run = self._unrun_program()
                    if first_run is not None:  # idle: a program compiled behind runs once first
                        break
                    due = self.sched.next_due_in()  # idle-time work waiting for its time
                    timeout = min((t for t in (tick, due) if t is not None), default=None)
                    if not wake.wait(timeout=timeout) and tick:
                        self.store.expire()
                if not self._running:
                    break
            if first_run is not None:
                self._first_run(first_run)
                continue
            try:
                self.loop.step()
            except Exception as e:  # a failed step must not kill the worker: fail its requests
                log.exception("engine step failed")
                self._fail_all(e)
        self.loop.drain()

    def _program_made(self, shape: tuple) -> None:
        """A program compiled or loaded behind (on that thread) runs once before a request meets
        it, unless a call of it is a long forward (`runs_before_its_first_run`): a scoring
        program here, on a two-token prompt (scoring touches no engine state); a
        step program here too, on a scratch state, where the engine runs first runs off its
        thread (`calls.warm`), else by the loop when idle (woken here). A first run on the loop
        held up any request that came meanwhile: up to 0.3 s, most often the first few after a
        start, while the programs behind were made."""
        if shape[0] == "score":
            if not self.calls.eager(shape):
                self._first_run(shape)
        elif self.calls.warm is not None:
            if shape not in self.calls.ran and not self.calls.eager(shape):
                self._first_run_on_scratch(shape)
            self.calls.warm.add(shape)
        if not self.compiles.queue:  # the last program behind
            self._scratch.pop(threading.get_ident(), None)
        with self.sched.wake:
            self.sched.wake.notify_all()

    def _first_run_on_scratch(self, shape: tuple) -> None:
        """`shape`'s first run on the calling thread's scratch engine state (`_scratch`), made at
        its first and kept for the next until that thread's programs are made."""
        me = threading.get_ident()
        try:
            state = self._scratch.get(me)
            self._scratch[me] = self.loop.padding_run(shape, self._fresh_state() if state is None else state)
        except Exception:  # the loop runs it anyway: a request pays the first run, as without this
            self._scratch.pop(me, None)
            log.exception("the first run of %s failed", programs.shape_name(shape))

    def _first_run_where_made(self, preparer: threading.Thread, shape: tuple) -> None:
        """Start-up's `after`: a program just compiled or loaded runs once on the thread that made
        it: the preparing thread on the engine's own state (the loop does not run yet), a helper
        thread on a scratch state, so the first runs of a start take every core, not one."""
        if not all(map(self.programs.has, self.loop.padding_run_needs(shape))):
            return  # not yet: it runs with those start-up leaves unrun, once all exist
        if shape[0] == "score" or threading.current_thread() is preparer:
            self._first_run(shape)
        else:
            self._first_run_on_scratch(shape)

    def _unrun_program(self) -> tuple | None:
        """A program the loop may run that exists and has never run (None: none, calls that are
        not executables, or first runs made off the loop's thread)."""
        if self.programs is None or self.calls.warm is not None:
            return None
        return next(iter(self.calls.unrun(self.shapes())), None)

    def _first_run(self, shape: tuple) -> None:
        """Run `shape` once: an executable's first run costs 0.1-0.4 s more than later ones (CPU,
        measured per program: benchmarks/README.md, bench_startup), paid here rather than by the
        first request that needs it. A step program runs on padding rows (`DeviceLoop.run_on_padding`,
        engine thread); a scoring program on a two-token prompt (any thread: it touches no state)."""
        try:
            self.calls.ran.add(shape)  # once, even if it fails
            if shape[0] == "score":
                self._score([0, 0], None, {shape[2]: self.programs.get(shape)}, KEEP_FIRST_SCORE_CACHE_BYTES)
            else:
                self.loop.run_on_padding(shape)
        except Exception:  # it has changed nothing a request reads; the request that needs it will try it
            log.exception("the first run of %s failed", programs.shape_name(shape))

    def _ahead_shapes(self) -> list[tuple]:
        """What start-up has before it serves: the covering set and, where an earlier launch kept it,
        one row's widest prefill chunk when its first run is cheap (not `eager`: every chunk of the
        default model, none past 1x32 of the 0.23B). Behind, the first long prompt after a warm
        restart met it still loading and went in 16-token chunks (default model: 2.5x the later ones)."""
        ahead = self.covering_shapes()
        widest = self.programs_of.widest_prefill()
        if (widest not in ahead and not self.calls.eager(widest)
                and (self.programs.has(widest) or self.programs.on_disk(widest))):
            ahead.append(widest)
        return ahead

    def _start_up(self, progress: bool) -> None:
        """Have the covering set (loaded or compiled), then compile the rest behind; one line
        says how long it took and why."""
        t0 = time.perf_counter()
        if self.programs is None:
            self.warmup(progress)
            log.info("start-up: ready in %.1f s (compiled %d programs)", time.perf_counter() - t0, len(self.shapes()))
            return
        has, on_disk = self.programs.has, self.programs.on_disk
        covering, ahead = self.covering_shapes(), self._ahead_shapes()
        others = [s for s in self.background_shapes() if s not in ahead]
        present = sum(map(has, ahead))  # (loaded beside the weights: `engine_programs.preload`)
        kept = sum(on_disk(s) for s in ahead if not has(s))
        with_widest = f" (with one row's widest prefill chunk: {len(ahead)})" if len(ahead) > len(covering) else ""
        log.log(logging.INFO if progress else logging.DEBUG, "start-up: %d programs serve every request%s: %s%d kept "
                "on disk, %d to compile on %d threads; the other %d follow once serving", len(covering), with_widest,
                f"{present} in memory already, " if present else "", kept, len(ahead) - present - kept,
                programs.compile_threads(), len(others))
        self.warmup(progress, ahead)
        if self._cancel.is_set():
            return
        t1 = time.perf_counter()
        for shape in self.calls.unrun(ahead):  # the first requests meet no first run
            self._first_run(shape)
        self.startup["first_runs_s"] = time.perf_counter() - t1
        if all(map(has, covering)):  # from now on the loop runs only what exists
            self.loop.has = self.calls.has  # (a warm-up the caller replaced: no, it compiles as it goes)
            if self._runs_off_the_loop:  # and only what has run once
                self.calls.warm = set(self.calls.ran)
        # Programs present but never run go behind too: their first run is made there.
        rest = [s for s in others if not has(s) or s not in self.calls.ran]
        order = {s: i for i, s in enumerate(self.programs_of.loading())}  # a restart loads all it kept
        rest.sort(key=lambda s: (not on_disk(s), order[s] if on_disk(s) else 0))  # (quick) before compiling
        missing = [s for s in rest if not has(s)]
        early = len(others) - len(missing)  # (loaded beside the weights: `preload`)
        to_load = sum(map(on_disk, missing))
        self.startup.update(ready_s=time.perf_counter() - t0, behind=len(missing))
        behind = ", ".join(f"{n} {how}" for n, how in ((to_load, "to load from disk"),
                                                       (len(missing) - to_load, "to compile")) if n)
        log.info("start-up: ready in %.1f s: %s; first runs %.1f s%s", self.startup["ready_s"],
                 self.startup.get("summary", "nothing prepared"),  # (a warm-up replaced by the caller)
                 self.startup["first_runs_s"], (f"; {early} of the others in memory already" if early else "")
                 + (f"; {len(missing)} more behind ({behind})" if missing else ""))
        self._compile_behind(rest)

    def _fail_all(self, error: Exception) -> None:
        """A step failed: fail its requests (`DeviceLoop.fail`) and start over with a fresh device state."""
        self.loop.fail()
        try:
            self._reset_device()
        except Exception:  # no device state to serve from (e.g. a follower process is gone): stop
            log.exception("the engine cannot reset its device state and stops")
            with self.sched.wake:
                self._running = False
                waiting = list(self.sched.waiting)
                self.sched.waiting.clear()
            for h in waiting:
                self.counters["finished_error"] += 1
                h.finish("error")
