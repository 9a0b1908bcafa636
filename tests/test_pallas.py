"""Pallas kernels of the gated delta rule, proven on a CPU-only machine three ways.

1. Numerically, in Pallas interpret mode: the chunk kernels (chunk.py) and the decode kernel
   (recurrent.py) equal the float32 token-by-token reference, in both precision policies (the
   "exact" one to float32 rounding, the "fast" one to bf16 rounding); the fused L2 norm, the
   decode kernel's state slots; the custom-VJP gradients equal `jax.grad` through the reference.
2. Lowered for CUDA from CPU: the public entry point with implementation="pallas" (and None)
   carries the compiled Triton kernels, not the interpreter's loops, and the decode kernel's
   state is aliased to its output. (tests/test_kernel_compile.py compiles them for sm_90/89.)
3. Wired into the model: `hybridjax.forward(..., implementation="pallas")` == "xla".

Interpret mode is slow and XLA compile time dominates on 2 cores, so shapes are small
(B = 2, Hk = 2, K = 16, V = 32), every case runs through one module-level jitted function that
computes all implementations at once, and results are cached so tests share compiles. "Without
an initial state" passes zeros as an array (same executable); `None` itself is covered by
`test_api_defaults`. Tolerances are error ratios max|a - b| / max|b| (in float64), named per
dtype below with their reasons; the measured ratios are printed (`pytest -s`).
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybridjax.pallas_kernels.gated_delta_rule.api as api
from hybridjax.pallas_kernels.compat import cuda_target
from hybridjax.pallas_kernels.gated_delta_rule import (
    RECURRENT_MAX_TOKENS,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_pallas,
    l2norm,
    recurrent_gated_delta_rule_pallas,
    recurrent_gated_delta_rule_reference,
)

from delta_inputs import SCALE, err_ratio, make_inputs  # noqa: E402

PARITY_TS = (1, 2, 63, 64, 65, 100, 300)  # around the 64-token chunk, and 5 chunks

# float32, "exact" policy: the chunk kernels add the same terms as the reference in another
# order (blocked matmuls, the blocked triangular inverse, exp(b_i - b_j) instead of a running
# product of exp(g_t)), so they differ by float32 rounding (eps 1.2e-7) accumulated over T;
# measured <= 1.3e-6 up to T = 300. The decode kernel runs the reference's own order (measured
# <= 2e-7). 2e-5 leaves a >10x margin and still catches any algebra or indexing slip (O(1)).
F32_TOL = 2e-5
# bfloat16 q/k/v, "exact": both sides upcast the same bf16 values, so the float32 state keeps
# F32_TOL; o is rounded to bf16 on output, where a float32 difference near a rounding boundary
# can flip one bf16 ulp: at most 2^-7 relative to max|o|.
BF16_O_TOL = 2.0**-7
# bfloat16 q/k/v, "fast" policy (fla's): every matmul operand is rounded to bf16 (relative 2^-9
# per rounding) and w, u and the chunk states h are stored in bf16, so each chunk adds a few bf16
# roundings to the state. fla checks its bf16 kernels with an RMS error ratio of ~5e-3; we hold
# the RMS ratio to that and the max ratio to 2e-2 (measured: RMS <= 4.1e-3 for o, which is
# itself bf16 on both sides, 3.2e-3 for the state; max <= 6.8e-3; flat in T: the same at
# T = 1000). Algebra slips are O(1) and still fail both.
FAST_RMS_TOL = 5e-3
FAST_MAX_TOL = 2e-2
# Gradients run longer float32 chains (the backward scan, the inverse's closed-form VJP);
# measured <= 2.5e-6.
GRAD_TOL = 1e-4
# The model: float32 everywhere, a few layers deep; same bound as tests/test_model.py. (Its
# "fast" float32 matmuls are TF32 on a GPU but full float32 in the CPU interpreter.)
MODEL_TOL = 1e-4


def rms_ratio(a, b):
    """fla's error ratio: RMS(a - b) / RMS(b), in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b**2)), 1e-30))


# These programs run once on tiny shapes, so compile time is the whole cost: LLVM at -O0 cuts it
# ~1.7x for the interpreted kernels. XLA's HLO passes still run; the arithmetic stays float32
# (up to the order of operations, which the tolerances already cover).
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, static_argnames=("fast",), compiler_options=FAST_COMPILE)
def _forward_all(q, k, v, g, beta, s0, fast=False):
    """{name: (o, state)}: the reference, the public "pallas" entry point ("exact"), the Pallas
    kernel the entry point did not pick for this T (so both kernels see every T), and with
    fast=True the chunk kernels under the "fast" policy."""
    kw = dict(scale=SCALE, initial_state=s0)
    out = {
        "ref": recurrent_gated_delta_rule_reference(q, k, v, g, beta, **kw),
        "api": chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=s0, implementation="pallas", precision="exact"
        ),
    }
    if q.shape[1] <= RECURRENT_MAX_TOKENS:  # the api ran the decode kernel
        out["chunk"] = chunk_gated_delta_rule_pallas(q, k, v, g, beta, precision="exact", **kw)
    else:  # the api ran the chunk kernels
        out["decode"] = recurrent_gated_delta_rule_pallas(q, k, v, g, beta, **kw)
    if fast:
        out["fast"] = chunk_gated_delta_rule_pallas(q, k, v, g, beta, precision="fast", **kw)
    return out


@functools.lru_cache(maxsize=None)
def forward_results(T, r, dtype_name="float32"):
    """{(init, name): (o, state)} as numpy, init in {"zeros", "state"}."""
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=T, qkv_dtype=jnp.dtype(dtype_name))
    fast = dtype_name != "float32"  # float32 "fast" dots are TF32 on a GPU, float32 here
    res = {}
    for init_name, init in (("zeros", jnp.zeros_like(s0)), ("state", s0)):
        for name, out in jax.device_get(_forward_all(q, k, v, g, beta, init, fast)).items():
            res[(init_name, name)] = out
    return res


def _check_forward(res, init, o_tol, s_tol):
    o_ref, s_ref = res[(init, "ref")]
    ratios = {}
    for (i, name), (o, s) in res.items():
        if i != init or name in ("ref", "fast"):
            continue
        assert o.shape == o_ref.shape and o.dtype == o_ref.dtype, name
        assert s.shape == s_ref.shape and s.dtype == np.float32, name
        ratios[name] = (err_ratio(o, o_ref), err_ratio(s, s_ref))
        assert ratios[name][0] < o_tol and ratios[name][1] < s_tol, (name, ratios[name])
    print(f"error ratios (o, state): {ratios}")


@pytest.mark.parametrize("init", ["zeros", "state"])
@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("T", PARITY_TS)
def test_pallas_matches_reference_f32(T, r, init):
    _check_forward(forward_results(T, r), init, F32_TOL, F32_TOL)


@pytest.mark.parametrize("init", ["zeros", "state"])
@pytest.mark.parametrize("T", [2, 65, 300])  # decode, the chunk boundary, five chunks
def test_pallas_matches_reference_bf16_inputs(T, init):
    res = forward_results(T, 2, "bfloat16")
    assert res[(init, "api")][0].dtype == jnp.bfloat16
    _check_forward(res, init, BF16_O_TOL, F32_TOL)


@pytest.mark.parametrize("init", ["zeros", "state"])
@pytest.mark.parametrize("T", [2, 65, 300])
def test_fast_policy_bf16_within_fla_tolerance(T, init):
    res = forward_results(T, 2, "bfloat16")
    (o, s), (o_ref, s_ref) = res[(init, "fast")], res[(init, "ref")]
    assert o.dtype == jnp.bfloat16 and s.dtype == np.float32
    ratios = dict(o_rms=rms_ratio(o, o_ref), s_rms=rms_ratio(s, s_ref),
                  o_max=err_ratio(o, o_ref), s_max=err_ratio(s, s_ref))
    print(f"fast-policy error ratios: {ratios}")
    assert max(ratios["o_rms"], ratios["s_rms"]) < FAST_RMS_TOL, ratios
    assert max(ratios["o_max"], ratios["s_max"]) < FAST_MAX_TOL, ratios
    # Not trivially equal to the exact policy: the bf16 roundings are really there.
    assert err_ratio(o, res[(init, "api")][0]) > 0 or T <= RECURRENT_MAX_TOKENS


@pytest.mark.parametrize("T", [2, 100])  # decode kernel and chunk kernels
def test_api_defaults(T):
    # scale=None -> K**-0.5, initial_state=None -> zeros; precision "fast" (float32 here).
    q, k, v, g, beta, _ = make_inputs(T, 2, seed=T)
    fn = functools.partial(chunk_gated_delta_rule, implementation="pallas")
    o, s = jax.jit(fn, compiler_options=FAST_COMPILE)(q, k, v, g, beta)
    o_want, s_want = forward_results(T, 2)[("zeros", "ref")]
    assert err_ratio(o, o_want) < F32_TOL and err_ratio(s, s_want) < F32_TOL


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("T", [3, 100])
def test_fused_l2norm_matches_reference(T, precision):
    # use_qk_l2norm_in_kernel with "pallas": the kernels normalise raw (unnormalised, scaled-up)
    # q and k themselves; the reference gets them normalised in XLA.
    q, k, v, g, beta, s0 = make_inputs(T, 2, seed=7, qkv_dtype=jnp.bfloat16, normalize_k=False)
    q, k = q * 3, k * 0.5

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def both(q, k, v, g, beta, s0):
        ours = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, implementation="pallas",
                                      use_qk_l2norm_in_kernel=True, precision=precision)
        ref = recurrent_gated_delta_rule_reference(l2norm(q), l2norm(k), v, g, beta,
                                                   scale=SCALE, initial_state=s0)
        return ours, ref

    (o, s), (o_ref, s_ref) = both(q, k, v, g, beta, s0)
    if precision == "exact" or T <= RECURRENT_MAX_TOKENS:
        assert err_ratio(o, o_ref) < BF16_O_TOL and err_ratio(s, s_ref) < F32_TOL
    else:
        assert rms_ratio(o, o_ref) < FAST_RMS_TOL and rms_ratio(s, s_ref) < FAST_RMS_TOL
        assert err_ratio(o, o_ref) < FAST_MAX_TOL and err_ratio(s, s_ref) < FAST_MAX_TOL


def test_decode_state_slots():
    # A pool of 5 slots; batch rows use slots 3, none (-1: padding) and 0. Used slots advance
    # as the reference does, every other slot is bit-identical, the padding row outputs zeros.
    T, r = 2, 2
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=11)  # B = 2 rows
    q, k, v, g, beta = (jnp.concatenate([x, x[:1]], axis=0) for x in (q, k, v, g, beta))
    pool = jnp.asarray(np.random.default_rng(1).standard_normal((5, *s0.shape[1:])), jnp.float32)
    idx = jnp.asarray([3, -1, 0], jnp.int32)
    fn = functools.partial(recurrent_gated_delta_rule_pallas, scale=SCALE)
    o, new_pool = jax.jit(fn, compiler_options=FAST_COMPILE)(
        q, k, v, g, beta, initial_state=pool, state_indices=idx)
    for row, slot in ((0, 3), (2, 0)):
        o_ref, s_ref = recurrent_gated_delta_rule_reference(
            q[row:row + 1], k[row:row + 1], v[row:row + 1], g[row:row + 1], beta[row:row + 1],
            scale=SCALE, initial_state=pool[slot:slot + 1])
        assert err_ratio(o[row:row + 1], o_ref) < F32_TOL
        assert err_ratio(new_pool[slot:slot + 1], s_ref) < F32_TOL
    assert not np.asarray(o[1]).any()
    for slot in (1, 2, 4):
        np.testing.assert_array_equal(np.asarray(new_pool[slot]), np.asarray(pool[slot]))


def test_varlen_packed_sequences_match_reference_per_sequence():
    # Five sequences packed along T (one empty, one a single token, one exactly a chunk, two
    # ragged), each with its own state: every sequence equals the reference run on its slice,
    # so no state or chunk leaks across a boundary.
    lens = [70, 0, 1, 64, 30]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v, g, beta, s0 = make_inputs(int(cu[-1]), 2, seed=13)
    q, k, v, g, beta = (x[:1] for x in (q, k, v, g, beta))
    init = jnp.asarray(np.random.default_rng(2).standard_normal((len(lens), *s0.shape[1:])),
                       jnp.float32)
    fn = functools.partial(chunk_gated_delta_rule, implementation="pallas", precision="exact")
    o, final = jax.jit(fn, compiler_options=FAST_COMPILE)(
        q, k, v, g, beta, initial_state=init, cu_seqlens=jnp.asarray(cu))
    assert o.shape == v.shape and final.shape == init.shape
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        o_ref, s_ref = recurrent_gated_delta_rule_reference(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale=SCALE,
            initial_state=init[i:i + 1])
        assert err_ratio(final[i:i + 1], s_ref) < F32_TOL, i
        if b > a:
            assert err_ratio(o[:, a:b], o_ref) < F32_TOL, i


def test_varlen_rejects_what_it_cannot_run():
    q, k, v, g, beta, _ = make_inputs(8, 2)
    cu = jnp.asarray([0, 3, 8], jnp.int32)
    with pytest.raises(ValueError, match="B = 1"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)  # B = 2
    one = [x[:1] for x in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="implementation 'pallas' or None"):
        chunk_gated_delta_rule(*one, cu_seqlens=cu, implementation="xla")
    with pytest.raises(ValueError, match=r"initial_state shape .* \[N, Hv, K, V\]"):
        chunk_gated_delta_rule(*one, cu_seqlens=cu, initial_state=jnp.zeros((1, 4, 16, 32)))


def test_strong_decay_is_finite():
    # g = -20 per token: gate sums reach -1280 within a chunk; exp must underflow to 0 and never
    # meet an overflowing exp(+...) times a zero mask.
    T, r = 100, 2  # a shape compiled for the parity tests
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=T)
    out = jax.device_get(_forward_all(q, k, v, jnp.full_like(g, -20.0), beta, s0))
    for name, (o, s) in out.items():
        assert np.isfinite(o).all() and np.isfinite(s).all(), name
        assert err_ratio(o, out["ref"][0]) < F32_TOL and err_ratio(s, out["ref"][1]) < F32_TOL


# ---- gradients -------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("impl", "norm"), compiler_options=FAST_COMPILE)
def _grads(args, w_o, w_s, impl, norm=False):
    """Gradients of <o, w_o> + <state, w_s> w.r.t. (q, k, v, g, beta, s0): reference autodiff
    and the public entry point's custom VJP (norm: use_qk_l2norm_in_kernel)."""

    def loss(fn, args):
        o, s = fn(*args)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s)

    def ref(q, k, v, g, beta, s0):
        if norm:
            q, k = l2norm(q), l2norm(k)
        return recurrent_gated_delta_rule_reference(q, k, v, g, beta, scale=SCALE, initial_state=s0)

    def ours(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, implementation=impl,
                                      use_qk_l2norm_in_kernel=norm)

    return jax.grad(loss, argnums=1)(ref, args), jax.grad(loss, argnums=1)(ours, args)


# (T, r): every T with grouped heads, Hv == Hk once.
GRAD_CASES = [(T, 2) for T in PARITY_TS] + [(65, 1)]


@pytest.mark.parametrize("T, r", GRAD_CASES)
def test_custom_vjp_gradients_match_reference(T, r):
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=T + 1)
    if T > 1:
        # A strongly negative gate must not make NaN gradients. (Not for T = 1: there every dg
        # is ~exp(-20) and both sides' values are float32 rounding noise.)
        g = g.at[:, T // 2].set(-20.0)
    rng = np.random.default_rng(T)
    w_o = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal(s0.shape), jnp.float32)
    # "pallas": the backward's state passes are the Pallas kernels of backward_kernels.py
    # (interpreted), the rest XLA; jax.grad drops the forward's (unused) output.
    g_ref, g_ours = _grads((q, k, v, g, beta, s0), w_o, w_s, impl="pallas")
    ratios = {}
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), g_ours, g_ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert np.isfinite(np.asarray(a)).all(), name
        ratios[name] = err_ratio(a, b)
    print(f"gradient error ratios: {ratios}")
    assert max(ratios.values()) < GRAD_TOL, ratios


def test_custom_vjp_gradients_with_fused_l2norm():
    # With the norm fused into the forward, the backward differentiates it itself.
    T, r = 65, 2
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=5, normalize_k=False)
    rng = np.random.default_rng(5)
    w_o = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal(s0.shape), jnp.float32)
    g_ref, g_ours = _grads((q, k, v, g, beta, s0), w_o, w_s, impl="pallas", norm=True)
    ratios = {n: err_ratio(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "state"),
                                                     g_ours, g_ref)}
    print(f"gradient error ratios (fused norm): {ratios}")
    assert max(ratios.values()) < GRAD_TOL, ratios


def test_pallas_backward_fast_policy_bf16():
    # bf16 inputs with "pallas": the backward's state passes run with bf16 operands (fast
    # policy), like fla's backward; same bounds as the forward's fast policy (measured RMS
    # <= 1.8e-3, max <= 5e-3 at T = 65 and 300).
    T, r = 65, 2
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=3, qkv_dtype=jnp.bfloat16)
    rng = np.random.default_rng(3)
    w_o = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal(s0.shape), jnp.float32)
    g_ref, g_ours = _grads((q, k, v, g, beta, s0), w_o, w_s, impl="pallas")
    names = ("q", "k", "v", "g", "beta", "state")
    ratios = {n: (rms_ratio(a, b), err_ratio(a, b)) for n, a, b in zip(names, g_ours, g_ref)}
    print(f"fast-policy gradient error ratios (rms, max): {ratios}")
    for n, a, b in zip(names, g_ours, g_ref):
        assert a.dtype == b.dtype, n
        assert ratios[n][0] < FAST_RMS_TOL and ratios[n][1] < FAST_MAX_TOL, (n, ratios[n])


def test_custom_vjp_gradients_bf16_inputs():
    # Cotangents come back in each input's dtype; values as float32 up to bf16 input rounding,
    # which both sides share (they differentiate the same upcast bf16 values).
    T, r = 65, 2
    q, k, v, g, beta, s0 = make_inputs(T, r, seed=3, qkv_dtype=jnp.bfloat16)
    rng = np.random.default_rng(3)
    w_o = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal(s0.shape), jnp.float32)
    g_ref, g_ours = _grads((q, k, v, g, beta, s0), w_o, w_s, impl="xla")
    ratios = {}
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), g_ours, g_ref):
        assert a.dtype == b.dtype, name
        ratios[name] = err_ratio(a, b)
        # bf16 cotangents: one bf16 rounding of each side's float32 value.
        tol = BF16_O_TOL if a.dtype == jnp.bfloat16 else GRAD_TOL
        assert ratios[name] < tol, name
    print(f"gradient error ratios: {ratios}")


# ---- lowering for CUDA from CPU --------------------------------------------------------------

TRITON_CALL = "__gpu$xla.gpu.triton"


def _lower(impl, T, *, platform="cuda", grad=False):
    """Lower the public entry point at a Qwen3.5-like head size, bf16 inputs, and return text."""
    hk, hv, kd, vd = 2, 4, 128, 128
    sds = jax.ShapeDtypeStruct
    args = (
        sds((1, T, hk, kd), jnp.bfloat16),
        sds((1, T, hk, kd), jnp.bfloat16),
        sds((1, T, hv, vd), jnp.bfloat16),
        sds((1, T, hv), jnp.float32),
        sds((1, T, hv), jnp.float32),
        sds((1, hv, kd, vd), jnp.float32),
    )

    def f(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=True, implementation=impl
        )

    def loss(*a):
        return sum(jnp.sum(x.astype(jnp.float32)) for x in f(*a))

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5)) if grad else f
    with cuda_target() if platform == "cuda" else contextlib.nullcontext():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("impl", ["pallas", None])
@pytest.mark.parametrize("T, kernels", [(3, 1), (RECURRENT_MAX_TOKENS + 1, 3), (300, 3)])
def test_lowers_for_cuda_with_triton_kernels(impl, T, kernels):
    # decode: one kernel; prefill: intra-chunk solve, state pass, output.
    text = _lower(impl, T)
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    assert calls == [TRITON_CALL] * kernels, calls
    # The interpreter runs a kernel as a while loop over its grid; none may be left.
    assert "stablehlo.while" not in text


def test_cpu_lowering_interprets_and_default_is_xla_on_cpu():
    assert "stablehlo.while" in _lower("pallas", 100, platform="cpu")
    for impl in ("pallas", None, "xla"):
        assert TRITON_CALL not in _lower(impl, 100, platform="cpu"), impl
    assert TRITON_CALL not in _lower("xla", 100)  # an explicit "xla" stays XLA on GPU too


@pytest.mark.parametrize("impl", ["pallas", None])
def test_gradient_lowers_for_cuda(impl):
    # value_and_grad keeps the forward's three Triton kernels and adds the backward's two state
    # passes (the per-chunk part of the backward is XLA).
    text = _lower(impl, 100, grad=True)
    names = re.findall(r'name = "(gdr_\w+)"', text)
    assert sorted(names) == sorted(["gdr_intra", "gdr_state", "gdr_output", "gdr_bwd_states",
                                    "gdr_bwd_reverse"]), names
    assert text.count(TRITON_CALL) == 5
    assert TRITON_CALL not in _lower(impl, 100, platform="cpu", grad=True)


def test_decode_state_is_aliased_in_place():
    # The decode kernel writes the state into its input buffer: operand 6 (the state) is
    # aliased to output 1, so a donated cache is updated without a copy.
    text = _lower("pallas", 3)
    call = next(line for line in text.splitlines() if TRITON_CALL in line)
    assert re.search(r"output_operand_aliases = \[#stablehlo.output_operand_alias<output_tuple_indices"
                     r" = \[1\], operand_index = 6", call), call[:300]


def test_unknown_precision_fails_fast():
    q, k, v, g, beta, _ = make_inputs(3, 2)
    with pytest.raises(ValueError, match=r"unknown precision 'tf32'"):
        chunk_gated_delta_rule(q, k, v, g, beta, implementation="pallas", precision="tf32")


# ---- choices that cannot run fail fast -------------------------------------------------------


def test_unknown_implementation_fails_fast():
    q, k, v, g, beta, _ = make_inputs(3, 2)
    with pytest.raises(ValueError, match=r"'triton'.*\['mosaic', 'pallas', 'reference', 'xla'\]"):
        chunk_gated_delta_rule(q, k, v, g, beta, implementation="triton")


def test_pallas_on_unsupported_backend_fails_fast(monkeypatch):
    monkeypatch.setattr(api.jax, "default_backend", lambda: "tpu")
    q, k, v, g, beta, _ = make_inputs(3, 2)
    with pytest.raises(ValueError, match="implementation='pallas' cannot run on the 'tpu'"):
        chunk_gated_delta_rule(q, k, v, g, beta, implementation="pallas")


def test_chunk_size_must_be_a_power_of_two():
    q, k, v, g, beta, _ = make_inputs(3, 2)
    with pytest.raises(ValueError, match="power of two"):
        chunk_gated_delta_rule_pallas(q, k, v, g, beta, scale=SCALE, chunk_size=48)


# ---- the model -------------------------------------------------------------------------------


def test_model_logits_pallas_equal_xla():
    import hybridjax
    from hybridjax.default_model import TINY_CONFIG

    # Two layers of the default tiny model: one Gated DeltaNet, one attention (compile time).
    cfg = hybridjax.config_from_dict(
        {**TINY_CONFIG, "num_hidden_layers": 2, "full_attention_interval": 2}
    )
    params = hybridjax.init_params(jax.random.PRNGKey(0), cfg)
    fwd = jax.jit(
        hybridjax.forward, static_argnames=("cfg", "implementation"), compiler_options=FAST_COMPILE
    )
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 21)).astype(np.int32)
    prompt, nxt = tokens[:, :20], tokens[:, 20:]  # prefill (chunk kernels), then one decode step
    assert prompt.shape[1] > RECURRENT_MAX_TOKENS
    out = {}
    for impl in ("xla", "pallas"):
        cache = hybridjax.reserve(hybridjax.init_cache(cfg, 1, 64), 21)
        logits, cache = fwd(params, prompt, cache, cfg, implementation=impl)
        step, cache = fwd(params, nxt, cache, cfg, implementation=impl)
        out[impl] = (logits, step, [layer.ssm for layer in cache.layers if hasattr(layer, "ssm")])
    (l_x, s_x, st_x), (l_p, s_p, st_p) = out["xla"], out["pallas"]
    assert len(st_x) == 1
    assert float(np.abs(np.asarray(l_x)).max()) > 0
    ratios = dict(prefill=err_ratio(l_p, l_x), decode=err_ratio(s_p, s_x))
    ratios.update({f"state{i}": err_ratio(a, b) for i, (a, b) in enumerate(zip(st_p, st_x))})
    print(f"model error ratios: {ratios}")
    assert max(ratios.values()) < MODEL_TOL, ratios
