"""Pallas paged-attention kernel for decode: a few queries per row over that row's pages.

Same contract as `reference.paged_attention_reference`; layout, grid and precision are in
README.md. `api.py` picks it (with implementation=None) when lowered for a GPU and T is at most
`MAX_DECODE_QUERIES`; any T works, but the blocking is tuned for decode.

Rows. The g = Hq / Hkv query heads of a kv head and the T queries of a row form one matrix of
M = T * g rows (row t * g + i is query t of head h * g + i), so each step of KB keys costs two
matrix-shaped dots, [BM, Dh] x [Dh, KB] and [BM, KB] x [KB, Dh] (Triton's `dot` needs >= 16 on
every side: M is zero-padded to a multiple of BM, a power of two >= 16; padded rows see no key).

Grid (B, Hkv * M / BM, splits). A program takes its share of the key blocks that hold visible
keys, n = (max position + KB) / KB (read in the kernel, so work follows real lengths, not the
table's width), finds each block's page through the page table, folds it into an online
softmax, and writes its unnormalised partial sum with its running max and denominator;
`_combine` (XLA) merges the splits (flash-decoding's split-K). Table entries are clamped to
[0, P), so garbage past a row's pages can never address memory outside the pool (and such
entries are never reached anyway). Block sizes and warps: `tiles`.

`interpret=None` follows the lowering platform (`jax.lax.platform_dependent`): the Pallas
interpreter on CPU, the compiled Triton kernel elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

f32 = jnp.float32

# implementation=None uses this kernel for up to this many queries per row (decode, speculative
# verification); longer inputs are prefill chunks, for which the XLA path is the one tuned.
MAX_DECODE_QUERIES = 16
# Split-K: aim for about one wave of programs on a large GPU (an H100 has 132 SMs) when
# B * Hkv alone is small, with at most MAX_SPLITS partial results per row to merge.
TARGET_PROGRAMS = 128
MAX_SPLITS = 16


def _pow2(n, lo=16):
    p = lo
    while p < n:
        p *= 2
    return p


def unsupported_reason(q_shape, page_shape):
    """Why the kernel cannot take these shapes (q [B, T, Hq, Dh], pages [P, S, Hkv, Dh]), or None.

    Triton tiles are powers of two >= 16 on the page (S) and head (Dh) axes, which live in the
    shared pool and cannot be padded per call without copying it."""
    s, dh = page_shape[1], page_shape[3]
    for name, n in (("page size S", s), ("head dim Dh", dh)):
        if n < 16 or n & (n - 1):
            return f"the Pallas kernel needs {name} to be a power of two >= 16, got {n}"
    return None


def default_splits(b, hkv, row_blocks, n_table):
    """Splits per (row, kv head, row block): enough programs for about one wave on a large GPU,
    at most MAX_SPLITS, never more than the table has pages."""
    programs = b * hkv * row_blocks
    return max(1, min(MAX_SPLITS, n_table, -(-TARGET_PROGRAMS // programs)))


@dataclasses.dataclass(frozen=True)
class Tiles:
    keys: int  # keys per loop step (KB): a page, or a slice of one
    rows: int  # query rows per program (BM), a power of two >= 16
    num_warps: int
    num_stages: int


def tiles(s, dh, rows, wide):
    """Block sizes and launch settings for pages of S keys, head dim Dh, `rows` = T * g query
    rows per (row, kv head); wide: float32 dots.

    Chosen by compiling offline for sm_90 and sm_89 (README's table): every supported shape
    compiles without spilling, within the 99 KB of shared memory sm_86/sm_89 give a block,
    with two pipeline stages (the next tile's loads in flight during this tile's dots).
    - 16-bit dots run on tensor cores over K (or V) tiles [KB, Dh] of up to 16 KB (64 keys of
      Dh = 128, 32 of Dh = 256) and up to 32 query rows; 8 warps when the float32
      accumulator [BM, Dh] passes 16 KB, 4 otherwise.
    - float32 dots are IEEE (no TF32), i.e. scalar FMAs holding both operands in registers:
      16 keys and up to 16 rows per step, 4 warps.
    """
    bm = min(_pow2(rows), 16 if wide else 32)
    if wide:
        return Tiles(keys=16, rows=bm, num_warps=4, num_stages=2)
    keys = max(16, min(s, 16 * 1024 // (2 * dh)))
    return Tiles(keys=keys, rows=bm, num_warps=8 if bm * dh * 4 > 16 * 1024 else 4, num_stages=2)


def _dot(a, b, *, trans_b=False):
    """2-D matmul accumulating in float32: 16-bit operands on tensor cores, float32 operands
    as IEEE float32 (no TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == f32 else jax.lax.Precision.DEFAULT
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=f32)


def _kernel(pos_ref, table_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *,
            scale, row_blocks, splits, kb):
    # blocks: pos [BM] int32, table [Np] int32, q [BM, Dh]; k, v the whole pool [P, S, Hkv, Dh]
    # -> acc [BM, Dh] float32 (unnormalised), m, l [BM] float32 (running max, denominator)
    h = jax.lax.div(pl.program_id(1), row_blocks)
    split = pl.program_id(2)
    n_pool, page = k_ref.shape[:2]
    per_page = page // kb  # key blocks of kb keys per page
    pos = pos_ref[...]  # [BM] absolute position of each query row; -1 for padding
    last = jnp.maximum(jnp.max(pos), -1)
    n = jnp.minimum(jax.lax.div(last + kb, kb), table_ref.shape[0] * per_page)  # blocks with visible keys
    share = jax.lax.div(n + splits - 1, splits)
    lo = split * share
    hi = jnp.minimum(n, lo + share)
    q = q_ref[...]
    key_offset = jax.lax.broadcasted_iota(jnp.int32, (1, kb), 1)  # [1, KB]

    def body(j, carry):
        m, l, acc = carry  # [BM], [BM], [BM, Dh]
        if per_page == 1:
            pid, keys = table_ref[j], pl.ds(0, kb)
        else:
            pid, keys = table_ref[jax.lax.div(j, per_page)], pl.ds(jax.lax.rem(j, per_page) * kb, kb)
        pid = jnp.clip(pid, 0, n_pool - 1)  # never outside the pool, whatever the table holds
        k = k_ref[pid, keys, h, :]  # [KB, Dh]
        v = v_ref[pid, keys, h, :]  # [KB, Dh]
        x = _dot(q, k.astype(q.dtype), trans_b=True) * scale  # [BM, KB]
        x = jnp.where(j * kb + key_offset <= pos[:, None], x, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing visible yet: keep exp finite
        p = jnp.exp(x - base[:, None])  # [BM, KB]
        rescale = jnp.exp(m - base)  # 0 while m is -inf
        l = l * rescale + jnp.sum(p, axis=1)
        acc = acc * rescale[:, None] + _dot(p.astype(v.dtype), v)  # [BM, Dh]
        return m_new, l, acc

    bm, dh = q.shape
    init = (jnp.full((bm,), -jnp.inf, f32), jnp.zeros((bm,), f32), jnp.zeros((bm, dh), f32))
    m, l, acc = jax.lax.fori_loop(lo, hi, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _partials(pos, table, q, k_pages, v_pages, *, scale, tile, splits, interpret):
    """pos [B, Mp], table [B, Np], q [B, Hkv, Mp, Dh] -> acc [B, Hkv, splits, Mp, Dh], m, l
    [B, Hkv, splits, Mp], all float32."""
    b, hkv, mp, dh = q.shape
    block_rows = tile.rows
    rb = mp // block_rows
    n_table = table.shape[1]
    kernel = functools.partial(_kernel, scale=scale, row_blocks=rb, splits=splits, kb=tile.keys)
    # grid axis 1 is (kv head, row block): hm = h * rb + r
    rows = lambda i, hm, s: (i, jax.lax.rem(hm, rb))  # noqa: E731
    q_block = lambda i, hm, s: (i, jax.lax.div(hm, rb), jax.lax.rem(hm, rb), 0)  # noqa: E731
    part = lambda i, hm, s: (i, jax.lax.div(hm, rb), s, jax.lax.rem(hm, rb))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(b, hkv * rb, splits),
        in_specs=[
            pl.BlockSpec((None, block_rows), rows),
            pl.BlockSpec((None, n_table), lambda i, hm, s: (i, 0)),
            pl.BlockSpec((None, None, block_rows, dh), q_block),
            pl.no_block_spec,  # the pool: pages are picked in the kernel through the table
            pl.no_block_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_rows, dh), lambda i, hm, s: (*part(i, hm, s), 0)),
            pl.BlockSpec((None, None, None, block_rows), part),
            pl.BlockSpec((None, None, None, block_rows), part),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, splits, mp, dh), f32),
            jax.ShapeDtypeStruct((b, hkv, splits, mp), f32),
            jax.ShapeDtypeStruct((b, hkv, splits, mp), f32),
        ],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages),
        name="paged_attention",
    )(pos, table, q, k_pages, v_pages)


def _combine(acc, m, l):
    """Merge split partials: acc [B, Hkv, splits, Mp, Dh], m, l [B, Hkv, splits, Mp] ->
    [B, Hkv, Mp, Dh] float32. A row that saw no key gets zeros."""
    top = jnp.max(m, axis=2, keepdims=True)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    w = jnp.exp(m - top)  # [B, Hkv, splits, Mp]; 0 for an empty split
    denom = jnp.sum(w * l, axis=2)
    num = jnp.sum(w[..., None] * acc, axis=2)
    return num / jnp.where(denom > 0, denom, 1.0)[..., None]


def paged_attention_pallas(q, k_pages, v_pages, page_table, q_pos, *, scale, splits=None, interpret=None):
    """Same contract as `reference.paged_attention_reference`.

    splits: programs per (row, kv head, row block) sharing a row's pages (split-K); None picks
    `default_splits`. interpret: True (interpreter), False (compiled Triton), None (by
    lowering platform: the interpreter on CPU, Triton elsewhere).
    """
    reason = unsupported_reason(q.shape, k_pages.shape)
    if reason:
        raise ValueError(reason)
    b, t, hq, dh = q.shape
    hkv = k_pages.shape[2]
    g = hq // hkv
    if t == 0:
        return jnp.zeros(q.shape, q.dtype)
    rows = t * g
    tile = tiles(k_pages.shape[1], dh, rows, wide=max(q.dtype.itemsize, k_pages.dtype.itemsize) >= 4)
    mp = -(-rows // tile.rows) * tile.rows
    # [B, T, Hq, Dh] -> [B, Hkv, T*g, Dh]: row t*g + i is query t of head h*g + i
    qh = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, dh)
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, mp - rows), (0, 0)))
    pos = jnp.pad(jnp.repeat(q_pos.astype(jnp.int32), g, axis=1), ((0, 0), (0, mp - rows)), constant_values=-1)
    splits = splits or default_splits(b, hkv, mp // tile.rows, page_table.shape[1])
    kw = dict(scale=float(scale), tile=tile, splits=splits)
    args = (pos, page_table.astype(jnp.int32), qh, k_pages, v_pages)
    if interpret is None:
        acc, m, l = jax.lax.platform_dependent(
            *args, cpu=functools.partial(_partials, interpret=True, **kw),
            default=functools.partial(_partials, interpret=False, **kw))
    else:
        acc, m, l = _partials(*args, interpret=interpret, **kw)
    out = _combine(acc, m, l)[:, :, :rows]  # [B, Hkv, T*g, Dh]
    return out.reshape(b, hkv, t, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, dh).astype(q.dtype)
