"""A `jax.custom_vjp` for the gated delta rule with a memory-lean backward, in XLA.

`gated_delta_rule_with_vjp(forward, q, k, v, g, beta, initial_state, scale=...)` runs any
forward with the reference's contract (the XLA chunked form, the Pallas kernels, the Pallas
decode kernel) and differentiates it w.r.t. q, k, v, g, beta and the initial state.

Residuals are the inputs only: no per-token state and no forward intermediates are kept
between the forward and the backward. The backward (derivation in README.md, "Backward"):

  1. recompute the state-independent per-chunk quantities (`xla._intra_chunk`, batched over
     all chunks) under `jax.vjp`, so their own VJP is available for step 4;
  2. recompute the N chunk-entry states with the forward state scan (N states of [K, V], not
     T of them);
  3. one reverse `lax.scan` over chunks carrying dS, the cotangent of the state, and emitting
     the cotangents of the per-chunk quantities (a handful of [C, K] x [K, V] matmuls per step);
  4. pull those back through step 1's VJP (the triangular inverse has a closed-form VJP in
     `xla._unit_lower_inverse`), the gate cumsum, the head repeat and the padding.

The backward is the same XLA code on every platform; a Pallas port of steps 2-3 is a
follow-up (see README.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .xla import _chunk, _chunk_states, _einsum, _prepare

f32 = jnp.float32

# Same trade-off as xla.CHUNK_SIZE; measured 1.07x / 1.08x / 1.16x faster than 64 at
# T = 512 / 2048 / 8192 on XLA:CPU. (The backward's chunking is independent of the forward's.)
BACKWARD_CHUNK_SIZE = 32


def _reverse_step(ds, xs):
    """One chunk backwards. ds: cotangent of the state leaving the chunk, [B, Hv, K, V].

    Forward of the chunk (S = state entering it):
      u = wv - wk S;  o = o_intra + q_eff S;  S' = decay S + k_dec^T u.
    """
    s, wk, wv, q_eff, k_dec, decay, do = xs
    # [B, Hv, C, K] x [B, Hv, K, V] -> [B, Hv, C, V]
    u = wv - _einsum("bhck,bhkv->bhcv", wk, s)
    du = _einsum("bhck,bhkv->bhcv", k_dec, ds)
    # [B, Hv, C, V] x [B, Hv, K, V] -> [B, Hv, C, K]
    d_q_eff = _einsum("bhcv,bhkv->bhck", do, s)
    d_k_dec = _einsum("bhcv,bhkv->bhck", u, ds)
    d_wk = -_einsum("bhcv,bhkv->bhck", du, s)
    d_decay = jnp.sum(s * ds, axis=(-2, -1))  # [B, Hv]
    # [B, Hv, C, K] x [B, Hv, C, V] -> [B, Hv, K, V]
    ds_in = (
        decay[:, :, None, None] * ds
        + _einsum("bhck,bhcv->bhkv", q_eff, do)
        - _einsum("bhck,bhcv->bhkv", wk, du)
    )
    return ds_in, (d_wk, du, d_q_eff, d_k_dec, d_decay)


def gated_delta_rule_backward(q, k, v, g, beta, initial_state, do, d_final, *, scale,
                              chunk_size=BACKWARD_CHUNK_SIZE):
    """Cotangents (dq, dk, dv, dg, dbeta, d_initial_state), each in its input's dtype.

    do [B, T, Hv, V] and d_final [B, Hv, K, V] are the cotangents of (o, final_state).
    """
    c = chunk_size
    n = -(-q.shape[1] // c)
    prep = functools.partial(_prepare, scale=scale, n=n, c=c)
    (wk, wv, _, q_eff, k_dec, decay), intra_vjp = jax.vjp(prep, q, k, v, g, beta)
    starts, _ = _chunk_states(wk, wv, k_dec, decay, initial_state.astype(f32))  # [N, B, Hv, K, V]
    do_c = _chunk(do.astype(f32), n, c)  # [N, B, Hv, C, V], zero on pads
    xs = (starts, wk, wv, q_eff, k_dec, decay, do_c)
    ds0, (d_wk, d_wv, d_q_eff, d_k_dec, d_decay) = jax.lax.scan(
        _reverse_step, d_final.astype(f32), xs, reverse=True
    )
    # o = o_intra + q_eff S: the cotangent of o_intra is do itself.
    grads = intra_vjp((d_wk, d_wv, do_c, d_q_eff, d_k_dec, d_decay))
    return (*grads, ds0.astype(initial_state.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _with_vjp(forward, scale, q, k, v, g, beta, initial_state):
    return forward(q, k, v, g, beta, scale=scale, initial_state=initial_state)


def _with_vjp_fwd(forward, scale, q, k, v, g, beta, initial_state):
    out = forward(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    return out, (q, k, v, g, beta, initial_state)  # inputs only: the backward recomputes


def _with_vjp_bwd(forward, scale, res, cts):
    do, d_final = cts
    return gated_delta_rule_backward(*res, do, d_final, scale=scale)


_with_vjp.defvjp(_with_vjp_fwd, _with_vjp_bwd)


def gated_delta_rule_with_vjp(forward, q, k, v, g, beta, initial_state, *, scale):
    """forward(q, k, v, g, beta, *, scale, initial_state) -> (o, final_state), with the
    memory-lean XLA backward above as its VJP. initial_state must be an array (not None).

    `forward` and `scale` are static (python objects); reuse one `forward` object so jit
    caches hit.
    """
    return _with_vjp(forward, scale, q, k, v, g, beta, initial_state)
