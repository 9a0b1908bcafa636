"""Pallas decode kernel for the gated delta rule: a few tokens, state in -> state out.

Same contract as `reference.recurrent_gated_delta_rule_reference`. `api.py` picks it for
T <= `api.RECURRENT_MAX_TOKENS`: a handful of tokens does not pay for chunk padding, C x C
decay matrices and a triangular inverse, and decode is bound by reading and writing the
[K, V] float32 state once per call, which this kernel does exactly once per (batch, head, V tile).

One kernel, grid (B, Hv, V / BV). Each program holds its state tile S [K, BV] in registers and
walks the tokens in order, exactly as the reference does:

    S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T (scale q_t)

Per-token vectors are read with a scalar index on the T axis (no tile indexing), the products
are broadcast-multiply-reduce (a [1, K] x [K, BV] `dot` would be below Triton's 16-row
minimum). Layouts as in `chunk.py`: q, k [B, T, Hk, K] (value head h reads key head h // r
through the index map), v [B, T, Hv, V], g, beta [B, T, Hv], state [B, Hv, K, V] float32.
K and V are zero-padded to powers of two >= 16; T needs no padding (its block is the whole axis).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .chunk import BLOCK_V, pad_inputs, run_on_platform, triton_params

f32 = jnp.float32


def _decode_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, sn_ref, *, t, scale):
    # blocks: q, k [T, K], v [T, BV], g, beta [T], s0 [K, BV] -> o [T, BV], sn [K, BV]
    def body(i, s):
        q = q_ref[i, :].astype(f32) * scale  # [K]
        k = k_ref[i, :].astype(f32)  # [K]
        v = v_ref[i, :].astype(f32)  # [BV]
        s = s * jnp.exp(g_ref[i].astype(f32))
        kv = jnp.sum(k[:, None] * s, axis=0)  # [BV] = S^T k
        u = beta_ref[i].astype(f32) * (v - kv)  # [BV]
        s = s + k[:, None] * u[None, :]
        o_ref[i, :] = jnp.sum(q[:, None] * s, axis=0).astype(o_ref.dtype)  # [BV] = S^T q
        return s

    sn_ref[...] = jax.lax.fori_loop(0, t, body, s0_ref[...].astype(f32))


def _decode(q, k, v, g, beta, s0, *, scale, interpret):
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    r = Hv // Hk
    bv = min(V, BLOCK_V)
    return pl.pallas_call(
        functools.partial(_decode_kernel, t=T, scale=scale),
        grid=(B, Hv, V // bv),
        in_specs=[
            pl.BlockSpec((None, T, None, K), lambda i, h, j: (i, 0, h // r, 0)),
            pl.BlockSpec((None, T, None, K), lambda i, h, j: (i, 0, h // r, 0)),
            pl.BlockSpec((None, T, None, bv), lambda i, h, j: (i, 0, h, j)),
            pl.BlockSpec((None, T, None), lambda i, h, j: (i, 0, h)),
            pl.BlockSpec((None, T, None), lambda i, h, j: (i, 0, h)),
            pl.BlockSpec((None, None, K, bv), lambda i, h, j: (i, h, 0, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, T, None, bv), lambda i, h, j: (i, 0, h, j)),
            pl.BlockSpec((None, None, K, bv), lambda i, h, j: (i, h, 0, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, Hv, V), v.dtype),
            jax.ShapeDtypeStruct((B, Hv, K, V), f32),
        ],
        interpret=interpret,
        compiler_params=triton_params(num_warps=4),
        name="gdr_decode",
    )(q, k, v, g, beta, s0)


def recurrent_gated_delta_rule_pallas(
    q, k, v, g, beta, *, scale, initial_state=None, interpret=None
):
    """Token-by-token gated delta rule in one Pallas kernel; same contract as the reference.

    interpret: True (interpreter), False (compiled Triton), None (by lowering platform:
    the interpreter on CPU, Triton elsewhere).
    Returns (o [B, T, Hv, V] in v's dtype, final_state [B, Hv, K, V] float32).
    """
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if T == 0:
        s = jnp.zeros((B, Hv, K, V), f32) if initial_state is None else initial_state.astype(f32)
        return jnp.zeros((B, 0, Hv, V), v.dtype), s
    padded = pad_inputs(q, k, v, g, beta, initial_state, 1)
    o, final = run_on_platform(functools.partial(_decode, scale=scale), interpret, *padded)
    return o[..., :V], final[:, :, :K, :V]
