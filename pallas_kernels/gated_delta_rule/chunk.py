"""Pallas prefill path for the gated delta rule: three kernels over the chunked WY/UT form.

Same contract as `reference.recurrent_gated_delta_rule_reference`; the math is in README.md.
Stages, one `pallas_call` each (C = 64, D = 16 the solve's diagonal block, BK = 64 rows of K):

  1. `_intra_kernel`, grid (B, Hv, NC): per chunk, the gate cumsum b, the strictly lower
     A = beta k k^T exp(b_i - b_j) (one [C, K] x [K, C] MMA), (I + A)^{-1} blocked (D x D
     diagonal blocks by substitution, all four at once, then merged by four [C, C] MMAs), and
     wk = (I + A)^{-1} (beta exp(b) k), wv = (I + A)^{-1} (beta v).
  2. `_state_kernel`, grid (S, Hv, V / BV), one program per sequence: the only sequential part.
     Walks the sequence's chunks with the state held as K / BK float32 tiles [BK, BV] in
     registers: stores the chunk-entry state h_n, the chunk's writes u = wv - wk S, and moves S
     to the next chunk; returns the final state.
  3. `_output_kernel`, grid (B, Hv, NC, V / BV): o = exp(b) q h_n + P u, with
     P_ij = (q_i . k_j) exp(b_i - b_j), j <= i, accumulated over K in BK-column blocks.

Layouts: the kernels read q, k [B, T, Hk, K], v [B, T, Hv, V], g, beta [B, T, Hv] as given (a
BlockSpec index map sends value head h to key head h // r: no repeat in memory) and write
o [B, T, Hv, V] in v's dtype. Intermediates are [B, Hv, T, ...]. T is not padded: each kernel
sees the whole T axis and takes its rows from small int32 tables (`chunk_tables`: a chunk's
(start, end), a sequence's (start, end, first chunk)); rows past `end` are masked (zeros in,
nothing out), which is the zero-padding of README.md without the copies. The same tables pack
several sequences along T (`cu_seqlens`, fla's varlen). K and V are zero-padded to powers of
two >= 16 only when they are not already (Triton's `dot` needs >= 16 on every side).

Fused L2 norm (`normalize=True`): q and k stay in their input dtype in memory; each kernel sums
squares over the K blocks it loads and applies 1 / ||q_i||, 1 / ||k_j|| as row / column scales
of its products (exact algebra: (q_i / |q_i|) . (k_j / |k_j|) = (q_i . k_j) / (|q_i| |k_j|)).

Precision: `common.Policy` ("fast": matmul operands and w, u, h in the input dtype, TF32 for
float32 operands; "exact": IEEE float32 throughout). Gates, cumsums, norms, the solve's
substitution and the running state are float32 in both. Block sizes: `common.tuning()`.

`interpret=None` picks per lowering platform (`jax.lax.platform_dependent`): the Pallas
interpreter on CPU, the compiled Triton kernels elsewhere, so a module lowered for CUDA from a
CPU machine holds the real kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import (
    Policy,
    f32,
    inv_norm,
    load_rows,
    next_pow2,
    run_on_platform,
    store_rows,
    sum_sq,
    triton_params,
    tuning,
)

CHUNK_SIZE = 64
# Diagonal block of the blocked triangular solve (fla's 16).
SOLVE_BLOCK = 16


def _row_col(c):
    return (jax.lax.broadcasted_iota(jnp.int32, (c, c), 0),
            jax.lax.broadcasted_iota(jnp.int32, (c, c), 1))


def _decay(b, keep):
    """exp(b_i - b_j) where `keep`, exactly 0 elsewhere; the exponent is masked before exp."""
    return jnp.exp(jnp.where(keep, b[:, None] - b[None, :], -jnp.inf))


def unit_lower_inverse(a, pol, block=SOLVE_BLOCK):
    """(I + A)^{-1} for strictly lower-triangular A [C, C] in registers, blocked as in fla.

    1. Diagonal blocks: D = I + A_diag (D x D blocks) is inverted by forward substitution on
       M = D^{-1} - I, row i of every block in the same step (C / D blocks at once, D - 1 steps).
       Row i of block b only meets block b of M (M is block diagonal), so summing the selected
       rows of A into one vector s and reducing s^T M gives every block's new row at once.
    2. Merge: I + A = D (I + N) with N = D^{-1} E (E the strictly block-lower part) nilpotent of
       order C / D, so (I + A)^{-1} = (I - N + N^2 - ...) D^{-1}, in Horner form: C / D MMAs.
       That is block forward substitution (fla's merge), not a power series in A: N has only
       C / D - 1 nonzero powers.
    Substitution in float32 FMAs; the merge MMAs are TF32 (fast) or IEEE (exact).
    """
    c = a.shape[0]
    row, col = _row_col(c)
    same = (row // block) == (col // block)
    a_diag = jnp.where(same, a, 0.0)

    def body(i, m):
        pick = (row % block) == i
        s = jnp.sum(jnp.where(pick, a_diag, 0.0), axis=0)  # [C]: row i of each block
        new = -s - jnp.sum(s[:, None] * m, axis=0)  # [C]: each block's row i of -a - a M
        return jnp.where(pick & same, new[None, :], m)

    eye = jnp.where(row == col, 1.0, 0.0)
    d_inv = jax.lax.fori_loop(1, block, body, jnp.zeros_like(a)) + eye
    if c == block:
        return d_inv
    n = pol.dot_f32(d_inv, jnp.where(same, 0.0, a))  # [C, C] strictly block-lower
    x = eye - n
    for _ in range(c // block - 2):
        x = eye - pol.dot_f32(n, x)
    return pol.dot_f32(x, d_inv)


# ---- stage 1: in-chunk WY solve --------------------------------------------------------------


def _chunk_rows(chunk_ref):
    """(start, end) rows of this program's chunk: rows [start, start + C) below end are real."""
    j = pl.program_id(2)
    return chunk_ref[j, 0], chunk_ref[j, 1]


def _intra_kernel(chunk_ref, k_ref, v_ref, g_ref, beta_ref, wk_ref, wv_ref, *, c, pol, normalize):
    # refs: chunks [NC, 2]; k [T, K], v [T, V], g/beta [T] -> wk [T, K], wv [T, V]
    start, t = _chunk_rows(chunk_ref)
    k = load_rows(k_ref, start, c, t)  # input dtype
    beta = load_rows(beta_ref, start, c, t).astype(f32)
    # Cumsum in float32: only differences b_i - b_j are used and |b| can reach ~100.
    b = jnp.cumsum(load_rows(g_ref, start, c, t).astype(f32), axis=0)
    rk = inv_norm(sum_sq(k)) if normalize else jnp.ones_like(b)
    row, col = _row_col(c)
    kk = pol.dot(k, k, trans_b=True)  # [C, C]
    a = (beta * rk)[:, None] * kk * rk[None, :] * _decay(b, col < row)
    w = unit_lower_inverse(a, pol)
    # exp(b) <= 1: underflow only.
    wk_ref_rows = pol.dot(w, (beta * jnp.exp(b) * rk)[:, None] * k.astype(f32))  # [C, K]
    store_rows(wk_ref, start, t, wk_ref_rows)
    store_rows(wv_ref, start, t, pol.dot(w, beta[:, None] * load_rows(v_ref, start, c, t).astype(f32)))


# ---- stage 2: sequential state pass ----------------------------------------------------------


def _state_kernel(seq_ref, wk_ref, wv_ref, g_ref, k_ref, s0_ref, u_ref, h_ref, sn_ref, *, c, bk,
                  pol, normalize):
    # refs: seqs [S, 3] (start, end, first chunk); wk [T, K], wv [T, BV], g [T], k [T, K],
    # s0 [K, BV] -> u [T, BV], h [NC, K, BV], sn [K, BV]; the state is K / BK tiles [BK, BV]
    nk = k_ref.shape[1] // bk
    seq = pl.program_id(0)
    first, t, h0 = seq_ref[seq, 0], seq_ref[seq, 1], seq_ref[seq, 2]

    def body(i, s):
        start = first + i * c
        for j in range(nk):
            h_ref[h0 + i, pl.ds(j * bk, bk), :] = s[j].astype(h_ref.dtype)
        u = load_rows(wv_ref, start, c, t).astype(f32)  # [C, BV]
        for j in range(nk):
            u = u - pol.dot(load_rows(wk_ref, start, c, t, (j * bk, bk)), s[j])
        store_rows(u_ref, start, t, u)
        g = load_rows(g_ref, start, c, t).astype(f32)
        b = jnp.cumsum(g, axis=0)
        b_last = jnp.sum(g)  # = b[C - 1]: rows past T carry g = 0
        ks = [load_rows(k_ref, start, c, t, (j * bk, bk)) for j in range(nk)]
        row_scale = jnp.exp(b_last - b)  # exponent <= 0
        if normalize:
            row_scale = row_scale * inv_norm(sum(sum_sq(kj) for kj in ks))
        u_dec = u * row_scale[:, None]
        decay = jnp.exp(b_last)
        return tuple(decay * s[j] + pol.dot(ks[j], u_dec, trans_a=True) for j in range(nk))

    s0 = tuple(s0_ref[pl.ds(j * bk, bk), :].astype(f32) for j in range(nk))
    final = jax.lax.fori_loop(0, (t - first + c - 1) // c, body, s0)
    for j in range(nk):
        sn_ref[pl.ds(j * bk, bk), :] = final[j]


# ---- stage 3: output -------------------------------------------------------------------------


def _output_kernel(chunk_ref, q_ref, k_ref, g_ref, u_ref, h_ref, o_ref, *, c, bk, scale, pol,
                   normalize):
    # refs: chunks [NC, 2]; q, k [T, K], g [T], u [T, BV], h [K, BV] (this chunk's entry state)
    # -> o [T, BV]
    start, t = _chunk_rows(chunk_ref)
    nk = q_ref.shape[1] // bk
    bv = u_ref.shape[1]
    qk = jnp.zeros((c, c), f32)
    qh = jnp.zeros((c, bv), f32)
    sq = sk = jnp.zeros((c,), f32)
    for j in range(nk):
        qj = load_rows(q_ref, start, c, t, (j * bk, bk))
        kj = load_rows(k_ref, start, c, t, (j * bk, bk))
        qk = qk + pol.dot(qj, kj, trans_b=True)
        qh = qh + pol.dot(qj, h_ref[pl.ds(j * bk, bk), :])
        if normalize:
            sq, sk = sq + sum_sq(qj), sk + sum_sq(kj)
    rq = scale * inv_norm(sq) if normalize else jnp.full((c,), scale, f32)
    rk = inv_norm(sk) if normalize else jnp.ones((c,), f32)
    b = jnp.cumsum(load_rows(g_ref, start, c, t).astype(f32), axis=0)
    row, col = _row_col(c)
    p = rq[:, None] * qk * rk[None, :] * _decay(b, col <= row)  # [C, C] causal, decayed
    o = (rq * jnp.exp(b))[:, None] * qh + pol.dot(p, load_rows(u_ref, start, c, t))
    store_rows(o_ref, start, t, o)


# ---- the pipeline ----------------------------------------------------------------------------


def chunk_tables(T, c, batch, cu_seqlens=None):
    """Which rows each program works on (int32, computed in XLA, so lengths may be traced).

    Returns (chunks [NC, 2]: (start, end) per chunk program; seqs [S, 3]: (start, end, first
    chunk) per sequence). Without cu_seqlens every batch row is one sequence of T tokens
    (S = B, NC = ceil(T / C)). With cu_seqlens [N + 1] (B = 1, sequences packed along T), chunks
    never cross a sequence end and NC = ceil(T / C) + N - 1 bounds their count; programs past
    the last chunk get (0, 0): every load and store of theirs is masked off.
    """
    i32 = jnp.int32
    if cu_seqlens is None:
        n = -(-T // c)
        starts = jnp.arange(n, dtype=i32) * c
        chunks = jnp.stack([starts, jnp.full((n,), T, i32)], axis=1)
        seqs = jnp.tile(jnp.asarray([[0, T, 0]], i32), (batch, 1))
        return chunks, seqs
    cu = cu_seqlens.astype(i32)
    num = cu.shape[0] - 1
    n_chunks = (cu[1:] - cu[:-1] + c - 1) // c  # [N]
    first = jnp.cumsum(n_chunks) - n_chunks  # [N] exclusive
    nc = -(-T // c) + num - 1
    p = jnp.arange(nc, dtype=i32)
    seq = jnp.clip(jnp.searchsorted(first + n_chunks, p, side="right"), 0, num - 1).astype(i32)
    live = p < jnp.sum(n_chunks)
    start = jnp.where(live, cu[seq] + (p - first[seq]) * c, 0)
    end = jnp.where(live, cu[seq + 1], 0)
    chunks = jnp.stack([start, end], axis=1)
    seqs = jnp.stack([cu[:-1], cu[1:], first.astype(i32)], axis=1)
    return chunks, seqs


def _per_value_head(x, r):
    """[B, T, Hk] -> [B, Hv, T]: value head h reads key head h // r."""
    return jnp.repeat(jnp.moveaxis(x, 2, 1), r, axis=1)


def _mosaic_forward(q, k, v, g, beta, s0, *, scale, normalize, interpret):
    """All three stages on Mosaic GPU (mosaic.py), bfloat16 "fast", T a multiple of C, no packing.
    XLA computes only the per-row scalars (gate cumsums, norms: O(T) each, no Mosaic GPU cumsum)."""
    from . import mosaic

    B, T, Hk, _ = q.shape
    r = v.shape[2] // Hk
    q, k = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    if normalize:
        rq = _per_value_head(scale * inv_norm(sum_sq(q)), r)
        rk = _per_value_head(inv_norm(sum_sq(k)), r)
    else:
        rq, rk = (jnp.full((B, v.shape[2], T), x, f32) for x in (scale, 1.0))
    wk, wv = mosaic.intra_mosaic(k, v, mosaic.intra_vectors(g, beta, rk), r=r, interpret=interpret)
    row_scale, chunk_decay = mosaic.gate_scales(g)  # [B, Hv, T], [B, Hv, NC]
    u, h, final = mosaic.state_pass_mosaic(wk, wv, k, row_scale * rk, chunk_decay, s0, interpret=interpret)
    o = mosaic.output_mosaic(q, k, u, h, mosaic.output_vectors(g, rq, rk), out_dtype=v.dtype,
                             interpret=interpret)
    return o, final


def _forward(chunks, seqs, q, k, v, g, beta, s0, *, scale, chunk_size, pol, normalize,
             interpret, kernels="triton"):
    """q, k [B, T, Hk, K], v [B, T, Hv, V], g, beta [B, T, Hv], s0 [S, Hv, K, V] float32 (S
    sequences: B, or the packed ones when B = 1), with K, V powers of two >= 16, and the
    `chunk_tables`. Returns (o [B, T, Hv, V], final state [S, Hv, K, V])."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    r, c = Hv // Hk, chunk_size
    nc, S = chunks.shape[0], seqs.shape[0]
    packed = S != B  # varlen: every sequence lives in batch row 0
    tune = tuning()
    bk = min(K, tune.block_k)
    call = functools.partial(pl.pallas_call, interpret=interpret)
    sds = jax.ShapeDtypeStruct
    io = pol.dtype
    kw = dict(c=c, pol=pol, normalize=normalize)
    row = (lambda i: 0) if packed else (lambda i: i)  # noqa: E731  batch row of program i
    key = lambda i, h, *_: (row(i), 0, h // r, 0)  # noqa: E731  [T, K] of head h's key head
    per_head = lambda i, h, *_: (row(i), 0, h)  # noqa: E731  [T] of g or beta
    whole = lambda *_: (0, 0)  # noqa: E731  the small index tables
    if kernels == "mosaic":  # the caller made T a multiple of C; no packing
        return _mosaic_forward(q, k, v, g, beta, s0, scale=scale, normalize=normalize, interpret=interpret)

    wk, wv = call(
        functools.partial(_intra_kernel, **kw),
        grid=(B, Hv, nc),
        in_specs=[
            pl.BlockSpec(chunks.shape, whole),
            pl.BlockSpec((None, T, None, K), key),
            pl.BlockSpec((None, T, None, V), lambda i, h, j: (i, 0, h, 0)),
            pl.BlockSpec((None, T, None), per_head),
            pl.BlockSpec((None, T, None), per_head),
        ],
        out_specs=[
            pl.BlockSpec((None, None, T, K), lambda i, h, j: (i, h, 0, 0)),
            pl.BlockSpec((None, None, T, V), lambda i, h, j: (i, h, 0, 0)),
        ],
        out_shape=[sds((B, Hv, T, K), io), sds((B, Hv, T, V), io)],
        compiler_params=triton_params(tune.intra_warps, tune.stages),
        name="gdr_intra",
    )(chunks, k, v, g, beta)

    bv = min(V, tune.state_bv)
    n_h = nc if packed else -(-T // c)  # chunk states per batch row
    u, h, final = call(
        functools.partial(_state_kernel, bk=bk, **kw),
        grid=(S, Hv, V // bv),
        in_specs=[
            pl.BlockSpec(seqs.shape, whole),
            pl.BlockSpec((None, None, T, K), lambda i, h, j: (row(i), h, 0, 0)),
            pl.BlockSpec((None, None, T, bv), lambda i, h, j: (row(i), h, 0, j)),
            pl.BlockSpec((None, T, None), per_head),
            pl.BlockSpec((None, T, None, K), key),
            pl.BlockSpec((None, None, K, bv), lambda i, h, j: (i, h, 0, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, T, bv), lambda i, h, j: (row(i), h, 0, j)),
            pl.BlockSpec((None, None, n_h, K, bv), lambda i, h, j: (row(i), h, 0, 0, j)),
            pl.BlockSpec((None, None, K, bv), lambda i, h, j: (i, h, 0, j)),
        ],
        out_shape=[sds((B, Hv, T, V), io), sds((B, Hv, n_h, K, V), io), sds((S, Hv, K, V), f32)],
        compiler_params=triton_params(tune.state_warps, tune.stages),
        name="gdr_state",
    )(seqs, wk, wv, g, k, s0)

    bv = min(V, tune.output_bv)
    o = call(
        functools.partial(_output_kernel, bk=bk, scale=scale, **kw),
        grid=(B, Hv, nc, V // bv),
        in_specs=[
            pl.BlockSpec(chunks.shape, whole),
            pl.BlockSpec((None, T, None, K), key),
            pl.BlockSpec((None, T, None, K), key),
            pl.BlockSpec((None, T, None), per_head),
            pl.BlockSpec((None, None, T, bv), lambda i, h, j, m: (i, h, 0, m)),
            pl.BlockSpec((None, None, None, K, bv), lambda i, h, j, m: (i, h, j, 0, m)),
        ],
        out_specs=pl.BlockSpec((None, T, None, bv), lambda i, h, j, m: (i, 0, h, m)),
        out_shape=sds((B, T, Hv, V), v.dtype),
        compiler_params=triton_params(tune.output_warps, tune.stages),
        name="gdr_output",
    )(chunks, q, k, g, u, h)
    return o, final


def _pad_to(x, axis, size):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def pad_heads(q, k, v, initial_state, num_states):
    """Zero-pad K and V to powers of two >= 16 (no copy when they already are; T never).

    Returns (q, k, v, state float32 [num_states, Hv, K', V'], zeros if None)."""
    K = q.shape[3]
    Hv, V = v.shape[2], v.shape[3]
    kp, vp = next_pow2(K), next_pow2(V)
    if initial_state is None:
        s0 = jnp.zeros((num_states, Hv, kp, vp), f32)
    else:
        s0 = _pad_to(_pad_to(initial_state.astype(f32), 2, kp), 3, vp)
    q, k = (_pad_to(x, 3, kp) for x in (q, k))
    return q, k, _pad_to(v, 3, vp), s0


def chunk_gated_delta_rule_pallas(
    q, k, v, g, beta, *, scale, initial_state=None, chunk_size=CHUNK_SIZE, interpret=None,
    normalize=False, precision="fast", cu_seqlens=None, kernels="triton",
):
    """Chunked gated delta rule in Pallas; same contract as the reference.

    Args:
      q, k: [B, T, Hk, K]; v: [B, T, Hv, V] with Hv % Hk == 0; g, beta: [B, T, Hv].
      scale: python float multiplying q (after the norm). initial_state: [B, Hv, K, V] or None.
      chunk_size: python int, a power of two, 16 <= chunk_size <= 64.
      interpret: True (interpreter), False (compiled Triton), None (by lowering platform).
      normalize: L2-normalise q and k inside the kernels (fla's use_qk_l2norm_in_kernel).
      precision: "fast" (tensor cores, input-dtype intermediates) or "exact" (IEEE float32).
      cu_seqlens: None, or int32 [N + 1] with B = 1: N sequences packed along T (sequence i is
        rows cu_seqlens[i]:cu_seqlens[i + 1], increasing, cu_seqlens[0] = 0, [-1] = T), each
        with its own state: initial_state and the final state are then [N, Hv, K, V].
      kernels: "triton", or "mosaic" (JAX 0.11+: all three stages on Pallas Mosaic GPU,
        mosaic.py; "fast" policy in bfloat16, chunk_size 64, no cu_seqlens; T is zero-padded to
        whole chunks, which changes nothing: g = 0 and k = 0 there).

    Returns:
      (o [B, T, Hv, V] in v's dtype, final_state [B or N, Hv, K, V] float32).
    """
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be a power of two in [16, 64], got {chunk_size}")
    pol = Policy.make(precision, v.dtype)
    num_states = B
    if cu_seqlens is not None:
        if B != 1 or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError("cu_seqlens needs B = 1 and shape [N + 1], N >= 1; got "
                             f"B = {B}, cu_seqlens {tuple(cu_seqlens.shape)}")
        num_states = cu_seqlens.shape[0] - 1
    if T == 0:
        s = (jnp.zeros((num_states, Hv, K, V), f32) if initial_state is None
             else initial_state.astype(f32))
        return jnp.zeros((B, 0, Hv, V), v.dtype), s
    q, k, v, s0 = pad_heads(q, k, v, initial_state, num_states)
    if kernels == "mosaic":
        if cu_seqlens is not None or chunk_size != 64 or pol.exact or v.dtype != jnp.bfloat16:
            raise ValueError("kernels='mosaic' needs bfloat16 inputs, precision 'fast', "
                             "chunk_size 64 and no cu_seqlens")
        t_pad = -(-T // chunk_size) * chunk_size
        q, k, v, g, beta = (_pad_to(x, 1, t_pad) for x in (q, k, v, g, beta))
    chunks, seqs = chunk_tables(q.shape[1], chunk_size, B, cu_seqlens)
    fwd = functools.partial(_forward, scale=scale, chunk_size=chunk_size, pol=pol,
                            normalize=normalize, kernels=kernels)
    o, final = run_on_platform(fwd, interpret, chunks, seqs, q, k, v, g, beta, s0)
    return o[:, :T, :, :V], final[:, :, :K, :V]
