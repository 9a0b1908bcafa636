"""Shared inputs for the delta-rule tests (test_delta_rule.py, test_pallas.py).

Small shapes (compile time dominates on 2 cores) with B > 1 and K != V, so a swapped batch or
K/V axis cannot pass.
"""

import jax.numpy as jnp
import numpy as np

B, HK, K, V = 2, 2, 16, 32
SCALE = K**-0.5


def err_ratio(a, b):
    """max|a - b| / max(max|b|, tiny), in float64."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-30))


def make_inputs(T, r, *, seed=0, qkv_dtype=jnp.float32, normalize_k=True):
    """Random inputs with model-like gates; Hv = r * HK. Returns (q, k, v, g, beta, state)."""
    rng = np.random.default_rng(seed)
    hv = r * HK
    q = rng.standard_normal((B, T, HK, K))
    k = rng.standard_normal((B, T, HK, K))
    if normalize_k:
        # Unit keys keep (I - beta k k^T) a contraction, as in the model (keys are L2-normalised);
        # unnormalised keys with beta ~ 1 make the state blow up and the ratio meaningless.
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, hv, V))
    # g = -exp(A_log) * softplus(a + dt_bias), as in Qwen3-Next; beta = sigmoid(b).
    a_log = rng.uniform(-2.0, 1.0, size=(hv,))
    g = -np.exp(a_log) * np.logaddexp(0.0, rng.standard_normal((B, T, hv)) - 1.0)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, hv))))
    state = rng.standard_normal((B, hv, K, V))
    qkv = [jnp.asarray(x, qkv_dtype) for x in (q, k, v)]
    rest = [jnp.asarray(x, jnp.float32) for x in (g, beta, state)]
    return (*qkv, *rest)
