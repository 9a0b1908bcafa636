"""The one public entry point for the gated delta rule, with fla's argument conventions.

`chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
use_qk_l2norm_in_kernel=False, implementation=None) -> (o, final_state)`

Shapes: q, k [B, T, Hk, K]; v [B, T, Hv, V] with Hv % Hk == 0 (value head h reads key head
h // (Hv // Hk)); g, beta [B, T, Hv]; initial_state [B, Hv, K, V] or None (zeros).
Returns o [B, T, Hv, V] in v's dtype and final_state [B, Hv, K, V] float32.

Implementations live in `_IMPLEMENTATIONS`; each takes
`(q, k, v, g, beta, *, scale, initial_state)` with q/k already normalised if requested. An
explicit choice never falls back silently. This module does not jit: the caller owns the jit
boundary (scale, the flag and `implementation` are python values, static under jit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import recurrent_gated_delta_rule_reference
from .xla import chunk_gated_delta_rule_xla

# At or below this many tokens a token-by-token scan beats the chunked form: a chunk pads
# T up to 64 and pays for C x C decay matrices and a triangular solve that a handful of tokens
# does not need. A future Pallas decode kernel will be chosen by the same threshold.
RECURRENT_MAX_TOKENS = 16

DEFAULT_IMPLEMENTATION = "xla"

# Matches transformers' / fla's l2norm: x * rsqrt(sum(x * x) + eps), in float32.
L2NORM_EPS = 1e-6


def _xla(q, k, v, g, beta, *, scale, initial_state):
    """XLA backend: a plain scan for short inputs (decode), the chunked form otherwise."""
    if q.shape[1] <= RECURRENT_MAX_TOKENS:
        return recurrent_gated_delta_rule_reference(
            q, k, v, g, beta, scale=scale, initial_state=initial_state
        )
    return chunk_gated_delta_rule_xla(q, k, v, g, beta, scale=scale, initial_state=initial_state)


# A later "pallas" entry plugs in here with the same keyword signature.
_IMPLEMENTATIONS = {
    "reference": recurrent_gated_delta_rule_reference,
    "xla": _xla,
}


def l2norm(x, eps=L2NORM_EPS):
    """L2-normalise over the last axis in float32: x * rsqrt(sum(x * x) + eps)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _check_rank(name, x, rank):
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")


def _validate(q, k, v, g, beta, initial_state):
    """Raise ValueError naming the offending argument if shapes do not fit together."""
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        _check_rank(name, x, rank)
    if k.shape != q.shape:
        raise ValueError(
            f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)} [B, T, Hk, K]"
        )
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if v.shape[:2] != (B, T):
        raise ValueError(f"v shape {tuple(v.shape)} must start with q's (B, T) = {(B, T)}")
    if Hk == 0 or Hv % Hk != 0:
        raise ValueError(f"v heads Hv={Hv} must be a positive multiple of q/k heads Hk={Hk}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, Hv):
            raise ValueError(f"{name} shape {tuple(x.shape)} must be [B, T, Hv] = {(B, T, Hv)}")
    if initial_state is not None and initial_state.shape != (B, Hv, K, V):
        raise ValueError(
            f"initial_state shape {tuple(initial_state.shape)} must be [B, Hv, K, V] = "
            f"{(B, Hv, K, V)}"
        )


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    use_qk_l2norm_in_kernel=False,
    implementation=None,
):
    """Gated delta rule over a sequence; see the module docstring for shapes.

    Args:
      scale: multiplies q after any normalisation; None means K ** -0.5.
      use_qk_l2norm_in_kernel: L2-normalise q and k (float32, eps 1e-6) first.
      implementation: one of `_IMPLEMENTATIONS` ("reference", "xla"); None means "xla".

    Returns:
      (o [B, T, Hv, V] in v's dtype, final_state [B, Hv, K, V] float32).
    """
    name = DEFAULT_IMPLEMENTATION if implementation is None else implementation
    if name not in _IMPLEMENTATIONS:
        raise ValueError(
            f"unknown implementation {implementation!r}; valid choices: {sorted(_IMPLEMENTATIONS)}"
        )
    _validate(q, k, v, g, beta, initial_state)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return _IMPLEMENTATIONS[name](q, k, v, g, beta, scale=scale, initial_state=initial_state)
