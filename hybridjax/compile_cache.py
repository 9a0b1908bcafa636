"""Where compiled programs are kept between runs, for every entry point: `hybridjax serve`,
`hybridjax generate` and the library (`hybridjax.load_model`).

JAX's persistent compilation cache lives in `default_compile_cache_dir()` (~/.cache/hybridjax/jax,
or $XDG_CACHE_HOME/hybridjax/jax; $JAX_COMPILATION_CACHE_DIR or an explicit directory overrides it;
$HYBRIDJAX_COMPILE_CACHE=0 turns it off for the library). The serving engine keeps its whole
executables beside it, in `executables/` (`hybridjax.engine_programs`).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path

_announced = threading.Event()


def default_compile_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybridjax" / "jax"


def use_compile_cache(directory: str | None = None, enabled: bool = True, announce: bool = True) -> Path | None:
    """Keep compiled XLA programs on disk between runs (JAX's persistent compilation cache), so
    a second start skips compilation. Returns the directory (None when off). `announce`: the
    first compile of the process that the cache does not hold says so, once, on stderr."""
    if not enabled:
        return None
    import jax

    if directory is None and jax.config.jax_compilation_cache_dir:
        path = Path(jax.config.jax_compilation_cache_dir)  # already set up (JAX_COMPILATION_CACHE_DIR, or a caller)
    else:
        path = Path(directory) if directory else default_compile_cache_dir()
        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program, even quick ones
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if announce:
        _announce_first_compile(path)
    return path


def library_compile_cache() -> Path | None:
    """The library's default: the same cache as the CLI, unless $HYBRIDJAX_COMPILE_CACHE is 0."""
    return use_compile_cache(None, os.environ.get("HYBRIDJAX_COMPILE_CACHE", "1") != "0")


def executable_dir() -> Path | None:
    """Where the serving engine keeps its executables: `executables/` in the compilation cache
    directory, when that cache is on."""
    import jax

    d = jax.config.jax_compilation_cache_dir
    return Path(d) / "executables" if d else None


_listening = False
_compiled = {"programs": 0, "seconds": 0.0}  # this process's programs the cache did not hold; compile seconds


def compiled_so_far() -> tuple[int, float]:
    """(programs the cache did not hold, seconds of compiling) in this process since the cache
    was turned on with `announce`: what a first run paid and a later one does not (the seconds
    also count reading the programs the cache held, a small part)."""
    return _compiled["programs"], _compiled["seconds"] if _compiled["programs"] else 0.0


def _announce_first_compile(path: Path) -> None:
    global _listening
    if _listening:
        return
    import jax

    def on_event(event: str, **kw) -> None:
        if event == "/jax/compilation_cache/cache_misses":
            _compiled["programs"] += 1
        if event == "/jax/compilation_cache/cache_misses" and not _announced.is_set():
            _announced.set()
            print(f"hybridjax: compiling the model's programs (a first run takes a while; later runs reuse "
                  f"them from {path})", file=sys.stderr, flush=True)

    def on_duration(event: str, seconds: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            _compiled["seconds"] += seconds

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    _listening = True


# --- programs kept as executables (hybridjax.engine_programs) ----------------------------------
#
# An executable JAX read from its persistent cache does not survive being serialized again: loaded
# in another process, it fails at its first run ("Function wrapped_broadcast.1 not found"; XLA:CPU,
# jax 0.10.2 and 0.11.2). So a program the engine keeps must be compiled, not read: its module is
# named after the engine's key (`renamed`), which keeps JAX's entries of one key apart from every
# other's, and a compile that still hits (the engine's file was lost after JAX wrote its entry)
# is done again under a name no entry has (`engine_programs.ProgramSet`).


def jit(fn=None, **options):
    """`jax.jit(fn, **options)` that remembers fn and its options, so `renamed` can jit it again
    under another name. A decorator too: `@compile_cache.jit(static_argnames=...)`."""
    import jax

    if fn is None:
        return functools.partial(jit, **options)
    jitted = jax.jit(fn, **options)
    jitted.jit_options = options
    return jitted


def renamed(jitted, tag: str):
    """`jitted` (made by `jit`) jitted again as `<function>_<tag>`: the same program in a module of
    that name, so its key in JAX's persistent cache is the tag's own."""
    import jax

    fn = jitted.__wrapped__

    @functools.wraps(fn)  # the signature too: static and donated arguments by name
    def program(*args, **kwargs):
        return fn(*args, **kwargs)

    program.__name__ = program.__qualname__ = f"{fn.__name__}_{tag}"
    return jax.jit(program, **jitted.jit_options)


_hits = threading.local()  # JAX's persistent-cache hits of compiles on this thread
_counting, _counting_lock = False, threading.Lock()  # the listener counting them is registered once


def _count_hit(event: str, **kw) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hits.n = getattr(_hits, "n", 0) + 1


def cache_hits() -> int:
    """JAX persistent-cache hits of this thread's compiles so far (JAX reports them in the thread
    that compiles)."""
    global _counting
    if not _counting:
        import jax

        with _counting_lock:
            if not _counting:
                jax.monitoring.register_event_listener(_count_hit)
                _counting = True
    return getattr(_hits, "n", 0)
