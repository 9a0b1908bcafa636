"""Pallas kernels for the sequential half of the backward: the chunk-state recompute and the
reverse state pass, each one program per (batch row, value head, V tile) walking the chunks.

`backward.py` computes the state-independent per-chunk quantities in XLA under `jax.vjp`
(`xla._prepare`: wk, wv, q_eff, k_dec and the chunk decay, all batched matmuls that XLA runs on
tensor cores itself) and pulls the cotangents back through them; what is sequential over chunks
runs here, with the state and its cotangent held in registers as K / BK float32 tiles [BK, BV]:

  `gdr_bwd_states`   S_0 = initial state; per chunk n: h_n = S_n, u = wv - wk S,
                     S_{n+1} = decay S + k_dec^T u. Writes the entry states h [N, K, V].
  `gdr_bwd_reverse`  dS = d_final; per chunk n from the last: S = h_n, u = wv - wk S,
                     du = k_dec dS,  d(wk) = -du S^T,  d(q_eff) = do S^T,  d(k_dec) = u dS^T,
                     d(decay) = <S, dS>,  dS <- decay dS + q_eff^T do - wk^T du.
                     Writes du and, per V tile, the [C, K] cotangents and d(decay) (summed over
                     tiles by the caller); returns the initial state's cotangent.

The algebra is `backward._reverse_step` (derivation in README.md, "Backward"); the inputs are
[B, Hv, N * C, ...] (chunks contiguous, T already padded to whole chunks by `xla._chunk`, so no
masks). Matmuls follow the precision policy (`common.Policy.dot`: operands in the input dtype
"fast", IEEE float32 "exact"); the caller passes the per-chunk inputs in that dtype and h is
stored in it; the state, its cotangent and every accumulation are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import f32, triton_params, tuning


def _cols(j, bk):
    return pl.ds(j * bk, bk)


def _states_kernel(wk_ref, wv_ref, kd_ref, dec_ref, s0_ref, h_ref, *, n, c, bk, pol):
    # refs: wk, kd [N C, K]; wv [N C, BV]; dec [N]; s0 [K, BV] -> h [N, K, BV]
    nk = wk_ref.shape[1] // bk

    def body(i, s):
        rows = pl.ds(pl.multiple_of(i * c, c), c)
        for j in range(nk):
            h_ref[i, _cols(j, bk), :] = s[j].astype(h_ref.dtype)
        u = wv_ref[rows, :].astype(f32)
        for j in range(nk):
            u = u - pol.dot(wk_ref[rows, _cols(j, bk)], s[j])  # [C, BV]
        return tuple(dec_ref[i] * s[j] + pol.dot(kd_ref[rows, _cols(j, bk)], u, trans_a=True)
                     for j in range(nk))

    s0 = tuple(s0_ref[_cols(j, bk), :].astype(f32) for j in range(nk))
    jax.lax.fori_loop(0, n, body, s0)


def _reverse_kernel(wk_ref, wv_ref, qe_ref, kd_ref, dec_ref, do_ref, h_ref, dsn_ref,
                    dwk_ref, du_ref, dqe_ref, dkd_ref, ddec_ref, ds0_ref, *, n, c, bk, pol):
    # refs: wk, qe, kd [N C, K]; wv, do [N C, BV]; dec [N]; h [N, K, BV]; dsn [K, BV]
    #    -> dwk, dqe, dkd [N C, K] and ddec [N] (this V tile's share), du [N C, BV], ds0 [K, BV]
    nk = wk_ref.shape[1] // bk

    def body(step, ds):
        i = n - 1 - step
        rows = pl.ds(pl.multiple_of(i * c, c), c)
        s = [h_ref[i, _cols(j, bk), :].astype(f32) for j in range(nk)]
        do = do_ref[rows, :]  # [C, BV]
        u = wv_ref[rows, :].astype(f32)
        du = jnp.zeros_like(u)
        for j in range(nk):
            u = u - pol.dot(wk_ref[rows, _cols(j, bk)], s[j])
            du = du + pol.dot(kd_ref[rows, _cols(j, bk)], ds[j])  # [C, BV]
        du_ref[rows, :] = du
        d_decay = jnp.zeros((), f32)
        new_ds = []
        # One K block at a time, its [C, BK] tiles (re)loaded where used: short live ranges.
        for j in range(nk):
            dwk_ref[rows, _cols(j, bk)] = -pol.dot(du, s[j], trans_b=True)  # [C, BK]
            dqe_ref[rows, _cols(j, bk)] = pol.dot(do, s[j], trans_b=True)
            dkd_ref[rows, _cols(j, bk)] = pol.dot(u, ds[j], trans_b=True)
            d_decay = d_decay + jnp.sum(s[j] * ds[j])
            new_ds.append(dec_ref[i] * ds[j]
                          + pol.dot(qe_ref[rows, _cols(j, bk)], do, trans_a=True)
                          - pol.dot(wk_ref[rows, _cols(j, bk)], du, trans_a=True))
        ddec_ref[i] = d_decay
        return tuple(new_ds)

    ds_n = tuple(dsn_ref[_cols(j, bk), :] for j in range(nk))
    ds0 = jax.lax.fori_loop(0, n, body, ds_n)
    for j in range(nk):
        ds0_ref[_cols(j, bk), :] = ds0[j]


def reverse_state_pass(wk, wv, q_eff, k_dec, decay, do, s0, d_final, *, c, pol, interpret):
    """The sequential half of the backward, as two Pallas kernels.

    Args: wk, q_eff, k_dec [B, Hv, N C, K]; wv, do [B, Hv, N C, V] (the policy's dtype);
      decay [B, Hv, N], s0, d_final [B, Hv, K, V] float32; K, V powers of two >= 16.
    Returns: (d_wk, d_wv, d_q_eff, d_k_dec [B, Hv, N C, K | V], d_decay [B, Hv, N],
      d_s0 [B, Hv, K, V]).
    """
    B, Hv, T, K = wk.shape
    V = wv.shape[-1]
    n = T // c
    tune = tuning()
    bk, bv = min(K, tune.block_k), min(V, tune.bwd_bv)
    nv = V // bv
    kw = dict(n=n, c=c, bk=bk, pol=pol)
    sds = jax.ShapeDtypeStruct
    rows_k = pl.BlockSpec((None, None, T, K), lambda b, h, j: (b, h, 0, 0))
    rows_v = pl.BlockSpec((None, None, T, bv), lambda b, h, j: (b, h, 0, j))
    per_chunk = pl.BlockSpec((None, None, n), lambda b, h, j: (b, h, 0))
    state = pl.BlockSpec((None, None, K, bv), lambda b, h, j: (b, h, 0, j))
    states = pl.BlockSpec((None, None, n, K, bv), lambda b, h, j: (b, h, 0, 0, j))
    params = triton_params(tune.bwd_warps, tune.stages)

    h = pl.pallas_call(
        functools.partial(_states_kernel, **kw),
        grid=(B, Hv, nv),
        in_specs=[rows_k, rows_v, rows_k, per_chunk, state],
        out_specs=states,
        out_shape=sds((B, Hv, n, K, V), pol.dtype),
        compiler_params=params,
        interpret=interpret,
        name="gdr_bwd_states",
    )(wk, wv, k_dec, decay, s0)

    tile_k = pl.BlockSpec((None, None, None, T, K), lambda b, h, j: (b, h, j, 0, 0))
    tile_n = pl.BlockSpec((None, None, None, n), lambda b, h, j: (b, h, j, 0))
    d_wk, d_wv, d_qe, d_kd, d_dec, d_s0 = pl.pallas_call(
        functools.partial(_reverse_kernel, **kw),
        grid=(B, Hv, nv),
        in_specs=[rows_k, rows_v, rows_k, rows_k, per_chunk, rows_v, states, state],
        out_specs=[tile_k, rows_v, tile_k, tile_k, tile_n, state],
        out_shape=[
            sds((B, Hv, nv, T, K), f32),
            sds((B, Hv, T, V), f32),
            sds((B, Hv, nv, T, K), f32),
            sds((B, Hv, nv, T, K), f32),
            sds((B, Hv, nv, n), f32),
            sds((B, Hv, K, V), f32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="gdr_bwd_reverse",
    )(wk, wv, q_eff, k_dec, decay, do, h, d_final)
    return d_wk.sum(2), d_wv, d_qe.sum(2), d_kd.sum(2), d_dec.sum(2), d_s0
