"""The chunked delta rule's state pass on Pallas Mosaic GPU (pallas_kernels/gated_delta_rule/
mosaic.py), checked without a GPU: Pallas' GPU interpreter runs it on the CPU (TMA copies,
barriers and WGMMAs simulated) against plain JAX and against the Triton kernels' path, and the
public entry point lowered for CUDA carries it as a Mosaic GPU custom call. JAX 0.11+ only."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.pallas_kernels.compat import lower_for_cuda
from hybridjax.pallas_kernels.gated_delta_rule import chunk_gated_delta_rule, mosaic

pytestmark = pytest.mark.skipif(not mosaic.AVAILABLE, reason=f"Pallas Mosaic GPU as in JAX 0.11+ (JAX {jax.__version__})")

# bfloat16 operands: the kernel rounds the state and u to bfloat16 before each WGMMA (as the
# Triton "fast" policy does), spacing 2^-8 relative; a few roundings deep, 1e-2 of the largest value.
BF16_TOL = 1e-2


def err_ratio(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def inputs(T, hk=1, hv=2, kd=64, vd=64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, T, hk, kd))
    k = rng.standard_normal((1, T, hk, kd))
    v = rng.standard_normal((1, T, hv, vd))
    g = -np.exp(rng.uniform(-2, 1, (hv,))) * np.logaddexp(0, rng.standard_normal((1, T, hv)) - 1)
    beta = 1 / (1 + np.exp(-rng.standard_normal((1, T, hv))))
    s0 = rng.standard_normal((1, hv, kd, vd)) * 0.1
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    return (*bf, *(jnp.asarray(x, jnp.float32) for x in (g, beta, s0)))


def test_state_pass_matches_plain_jax_in_the_gpu_interpreter():
    rng = np.random.default_rng(1)
    B, T, hk, hv, kd, vd = 1, 128, 1, 2, 64, 64
    wk = jnp.asarray(rng.standard_normal((B, hv, T, kd)) * 0.1, jnp.bfloat16)
    wv = jnp.asarray(rng.standard_normal((B, hv, T, vd)), jnp.bfloat16)
    k = rng.standard_normal((B, T, hk, kd))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.bfloat16)
    row_scale, decay = mosaic.gate_scales(jnp.asarray(-np.abs(rng.standard_normal((B, T, hv))) * 0.1, jnp.float32))
    s0 = jnp.asarray(rng.standard_normal((B, hv, kd, vd)) * 0.1, jnp.float32)
    got = mosaic.state_pass_mosaic(wk, wv, k, row_scale, decay, s0, interpret=True)
    want = mosaic.state_pass_reference(wk, wv, k, row_scale, decay, s0)
    for name, a, b in zip(("u", "h", "final"), got, want):
        assert a.shape == b.shape, name
        assert err_ratio(a, b) < BF16_TOL, (name, err_ratio(a, b))


def test_mosaic_equals_the_triton_path_with_fused_norm_and_a_ragged_tail():
    # T = 100: two chunks, the second padded; the L2 norm is fused (1 / ||k|| folded into the
    # row scales on the Mosaic side); on CPU both run interpreted.
    args = inputs(100)
    kw = dict(initial_state=args[5], use_qk_l2norm_in_kernel=True)
    def run(impl):
        return lambda *a: chunk_gated_delta_rule(*a[:5], implementation=impl, **kw)

    o_m, s_m = run("mosaic")(*args)
    o_p, s_p = run("pallas")(*args)
    assert o_m.shape == o_p.shape and s_m.shape == s_p.shape
    # Interpreted, both round the same operands to bfloat16 and accumulate in float32: seen equal
    # to the bit; the tolerance is for the GPU, where the accumulation order differs.
    assert err_ratio(o_m, o_p) < BF16_TOL and err_ratio(s_m, s_p) < BF16_TOL
    program = str(jax.make_jaxpr(run("mosaic"))(*args))  # and the Mosaic kernel did run
    assert "wgmma_ref" in program and "copy_gmem_to_smem" in program
    assert "wgmma" not in str(jax.make_jaxpr(run("pallas"))(*args))


def test_lowers_for_cuda_with_the_mosaic_state_pass():
    sds = jax.ShapeDtypeStruct
    T, hk, hv, kd = 8192, 16, 32, 128  # the prefill timing shape of benchmarks/gpu_check.py
    args = (sds((1, T, hk, kd), jnp.bfloat16), sds((1, T, hk, kd), jnp.bfloat16), sds((1, T, hv, kd), jnp.bfloat16),
            sds((1, T, hv), jnp.float32), sds((1, T, hv), jnp.float32), sds((1, hv, kd, kd), jnp.float32))
    text = lower_for_cuda(lambda q, k, v, g, b, s: chunk_gated_delta_rule(
        q, k, v, g, b, initial_state=s, implementation="mosaic", use_qk_l2norm_in_kernel=True), *args).as_text()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    assert sorted(calls) == sorted(["__gpu$xla.gpu.triton", "mosaic_gpu_v2", "__gpu$xla.gpu.triton"]), calls
    assert "stablehlo.while" not in text  # no interpreter loop left


def test_mosaic_refuses_what_it_does_not_run():
    args = inputs(100)
    with pytest.raises(ValueError, match="'fast' policy on bfloat16"):
        chunk_gated_delta_rule(*args[:5], implementation="mosaic", precision="exact")
