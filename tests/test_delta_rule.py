"""Gated delta rule: chunked XLA == token-by-token reference == float64 numpy loop == transformers.

Kept fast on a 2-core CPU, where XLA compile time dominates: small B/K/V, one jitted function
per implementation compiled once per shape, and results cached so tests share shapes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.pallas_kernels.gated_delta_rule import (
    RECURRENT_MAX_TOKENS,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_xla,
    recurrent_gated_delta_rule_reference,
)

from delta_inputs import B, HK, K, SCALE, V, err_ratio, make_inputs  # noqa: E402

# Tolerances on the error ratio max|a - b| / max|b|, per dtype.
# float32 has eps ~1.2e-7. The chunked form adds the same terms in another order (blocked
# matmuls, the triangular inverse, exp(b_i - b_j) instead of a running product of exp(g_t)), so
# the two differ by accumulated rounding that grows slowly with T: measured <= 1.3e-6 up to
# T = 1000. 2e-5 leaves a >10x margin and still catches any algebra slip (those are O(1)).
F32_TOL = 2e-5
# bfloat16 q/k/v: both sides upcast the same bf16 values, so the float32 state keeps F32_TOL;
# o is rounded to bf16 on output, where a float32 difference near a rounding boundary can flip
# one bf16 ulp, at most 2^-7 of max|o| (measured ~3e-4).
BF16_O_TOL = 2.0**-7
# Gradients run longer float32 chains (backward scans, the inverse's VJP); measured <= 5e-7.
GRAD_TOL = 1e-4
# Against the float64 loop: only float32 rounding of the implementation; measured <= 1.2e-6.
F64_TOL = 1e-5

PARITY_TS = (1, 2, 63, 64, 65, 100, 300, 1000)


def naive_f64(q, k, v, g, beta, state, scale):
    """Independent float64 oracle in the product form S = e^g (I - b k k^T) S + b k v^T."""
    q, k, v, g, beta, state = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    b_, t_, hk, _ = q.shape
    hv = v.shape[2]
    o = np.zeros(v.shape)
    s = state.copy()
    for bi in range(b_):
        for h in range(hv):
            kh = h // (hv // hk)
            for t in range(t_):
                kt = k[bi, t, kh]
                bt = beta[bi, t, h]
                proj = np.eye(len(kt)) - bt * np.outer(kt, kt)
                s[bi, h] = np.exp(g[bi, t, h]) * proj @ s[bi, h] + bt * np.outer(kt, v[bi, t, h])
                o[bi, t, h] = s[bi, h].T @ (scale * q[bi, t, kh])
    return o, s


# One jit per function; jax caches one executable per input shape, so tests that reuse a
# (T, Hv/Hk) shape reuse the compiled code. "Without initial state" passes zeros as an array
# (same executable); `None` itself is covered through the public API below.
REF = jax.jit(recurrent_gated_delta_rule_reference, static_argnames=("scale",))
XLA = jax.jit(chunk_gated_delta_rule_xla, static_argnames=("scale", "chunk_size"))

# (T, Hv / Hk): every T with grouped heads; Hv == Hk once (the repeat is then the identity).
F32_CASES = [(T, 2) for T in PARITY_TS] + [(65, 1)]
BF16_CASES = [(300, 2)]


@functools.lru_cache(maxsize=None)
def parity_results(T, r, dtype_name="float32"):
    """{(init, impl): (o, state)} as numpy, for init in {zeros, state}, impl in {ref, xla}."""
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=T, qkv_dtype=jnp.dtype(dtype_name))
    out = {}
    for init_name, init in (("zeros", jnp.zeros_like(s0)), ("state", s0)):
        for impl, fn in (("ref", REF), ("xla", XLA)):
            out[(init_name, impl)] = jax.device_get(
                fn(q, k, v, g, beta, scale=SCALE, initial_state=init)
            )
    return out


@pytest.mark.parametrize("init", ["zeros", "state"])
@pytest.mark.parametrize("T, r", F32_CASES)
def test_xla_matches_reference_f32(T, r, init):
    res = parity_results(T, r)
    (o_ref, s_ref), (o_xla, s_xla) = res[(init, "ref")], res[(init, "xla")]
    assert o_xla.shape == o_ref.shape == (B, T, r * HK, V)
    assert o_xla.dtype == np.float32
    assert s_xla.shape == (B, r * HK, K, V) and s_xla.dtype == np.float32
    assert err_ratio(o_xla, o_ref) < F32_TOL
    assert err_ratio(s_xla, s_ref) < F32_TOL


@pytest.mark.parametrize("init", ["zeros", "state"])
@pytest.mark.parametrize("T, r", BF16_CASES)
def test_xla_matches_reference_bf16_inputs(T, r, init):
    res = parity_results(T, r, "bfloat16")
    (o_ref, s_ref), (o_xla, s_xla) = res[(init, "ref")], res[(init, "xla")]
    assert o_xla.dtype == o_ref.dtype == jnp.bfloat16
    assert s_xla.dtype == np.float32
    assert err_ratio(o_xla, o_ref) < BF16_O_TOL
    assert err_ratio(s_xla, s_ref) < F32_TOL


@pytest.mark.parametrize("init", ["zeros", "state"])
def test_reference_and_xla_match_float64_loop(init):
    # Checks the oracle itself: an independent float64 loop in the product form.
    T, r = 65, 2  # a shape already compiled for the parity tests
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=T)
    s0 = np.zeros_like(s0) if init == "zeros" else s0
    o_64, s_64 = naive_f64(q, k, v, g, beta, s0, SCALE)
    res = parity_results(T, r)
    for impl in ("ref", "xla"):
        o, s = res[(init, impl)]
        assert err_ratio(o, o_64) < F64_TOL, impl
        assert err_ratio(s, s_64) < F64_TOL, impl


def test_matches_transformers_with_qk_l2norm():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    T, r = 100, 2  # T > RECURRENT_MAX_TOKENS, so "xla" takes the chunked path
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=2, normalize_k=False)

    @jax.jit
    def ours(q, k, v, g, beta, s0):
        kw = dict(initial_state=s0, use_qk_l2norm_in_kernel=True)
        return {
            name: chunk_gated_delta_rule(q, k, v, g, beta, **kw, implementation=name)
            for name in ("reference", "xla")
        }

    results = ours(q, k, v, g, beta, s0)
    t = [torch.from_numpy(np.array(x)) for x in (q, k, v, g, beta, s0)]
    kw = dict(initial_state=t[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
    theirs = {
        "chunk": hf.torch_chunk_gated_delta_rule(*t[:5], **kw),
        "recurrent": hf.torch_recurrent_gated_delta_rule(*t[:5], **kw),
    }
    for name, (o, s) in results.items():
        for hf_name, (o_t, s_t) in theirs.items():
            assert err_ratio(o, o_t.numpy()) < F32_TOL, (name, hf_name)
            assert err_ratio(s, s_t.numpy()) < F32_TOL, (name, hf_name)


def test_strong_decay_is_finite():
    # g = -20 per token: gate sums reach -1280 within a chunk; exp must underflow to 0 and never
    # meet an overflowing exp(+...) times a zero mask.
    T, r = 100, 2
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=T)
    g = jnp.full_like(g, -20.0)
    for fn in (REF, XLA):
        o, s = fn(q, k, v, g, beta, scale=SCALE, initial_state=s0)
        assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
        # exp(-20) ~ 2e-9: the state keeps only the last token's write, beta k v^T.
        k_last = np.repeat(np.asarray(k[:, -1]), r, axis=1)  # [B, Hv, K]
        want = np.einsum("bhk,bhv->bhkv", k_last, np.asarray(v[:, -1]))
        want = want * np.asarray(beta[:, -1])[..., None, None]
        assert err_ratio(s, want) < 1e-6


def test_gradients_agree():
    T, r = 40, 2
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=4)
    g = g.at[:, 5].set(-20.0)  # strongly negative gates must not make NaN gradients
    rng = np.random.default_rng(5)
    w_o = jnp.asarray(rng.standard_normal((B, T, r * HK, V)), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal((B, r * HK, K, V)), jnp.float32)

    def loss(fn, args):
        o, s = fn(*args[:5], scale=SCALE, initial_state=args[5])
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    xla16 = functools.partial(chunk_gated_delta_rule_xla, chunk_size=16)  # 3 chunks, padded

    @jax.jit
    def grads(args):
        return (
            jax.grad(loss, argnums=1)(recurrent_gated_delta_rule_reference, args),
            jax.grad(loss, argnums=1)(xla16, args),
        )

    g_ref, g_xla = grads((q, k, v, g, beta, s0))
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), g_xla, g_ref):
        assert np.isfinite(np.asarray(a)).all(), name
        assert err_ratio(a, b) < GRAD_TOL, name


@pytest.mark.parametrize("T", [2, 100])  # the scan path (<= RECURRENT_MAX_TOKENS) and chunked
def test_api_defaults(T):
    # scale=None -> K**-0.5, initial_state=None -> zeros, implementation=None -> "xla".
    assert (T <= RECURRENT_MAX_TOKENS) == (T == 2)
    r = 2
    q, k, v, g, beta, _ = make_inputs(T, r, seed=T)
    o, s = jax.jit(chunk_gated_delta_rule)(q, k, v, g, beta)
    o_want, s_want = parity_results(T, r)[("zeros", "xla")]
    assert o.shape == o_want.shape and s.shape == s_want.shape and s.dtype == jnp.float32
    assert err_ratio(o, o_want) < F32_TOL and err_ratio(s, s_want) < F32_TOL


def test_empty_sequence():
    q, k, v, g, beta, s0 = make_inputs(0, 2)
    for fn in (
        functools.partial(chunk_gated_delta_rule_xla, scale=SCALE),
        functools.partial(chunk_gated_delta_rule, implementation="xla"),
    ):
        o, s = fn(q, k, v, g, beta, initial_state=s0)
        assert o.shape == (B, 0, 2 * HK, V)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))


def _shape_args(T=3, hk=2, hv=4):
    z = np.zeros
    return dict(
        q=z((B, T, hk, K)), k=z((B, T, hk, K)), v=z((B, T, hv, V)),
        g=z((B, T, hv)), beta=z((B, T, hv)),
    )  # fmt: skip


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=np.zeros((B, 3, K))), "q must have rank 4"),
        (dict(k=np.zeros((B, 3, 2, K + 1))), "k shape"),
        (dict(v=np.zeros((B, 4, 4, V))), "v shape"),
        (dict(v=np.zeros((B, 3, 3, V)), g=np.zeros((B, 3, 3)), beta=np.zeros((B, 3, 3))), "Hv=3"),
        (dict(g=np.zeros((B, 3, 2))), "g shape"),
        (dict(beta=np.zeros((B, 3))), "beta must have rank 3"),
        (dict(initial_state=np.zeros((B, 4, V, K))), "initial_state shape"),
    ],
)
def test_validation_errors(change, match):
    args = {**_shape_args(), **change}
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule(**args)


def test_unknown_implementation_names_choices():
    with pytest.raises(ValueError, match=r"'triton'.*\['mosaic', 'pallas', 'reference', 'xla'\]"):
        chunk_gated_delta_rule(**_shape_args(), implementation="triton")
