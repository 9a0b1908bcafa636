"""Pallas decode kernel for the gated delta rule: a few tokens, the state updated in place.

Same contract as `reference.recurrent_gated_delta_rule_reference`. `api.py` picks it for
T <= `api.RECURRENT_MAX_TOKENS`: a handful of tokens does not pay for chunk bookkeeping, C x C
decay matrices and a triangular inverse, and decode is bound by reading and writing the
[K, V] float32 state once per call, which this kernel does exactly once per (row, head, V tile).

One kernel, grid (B, Hv, V / BV) with a small BV (`common.TUNING`: 8, so a Qwen3.5 layer at
batch 1 runs 32 x 16 = 512 programs). Each program holds its state tile S [K, BV] in registers
and walks the tokens in order, exactly as the reference does:

    S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T (scale q_t)

The state is updated in place: the state operand is aliased to the state output
(`input_output_aliases`), so under a jit that donates the cache no [B, Hv, K, V] copy is made.

State slots (`state_indices`, optional): the state is a pool [num_slots, Hv, K, V] and row b of
the batch reads and writes slot `state_indices[b]`; a negative index marks a padding row (its
outputs are zeros and no slot is touched). An engine keeps one pool for all its slots and passes
only the active rows, so idle slots cost nothing. Without it, row b uses state row b.

Per-token vectors are read with a scalar index on the T axis (no tile indexing), the products
are broadcast-multiply-reduce (a [1, K] x [K, BV] `dot` would be below Triton's 16-row
minimum). Layouts as in `chunk.py`: q, k [B, T, Hk, K] (value head h reads key head h // r
through the index map), v [B, T, Hv, V], g, beta [B, T, Hv], state float32. K and V are
zero-padded to powers of two >= 16 (a copy only when they are not); T needs no padding.
`normalize=True` L2-normalises q and k in the kernel (float32, eps 1e-6).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .common import f32, inv_norm, next_pow2, run_on_platform, sum_sq, triton_params, tuning


def _decode_kernel(idx_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, sn_ref, *, t,
                   scale, bv, normalize):
    # refs: idx [B] slots; q, k [T, K], v [T, BV], g, beta [T]; s (= sn, aliased) the whole
    # pool [S, Hv, K, V] -> o [T, BV]; this program's tile: slot idx[b], head h, columns j*BV
    slot = idx_ref[pl.program_id(0)]
    live = slot >= 0
    head, cols = pl.program_id(1), pl.ds(pl.program_id(2) * bv, bv)
    kd = q_ref.shape[1]
    tile = sn_ref.at[jnp.maximum(slot, 0), head, :, cols]  # [K, BV]
    s0 = plt.load(s_ref.at[jnp.maximum(slot, 0), head, :, cols],
                  mask=jnp.full((kd, bv), live), other=0.0)

    def body(i, s):
        q = q_ref[i, :].astype(f32)  # [K]
        k = k_ref[i, :].astype(f32)  # [K]
        if normalize:
            q, k = q * inv_norm(sum_sq(q)), k * inv_norm(sum_sq(k))
        v = v_ref[i, :].astype(f32)  # [BV]
        s = s * jnp.exp(g_ref[i].astype(f32))
        kv = jnp.sum(k[:, None] * s, axis=0)  # [BV] = S^T k
        u = beta_ref[i].astype(f32) * (v - kv)  # [BV]
        s = s + k[:, None] * u[None, :]
        o = jnp.sum((q * scale)[:, None] * s, axis=0)  # [BV] = S^T q
        o_ref[i, :] = jnp.where(live, o, 0.0).astype(o_ref.dtype)
        return s

    final = jax.lax.fori_loop(0, t, body, s0.astype(f32))
    plt.store(tile, final, mask=jnp.full((kd, bv), live))


def _decode(idx, q, k, v, g, beta, pool, *, scale, normalize, interpret):
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    r = Hv // Hk
    tune = tuning()
    bv = min(V, tune.decode_bv)
    whole = lambda i, h, j: (0, 0, 0, 0)  # noqa: E731  the pool: slots are picked in the kernel
    return pl.pallas_call(
        functools.partial(_decode_kernel, t=T, scale=scale, bv=bv, normalize=normalize),
        grid=(B, Hv, V // bv),
        in_specs=[
            pl.BlockSpec((B,), lambda i, h, j: (0,)),
            pl.BlockSpec((None, T, None, K), lambda i, h, j: (i, 0, h // r, 0)),
            pl.BlockSpec((None, T, None, K), lambda i, h, j: (i, 0, h // r, 0)),
            pl.BlockSpec((None, T, None, bv), lambda i, h, j: (i, 0, h, j)),
            pl.BlockSpec((None, T, None), lambda i, h, j: (i, 0, h)),
            pl.BlockSpec((None, T, None), lambda i, h, j: (i, 0, h)),
            pl.BlockSpec(pool.shape, whole),
        ],
        out_specs=[
            pl.BlockSpec((None, T, None, bv), lambda i, h, j: (i, 0, h, j)),
            pl.BlockSpec(pool.shape, whole),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, Hv, V), v.dtype),
            jax.ShapeDtypeStruct(pool.shape, f32),
        ],
        input_output_aliases={6: 1},
        interpret=interpret,
        compiler_params=triton_params(tune.decode_warps),
        name="gdr_decode",
    )(idx, q, k, v, g, beta, pool)


def _pad_last(x, size):
    if x.shape[-1] == size:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def recurrent_gated_delta_rule_pallas(
    q, k, v, g, beta, *, scale, initial_state=None, interpret=None, normalize=False,
    state_indices=None,
):
    """Token-by-token gated delta rule in one Pallas kernel; same contract as the reference.

    Args:
      initial_state: [B, Hv, K, V], or with `state_indices` a pool [num_slots, Hv, K, V]
        (None: zeros [B, Hv, K, V]).
      state_indices: None, or int32 [B]: row b reads and writes pool slot state_indices[b];
        negative = padding row (zero output, no slot touched).
      interpret: True (interpreter), False (compiled Triton), None (by lowering platform).
      normalize: L2-normalise q and k in the kernel.

    Returns:
      (o [B, T, Hv, V] in v's dtype, the new state float32, shaped like initial_state: the
      whole pool with `state_indices`).
    """
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if initial_state is None:
        if state_indices is not None:
            raise ValueError("state_indices needs an initial_state pool [num_slots, Hv, K, V]")
        initial_state = jnp.zeros((B, Hv, K, V), f32)
    if state_indices is None:
        state_indices = jnp.arange(B, dtype=jnp.int32)
    elif state_indices.shape != (B,):
        raise ValueError(f"state_indices must be [B] = [{B}], got {tuple(state_indices.shape)}")
    if T == 0:
        return jnp.zeros((B, 0, Hv, V), v.dtype), initial_state.astype(f32)
    kp, vp = next_pow2(K), next_pow2(V)
    q, k = (_pad_last(x, kp) for x in (q, k))
    v = _pad_last(v, vp)
    pool = _pad_last(jnp.pad(initial_state.astype(f32), [(0, 0)] * 2 + [(0, kp - K), (0, 0)])
                     if kp != K else initial_state.astype(f32), vp)
    args = (state_indices.astype(jnp.int32), q, k, v, g, beta, pool)
    fn = functools.partial(_decode, scale=scale, normalize=normalize)
    o, final = run_on_platform(fn, interpret, *args)
    return o[..., :V], final[:, :, :K, :V]
