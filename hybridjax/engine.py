"""The engine: continuous batching over a fixed number of decode slots, with exact-prefix
snapshot reuse at admission.

One background thread owns all device state: a batched cache of `slots` rows, the next-token
logits of every row, and the per-row sampler. Each loop iteration
  1. admits waiting requests into free slots: one pass over the snapshot store finds every
     request's longest cached prefix; only the rest of each prompt is prefilled (from the
     snapshot, without donation: the snapshot stays intact and may be shared by several
     requests), cut at checkpoint positions where snapshots are taken; an exact hit uses the
     stored logits and makes no model call;
  2. runs one jitted, donating step for all slots (draw a token per active row, feed it back);
  3. hands tokens to their requests, finishes rows that stopped (their end-of-response
     snapshot is a copy of the row, so the batched cache stays donatable) and frees slots of
     cancelled requests.
Requests are independent rows: greedy output does not depend on the batch or on cache hits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from collections import Counter, deque
from typing import AsyncIterator, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridjax.cache import Cache, bucket, init_cache, with_capacity
from hybridjax.config import Config
from hybridjax.generate import (
    init_sampler, pad_prompts, prefill, read_row, sample_and_decode_donating, write_row_donating,
)
from hybridjax.params import Params
from hybridjax.prefix_cache import SnapshotStore, checkpoint_positions
from hybridjax.sampling import sampling_params
from hybridjax.tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The engine's waiting queue is at its bound; the client should retry later."""


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


@dataclasses.dataclass(frozen=True)
class Event:
    token_id: int | None
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"


class RequestHandle:
    """What `Engine.submit` returns: the request's events, its usage, and `cancel()`."""

    _ids = itertools.count()

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None):
        self.id = next(self._ids)
        self.request = request
        self.prompt_tokens = len(request.prompt_ids)
        self.cached_tokens = 0
        self.token_ids: list[int] = []
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


@dataclasses.dataclass
class _Slot:
    handle: RequestHandle
    decoder: StreamDecoder | None
    held_text: str = ""  # decoded text not yet sent (it may be the start of a stop string)


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
                 max_queue: int = 64):
        if slots < 1 or max_len < 2:
            raise ValueError("engine: slots must be >= 1 and max_len >= 2")
        self.cfg, self.params, self.tokenizer = cfg, params, tokenizer
        self.slots, self.max_len = slots, max_len
        self.store, self.checkpoint_interval, self.max_queue = store, checkpoint_interval, max_queue
        self.counters: Counter = Counter()
        self._waiting: deque[RequestHandle] = deque()
        self._wake = threading.Condition()
        self._rows: list[_Slot | None] = [None] * slots
        self._thread: threading.Thread | None = None
        self._running = False
        # Device state, owned by the engine thread.
        self._cache = init_cache(cfg, slots, max_len)
        self._logits = jnp.zeros((slots, cfg.vocab_size), jnp.float32)
        self._sampler = init_sampler(sampling_params(slots), [0] * slots, cfg.vocab_size)

    # --- public API (any thread) ----------------------------------------------------
    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n + max(request.max_tokens, 1) > self.max_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) exceeds the context length {self.max_len}")
        handle = RequestHandle(request, loop)
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull(f"the queue is full ({self.max_queue} waiting requests)")
            self._waiting.append(handle)
            self.counters["requests"] += 1
            self._wake.notify()
        return handle

    def start(self) -> "Engine":
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._loop, name="hybridjax-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_slots(self) -> int:
        return sum(r is not None for r in self._rows)

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> RequestHandle:
        """Submit and wait for the end (tests, scripts)."""
        handle = self.submit(request)
        for _ in handle.events(timeout=timeout):
            pass
        return handle

    # --- the loop (engine thread) ----------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._running and not self._waiting and self.active_slots == 0:
                    self._wake.wait()
                if not self._running:
                    break
            try:
                self._admit()
                if self.active_slots:
                    self._step()
            except Exception as e:  # a failed step must not kill the worker: fail its requests
                log.exception("engine step failed")
                self._fail_all(e)
        for row, slot in enumerate(self._rows):
            if slot is not None:
                self._finish(row, "cancelled", snapshot=False)

    def _fail_all(self, error: Exception) -> None:
        self.counters["errors"] += 1
        for row, slot in enumerate(self._rows):
            if slot is not None:
                slot.handle.finish_reason = "error"  # the server reads it (500, not a 200 with no reason)
                slot.handle._emit(Event(None, "", "error"))
                self._rows[row] = None
        self._cache = init_cache(self.cfg, self.slots, self.max_len)
        # The step donates logits and sampler too: if it failed after donating, they are deleted
        # buffers and every later step would fail. Rebuild them so the worker keeps serving.
        self._logits = jnp.zeros((self.slots, self.cfg.vocab_size), jnp.float32)
        self._sampler = init_sampler(sampling_params(self.slots), [0] * self.slots, self.cfg.vocab_size)

    def _admit(self) -> None:
        free = [i for i, r in enumerate(self._rows) if r is None]
        with self._wake:
            batch = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
        batch = [h for h in batch if not self._drop_if_cancelled(h)]
        if not batch:
            return
        reqs = [h.request for h in batch]
        hits = (self.store.lookup_many([r.prompt_ids for r in reqs], [r.namespace for r in reqs])
                if self.store is not None else [None] * len(batch))
        for k, (handle, hit, row) in enumerate(zip(batch, hits, free)):
            try:
                if self.store is not None and _shared_prefix(reqs[:k], reqs[k]) > hit.reused:
                    # An earlier request of this batch has just stored a longer shared prefix.
                    hit = self.store.lookup(reqs[k].prompt_ids, reqs[k].namespace)
                # Requests admitted together that share a prefix: the first one snapshots it.
                shared = _shared_prefix(reqs[k + 1 :], reqs[k]) if self.store is not None else 0
                self._start(handle, hit, row, shared)
            except Exception:
                log.exception("admission failed")
                self.counters["errors"] += 1
                handle.finish_reason = "error"  # as in _fail_all: the handle must say how it ended
                handle._emit(Event(None, "", "error"))

    def _drop_if_cancelled(self, handle: RequestHandle) -> bool:
        if handle.cancelled.is_set():
            handle.finish_reason = "cancelled"
            handle._emit(Event(None, "", "cancelled"))
            return True
        return False

    def _prefill_with_snapshots(self, req: GenerationRequest, hit, shared: int = 0) -> tuple[jax.Array, Cache]:
        """(logits [vocab], batch-of-one cache) after the prompt, reusing `hit`, taking
        snapshots at checkpoint positions, the end of the history and the end of the prompt."""
        prompt = req.prompt_ids
        if hit is not None and hit.snapshot is not None:
            if hit.exact:
                return hit.snapshot.logits, hit.snapshot.cache
            start, cache = hit.reused, hit.snapshot.cache
        else:
            start, cache = 0, init_cache(self.cfg, 1, self.max_len)
        extra = [p for p in (req.history_len, shared) if p]
        logits = None
        for cut in checkpoint_positions(start, len(prompt), self.checkpoint_interval, extra):
            tokens, counts = pad_prompts([prompt[start:cut]])
            logits, cache = prefill(self.params, tokens, cache, self.cfg, counts)
            logits = logits[0]
            self.counters["tokens_prefilled"] += cut - start
            if self.store is not None:
                self.store.counters["tokens_prefilled"] += cut - start
                kind = "prompt" if cut == len(prompt) else ("history" if cut == req.history_len else "checkpoint")
                self.store.insert(prompt[:cut], cache, logits, namespace=req.namespace, kind=kind)
            start = cut
        return logits, cache

    def _start(self, handle: RequestHandle, hit, row: int, shared: int = 0) -> None:
        req = handle.request
        handle.cached_tokens = hit.reused if hit is not None else 0
        logits, row_cache = self._prefill_with_snapshots(req, hit, shared)
        if row_cache.capacity > self._cache.capacity:
            self._cache = with_capacity(self._cache, row_cache.capacity)
        self._cache, self._logits = write_row_donating(
            (self._cache, self._logits), (row_cache, logits[None]), jnp.int32(row))
        sp = sampling_params(1, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                             repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                             frequency_penalty=req.frequency_penalty)
        tokens, counts = pad_prompts([req.prompt_ids])
        row_sampler = init_sampler(sp, [req.seed], self.cfg.vocab_size, tokens, counts)
        self._sampler = write_row_donating(self._sampler, row_sampler, jnp.int32(row))
        # Special tokens stay in the text (stop tokens never reach it), so a client re-sending
        # the response re-encodes it to the same ids and hits the response snapshot.
        decoder = StreamDecoder(self.tokenizer, skip_special_tokens=False) if self.tokenizer else None
        self._rows[row] = _Slot(handle, decoder)
        handle.admitted.set()

    def _step(self) -> None:
        active = np.array([r is not None for r in self._rows])
        needed = int(np.max(np.asarray(self._cache.lengths)[active], initial=0)) + 1
        if needed > self._cache.capacity:
            self._cache = with_capacity(self._cache, bucket(needed, self.max_len))
        tok, self._logits, self._cache, self._sampler = sample_and_decode_donating(
            self.params, self._logits, self._cache, self._sampler, jnp.asarray(active), self.cfg)
        tok = np.asarray(tok)
        lengths = np.asarray(self._cache.lengths)
        for row, slot in enumerate(self._rows):
            if slot is None:
                continue
            if slot.handle.cancelled.is_set():
                self._finish(row, "cancelled", snapshot=False)
                continue
            self._deliver(row, slot, int(tok[row]), int(lengths[row]))
        self.counters["steps"] += 1

    def _deliver(self, row: int, slot: _Slot, token: int, length: int) -> None:
        h, req = slot.handle, slot.handle.request
        h.token_ids.append(token)
        self.counters["tokens_generated"] += 1
        stopped = token in req.stop_ids  # a stop token ends the response and is not part of its text
        text = slot.held_text + (slot.decoder.push(token) if slot.decoder and not stopped else "")
        done = stopped or len(h.token_ids) >= req.max_tokens or length >= self.max_len
        if done and slot.decoder:
            text += slot.decoder.flush()
        cut = min((text.find(s) for s in req.stop_strings if s in text), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        else:
            finish = "stop" if stopped else ("length" if done else None)
        # Text that may be the start of a stop string waits for the next token.
        send, slot.held_text = (text, "") if finish else _safe_split(text, req.stop_strings)
        h.text += send
        h._emit(Event(token, send, None))
        if finish:
            self._finish(row, finish)

    def _finish(self, row: int, reason: str, snapshot: bool = True) -> None:
        slot = self._rows[row]
        self._rows[row] = None
        h = slot.handle
        if snapshot and self.store is not None and reason in ("stop", "length"):
            # The row's cache covers prompt + every generated token: the next turn resumes here.
            tokens = list(h.request.prompt_ids) + h.token_ids
            cache = read_row(self._cache, row, bucket(len(tokens), self.max_len))
            self.store.insert(tokens, cache, self._logits[row], namespace=h.request.namespace, kind="response")
        h.finish_reason = reason
        self.counters[f"finished_{reason}"] += 1
        h._emit(Event(None, "", reason))
