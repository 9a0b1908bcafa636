"""Shared fixtures: tiny HF checkpoints (built once per session) and jitted forwards.

JAX compile time dominates on 2 cores, so every compiled function is shared: one jitted
`forward` per session, with the config as a static argument.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
from pathlib import Path

# The library turns the persistent compilation cache on (hybridjax.load_model); tests keep it off
# (see _no_persistent_compile_cache).
os.environ["HYBRIDJAX_COMPILE_CACHE"] = "0"

import jax
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import hybridjax  # noqa: E402


def _hf_models():
    """The tiny-checkpoint builders need torch + transformers; without them (the Python 3.12 /
    JAX 0.11 lane, the GPU image's plain checkout) every test that asks for a checkpoint skips."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import hf_models

    return hf_models


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. XLA:CPU maps each compiled kernel's
    code and data into memory separately (about 200 mappings per model forward); one process
    running the whole suite reached the kernel's limit of 65,530 mappings (vm.max_map_count), and
    the next compile crashed (segfault or abort, seen in CI). Clearing frees the mappings; later
    modules recompile what they use."""
    yield
    from hybridjax import engine_programs

    engine_programs.clear_registry()  # the engines' executables (hybridjax.engine_programs)
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _no_persistent_compile_cache():
    """No persistent compilation cache in the test process: with it on, a JAX 0.10 cache write
    segfaulted in CI (an engine thread compiling while test threads ran). In-process CLI calls
    pass --no-compile-cache; this fails the test that forgets to."""
    yield
    if jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", None)  # so that only the offending test fails
        pytest.fail("this test enabled the persistent compilation cache (pass --no-compile-cache)")


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of a tiny HF checkpoint saved by transformers."""
    root = tmp_path_factory.mktemp("hf")
    return {name: build(root / name) for name, build in _hf_models().BUILDERS.items()}


@pytest.fixture(scope="session")
def loaded(hf_dirs):
    """name -> (cfg, params) loaded by hybridjax in float32."""
    return {name: hybridjax.load_hf(d, dtype="float32") for name, d in hf_dirs.items()}


@pytest.fixture(scope="session")
def torch_models(hf_dirs):
    return {name: _hf_models().load_torch(d) for name, d in hf_dirs.items()}


@functools.lru_cache(maxsize=None)
def _jitted_forward():
    return jax.jit(hybridjax.forward, static_argnames=("cfg", "implementation"))


@pytest.fixture(scope="session")
def jforward():
    """`hybridjax.forward` jitted once for the whole session (cfg static)."""
    fwd = _jitted_forward()

    def run(params, tokens, cache, cfg, **kw):
        n = jax.numpy.asarray(tokens).shape[1]
        return fwd(params, tokens, hybridjax.reserve(cache, kw.get("token_counts", n)), cfg, **kw)

    return run
