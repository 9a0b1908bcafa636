"""Would fusing the projections that read one input into one packed call pay? Same bytes, two
ways: G separate `matmul_packed` calls per layer, or one call over their concatenation.

    python benchmarks/bench_fused_calls.py [--rounds 40]

For the bench_generate model's shapes (K = 1024, bfloat16, one row): GDN's in_qkv / in_z / in_b /
in_a (N = 2048, 1024, 16, 16), attention's q / k / v (2048, 256, 256), the MLP's gate / up (3072,
3072). Each is chained over 12 layers inside one jit (each layer's input depends on the last
layer's output, as in a decode step); the two ways alternate round by round; medians. Prints
the time saved per call removed, and the GB/s each way streams.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

GROUPS = {"gdn in_qkv/z/b/a": [2048, 1024, 16, 16], "attention q/k/v": [2048, 256, 256], "mlp gate/up": [3072, 3072]}
K, LAYERS = 1024, 12


def chained(call):
    import jax

    @jax.jit
    def run(x, weights):
        for layer in weights:  # the next layer's input depends on this layer's outputs
            x = x + 1e-3 * sum(y[:, :1].sum() for y in call(x, layer))
        return x

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from hybridjax import cpu_kernels as ck

    if not ck.available():
        print(f"error: {ck.load_error()}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    x = jnp.ones((1, K), jnp.float32)
    print(f"load average {os.getloadavg()[0]:.2f}; {LAYERS} layers chained, K = {K}, bf16 packed, one row")
    print("| group | calls / layer | separate ms | fused ms | saved per call removed | GB/s separate | GB/s fused |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, ns in GROUPS.items():
        plain = [[jnp.asarray(rng.standard_normal((K, n), np.float32) * 0.02).astype(jnp.bfloat16) for n in ns]
                 for _ in range(LAYERS)]
        separate = [[ck.pack_bf16(w) for w in layer] for layer in plain]
        fused = [[ck.pack_bf16(jnp.concatenate(layer, axis=1))] for layer in plain]
        run_sep = chained(lambda x, layer: [ck.matmul_packed(x, p, n) for p, n in zip(layer, ns)])
        run_fused = chained(lambda x, layer: [ck.matmul_packed(x, layer[0], sum(ns))])
        times = {"sep": [], "fused": []}
        for r in range(a.rounds + 1):  # round 0 compiles
            for key, fn, ws in (("sep", run_sep, separate), ("fused", run_fused, fused)):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, ws))
                if r:
                    times[key].append(time.perf_counter() - t0)
        s, f = statistics.median(times["sep"]), statistics.median(times["fused"])
        gb = sum(K * n * 2 for n in ns) * LAYERS / 1e9
        print(f"| {name} | {len(ns)} | {1e3 * s:.2f} | {1e3 * f:.2f} | {1e6 * (s - f) / LAYERS / (len(ns) - 1):.0f} us | "
              f"{gb / s:.1f} | {gb / f:.1f} |")
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
