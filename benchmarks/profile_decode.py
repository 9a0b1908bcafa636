"""Where a batch-1 decode step's time goes, from a jax.profiler trace of the jitted step.

    python benchmarks/profile_decode.py [--model-dir DIR] [--dtype float32] [--kernels 0|1]
                                        [--steps 20] [--capacity 256] [--top 15] [--engine]

Loads the model of bench_generate.py (built into --model-dir if absent), prefills 128 tokens,
then traces `--steps` one-token steps of hybridjax.generate's decode step (donating, as the
engine and `stream` run it) and adds up, per HLO op of the compiled step, the time the XLA
threads spent in it. With --engine, the step is the engine's instead (`Engine` as `hybridjax
serve` builds it: default ServerConfig, max_len --capacity, one request streaming `--steps`
tokens once every program is compiled; a word tokenizer is written beside the model if it has
none), and the wall time per token includes the engine loop's host work. Ops are grouped:

  projections <name>   the matmuls of one kind of weight (XLA dot or the CPU kernel's call)
  GDN state            the delta-rule step (ops inside its scan: read, decay, update, write)
  attention            scores and values over the KV cache (the dots on the cache, their
                       transposes and reshapes)
  copies               copy ops (cache leaves XLA could not update in place)
  other fusions        norms, gates, conv, RoPE, residuals, casts
  outside ops          wall time of the step minus the ops' time (dispatch, thunk scheduling,
                       waiting threads)

The sampler is not in the step: its time (greedy, one row) is measured on its own. Under load
the op times stretch (a descheduled thread still counts): compare shares, not milliseconds.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def categorize(kind: str, line: str) -> str:
    weight = re.search(r"%params_(?:layers_\d+__)?(\w+?)(?:\.\d+)?[,)]", line)
    if kind in ("dot", "custom-call") and weight:
        return "projections " + weight.group(1).replace("mixer_", "").replace("ffn_", "mlp ")
    meta = re.search(r'op_name="([^"]*)"', line)
    name = meta.group(1) if meta else ""
    if "while" in name:
        return "GDN state (delta rule step)"
    if kind == "copy" or name.endswith("copy"):
        return "copies"
    if kind == "dot" or "ynn_fusion" in line or re.search(r"f32\[\d+,\d+,\d+,128\]", line) and "transpose" in name:
        return "attention over the cache"
    return "other fusions"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/bench_cpu_decode_model")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--kernels", default="1", choices=("0", "1"), help="HYBRIDJAX_CPU_KERNELS")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--capacity", type=int, default=256, help="KV cache capacity (tokens)")
    ap.add_argument("--top", type=int, default=15, help="print the slowest ops too")
    ap.add_argument("--engine", action="store_true", help="the engine's decode step (max_len --capacity)")
    ap.add_argument("--pack-for-decode", action="store_true",
                    help="the weights in cpu_kernels.pack_params' layouts (as `--pack-for-decode`)")
    a = ap.parse_args(argv)
    os.environ["HYBRIDJAX_CPU_KERNELS"] = a.kernels

    import jax
    import jax.numpy as jnp

    import bench_generate
    import hybridjax
    from hybridjax import generate as hg
    from hybridjax.cache import init_cache

    model_dir = Path(a.model_dir)
    if not (model_dir / "config.json").is_file():
        model_dir.mkdir(parents=True, exist_ok=True)
        bench_generate.build_model(model_dir)
    cfg, params = hybridjax.load_hf(model_dir, dtype=a.dtype, pack_for_decode=a.pack_for_decode)
    if a.engine:
        return profile_engine(a, model_dir, cfg, params)
    prompt = bench_generate.prompt_tokens(128)[None]
    cache = init_cache(cfg, 1, a.capacity, capacity=a.capacity)
    logits, cache = hg.prefill(params, prompt, cache, cfg)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    active = jnp.ones((1,), bool)
    step = jax.jit(functools.partial(hg._decode, cfg=cfg), donate_argnames="cache")
    for _ in range(3):
        logits, cache = step(params, tok, active, cache)
    jax.block_until_ready(logits)
    ops = hlo_ops(step.lower(params, tok, active, cache).compile().as_text())

    # the sampler on its own (greedy, no penalties): what generate adds per token
    sampler = hg.init_sampler(hg.sampling_params(1), [0], cfg.vocab_size)
    nt = jax.jit(hg.next_token)
    jax.block_until_ready(nt(logits, sampler))
    t0 = time.perf_counter()
    for _ in range(a.steps):
        t, sampler = nt(logits, sampler)
    jax.block_until_ready(t)
    sampler_ms = (time.perf_counter() - t0) / a.steps * 1e3

    def run_steps():
        nonlocal logits, cache
        for _ in range(a.steps):
            logits, cache = step(params, tok, active, cache)
            jax.block_until_ready(logits)

    load0 = os.getloadavg()[0]
    wall, per_op = traced_ops(run_steps, ops, a.steps)
    report(a, "decode step", wall, per_op, ops, load0, sampler_ms)
    return 0


def hlo_ops(compiled_text: str) -> dict:
    """HLO op name -> (kind, line) of a compiled program's text."""
    ops = {}
    for line in compiled_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
        if m:
            ops[m.group(1)] = (m.group(3), line.strip())
    return ops


def traced_ops(run, ops: dict, steps: int) -> tuple[float, collections.Counter]:
    """Wall seconds per step of `run()` (which runs `steps` steps) under jax.profiler, and the ms
    per step the XLA threads spent in each op of `ops`."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        run()
        wall = (time.perf_counter() - t0) / steps
        jax.profiler.stop_trace()
        trace = sorted(glob.glob(d + "/**/*.xplane.pb", recursive=True), key=os.path.getmtime)[-1]
        prof = jax.profiler.ProfileData.from_file(trace)
    per_op = collections.Counter()
    for plane in prof.planes:
        for line in plane.lines:
            if "XLA" in line.name:
                for ev in line.events:
                    if ev.name in ops:
                        per_op[ev.name] += ev.duration_ns / steps / 1e6  # ms per step
    return wall, per_op


def report(a, what: str, wall: float, per_op: collections.Counter, ops: dict, load0: float,
           sampler_ms: float | None) -> None:
    groups = collections.Counter()
    for name, ms in per_op.items():
        groups[categorize(*ops[name])] += ms
    groups["outside ops"] = max(wall * 1e3 - sum(per_op.values()), 0.0)
    total = sum(groups.values())
    print(f"{what}, {a.dtype}, kernels={a.kernels}, capacity {a.capacity}: wall {wall * 1e3:.2f} ms/step "
          f"(ops {sum(per_op.values()):.2f} ms); 1-min load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print("| group | ms/step | share |\n|---|---:|---:|")
    for g, ms in groups.most_common():
        print(f"| {g} | {ms:.2f} | {100 * ms / total:.1f}% |")
    if sampler_ms is not None:
        print(f"\nsampler (greedy, 1 row, its own jit call): {sampler_ms:.3f} ms")
    print(f"\nslowest {a.top} ops:")
    for name, ms in per_op.most_common(a.top):
        print(f"  {ms:7.3f} ms  {ops[name][1][:160]}")


def profile_engine(a, model_dir: Path, cfg, params) -> int:
    """The engine's one-row decode step: traced while one request streams, after its first token
    (so no prefill op shares a name with the step's), once every program exists."""
    import jax
    import numpy as np

    import bench_generate
    import bench_serve_decode
    from hybridjax import engine_steps
    from hybridjax.engine import GenerationRequest
    from hybridjax.server import ServerConfig
    from hybridjax.server.app import build_engine
    from hybridjax.tokenizer import Tokenizer

    if not (model_dir / "tokenizer.json").is_file():
        bench_serve_decode.word_tokenizer(model_dir, cfg.vocab_size)
    engine, _ = build_engine(ServerConfig(max_len=a.capacity), cfg, params, Tokenizer.from_dir(model_dir), "profile")
    engine.start(warmup=True)
    engine.ready.wait()
    while engine.compiling:
        time.sleep(0.5)
    loop = engine.loop
    rows, table = np.zeros((1,), np.int32), np.zeros((1, engine.sched.pages_per_row), np.int32)
    # The engine's own executable may be loaded from disk, without its text: the same step compiled
    # again here gives the same op names (its ops accounted for 46.1 of 46.8 ms per token when run).
    ops = hlo_ops(engine_steps.decode.lower(loop.params, loop.state, rows, table, cfg, loop.implementation)
                  .compile().as_text())
    prompt = bench_generate.prompt_tokens(128).tolist()
    for _ in engine.submit(GenerationRequest(prompt, max_tokens=8)).events():  # a first run of each program
        pass
    events = engine.submit(GenerationRequest(prompt, max_tokens=a.steps + 1)).events()
    next(events)  # the first token: prefill done

    def run_steps():
        for _ in events:
            pass

    load0 = os.getloadavg()[0]
    wall, per_op = traced_ops(run_steps, ops, a.steps)
    engine.stop()
    report(a, "engine decode step (1 row, wall: per token, host work included)", wall, per_op, ops, load0, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
