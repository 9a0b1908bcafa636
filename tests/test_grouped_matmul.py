"""hybridjax.pallas_kernels.grouped_matmul (XLA loop, ragged_dot, the Pallas kernel in the interpreter and
lowered for CUDA) and the CPU kernel's indexed matmul against the naive reference.

Cases: empty groups, a group of one row, rows past the groups (must come out zero), tiles that
straddle groups, transposed weights, gradients (against autodiff of the plain reference, which
has no custom VJP), bfloat16. float32 results differ from the reference only in summation
order within one dot: 1e-5 relative (measured ~1e-7); bfloat16 inputs: the same products
accumulated in float32 by both, 1e-5 as well, against the reference on the same bf16 values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax import cpu_kernels, moe
from hybridjax.pallas_kernels.compat import lower_for_cuda
from hybridjax.pallas_kernels.grouped_matmul import gmm_pallas, gmm_reference, grouped_matmul, tgmm_reference, tgmm_xla

RTOL = 1e-5
M, K, N = 37, 16, 32  # K, N multiples of 16: the Pallas kernel takes them
SIZES = np.array([5, 0, 12, 1, 0, 15], np.int32)  # sum 33 < M: four rows past the groups


def err_ratio(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def operands(dtype=jnp.float32, transposed=False):
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (M, K), dtype)
    w = jax.random.normal(kw, (len(SIZES), N, K) if transposed else (len(SIZES), K, N), dtype)
    return x, w, jnp.asarray(SIZES)


_gmm = jax.jit(grouped_matmul, static_argnames=("transpose_rhs", "implementation", "tile_rows"))


@pytest.mark.parametrize("implementation,tile_rows", [("xla", None), ("xla", 1), ("xla", 4), ("ragged_dot", None),
                                                     ("pallas", None), (None, None)])
@pytest.mark.parametrize("transposed", [False, True])
def test_forward_equals_reference(implementation, tile_rows, transposed):
    x, w, gs = operands(transposed=transposed)
    ref = gmm_reference(x, w, gs, transpose_rhs=transposed)
    got = _gmm(x, w, gs, transpose_rhs=transposed, implementation=implementation, tile_rows=tile_rows)
    assert np.all(np.asarray(got)[SIZES.sum():] == 0)
    assert err_ratio(got, ref) < RTOL


def test_cpu_kernel_form_equals_reference():
    """hybridjax.moe's CPU form: group-aligned tiles through the indexed kernel, one call."""
    for tm in (1, 4, 8):
        for transposed in (False, True):
            x, w, gs = operands(transposed=transposed)
            got = jax.jit(moe._gmm_cpu, static_argnums=(3, 4))(x, w, gs, tm, transposed)
            assert np.all(np.asarray(got)[SIZES.sum():] == 0)
            assert err_ratio(got, gmm_reference(x, w, gs, transpose_rhs=transposed)) < RTOL, (tm, transposed)


@pytest.mark.parametrize("form", ["xla", "cpu_kernel"])
@pytest.mark.parametrize("transposed", [False, True])
def test_gradients_equal_autodiff_of_reference(form, transposed):
    x, w, gs = operands(transposed=transposed)
    ct = jax.random.normal(jax.random.PRNGKey(1), (M, N))
    f = (lambda x, w: grouped_matmul(x, w, gs, transpose_rhs=transposed)) if form == "xla" else (
        lambda x, w: moe._gmm_cpu(x, w, gs, 4, transposed))
    got = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * ct), (0, 1)))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(gmm_reference(x, w, gs, transpose_rhs=transposed) * ct), (0, 1))(x, w)
    for a, b in zip(got, ref):
        assert err_ratio(a, b) < RTOL
    assert np.all(np.asarray(got[1])[[1, 4]] == 0)  # empty groups get no gradient


def test_tgmm_equals_reference():
    x, _, gs = operands()
    dy = jax.random.normal(jax.random.PRNGKey(2), (M, N))
    for tm in (None, 1, 5):
        assert err_ratio(tgmm_xla(x, dy, gs, len(SIZES), tile_rows=tm), tgmm_reference(x, dy, gs, len(SIZES))) < RTOL


def test_bfloat16():
    x, w, gs = operands(jnp.bfloat16)
    ref = gmm_reference(x.astype(jnp.float32), w.astype(jnp.float32), gs)
    assert err_ratio(_gmm(x, w, gs), ref) < RTOL
    assert err_ratio(jax.jit(moe._gmm_cpu, static_argnums=(3, 4))(x, w, gs, 4, False), ref) < RTOL


def test_indexed_cpu_kernel():
    """y[b] = x[b] @ w[index[b]] read in place; an index outside [0, E) gives zeros."""
    kx, kw = jax.random.split(jax.random.PRNGKey(3))
    e = 5
    x, w = jax.random.normal(kx, (7, 3, 48)), jax.random.normal(kw, (e, 48, 80))
    index = jnp.array([-1, 2, 5, 1, 4, 0, 2], jnp.int32)
    live = ((index >= 0) & (index < e))[:, None, None]
    ref = jnp.where(live, jnp.einsum("brk,bkn->brn", x, w[jnp.clip(index, 0, e - 1)]), 0.0)
    got = cpu_kernels.matmul_indexed(x, w, index)
    assert np.all(np.asarray(got)[~np.asarray(live[:, 0, 0])] == 0)
    assert err_ratio(got, ref) < RTOL
    assert err_ratio(cpu_kernels.matmul_indexed(x, jnp.swapaxes(w, 1, 2), index, transposed=True), ref) < RTOL
    g = jax.jit(jax.grad(lambda x, w: jnp.sum(cpu_kernels.matmul_indexed(x, w, index) ** 2), (0, 1)))(x, w)
    gr = jax.grad(lambda x, w: jnp.sum(jnp.where(live, jnp.einsum("brk,bkn->brn", x, w[jnp.clip(index, 0, e - 1)]), 0) ** 2),
                  (0, 1))(x, w)
    for a, b in zip(g, gr):
        assert err_ratio(a, b) < RTOL


def test_pallas_bfloat16_and_many_groups_in_the_interpreter():
    """Tiles of 16+ rows over groups of 1..9 rows (most tiles mostly masked), bf16 operands."""
    sizes = jnp.asarray(np.random.RandomState(0).randint(0, 10, 6), jnp.int32)
    x, w = jax.random.normal(jax.random.PRNGKey(4), (40, 32)), jax.random.normal(jax.random.PRNGKey(5), (6, 32, 48))
    for dtype in (jnp.float32, jnp.bfloat16):
        xs, ws = x.astype(dtype), w.astype(dtype)
        ref = gmm_reference(xs.astype(jnp.float32), ws.astype(jnp.float32), sizes)
        assert err_ratio(jax.jit(functools.partial(gmm_pallas, interpret=True))(xs, ws, sizes), ref) < RTOL, dtype


def test_lowers_for_cuda_with_the_triton_kernel():
    """implementation=None lowered for a GPU carries the Triton kernel (forward and the dx of the
    backward); lowered for CPU it does not."""
    x, w, gs = operands()

    def loss(x, w):
        return jnp.sum(grouped_matmul(x, w, gs) ** 2)

    cuda = lower_for_cuda(jax.grad(loss, (0, 1)), x, w).as_text()
    assert cuda.count("__gpu$xla.gpu.triton") >= 2
    cpu = jax.jit(jax.grad(loss, (0, 1))).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    assert "__gpu$xla.gpu.triton" not in cpu


def test_bad_arguments_are_named():
    x, w, gs = operands()
    with pytest.raises(ValueError, match="unknown implementation"):
        grouped_matmul(x, w, gs, implementation="triton")
    with pytest.raises(ValueError, match="multiple of 16"):
        grouped_matmul(x[:, :10], w[:, :10], gs, implementation="pallas")
    with pytest.raises(ValueError, match="K of x"):
        grouped_matmul(x[:, :3], w, gs)
