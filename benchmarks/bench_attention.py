"""Full attention over the KV buffer: `hybridjax.ops.attention` vs the cache-layout einsums.

    python benchmarks/bench_attention.py [--repeats 7]

One attention layer of bench_generate's model (Hq = 8, Hkv = 2, Dh = 128, batch 1, float32)
for three cases: one decode token over 8192 cached positions, a 64-token suffix prefill over
8192 (the next turn of a long chat), and a cold 2048-token prefill. The baseline contracts
directly in the cache layout [B, S, Hkv, Dh] (what ops.attention did before); ops.attention
moves heads first so both products are plain batched matmuls. Both are jitted and warmed up,
then alternate for `--repeats` rounds; best times, their ratio and the max difference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridjax.ops import attention  # noqa: E402

HQ, HKV, DH = 8, 2, 128
CASES = ((1, 8192), (64, 8192), (2048, 2048))  # (new tokens T, buffer length S)


def attention_cache_layout(q, k, v, q_pos, scale):
    """The baseline: scores contracted in the cache layout, [B, Hkv, G, T, S]."""
    b, t, hq, dh = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, dh)
    scores = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(k.shape[1])[None, None, :] <= q_pos[:, :, None]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgts,bshd->bthgd", probs, v, preferred_element_type=jnp.float32).astype(v.dtype)
    return out.reshape(b, t, hq, dh)


def best_of(fns, args, repeats):
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[i].append(time.perf_counter() - start)
    return [min(t) for t in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    scale = DH**-0.5
    ours = jax.jit(lambda q, k, v, p: attention(q, k, v, p, scale))
    base = jax.jit(lambda q, k, v, p: attention_cache_layout(q, k, v, p, scale))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; Hq={HQ} Hkv={HKV} Dh={DH}, float32, best of {a.repeats}")
    print("| new tokens | cached positions | ops.attention ms | cache layout ms | ratio | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|")
    for t, s in CASES:
        q = jnp.asarray(rng.standard_normal((1, t, HQ, DH)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((1, s, HKV, DH)), jnp.float32) for _ in range(2))
        pos = jnp.asarray(s - t + np.arange(t), jnp.int32)[None]
        args = (q, k, v, pos)
        diff = float(jnp.max(jnp.abs(ours(*args) - base(*args))))  # also the warm-up
        t_ours, t_base = best_of((ours, base), args, a.repeats)
        print(f"| {t} | {s} | {t_ours * 1e3:.1f} | {t_base * 1e3:.1f} | {t_base / t_ours:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
