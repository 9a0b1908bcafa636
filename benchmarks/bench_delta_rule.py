"""Gated delta rule: reference vs chunked XLA on CPU; Pallas vs XLA on a GPU; sm_90 compile table.

    python benchmarks/bench_delta_rule.py [--quick] [--lengths 512,2048,8192] [--repeats 3]
                                          [--max-temp-gb 6] [--json OUT]
                                          [--compile-table] [--archs 90,89] [--fla-src DIR]
                                          [--skip-timing]

One Qwen3.5-like Gated DeltaNet layer: batch 1, Hk = 16 key heads, Hv = 32 value heads,
K = V = 128, float32 inputs on CPU (bfloat16 on GPU), unit keys, model-like gates. For each T:

  fwd      (o, final_state) = chunk_gated_delta_rule(..., implementation=X)
  fwd+bwd  jax.grad of <o, w_o> + <state, w_s> w.r.t. q, k, v, g, beta and the initial state:
           "reference" differentiates the token scan (it stores every token's [K, V] state per
           head); "xla" uses the custom VJP (inputs are the only residuals, chunk states are
           recomputed); "xla-autodiff" differentiates xla.py's chunked form directly.

Every function is jitted and warmed up once (compile time reported separately), then the
implementations alternate round by round for `--repeats` rounds, so load drift on a shared
machine hits them alike; the best run is reported (the least disturbed one) with the median.
`temp GB` is XLA's temp-buffer size for the compiled program (`memory_analysis()`); a
program whose temp exceeds `--max-temp-gb` is compiled but not run.

FLOPs are counted per algorithm (multiply-add = 2), per token and value head:
  reference  7 K V                       (decay, S^T k, k u^T, S^T q)
  chunked    C (8 K + 4 V) + 2 C^2 + 6 K V (chunk C: k k^T, q k^T, the inverse applied to
                                          [V | K], P wv, P wk, the row-by-row inverse, and
                                          three [C, K] x [K, V] state products; xla forms
                                          k k^T and q k^T per key head: 4 K / r for 4 K)
and fwd+bwd is counted as 3x fwd. ratio = the baseline's best time / this row's ("-" when
the baseline was skipped). On a GPU (`jax.devices("gpu")` non-empty) a second table compares
"pallas" against the baseline "xla" (bfloat16 inputs); without one it prints a skip line.

--compile-table (needs the `triton` package; no GPU): the public entry point with
implementation="pallas" (default "fast" policy, fused L2 norm, bf16 q/k/v) is lowered for CUDA
at the layer above, T = max(--lengths) (prefill kernels, and the gradient's two backward state
passes) and T = 1 (decode kernel), each Triton kernel is
compiled offline for every --archs target with that generation's block sizes, and a table gives
per kernel: wgmma / mma (tensor-core) and scalar FMA instruction counts in the PTX, registers,
stack bytes, SASS local loads/stores (spills), shared memory against the target's limit
(pallas_kernels/triton_offline.py). With --fla-src pointing at a checkout of
flash-linear-attention, the same table is printed for fla's forward kernels
(benchmarks/fla_compile.py; fla is read from that directory, never vendored).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # fla_compile

from hybridjax.pallas_kernels.compat import lower_for_cuda  # noqa: E402
from hybridjax.pallas_kernels.gated_delta_rule import (  # noqa: E402
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_xla,
)
from hybridjax.pallas_kernels.gated_delta_rule.api import XLA_CHUNK_SIZE  # noqa: E402
from hybridjax.pallas_kernels.gated_delta_rule.chunk import CHUNK_SIZE as PALLAS_CHUNK_SIZE  # noqa: E402

LAYER = dict(B=1, Hk=16, Hv=32, K=128, V=128)
FULL = dict(lengths=(512, 2048, 8192), repeats=3)
QUICK = dict(lengths=(512, 2048), repeats=2)


def make_inputs(T, dtype, seed=0):
    """Random layer inputs (q, k, v, g, beta, s0) and loss weights (w_o, w_s)."""
    B, Hk, Hv, K, V = (LAYER[n] for n in ("B", "Hk", "Hv", "K", "V"))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, K), np.float32)
    k = rng.standard_normal((B, T, Hk, K), np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, V), np.float32)
    g = -np.exp(rng.uniform(-2, 1, (Hv,))) * np.logaddexp(0, rng.standard_normal((B, T, Hv)) - 1)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, Hv))))
    s0 = rng.standard_normal((B, Hv, K, V), np.float32) * 0.1
    w_o = rng.standard_normal((B, T, Hv, V), np.float32)
    w_s = rng.standard_normal((B, Hv, K, V), np.float32)
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    args += [jnp.asarray(x, jnp.float32) for x in (g, beta, s0)]
    return tuple(args), (jnp.asarray(w_o), jnp.asarray(w_s))


def flops(impl, T):
    """Forward FLOPs of one layer under the algorithm `impl` runs (see module docstring)."""
    K, V, Hv, B = LAYER["K"], LAYER["V"], LAYER["Hv"], LAYER["B"]
    c = PALLAS_CHUNK_SIZE if impl == "pallas" else XLA_CHUNK_SIZE
    if impl == "reference":
        per_token = 7 * K * V
    else:  # xla forms k k^T and q k^T once per key head, shared by r = Hv / Hk value heads
        qk_kk = 4 * K / (LAYER["Hv"] // LAYER["Hk"]) if impl.startswith("xla") else 4 * K
        per_token = c * (qk_kk + 4 * K + 4 * V) + 2 * c**2 + 6 * K * V
    return B * T * Hv * per_token


def _forward_fn(impl):
    if impl == "xla-autodiff":
        return lambda q, k, v, g, b, s: chunk_gated_delta_rule_xla(
            q, k, v, g, b, scale=LAYER["K"] ** -0.5, initial_state=s, chunk_size=XLA_CHUNK_SIZE
        )
    return lambda q, k, v, g, b, s: chunk_gated_delta_rule(
        q, k, v, g, b, initial_state=s, implementation=impl
    )


def build(impl, mode):
    """A jitted (args, weights) -> outputs for impl in {reference, xla, xla-autodiff, pallas}."""
    fwd = _forward_fn(impl)
    if mode == "fwd":
        return jax.jit(lambda args, w: fwd(*args))

    def loss(args, w):
        o, s = fwd(*args)
        return jnp.sum(o.astype(jnp.float32) * w[0]) + jnp.sum(s * w[1])

    return jax.jit(jax.grad(loss))


def compile_one(impl, mode, args, w, max_temp_gb):
    """dict(impl, mode, compile_s, temp_gb, fn) with fn=None (and `skipped`) if over budget."""
    t0 = time.perf_counter()
    compiled = build(impl, mode).lower(args, w).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp_gb = (mem.temp_size_in_bytes if mem is not None else 0) / 2**30
    row = dict(impl=impl, mode=mode, compile_s=compile_s, temp_gb=temp_gb, fn=compiled)
    if temp_gb > max_temp_gb:
        row.update(fn=None, skipped=f"temp {temp_gb:.1f} GB > --max-temp-gb")
    return row


def measure(rows, args, w, repeats):
    """Time every runnable row, alternating implementations round by round so that load drift
    on a shared machine hits them alike; sets best_ms and median_ms."""
    live = [r for r in rows if r["fn"] is not None]
    for r in live:
        jax.block_until_ready(r["fn"](args, w))  # warm-up run
        r["times"] = []
    for _ in range(repeats):
        for r in live:
            t0 = time.perf_counter()
            jax.block_until_ready(r["fn"](args, w))
            r["times"].append(time.perf_counter() - t0)
    for r in live:
        r["best_ms"] = 1e3 * min(r["times"])
        r["median_ms"] = 1e3 * statistics.median(r["times"])


def run_table(impls, baseline, lengths, dtype, repeats, max_temp_gb):
    rows = []
    header = (f"{'T':>5} {'mode':<8} {'impl':<13} {'best ms':>9} {'median ms':>10} "
              f"{'GFLOP':>7} {'GFLOP/s':>8} {'temp GB':>8} {'compile s':>9} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    for T in lengths:
        args, w = make_inputs(T, dtype, seed=T)
        for mode in ("fwd", "fwd+bwd"):
            # "xla-autodiff" has the same forward as "xla".
            impls_here = [i for i in impls if not (mode == "fwd" and i == "xla-autodiff")]
            mode_rows = [
                dict(T=T, **compile_one(i, mode, args, w, max_temp_gb)) for i in impls_here
            ]
            measure(mode_rows, args, w, repeats)
            base = next((r for r in mode_rows if r["impl"] == baseline and "best_ms" in r), None)
            for row in mode_rows:
                gflop = flops(row["impl"], T) * (3 if mode == "fwd+bwd" else 1) / 1e9
                row["gflop"] = gflop
                if "best_ms" in row:
                    row["gflops"] = gflop / (row["best_ms"] / 1e3)
                    row["ratio"] = base["best_ms"] / row["best_ms"] if base else None
                    ratio = f"{row['ratio']:6.1f}" if row["ratio"] else f"{'-':>6}"
                    print(f"{T:>5} {mode:<8} {row['impl']:<13} {row['best_ms']:9.1f} "
                          f"{row['median_ms']:10.1f} {gflop:7.1f} {row['gflops']:8.1f} "
                          f"{row['temp_gb']:8.2f} {row['compile_s']:9.1f} {ratio}")
                else:
                    print(f"{T:>5} {mode:<8} {row['impl']:<13} {'skipped':>9} {'':>10} "
                          f"{gflop:7.1f} {'':>8} {row['temp_gb']:8.2f} {row['compile_s']:9.1f}"
                          f"   ({row['skipped']})")
                sys.stdout.flush()
                row.pop("fn")
                row.pop("times", None)
                rows.append(row)
        del args, w
    return rows


def lower_layer(T, dtype=jnp.bfloat16, precision="fast", grad=False):
    """The public "pallas" entry point at LAYER (or its gradient), lowered for CUDA (works on a
    CPU-only host)."""
    B, Hk, Hv, K, V = (LAYER[n] for n in ("B", "Hk", "Hv", "K", "V"))
    sds = jax.ShapeDtypeStruct
    args = (sds((B, T, Hk, K), dtype), sds((B, T, Hk, K), dtype), sds((B, T, Hv, V), dtype),
            sds((B, T, Hv), jnp.float32), sds((B, T, Hv), jnp.float32),
            sds((B, Hv, K, V), jnp.float32))

    def f(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, implementation="pallas",
                                      use_qk_l2norm_in_kernel=True, precision=precision)

    def loss(*a):
        o, s = f(*a)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    fn = jax.grad(loss, argnums=tuple(range(6))) if grad else f
    return lower_for_cuda(fn, *args)


def compile_table(archs, prefill_T=8192, fla_src=None):
    """Print (and return) the offline compile table of our kernels, and fla's if fla_src."""
    from hybridjax.pallas_kernels import triton_offline
    from hybridjax.pallas_kernels.gated_delta_rule.common import compile_target

    rows = []
    for arch in archs:
        with compile_target(arch):
            kernels = [*triton_offline.triton_kernels(lower_layer(prefill_T)),
                       *triton_offline.triton_kernels(lower_layer(1))]
            kernels += [k for k in triton_offline.triton_kernels(lower_layer(prefill_T, grad=True))
                        if k.name.startswith("gdr_bwd")]
            rows += [triton_offline.compile_kernel(k, arch) for k in kernels]
    print(f"Pallas kernels compiled offline (layer {LAYER}, bf16, T = {prefill_T}, decode T = 1, "
          "backward = the gradient's state passes, precision 'fast'):")
    print(triton_offline.format_table(rows))
    result = {"ours": [dataclasses.asdict(r) for r in rows]}
    if fla_src:
        from fla_compile import fla_reports

        fla_rows = [r for arch in archs for r in fla_reports(fla_src, arch, T=prefill_T, **LAYER)]
        print(f"\nfla forward kernels from {fla_src}, compiled the same way:")
        print(triton_offline.format_table(fla_rows))
        result["fla"] = [dataclasses.asdict(r) for r in fla_rows]
    sys.stdout.flush()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="T = 512, 2048 and 2 repeats")
    p.add_argument("--lengths", type=str, default=None, help="comma-separated T values")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--max-temp-gb", type=float, default=6.0,
                   help="compile but do not run programs needing more XLA temp memory")
    p.add_argument("--json", type=Path, default=None, help="write all rows here")
    p.add_argument("--compile-table", action="store_true",
                   help="compile the Pallas kernels offline for --archs (needs `triton`)")
    p.add_argument("--archs", type=str, default="90,89", help="compute capabilities, e.g. 90,89")
    p.add_argument("--fla-src", type=Path, default=None,
                   help="a flash-linear-attention checkout: add its kernels to the compile table")
    p.add_argument("--skip-timing", action="store_true", help="only the compile table")
    a = p.parse_args(argv)
    preset = QUICK if a.quick else FULL
    lengths = tuple(int(x) for x in a.lengths.split(",")) if a.lengths else preset["lengths"]
    repeats = a.repeats or preset["repeats"]

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    print(f"layer {LAYER}, chunk: xla {XLA_CHUNK_SIZE}, pallas {PALLAS_CHUNK_SIZE}; "
          f"repeats {repeats}\n")
    result = {}
    if a.compile_table:
        archs = [int(x) for x in a.archs.split(",")]
        result["compile"] = compile_table(archs, max(lengths), a.fla_src)
        print()
    if a.skip_timing:
        if a.json:
            a.json.write_text(json.dumps(result, indent=1))
        return 0
    print("CPU: token-by-token reference vs chunked XLA (float32 inputs)")
    with jax.default_device(jax.devices("cpu")[0]):
        result["cpu"] = run_table(("reference", "xla", "xla-autodiff"), "reference", lengths,
                                  jnp.float32, repeats, a.max_temp_gb)

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    print()
    if gpus:
        print(f"GPU {gpus[0]}: Pallas (Triton) vs XLA (bfloat16 inputs)")
        with jax.default_device(gpus[0]):
            result["gpu"] = run_table(("xla", "pallas"), "xla", lengths, jnp.bfloat16, repeats,
                                      a.max_temp_gb)
    else:
        print("GPU: no GPU device found; skipping the Pallas timings (T = 2048 and 8192 need a GPU).")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
