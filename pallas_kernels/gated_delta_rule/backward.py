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

from .backward_kernels import reverse_state_pass
from .common import Policy, l2norm, next_pow2, run_on_platform
from .xla import _chunk, _chunk_states, _einsum, _prepare

f32 = jnp.float32

# Same trade-off as xla.CHUNK_SIZE; measured 1.07x / 1.08x / 1.16x faster than 64 at
# T = 512 / 2048 / 8192 on XLA:CPU. (The backward's chunking is independent of the forward's.)
BACKWARD_CHUNK_SIZE = 32
# With the Pallas state passes (GPU): fla's chunk, 64 rows per MMA tile.
PALLAS_BACKWARD_CHUNK_SIZE = 64


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
                              chunk_size=None, normalize=False, kernels="xla", precision=None):
    """Cotangents (dq, dk, dv, dg, dbeta, d_initial_state), each in its input's dtype.

    do [B, T, Hv, V] and d_final [B, Hv, K, V] are the cotangents of (o, final_state).
    normalize: the forward L2-normalised q and k itself (the norm's VJP joins step 4's).
    kernels: where steps 2-3 (the sequential state passes) run: "xla" (`lax.scan`), "pallas"
      (backward_kernels.py; interpreted on CPU), or "auto" (Pallas when lowered for a GPU, the
      XLA backward otherwise). precision: the Pallas kernels' policy ("fast" / "exact").
    """
    kw = dict(scale=scale, chunk_size=chunk_size, normalize=normalize, precision=precision)
    args = (q, k, v, g, beta, initial_state, do, d_final)
    if kernels == "auto":
        return jax.lax.platform_dependent(
            *args,
            cpu=functools.partial(gated_delta_rule_backward, kernels="xla", **kw),
            cuda=functools.partial(gated_delta_rule_backward, kernels="pallas", **kw),
            rocm=functools.partial(gated_delta_rule_backward, kernels="pallas", **kw),
            default=functools.partial(gated_delta_rule_backward, kernels="xla", **kw),
        )
    pallas = kernels == "pallas"
    c = chunk_size or (PALLAS_BACKWARD_CHUNK_SIZE if pallas else BACKWARD_CHUNK_SIZE)
    n = -(-q.shape[1] // c)

    def prep(q, k, v, g, beta):
        if normalize:
            q, k = l2norm(q), l2norm(k)
        return _prepare(q, k, v, g, beta, scale=scale, n=n, c=c)

    (wk, wv, _, q_eff, k_dec, decay), intra_vjp = jax.vjp(prep, q, k, v, g, beta)
    do_c = _chunk(do.astype(f32), n, c)  # [N, B, Hv, C, V], zero on pads
    s0, ds_n = initial_state.astype(f32), d_final.astype(f32)
    if pallas:
        pol = Policy.make(precision or "fast", v.dtype)
        ds0, cts = _pallas_state_passes(wk, wv, q_eff, k_dec, decay, do_c, s0, ds_n, pol)
        d_wk, d_wv, d_q_eff, d_k_dec, d_decay = cts
    else:
        starts, _ = _chunk_states(wk, wv, k_dec, decay, s0)  # [N, B, Hv, K, V]
        xs = (starts, wk, wv, q_eff, k_dec, decay, do_c)
        ds0, (d_wk, d_wv, d_q_eff, d_k_dec, d_decay) = jax.lax.scan(
            _reverse_step, ds_n, xs, reverse=True
        )
    # o = o_intra + q_eff S: the cotangent of o_intra is do itself.
    grads = intra_vjp((d_wk, d_wv, do_c, d_q_eff, d_k_dec, d_decay))
    return (*grads, ds0.astype(initial_state.dtype))


def _pallas_state_passes(wk, wv, q_eff, k_dec, decay, do_c, s0, ds_n, pol):
    """Steps 2-3 with backward_kernels.py. Per-chunk inputs [N, B, Hv, C, ...] are laid out
    [B, Hv, N C, ...] (K, V zero-padded to powers of two >= 16) and the cotangents back."""
    N, B, Hv, C, K = wk.shape
    V = wv.shape[-1]
    kp, vp = next_pow2(K), next_pow2(V)

    def rows(x, width):  # [N, B, Hv, C, X] -> [B, Hv, N C, width] in the policy's dtype
        x = jnp.moveaxis(x, 0, 2).reshape(B, Hv, N * C, x.shape[-1]).astype(pol.dtype)
        return jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])

    def chunks(x, width):  # [B, Hv, N C, width] -> [N, B, Hv, C, X]
        return jnp.moveaxis(x[..., :width].reshape(B, Hv, N, C, width), 2, 0)

    def pad_state(s):
        return jnp.pad(s, [(0, 0), (0, 0), (0, kp - K), (0, vp - V)])

    args = (rows(wk, kp), rows(wv, vp), rows(q_eff, kp), rows(k_dec, kp),
            jnp.moveaxis(decay, 0, 2), rows(do_c, vp), pad_state(s0), pad_state(ds_n))
    fn = functools.partial(_reverse_state_pass, c=C, pol=pol)
    d_wk, d_wv, d_qe, d_kd, d_dec, ds0 = run_on_platform(fn, None, *args)
    cts = (chunks(d_wk, K), chunks(d_wv, V), chunks(d_qe, K), chunks(d_kd, K),
           jnp.moveaxis(d_dec, 2, 0))
    return ds0[:, :, :K, :V], cts


def _reverse_state_pass(*args, c, pol, interpret):
    return reverse_state_pass(*args, c=c, pol=pol, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _with_vjp(forward, scale, normalize, precision, q, k, v, g, beta, initial_state):
    return _call(forward, scale, normalize, precision, q, k, v, g, beta, initial_state)


def _call(forward, scale, normalize, precision, q, k, v, g, beta, initial_state):
    if normalize or precision is not None:
        return forward(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       normalize=normalize, precision=precision)
    return forward(q, k, v, g, beta, scale=scale, initial_state=initial_state)


def _with_vjp_fwd(forward, scale, normalize, precision, q, k, v, g, beta, initial_state):
    out = _call(forward, scale, normalize, precision, q, k, v, g, beta, initial_state)
    return out, (q, k, v, g, beta, initial_state)  # inputs only: the backward recomputes


def _with_vjp_bwd(forward, scale, normalize, precision, res, cts):
    do, d_final = cts
    kernels = getattr(forward, "backward_kernels", "xla")
    return gated_delta_rule_backward(*res, do, d_final, scale=scale, normalize=normalize,
                                     kernels=kernels, precision=precision)


_with_vjp.defvjp(_with_vjp_fwd, _with_vjp_bwd)


def gated_delta_rule_with_vjp(forward, q, k, v, g, beta, initial_state, *, scale,
                              normalize=False, precision=None):
    """forward(q, k, v, g, beta, *, scale, initial_state[, normalize, precision]) ->
    (o, final_state), with the memory-lean XLA backward above as its VJP. initial_state must
    be an array (not None). normalize: the forward L2-normalises q and k itself; precision is
    passed through (both only when set).

    `forward`, `scale`, `normalize` and `precision` are static (python objects); reuse one
    `forward` object so jit caches hit.
    """
    return _with_vjp(forward, scale, normalize, precision, q, k, v, g, beta, initial_state)
