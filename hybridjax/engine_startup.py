"""What the engine compiles, and when: every program its loop can run (`Shapes`), the covering set
it serves from, and `Compiles`: the covering set ahead on several threads, the rest behind on one
low-priority thread while the engine serves, a scoring program next in line when a request needs it.
Programs themselves (executables, kept on disk) are hybridjax.engine_programs'."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections import deque
from typing import Callable, Sequence

from hybridjax import engine_programs as programs
log = logging.getLogger("hybridjax.engine")

# Widths of the pieces a prompt is scored in (echo + logprobs): the narrowest is in the covering set,
# so no echo waits for a compile; wider ones, made behind, take fewer calls for a long prompt.
# Scoring in pieces replaced one program per padded length (9 at --max-len 4096, each compiled
# behind and ~6-10 s of a core): the first echo of a length waited for its program (benchmarks/README.md).
SCORE_PIECES = (16, 256)


def one_row_prefill(shape: tuple) -> bool:
    """A prefill chunk of one row: a long prompt's, what a restart loads first (`Shapes.loading`)."""
    return shape[:2] == ("prefill", 1)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The programs of an engine's settings, as (step name, rows, tokens)."""

    decode_buckets: tuple[int, ...]
    prefill_buckets: tuple[int, ...]
    prefill_chunk: int
    speculative_tokens: int
    max_len: int

    @property
    def draw_buckets(self) -> tuple[int, ...]:
        """The row counts of the draw programs: a decode step's or a prefill call's (an exact hit
        draws alone: 1 row). A draw of fewer rows pads to the next one made."""
        return tuple(sorted(set(self.decode_buckets) | set(self.prefill_buckets) | {1}))

    def all(self) -> list[tuple]:
        """Every program the loop runs: what a full warm-up compiles."""
        k = self.speculative_tokens
        out = [("spec_decode", r, k + 1) for r in self.decode_buckets] if k else []
        # Plain steps also serve a speculative engine's constrained rows (they never draft).
        out += [("decode", r, 1) for r in self.decode_buckets]
        out += [("draw", r, 0) for r in self.draw_buckets]  # after a decode step, a prompt's end, an exact hit
        out += [("set_bits", r, 0) for r in self.decode_buckets]
        t = 16
        while t <= self.prefill_chunk:
            out += [("prefill", r, t) for r in self.prefill_buckets if r * t <= self.prefill_chunk]
            t *= 2
        return out + [("setup_row", 1, 0), ("setup_row_snapshot", 1, 0), ("read_row", 1, 0), ("copy_page", 1, 0)]

    def covering(self) -> list[tuple]:
        """The fewest programs that serve every request correctly: the largest decode bucket (any
        batch pads to it), one row's smallest prefill chunk (any prompt splits into such chunks),
        the largest draw (any draw pads to it), the per-request helpers and the narrowest scoring
        piece (any prompt's echo + logprobs is scored in such pieces)."""
        top = self.decode_buckets[-1]
        k = self.speculative_tokens
        out = [("spec_decode", top, k + 1)] if k else []
        out.append(("decode", top, 1))  # also a speculative engine's constrained rows (they never draft)
        out += [("prefill", 1, 16), ("draw", self.draw_buckets[-1], 0), ("set_bits", top, 0)]
        out += [s for s in self.all() if s[0] in ("setup_row", "setup_row_snapshot", "read_row", "copy_page")]
        return out + self.score()[:1]

    def widest_prefill(self) -> tuple:
        """One row's widest prefill chunk: a long prompt's (on the 0.23B model, 3.6 ms a token in
        256-token chunks against 14.5 ms in 16-token ones: benchmarks/README.md, bench_startup)."""
        return ("prefill", 1, self.prefill_chunk)

    def score(self) -> list[tuple]:
        """The prompt-scoring programs (`Engine.prompt_logprobs`): one per piece width, narrowest first."""
        return [("score", 1, w) for w in SCORE_PIECES if w <= max(self.max_len, SCORE_PIECES[0])]

    def background(self) -> list[tuple]:
        """What compiles behind, the most useful first: one row's widest prefill chunk (a long
        prompt's calls cost 4x less a token than in 16-token chunks, where the next decode bucket
        saves ~15% of a step), smaller decode buckets, the other one-row prefill chunks (longer
        first), the scoring programs, prefills of several rows."""
        have = set(self.covering())
        rest = [s for s in self.all() + self.score() if s not in have]
        order = {"decode": 0, "spec_decode": 0, "prefill": 1, "score": 2}
        widest = self.widest_prefill()

        def rank(s):
            group = -1 if s == widest else order.get(s[0], 0) + (s[0] == "prefill" and s[1] > 1) * 2
            return group, -s[2] if s[0] == "prefill" else s[2], s[1]

        return sorted(rest, key=rank)

    def loading(self) -> list[tuple]:
        """The order a restart loads kept programs in (`engine_programs.preload`, then behind): the
        covering set, then one row's prefill chunks, widest first, then the others as they compile
        behind. A load costs about the same for any program (0.2-0.5 s of a core, the 0.23B
        model), so what a user meets first goes first: a long prompt's 64- or 128-token tail in
        16-token chunks made its first request 2x the later ones after a warm restart."""
        behind = self.background()
        one_row = sorted(filter(one_row_prefill, behind), key=lambda s: -s[2])
        return self.covering() + one_row + [s for s in behind if s not in one_row]

    def ready_buckets(self, name: str, tokens: int, has: Callable | None) -> list[int]:
        """The decode buckets whose `name` program exists (`has` None: all may run)."""
        return [r for r in self.decode_buckets if has is None or has((name, r, tokens))]

    def ready_prefill(self, has: Callable | None) -> dict[int, list[int]]:
        """rows -> the chunk widths (ascending) whose prefill program exists (`has` None: all)."""
        out: dict[int, list[int]] = {}
        for name, r, t in self.all():
            if name == "prefill" and (has is None or has((name, r, t))):
                out.setdefault(r, []).append(t)
        return {r: sorted(ts) for r, ts in out.items()}


def yield_cpu_to_serving() -> None:
    """Lower the calling thread's CPU priority (Linux: the nice value is per thread), so that the
    programs compiled behind take the cores the streams being served leave idle: on 2 cores one
    compile held a core and one stream ran at 0.75x of generate until all were done
    (benchmarks/bench_serve_decode.py --during-compiles)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at the same priority
        pass


class Compiles:
    """An engine's programs coming into being (`programs`: its ProgramSet): ahead (`prepare`),
    behind (`behind`), or at once for a request that waits for it (`first`). `cancel` stops them
    between programs (a compile under way cannot be interrupted)."""

    def __init__(self, program_set: "programs.ProgramSet", cancel: threading.Event,
                 made: Callable[[tuple], None] = lambda shape: None):
        self.programs, self.cancel = program_set, cancel
        self.made = made  # called with each shape compiled or loaded behind (the engine runs it once)
        self.queue: deque[tuple] = deque()  # shapes the thread behind does next, in order
        self.thread: threading.Thread | None = None  # the one compiling behind
        self.urgent: list[threading.Thread] = []  # those compiling for a waiting request (`first`)
        self.startup: dict = {}  # how `prepare` went: seconds, programs loaded / compiled

    def prepare(self, shapes: Sequence[tuple], progress: bool,
                after: Callable[[tuple], None] | None = None) -> float:
        """Have `shapes` compiled or loaded, several side by side (`engine_programs.StartUp`), one
        log line each (at INFO with `progress`: n/N, seconds, time left); `after(shape)` then, on
        the thread that made it (the engine: its first run). Returns the seconds."""
        run = programs.StartUp(self.programs, list(shapes), programs.compile_threads())

        def report(shape, how, seconds):
            left = run.seconds_left() if run.done < run.total else None
            eta = f", about {left:.0f} s left" if left else ""
            level = logging.INFO if progress and how == "compiled" else logging.DEBUG  # a load is quick: no news
            log.log(level, "start-up: %d/%d %s %s in %.1f s%s", run.done, run.total, programs.shape_name(shape), how,
                    seconds, eta)

        run.run(self.cancel, report, after)
        seconds = time.perf_counter() - run.t0
        self.startup = dict(seconds=seconds, programs=len(shapes), summary=run.summary(), **run.outcomes)
        return seconds

    def behind(self, shapes: Sequence[tuple]) -> None:
        """Compile `shapes` in a thread at low priority while the engine serves. One row's prefill
        chunks at their head that exist or are kept on disk (a restart's, `Shapes.loading`) are
        made first at the serving priority: a load is 0.2-0.5 s of a core, but at nice +10 beside
        the requests the 0.23B model's took seconds, and a long prompt went in 16-token chunks
        meanwhile (2.1x the later ones after a warm restart: benchmarks/README.md)."""
        self.queue.extend(shapes)
        if not shapes:
            return
        def kept_one_row_prefill(s):
            return one_row_prefill(s) and (self.programs.has(s) or self.programs.on_disk(s))

        ahead = len(list(itertools.takewhile(kept_one_row_prefill, shapes)))  # made at the serving priority

        def run():
            t0, n, made = time.perf_counter(), 0, 0
            while not self.cancel.is_set():
                if made == ahead:
                    yield_cpu_to_serving()
                try:
                    shape = self.queue.popleft()
                except IndexError:
                    break
                made += 1
                try:
                    n += self.programs.ensure(shape) != "present"
                    self.made(shape)
                except Exception:  # that bucket stays missing: its requests keep using the others
                    log.exception("compiling %s failed", programs.shape_name(shape))
            if n and not self.cancel.is_set():  # DEBUG: the URL stays the last line a user sees
                log.debug("start-up: the other %d programs are ready too (%.1f s behind, %d loaded, %d compiled)", n,
                          time.perf_counter() - t0, self.programs.counters["loaded"], self.programs.counters["compiled"])

        self.thread = threading.Thread(target=run, name="hybridjax-compile", daemon=True)
        self.thread.start()

    def first(self, shape: tuple) -> None:
        """Have `shape` now, for a request that waits for it: compiled at once on a thread of its
        own at the serving priority (not behind the queue: the thread behind may be minutes from
        it, and at nice +10 it yields the cores to this one). The caller's thread never compiles:
        an exit waits for the compiling threads (`threads`), which XLA needs."""
        if self.programs.has(shape):
            return
        failed: list[BaseException] = []

        def run():
            try:
                self.programs.ensure(shape)  # per shape at most one compile: the thread behind may join it
            except BaseException as e:  # noqa: BLE001  (handed to the waiting caller)
                failed.append(e)

        t = threading.Thread(target=run, name="hybridjax-compile", daemon=True)
        self.urgent.append(t)
        t.start()
        t.join()
        self.urgent.remove(t)
        if failed:
            raise failed[0]

    def threads(self) -> list[threading.Thread]:
        """The threads compiling now (behind, or for a waiting request)."""
        return [t for t in (self.thread, *self.urgent) if t is not None and t.is_alive()]
