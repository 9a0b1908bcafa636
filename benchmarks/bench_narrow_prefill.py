"""Narrow prefill chunks on CPU: the streaming kernel against XLA's matmuls for the same calls.

    python benchmarks/bench_narrow_prefill.py [--model-dir DIR] [--dtypes float32,bfloat16]
        [--tokens 8,16,32,64] [--rounds 4] [--repeats 5] [--pack] [--matmuls]

`hybridjax.ops.dense` sends x @ w to the CPU kernel up to `cpu_kernels.max_rows(w.dtype)` rows
(float32 16, bfloat16 32; decode's 8 before), XLA's matmul above. One-row prefill chunks of 16
or 32 tokens (the engine's narrowest, what a short prompt or a chat turn runs) have that many
rows. Here, in one process, for each dtype: `hybridjax.generate.prefill` of T tokens (batch 1,
a fresh cache) compiled with the limits as shipped (`kernel`) and with the kernel kept to
decode's rows (`xla`: `MAX_ROWS` and `MAX_ROWS_BF16` set to `DECODE_ROWS`); every program
compiled and run once first, then rounds in which the two take turns going first; per round
the median of --repeats calls; printed: medians over rounds and the per-round ratio xla /
kernel (> 1: the kernel is faster). T = 8 runs the same program both ways (8 rows: the kernel
either way): its ratios show the machine's noise.

--pack: bfloat16 also with `cpu_kernels.pack_params` (the panels decode streams; where prefill
widens, its copy is float32). --matmuls: first the matmuls alone, [R, K] @ [K, N] for the
0.23B model's shapes and its tied head, kernel against XLA's dot (bfloat16 weights widened in
the call, as `dense` does where the CPU has no bf16 dot instruction).

The model is bench_generate.py's random Qwen3.5 (hidden 1024, 12 layers, vocab 32000, 228 M
params), built once into --model-dir if absent. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import hybridjax  # noqa: E402
from hybridjax import cpu_kernels  # noqa: E402
from hybridjax.cache import init_cache  # noqa: E402
from hybridjax import generate  # noqa: E402

import bench_generate  # noqa: E402
from bench_cpu_decode import kernel_path, loadavg, median_time  # noqa: E402

SHIPPED = (cpu_kernels.MAX_ROWS, cpu_kernels.MAX_ROWS_BF16)


def set_limits(kernel: bool) -> None:
    """The shipped limits, or the kernel kept to decode's rows; the next trace sees them."""
    cpu_kernels.MAX_ROWS, cpu_kernels.MAX_ROWS_BF16 = SHIPPED if kernel else (cpu_kernels.DECODE_ROWS,) * 2
    jax.clear_caches()


def median_ms(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile, first run
    return float(np.median(median_time(lambda: jax.block_until_ready(fn()), repeats))) * 1e3


def matmul_table(repeats: int) -> None:
    rng = np.random.default_rng(0)
    xla = jax.jit(lambda x, w: jnp.dot(x, w.astype(jnp.float32), preferred_element_type=jnp.float32))
    xla_t = jax.jit(lambda x, w: jnp.dot(x, w.astype(jnp.float32).T, preferred_element_type=jnp.float32))
    ker = jax.jit(lambda x, w: cpu_kernels.matmul(x, w))
    ker_t = jax.jit(lambda x, w: cpu_kernels.matmul(x, w, transposed=True))
    shapes = ((1024, 3072), (3072, 1024), (1024, 32000), (32000, 1024))  # the last: a tied head, [N, K]
    print(f"\nmatmuls, xla / kernel ms (load {loadavg()})")
    print("| dtype | rows | " + " | ".join(f"{s[0]}x{s[1]}" + (" tied" if s[0] > s[1] * 8 else "") for s in shapes) + " |")
    print("|---|---:|" + "---:|" * len(shapes))
    for dtype in (jnp.float32, jnp.bfloat16):
        ws = [jnp.asarray(rng.standard_normal(s, np.float32)).astype(dtype) for s in shapes]
        for rows in (8, 16, 32, 64):
            cells = []
            for s, w in zip(shapes, ws):
                tied = s[0] > s[1] * 8
                x = jnp.asarray(rng.standard_normal((rows, s[1] if tied else s[0]), np.float32))
                a = median_ms(lambda: (xla_t if tied else xla)(x, w), repeats)
                b = median_ms(lambda: (ker_t if tied else ker)(x, w), repeats)
                cells.append(f"{a:.1f} / {b:.1f} ({a / b:.2f}x)")
            print(f"| {jnp.dtype(dtype).name} | {rows} | " + " | ".join(cells) + " |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=None)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", default="8,16,32,64")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pack", action="store_true")
    p.add_argument("--matmuls", action="store_true")
    a = p.parse_args(argv)
    if not cpu_kernels.available():
        print(f"error: {cpu_kernels.load_error()}", file=sys.stderr)
        return 1
    print(f"kernel path {kernel_path(cpu_kernels)}; load {loadavg()}")
    if a.matmuls:
        matmul_table(a.repeats)
    tmp = tempfile.TemporaryDirectory()
    model_dir = Path(a.model_dir or tmp.name)
    if not (model_dir / "config.json").is_file():
        model_dir.mkdir(parents=True, exist_ok=True)
        print(f"building the model in {model_dir} ...", file=sys.stderr, flush=True)
        bench_generate.build_model(model_dir)
    tokens = [int(t) for t in a.tokens.split(",")]
    variants = []
    for dtype in a.dtypes.split(","):
        cfg, params = hybridjax.load_hf(model_dir, dtype=dtype)
        variants.append((dtype, cfg, jax.block_until_ready(params)))
        if a.pack and dtype == "bfloat16":
            variants.append(("bfloat16 packed", cfg, jax.block_until_ready(cpu_kernels.pack_params(params, force=True))))
    rng = np.random.default_rng(0)
    calls = {}  # (weights, T, kernel) -> a compiled prefill and its arguments
    for kernel in (True, False):  # every program compiled first, under its limits
        set_limits(kernel)
        for name, cfg, params in variants:
            for t in tokens:
                toks, counts, cache = generate._prepare_prefill(rng.integers(16, 4000, (1, t)), None,
                                                                init_cache(cfg, 1, 512))
                args = (params, toks, counts, cache)
                calls[(name, t, kernel)] = (generate._prefill_jit.lower(*args, cfg).compile(), args)
    set_limits(True)
    for fn, args in calls.values():  # first runs (pages touched, threads woken), not timed
        jax.block_until_ready(fn(*args))
    times: dict = {}
    for r in range(a.rounds):
        for kernel in ((True, False) if r % 2 == 0 else (False, True)):  # order alternates
            for name, _, _ in variants:
                for t in tokens:
                    fn, args = calls[(name, t, kernel)]
                    times.setdefault((name, t, kernel), []).append(median_ms(lambda: fn(*args), a.repeats))
    set_limits(True)
    print(f"\nprefill of T tokens, batch 1, ms: medians of {a.rounds} rounds (load {loadavg()})")
    print("| weights | T | kernel | xla | xla / kernel, per round |")
    print("|---|---:|---:|---:|---|")
    for name, _, _ in variants:
        for t in tokens:
            k, x = times[(name, t, True)], times[(name, t, False)]
            ratios = ", ".join(f"{b / c:.2f}" for b, c in zip(x, k))
            print(f"| {name} | {t} | {np.median(k):.0f} | {np.median(x):.0f} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
