"""Heavy per-request work off the event loop, each kind in its own lane.

A lane is a small thread pool of its own with a bound on the work it holds (running and
waiting): a burst of one kind of request (prompts to score for echo + logprobs, large bodies to
parse) queues behind itself, never in front of other requests' tokenizing or /health, and past
the bound it is refused at once (429) instead of waiting without end.

`decode_body` is the JSON parsing and lone-surrogate check of a request body, the part of a
large body's cost that used to run on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

# Bodies up to this size are parsed on the event loop (microseconds); larger ones in a lane.
INLINE_BODY_BYTES = 64 * 1024
# Where a lone surrogate can come from: an escape of one (\uD800-\uDFFF), or its raw UTF-8 bytes
# (json.loads decodes bytes with 'surrogatepass'). Bodies without either skip the walk.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")


class LaneFull(Exception):
    pass


class BodyError(ValueError):
    """A body that is not a JSON object of valid Unicode; `param` names the bad field if any."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Lane:
    """`threads` workers for one kind of work; at most `limit` calls held at once (`LaneFull`
    past it). Calls and the count run on the event loop, so the count needs no lock."""

    def __init__(self, name: str, threads: int, limit: int):
        self.name, self.limit = name, limit
        self.held = 0
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"hybridjax-{name}")

    async def run(self, fn: Callable, *args):
        if self.held >= self.limit:
            raise LaneFull(f"too many requests waiting to {self.name} ({self.limit})")
        self.held += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.held -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def decode_body(raw: bytes) -> dict:
    """The JSON object in `raw`, every string and key valid Unicode; else `BodyError`."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BodyError("invalid JSON body: nested too deeply") from None
    except ValueError as e:  # also integer literals over Python's 4300-digit limit, bad UTF-8
        raise BodyError(f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BodyError("the request body must be a JSON object")
    if _MAYBE_SURROGATE.search(raw):
        bad = unencodable_string(body)
        if bad is not None:
            raise BodyError(f"invalid parameter '{bad}': the string is not valid Unicode (a lone surrogate)",
                            param=bad)
    return body


def printable(s: str) -> str:
    """`s` with any lone surrogate written as an escape (\\udc80), so a message can quote it."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def unencodable_string(body) -> str | None:
    """The path ('messages.0.content') of the first string or key that is not valid Unicode
    (JSON lets a lone surrogate through; the tokenizer cannot encode it), itself printable. Iterative:
    the body may be as deep as the JSON parser allows."""
    stack = [((), body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return ".".join(printable(str(p)) for p in path) or None
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((path + (k,), k))
                stack.append((path + (k,), x))
        elif isinstance(v, list):
            stack.extend((path + (i,), x) for i, x in enumerate(v))
    return None
