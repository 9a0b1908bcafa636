"""CPU kernels called through XLA's FFI: the small-row matmul that decode and narrow prefill
chunks run on.

    y = matmul(x, w)              # x [..., R, K] float32 | bfloat16; w [K, N] float32 | bfloat16
    y = matmul(x, q, scale)       # q [K, N] int8, scale [N] float32: y = (x @ q) * scale
    y = matmul(x, e, transposed=True)   # e [N, K]: y = x @ e.T (a tied embedding as the head)
    y = matmul_indexed(x, w, index)     # x [B, R, K], w [E, K, N], index [B]: y[b] = x[b] @ w[index[b]]
                                        # (routed experts, read in place; index outside [0, E): zeros)
    p = pack_bf16(w)                    # w [K, N] -> bfloat16 panels [ceil(N/32), ceil(K/2) * 64], once
    y = matmul_packed(x, p, n=N)        # = matmul(x, w.astype(bfloat16)), streamed from the panels
    q, d = quantize_int8_blocks(w)      # int8 with a scale per column per block of 32 k (Q8_0-like)
    y = matmul_q8(x, pack_int8(q), pack_block_scales(d), n=N)   # int8 x int8 dots, x rounded per block
    params = quantize_params(params)    # projections as Int8Weight: (q, scale) or int8-dot's (panels, panel_scales)
                                  # y [..., R, N] float32, accumulated in float32

A decode step reads every weight once per token, so it is bound by memory bandwidth, and
XLA:CPU's one-row dots reach only part of it (bfloat16 ones ~2 GB/s: docs/architecture.md, Known traps).
The kernel (matmul.cc) streams the weight in hybridjax's own `[in, out]` layout, so nothing is
packed at load time and prefill reads the same arrays: its narrow chunks here (`max_rows`),
wider ones with XLA's matmuls. Its paths,
picked from cpuid at run time: "avx512bf16" (vdpbf16ps, bfloat16 weights), "avx512", "avx2",
"scalar". Work items (column tiles, and slices of K for narrow weights) are shared out over
XLA's intra-op threads.

The extension is a small C++ library built when the package is installed (setup.py, against
`jax.ffi.include_dir()`). If it is missing or fails to load, `available()` is False, a
warning is logged once when a caller first asks for it, and `hybridjax.ops.dense` keeps
XLA's dot.

Environment (read at trace time: call `jax.clear_caches()` after changing them in-process):
  HYBRIDJAX_CPU_KERNELS=0     never use the kernel in `dense`;
  HYBRIDJAX_CPU_ISA=NAME      cap the path (scalar | avx2 | avx512 | avx512bf16), e.g. to test
                              a fallback on a CPU that has more; the layouts chosen at load
                              follow the capped path (`isa()`), as on a CPU with only that one;
  HYBRIDJAX_CPU_THREADS=N     use at most N threads per call (default: XLA's pool);
  HYBRIDJAX_CPU_BF16_PREFILL=widen|direct   bf16 prefill matmuls in float32 or bf16 on XLA
                              (default: widen unless the CPU has avx512bf16; `widen_bf16_prefill`);
  HYBRIDJAX_CPU_AVX2_PASS_ROWS=4|8   weight rows the avx2 path reads side by side for one or two
                              rows of x and a float32 weight (read when the library loads;
                              `set_avx2_pass_rows`). The same bits either way; which is faster is
                              the CPU's, so by default each weight shape's first calls time both.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

ISAS = ("scalar", "avx2", "avx512", "avx512bf16")  # in the kernel's numbering, 0..3
TARGET = "hybridjax_cpu_matmul"
TARGET_INDEXED = "hybridjax_cpu_matmul_indexed"
TARGET_PACKED = "hybridjax_cpu_matmul_packed"
TARGET_Q8 = "hybridjax_cpu_matmul_q8"
# Rows up to which `dense` prefers the kernel, by weight dtype: decode (the engine's slots, at
# most DECODE_ROWS) and narrow prefill chunks, where XLA:CPU's small-M dots run below the
# kernel's stream. A 16-token prefill of the 0.23B model took 0.6-0.85x the time in float32 with
# AVX-512 (about the same on the AVX2 path), and a 16- or 32-token one 0.25-0.65x in bfloat16
# (XLA widens the weight in every call); more rows keep XLA's matmuls, compute-bound there and as
# fast or faster (benchmarks/README.md, bench_narrow_prefill.py). int8 weights stay at decode's
# rows: int8-dot rounds x to int8, so its prefill keeps float32 activations.
DECODE_ROWS = 8
MAX_ROWS = 16
MAX_ROWS_BF16 = 32
# Output columns per work item (rounded to whole 32-column chunks) and slices of K; 0: the
# kernel picks from the shape (about four items per weight, tiles >= 1024 columns wide).
TILE_COLS = 0
K_SLICES = 0
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)


def _library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_matmul{suffix}"
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) once registered with XLA, or (None, why not)."""
    path = _library_path()
    if path is None:
        return None, (
            f"the C++ extension is not built (no _matmul*.so in {Path(__file__).parent}); "
            "reinstall the package with a C++17 compiler present, or build it in place with "
            "`python setup.py build_ext --inplace`"
        )
    pass_rows = _pass_rows(os.environ.get("HYBRIDJAX_CPU_AVX2_PASS_ROWS") or None)  # a bad value: its own error
    try:
        lib = ctypes.CDLL(str(path))
        lib.HjBestIsa.restype = ctypes.c_int
        lib.HjHelperItems.restype = ctypes.c_int64
        lib.HjAvx2PassRows.restype = ctypes.c_int
        lib.HjAvx2PassRows.argtypes = (ctypes.c_int64, ctypes.c_int64)
        lib.HjSetAvx2PassRows.argtypes = (ctypes.c_int,)
        lib.HjSetAvx2PassRows(pass_rows)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.HjMatmul), platform="cpu")
        jax.ffi.register_ffi_target(TARGET_INDEXED, jax.ffi.pycapsule(lib.HjMatmulIndexed), platform="cpu")
        jax.ffi.register_ffi_target(TARGET_PACKED, jax.ffi.pycapsule(lib.HjMatmulPacked), platform="cpu")
        jax.ffi.register_ffi_target(TARGET_Q8, jax.ffi.pycapsule(lib.HjMatmulQ8), platform="cpu")
    except (OSError, AttributeError, RuntimeError, ValueError) as e:
        return None, f"the C++ extension {path.name} failed to load: {e}"
    return lib, None


def _pass_rows(value) -> int:
    if value is None:
        return 0  # measure
    if str(value) not in ("4", "8"):
        raise ValueError(f"avx2 weight rows per pass must be 4 or 8 (HYBRIDJAX_CPU_AVX2_PASS_ROWS), got {value!r}")
    return int(value)


def set_avx2_pass_rows(pass_rows: int | None) -> None:
    """How many weight rows the avx2 path reads side by side (4 or 8) for one or two rows of x and
    a float32 weight of >= 256 KB and up to 16384 columns (decode's projections); None: each
    weight shape's first calls alternate the two and the faster serves the rest (starting over).
    The results are the same bits either way; the speed is the CPU's (matmul.cc, NextPassRows)."""
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(load_error())
    lib.HjSetAvx2PassRows(_pass_rows(pass_rows))


def avx2_pass_rows(k: int, n: int) -> int | None:
    """The weight rows per pass a [k, n] float32 weight takes on the avx2 path (4 or 8); None while
    its first calls still time both, or before any call of that shape."""
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(load_error())
    return lib.HjAvx2PassRows(int(k), int(n)) or None


def available() -> bool:
    """True when the extension is built, loaded and registered with XLA."""
    return _load()[0] is not None


def load_error() -> str | None:
    """Why the extension is unavailable, or None."""
    return _load()[1]


@functools.lru_cache(maxsize=None)
def warn_unavailable() -> None:
    """Log, once per process, that decode falls back to XLA's dots."""
    log.warning("hybridjax CPU kernels unavailable, decode uses XLA's dots (slower): %s", load_error())


def best_isa() -> str:
    """The best path this CPU supports (the kernel's own cpuid check)."""
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(load_error())
    return ISAS[lib.HjBestIsa()]


def isa() -> str:
    """The path the kernel's calls take: HYBRIDJAX_CPU_ISA's cap where it is below `best_isa()`,
    else the best. The layout choices (`pack_params`, `int8_mode`, `widen_bf16_prefill`) follow
    it, so a capped process does what a CPU with only that path would, layouts included."""
    best = best_isa()
    cap = _isa_code(None)
    return best if cap < 0 else ISAS[min(cap, ISAS.index(best))]


def helper_items() -> int:
    """Work items run so far by helper threads of XLA's pool (process-wide; for tests)."""
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(load_error())
    return int(lib.HjHelperItems())


def enabled() -> bool:
    """Whether `dense` may use the kernel: built, and not switched off by HYBRIDJAX_CPU_KERNELS=0."""
    if os.environ.get("HYBRIDJAX_CPU_KERNELS", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    if not available():
        if jax.default_backend() == "cpu":  # on a GPU host the warning would only puzzle
            warn_unavailable()
        return False
    return True


def max_rows(w_dtype) -> int:
    """Rows of x up to which `dense` sends x @ w (w of this dtype) to the kernel; 0: never."""
    return {jnp.dtype(jnp.float32): MAX_ROWS, jnp.dtype(jnp.bfloat16): MAX_ROWS_BF16,
            jnp.dtype(jnp.int8): DECODE_ROWS}.get(jnp.dtype(w_dtype), 0)


def supports(rows: int, x_dtype, w_dtype) -> bool:
    """Whether `dense` should send rows of x @ w here: few rows, dtypes the kernel takes."""
    return rows <= max_rows(w_dtype) and jnp.dtype(x_dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def widen_bf16_prefill() -> bool:
    """Whether `dense` widens bfloat16 prefill matmuls to float32 on CPU (at trace time).

    HYBRIDJAX_CPU_BF16_PREFILL=widen | direct decides; by default widen where the CPU has no
    bf16 dot instruction (`isa()` below avx512bf16, or the extension is not built): there
    XLA:CPU's bf16 x bf16 -> f32 dot ran 0.7-0.8x its float32 one (AVX2, benchmarks/README.md),
    while with AVX512_BF16 / AMX its bf16 path is the faster one."""
    mode = os.environ.get("HYBRIDJAX_CPU_BF16_PREFILL", "").strip().lower()
    if mode in ("widen", "direct"):
        return mode == "widen"
    if mode:
        raise ValueError(f"HYBRIDJAX_CPU_BF16_PREFILL must be widen or direct, got {mode!r}")
    return not (available() and isa() == "avx512bf16")


def _isa_code(isa: str | None) -> int:
    isa = isa or os.environ.get("HYBRIDJAX_CPU_ISA") or None
    if isa is None:
        return -1  # the best the CPU has
    if isa not in ISAS:
        raise ValueError(f"unknown CPU kernel path {isa!r}; valid: {', '.join(ISAS)}")
    return ISAS.index(isa)


def _call(x, w, scale, isa, max_threads, tile_cols, k_slices, transposed):
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[-2] if transposed else w.shape[-1],), jnp.float32)
    # expand_dims: a vmapped operand arrives with a leading batch axis, an unbatched one with
    # a leading 1; the kernel broadcasts size-1 axes and folds a shared weight's rows together.
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="expand_dims")
    args = (x, w) if scale is None else (x, w, scale)
    return call(*args, isa=np.int64(isa), max_threads=np.int64(max_threads), tile_cols=np.int64(tile_cols),
                k_slices=np.int64(k_slices), transposed=bool(transposed))


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5, 6, 7))
def _matmul(x, w, scale, isa, max_threads, tile_cols, k_slices, transposed):
    return _call(x, w, scale, isa, max_threads, tile_cols, k_slices, transposed)


@_matmul.defjvp
def _matmul_jvp(isa, max_threads, tile_cols, k_slices, transposed, primals, tangents):
    # Linear in x and w: the tangent goes through XLA's dot (so it transposes for grad).
    x, w, scale = primals
    dx, dw, dscale = tangents
    y = _matmul(x, w, scale, isa, max_threads, tile_cols, k_slices, transposed)

    def as_kn(a):  # [.., K, N] float32
        a = a.astype(jnp.float32)
        return jnp.swapaxes(a, -1, -2) if transposed else a

    f32 = jnp.float32
    if w.dtype == jnp.int8:  # q carries no tangent; scale does
        dy = jnp.matmul(dx.astype(f32), as_kn(w) * scale) + jnp.matmul(x.astype(f32), as_kn(w)) * dscale
    else:
        dy = jnp.matmul(dx.astype(f32), as_kn(w)) + jnp.matmul(x.astype(f32), as_kn(dw))
    return y, dy


def matmul(x, w, scale=None, *, transposed: bool = False, isa: str | None = None,
           max_threads: int | None = None, tile_cols: int = TILE_COLS, k_slices: int = K_SLICES):
    """x [..., R, K] (float32 | bfloat16) @ w [K, N] -> [..., R, N] float32, on the CPU kernel.

    w is float32, bfloat16, or int8 with `scale` [N] float32 (y = (x @ w) * scale).
    transposed: w is [N, K] and y = x @ w.T, read in place (a tied embedding as the head).
    isa: cap the path ("scalar", "avx2", "avx512", "avx512bf16"; default HYBRIDJAX_CPU_ISA or
    the best this CPU has); asking for more than the CPU has fails at run time.
    max_threads: threads per call (default HYBRIDJAX_CPU_THREADS or XLA's pool; 0 = pool).
    tile_cols, k_slices: output columns per work item and slices of K (0: chosen from the
    shape; tests force small tiles and several slices to reach every edge).
    Works under jit, vmap (any operand) and inside loops; only lowers for CPU.
    """
    if not available():
        raise RuntimeError(load_error())
    x, w = jnp.asarray(x), jnp.asarray(w)
    k_axis, n_axis = (1, 0) if transposed else (0, 1)
    if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[k_axis]:
        want = "[N, K] (transposed)" if transposed else "[K, N]"
        raise ValueError(f"matmul: x [..., R, K] @ w {want}, got {x.shape} and {w.shape}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"matmul: x must be float32 or bfloat16, got {x.dtype}")
    if w.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"matmul: w must be float32, bfloat16 or int8, got {w.dtype}")
    if (w.dtype == jnp.int8) != (scale is not None):
        raise ValueError("matmul: int8 weights need a per-column scale [N]; other dtypes take none")
    if scale is not None:
        scale = jnp.asarray(scale, jnp.float32)
        if scale.shape != (w.shape[n_axis],):
            raise ValueError(f"matmul: scale must be [N] = [{w.shape[n_axis]}], got {scale.shape}")
        scale = scale[None]  # [1, N]: a row of y's [R, N], so every operand has y's rank
    if max_threads is None:
        max_threads = int(os.environ.get("HYBRIDJAX_CPU_THREADS", "0") or 0)
    lead = x.shape[:-2]
    w = w.reshape((1,) * len(lead) + w.shape)  # [1.., K, N]: same rank as x
    if scale is not None:
        scale = scale.reshape((1,) * len(lead) + scale.shape)
    return _matmul(x, w, scale, _isa_code(isa), int(max_threads), int(tile_cols), int(k_slices), bool(transposed))


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def _matmul_indexed(x, w, index, isa, max_threads, transposed):
    n = w.shape[1] if transposed else w.shape[2]
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET_INDEXED, out, vmap_method="sequential")
    return call(x, w, index, isa=np.int64(isa), max_threads=np.int64(max_threads), tile_cols=np.int64(0),
                k_slices=np.int64(0), transposed=bool(transposed))


@_matmul_indexed.defjvp
def _matmul_indexed_jvp(isa, max_threads, transposed, primals, tangents):
    # Linear in x and w: the tangent gathers the experts with XLA (transposable for grad).
    x, w, index = primals
    dx, dw, _ = tangents
    y = _matmul_indexed(x, w, index, isa, max_threads, transposed)
    live = ((index >= 0) & (index < w.shape[0]))[:, None, None]
    safe = jnp.clip(index, 0, w.shape[0] - 1)
    spec = "brk,bnk->brn" if transposed else "brk,bkn->brn"
    f32 = jnp.float32
    dy = (jnp.einsum(spec, dx.astype(f32), w[safe].astype(f32))
          + jnp.einsum(spec, x.astype(f32), dw[safe].astype(f32)))
    return y, jnp.where(live, dy, 0.0)


def matmul_indexed(x, w, index, *, transposed: bool = False, isa: str | None = None, max_threads: int | None = None):
    """x [B, R, K] (float32 | bfloat16), w [E, K, N] (float32 | bfloat16), index [B] int32 ->
    float32 [B, R, N] with y[b] = x[b] @ w[index[b]]: each batch reads its own expert in place.
    An index outside [0, E) gives zeros and costs nothing. transposed: w is [E, N, K].
    Differentiable (the tangent gathers with XLA); only lowers for CPU."""
    if not available():
        raise RuntimeError(load_error())
    x, w, index = jnp.asarray(x), jnp.asarray(w), jnp.asarray(index, jnp.int32)
    k_axis = 2 if transposed else 1
    if x.ndim != 3 or w.ndim != 3 or index.shape != x.shape[:1] or x.shape[-1] != w.shape[k_axis]:
        raise ValueError(f"matmul_indexed: x [B, R, K], w [E, K, N] (or [E, N, K] transposed), index [B]; "
                         f"got {x.shape}, {w.shape}, {index.shape}")
    if x.dtype not in (jnp.float32, jnp.bfloat16) or w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"matmul_indexed: x and w must be float32 or bfloat16, got {x.dtype}, {w.dtype}")
    if max_threads is None:
        max_threads = int(os.environ.get("HYBRIDJAX_CPU_THREADS", "0") or 0)
    return _matmul_indexed(x, w, index, _isa_code(isa), int(max_threads), bool(transposed))


# Paths on which `pack_params` packs: avx512bf16 (vdpbf16ps on the pairs) and avx2 (a pair widened
# by a shift and a mask: fewer uops per weight than the [K, N] path's widening, one stream per
# panel). avx512 without bf16 keeps its [K, N] path (it would read panels with AVX2 code); there
# `pack_params` keeps only prefill's float32 copy beside it (`WidenedWeight`).
PACKED_ISAS = ("avx2", "avx512bf16")
# Paths on which `pack_params` holds float32 projections transposed (`TransposedWeight`): one row
# of x read a [N, K] weight 1.1-1.4x faster than [K, N], and a decode step ran 1.21-1.25x faster
# (AVX2 capped and AVX-512 on a Zen 5, benchmarks/README.md; float32 takes the same avx512 code
# with or without AVX512_BF16).
TRANSPOSED_ISAS = ("avx2", "avx512", "avx512bf16")
PANEL = 32  # output columns per panel of a packed weight (two zmm registers of float32 sums)


def pack_bf16(w):
    """w [K, N] -> bfloat16 panels [ceil(N / 32), ceil(K / 2) * 64] for `matmul_packed`.

    Panel j holds columns 32j .. 32j + 31; within it, pair p of weight rows (2p, 2p + 1) is 32
    (w[2p, c], w[2p + 1, c]) pairs: the operand of vdpbf16ps, so the kernel streams each panel
    from one contiguous block with no shuffles. K and N are zero-padded (to even, to whole
    panels). Meant to run once, when parameters are placed: it reads and writes the weight."""
    w = jnp.asarray(w).astype(jnp.bfloat16)
    k, n = w.shape
    kp, panels = -(-k // 2), -(-n // PANEL)
    w = jnp.pad(w, ((0, 2 * kp - k), (0, PANEL * panels - n)))
    # [kp, 2, panels, 32] -> [panels, kp, 32, 2]
    return w.reshape(kp, 2, panels, PANEL).transpose(2, 0, 3, 1).reshape(panels, kp * 2 * PANEL)


_pack_bf16_jit = jax.jit(pack_bf16)  # one compile per weight shape


def unpack_bf16(p, k: int, n: int):
    """The inverse of `pack_bf16`: panels -> bfloat16 [K, N] (a reference, and XLA's operand)."""
    panels = p.shape[0]
    kp = p.shape[1] // (2 * PANEL)
    w = p.reshape(panels, kp, PANEL, 2).transpose(1, 3, 0, 2).reshape(2 * kp, panels * PANEL)
    return w[:k, :n]


def _call_packed(x, p, n, isa, max_threads, tile_cols, k_slices):
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET_PACKED, out, vmap_method="expand_dims")
    return call(x, p, isa=np.int64(isa), max_threads=np.int64(max_threads), tile_cols=np.int64(tile_cols),
                k_slices=np.int64(k_slices))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4, 5, 6))
def _matmul_packed(x, p, n, isa, max_threads, tile_cols, k_slices):
    return _call_packed(x, p, n, isa, max_threads, tile_cols, k_slices)


@_matmul_packed.defjvp
def _matmul_packed_jvp(n, isa, max_threads, tile_cols, k_slices, primals, tangents):
    # Linear in x and p: the tangent goes through XLA's dot on the unpacked weight.
    x, p = primals
    dx, dp = tangents
    y = _matmul_packed(x, p, n, isa, max_threads, tile_cols, k_slices)
    k, f32 = x.shape[-1], jnp.float32
    dy = (jnp.matmul(dx.astype(f32), unpack_bf16(p[(0,) * (p.ndim - 2)], k, n).astype(f32))
          + jnp.matmul(x.astype(f32), unpack_bf16(dp[(0,) * (dp.ndim - 2)], k, n).astype(f32)))
    return y, dy


def matmul_packed(x, p, n: int, *, isa: str | None = None, max_threads: int | None = None,
                  tile_cols: int = TILE_COLS, k_slices: int = K_SLICES):
    """x [..., R, K] (float32 | bfloat16) @ w [K, N] -> [..., R, N] float32, w given packed
    (`pack_bf16(w)`, bfloat16 panels [ceil(N / 32), ceil(K / 2) * 64]); n is N.

    The same sums as `matmul(x, w.astype(bfloat16))` up to float32 rounding (bf16 products,
    float32 accumulation), streamed faster: each panel is one contiguous block and its sums stay
    in registers (avx512bf16: vdpbf16ps; avx2 and avx512: a pair widened by a shift and a mask).
    The scalar path reads the panels with plain C++ (correct, slow): pack only where `isa()`
    is in PACKED_ISAS. Other arguments as for `matmul`.
    """
    if not available():
        raise RuntimeError(load_error())
    x, p = jnp.asarray(x), jnp.asarray(p)
    k = x.shape[-1] if x.ndim else 0
    want = (-(-n // PANEL), -(-k // 2) * 2 * PANEL)
    if x.ndim < 2 or p.ndim != 2 or p.shape != want or p.dtype != jnp.bfloat16:
        raise ValueError(f"matmul_packed: x [..., R, K] and bfloat16 panels {want} for n={n}; "
                         f"got {x.shape} and {p.shape} {p.dtype}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"matmul_packed: x must be float32 or bfloat16, got {x.dtype}")
    if max_threads is None:
        max_threads = int(os.environ.get("HYBRIDJAX_CPU_THREADS", "0") or 0)
    p = p.reshape((1,) * (x.ndim - 2) + p.shape)  # same rank as x
    return _matmul_packed(x, p, int(n), _isa_code(isa), int(max_threads), int(tile_cols), int(k_slices))


# --- int8 x int8: weights packed in quads of K, activations quantised per block ------------

QUAD = 4  # consecutive k per 32-bit lane of a packed int8 weight (the operand of vpmaddubsw)
# Values of x per activation scale on the int8 x int8 path: 32, Q8_0's block. On the 228M model
# 128 raised the mean KL against float32 to 2.6e-3 (32: 1.9e-3), 16 lowered it only to 1.7e-3, and
# the kernel's speed did not measurably differ (benchmarks/README.md).
X_BLOCK = 32


def pack_int8(q):
    """q [K, N] int8 -> int8 panels [ceil(N / 32), ceil(K / 4) * 128] for `matmul_q8`.

    Panel j holds columns 32j .. 32j + 31; within it, quad p of weight rows (4p .. 4p + 3) is 32
    lanes of 4 bytes (q[4p, c], .., q[4p + 3, c]): a 32-byte load is 4 k of 8 columns, what
    vpmaddubsw multiplies by a broadcast quad of x. K and N are zero-padded (to whole quads and
    panels). Meant to run once, at load."""
    q = jnp.asarray(q, jnp.int8)
    k, n = q.shape
    kq, panels = -(-k // QUAD), -(-n // PANEL)
    q = jnp.pad(q, ((0, QUAD * kq - k), (0, PANEL * panels - n)))
    # [kq, 4, panels, 32] -> [panels, kq, 32, 4]
    return q.reshape(kq, QUAD, panels, PANEL).transpose(2, 0, 3, 1).reshape(panels, kq * QUAD * PANEL)



def unpack_int8(p, k: int, n: int):
    """The inverse of `pack_int8`: panels -> int8 [K, N]."""
    panels = p.shape[0]
    kq = p.shape[1] // (QUAD * PANEL)
    return p.reshape(panels, kq, PANEL, QUAD).transpose(1, 3, 0, 2).reshape(QUAD * kq, panels * PANEL)[:k, :n]


# Storage of w's block scales for `matmul_q8`: float16 adds 1/16 byte per weight (as Q8_0), float32
# 1/8. float16 streamed at least as fast in the same runs (8 of 12 medians ahead, under load) and
# its rounding (< 2^-10, rounded up) is small beside the weights' own (1/254 of a block's max).
Q8_SCALE_DTYPE = jnp.float16


def quantize_int8_blocks(w, block: int = X_BLOCK, scale_dtype=None):
    """int8 with one scale per output column per block of `block` consecutive k (the blocks of x in
    `matmul_q8`): w [K, N] -> (q int8 [K, N], d [ceil(K / block), N] in scale_dtype, default
    Q8_SCALE_DTYPE). d = max |w| / 127 over the block, stored rounded up (so no |w| / d exceeds
    127), and q = round(w / d) against the stored d; blocks of zeros get d = 1 (q = 0)."""
    dtype = jnp.dtype(Q8_SCALE_DTYPE if scale_dtype is None else scale_dtype)
    w = jnp.asarray(w, jnp.float32)
    k, n = w.shape
    nb = -(-k // block)
    wb = jnp.pad(w, ((0, nb * block - k), (0, 0))).reshape(nb, block, n)
    amax = jnp.max(jnp.abs(wb), axis=1)
    d = jnp.where(amax > 0, amax / 127.0, 1.0)
    stored = d.astype(dtype)
    stored = jnp.where(stored.astype(jnp.float32) < d, jnp.nextafter(stored, jnp.asarray(jnp.inf, dtype)), stored)
    q = jnp.clip(jnp.round(wb / stored.astype(jnp.float32)[:, None, :]), -127, 127).astype(jnp.int8)
    return q.reshape(nb * block, n)[:k], stored


def dequantize_int8_blocks(q, d, block: int = X_BLOCK):
    """q [K, N] int8, d [ceil(K / block), N] -> float32 [K, N]: the weight they stand for."""
    k = q.shape[0]
    return q.astype(jnp.float32) * jnp.repeat(jnp.asarray(d, jnp.float32), block, axis=0)[:k]


def pack_block_scales(d):
    """d [blocks, N] -> [ceil(N / 32), blocks * 32] in d's dtype, for `matmul_q8`: panel j holds
    block b's scales of columns 32j .. 32j + 31 at b * 32, so the kernel reads them in step with
    `pack_int8`'s panel j. Padded columns get 0 (their weights are 0 too)."""
    d = jnp.asarray(d)
    nb, n = d.shape
    panels = -(-n // PANEL)
    d = jnp.pad(d, ((0, 0), (0, PANEL * panels - n)))
    return d.reshape(nb, panels, PANEL).transpose(1, 0, 2).reshape(panels, nb * PANEL)


def unpack_block_scales(s, n: int):
    """The inverse of `pack_block_scales`: [ceil(N / 32), blocks * 32] -> [blocks, N]."""
    panels, nb = s.shape[0], s.shape[1] // PANEL
    return s.reshape(panels, nb, PANEL).transpose(1, 0, 2).reshape(nb, panels * PANEL)[:, :n]


def quantize_x_blocks(x, block: int = X_BLOCK):
    """NumPy reference of the kernel's activation quantisation: x [R, K] float32 -> (q int8 [R, K],
    d float32 [R, ceil(K / block)]), per block d = max |x| / 127 and q = rint(x * (1 / d)), in
    that float32 order (d = 0 for a block of zeros, whose q are 0)."""
    x = np.asarray(x, np.float32)
    r, k = x.shape
    nb = -(-k // block)
    xp = np.zeros((r, nb * block), np.float32)
    xp[:, :k] = x
    xb = xp.reshape(r, nb, block)
    d = np.abs(xb).max(axis=2) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(xb * inv[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(r, nb * block)[:, :k], d.astype(np.float32)


def _call_q8(x, p, s, n, isa, max_threads, tile_cols, k_slices, x_block):
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET_Q8, out, vmap_method="expand_dims")
    return call(x, p, s, isa=np.int64(isa), max_threads=np.int64(max_threads), tile_cols=np.int64(tile_cols),
                k_slices=np.int64(k_slices), x_block=np.int64(x_block))


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _matmul_q8(x, p, s, n, isa, max_threads, tile_cols, k_slices, x_block):
    return _call_q8(x, p, s, n, isa, max_threads, tile_cols, k_slices, x_block)


@_matmul_q8.defjvp
def _matmul_q8_jvp(n, isa, max_threads, tile_cols, k_slices, x_block, primals, tangents):
    # Straight through the activation rounding: the tangent of x @ (q * d) with XLA.
    x, p, s = primals
    dx, _, ds = tangents
    y = _matmul_q8(x, p, s, n, isa, max_threads, tile_cols, k_slices, x_block)
    k, lead = x.shape[-1], (0,) * (p.ndim - 2)
    q = unpack_int8(p[lead], k, n)
    f32 = jnp.float32
    w = dequantize_int8_blocks(q, unpack_block_scales(s[lead], n).astype(f32), x_block)  # (q unpacked once for both)
    dw = dequantize_int8_blocks(q, unpack_block_scales(ds[lead].astype(f32), n), x_block)
    dy = jnp.matmul(dx.astype(f32), w) + jnp.matmul(x.astype(f32), dw)
    return y, dy


def matmul_q8(x, p, s, n: int, *, isa: str | None = None, max_threads: int | None = None,
              tile_cols: int = TILE_COLS, k_slices: int = K_SLICES, x_block: int | None = None):
    """x [..., R, K] (float32 | bfloat16) @ (q * d) -> [..., R, N] float32 with integer dots:
    p = pack_int8(q), s = pack_block_scales(d) for (q, d) = quantize_int8_blocks(w, x_block)
    (q [K, N] int8, d [ceil(K / x_block), N] float16 or float32), n = N.

    Each row of x is quantised to int8 per block of `x_block` values (`quantize_x_blocks`: dx =
    max |x| / 127); then y[r, c] = sum over blocks b of float(xq[r, b] . q[b, c]) * (dx[r, b] *
    d[b, c]), the dots exact in int32, the sum in float32 (a fused multiply-add per block). Not
    equal to a float matmul: x is rounded too (as in Q8_0), for a weight read in 4 uops per 32
    bytes on AVX2. x_block (default X_BLOCK): a multiple of 4, at most 1024 (so a block's dot is
    exact in float32), the blocks of d too. Other arguments as for `matmul`; the scalar path
    computes the same sums in plain C++."""
    if not available():
        raise RuntimeError(load_error())
    x, p = jnp.asarray(x), jnp.asarray(p)
    k = x.shape[-1] if x.ndim else 0
    want = (-(-n // PANEL), -(-k // QUAD) * QUAD * PANEL)
    if x.ndim < 2 or p.ndim != 2 or p.shape != want or p.dtype != jnp.int8:
        raise ValueError(f"matmul_q8: x [..., R, K] and int8 panels {want} for n={n}; got {x.shape} and "
                         f"{p.shape} {p.dtype}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"matmul_q8: x must be float32 or bfloat16, got {x.dtype}")
    x_block = X_BLOCK if x_block is None else x_block  # read per call: a benchmark may set X_BLOCK
    if x_block <= 0 or x_block % QUAD or x_block > 1024:
        raise ValueError(f"matmul_q8: x_block must be a multiple of 4 up to 1024, got {x_block}")
    s = jnp.asarray(s)
    want_s = (want[0], -(-k // x_block) * PANEL)
    if s.shape != want_s or s.dtype not in (jnp.float16, jnp.float32):
        raise ValueError(f"matmul_q8: block scales must be float16 or float32 {want_s} "
                         f"(pack_block_scales), got {s.shape} {s.dtype}")
    if max_threads is None:
        max_threads = int(os.environ.get("HYBRIDJAX_CPU_THREADS", "0") or 0)
    lead = (1,) * (x.ndim - 2)
    return _matmul_q8(x, p.reshape(lead + p.shape), s.reshape(lead + s.shape), int(n), _isa_code(isa),
                      int(max_threads), int(tile_cols), int(k_slices), int(x_block))


class _DecodeLayout:
    """A weight kept in a decode layout beside the array XLA reads (`main`): shape, dtype and ndim
    are that array's; a pytree of `fields`, in the constructor's order."""

    fields: tuple[str, ...] = ()

    @property
    def main(self):
        return getattr(self, self.fields[0])

    @property
    def shape(self):
        return self.main.shape

    @property
    def dtype(self):
        return self.main.dtype

    @property
    def ndim(self):
        return self.main.ndim

    def tree_flatten(self):
        return tuple(getattr(self, f) for f in self.fields), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


@jax.tree_util.register_pytree_node_class
class PackedWeight(_DecodeLayout):
    """A bfloat16 weight [K, N] kept twice: `w` for prefill's XLA matmuls (and any other reader)
    and `panels = pack_bf16(w)` (decode's `matmul_packed`). `hybridjax.ops.dense` takes it in
    place of w. `w` is the bfloat16 weight, or its exact float32 widening where prefill widens
    anyway (`pack_params`): then it is widened once here instead of in every prefill call.
    Costs a second copy of the weight (a bf16 model then holds as many bytes as a float32 one;
    with the float32 `w`, 1.5x); buys a faster decode (benchmarks/README.md). Its dtype is the
    weight's, bfloat16, whatever `w` holds."""

    fields = ("w", "panels")

    def __init__(self, w, panels):
        self.w, self.panels = w, panels

    @property
    def dtype(self):
        return self.panels.dtype

    def __repr__(self):
        return f"PackedWeight(shape={self.shape}, dtype={self.dtype})"


@jax.tree_util.register_pytree_node_class
class WidenedWeight(_DecodeLayout):
    """A bfloat16 weight [K, N] kept twice where the kernel's path reads bf16 [K, N] itself but
    bf16 prefill widens to float32 (avx512 without AVX512_BF16: `pack_params`): `w` its exact
    float32 widening for prefill's XLA matmuls, `bf16` the weight for decode's kernel. Prefill
    then converts no weight per call (without it, 64-token bf16 chunks ran at 0.58x float32's
    on such a CPU, benchmarks/README.md); decode streams the bf16 bytes as before. 6 bytes per
    weight instead of 2. Its dtype is the weight's, bfloat16."""

    fields = ("w", "bf16")

    def __init__(self, w, bf16):
        self.w, self.bf16 = w, bf16

    @property
    def dtype(self):
        return self.bf16.dtype

    def __repr__(self):
        return f"WidenedWeight(shape={self.shape}, dtype={self.dtype})"


@jax.tree_util.register_pytree_node_class
class TransposedWeight(_DecodeLayout):
    """A float32 weight [K, N] held transposed, `t` [N, K] (`pack_params`, where the kernel's path
    is in TRANSPOSED_ISAS): decode rows then read each output's weights as one contiguous row
    (the kernel's `transposed` path, dot products along K: 1.1-1.4x the [K, N] stream's bytes/s
    for one row, benchmarks/README.md), and prefill's XLA matmuls read `t` in place
    (x @ t.T: as fast as x @ w, no copy). The same memory as w. Its shape is the weight's, [K, N]."""

    fields = ("t",)

    def __init__(self, t):
        self.t = t

    @property
    def shape(self):
        return self.t.shape[::-1]

    def __repr__(self):
        return f"TransposedWeight(shape={self.shape}, dtype={self.dtype})"


@jax.tree_util.register_pytree_node_class
class Int8Weight(_DecodeLayout):
    """A weight [K, N] in int8, in one of two layouts (`quantize_params`); `hybridjax.ops.dense`
    takes it in place of w.

    int8-wo (weight-only): `q` [K, N] int8 with one float32 `scale` [N] per output column
    (`quantize_int8`), standing for `q * scale`. Decode rows stream q through the kernel's int8
    path (a quarter of float32's bytes); more rows run XLA's float32 matmul on q widened, the
    scale applied to the product.

    int8-dot: only `panels`, `panel_scales`: the weight quantised with a scale per column per
    block of X_BLOCK k (`quantize_int8_blocks`, as Q8_0), packed (`pack_int8`, float16
    `pack_block_scales`), 1 + 1/16 bytes per weight; q and scale are None and the shape [K, N]
    rides along as static data. Decode rows go to `matmul_q8`, which rounds the activations to
    int8 too and multiplies integers; more rows (prefill) dequantise the panels to float32 inside
    the step for XLA's matmul (`dequantize_int8_panels`), so both read the same weight."""

    fields = ("q", "scale", "panels", "panel_scales")

    def __init__(self, q=None, scale=None, panels=None, panel_scales=None, shape=None):
        self.q, self.scale, self.panels, self.panel_scales = q, scale, panels, panel_scales
        self._shape = None if shape is None else tuple(int(d) for d in shape)

    @classmethod
    def from_panels(cls, panels, panel_scales, shape):
        """The int8-dot layout: block-quantised panels of a [K, N] = `shape` weight, nothing else."""
        return cls(None, None, panels, panel_scales, shape)

    @property
    def is_dot(self) -> bool:
        return self.panels is not None

    @property
    def shape(self):
        return self._shape if self.q is None else self.q.shape

    @property
    def dtype(self):
        return jnp.dtype(jnp.int8)

    @property
    def ndim(self):
        return len(self.shape)

    def tree_flatten(self):
        # int8-dot's panels do not show K and N (both padded), so its shape is static aux data.
        return (self.q, self.scale, self.panels, self.panel_scales), (self._shape if self.q is None else None)

    @classmethod
    def tree_unflatten(cls, shape, children):
        return cls(*children, shape=shape)

    def __repr__(self):
        return f"Int8Weight(shape={self.shape}{', int8-dot' if self.is_dot else ''})"


def dequantize_int8(q, scale):
    """q [K, N] int8, scale [N] -> float32 [K, N] = q * scale (the weight an Int8Weight stands for)."""
    return q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)


def dequantize_int8_panels(p, s, k: int, n: int, block: int = X_BLOCK):
    """int8-dot's packed panels `p` and block scales `s` -> float32 [K, N]: the weight `matmul_q8`
    multiplies by (XLA fuses the unpacking, the widening and the scales into one pass)."""
    return dequantize_int8_blocks(unpack_int8(p, k, n), unpack_block_scales(s, n).astype(jnp.float32), block)


def is_weight_layout(x) -> bool:
    """Whether x is a weight kept in a layout of this module (a pytree leaf for tree walks)."""
    return isinstance(x, (PackedWeight, WidenedWeight, TransposedWeight, Int8Weight))


def plain_weight(w):
    """w's plain [K, N] array, whether it is one, a `PackedWeight`, or an `Int8Weight`
    (dequantised to float32: int8-dot's from its block-quantised panels)."""
    if isinstance(w, Int8Weight):
        if w.is_dot:
            return dequantize_int8_panels(w.panels, w.panel_scales, *w.shape)
        return dequantize_int8(w.q, w.scale)
    if isinstance(w, PackedWeight):
        return w.w if w.w.dtype == w.dtype else w.w.astype(w.dtype)  # prefill's float32 copy: exact
    if isinstance(w, WidenedWeight):
        return w.bf16
    if isinstance(w, TransposedWeight):
        return w.t.T
    return w


# The projections `hybridjax.ops.dense` reads, by parameter name (not the tied embedding: it is
# also a lookup table, and its head reads rows in place already; not experts: 3-d).
DENSE_WEIGHTS = frozenset({
    "in_qkv", "in_z", "in_b", "in_a", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down",
    "shared_gate", "router", "lm_head", "fc"})


def pack_params(params, force: bool = False):
    """params with every [K, N] projection (DENSE_WEIGHTS) in the layouts that make this CPU's
    decode and prefill fastest: bfloat16 ones at more memory, float32 ones (AVX2, AVX-512) in the same.
    Run once, when the params are placed (single device).

    float32, where the kernel's path is in TRANSPOSED_ISAS (AVX2, AVX-512): a `TransposedWeight`,
    held [N, K], so that decode reads each output's weights as one contiguous row (a float32
    decode step 1.2x faster, prefill alike: benchmarks/README.md). Nothing to change: params
    themselves.

    Where the kernel's path (`isa()`) streams packed panels fast (PACKED_ISAS: vdpbf16ps on
    avx512bf16; widened pairs on avx2), a `PackedWeight`: decode streams the panels. Where bf16
    prefill widens to float32 (`widen_bf16_prefill`: no bf16 dot instruction), prefill's copy is
    kept widened: XLA:CPU's convert runs single-threaded into fresh pages (0.4 G elements/s in a
    prefill), about half of bf16 prefill's gap to float32 (per round 0.87x -> 0.92x of float32's
    on AVX2); widened once here, prefill runs float32's matmuls on the same numbers
    (benchmarks/README.md). On avx512 without AVX512_BF16, whose [K, N] path decodes faster than
    panels read by AVX2 code, only that: a `WidenedWeight`. Elsewhere, or with the kernel off,
    params are returned as they are. `force` packs bf16 panels anyway (tests of the fallback)."""
    wide = widen_bf16_prefill()
    if force or (enabled() and isa() in PACKED_ISAS):
        def bf16_layout(w):
            return PackedWeight(w.astype(jnp.float32) if wide else w, _pack_bf16_jit(w))
    elif enabled() and isa() == "avx512" and wide:
        def bf16_layout(w):
            return WidenedWeight(w.astype(jnp.float32), w)
    else:
        bf16_layout = None
    f32_layout = (lambda w: TransposedWeight(_transpose_jit(w))) if enabled() and isa() in TRANSPOSED_ISAS else None
    layouts = {jnp.dtype(jnp.bfloat16): bf16_layout, jnp.dtype(jnp.float32): f32_layout}
    if not any(layouts.values()):
        return params

    def pack(path, leaf):
        name = getattr(path[-1], "name", None) if path else None
        layout = layouts.get(jnp.dtype(leaf.dtype)) if hasattr(leaf, "dtype") else None
        if name in DENSE_WEIGHTS and not is_weight_layout(leaf) and getattr(leaf, "ndim", 0) == 2 and layout:
            return layout(leaf)
        return leaf

    packed = jax.tree_util.tree_map_with_path(pack, params, is_leaf=is_weight_layout)
    unchanged = all(a is b for a, b in zip(jax.tree_util.tree_leaves(packed, is_leaf=is_weight_layout),
                                           jax.tree_util.tree_leaves(params, is_leaf=is_weight_layout)))
    return params if unchanged else packed


_transpose_jit = jax.jit(lambda w: w.T)  # a new [N, K] array, rows contiguous


def unpack_params(params):
    """The inverse of `pack_params`: every weight layout back to its plain [K, N] weight."""
    return jax.tree_util.tree_map(plain_weight, params, is_leaf=is_weight_layout)


def quantize_int8(w):
    """Weight-only int8 with one scale per output column: w [K, N] -> (q int8 [K, N], scale [N]).

    scale = max |w[:, n]| / 127, q = round(w / scale); columns of zeros get scale 1."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=0)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return q, scale


# What `quantize_params` quantises: the projections `dense` reads, but not the MoE router (a
# softmax over experts whose ranking a small error can flip; it is tiny) and not the embedding.
INT8_WEIGHTS = DENSE_WEIGHTS - {"router"}
# int8: this CPU's int8 decode (`int8_mode`); int8-wo: weight-only, x stays float (the kernel
# widens q); int8-dot: the weight quantised per column per block of 32 k, held only as packed
# panels, x rounded to int8 per block for integer dots.
QUANTIZE_MODES = ("int8", "int8-wo", "int8-dot")
# Paths on which "int8" means int8-dot: AVX2. There int8-dot has the accuracy (mean KL against float32
# on the 228M model 1.28-1.29e-3; weight-only 1.22e-3, llama.cpp's Q8_0 1.33e-3), decode at least as
# fast as weight-only int8 (1.01-1.13x in quiet runs; beside Q8_0 0.96-1.01x, weight-only's 0.82-0.95x),
# the memory (1 + 1/16 bytes per projection weight: the panels only) and, quiet, prefill near
# weight-only's (XLA on the panels dequantised in the step: 0.97-0.98x at 256 and 512 tokens, 0.81x at
# 64, where the per-call dequantisation weighs most; 0.82-0.89x under load). benchmarks/README.md,
# "int8-dot prefill from the panels". AVX-512 CPUs read the panels with the same AVX2 code, not
# measured against their own weight-only paths: they keep weight-only.
INT8_DOT_ISAS: tuple[str, ...] = ("avx2",)


def int8_mode(mode: str = "int8") -> str:
    """The concrete layout for a quantize mode: "int8" -> "int8-dot" where the kernel is enabled and
    its path (`isa()`) is in INT8_DOT_ISAS, else "int8-wo"; the explicit modes stay as they are."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantisation {mode!r}; valid: {', '.join(QUANTIZE_MODES)}")
    if mode != "int8":
        return mode
    return "int8-dot" if enabled() and isa() in INT8_DOT_ISAS else "int8-wo"

_quantize_int8_jit = jax.jit(quantize_int8)  # one compile per weight shape


@jax.jit
def _int8_dot_panels(w):
    q, d = quantize_int8_blocks(w)
    return pack_int8(q), pack_block_scales(d)


def quantize_params(params, mode: str = "int8"):
    """params with every 2-d projection in INT8_WEIGHTS as an `Int8Weight`, computed from the weight
    as loaded; `mode` as in QUANTIZE_MODES: int8-wo keeps int8 with a scale per output column,
    int8-dot only block-quantised packed panels (`Int8Weight`). Embeddings, norms, gates' biases,
    the router and MoE experts stay as they are. Single device (the kernel's)."""
    dot = int8_mode(mode) == "int8-dot"

    def quantize(path, leaf):
        name = getattr(path[-1], "name", None) if path else None
        if name in INT8_WEIGHTS and not is_weight_layout(leaf) and getattr(leaf, "ndim", 0) == 2:
            if dot:
                return Int8Weight.from_panels(*_int8_dot_panels(leaf), leaf.shape)
            return Int8Weight(*_quantize_int8_jit(leaf))
        return leaf

    return jax.tree_util.tree_map_with_path(quantize, params, is_leaf=is_weight_layout)
