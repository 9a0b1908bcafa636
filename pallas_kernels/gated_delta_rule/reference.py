"""Token-by-token gated delta rule in float32: the oracle every faster version is tested against.

Never optimise this file; its only job is to be obviously right. Per value head h (which reads
key head h // r, r = Hv // Hk):

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
    o_t = S_t^T (scale * q_t)

Same recurrence as transformers' `torch_recurrent_gated_delta_rule` (Qwen3-Next), without its
L2 normalisation, which lives in `api.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The oracle must not inherit a backend's reduced default matmul precision (TF32 / bf16 passes).
_PRECISION = jax.lax.Precision.HIGHEST


def recurrent_gated_delta_rule_reference(q, k, v, g, beta, *, scale, initial_state=None):
    """Run the gated delta rule one token at a time (`lax.scan` over T), all in float32.

    Args:
      q, k: [B, T, Hk, K] queries and keys (any float dtype).
      v: [B, T, Hv, V] values; Hv must be a multiple of Hk.
      g: [B, T, Hv] log-decay per token (normally <= 0).
      beta: [B, T, Hv] write strength per token.
      scale: python float multiplying q.
      initial_state: [B, Hv, K, V] or None (zeros).

    Returns:
      (o [B, T, Hv, V] in v's dtype, final_state [B, Hv, K, V] float32).
    """
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    r = Hv // Hk
    f32 = jnp.float32
    # Value head h uses key head h // r: repeat (not tile) along the head axis.
    q = jnp.repeat(q.astype(f32), r, axis=2) * scale  # [B, T, Hv, K]
    k = jnp.repeat(k.astype(f32), r, axis=2)  # [B, T, Hv, K]
    if initial_state is None:
        state = jnp.zeros((B, Hv, K, V), f32)
    else:
        state = initial_state.astype(f32)

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, Hv, K] x2, [B, Hv, V], [B, Hv] x2
        S = S * jnp.exp(g_t)[:, :, None, None]
        # [B, Hv, K] x [B, Hv, K, V] -> [B, Hv, V]
        kv_mem = jnp.einsum("bhk,bhkv->bhv", k_t, S, precision=_PRECISION)
        delta = b_t[:, :, None] * (v_t - kv_mem)  # [B, Hv, V]
        # outer product: [B, Hv, K] x [B, Hv, V] -> [B, Hv, K, V]
        S = S + jnp.einsum("bhk,bhv->bhkv", k_t, delta, precision=_PRECISION)
        # [B, Hv, K] x [B, Hv, K, V] -> [B, Hv, V]
        o_t = jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=_PRECISION)
        return S, o_t

    # Time leading for scan: [T, B, ...].
    xs = tuple(jnp.moveaxis(x.astype(f32), 1, 0) for x in (q, k, v, g, beta))
    state, o = jax.lax.scan(step, state, xs)  # o: [T, B, Hv, V]
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), state
