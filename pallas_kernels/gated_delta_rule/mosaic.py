"""The chunked delta rule's forward as Pallas Mosaic GPU kernels (Hopper, JAX 0.11+).

The three stages of chunk.py, for equal-length rows (no `cu_seqlens`), T a multiple of the chunk
C = 64 and the "fast" policy (bfloat16 operands, float32 accumulators), one warpgroup each:

  `intra_mosaic` (stage 1, grid B x Hv x NC): A = beta k k^T decayed, W = (I + A)^{-1} by
      recursive block inversion, wk = W (beta exp(b) k), wv = W (beta v).
  `state_pass_mosaic` (stage 2, grid B x Hv x V / BV), the only sequential part:
      for each chunk n:   h[n] = S                                  (chunk-entry state, stored)
                          u    = wv - wk S                           [C, BV]   (one WGMMA)
                          S    = exp(b_last) S + k^T (u * exp(b_last - b))   (one WGMMA, k^T from SMEM)
      The state S [K, BV] float32 stays in registers in the WGMMA accumulator layout for the
      whole sequence; wk, k, wv arrive by TMA, two chunks in flight.
  `output_mosaic` (stage 3, grid B Hv x NC x V / BV): o = exp(b) q h_n + P u, P causal, decayed.

q, k [B, T, Hk, K] and v [B, T, Hv, V] are read in place (value head h reads key head h // r);
o is written in place. Per-row scalars (gate cumsums, L2 norms) come from XLA: Mosaic GPU has no
register cumsum, and they are O(T) (`gate_scales`, `intra_vectors`, `output_vectors`).

Checked without a GPU: on CPU with Pallas' GPU interpreter (`InterpretGPUParams`) against plain
JAX / numpy and the Triton kernels' path (tests/test_mosaic.py), and lowered for CUDA (three
`mosaic_gpu_v2` custom calls, WGMMAs counted); see README.md for what that does and does not prove.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # JAX 0.11 is where Pallas Mosaic GPU is current (and has a GPU interpreter)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    AVAILABLE = hasattr(plgpu, "InterpretGPUParams")
except ImportError:  # pragma: no cover - older JAX
    plgpu, AVAILABLE = None, False

CHUNK = 64  # C: one 64-row WGMMA
BLOCK_V = 64  # BV: value columns per program
STAGES = 2  # chunks in flight


def gate_scales(g, c=CHUNK):
    """From g [B, T, Hv] (T a multiple of c): row_scale [B, Hv, T] = exp(b_last - b_t) within each
    chunk and chunk_decay [B, Hv, NC] = exp(b_last), b the in-chunk cumsum (float32; exponents
    <= 0)."""
    B, T, Hv = g.shape
    gc = jnp.moveaxis(g.astype(jnp.float32), 2, 1).reshape(B, Hv, T // c, c)
    b = jnp.cumsum(gc, axis=-1)
    b_last = b[..., -1:]
    return jnp.exp(b_last - b).reshape(B, Hv, T), jnp.exp(b_last[..., 0])


def _wgmma(a, b, shape):
    """a @ b (SMEM operands) on one WGMMA into a fresh float32 accumulator of `shape`, read out."""
    def run(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _swizzled(shape, dtype):
    """An SMEM buffer that WGMMA and TMA read: 8-row tiles, 128-byte swizzle."""
    elems = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128)))


def state_pass_mosaic(wk, wv, k, row_scale, chunk_decay, s0, *, interpret=False):
    """wk [B, Hv, T, K], wv [B, Hv, T, V] bfloat16 (stage 1's outputs); k [B, T, Hk, K] bfloat16,
    already L2-normalised if the model normalises; row_scale [B, Hv, T], chunk_decay [B, Hv, NC]
    (`gate_scales`); s0 [B, Hv, K, V] float32. Returns (u [B, Hv, T, V] bfloat16, h [B, Hv, NC, K, V]
    bfloat16 chunk-entry states, final state [B, Hv, K, V] float32)."""
    B, Hv, T, K = wk.shape
    V, Hk = wv.shape[-1], k.shape[2]
    r, c, bv, nc = Hv // Hk, CHUNK, BLOCK_V, T // CHUNK
    if T % c or K % 64 or V % bv or wk.dtype != jnp.bfloat16:
        raise ValueError(f"mosaic state pass: T % {c} == 0, K % 64 == 0, V % {bv} == 0 and bfloat16 "
                         f"operands; got T={T}, K={K}, V={V}, {wk.dtype}")
    decay_rows = jnp.broadcast_to(chunk_decay[..., None], (B, Hv, nc, K))  # a row vector per chunk
    bf16, f32 = jnp.bfloat16, jnp.float32

    def body(wk_ref, wv_ref, k_ref, rs_ref, dec_ref, s0_ref, u_ref, h_ref, sn_ref,
             wk_smem, wv_smem, k_smem, rs_smem, dec_smem, s_smem, u_smem, sn_smem, loaded, s0_loaded):
        b, h, j = (jax.lax.axis_index(n) for n in ("b", "h", "j"))
        cols = pl.ds(j * bv, bv)

        def load(n, slot):
            rows = pl.ds(n * c, c)
            bar = loaded.at[slot]
            plgpu.copy_gmem_to_smem(wk_ref.at[b, h, rows], wk_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(wv_ref.at[b, h, rows, cols], wv_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h // r], k_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(rs_ref.at[b, h, rows], rs_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(dec_ref.at[b, h, n], dec_smem.at[slot], bar)

        for n in range(min(STAGES, nc)):
            load(n, n)
        plgpu.copy_gmem_to_smem(s0_ref.at[b, h, :, cols], sn_smem, s0_loaded)
        plgpu.barrier_wait(s0_loaded)
        s = plgpu.load(sn_smem, layout=plgpu.Layout.WGMMA)  # [K, BV] float32, registers

        def chunk(n, s):
            slot = jax.lax.rem(n, STAGES)
            plgpu.barrier_wait(loaded.at[slot])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last chunk's stores have read s_smem, u_smem
            s_smem[...] = s.astype(bf16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_smem, h_ref.at[b, h, n, :, cols])

            def wk_s(acc):  # [C, K] x [K, BV]
                plgpu.wgmma(acc, wk_smem.at[slot], s_smem)
                return acc[...]

            wks = pl.run_scoped(wk_s, plgpu.ACC((c, bv), f32))
            u = plgpu.load(wv_smem.at[slot], layout=plgpu.Layout.WGMMA).astype(f32) - wks
            rs = plgpu.load(rs_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))
            u_smem[...] = u.astype(bf16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(u_smem, u_ref.at[b, h, pl.ds(n * c, c), cols])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            u_smem[...] = (u * jax.lax.broadcast_in_dim(rs, u.shape, [0])).astype(bf16)
            plgpu.commit_smem()
            dec = plgpu.load(dec_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))

            def kt_u(acc):  # [K, C] x [C, BV]
                plgpu.wgmma(acc, k_smem.at[slot].T, u_smem)
                return acc[...]

            # A zero accumulator, not ACC.init(decayed S): the GPU interpreter has no run_state.
            s = s * jax.lax.broadcast_in_dim(dec, s.shape, [0]) + pl.run_scoped(kt_u, plgpu.ACC((K, bv), f32))

            @pl.when(n + STAGES < nc)
            def _():
                plgpu.commit_smem()  # its warpgroup barrier: every thread is done reading this slot
                load(n + STAGES, slot)

            return s

        s = jax.lax.fori_loop(0, nc, chunk, s)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        sn_smem[...] = s
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(sn_smem, sn_ref.at[b, h, :, cols])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        _swizzled((STAGES, c, K), bf16), _swizzled((STAGES, c, bv), bf16), _swizzled((STAGES, c, K), bf16),
        plgpu.SMEM((STAGES, c), f32), plgpu.SMEM((STAGES, K), f32),
        _swizzled((K, bv), bf16), _swizzled((c, bv), bf16), plgpu.SMEM((K, bv), f32),
        plgpu.Barrier(num_arrivals=5, num_barriers=STAGES),  # a slot is loaded when its 5 copies are
        plgpu.Barrier(),
    ]
    out_type = (jax.ShapeDtypeStruct((B, Hv, T, V), bf16), jax.ShapeDtypeStruct((B, Hv, nc, K, V), bf16),
                jax.ShapeDtypeStruct((B, Hv, K, V), f32))
    kw = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, V // bv),
                        grid_names=("b", "h", "j"), compiler_params=plgpu.CompilerParams(), **kw)(
        wk, wv, k, row_scale, decay_rows, s0)


def state_pass_reference(wk, wv, k, row_scale, chunk_decay, s0):
    """The same recurrence in plain JAX, float32 (the test's yardstick)."""
    B, Hv, T, K = wk.shape
    r, nc = Hv // k.shape[2], T // CHUNK
    kh = jnp.repeat(jnp.moveaxis(k, 2, 1), r, axis=1).astype(jnp.float32)  # [B, Hv, T, K]
    split = lambda x: jnp.moveaxis(x.reshape(B, Hv, nc, CHUNK, *x.shape[3:]), 2, 0)  # noqa: E731

    def step(s, xs):
        wk_n, wv_n, k_n, rs_n, dec_n = xs
        u = wv_n.astype(jnp.float32) - jnp.einsum("bhck,bhkv->bhcv", wk_n.astype(jnp.float32), s)
        s_new = dec_n[..., None, None] * s + jnp.einsum("bhck,bhcv->bhkv", k_n, u * rs_n[..., None])
        return s_new, (u, s)

    xs = (split(wk), split(wv), split(kh), split(row_scale), jnp.moveaxis(chunk_decay, 2, 0))
    final, (u, h) = jax.lax.scan(step, s0.astype(jnp.float32), xs)
    return jnp.moveaxis(u, 0, 2).reshape(B, Hv, T, -1), jnp.moveaxis(h, 0, 2), final


state_pass_mosaic_jit = functools.partial(jax.jit, static_argnames="interpret")(state_pass_mosaic)


# ---- stage 1 (intra-chunk WY solve) on Mosaic GPU ---------------------------------------------

INVERSE_LEVELS = 6  # block sizes 2, 4, ..., 64 = C: log2(C) doublings of the inverted diagonal blocks


def intra_vectors(g, beta, rk, c=CHUNK):
    """The per-row scalars the intra-chunk kernel needs, [B, Hv, NC, 6, c] float32 (XLA: a cumsum
    has no Mosaic GPU register op): b twice (in-chunk gate cumsum; one copy per register layout,
    since layout inference fails on one SMEM row loaded in two layouts), beta * rk (A's row scale), rk (A's
    column scale, 1 / ||k_t|| or 1), beta exp(b) rk (wk's row scale), beta (wv's row scale).
    g, beta [B, T, Hv]; rk [B, Hv, T]."""
    B, T, Hv = g.shape
    per_chunk = lambda x: jnp.moveaxis(x.astype(jnp.float32), 2, 1).reshape(B, Hv, T // c, c)  # noqa: E731
    b = jnp.cumsum(per_chunk(g), axis=-1)
    bt = per_chunk(beta)
    rk = rk.astype(jnp.float32).reshape(B, Hv, T // c, c)
    return jnp.stack([b, b, bt * rk, rk, bt * jnp.exp(b) * rk, bt], axis=3)


def intra_mosaic(k, v, vecs, *, r, interpret=False):
    """Stage 1 of chunk.py (`_intra_kernel`) on Mosaic GPU, "fast" policy on bfloat16:
    A = (beta rk)_i (k_i . k_j) rk_j exp(b_i - b_j) for j < i, W = (I + A)^{-1}, and
    wk = W (beta exp(b) rk k), wv = W (beta v), each [C, C] x [C, K|V] one bfloat16 WGMMA as
    in the Triton kernel. k [B, T, Hk, K], v [B, T, Hv, V] bfloat16 read in place (value head h
    uses key head h // r); vecs from `intra_vectors`. Returns wk [B, Hv, T, K], wv [B, Hv, T, V]
    bfloat16.

    The inverse: the Triton kernel substitutes row by row, which needs a register row pick that
    Mosaic GPU lacks. Here it is recursive block inversion, all [C, C] products: X_2 from A, then
    X_2s = X_s - X_s E_s X_s for s = 2 .. 32 (ten products). It builds blocks of the true inverse
    only (no intermediate growth; the product form prod (I + N^(2^k)) cancels catastrophically
    when a chunk's keys are correlated). Each product runs on bfloat16 tensor cores as hi + lo
    splits (x = hi + lo, both bfloat16; hi hi + hi lo + lo hi, float32 accumulation), ~2^-16
    relative, near the Triton kernel's float32 substitution and TF32 merge; TF32 WGMMA would need
    K-major operands on both sides."""
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    c, nc = CHUNK, T // CHUNK
    if T % c or K % 64 or V % 64 or k.dtype != jnp.bfloat16 or v.dtype != jnp.bfloat16:
        raise ValueError(f"mosaic intra kernel: T % {c} == 0, K, V % 64 == 0 and bfloat16 operands; "
                         f"got T={T}, K={K}, V={V}, {k.dtype}, {v.dtype}")
    bf16, f32 = jnp.bfloat16, jnp.float32
    row_l, col_l = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def body(k_ref, v_ref, vec_ref, wk_ref, wv_ref,
             k_smem, v_smem, vec_smem, xh, xl, ph, plo, wk_smem, wv_smem, loaded):
        b, h, n = (jax.lax.axis_index(a) for a in ("b", "h", "n"))
        rows = pl.ds(n * c, c)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h // r], k_smem, loaded)
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h], v_smem, loaded)
        plgpu.copy_gmem_to_smem(vec_ref.at[b, h, n], vec_smem, loaded)
        plgpu.barrier_wait(loaded)

        def matmul(a, b_, n_cols):
            return _wgmma(a, b_, (c, n_cols))

        def matmul3(x_hi, x_lo, y_hi, y_lo):  # (x_hi + x_lo)(y_hi + y_lo) less the lo lo term
            def run(acc):
                plgpu.wgmma(acc, x_hi, y_hi)
                plgpu.wgmma(acc, x_hi, y_lo)
                plgpu.wgmma(acc, x_lo, y_hi)
                return acc[...]
            return pl.run_scoped(run, plgpu.ACC((c, c), f32))

        # Layouts named on the [C, C] values: left to layout inference, lowering took 3-4x longer.
        wg = lambda x: plgpu.layout_cast(x, plgpu.Layout.WGMMA)  # noqa: E731

        def split_store(x, hi_ref, lo_ref):
            hi = wg(x.astype(bf16))
            hi_ref[...] = hi
            lo_ref[...] = wg((x - hi.astype(f32)).astype(bf16))

        vec = lambda i, layout: plgpu.load(vec_smem.at[i], layout=layout)  # noqa: E731
        bcast = lambda x, dim: jax.lax.broadcast_in_dim(x, (c, c), [dim])  # noqa: E731
        row = plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, (c, c), 0), plgpu.Layout.WGMMA)
        col = plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, (c, c), 1), plgpu.Layout.WGMMA)

        kk = matmul(k_smem, k_smem.T, c)  # [C, K] x [K, C]
        # exp of a masked exponent: b_i - b_j <= 0 below the diagonal (g <= 0); min() keeps the
        # masked-off upper part finite whatever g's sign.
        decay = wg(jnp.exp(jnp.minimum(wg(bcast(vec(0, row_l), 0)) - wg(bcast(vec(1, col_l), 1)), 0.0)))
        a = wg(wg(bcast(vec(2, row_l), 0)) * kk * wg(bcast(vec(3, col_l), 1)) * decay)
        a = wg(jnp.where(row > col, a, 0.0))
        # Recursive block inversion: X_s, the inverse of I + A's diagonal s x s blocks, doubles
        # to X_2s = X_s - X_s E_s X_s (E_s: A's lower off-diagonal s-blocks inside each 2s-block).
        x = wg(wg(jnp.where(row == col, 1.0, 0.0)) - wg(jnp.where((row >> 1) == (col >> 1), a, 0.0)))  # X_2
        for level in range(1, INVERSE_LEVELS):
            pair = wg((row >> (level + 1)) == (col >> (level + 1)))
            e = wg(jnp.where(pair & wg((row >> level) != (col >> level)), a, 0.0))
            split_store(x, xh, xl)
            split_store(e, ph, plo)
            plgpu.commit_smem()
            y = matmul3(xh, xl, ph, plo)  # X_s E_s
            split_store(y, ph, plo)
            plgpu.commit_smem()
            x = wg(x - matmul3(ph, plo, xh, xl))  # (X_s E_s) X_s

        # "fast" policy: W and the scaled rows in bfloat16, one WGMMA each (the Triton kernel's
        # dot). The scaled rows go to the output buffers, which each WGMMA's result then
        # replaces (it has waited for the WGMMA, so nothing reads them any more).
        xh[...] = x.astype(bf16)
        ks = plgpu.load(k_smem, layout=plgpu.Layout.WGMMA).astype(f32)
        wk_smem[...] = (ks * jax.lax.broadcast_in_dim(vec(4, row_l), ks.shape, [0])).astype(bf16)
        vs = plgpu.load(v_smem, layout=plgpu.Layout.WGMMA).astype(f32)
        wv_smem[...] = (vs * jax.lax.broadcast_in_dim(vec(5, row_l), vs.shape, [0])).astype(bf16)
        plgpu.commit_smem()
        wk = matmul(xh, wk_smem, K)
        wk_smem[...] = wk.astype(bf16)
        wv = matmul(xh, wv_smem, V)
        wv_smem[...] = wv.astype(bf16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(wk_smem, wk_ref.at[b, h, rows])
        plgpu.copy_smem_to_gmem(wv_smem, wv_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        _swizzled((c, K), bf16), _swizzled((c, V), bf16), plgpu.SMEM((6, c), f32),
        *(_swizzled((c, c), bf16) for _ in range(4)),
        _swizzled((c, K), bf16), _swizzled((c, V), bf16),
        plgpu.Barrier(num_arrivals=3),
    ]
    out_type = (jax.ShapeDtypeStruct((B, Hv, T, K), bf16), jax.ShapeDtypeStruct((B, Hv, T, V), bf16))
    kw = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, nc),
                        grid_names=("b", "h", "n"), compiler_params=plgpu.CompilerParams(), **kw)(k, v, vecs)


# ---- stage 3 (output) on Mosaic GPU ------------------------------------------------------------


def output_vectors(g, rq, rk, c=CHUNK):
    """Per-row scalars of the output kernel, [B, Hv, NC, 4, c] float32: b twice (in-chunk gate
    cumsum, one copy per register layout),
    rq (scale / ||q_t|| or scale), rk (1 / ||k_t|| or 1). g [B, T, Hv]; rq, rk [B, Hv, T]."""
    B, T, Hv = g.shape
    b = jnp.cumsum(jnp.moveaxis(g.astype(jnp.float32), 2, 1).reshape(B, Hv, T // c, c), axis=-1)
    split = lambda x: x.astype(jnp.float32).reshape(B, Hv, T // c, c)  # noqa: E731
    return jnp.stack([b, b, split(rq), split(rk)], axis=3)


def output_mosaic(q, k, u, h, vecs, *, out_dtype, interpret=False):
    """Stage 3 of chunk.py (`_output_kernel`) on Mosaic GPU, "fast" policy on bfloat16:
    o = rq exp(b) (q h_n) + P u, P_ij = rq_i (q_i . k_j) rk_j exp(b_i - b_j) for j <= i, P in
    bfloat16 for its WGMMA as in the Triton kernel. q, k [B, T, Hk, K] bfloat16 read in place;
    u [B, Hv, T, V], h [B, Hv, NC, K, V] bfloat16 (the state pass); vecs from `output_vectors`.
    Returns o [B, T, Hv, V] in out_dtype (written in place through TMA)."""
    B, T, Hk, K = q.shape
    Hv, V = u.shape[1], u.shape[3]
    r, c, bv, nc = Hv // Hk, CHUNK, BLOCK_V, T // CHUNK
    if T % c or K % 64 or V % bv or q.dtype != jnp.bfloat16 or u.dtype != jnp.bfloat16:
        raise ValueError(f"mosaic output kernel: T % {c} == 0, K % 64 == 0, V % {bv} == 0 and bfloat16 "
                         f"operands; got T={T}, K={K}, V={V}, {q.dtype}, {u.dtype}")
    bf16, f32 = jnp.bfloat16, jnp.float32
    row_l, col_l = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def body(q_ref, k_ref, u_ref, h_ref, vec_ref, o_ref,
             q_smem, k_smem, u_smem, h_smem, vec_smem, p_smem, o_smem, loaded):
        bh, n, j = (jax.lax.axis_index(a) for a in ("bh", "n", "j"))
        b, hd = bh // Hv, jax.lax.rem(bh, Hv)
        rows, cols = pl.ds(n * c, c), pl.ds(j * bv, bv)
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, hd // r], q_smem, loaded)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hd // r], k_smem, loaded)
        plgpu.copy_gmem_to_smem(u_ref.at[b, hd, rows, cols], u_smem, loaded)
        plgpu.copy_gmem_to_smem(h_ref.at[b, hd, n, :, cols], h_smem, loaded)
        plgpu.copy_gmem_to_smem(vec_ref.at[b, hd, n], vec_smem, loaded)
        plgpu.barrier_wait(loaded)

        def matmul(a, b_, n_cols):
            return _wgmma(a, b_, (c, n_cols))

        vec = lambda i, layout: plgpu.load(vec_smem.at[i], layout=layout)  # noqa: E731
        bcast = lambda x, dim, n_cols: jax.lax.broadcast_in_dim(x, (c, n_cols), [dim])  # noqa: E731
        row = plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, (c, c), 0), plgpu.Layout.WGMMA)
        col = plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, (c, c), 1), plgpu.Layout.WGMMA)
        b_row, rq = vec(0, row_l), vec(2, row_l)

        qk = matmul(q_smem, k_smem.T, c)  # [C, K] x [K, C]
        qh = matmul(q_smem, h_smem, bv)  # [C, K] x [K, BV]
        decay = jnp.exp(jnp.minimum(bcast(b_row, 0, c) - bcast(vec(1, col_l), 1, c), 0.0))
        p = jnp.where(row >= col, bcast(rq, 0, c) * qk * bcast(vec(3, col_l), 1, c) * decay, 0.0)
        p_smem[...] = p.astype(bf16)
        plgpu.commit_smem()
        o = bcast(rq * jnp.exp(b_row), 0, bv) * qh + matmul(p_smem, u_smem, bv)
        o_smem[...] = o.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, rows, hd, cols])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        _swizzled((c, K), bf16), _swizzled((c, K), bf16), _swizzled((c, bv), bf16), _swizzled((K, bv), bf16),
        plgpu.SMEM((4, c), f32), _swizzled((c, c), bf16), plgpu.SMEM((c, bv), out_dtype),
        plgpu.Barrier(num_arrivals=5),
    ]
    kw = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((B, T, Hv, V), out_dtype), scratch_types=scratch,
                        grid=(B * Hv, nc, V // bv), grid_names=("bh", "n", "j"),
                        compiler_params=plgpu.CompilerParams(), **kw)(q, k, u, h, vecs)
