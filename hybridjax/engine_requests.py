"""What a caller hands the engine and gets back: a `GenerationRequest`, the `RequestHandle` that
streams its `Event`s, and the errors of submission. Plain Python: the server, the scheduler and
the tests use these without touching the device."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import math
import queue
import threading
from typing import AsyncIterator, Iterator

import numpy as np

from hybridjax.token_ids import frozen_ids
from hybridjax.prefix_report import CACHE_OFF, CacheReport


class QueueFull(Exception):
    """The engine's waiting queue is at its bound; the client should retry later."""


class InvalidRequest(ValueError):
    """A request the engine cannot run; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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

    @functools.cached_property
    def prompt_array(self) -> np.ndarray:
        """`prompt_ids` as a read-only int32 array, made once: the store's lookup, the row's setup
        and every snapshot of the prompt (a prefix of this one array, not a copy) share it."""
        return frozen_ids(self.prompt_ids)


def check_request(req: GenerationRequest, vocab_size: int, max_logprobs: int) -> None:
    """Reject values the device steps cannot take (int32 / uint32 fields, non-finite floats)
    at submission, so that a bad request fails alone and before any stream starts."""

    def bad(field, why):
        raise InvalidRequest(f"invalid {field} {getattr(req, field)!r}: {why}", field)

    if not 0 <= req.top_k < 2**31:
        bad("top_k", "must be in [0, 2**31)")
    if not 0 <= req.seed < 2**32:
        bad("seed", "must be in [0, 2**32)")
    if req.logprobs is not None and not 0 <= req.logprobs <= max_logprobs:
        bad("logprobs", f"must be in [0, {max_logprobs}]")
    for field in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(req, field)):
            bad(field, "must be finite")
    if req.temperature < 0 or not 0 < req.top_p <= 1 or req.repetition_penalty <= 0:
        bad("temperature" if req.temperature < 0 else "top_p" if not 0 < req.top_p <= 1 else "repetition_penalty",
            "out of range")
    if req.prompt_ids and not (0 <= min(req.prompt_ids) and max(req.prompt_ids) < vocab_size):  # in C
        bad("prompt_ids", f"token ids must be in [0, {vocab_size})")
    if not 0 <= req.min_tokens <= max(req.max_tokens, 0):
        bad("min_tokens", "must be in [0, max_tokens]")
    for tid, b in req.logit_bias:
        if not 0 <= tid < vocab_size:
            bad("logit_bias", f"token id {tid} is outside the vocabulary [0, {vocab_size})")
        if not -100 <= b <= 100:
            bad("logit_bias", f"the bias of token {tid} must be in [-100, 100]")


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
        self.not_before = 0.0  # idle-time work: not started before this perf_counter time
        self.row_args: tuple | None = None  # engine.request_row_args, made by the submitting thread
        self._loop = loop
        self._queue: queue.Queue | asyncio.Queue = asyncio.Queue() if loop else queue.Queue()

    def cancel(self) -> None:
        """Stop generating; the slot is freed at the engine's next step."""
        self.cancelled.set()

    def finish(self, reason: str) -> None:
        """The last event: the request ended with `reason` (engine thread)."""
        self.finish_reason = reason
        self._emit(Event(None, "", reason))

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
