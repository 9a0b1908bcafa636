"""The chunked delta rule's forward on Pallas Mosaic GPU (pallas_kernels/gated_delta_rule/
mosaic.py: intra-chunk solve, state pass, output), checked without a GPU: Pallas' GPU interpreter
runs each kernel on the CPU (TMA copies, barriers and WGMMAs simulated) against float64 numpy /
plain JAX, the whole forward against the reference recurrence and the Triton kernels' path, and
the public entry point lowered for CUDA carries three Mosaic GPU custom calls whose WGMMAs are
counted. JAX 0.11+ only (the module skips on 0.10, which has no Mosaic GPU interpreter)."""

from __future__ import annotations

import collections
import contextlib
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
# The whole forward against the float32 reference: fla's bf16 tolerances, as tests/test_pallas.py
# uses for the Triton "fast" policy (RMS of the error over RMS of the value; max ratio).
FAST_RMS_TOL, FAST_MAX_TOL = 5e-3, 2e-2


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


def f64(x):
    return np.asarray(x, np.float64)


def test_intra_chunk_solve_matches_numpy_with_correlated_keys():
    # Keys sharing a direction (cosines ~0.8) and slow gates make (I + A)^{-1} far from I - A:
    # here one doubling level fewer in the recursive inverse gives errors of 0.2-0.8, and the
    # product form prod (I + N^(2^k)) gave 1e2-1e3 (catastrophic cancellation). Unnormalised keys,
    # with 1 / ||k|| passed as rk, as the fused norm does.
    rng = np.random.default_rng(2)
    B, T, hk, hv, kd, vd = 1, 128, 1, 2, 64, 64
    k = 0.7 * rng.standard_normal((1, 1, 1, kd)) + 0.3 * rng.standard_normal((B, T, hk, kd))
    k = jnp.asarray(k * 3, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, T, hv, vd)), jnp.bfloat16)
    g = -np.abs(rng.standard_normal((B, T, hv))) * 0.02
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, hv))))
    rk = 1 / np.linalg.norm(f64(k), axis=-1)  # [B, T, hk]
    rk_h = np.repeat(np.moveaxis(rk, 2, 1), hv // hk, axis=1)  # [B, hv, T]
    vecs = mosaic.intra_vectors(jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32),
                                jnp.asarray(rk_h, jnp.float32))
    wk, wv = mosaic.intra_mosaic(k, v, vecs, r=hv // hk, interpret=True)
    assert wk.shape == (B, hv, T, kd) and wv.shape == (B, hv, T, vd)
    for h in range(hv):
        for n in range(T // mosaic.CHUNK):
            rows = slice(n * 64, (n + 1) * 64)
            kc = f64(k)[0, rows, h // (hv // hk)] * rk_h[0, h, rows, None]
            b, bt = np.cumsum(g[0, rows, h]), beta[0, rows, h]
            a = np.tril(bt[:, None] * (kc @ kc.T) * np.exp(b[:, None] - b[None, :]), -1)
            w = np.linalg.inv(np.eye(64) + a)
            want_k, want_v = w @ ((bt * np.exp(b))[:, None] * kc), w @ (bt[:, None] * f64(v)[0, rows, h])
            # bfloat16 W, scaled rows and outputs (three roundings of 2^-9); seen <= 6.5e-3
            assert err_ratio(wk[0, h, rows], want_k) < BF16_TOL, (h, n, err_ratio(wk[0, h, rows], want_k))
            assert err_ratio(wv[0, h, rows], want_v) < BF16_TOL, (h, n, err_ratio(wv[0, h, rows], want_v))


def test_output_kernel_matches_numpy():
    rng = np.random.default_rng(3)
    B, T, hk, hv, kd, vd = 1, 128, 1, 2, 64, 128  # V = 128: two 64-column programs per chunk
    q, k = (jnp.asarray(rng.standard_normal((B, T, hk, kd)), jnp.bfloat16) for _ in range(2))
    u = jnp.asarray(rng.standard_normal((B, hv, T, vd)), jnp.bfloat16)
    hs = jnp.asarray(rng.standard_normal((B, hv, T // 64, kd, vd)) * 0.1, jnp.bfloat16)
    g = -np.abs(rng.standard_normal((B, T, hv))) * 0.1
    rq = np.repeat(np.moveaxis(0.125 / np.linalg.norm(f64(q), axis=-1), 2, 1), hv, axis=1)
    rk = np.repeat(np.moveaxis(1 / np.linalg.norm(f64(k), axis=-1), 2, 1), hv, axis=1)
    vecs = mosaic.output_vectors(jnp.asarray(g, jnp.float32), jnp.asarray(rq, jnp.float32),
                                 jnp.asarray(rk, jnp.float32))
    o = mosaic.output_mosaic(q, k, u, hs, vecs, out_dtype=jnp.bfloat16, interpret=True)
    assert o.shape == (B, T, hv, vd)
    for h in range(hv):
        for n in range(T // 64):
            rows = slice(n * 64, (n + 1) * 64)
            qc, kc = f64(q)[0, rows, 0] * rq[0, h, rows, None], f64(k)[0, rows, 0] * rk[0, h, rows, None]
            b = np.cumsum(g[0, rows, h])
            p = np.tril((qc @ kc.T) * np.exp(b[:, None] - b[None, :]))
            want = np.exp(b)[:, None] * (qc @ f64(hs)[0, h, n]) + p @ f64(u)[0, h, rows]
            # P rounded to bfloat16 for its WGMMA, o stored in bfloat16
            assert err_ratio(o[0, rows, h], want) < BF16_TOL, (h, n, err_ratio(o[0, rows, h], want))


def test_mosaic_forward_matches_the_reference_and_the_triton_path():
    # T = 100: two chunks, the second zero-padded; the L2 norm is fused (1 / ||q||, 1 / ||k|| as
    # row / column scales); on CPU both paths run interpreted.
    args = inputs(100)
    kw = dict(initial_state=args[5], use_qk_l2norm_in_kernel=True)
    def run(impl):
        return lambda *a: chunk_gated_delta_rule(*a[:5], implementation=impl, **kw)

    o_m, s_m = run("mosaic")(*args)
    o_r, s_r = run("reference")(*(x.astype(jnp.float32) for x in args))
    assert o_m.shape == o_r.shape and s_m.shape == s_r.shape
    rms = lambda a, b: float(np.sqrt(np.mean((f64(a) - f64(b)) ** 2) / np.mean(f64(b) ** 2)))  # noqa: E731
    assert max(rms(o_m, o_r), rms(s_m, s_r)) < FAST_RMS_TOL, (rms(o_m, o_r), rms(s_m, s_r))
    assert max(err_ratio(o_m, o_r), err_ratio(s_m, s_r)) < FAST_MAX_TOL, (err_ratio(o_m, o_r), err_ratio(s_m, s_r))
    # The Triton path rounds the same operands, but solves by substitution: close, not bitwise.
    o_p, s_p = run("pallas")(*args)
    assert err_ratio(o_m, o_p) < BF16_TOL and err_ratio(s_m, s_p) < BF16_TOL
    program = str(jax.make_jaxpr(run("mosaic"))(*args))  # all three stages are Mosaic kernels
    assert program.count("copy_gmem_to_smem") >= 3 and "wgmma_ref" in program
    assert "wgmma" not in str(jax.make_jaxpr(run("pallas"))(*args))


@contextlib.contextmanager
def mosaic_modules():
    """Collect the MLIR text of each Mosaic GPU kernel as JAX lowers it (already in the LLVM /
    NVVM dialects; the custom call itself carries it as bytecode). Wraps a JAX-internal hook,
    `_run_serde_pass`, as the README says; yields a list filled during the block."""
    from jax.experimental.mosaic.gpu import core

    texts, serde = [], core._run_serde_pass

    def capture(module, *, serialize, **kw):
        if serialize:
            texts.append(str(module))
        return serde(module, serialize=serialize, **kw)

    core._run_serde_pass = capture
    try:
        yield texts
    finally:
        core._run_serde_pass = serde


def wgmma_shapes(text):
    return collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)", text))


def test_lowers_for_cuda_with_three_mosaic_kernels():
    sds = jax.ShapeDtypeStruct
    T, hk, hv, kd = 8192, 16, 32, 128  # the prefill timing shape of benchmarks/gpu_check.py
    args = (sds((1, T, hk, kd), jnp.bfloat16), sds((1, T, hk, kd), jnp.bfloat16), sds((1, T, hv, kd), jnp.bfloat16),
            sds((1, T, hv), jnp.float32), sds((1, T, hv), jnp.float32), sds((1, hv, kd, kd), jnp.float32))
    if not hasattr(pytest.importorskip("jax.experimental.mosaic.gpu.core"), "_run_serde_pass"):
        pytest.skip("this JAX has no _run_serde_pass to read the kernels' MLIR from")
    with mosaic_modules() as texts:
        text = lower_for_cuda(lambda q, k, v, g, b, s: chunk_gated_delta_rule(
            q, k, v, g, b, initial_state=s, implementation="mosaic", use_qk_l2norm_in_kernel=True), *args).as_text()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    assert calls == ["mosaic_gpu_v2"] * 3, calls  # no Triton kernel left in the forward
    assert "stablehlo.while" not in text  # no interpreter loop left
    assert len(texts) == 3, len(texts)
    # Each WGMMA instruction is one inline-asm op in the MLIR; loops are not unrolled, so the
    # state pass's figure is per chunk step and the others' per program (one chunk).
    intra, state, output = (wgmma_shapes(t) for t in texts)
    bf = ".f32.bf16.bf16"
    # A: K = 128 in k16 steps (8); the inverse: 5 doublings x 2 products x 3 hi/lo parts x C = 64
    # in k16 steps (120); wk and wv: [C, C] x [C, 128], 4 each.
    assert intra == {"m64n64k16" + bf: 8 + 120, "m64n128k16" + bf: 8}, intra
    assert state == {"m64n64k16" + bf: 16}, state  # wk S (8) and k^T u (2 x 4)
    # q k^T (8), q h (8), P u (4)
    assert output == {"m64n64k16" + bf: 20}, output
    assert all("cp.async.bulk.tensor" in t for t in texts)  # TMA in and out
    print(f"\nWGMMAs at T={T}, Hv={hv}: intra {dict(intra)}; state per chunk {dict(state)}; output {dict(output)}")


def test_mosaic_refuses_what_it_does_not_run():
    # float32 / "exact": WGMMA takes float32 only as TF32 with K-major operands on both sides,
    # which the state pass's k^T and the transposed products here do not have.
    args = inputs(100)
    with pytest.raises(ValueError, match="'fast' policy on bfloat16"):
        chunk_gated_delta_rule(*args[:5], implementation="mosaic", precision="exact")
    with pytest.raises(ValueError, match="'fast' policy on bfloat16"):
        chunk_gated_delta_rule(*(x.astype(jnp.float32) for x in args[:5]), implementation="mosaic")
