"""The engine's compiled programs: each shape the loop runs is one executable, compiled ahead of
time (or loaded from disk), and called directly, so a live request never meets XLA.

A shape is (step name, rows, tokens), as `Engine.shapes` lists them. `ProgramSet` holds the
executables of one engine configuration; engines of one configuration in a process share it.
With a directory, every executable is also kept on disk (`jax.experimental.serialize_executable`)
under a key of everything that makes it valid: the model config, the abstract params and engine
state (shapes, dtypes, shardings), the engine's settings, the jax / jaxlib versions, the backend
and its devices, the CPU's feature flags, XLA_FLAGS and the digest of this package's source.
A restart then loads executables without tracing or compiling; a missing, mismatched or
corrupt file (each carries a checksum) is compiled again, never trusted.

A launch may name itself (`note_launch`): the next launch of that name loads the programs the
last one started with while its weights load (`preload`), before the engine that will use them
exists; they are used only under the key the engine then computes, so a stale name costs a load,
never a wrong program.

`CompiledCalls` is the engine's `calls` over a ProgramSet: the step functions of
`hybridjax.engine_steps`, served by the executable of their shape, falling back to the jitted
function (which compiles, counted in `live_compiles`) only for a shape nothing compiled.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from hybridjax import compile_cache
from hybridjax import engine_steps as steps

log = logging.getLogger(__name__)

_MAGIC = b"hybridjax-executable-1\n"
_REGISTRY: dict[str, "ProgramSet"] = {}
_REGISTRY_LOCK = threading.Lock()


# --- what makes an executable valid ------------------------------------------------------------


def abstract(tree):
    """ShapeDtypeStructs (with the arrays' shardings) for every array leaf of `tree`."""
    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, (np.ndarray, np.generic)):
            return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
        return x

    return jax.tree_util.tree_map(one, tree)


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """sha256 over the sources the programs are made of: the package's Python files and the
    kernels' (hybridjax.pallas_kernels, inside the package when installed, beside it in a
    checkout). Changed code makes different programs; tests, benchmarks and docs do not count."""
    import hybridjax

    package = Path(hybridjax.__file__).resolve().parent
    roots = [package] + [r / "pallas_kernels" for r in map(Path, hybridjax.__path__) if r.resolve() != package]
    h = hashlib.sha256()
    for root in roots:
        for f in sorted(root.rglob("*.py")) if root.is_dir() else ():
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> str:
    """What a compiled program depends on beyond its inputs: versions, backend, devices, CPU, and
    whether the CPU kernels' extension is built (the same source makes other programs without it:
    XLA's dots in place of its calls, which a process without it cannot load)."""
    import jaxlib

    from hybridjax import cpu_kernels

    devices = jax.devices()
    return repr((jax.__version__, jaxlib.__version__, jax.default_backend(), len(devices),
                 sorted({d.device_kind for d in devices}), jax.process_count(), cpu_flags(),
                 os.environ.get("XLA_FLAGS", ""), platform.python_version(), source_digest(),
                 {k: v for k, v in os.environ.items() if k.startswith("HYBRIDJAX_CPU_")}, cpu_kernels.available()))


def program_key(cfg, params, state, settings: dict) -> str:
    """A short digest naming one engine configuration's programs (`params`, `state`: abstract)."""
    described = repr((cfg, jax.tree_util.tree_structure(params), jax.tree_util.tree_leaves(params),
                      jax.tree_util.tree_structure(state), jax.tree_util.tree_leaves(state),
                      sorted(settings.items()), environment()))
    return hashlib.sha256(described.encode()).hexdigest()[:24]


# --- one configuration's programs ------------------------------------------------------------


def shape_name(shape: tuple) -> str:
    name, rows, tokens = shape
    return f"{name}-{rows}x{tokens}"


class ProgramSet:
    """The executables of one engine configuration, by shape. `lowerers` maps a shape's name to
    a function (rows, tokens, tag) -> jax.stages.Lowered whose module is named after tag (the set's key:
    `_compile`); `directory` (optional): where executables are kept between runs. Thread-safe: the
    engine thread reads, a compile thread adds."""

    def __init__(self, key: str, lowerers: dict, directory: str | Path | None = None):
        self.key, self.lowerers = key, lowerers
        self.directory = Path(directory) / key if directory else None
        self._compiled: dict[tuple, object] = {}
        self._lock = threading.Lock()  # guards the counters and the per-shape locks
        self._shape_locks: dict[tuple, threading.Lock] = {}  # one compile per shape; shapes side by side
        self._changed = threading.Condition()
        self.counters = {"loaded": 0, "compiled": 0, "load_failed": 0, "load_seconds": 0.0, "compile_seconds": 0.0}
        self.seconds: dict[tuple, float] = {}  # shape -> what compiling it took (this process)
        self.preloaded: set[tuple] = set()  # shapes loaded before an engine asked (`preload`)
        self.claimed = bool(lowerers)  # an engine made or took it (a preloaded set is not, yet)

    def get(self, shape: tuple):
        return self._compiled.get(shape)

    def has(self, shape: tuple) -> bool:
        return shape in self._compiled

    def ensure(self, shape: tuple, compile: bool = True) -> str:
        """Make `shape`'s executable exist: 'present', 'loaded' (from disk) or 'compiled'.
        Threads may ensure different shapes at once (XLA compiles each on one core); a second
        thread asking for the same shape waits for the first and finds it 'present'. `compile`
        False (`preload`, before the lowerers exist): 'missing' where nothing usable is kept."""
        with self._lock:
            shape_lock = self._shape_locks.setdefault(shape, threading.Lock())
        with shape_lock:
            if shape in self._compiled:
                return "present"
            t0 = time.perf_counter()
            exe = self._load(shape)
            how = "loaded" if exe is not None else "compiled"
            if exe is None:
                if not compile:
                    return "missing"
                exe = self._compile(shape)
                self._save(shape, exe)
            seconds = time.perf_counter() - t0
            with self._lock:
                self.counters[how] += 1
                self.counters["load_seconds" if how == "loaded" else "compile_seconds"] += seconds
                if how == "compiled":
                    self.seconds[shape] = seconds
                if not compile:
                    self.preloaded.add(shape)
            with self._changed:
                self._compiled[shape] = exe
                self._changed.notify_all()
            return how

    def _compile(self, shape: tuple):
        """`shape`'s executable compiled here, never one JAX read from its persistent cache (which
        would not load again once kept: compile_cache, "programs kept as executables"). Modules
        are named after this set's key, so JAX holds an entry of ours only if our file of it was
        lost; then it compiles again under a name of its own."""
        name, rows, tokens = shape
        hits = compile_cache.cache_hits()
        exe = self.lowerers[name](rows, tokens, self.key).compile()
        if compile_cache.cache_hits() == hits:
            return exe
        log.info("%s was in JAX's compilation cache but not kept here: compiling it again to keep it", shape_name(shape))
        return self.lowerers[name](rows, tokens, f"{self.key}_{secrets.token_hex(4)}").compile()

    def on_disk(self, shape: tuple) -> bool:
        """A kept executable exists for `shape` (it may still turn out unusable)."""
        path = self._path(shape)
        return path is not None and path.is_file()

    def wait_for(self, shape: tuple, timeout: float | None = None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: shape in self._compiled, timeout)

    def _path(self, shape: tuple) -> Path | None:
        return self.directory / f"{shape_name(shape)}.xla" if self.directory else None

    def _load(self, shape: tuple):
        path = self._path(shape)
        if path is None or not path.is_file():
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        from hybridjax import cpu_kernels

        cpu_kernels.available()  # registers the CPU kernel's FFI targets, which the programs may call
        try:
            data = path.read_bytes()
            body = data[len(_MAGIC) + 32:]
            if not data.startswith(_MAGIC) or hashlib.sha256(body).digest() != data[len(_MAGIC):len(_MAGIC) + 32]:
                raise ValueError("bad header or checksum")
            payload, in_tree, out_tree = pickle.loads(body)
            return deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # corrupt, truncated, or from another build: compile it again
            with self._lock:
                self.counters["load_failed"] += 1
            log.warning("compiled program %s is unusable (%s): compiling it again", path, e)
            return None

    def _save(self, shape: tuple, exe) -> None:
        path = self._path(shape)
        if path is None:
            return
        from jax.experimental.serialize_executable import serialize

        try:
            body = pickle.dumps(serialize(exe))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
            tmp.write_bytes(_MAGIC + hashlib.sha256(body).digest() + body)
            os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
        except Exception as e:  # a program that cannot be kept still serves this run
            log.warning("cannot keep compiled program %s: %s", shape_name(shape), e)


def program_set(key: str, lowerers: dict, directory=None) -> ProgramSet:
    """The process's ProgramSet for `key` (engines of one configuration share executables). A set
    preloaded under this key is taken; one preloaded under another key is dropped (its launch's
    settings, weights or code changed: the engine it was loaded for is this one)."""
    with _REGISTRY_LOCK:
        for stale in [k for k, ps in _REGISTRY.items() if not ps.claimed and k != key]:
            del _REGISTRY[stale]
        ps = _REGISTRY.get(key)
        if ps is None or (directory and ps.directory is None):
            ps = _REGISTRY[key] = ProgramSet(key, lowerers, directory)
        elif not ps.claimed and lowerers:
            ps.lowerers, ps.claimed = lowerers, True
        return ps


def _launch_path(directory, launch: str) -> Path:
    return Path(directory) / "launches" / f"{launch}.json"


def note_launch(directory, launch: str, key: str, shapes) -> None:
    """Remember that a launch named `launch` (a digest of its model and settings) made the programs
    `shapes` of `key`, in the order the next such launch's `preload` loads them."""
    path = _launch_path(directory, launch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "shapes": [list(s) for s in shapes]}))
        os.replace(tmp, path)
    except OSError as e:  # the next start loads them after its weights instead: slower, no worse
        log.debug("cannot note the launch's programs: %s", e)


def preload(directory, launch: str) -> threading.Thread | None:
    """Start loading, on a thread, the kept programs of the last launch named `launch` (in the
    order it noted, `Shapes.loading`: those it serves from, then one row's prefill chunks), into the
    process's ProgramSet of their key, while the caller loads the weights: the engine that
    computes the same key finds them present (a warm `hybridjax serve` of the 0.23B model: ready
    in 4.15-4.23 s against 4.43-4.52 s loading them after the weights; what is left is their first
    runs, which need the weights: benchmarks/README.md). Loading stops once an engine exists: one
    of that key claims the set (what is left, it loads itself, ahead or behind at low priority),
    one of another drops it. A missing or unusable file is left for the engine to compile."""
    try:
        noted = json.loads(_launch_path(directory, launch).read_text())
        key, shapes = str(noted["key"]), [tuple(s) for s in noted["shapes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # never launched so (or a note from another version): nothing to load ahead
    ps = program_set(key, {}, directory)  # no lowerers: unclaimed until an engine of this key asks

    def run():
        for shape in shapes:
            with _REGISTRY_LOCK:  # an engine took the set over (its requests come first now), or
                wanted = not ps.claimed and _REGISTRY.get(key) is ps  # dropped it (its key is another)
            if not wanted:
                break
            ps.ensure(shape, compile=False)

    thread = threading.Thread(target=run, name="hybridjax-preload", daemon=True)
    thread.start()
    return thread


def clear_registry() -> None:
    """Forget every ProgramSet of this process (tests: like `jax.clear_caches`)."""
    with _REGISTRY_LOCK:
        _REGISTRY.clear()


# --- start-up: programs side by side, the costliest first -----------------------------------

# What each step costs to compile, relative to the others (XLA:CPU seconds, lowering included,
# the 0.23B model, two runs: the 16-token scoring piece 6-7.5, prefill 1x16 ~6, decode 4x1 ~5.5,
# a draw ~3, a row's set-up ~1, the rest well under 1). Start-up compiles the costliest first, so
# that its threads end together, and estimates the time left from these weights.
COMPILE_COST = {"spec_decode": 8.0, "prefill": 5.0, "decode": 4.0, "score": 4.0, "draw": 2.2,
                "setup_row": 1.5, "setup_row_snapshot": 1.5}


def compile_cost(shape: tuple) -> float:
    return COMPILE_COST.get(shape[0], 0.3)


def compile_threads() -> int:
    """How many programs start-up compiles side by side: XLA:CPU compiles one program on one
    core, so one per core this process may use, at most 4 (the covering set has two costly
    programs and a few small ones). $HYBRIDJAX_COMPILE_THREADS overrides it."""
    given = os.environ.get("HYBRIDJAX_COMPILE_THREADS", "").strip()
    if given:
        return max(1, int(given))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores))


class StartUp:
    """Has `shapes` ensured in `programs` by up to `threads` threads, the costliest first (`run`), and
    says how it goes: counts by outcome, seconds per compiled shape, and the time left."""

    def __init__(self, programs: ProgramSet, shapes, threads: int):
        # A helper thread only for a shape to load or compile beside: one that finds every shape in
        # memory (a warm start: loaded beside the weights) would make its first runs on a scratch
        # engine state of its own (`Engine._first_run_on_scratch`), whose zeros (the KV pool's size)
        # cost more than the runs share (the 0.23B model: ready 0.3-0.6 s after the weights, not 0.6-1.1)
        to_make = sum(not programs.has(s) for s in shapes)
        self.programs, self.threads = programs, max(1, min(threads, to_make))
        self.total = len(shapes)
        self._todo = sorted(shapes, key=compile_cost, reverse=True)  # stable: equal costs keep their order
        self._running: dict[tuple, float] = {}  # shape -> when its thread began it
        self._lock = threading.Lock()
        self.outcomes = {"loaded": 0, "compiled": 0, "present": 0, "preloaded": 0}
        self.seconds: dict[tuple, float] = {}  # compiled shape -> seconds (lowering included)
        self.t0 = time.perf_counter()

    @property
    def done(self) -> int:
        return sum(self.outcomes.values())

    def run(self, cancel: threading.Event, report=None, after=None) -> None:
        """Ensure every shape; `report(shape, how, seconds)` after each, then `after(shape)` (both
        from the thread that did it: the caller's or a helper). Once `cancel` is set no new shape
        starts; returns when the started ones end (a compile under way cannot be interrupted). A
        failed compile is raised here."""
        errors: list[BaseException] = []

        def work():
            while not cancel.is_set() and not errors:
                with self._lock:
                    if not self._todo:
                        return
                    shape = self._todo.pop(0)
                    self._running[shape] = time.perf_counter()
                try:
                    how = self.programs.ensure(shape)
                except BaseException as e:  # noqa: BLE001  (handed to the caller's thread)
                    errors.append(e)
                    return
                if how == "present" and shape in self.programs.preloaded:
                    how = "preloaded"
                with self._lock:
                    seconds = time.perf_counter() - self._running.pop(shape)
                    self.outcomes[how] += 1
                    if how == "compiled":
                        self.seconds[shape] = seconds
                if report is not None:
                    report(shape, how, seconds)
                if after is not None:
                    after(shape)

        helpers = [threading.Thread(target=work, name=f"hybridjax-startup-{i}", daemon=True)
                   for i in range(1, self.threads)]
        for t in helpers:
            t.start()
        work()  # the caller's thread is one of them
        for t in helpers:
            t.join()
        if errors:
            raise errors[0]

    def seconds_left(self) -> float | None:
        """The time left, from the seconds per unit of `compile_cost` the compiles so far took:
        the shapes not begun, plus what the running ones still need, spread over the threads.
        None before the first compile ends."""
        with self._lock:
            if not self.seconds:
                return None
            rate = sum(self.seconds.values()) / sum(compile_cost(s) for s in self.seconds)
            now = time.perf_counter()
            work = sum(compile_cost(s) for s in self._todo) * rate
            work += sum(max(compile_cost(s) * rate - (now - t), 0.0) for s, t in self._running.items())
            return work / self.threads

    def summary(self) -> str:
        """e.g. '8 programs compiled on 2 threads (prefill-1x16 7.1 s, decode-4x1 6.0 s, 6 more 5.2 s)'."""
        top = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        named = [f"{shape_name(s)} {t:.1f} s" for s, t in top[:2]]
        if len(top) > 2:
            named.append(f"{len(top) - 2} more {sum(t for _, t in top[2:]):.1f} s")
        parts = []
        if self.outcomes["compiled"]:
            parts.append(f"{self.outcomes['compiled']} compiled on {self.threads} thread{'s' * (self.threads > 1)} "
                         f"({', '.join(named)})")
        if self.outcomes["loaded"]:
            parts.append(f"{self.outcomes['loaded']} loaded from disk")
        if self.outcomes["preloaded"]:
            parts.append(f"{self.outcomes['preloaded']} loaded from disk beside the weights")
        if self.outcomes["present"]:
            parts.append(f"{self.outcomes['present']} already in memory")
        return f"{self.done} programs: " + ", ".join(parts) if parts else "no programs"


# --- the engine's step lowerers ---------------------------------------------------------------


def engine_lowerers(cfg, params, state, *, slots: int, pages_per_row: int, num_pages: int, implementation,
                    speculative_tokens: int, row_args: tuple) -> dict:
    """name -> (rows, tokens, tag) -> Lowered, for every step the engine loop runs, its module
    named after `tag` (`compile_cache.renamed`). `params`, `state`, `row_args` (what setup_row
    takes after state, row, gdn, logits): abstract (shapes only: lowering never touches the live,
    donated state)."""
    i32 = lambda r: jax.ShapeDtypeStruct((r,), np.int32)  # noqa: E731
    table = lambda r: jax.ShapeDtypeStruct((r, pages_per_row), np.int32)  # noqa: E731
    page = jax.ShapeDtypeStruct((), np.int32)
    snapshot = lambda: jax.eval_shape(steps._read_row, state, page)  # noqa: E731  (traced only to compile)
    named = compile_cache.renamed
    return {
        "decode": lambda r, t, tag: named(steps.decode_model, tag).lower(params, state, i32(r), table(r), cfg,
                                                                        implementation),
        "spec_decode": lambda r, t, tag: named(steps.spec_decode, tag).lower(
            params, state, i32(r), table(r), cfg, speculative_tokens, implementation),
        "draw": lambda r, t, tag: named(steps.draw, tag).lower(steps.draw_part(state), i32(r),
                                                              jax.ShapeDtypeStruct((r,), np.bool_)),
        "prefill": lambda r, t, tag: named(steps.prefill_model, tag).lower(
            params, state, i32(r), jax.ShapeDtypeStruct((r, t), np.int32), i32(r), table(r), cfg, implementation),
        "setup_row": lambda r, t, tag: named(steps.setup_row, tag).lower(state, page, None, None, *row_args),
        "setup_row_snapshot": lambda r, t, tag: named(steps.setup_row, tag).lower(state, page, *snapshot(), *row_args),
        "set_bits": lambda r, t, tag: named(steps.set_bits, tag).lower(
            state, i32(r), jax.ShapeDtypeStruct((r, steps.mask_words(cfg.vocab_size)), np.int32)),
        "read_row": lambda r, t, tag: named(steps.read_row, tag).lower(state, page),
        "copy_page": lambda r, t, tag: named(steps.copy_page, tag).lower(state, page, page),
    }


class CompiledCalls:
    """The engine's calls (`Engine(calls=...)`), each served by its shape's executable in
    `programs`; a shape without one runs the jitted step (compiling: `live_compiles` counts it)."""

    def __init__(self, programs: ProgramSet, eager: Callable[[tuple], bool] = lambda shape: False,
                 draw_buckets: tuple[int, ...] = (1,)):
        self.programs, self.eager = programs, eager
        self.draw_buckets = tuple(sorted(draw_buckets))  # the row counts a draw program is made for
        self.live_compiles = 0  # calls that found no executable (the jitted step compiles once per shape)
        self.ran: set[tuple] = set()  # shapes whose executable has run (on CPU a first run costs 0.1-0.4 s more)
        # With first runs off the engine thread (`Engine`): the shapes whose first run has ended, the
        # only ones the loop may run but those `eager` names. None: any shape whose executable exists.
        self.warm: set[tuple] | None = None
        self._missing: set[tuple] = set()
        self.init_state, self.read_pages, self.write_pages = steps.init_state, steps.read_pages, steps.write_pages

    def has(self, shape: tuple) -> bool:
        """The loop may run `shape`: its executable exists (and, with `warm`, has run once, unless
        `eager(shape)`: one whose first run off the loop takes long, `Engine` says which)."""
        if self.warm is None or self.eager(shape):
            return self.programs.has(shape)
        return shape in self.warm

    def unrun(self, shapes) -> list[tuple]:
        """Those of `shapes` whose executable exists and has never run (`Engine` runs them once on
        padding rows while idle, so no request pays a first run)."""
        return [s for s in shapes if s not in self.ran and self.programs.has(s)]

    def _run(self, shape: tuple, args: tuple, jitted):
        """Run `shape`'s executable on `args`; without one (or for arguments it was not compiled
        for, which it rejects before running anything) the jitted step, which compiles."""
        exe = self.programs.get(shape)
        if exe is not None:
            try:
                out = exe(*args)
                self.ran.add(shape)
                return out
            except TypeError as e:
                log.warning("compiled program %s rejects its arguments (%s)", shape_name(shape), e)
        self.live_compiles += 1
        if shape not in self._missing:  # once per shape (an engine without warm-up meets each once)
            self._missing.add(shape)
            log.info("no compiled program for %s: the jitted step compiles it", shape_name(shape))
        return jitted()

    # A decode step or a prefill chunk is two programs: the model's, then the draw's (`draw`).
    def decode(self, params, state, rows, table, cfg, implementation=None):
        state = self._run(("decode", len(rows), 1), (params, state, rows, table),
                          lambda: steps.decode_model(params, state, rows, table, cfg, implementation))
        drawn, done, lengths, state = self.draw(state, rows, np.ones(len(rows), bool))
        return (drawn, done, lengths), state

    def spec_decode(self, params, state, rows, table, cfg, k, implementation=None):
        return self._run(("spec_decode", len(rows), k + 1), (params, state, rows, table),
                         lambda: steps.spec_decode(params, state, rows, table, cfg, k, implementation))

    def prefill_chunk(self, params, state, rows, tokens, counts, table, last, cfg, implementation=None):
        """As `steps.prefill_chunk`; a chunk that ends no prompt draws nothing (Drawn None)."""
        reads, state = self._run(("prefill",) + tokens.shape, (params, state, rows, tokens, counts, table),
                                 lambda: steps.prefill_model(params, state, rows, tokens, counts, table, cfg,
                                                             implementation))
        ends = np.asarray(last) & (np.asarray(counts) > 0)
        drawn = None
        if ends.any():
            drawn, _, _, state = self.draw(state, rows, ends)
        return drawn, reads, state

    def sample_first(self, state, rows):
        drawn, done, _, state = self.draw(state, rows, np.ones(len(rows), bool))
        return drawn, done, state

    def draw(self, state, rows, mask, exact: bool = False):
        """`steps.draw` on the smallest draw program that may run (`has`) and holds len(rows)
        rows, padded with rows that do not exist (the device skips them; the outputs keep their
        rows). `exact`: the program of len(rows) rows itself (its first run)."""
        r = len(rows)
        fits = [b for b in self.draw_buckets if b >= r and self.has(("draw", b, 0))]
        b = r if exact or not fits else fits[0]
        if b > r:
            rows = np.concatenate([np.asarray(rows, np.int32), np.full((b - r,), state.slots, np.int32)])
            mask = np.concatenate([np.asarray(mask, bool), np.zeros((b - r,), bool)])
        part = steps.draw_part(state)
        drawn, done, lengths, part = self._run(("draw", b, 0), (part, rows, mask), lambda: steps.draw(part, rows, mask))
        return drawn, done, lengths, steps.with_draw_part(state, part)

    def setup_row(self, state, row, gdn, logits, *rest):
        name = "setup_row" if gdn is None else "setup_row_snapshot"
        return self._run((name, 1, 0), (state, np.int32(row), gdn, logits, *rest),
                         lambda: steps.setup_row(state, row, gdn, logits, *rest))

    def set_bits(self, state, rows, bits):
        return self._run(("set_bits", len(rows), 0), (state, rows, bits), lambda: steps.set_bits(state, rows, bits))

    def read_row(self, state, row):
        return self._run(("read_row", 1, 0), (state, np.int32(row)), lambda: steps.read_row(state, row))

    def copy_page(self, state, src, dst):
        return self._run(("copy_page", 1, 0), (state, np.int32(src), np.int32(dst)),
                         lambda: steps.copy_page(state, src, dst))
