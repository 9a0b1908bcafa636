"""The chunked delta rule's sequential state pass as a Pallas Mosaic GPU kernel (Hopper, JAX 0.11+).

Same contract as stage 2 of chunk.py (`_state_kernel`), for equal-length rows (no `cu_seqlens`),
T a multiple of the chunk C = 64 and the "fast" policy (bfloat16 operands, float32 accumulators):

    for each chunk n:   h[n] = S                                  (chunk-entry state, stored)
                        u    = wv - wk S                           [C, BV]   (one WGMMA)
                        S    = exp(b_last) S + k^T (u * exp(b_last - b))   (one WGMMA, k^T from SMEM)

One program per (batch row, value head, BV-column block), one warpgroup; the state S [K, BV]
float32 stays in registers in the WGMMA accumulator layout for the whole sequence. Per chunk,
wk, k (key head h // r, read in place from [B, T, Hk, K]) and wv arrive in SMEM by TMA, two
chunks in flight (the next chunk loads while this one computes). The gate scalings need a cumsum,
which Mosaic GPU has no register op for, so the caller passes them precomputed by XLA
(`gate_scales`: tiny [B, Hv, T] and [B, Hv, NC, K] float32 arrays).

Checked without a GPU: on CPU with Pallas' GPU interpreter (`InterpretGPUParams`) against chunk.py's
stage 2 (tests/test_mosaic.py), lowered for CUDA (a `mosaic_gpu` custom call) and, where JAX emits
PTX at lowering time, compiled offline; see README.md for what that does and does not prove.
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
