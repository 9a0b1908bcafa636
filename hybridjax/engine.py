"""The engine: continuous batching over a fixed number of slots, KV in a shared page pool,
prompts prefilled in chunks between decode steps, and exact-prefix snapshot reuse.

One background thread owns the device state (`hybridjax.engine_steps.EngineState`: every
slot's recurrent state, sampler and logits, and the KV page pool) and the host bookkeeping
(page tables, reference counts, slots). Each loop iteration
  1. admits waiting requests into free slots: one pass over the snapshot store finds each
     one's longest cached prefix; the slot gets the snapshot's full KV pages by id, a copy of
     its partial last page, its recurrent state and logits, and fresh pages for the rest of
     the prompt and the response; an exact hit draws its first token at once, no model call;
  2. runs one prefill call of at most `prefill_chunk` tokens, shared by the prompts being
     prefilled (several rows when their chunks fit together); a chunk ends at a snapshot
     point (checkpoint, end of the chat history, a prefix shared with another request, the end
     of the prompt) where the row's snapshot is taken: full pages shared, the partial page
     copied; a prompt's last chunk draws its first token, which is sent at once;
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
as a covering set exists (`covering_shapes`: one decode bucket, the smallest prefill chunk, the
per-request helpers) and compiles the rest behind, in a thread; until a bucket exists, its work
runs padded to a larger compiled bucket or split into smaller chunks.
Requests are independent rows: greedy output does not depend on the batch or on cache hits.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections import Counter, deque
from typing import AsyncIterator, Iterator, Sequence

import jax
import numpy as np

from hybridjax import engine_programs as programs
from hybridjax import engine_steps as steps
from hybridjax.config import Config
from hybridjax.generate import length_bucket, score_inputs
from hybridjax.pages import DEFAULT_PAGE_SIZE, PagePool, PoolExhausted, page_bytes, pages_for
from hybridjax.params import Params
from hybridjax.prefix_cache import SnapshotStore, checkpoint_positions
from hybridjax.prefix_report import CACHE_OFF, CacheReport
from hybridjax.sampling import bias_row, sampling_params
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
SHARE_MIN_TOKENS = 16  # a request waits for another's shared-prefix snapshot only past this many tokens


def _yield_cpu_to_serving() -> None:
    """Lower the calling thread's CPU priority (Linux: the nice value is per thread), so that the
    programs compiled behind take the cores the streams being served leave idle: on 2 cores one
    compile held a core and one stream ran at 0.75x of generate until all were done
    (benchmarks/bench_serve_decode.py --during-compiles)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at the same priority
        pass


class QueueFull(Exception):
    """The engine's waiting queue is at its bound; the client should retry later."""


class InvalidRequest(ValueError):
    """A request the engine cannot run; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check_request(req: "GenerationRequest", vocab_size: int) -> None:
    """Reject values the device steps cannot take (int32 / uint32 fields, non-finite floats)
    at submission, so that a bad request fails alone and before any stream starts."""
    import math

    def bad(field, why):
        raise InvalidRequest(f"invalid {field} {getattr(req, field)!r}: {why}", field)

    if not 0 <= req.top_k < 2**31:
        bad("top_k", "must be in [0, 2**31)")
    if not 0 <= req.seed < 2**32:
        bad("seed", "must be in [0, 2**32)")
    if req.logprobs is not None and not 0 <= req.logprobs <= steps.MAX_TOP_LOGPROBS:
        bad("logprobs", f"must be in [0, {steps.MAX_TOP_LOGPROBS}]")
    for field in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(req, field)):
            bad(field, "must be finite")
    if req.temperature < 0 or not 0 < req.top_p <= 1 or req.repetition_penalty <= 0:
        bad("temperature" if req.temperature < 0 else "top_p" if not 0 < req.top_p <= 1 else "repetition_penalty",
            "out of range")
    if any(not 0 <= t < vocab_size for t in req.prompt_ids):
        bad("prompt_ids", f"token ids must be in [0, {vocab_size})")
    if not 0 <= req.min_tokens <= max(req.max_tokens, 0):
        bad("min_tokens", "must be in [0, max_tokens]")
    for tid, b in req.logit_bias:
        if not 0 <= tid < vocab_size:
            bad("logit_bias", f"token id {tid} is outside the vocabulary [0, {vocab_size})")
        if not -100 <= b <= 100:
            bad("logit_bias", f"the bias of token {tid} must be in [-100, 100]")


@dataclasses.dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    namespace: str = ""
    history_len: int | None = None  # end of the stable chat history, a snapshot point
    logprobs: int | None = None  # report each token's log-probability and this many alternatives (0..20)
    min_tokens: int = 0  # no stop id is drawn (or ends the response) before this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); -100 bans
    grammar: str | None = None  # constrained decoding: an llguidance grammar (hybridjax.grammar)


@dataclasses.dataclass(frozen=True)
class Event:
    token_id: int | None
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    logprob: float | None = None  # with request.logprobs: the token's log-probability
    top_logprobs: tuple[tuple[int, float], ...] = ()  # and the most likely (token, logprob), best first


class RequestHandle:
    """What `Engine.submit` returns: the request's events, its usage, and `cancel()`."""

    _ids = itertools.count()

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None):
        self.id = next(self._ids)
        self.request = request
        self.prompt_tokens = len(request.prompt_ids)
        self.cached_tokens = 0
        self.cache_report: CacheReport = CACHE_OFF  # set at admission from the store's lookup
        self.token_ids: list[int] = []
        self.logprobs: list[tuple] = []  # with request.logprobs: (logprob, top alternatives) per token
        self.text = ""
        self.finish_reason: str | None = None
        self.cancelled = threading.Event()
        self.admitted = threading.Event()
        self._loop = loop
        self._queue: queue.Queue | asyncio.Queue = asyncio.Queue() if loop else queue.Queue()

    def cancel(self) -> None:
        """Stop generating; the slot is freed at the engine's next step."""
        self.cancelled.set()

    def _emit(self, event: Event) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        else:
            self._queue.put(event)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocking iterator over events, ending after the one with a finish_reason."""
        while True:
            ev = self._queue.get(timeout=timeout)
            yield ev
            if ev.finish_reason is not None:
                return

    async def aevents(self) -> AsyncIterator[Event]:
        while True:
            ev = await self._queue.get()
            yield ev
            if ev.finish_reason is not None:
                return


@dataclasses.dataclass(eq=False)
class _Slot:
    handle: RequestHandle
    row: int
    decoder: StreamDecoder | None
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


@dataclasses.dataclass
class _Step:
    """A dispatched decode step whose outputs the host has not read yet."""

    index: int
    slots: list  # _Slot per row of the call (None for padding)
    outputs: tuple  # device arrays: tokens, done, lengths [R] (a speculative step: see spec_decode)
    speculative: bool = False  # a drafting step (`steps.spec_decode`)
    started: float = 0.0  # perf_counter at dispatch
    after_prefill: bool = False  # a prefill chunk ran just before it (its time is not the step's own)


class _SpecPolicy:
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


def _draw_of(drawn: "steps.Drawn", i: int, slot: _Slot) -> tuple[int, tuple]:
    """(token, (logprob, top alternatives) or ()) of row i of a step's draws, read from the device
    (the log-probabilities only when the request asked for them)."""
    token = int(np.asarray(drawn.tokens)[i])
    k = slot.handle.request.logprobs
    if k is None:
        return token, ()
    top = zip(np.asarray(drawn.top_ids)[i, :k].tolist(), np.asarray(drawn.top_logprobs)[i, :k].tolist())
    return token, (float(np.asarray(drawn.logprob)[i]), tuple(top))


def _buckets(n: int, cap: int | None = None) -> list[int]:
    """Batch buckets up to n rows: powers of two below n, then n (at most `cap`)."""
    top = min(n, cap or n)
    out = [1]
    while out[-1] * 2 < top:
        out.append(out[-1] * 2)
    return sorted(set(out + [top]))


def _powers(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... up to hi."""
    out = [lo]
    while out[-1] * 2 <= hi:
        out.append(out[-1] * 2)
    return out


def request_row_args(cfg: Config, req: "GenerationRequest", length: int = 0) -> tuple:
    """What `engine_steps.setup_row` takes after (state, row, gdn, logits) for a request whose
    row starts at `length` cached tokens: length, sampling parameters, seed, seen tokens,
    budget, stop ids, wants log-probabilities, logit bias [vocab], min tokens."""
    sp = sampling_params(1, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                         repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                         frequency_penalty=req.frequency_penalty)
    seen = np.zeros((cfg.vocab_size,), bool)
    seen[np.asarray(req.prompt_ids)] = True
    stops = np.full((steps.MAX_STOPS,), -1, np.int32)
    ids = list(dict.fromkeys(req.stop_ids))[: steps.MAX_STOPS]
    stops[: len(ids)] = ids
    return (np.int32(length), sp, np.uint32(req.seed % 2**32), seen, np.int32(req.max_tokens), stops,
            np.bool_(req.logprobs is not None), bias_row(cfg.vocab_size, req.logit_bias), np.int32(req.min_tokens))


def _bucket(n: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= n)


def _shared_prefix(others: Sequence[GenerationRequest], req: GenerationRequest) -> int:
    """The longest prefix `req`'s prompt shares with a prompt of `others` in its namespace."""
    def common(a, b):
        n = min(len(a), len(b))
        return next((i for i in range(n) if a[i] != b[i]), n)

    return max((common(o.prompt_ids, req.prompt_ids) for o in others if o.namespace == req.namespace), default=0)


def _safe_split(text: str, stops: Sequence[str]) -> tuple[str, str]:
    """(text that can be sent, tail that may still grow into a stop string)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return (text[: len(text) - hold], text[len(text) - hold :]) if hold else (text, "")


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
        # adaptive: plain steps while drafting does not pay (`_SpecPolicy`); else every step drafts.
        # Off by default: its choices follow measured times, so a seeded sampled request is no
        # longer reproducible, and on the shared CPU it did not beat drafting every step clearly.
        self._policy = _SpecPolicy() if speculative_tokens and speculative_adaptive else None
        self._last_done: float | None = None  # when the host last read a step's outputs
        self._prefilled = False  # a prefill chunk was dispatched since the last decode step
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
        self.decode_buckets = _buckets(slots)
        self.prefill_buckets = [r for r in _buckets(slots, prefill_rows) if prefill_chunk // r >= 16]
        if store is not None:
            store.use_pages(self.pool, self.page_bytes)
            store.checkpoint_interval = checkpoint_interval  # the cache report names the grid
        self.counters: Counter = Counter()
        self._waiting: deque[RequestHandle] = deque()
        self._background: deque[RequestHandle] = deque()  # prefill-only work for idle time
        self._wake = threading.Condition()
        self._rows: list[_Slot | None] = [None] * slots
        self._seq = itertools.count()
        self._steps = itertools.count()
        self._inflight: _Step | None = None
        self._waiting_snapshots: dict[int, list] = {}  # step index -> response snapshots its outputs decide
        self._thread: threading.Thread | None = None
        self._running = False
        self.ready = threading.Event()  # set once the worker serves (after any warm-up)
        self.served = False  # it was ready once (its state is worth saving)
        self._cancel = threading.Event()  # stop compiling (the engine stops)
        self._behind: deque[tuple] = deque()  # shapes the compile thread does next, in order
        self._compiler: threading.Thread | None = None
        self._worker: threading.Thread | None = None  # the last worker started (kept after stop)
        self.startup: dict = {}  # how start-up went: seconds, programs loaded / compiled
        self._score_caches: dict = {}  # length -> an empty cache for the prompt scorer
        self._compiled_only = False  # run only shapes whose program exists (`_has`)
        self._reset_device()
        self.programs: programs.ProgramSet | None = None
        if calls is None:
            self.programs = self._program_set(executable_dir)
            self.calls = programs.CompiledCalls(self.programs)

    def _program_set(self, directory) -> "programs.ProgramSet":
        params, state = programs.abstract(self.params), programs.abstract(self._state)
        settings = dict(slots=self.slots, num_pages=self.pool.num_pages, page_size=self.pool.page_size,
                        pages_per_row=self.pages_per_row, prefill_chunk=self.prefill_chunk, max_len=self.max_len,
                        prefill_buckets=tuple(self.prefill_buckets), decode_buckets=tuple(self.decode_buckets),
                        speculative_tokens=self.speculative_tokens, implementation=self.implementation)
        lowerers = programs.engine_lowerers(
            self.cfg, params, state, slots=self.slots, pages_per_row=self.pages_per_row, num_pages=self.pool.num_pages,
            implementation=self.implementation, speculative_tokens=self.speculative_tokens,
            row_args=programs.abstract(request_row_args(self.cfg, GenerationRequest([0], 1))))
        # the prompt-scoring programs (echo with logprobs: `prompt_logprobs`), by padded length
        from hybridjax.generate import SCORE_CHUNK, _prompt_logprobs

        lowerers["score"] = lambda r, t: _prompt_logprobs.lower(params, *score_inputs(params, t, self.cfg),
                                                                self.cfg, SCORE_CHUNK)
        return programs.program_set(programs.program_key(self.cfg, params, state, settings), lowerers, directory)

    def _reset_device(self) -> None:
        self._state = self.calls.init_state(self.cfg, self.slots, self.pool.num_pages, self.pool.page_size, self.dtype,
                                            mesh=self.params.mesh, mtp=self.speculative_tokens > 0)
        self._table = np.full((self.slots, self.pages_per_row), self.pool.num_pages, np.int32)  # P: no page

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
        check_request(request, self.cfg.vocab_size)
        if pages_for(n + request.max_tokens, self.pool.page_size) > self.pool.num_pages:
            raise ValueError(f"prompt + max_tokens ({n + request.max_tokens} tokens) exceeds the KV pool "
                             f"({self.pool.num_pages} pages of {self.pool.page_size} tokens)")
        handle = RequestHandle(request, loop)
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull(f"the queue is full ({self.max_queue} waiting requests)")
            self._waiting.append(handle)
            self.counters["requests"] += 1
            self._wake.notify()
        return handle

    def prefill_in_background(self, prompt_ids: Sequence[int], namespace: str = "") -> RequestHandle | None:
        """Have a snapshot of `prompt_ids` ready for a later request (e.g. the next chat turn as
        its template will render it): prefilled, from the longest snapshot, in idle time only (no
        request waits), ending in a snapshot and no token. None when there is no store."""
        if self.store is None or not prompt_ids or len(prompt_ids) > self.max_len:
            return None
        handle = RequestHandle(GenerationRequest(list(prompt_ids), max_tokens=0, namespace=namespace))
        with self._wake:
            if len(self._background) >= self.max_queue:
                self._background.popleft()  # the oldest wish goes; nobody waits for it
            self._background.append(handle)
            self._wake.notify()
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
        with self._wake:
            self._running = False
            self._wake.notify()
        for t in (self._thread, self._compiler):
            if t is not None and t is not threading.current_thread():
                t.join(None if wait or (t is self._thread and self.ready.is_set()) else 1.0)
        self._thread = None
        self.ready.clear()

    @property
    def compiling(self) -> bool:
        """A thread of this engine is still compiling (start-up or behind)."""
        return bool(self._compiling_threads())

    def _compiling_threads(self) -> list[threading.Thread]:
        starting = self._worker if not self.served else None  # the worker compiles before it serves
        return [t for t in (self._compiler, starting) if t is not None and t.is_alive()]

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_slots(self) -> int:
        return sum(r is not None for r in self._rows)

    @property
    def idle(self) -> bool:
        """Nothing waiting, running or prefilling in the background."""
        return not self._waiting and not self._background and self.active_slots == 0 and self._inflight is None

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> RequestHandle:
        """Submit and wait for the end (tests, scripts)."""
        handle = self.submit(request)
        for _ in handle.events(timeout=timeout):
            pass
        return handle

    def shapes(self) -> list[tuple]:
        """Every program the loop runs, as (step name, rows, tokens): what `warmup` compiles."""
        k = self.speculative_tokens
        out = [("spec_decode", r, k + 1) for r in self.decode_buckets] if k else []
        # Plain steps also serve a speculative engine's constrained rows (they never draft).
        out += [("decode", r, 1) for r in self.decode_buckets]
        out += [("sample_first", 1, 0)]  # an exact hit is admitted, and draws, alone
        out += [("set_bits", r, 0) for r in self.decode_buckets]
        t = 16
        while t <= self.prefill_chunk:
            out += [("prefill", r, t) for r in self.prefill_buckets if r * t <= self.prefill_chunk]
            t *= 2
        return out + [("setup_row", 1, 0), ("setup_row_snapshot", 1, 0), ("read_row", 1, 0), ("copy_page", 1, 0)]

    def covering_shapes(self) -> list[tuple]:
        """The fewest programs that serve every request correctly: the largest decode bucket (any
        batch pads to it), one row's smallest prefill chunk (any prompt splits into such chunks),
        the first draw of an exact hit and the per-request helpers. What `start(warmup=True)`
        has before it serves; the rest compile behind."""
        top = self.decode_buckets[-1]
        k = self.speculative_tokens
        out = [("spec_decode", top, k + 1)] if k else []
        out.append(("decode", top, 1))  # also a speculative engine's constrained rows (they never draft)
        out += [("prefill", 1, 16), ("sample_first", 1, 0), ("set_bits", top, 0)]
        return out + [s for s in self.shapes() if s[0] in ("setup_row", "setup_row_snapshot", "read_row", "copy_page")]

    def score_shapes(self) -> list[tuple]:
        """The prompt-scoring programs (`prompt_logprobs`): one per padded length up to max_len."""
        return [("score", 1, t) for t in _powers(16, length_bucket(self.max_len))]

    def background_shapes(self) -> list[tuple]:
        """What compiles behind, the most useful first: smaller decode buckets, longer one-row
        prefill chunks (fewer calls per prompt), the scoring programs, prefills of several rows."""
        have = set(self.covering_shapes())
        rest = [s for s in self.shapes() + self.score_shapes() if s not in have]
        order = {"decode": 0, "spec_decode": 0, "prefill": 1, "score": 2}
        return sorted(rest, key=lambda s: (order.get(s[0], 0) + (s[0] == "prefill" and s[1] > 1) * 2,
                                           -s[2] if s[0] == "prefill" else s[2], s[1]))

    def warmup(self, progress: bool = False, shapes: Sequence[tuple] | None = None) -> float:
        """Compile (or load from disk) every shape the loop can run (`shapes`: these only), so that
        no request waits for XLA. Call before `start`. Returns the seconds it took. One engine of a
        process warms up at a time: engines of one configuration share the programs, so the
        second finds them compiled instead of compiling them again beside the first."""
        with _WARMUP_LOCK:
            if self.programs is None:
                return self._warmup_by_running(progress)
            return self._prepare(list(shapes or self.shapes()), progress)

    def _prepare(self, shapes: list[tuple], progress: bool) -> float:
        """Have `shapes` compiled or loaded, several side by side (`engine_programs.StartUp`),
        one log line each (at INFO with `progress`: n/N, seconds, time left); stops early when
        the engine stops."""
        run = programs.StartUp(self.programs, shapes, programs.compile_threads())

        def report(shape, how, seconds):
            left = run.seconds_left() if run.done < run.total else None
            eta = f", about {left:.0f} s left" if left else ""
            level = logging.INFO if progress and how == "compiled" else logging.DEBUG  # a load is quick: no news
            log.log(level, "start-up: %d/%d %s %s in %.1f s%s", run.done, run.total, programs.shape_name(shape), how,
                    seconds, eta)

        run.run(self._cancel, report)
        seconds = time.perf_counter() - run.t0
        self.startup = dict(seconds=seconds, programs=len(shapes), summary=run.summary(), **run.outcomes)
        return seconds

    def _compile_behind(self, shapes: list[tuple]) -> None:
        """Compile `shapes` in a thread while the engine serves (`prompt_logprobs` may move one
        to the front); a request meanwhile runs on a larger compiled bucket or in smaller calls."""
        self._behind.extend(shapes)
        if not shapes:
            return

        def run():
            _yield_cpu_to_serving()
            t0, n = time.perf_counter(), 0
            while not self._cancel.is_set():
                try:
                    shape = self._behind.popleft()
                except IndexError:
                    break
                try:
                    n += self.programs.ensure(shape) != "present"
                except Exception:  # that bucket stays missing: its requests keep using the others
                    log.exception("compiling %s failed", programs.shape_name(shape))
            if n and not self._cancel.is_set():  # DEBUG: the URL stays the last line a user sees
                log.debug("start-up: the other %d programs are ready too (%.1f s behind, %d loaded, %d compiled)", n,
                         time.perf_counter() - t0, self.programs.counters["loaded"], self.programs.counters["compiled"])

        self._compiler = threading.Thread(target=run, name="hybridjax-compile", daemon=True)
        self._compiler.start()

    def prompt_logprobs(self, prompt_ids: Sequence[int], sp=None, top: int = 0) -> list[tuple[float, tuple]]:
        """`generate.prompt_logprobs` on a compiled scoring program: the smallest compiled length
        bucket that holds the prompt (padding on the right changes no position's score). Before
        one exists the compile thread does the one that fits next, and this waits for it: the
        caller's thread never compiles (unless the engine compiles nothing ahead: no warm-up)."""
        from hybridjax.generate import prompt_logprobs

        fits = [s for s in self.score_shapes() if s[2] >= len(prompt_ids)]
        if self.programs is None or not fits or len(prompt_ids) < 2:
            return prompt_logprobs(self.params, prompt_ids, self.cfg, sp, top)
        shape = next((s for s in fits if self.programs.has(s)), None)
        if shape is None:
            shape = fits[0]
            self._behind.appendleft(shape)  # next in line (a shape compiled twice is only 'present')
            while not self.programs.wait_for(shape, 0.5):
                if self._compiler is None or not self._compiler.is_alive():  # nothing compiles behind
                    self.programs.ensure(shape)
        return prompt_logprobs(self.params, prompt_ids, self.cfg, sp, top, bucket=shape[2],
                               scorer=self.programs.get(shape), empty_cache=self._empty_score_cache(shape[2]))

    def _empty_score_cache(self, t: int):
        """An empty cache of t positions for the scorer, made from host zeros (`init_cache` would
        compile its jnp.zeros), once per length."""
        cache = self._score_caches.get(t)
        if cache is None:
            from hybridjax.cache import init_cache

            shapes = jax.eval_shape(lambda: init_cache(self.cfg, 1, t, self.dtype, capacity=t))
            cache = self._score_caches[t] = jax.tree_util.tree_map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype)),
                                                                   shapes)
        return cache

    def _warmup_by_running(self, progress: bool) -> float:
        """Warm-up for calls that are jitted functions (hybridjax.multihost): run every shape
        once on padding rows (nothing changes), which compiles it."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        pad = lambda r: np.full((r,), self.slots, np.int32)  # noqa: E731  (out-of-range rows: no-ops)
        table = lambda r: np.full((r, self.pages_per_row), self.pool.num_pages, np.int32)  # noqa: E731
        shapes = self.shapes()
        for name, r, t in tqdm(shapes, desc="compiling", unit="program", disable=not progress):
            s = self._state
            if name == "decode":
                out, s = self.calls.decode(self.params, s, pad(r), table(r), self.cfg, self.implementation)
            elif name == "spec_decode":
                out, s = self.calls.spec_decode(self.params, s, pad(r), table(r), self.cfg, self.speculative_tokens,
                                                self.implementation)
            elif name == "sample_first":
                out, _, s = self.calls.sample_first(s, pad(r))
            elif name == "set_bits":
                out = s = self.calls.set_bits(s, pad(r), np.full((r, steps.mask_words(self.cfg.vocab_size)), -1, np.int32))
            elif name == "prefill":
                out, _, s = self.calls.prefill_chunk(self.params, s, pad(r), np.zeros((r, t), np.int32), np.zeros((r,), np.int32),
                                                table(r), np.zeros((r,), bool), self.cfg, self.implementation)
            elif name.startswith("setup_row"):
                gdn, logits = self.calls.read_row(s, 0) if name.endswith("snapshot") else (None, None)
                s = self._setup(s, self.slots, gdn, logits, 0, GenerationRequest([0], 1))
                out = s.lengths
            elif name == "read_row":
                out = self.calls.read_row(s, 0)
            else:
                out = s = self.calls.copy_page(s, self.pool.num_pages, self.pool.num_pages)
            self._state = s
            jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        log.info("compiled %d programs in %.1f s", len(shapes), seconds)
        return seconds

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
        while True:
            with self._wake:
                while (self._running and not self._waiting and not self._background and self.active_slots == 0
                       and self._inflight is None):
                    if not self._wake.wait(timeout=tick) and tick:
                        self.store.expire()
                if not self._running:
                    break
            try:
                self._admit()
                self._prefill()
                if self._inflight is not None and self._constrained_decoding():
                    # A constrained row's next mask needs the token in flight: no overlap.
                    self._process(self._inflight)
                    self._inflight = None
                step = self._dispatch()
                if self._inflight is not None:
                    self._process(self._inflight)
                self._inflight = step
            except Exception as e:  # a failed step must not kill the worker: fail its requests
                log.exception("engine step failed")
                self._fail_all(e)
        if self._inflight is not None:
            self._process(self._inflight)
            self._inflight = None
        for slot in self._rows:
            if slot is not None:
                self._close(slot, "cancelled")
                self._free(slot)

    def _start_up(self, progress: bool) -> None:
        """Have the covering set (loaded or compiled), then compile the rest behind; one line
        says how long it took and why."""
        t0 = time.perf_counter()
        if self.programs is None:
            self.warmup(progress)
            log.info("start-up: ready in %.1f s (compiled %d programs)", time.perf_counter() - t0, len(self.shapes()))
            return
        covering = [s for s in self.covering_shapes() if not self.programs.has(s)]
        kept = sum(map(self.programs.on_disk, covering))
        log.log(logging.INFO if progress else logging.DEBUG, "start-up: %d programs serve every request: %d kept on "
                "disk, %d to compile on %d threads; the other %d follow once serving", len(covering), kept,
                len(covering) - kept, programs.compile_threads(), len(self.background_shapes()))
        self.warmup(progress, self.covering_shapes())
        if self._cancel.is_set():
            return
        self._compiled_only = all(self.programs.has(s) for s in self.covering_shapes())  # (a replaced warm-up: no)
        rest = [s for s in self.background_shapes() if not self.programs.has(s)]
        rest.sort(key=lambda s: not self.programs.on_disk(s))  # a restart loads all it kept (quick) before compiling
        self.startup.update(ready_s=time.perf_counter() - t0, behind=len(rest))
        log.info("start-up: ready in %.1f s: %s%s", self.startup["ready_s"],
                 self.startup.get("summary", "nothing prepared"),  # (a warm-up replaced by the caller)
                 f"; {len(rest)} more compile behind" if rest else "")
        self._compile_behind(rest)

    def _fail_all(self, error: Exception) -> None:
        """Fail every running request and start over with a fresh device state: a failed step may
        have consumed (donated) the pool, so the snapshots that name its pages go too."""
        self.counters["errors"] += 1
        for slot in self._rows:
            if slot is not None:
                self.counters["finished_error"] += 1
                slot.handle.finish_reason = "error"  # the server reads it (500, not a 200 with no reason)
                slot.handle._emit(Event(None, "", "error"))
        self._rows = [None] * self.slots
        self._inflight = None
        if self.store is not None:
            self.store.clear()
        self._waiting_snapshots.clear()
        self.pool.reset()
        try:
            self._reset_device()
        except Exception:  # no device state to serve from (e.g. a follower process is gone): stop
            log.exception("the engine cannot reset its device state and stops")
            with self._wake:
                self._running = False
                waiting, self._waiting = list(self._waiting), deque()
            for h in waiting:
                self.counters["finished_error"] += 1
                h.finish_reason = "error"
                h._emit(Event(None, "", "error"))

    # --- admission ------------------------------------------------------------------------
    def _admit(self) -> None:
        free = [i for i, r in enumerate(self._rows) if r is None]
        with self._wake:
            batch = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
            if not self._waiting and len(batch) < len(free) and self._background and not self._prefilling():
                batch.append(self._background.popleft())  # idle time: one background prefill
        batch = [h for h in batch if not self._drop_if_cancelled(h)]
        if not batch:
            return
        reqs = [h.request for h in batch]
        hits = (self.store.lookup_many([r.prompt_ids for r in reqs], [r.namespace for r in reqs])
                if self.store is not None else [None] * len(batch))
        deferred, blocked = [], False
        for handle, hit in zip(batch, hits):
            # Waiting for pages keeps the queue's order; waiting for a shared prefix's snapshot
            # (which another row is about to take) holds back only this request.
            if blocked or self._wait_for_shared_prefix(handle.request, hit):
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
                handle.finish_reason = "error"  # as in _fail_all: the handle must say how it ended
                handle._emit(Event(None, "", "error"))
        with self._wake:
            self._waiting.extendleft(reversed(deferred))

    def _drop_if_cancelled(self, handle: RequestHandle) -> bool:
        if handle.cancelled.is_set():
            handle.finish_reason = "cancelled"
            self.counters["finished_cancelled"] += 1
            handle._emit(Event(None, "", "cancelled"))
            return True
        return False

    def _wait_for_shared_prefix(self, req: GenerationRequest, hit) -> bool:
        """True if a prompt being prefilled shares more of `req`'s prefix than the store has: it is
        given a snapshot point there, and `req` waits for that snapshot instead of recomputing it."""
        if self.store is None:
            return False
        best = None
        for slot in self._rows:
            if slot is not None and slot.prefilling:
                n = _shared_prefix([slot.handle.request], req)
                if n >= SHARE_MIN_TOKENS and n > hit.reused and slot.pos < n and (best is None or n > best[0]):
                    best = (n, slot)
        if best is None:
            return False
        n, slot = best
        if n not in slot.cuts:
            slot.cuts = sorted(slot.cuts + [n])
        return True

    def _start(self, handle: RequestHandle, hit, row: int) -> bool:
        """Set up `row` for a request; False (nothing changed) when the pool cannot hold it yet."""
        req, size = handle.request, self.pool.page_size
        snap = hit.snapshot if hit is not None else None
        start = hit.reused if snap is not None else 0
        shared = list(snap.pages[: start // size]) if snap is not None else []
        fresh = self._alloc(pages_for(len(req.prompt_ids) + req.max_tokens, size) - len(shared), keep=snap)
        if fresh is None:
            return False
        self.pool.retain(shared)
        if start % size:  # the snapshot's partial last page: copied, since this row writes past it
            self._state = self.calls.copy_page(self._state, snap.pages[start // size], fresh[0])
        pages = shared + fresh
        self._table[row] = self.pool.num_pages
        self._table[row, : len(pages)] = pages
        self._state = self._setup(self._state, row, snap.cache if snap else None, snap.logits if snap else None, start, req)
        constraint = None
        if req.grammar is not None:
            constraint = self.grammars.matcher(req.grammar)
            self._state = self.calls.set_bits(self._state, self._rows_array([row], self._ready_buckets("set_bits", 0)),
                                              self._bits([constraint], self._ready_buckets("set_bits", 0)))
        handle.cached_tokens = start
        if hit is not None and hit.report is not None:
            handle.cache_report = hit.report
        if req.max_tokens:  # a request someone sent (not a background prefill): counted by its report
            self.counters[f"cache_reason_{handle.cache_report.label}"] += 1
        extra = [p for p in (req.history_len,) if p]
        with self._wake:
            waiting = [h.request for h in self._waiting]
        extra += [n for n in (_shared_prefix(waiting, req),) if n >= SHARE_MIN_TOKENS]
        slot = _Slot(handle, row, StreamDecoder(self.tokenizer, skip_special_tokens=False) if self.tokenizer else None,
                     pages, start, checkpoint_positions(start, len(req.prompt_ids), self.checkpoint_interval, extra),
                     next(self._seq), constraint=constraint)
        # Special tokens stay in the text (stop tokens never reach it), so a client re-sending
        # the response re-encodes it to the same ids and hits the response snapshot.
        self._rows[row] = slot
        handle.admitted.set()
        if req.max_tokens == 0 and not slot.prefilling:  # background work whose snapshot exists already
            self._end_background(slot)
        elif not slot.prefilling:  # an exact hit: the stored logits give the first token, no model call
            drawn, _, self._state = self.calls.sample_first(self._state, self._rows_array([row], self.decode_buckets))
            self._deliver(slot, *_draw_of(drawn, 0, slot), start, moving=False, ends=(start, start))
        return True

    def _setup(self, state, row, gdn, logits, length, req: GenerationRequest):
        return self.calls.setup_row(state, np.int32(row), gdn, logits, *request_row_args(self.cfg, req, length))

    def _has(self):
        """Which shapes the loop may run: after a warm-up start, those whose program exists; else
        (jitted calls, or an engine started without warm-up: it compiles as it goes) all."""
        has = getattr(self.calls, "has", None)
        return has if self._compiled_only else None

    def _ready_buckets(self, name: str, tokens: int) -> list[int]:
        """The decode buckets whose program exists (`_has`)."""
        has = self._has()
        return [r for r in self.decode_buckets if has is None or has((name, r, tokens))]

    def _ready_prefill(self) -> dict[int, list[int]]:
        """rows -> the chunk widths (ascending) whose prefill program exists (`_has`)."""
        has = self._has()
        out: dict[int, list[int]] = {}
        for name, r, t in self.shapes():
            if name == "prefill" and (has is None or has((name, r, t))):
                out.setdefault(r, []).append(t)
        return {r: sorted(ts) for r, ts in out.items()}
    @functools.cached_property
    def grammars(self):
        """The grammar compiler of this engine's tokenizer and vocabulary (hybridjax.grammar)."""
        from hybridjax.grammar import Compiler

        if self.tokenizer is None:
            raise ValueError("constrained decoding needs a tokenizer")
        return Compiler(self.tokenizer.backend.to_str(), self.cfg.vocab_size,
                        tuple(self.tokenizer.eos_token_ids) + tuple(self.cfg.eos_token_id))

    def _bits(self, constraints: list, buckets: Sequence[int]) -> np.ndarray:
        """The constraints' masks [bucket, words] (padding rows allow everything)."""
        out = np.full((_bucket(len(constraints), buckets), steps.mask_words(self.cfg.vocab_size)), -1, np.int32)
        for i, c in enumerate(constraints):
            out[i] = c.bits
        return out

    def _constrained_decoding(self) -> bool:
        return any(s is not None and s.constraint is not None and not s.prefilling for s in self._rows)

    def _alloc(self, n: int, keep=None) -> list[int] | None:
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
    def _prefill(self) -> None:
        """One prefill call: a chunk of each prompt being prefilled, as many rows as fit the budget."""
        live = []
        for row, slot in enumerate(self._rows):
            if slot is not None and slot.prefilling:
                if slot.handle.cancelled.is_set():
                    self._close(slot, "cancelled")
                    self._free(slot)
                else:
                    live.append((slot.handle.request.max_tokens == 0, slot.seq, row, slot))
        if not live:
            return
        live.sort(key=lambda x: x[:2])  # oldest first, background work last
        widths = self._ready_prefill()  # rows -> compiled chunk widths
        n = max(r for r in widths if r <= len(live))  # rows this call: a whole bucket
        # tokens per row: a long prompt shares the budget with short ones, in chunks compiled
        cap = min(self.prefill_chunk // n, widths[n][-1])
        chosen = [(row, slot, min(slot.cuts[0], slot.pos + cap) - slot.pos) for _, _, row, slot in live[:n]]
        need = length_bucket(max(c for _, _, c in chosen))
        width = next(t for t in widths[n] if t >= need)  # the smallest compiled width that holds it
        tokens = np.zeros((n, width), np.int32)
        counts = np.zeros((n,), np.int32)
        last = np.zeros((n,), bool)
        for i, (row, slot, c) in enumerate(chosen):
            tokens[i, :c] = slot.prompt[slot.pos : slot.pos + c]
            counts[i], last[i] = c, slot.pos + c == len(slot.prompt) and slot.handle.request.max_tokens > 0
        rows = self._rows_array([row for row, _, _ in chosen], self.prefill_buckets)
        self._prefilled = True
        drawn, _, self._state = self.calls.prefill_chunk(self.params, self._state, rows, tokens, counts,
                                                     self._table_rows(rows), last, self.cfg, self.implementation)
        self.counters["prefill_chunks"] += 1
        self.counters["tokens_prefilled"] += int(counts.sum())
        for i, (row, slot, c) in enumerate(chosen):
            slot.pos += c
            if self.store is not None:
                self.store.counters["tokens_prefilled"] += c
            if slot.pos == slot.cuts[0]:
                slot.cuts.pop(0)
                self._snapshot(slot, row, self._snapshot_kind(slot))
            if not slot.prefilling and slot.handle.request.max_tokens == 0:
                self._end_background(slot)
            elif last[i]:
                self._deliver(slot, *_draw_of(drawn, i, slot), slot.pos, moving=False, ends=(slot.pos, slot.pos))

    def _end_background(self, slot: _Slot) -> None:
        """A background prefill ends: counted apart, not as a finished request (nobody sent it)."""
        slot.finished = True
        slot.handle.finish_reason = "stop"
        self.counters["background_prefills"] += 1
        slot.handle._emit(Event(None, "", "stop"))
        self._free(slot)

    def _prefilling(self) -> bool:
        return any(s is not None and s.prefilling for s in self._rows)

    def _snapshot_kind(self, slot: _Slot) -> str:
        if slot.pos == len(slot.prompt) and slot.handle.request.max_tokens == 0:
            return "history"  # a background prefill: kept like a chat history, never superseded
        if slot.pos == len(slot.prompt):
            return "prompt"
        return "history" if slot.pos == slot.handle.request.history_len else "checkpoint"

    def _snapshot(self, slot: _Slot, row: int, kind: str, length: int | None = None, copy_partial: bool = True,
                  ends: tuple[int, int] | None = None) -> None:
        """Store the row's state after its first `length` tokens: full pages by id; a partial
        last page copied (the row still writes into it) unless the row is done writing.
        ends: a response's (least, most) cache length once the dispatched steps have run
        (`_ends`): a speculative engine snapshots a response only if that is `length`."""
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
        size = self.pool.page_size
        pages = slot.pages[: length // size]
        if length % size:
            if copy_partial:
                copy = self._alloc(1)
                if copy is None:
                    self.counters["snapshots_skipped_no_pages"] += 1
                    return
                self._state = self.calls.copy_page(self._state, slot.pages[length // size], copy[0])
                pages = pages + copy
            else:
                copy = []
                pages = slot.pages[: pages_for(length, size)]
        gdn, logits = self.calls.read_row(self._state, row)
        tokens = (list(slot.prompt) + slot.drawn)[:length]
        insert = functools.partial(self.store.insert, tokens, gdn, logits, namespace=slot.handle.request.namespace,
                                   kind=kind, pages=pages)
        if wait:
            # A drafting step in flight feeds the row (the host saw a stop the device did not):
            # it ends at `length` only if it accepts no draft, which its outputs will say. The
            # state read now is the state after it (device work runs in dispatch order); its
            # pages are held until then. Asking the device now would wait for the step.
            self.pool.retain(pages)
            self._waiting_snapshots.setdefault(slot.last_step, []).append((slot, length, insert, pages))
            self.counters["spec_snapshots_waiting"] += 1
        else:
            insert()
        if length % size and copy_partial:
            self.pool.release(copy)  # the store holds it now (or nobody, if it kept an equal older entry)

    def _settle_snapshots(self, step: _Step, lengths: np.ndarray) -> None:
        """The response snapshots that waited for `step` (`_snapshot`): stored if the step left
        the row's cache at the response's end, else skipped."""
        for slot, length, insert, pages in self._waiting_snapshots.pop(step.index, ()):
            if int(lengths[step.slots.index(slot)]) == length:
                insert()
            else:
                self.counters["snapshots_skipped_speculative"] += 1
            self.pool.release(pages)

    def _ends(self, slot: _Slot, step: _Step, n: int, idle: bool, done: bool) -> tuple[int, int]:
        """(least, most) tokens in the row's cache once every dispatched step has run, from
        step `step`'s outputs (n: the row's length after it; idle: its last token is fed; done:
        it draws no more, on the device). Only the step after it (dispatched before these
        outputs were read) can move the row: a row it feeds that is done or that it does not
        draft for takes one token (its pending one); one it drafts for takes 1 to K + 1."""
        if slot.last_step <= step.index or idle:
            return n, n
        if done or not slot.last_drafting:
            return n + 1, n + 1
        return n + 1, n + 1 + self.speculative_tokens

    # --- decode ---------------------------------------------------------------------------
    def _dispatch(self) -> _Step | None:
        """Dispatch one decode step for the decoding rows (asynchronous: returns at once). A row
        whose last token (by max_tokens) the step in flight draws sits this step out: feeding that
        token would only add it to the response snapshot, and a request arriving next would wait
        for the step on the device."""
        rows = [r for r, slot in enumerate(self._rows)
                if slot is not None and not slot.prefilling and not self._drawing_last(slot)]
        if not rows:
            return None
        index = next(self._steps)
        arr = self._rows_array(rows, self._ready_buckets("spec_decode" if self.speculative_tokens else "decode",
                                                         self.speculative_tokens + 1))
        constrained = [r for r in rows if self._rows[r].constraint is not None]
        if constrained:  # each constrained row's mask for the token this step draws
            self._state = self.calls.set_bits(self._state, self._rows_array(constrained, self._ready_buckets("set_bits", 0)),
                                              self._bits([self._rows[r].constraint for r in constrained],
                                                         self._ready_buckets("set_bits", 0)))
        # Constrained rows decode without drafts: a draft would need the mask after tokens not drawn yet.
        draft = (self.speculative_tokens > 0 and not constrained
                 and (self._policy is None or self._policy.draft(len(arr))))
        if not draft and self.speculative_tokens:  # the adaptive policy's plain step: its own buckets
            arr = self._rows_array(rows, self._ready_buckets("decode", 1))
        started = time.perf_counter()
        if draft:
            outputs, self._state = self.calls.spec_decode(self.params, self._state, arr, self._table_rows(arr), self.cfg,
                                                          self.speculative_tokens, self.implementation)
            self.counters["spec_verify_steps"] += 1
        else:
            outputs, self._state = self.calls.decode(self.params, self._state, arr, self._table_rows(arr), self.cfg,
                                                self.implementation)
        slots = [self._rows[r] if r < self.slots else None for r in arr]
        for s in slots:
            if s is not None:
                s.last_step, s.last_drafting = index, draft
        self.counters["steps"] += 1
        step = _Step(index, slots, outputs, draft, started, self._prefilled)
        self._prefilled = False
        return step

    def _drawing_last(self, slot: _Slot) -> bool:
        in_flight = self._inflight is not None and slot.last_step == self._inflight.index
        return len(slot.handle.token_ids) + in_flight >= slot.handle.request.max_tokens

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
                self._close(slot, "cancelled")
                self._free(slot)
                continue
            n = int(lengths[i])
            self._deliver(slot, *_draw_of(drawn, i, slot), n, moving=slot.last_step > step.index,
                          ends=self._ends(slot, step, n, False, bool(done[i])))  # it drew: not idle

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
                self._close(slot, "cancelled")
                self._free(slot)
                continue
            c, n = int(count[i]), int(lengths[i])
            fed = c if idle[i] else c - 1  # tokens drawn this step that the cache now covers
            ends = self._ends(slot, step, n, bool(idle[i]), bool(done[i]))
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
        if self._policy is not None and not step.after_prefill:
            start = max(step.started, self._last_done) if self._last_done is not None else step.started
            self._policy.record(step.speculative, len(step.slots), done - start, gain)
        self._last_done = done

    # --- delivery and the end of a request -------------------------------------------------
    def _deliver(self, slot: _Slot, token: int, logprobs: tuple, length: int, moving: bool,
                 ends: tuple[int, int]) -> None:
        """Send one drawn token. `length`: the row's cache length when it was drawn; `moving`: a
        step already dispatched feeds it (the next step feeds a finished row's last token too);
        `ends`: the row's (least, most) cache length once the dispatched steps have run (`_ends`)."""
        h, req = slot.handle, slot.handle.request
        slot.drawn.append(token)
        h.token_ids.append(token)
        if logprobs:
            h.logprobs.append(logprobs)
        self.counters["tokens_generated"] += 1
        # A stop token ends the response (once min_tokens are drawn) and is not part of its text.
        stopped = token in req.stop_ids and len(h.token_ids) > req.min_tokens
        text = slot.held_text + (slot.decoder.push(token) if slot.decoder and not stopped else "")
        # A grammar that has matched a whole value (only the end may follow), or rejects the token, ends it.
        matched = slot.constraint is not None and not stopped and (not slot.constraint.advance(token)
                                                                     or slot.constraint.finished)
        done = stopped or matched or len(h.token_ids) >= req.max_tokens
        if done and slot.decoder:
            text += slot.decoder.flush()
        cut = min((text.find(s) for s in req.stop_strings if s in text), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        else:
            finish = "stop" if stopped or matched else ("length" if done else None)
        # Text that may be the start of a stop string waits for the next token.
        send, slot.held_text = (text, "") if finish else _safe_split(text, req.stop_strings)
        h.text += send
        h._emit(Event(token, send, None, *logprobs))
        if finish:
            self._close(slot, finish)
            # The response snapshot covers what the row's cache will cover: every token sent when
            # a dispatched step feeds the last one (a response that ends while decoding), else
            # all but the last (one that ends at its first token: the prompt's snapshot already).
            # The snapshot is read after that step: device work runs in dispatch order.
            self._snapshot(slot, slot.row, "response", length=length + int(moving), copy_partial=False, ends=ends)
            self._free(slot)

    def _close(self, slot: _Slot, reason: str) -> None:
        """The client gets its finish event."""
        slot.finished = True
        h = slot.handle
        h.finish_reason = reason
        self.counters[f"finished_{reason}"] += 1
        h._emit(Event(None, "", reason))

    def _free(self, slot: _Slot) -> None:
        """Free the slot and its pages (a snapshot taken before keeps its own hold). Safe while a
        dispatched step still runs on the row: device work runs in dispatch order."""
        self._rows[slot.row] = None
        self.pool.release(slot.pages)

    # --- small helpers ------------------------------------------------------------------
    def _rows_array(self, rows: list[int], buckets: Sequence[int]) -> np.ndarray:
        out = np.full((_bucket(len(rows), buckets),), self.slots, np.int32)  # padding: out of range
        out[: len(rows)] = rows
        return out

    def _table_rows(self, rows: np.ndarray) -> np.ndarray:
        """The page tables of `rows` (padding rows: no pages)."""
        out = np.full((len(rows), self.pages_per_row), self.pool.num_pages, np.int32)
        real = rows < self.slots
        out[real] = self._table[rows[real]]
        return out
