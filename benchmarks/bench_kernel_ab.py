"""What a change to the CPU kernel bought: decode tok/s of the current kernel against an older
build of it, in one process, modes alternating round by round.

    git archive OLD_COMMIT | tar -x -C /tmp/old && (cd /tmp/old && python setup.py build_ext --inplace)
    python benchmarks/bench_kernel_ab.py --old-so /tmp/old/hybridjax/cpu_kernels/_matmul*.so \
        --model-dir /tmp/bench_model [--repeats 3] [--new-tokens 64]

The old library is loaded beside the current one and registered under another FFI target name
(its attributes: isa, max_threads, tile_cols, k_slices, transposed). Modes, for float32 and bfloat16
weights: `old` (the older build), `new-noslice` (the current build with the older tiling:
columns only, about two tiles per thread, at least 512 wide, no slices of K: what the L2
prefetch of the next pass bought), `new` (the current build, its own plan). Timed as single
decode steps, modes interleaved round by round (bench_cpu_decode.step_times): on a machine other
jobs share, the 10th percentile is the step that had both cores; the median is shown beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-so", required=True)
    ap.add_argument("--model-dir", default="/tmp/bench_model")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=20, help="rounds of 4 steps per mode")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import bench_cpu_decode as bcd
    import bench_generate
    import hybridjax
    from hybridjax import cpu_kernels

    old = ctypes.CDLL(a.old_so)
    jax.ffi.register_ffi_target("hybridjax_cpu_matmul_old", jax.ffi.pycapsule(old.HjMatmul), platform="cpu")
    new_call = cpu_kernels._call

    def old_call(x, w, scale, isa, max_threads, tile_cols, k_slices, transposed):
        out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[-2] if transposed else w.shape[-1],), jnp.float32)
        call = jax.ffi.ffi_call("hybridjax_cpu_matmul_old", out, vmap_method="expand_dims")
        args = (x, w) if scale is None else (x, w, scale)
        return call(*args, isa=np.int64(isa), max_threads=np.int64(max_threads), tile_cols=np.int64(tile_cols),
                    k_slices=np.int64(k_slices), transposed=bool(transposed))  # builds since K slices

    def noslice_call(x, w, scale, isa, max_threads, tile_cols, k_slices, transposed):
        n = w.shape[-2] if transposed else w.shape[-1]
        threads = os.cpu_count() or 1  # XLA's pool: one thread per core
        tc = max(-(-n // (2 * threads)), 512)  # the older plan: ~two column tiles per thread, >= 512
        return new_call(x, w, scale, isa, max_threads, tc, 1, transposed)

    calls = {"old": old_call, "new-noslice": noslice_call, "new": new_call}

    class Patched(bcd.Mode):
        def __init__(self, name, params, cfg, call):
            super().__init__(name, params, cfg, True, 0)
            self.call = call

        @contextlib.contextmanager
        def patched(self):  # the kernel's call is read while the mode's own jit traces
            cpu_kernels._call = self.call
            try:
                yield
            finally:
                cpu_kernels._call = new_call

    modes = {}
    for dtype in ("float32", "bfloat16"):
        cfg, params = hybridjax.load_hf(a.model_dir, dtype=dtype)
        for kind, call in calls.items():
            modes[f"{dtype} {kind}"] = Patched(f"{dtype} {kind}", params, cfg, call)
    prompt = bench_generate.prompt_tokens(a.prompt).tolist()
    load0 = bcd.loadavg()
    st = bcd.step_times(modes, prompt, a.rounds, 4, 8192)
    print(f"\nkernel A/B, single decode steps after a {a.prompt}-token prompt, {a.rounds} rounds x 4 steps per "
          f"mode, interleaved; load {load0} -> {bcd.loadavg()}\n")
    q = {name: {p: float(np.percentile(t, p)) for p in (10, 50)} for name, t in st.items() if name in modes}
    print("| weights | stat | old ms | new-noslice ms | new ms | old / new-noslice | old / new |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for dtype in ("float32", "bfloat16"):
        for p in (10, 50):
            t = {k: 1e3 * q[f"{dtype} {k}"][p] for k in calls}
            print(f"| {dtype} | p{p} | {t['old']:.2f} | {t['new-noslice']:.2f} | {t['new']:.2f} | "
                  f"{t['old'] / t['new-noslice']:.2f}x | {t['old'] / t['new']:.2f}x |")
    for p in (10, 50):
        r = {k: q[f"float32 {k}"][p] / q[f"bfloat16 {k}"][p] for k in calls}
        print(f"bfloat16 speed / float32 speed (p{p}): " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
