"""Pallas grouped-matmul kernel (Triton on a GPU, the Pallas interpreter on CPU for tests).

Same contract as `reference.gmm_reference`. Grid (tiles, N / BN): program (t, j) takes tile t
of `common.group_tiles` (BM rows of one group, aligned to the group's first row), loops over K
in BK blocks with [BM, BK] x [BK, BN] dots on its group's matrix, and stores the group's rows
(masked); tiles cover disjoint rows, so there are no write conflicts. Unused tiles (the static
bound exceeds the real count) store nothing. Rows no tile owns (past the groups) are zeroed
outside the kernel. Triton dots need every side >= 16: BM is the tile rows rounded up to a power
of two >= 16, and K, N must be multiples of 16 (`unsupported_reason`). float32 operands are
multiplied as IEEE float32 (Precision.HIGHEST), 16-bit ones on tensor cores; accumulation float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .common import group_tiles
from .xla import default_tile_rows

f32 = jnp.float32


def _pow2(n, lo=16):
    p = lo
    while p < n:
        p *= 2
    return p


def _block(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n (>= 16 when n is a multiple of 16)."""
    b = cap
    while n % b:
        b //= 2
    return b


def unsupported_reason(k: int, n: int):
    for name, v in (("K", k), ("N", n)):
        if v % 16:
            return f"the Pallas grouped matmul needs {name} to be a multiple of 16, got {v}"
    return None


def _kernel(start_ref, count_ref, group_ref, x_ref, w_ref, o_ref, *, bm, bk, bn, transpose_rhs):
    t, j = pl.program_id(0), pl.program_id(1)
    g = jnp.maximum(group_ref[t], 0)
    start, count = start_ref[t], count_ref[t]
    k = x_ref.shape[1]
    wide = x_ref.dtype == f32 or w_ref.dtype == f32
    precision = jax.lax.Precision.HIGHEST if wide else jax.lax.Precision.DEFAULT
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

    def body(i, acc):
        xb = x_ref[pl.ds(start, bm), pl.ds(i * bk, bk)]  # [BM, BK] (x is padded by BM rows)
        if transpose_rhs:
            wb = w_ref[g, pl.ds(j * bn, bn), pl.ds(i * bk, bk)]  # [BN, BK]
        else:
            wb = w_ref[g, pl.ds(i * bk, bk), pl.ds(j * bn, bn)]  # [BK, BN]
        if wide:
            xb, wb = xb.astype(f32), wb.astype(f32)
        return acc + jax.lax.dot_general(xb, wb, dims, precision=precision, preferred_element_type=f32)

    # An empty tile runs no step. (Not `jnp.where(count > 0, k // bk, 0)`: Pallas's Triton lowering
    # made that bound an i1, which XLA's Triton rejects on the GPU; JAX 0.11.2, H200.)
    steps = jnp.minimum(count, 1) * (k // bk)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), f32))
    mask = (jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < count)
    plt.store(o_ref.at[pl.ds(start, bm), pl.ds(j * bn, bn)], acc, mask=mask)


def _call(start, count, group, xp, w, *, bm, bk, bn, n, transpose_rhs, interpret):
    kernel = functools.partial(_kernel, bm=bm, bk=bk, bn=bn, transpose_rhs=transpose_rhs)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), f32),
        grid=(start.shape[0], n // bn),
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=4, num_stages=2),
    )(start, count, group, xp, w)


def gmm_pallas(x, w, group_sizes, *, transpose_rhs: bool = False, tile_rows: int | None = None,
               interpret: bool | None = None):
    """Same contract as `reference.gmm_reference`. interpret: True (interpreter), False (Triton),
    None (by lowering platform: the interpreter on CPU, Triton elsewhere)."""
    m, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    reason = unsupported_reason(k, n)
    if reason:
        raise ValueError(reason)
    wide = max(x.dtype.itemsize, w.dtype.itemsize) >= 4
    bm = min(_pow2(tile_rows or default_tile_rows(m, w.shape[0])), 32 if wide else 64)
    bk, bn = _block(k, 32 if wide else 64), _block(n, 32 if wide else 64)
    start, count, group = group_tiles(group_sizes, m, bm)
    xp = jnp.pad(x, ((0, bm), (0, 0)))  # a tile's loads past the last row stay in bounds
    kw = dict(bm=bm, bk=bk, bn=bn, n=n, transpose_rhs=transpose_rhs)
    args = (start, count, group, xp, w)
    if interpret is None:
        out = jax.lax.platform_dependent(*args, cpu=functools.partial(_call, interpret=True, **kw),
                                         default=functools.partial(_call, interpret=False, **kw))
    else:
        out = _call(*args, interpret=interpret, **kw)
    live = jnp.arange(m) < jnp.sum(group_sizes)
    return jnp.where(live[:, None], out[:m], 0.0)  # rows no tile owns hold garbage
