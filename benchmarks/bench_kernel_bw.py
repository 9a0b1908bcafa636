"""Bytes/s of the CPU kernel's weight stream, float32 against bfloat16 weights, in one process.

    python benchmarks/bench_kernel_bw.py [--shapes 1024x3072,3072x1024,1024x32000] [--rows 1,2,4,8]
                                         [--rounds 15] [--old-so OLD.so] [--threads 0]

Decode reads every weight once per token, so the kernel should stream a bfloat16 weight at
the float32 one's bytes/s (and decode twice as fast). Per shape and row count, modes run
round-robin in one process (each round times every mode once, so load from other jobs hits
them alike): `f32` (float32 weight and x), `bf16` (bfloat16 weight and x, as a bf16 model
decodes), `bf16-xf32` (bfloat16 weight, float32 x: the hi + lo split), `bf16-packed` (the same
bfloat16 weight packed once into panels, `cpu_kernels.pack_bf16` / `matmul_packed`), `int8` (weight-only
int8 with per-column scales, float32 x), `int8-dot` (the weight quantised per column per block of
32 k, float16 scales, packed in quads of K, `cpu_kernels.quantize_int8_blocks` / `pack_int8` /
`matmul_q8`: x rounded to int8 per block, integer dots), `int8-dot-f32` (the same with float32
scales), `f32-t` (the float32 weight stored transposed, [N, K], each output a dot along a
contiguous weight row: llama.cpp's layout, the kernel's `transposed` path), `read` (no matmul: a plain sequential read of the float32
copies, on as many threads as the kernel may use: the bandwidth the kernel should reach). With `--old-so` an
older build of the kernel (loaded beside the current one under another FFI target name) adds
`old-bf16`, `old-f32`, `old-int8` and `old-f32-t`, so a change is measured against its predecessor in the same run.

Each timed call is one jitted chain over several copies of the weight (at least ~200 MB of
float32 in all, more than the L3 holds), each call's input depending on the previous output,
so the weight comes from memory as in a decode step. GB/s = weight bytes read / time (int8-dot:
one byte per weight, its scales not counted, so it compares with int8 as weights per second); the
table shows the median over rounds and the best round (the round that had its cores).
"""

from __future__ import annotations

import argparse
import functools
import ctypes
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1024x3072,3072x1024,1024x32000", help="KxN weights, comma-separated")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--total-mb", type=float, default=200.0, help="float32 weight bytes per timed call")
    ap.add_argument("--old-so", default=None, help="an older build of _matmul*.so to compare against")
    ap.add_argument("--threads", type=int, default=0, help="max threads per kernel call (0: XLA's pool)")
    ap.add_argument("--modes", default=None, help="comma-separated subset of the modes")
    ap.add_argument("--x-block", type=int, default=0, help="int8-dot: values of x per scale (0: the default)")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import bench_cpu_decode
    from hybridjax import cpu_kernels

    calls = {"new": lambda x, w: cpu_kernels.matmul(x, w, max_threads=a.threads),
             "packed": lambda x, w: cpu_kernels.matmul_packed(x, w[0], w[1], max_threads=a.threads),
             "int8": lambda x, w: cpu_kernels.matmul(x, w[0], w[1], max_threads=a.threads),
             "t": lambda x, w: cpu_kernels.matmul(x, w, transposed=True, max_threads=a.threads),
             "q8": lambda x, w: cpu_kernels.matmul_q8(x, w[0][0], w[0][1], w[1], max_threads=a.threads,
                                                      x_block=a.x_block or cpu_kernels.X_BLOCK)}
    if a.old_so:
        old = ctypes.CDLL(a.old_so)
        jax.ffi.register_ffi_target("hybridjax_cpu_matmul_old", jax.ffi.pycapsule(old.HjMatmul), platform="cpu")

        def old_call(x, w, transposed=False):  # the attributes every build so far takes; the same path (isa)
            args = (x, w) if not isinstance(w, tuple) else (x, w[0], w[1][None])  # int8: (q, scale [1, N])
            n = args[1].shape[0 if transposed else -1]
            out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32)
            call = jax.ffi.ffi_call("hybridjax_cpu_matmul_old", out, vmap_method="expand_dims")
            return call(*args, isa=np.int64(cpu_kernels._isa_code(None)), max_threads=np.int64(a.threads), tile_cols=np.int64(0),
                        k_slices=np.int64(0), transposed=transposed)

        calls["old"] = old_call
        calls["old-t"] = functools.partial(old_call, transposed=True)

    # mode -> (call, weight dtype, x dtype)
    modes = {"f32": ("new", jnp.float32, jnp.float32), "bf16": ("new", jnp.bfloat16, jnp.bfloat16),
             "bf16-xf32": ("new", jnp.bfloat16, jnp.float32), "bf16-packed": ("packed", "packed", jnp.bfloat16),
             "int8": ("int8", "int8", jnp.float32), "int8-dot": ("q8", "int8-dot", jnp.float32),
             "int8-dot-f32": ("q8", "int8-dot-f32", jnp.float32), "f32-t": ("t", "f32-t", jnp.float32),
             "read": ("read", jnp.float32, None)}
    if a.old_so:
        modes.update({"old-f32": ("old", jnp.float32, jnp.float32), "old-bf16": ("old", jnp.bfloat16, jnp.bfloat16),
                      "old-int8": ("old", "int8", jnp.float32), "old-f32-t": ("old-t", "f32-t", jnp.float32)})
    if a.modes:
        modes = {m: modes[m] for m in a.modes.split(",")}

    def chain(call):
        @functools.partial(jax.jit, static_argnums=2)
        def run(x, arrays, ns):  # x [R, K]; each call's x depends on the previous y (no overlap)
            ws = [(w, n) for w, n in zip(arrays, ns)] if ns else arrays
            for w in ws:
                y = call(x, w)
                x = x + (y[:, :1] * 1e-30).astype(x.dtype)
            return x

        def f(x, ws):
            if isinstance(ws[0], tuple) and len(ws[0]) == 3:  # int8-dot: (panels, scale, n), n static
                return run(x, [(p, s) for p, s, _ in ws], tuple(n for _, _, n in ws))
            if isinstance(ws[0], tuple) and not isinstance(ws[0][1], int):  # int8: (q, scale)
                return run(x, ws, ())
            if isinstance(ws[0], tuple):  # packed: (panels, n), n static
                return run(x, [w for w, _ in ws], tuple(n for _, n in ws))
            return run(x, ws, ())
        return f

    print(f"CPU kernel weight stream, path {bench_cpu_decode.kernel_path(cpu_kernels)}, threads {a.threads or 'pool'}; "
          f"load {loadavg()} at start")
    print("| K x N | rows | " + " | ".join(f"{m} GB/s med / best" for m in modes)
          + " | f32, bf16, int8 / read (med) | load |")
    print("|---|---:|" + "---:|" * len(modes) + "---:|---|")
    rng = np.random.default_rng(0)
    for shape in a.shapes.split(","):
        k, n = (int(s) for s in shape.split("x"))
        copies = max(2, int(np.ceil(a.total_mb * 1e6 / (4 * k * n))))
        base = rng.standard_normal((copies, k, n), dtype=np.float32) * 0.05
        ws = {jnp.float32: [jnp.asarray(b) for b in base]}
        ws[jnp.bfloat16] = [w.astype(jnp.bfloat16) for w in ws[jnp.float32]]
        ws["packed"] = [(cpu_kernels.pack_bf16(w), n) for w in ws[jnp.bfloat16]]
        ws["f32-t"] = ([jnp.asarray(np.ascontiguousarray(b.T)) for b in base]
                       if any(wd == "f32-t" for _, wd, _ in modes.values()) else [])
        del base
        ws["int8"] = [cpu_kernels.quantize_int8(w) for w in ws[jnp.float32]] if "int8" in modes else []
        block = a.x_block or cpu_kernels.X_BLOCK
        for mode, dtype in (("int8-dot", jnp.float16), ("int8-dot-f32", jnp.float32)):
            blocked = ([cpu_kernels.quantize_int8_blocks(w, block, dtype) for w in ws[jnp.float32]]
                       if mode in modes else [])
            ws[mode] = [(cpu_kernels.pack_int8(q), cpu_kernels.pack_block_scales(d), n) for q, d in blocked]
        host = [np.asarray(w) for w in ws[jnp.float32]] if "read" in modes else []
        fns = {m: chain(calls[c]) for m, (c, _, _) in modes.items() if c != "read"}
        if "read" in modes:
            lib = cpu_kernels._load()[0]
            lib.HjStreamRead.restype = ctypes.c_uint64
            lib.HjStreamRead.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            nthreads = a.threads or os.cpu_count() or 1
            fns["read"] = lambda x, arrays: [lib.HjStreamRead(h.ctypes.data, h.nbytes, nthreads) for h in host][0]
        for rows in (int(r) for r in a.rows.split(",")):
            xs = {dt: jnp.asarray(rng.standard_normal((rows, k)), dt) for dt in (jnp.float32, jnp.bfloat16)}
            for m, (_, wd, xd) in modes.items():  # compile and warm
                jax.block_until_ready(fns[m](xs.get(xd), ws[wd]))
            times = {m: [] for m in modes}
            for _ in range(a.rounds):
                for m, (_, wd, xd) in modes.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(fns[m](xs.get(xd), ws[wd]))
                    times[m].append(time.perf_counter() - t0)
            gbs = {}
            for m, (_, wd, _) in modes.items():
                per_weight = {"packed": 2, "f32-t": 4}.get(wd, 1) if isinstance(wd, str) else jnp.dtype(wd).itemsize
                nbytes = copies * k * n * per_weight
                t = np.asarray(times[m])
                gbs[m] = (nbytes / np.median(t) / 1e9, nbytes / t.min() / 1e9)
            ref = "read" if "read" in gbs else "f32"  # ratios against the plain read when there is one
            ratio = [f"{gbs[m][0] / gbs[ref][0]:.2f}" if m in gbs and ref in gbs else "-"
                     for m in ("f32", "bf16", "int8")]
            print(f"| {k}x{n} | {rows} | " + " | ".join(f"{g[0]:.1f} / {g[1]:.1f}" for g in gbs.values())
                  + f" | {', '.join(ratio)} | {loadavg()} |", flush=True)
        del ws, fns
    return 0


if __name__ == "__main__":
    sys.exit(main())
