"""Pallas prefill path for the gated delta rule: three kernels over the chunked WY/UT form.

Same contract as `reference.recurrent_gated_delta_rule_reference`; the math is in README.md.
Stages, one `pallas_call` each (C = chunk size, all block sizes powers of two):

  1. `_intra_kernel`, grid (B, Hv, N): per chunk, the gate cumsum b, the strictly lower
     A = beta k k^T exp(b_i - b_j), (I + A)^{-1} by forward substitution, and
     wk = (I + A)^{-1} (beta exp(b) k), wv = (I + A)^{-1} (beta v).
  2. `_state_kernel`, grid (B, Hv, V / BV): the only sequential part. Walks the N chunks with
     the state tile S [K, BV] in registers: stores the chunk-entry state h_n, the chunk's writes
     u = wv - wk S, and moves S to the next chunk; returns the final state.
  3. `_output_kernel`, grid (B, Hv, N): o = exp(b) q h_n + P u with the causal in-chunk
     decay-masked P_ij = (q_i . k_j) exp(b_i - b_j), j <= i.

Layouts: the kernels read q, k [B, T, Hk, K], v [B, T, Hv, V], g, beta [B, T, Hv] as given
(a BlockSpec index map sends value head h to key head h // r: no repeat in memory) and write
o [B, T, Hv, V] in v's dtype. Intermediates are [B, Hv, T, ...] so a chunk is one contiguous
tile. T is zero-padded to a multiple of C (pads decay by exp(0) = 1 and write 0), K and V to
powers of two >= 16 (Triton's `dot` needs >= 16 on every side; zero columns change nothing).

Precision: 16-bit inputs are upcast inside the kernels; every product accumulates in float32
with IEEE float32 dots (`Precision.HIGHEST`), the state and h are float32.

`interpret=None` picks per lowering platform (`jax.lax.platform_dependent`): the Pallas
interpreter on CPU, the compiled Triton kernels elsewhere, so a module lowered for CUDA from a
CPU machine holds the real kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

CHUNK_SIZE = 64
# Value-tile width of the state pass: the [K, BV] float32 state lives in registers.
BLOCK_V = 64

_PRECISION = jax.lax.Precision.HIGHEST
f32 = jnp.float32


def next_pow2(n, lo=16):
    """Smallest power of two >= max(n, lo)."""
    p = lo
    while p < n:
        p *= 2
    return p


def triton_params(num_warps=4, num_stages=2):
    """Selects Pallas' Triton backend (not Mosaic GPU) when lowered for a GPU."""
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot(a, b, *, trans_a=False, trans_b=False):
    """2-D matmul accumulating in float32 with IEEE float32 inputs (no TF32)."""
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=_PRECISION,
                               preferred_element_type=f32)


def _row_index(c):
    return jax.lax.broadcasted_iota(jnp.int32, (c, c), 0), jax.lax.broadcasted_iota(
        jnp.int32, (c, c), 1
    )


def _decay(b, keep):
    """exp(b_i - b_j) where `keep`, exactly 0 elsewhere; the exponent is masked before exp."""
    return jnp.exp(jnp.where(keep, b[:, None] - b[None, :], -jnp.inf))


def unit_lower_inverse(a):
    """(I + A)^{-1} for strictly lower-triangular A [C, C] held in registers.

    Forward substitution on M = (I + A)^{-1} - I: row i is -a_i - a_i M, and a_i only reaches
    rows j < i of M, which are final. Rows are picked and replaced with iota masks, not dynamic
    indexing, so this lowers to Triton (where a register tile cannot be indexed).
    """
    c = a.shape[0]
    row, col = _row_index(c)

    def body(i, m):
        a_i = jnp.sum(jnp.where(row == i, a, 0.0), axis=0)  # [C] row i of A
        m_i = -a_i - jnp.sum(a_i[:, None] * m, axis=0)  # [C]: -a_i - a_i @ M
        return jnp.where(row == i, m_i[None, :], m)

    m = jax.lax.fori_loop(1, c, body, jnp.zeros_like(a))
    return m + jnp.where(row == col, 1.0, 0.0)


# ---- stage 1: in-chunk WY solve --------------------------------------------------------------


def _intra_kernel(k_ref, v_ref, g_ref, beta_ref, wk_ref, wv_ref, b_ref):
    # blocks: k [C, K], v [C, V], g/beta [C] -> wk [C, K], wv [C, V], b [C]
    k = k_ref[...].astype(f32)
    v = v_ref[...].astype(f32)
    beta = beta_ref[...].astype(f32)
    # Cumsum in float32: only differences b_i - b_j are used and |b| can reach ~100.
    b = jnp.cumsum(g_ref[...].astype(f32), axis=0)
    c = k.shape[0]
    row, col = _row_index(c)
    a = beta[:, None] * dot(k, k, trans_b=True) * _decay(b, col < row)  # [C, C]
    w = unit_lower_inverse(a)
    wk_ref[...] = dot(w, (beta * jnp.exp(b))[:, None] * k)  # exp(b) <= 1: underflow only
    wv_ref[...] = dot(w, beta[:, None] * v)
    b_ref[...] = b


# ---- stage 2: sequential state pass ----------------------------------------------------------


def _last(x):
    """x[-1] of a register vector, by a masked sum (Triton cannot index a tile)."""
    idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(idx == x.shape[0] - 1, x, 0.0))


def _state_kernel(wk_ref, wv_ref, b_ref, k_ref, s0_ref, u_ref, h_ref, sn_ref, *, c, n):
    # blocks: wk [T, K], wv [T, BV], b [T], k [T, K], s0 [K, BV]
    #      -> u [T, BV], h [N, K, BV], sn [K, BV]
    def body(i, s):
        t = pl.ds(pl.multiple_of(i * c, c), c)
        h_ref[i] = s
        u = wv_ref[t, :] - dot(wk_ref[t, :], s)  # [C, BV]
        u_ref[t, :] = u
        b = b_ref[t]
        b_last = _last(b)
        k_dec = k_ref[t, :].astype(f32) * jnp.exp(b_last - b)[:, None]  # exponent <= 0
        return jnp.exp(b_last) * s + dot(k_dec, u, trans_a=True)  # [K, BV]

    sn_ref[...] = jax.lax.fori_loop(0, n, body, s0_ref[...].astype(f32))


# ---- stage 3: output -------------------------------------------------------------------------


def _output_kernel(q_ref, k_ref, b_ref, u_ref, h_ref, o_ref, *, scale):
    # blocks: q, k [C, K], b [C], u [C, V], h [K, V] -> o [C, V]
    q = q_ref[...].astype(f32) * scale
    k = k_ref[...].astype(f32)
    b = b_ref[...]
    row, col = _row_index(q.shape[0])
    p = dot(q, k, trans_b=True) * _decay(b, col <= row)  # [C, C] causal, decayed
    o = dot(q * jnp.exp(b)[:, None], h_ref[...]) + dot(p, u_ref[...])
    o_ref[...] = o.astype(o_ref.dtype)


# ---- the pipeline ----------------------------------------------------------------------------


def _pad_to(x, axis, size):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _forward(q, k, v, g, beta, s0, *, scale, chunk_size, interpret):
    """Padded inputs: q, k [B, T, Hk, K], v [B, T, Hv, V], g, beta [B, T, Hv], s0 [B, Hv, K, V]
    float32, with T % C == 0 and K, V powers of two. Returns (o [B, T, Hv, V], final)."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    r, c = Hv // Hk, chunk_size
    n = T // c
    bv = min(V, BLOCK_V)
    call = functools.partial(pl.pallas_call, interpret=interpret)
    sds = jax.ShapeDtypeStruct

    wk, wv, b = call(
        _intra_kernel,
        grid=(B, Hv, n),
        in_specs=[
            pl.BlockSpec((None, c, None, K), lambda i, h, j: (i, j, h // r, 0)),
            pl.BlockSpec((None, c, None, V), lambda i, h, j: (i, j, h, 0)),
            pl.BlockSpec((None, c, None), lambda i, h, j: (i, j, h)),
            pl.BlockSpec((None, c, None), lambda i, h, j: (i, j, h)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, c, K), lambda i, h, j: (i, h, j, 0)),
            pl.BlockSpec((None, None, c, V), lambda i, h, j: (i, h, j, 0)),
            pl.BlockSpec((None, None, c), lambda i, h, j: (i, h, j)),
        ],
        out_shape=[sds((B, Hv, T, K), f32), sds((B, Hv, T, V), f32), sds((B, Hv, T), f32)],
        compiler_params=triton_params(num_warps=8),
        name="gdr_intra",
    )(k, v, g, beta)

    u, h, final = call(
        functools.partial(_state_kernel, c=c, n=n),
        grid=(B, Hv, V // bv),
        in_specs=[
            pl.BlockSpec((None, None, T, K), lambda i, h, j: (i, h, 0, 0)),
            pl.BlockSpec((None, None, T, bv), lambda i, h, j: (i, h, 0, j)),
            pl.BlockSpec((None, None, T), lambda i, h, j: (i, h, 0)),
            pl.BlockSpec((None, T, None, K), lambda i, h, j: (i, 0, h // r, 0)),
            pl.BlockSpec((None, None, K, bv), lambda i, h, j: (i, h, 0, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, T, bv), lambda i, h, j: (i, h, 0, j)),
            pl.BlockSpec((None, None, n, K, bv), lambda i, h, j: (i, h, 0, 0, j)),
            pl.BlockSpec((None, None, K, bv), lambda i, h, j: (i, h, 0, j)),
        ],
        out_shape=[
            sds((B, Hv, T, V), f32),
            sds((B, Hv, n, K, V), f32),
            sds((B, Hv, K, V), f32),
        ],
        compiler_params=triton_params(num_warps=4),
        name="gdr_state",
    )(wk, wv, b, k, s0)

    o = call(
        functools.partial(_output_kernel, scale=scale),
        grid=(B, Hv, n),
        in_specs=[
            pl.BlockSpec((None, c, None, K), lambda i, h, j: (i, j, h // r, 0)),
            pl.BlockSpec((None, c, None, K), lambda i, h, j: (i, j, h // r, 0)),
            pl.BlockSpec((None, None, c), lambda i, h, j: (i, h, j)),
            pl.BlockSpec((None, None, c, V), lambda i, h, j: (i, h, j, 0)),
            pl.BlockSpec((None, None, None, K, V), lambda i, h, j: (i, h, j, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, c, None, V), lambda i, h, j: (i, j, h, 0)),
        out_shape=sds((B, T, Hv, V), v.dtype),
        compiler_params=triton_params(num_warps=4),
        name="gdr_output",
    )(q, k, b, u, h)
    return o, final


def run_on_platform(fn, interpret, *args):
    """Run fn(*args, interpret=...): None follows the lowering platform (interpreter on CPU)."""
    if interpret is not None:
        return fn(*args, interpret=interpret)
    return jax.lax.platform_dependent(
        *args,
        cpu=functools.partial(fn, interpret=True),
        default=functools.partial(fn, interpret=False),
    )


def pad_inputs(q, k, v, g, beta, initial_state, t_multiple):
    """Zero-pad T to a multiple of t_multiple and K, V to powers of two >= 16.

    Returns the padded (q, k, v, g, beta, state) with state float32 (zeros if None)."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    kp, vp = next_pow2(K), next_pow2(V)
    tp = -(-T // t_multiple) * t_multiple
    if initial_state is None:
        s0 = jnp.zeros((B, Hv, kp, vp), f32)
    else:
        s0 = _pad_to(_pad_to(initial_state.astype(f32), 2, kp), 3, vp)
    q, k = (_pad_to(_pad_to(x, 1, tp), 3, kp) for x in (q, k))
    v = _pad_to(_pad_to(v, 1, tp), 3, vp)
    g, beta = (_pad_to(x, 1, tp) for x in (g, beta))
    return q, k, v, g, beta, s0


def chunk_gated_delta_rule_pallas(
    q, k, v, g, beta, *, scale, initial_state=None, chunk_size=CHUNK_SIZE, interpret=None
):
    """Chunked gated delta rule in Pallas; same contract as the reference.

    Args:
      q, k: [B, T, Hk, K]; v: [B, T, Hv, V] with Hv % Hk == 0; g, beta: [B, T, Hv].
      scale: python float multiplying q. initial_state: [B, Hv, K, V] or None (zeros).
      chunk_size: python int, a power of two >= 16.
      interpret: True (interpreter), False (compiled Triton), None (by lowering platform).

    Returns:
      (o [B, T, Hv, V] in v's dtype, final_state [B, Hv, K, V] float32).
    """
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    if T == 0:
        s = jnp.zeros((B, Hv, K, V), f32) if initial_state is None else initial_state.astype(f32)
        return jnp.zeros((B, 0, Hv, V), v.dtype), s
    padded = pad_inputs(q, k, v, g, beta, initial_state, chunk_size)
    fwd = functools.partial(_forward, scale=scale, chunk_size=chunk_size)
    o, final = run_on_platform(fwd, interpret, *padded)
    return o[:, :T, :, :V], final[:, :, :K, :V]
