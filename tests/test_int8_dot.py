"""The int8 x int8 decode path (`cpu_kernels.pack_int8` / `matmul_q8`, `quantize_params(.., "int8-dot")`):
the kernel against a NumPy reference of the same math on every path this CPU has, and the model.

Tolerances.
- Kernel vs reference: both quantise x the same way (float32 operations in one order, rint half
  to even), so the int8 values and every block's integer dot are equal and exact (|dot| <=
  1024 * 127 * 127 < 2^24, exact in float32 too). What differs is the float epilogue: the sum over
  blocks of float(dot_b) * d_b, fused (AVX2) or rounded twice (scalar, NumPy), then times the
  column's scale. Each of those <= 2 * blocks + 1 roundings errs by at most 2^-24 of the running
  |sum|, itself at most A = sum_b |dot_b * d_b| * scale: we allow (2 * blocks + 2) * 2^-24 * A.
  A wrong quantised value or a lost quad would move y by about d_b * |q| >> that bound.
- Model vs float32 (tests/test_int8.py, both modes): as weight-only int8, plus x rounded to int8 per
  block of 32, half a step of max |x_block| / 127 per value: about as much error again as the
  weights' rounding, so still far inside 2% of the logit range; greedy tokens mostly equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybridjax
from hybridjax import cpu_kernels, ops

from decode_helpers import decode_logits

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernel extension not built")

U32 = 2.0**-24


def paths_here() -> list[str]:
    return list(cpu_kernels.ISAS[: cpu_kernels.ISAS.index(cpu_kernels.best_isa()) + 1])


def reference(x, q, scale, block):
    """(y, A): the kernel's math in NumPy, x [R, K] float32, q [K, N] int8, scale [N]; A bounds |y|
    term by term (module docstring)."""
    xq, d = cpu_kernels.quantize_x_blocks(x, block)
    k = x.shape[1]
    acc = np.zeros((x.shape[0], q.shape[1]), np.float32)
    mag = np.zeros_like(acc)
    for b in range(d.shape[1]):
        sl = slice(b * block, min(k, (b + 1) * block))
        dot = xq[:, sl].astype(np.int64) @ q[sl].astype(np.int64)  # exact
        assert np.abs(dot).max(initial=0) < 2**24
        term = dot.astype(np.float32) * d[:, b : b + 1]
        acc = acc + term
        mag = mag + np.abs(term)
    return acc * scale, mag * np.abs(scale), d.shape[1]


def make(rng, rows, k, n):
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, ::7] *= 20  # outliers, so blocks get different scales
    q, scale = cpu_kernels.quantize_int8(rng.standard_normal((k, n)).astype(np.float32))
    return x, np.asarray(q), np.asarray(scale)


def check(y, x, q, scale, block):
    ref, mag, blocks = reference(x, q, scale, block)
    y = np.asarray(y)
    assert y.shape == ref.shape and y.dtype == np.float32
    bound = (2 * blocks + 2) * U32 * mag + 1e-30
    worst = float(np.max(np.abs(y - ref) / bound))
    assert worst <= 1.0, f"error {worst:.2f}x the bound"


def test_pack_int8_roundtrip_and_layout():
    q = jnp.asarray(np.random.default_rng(0).integers(-127, 128, (13, 70)), jnp.int8)
    p = cpu_kernels.pack_int8(q)
    assert p.shape == (3, 4 * 128) and p.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_int8(p, 13, 70)), np.asarray(q))
    # panel 1, quad 2, lane 3, byte 1 is q[2 * 4 + 1, 32 + 3]
    assert int(p[1, 2 * 128 + 3 * 4 + 1]) == int(q[9, 35])


def test_quantize_x_blocks():
    x = np.array([[0.0] * 4 + [1.0, -2.0, 0.5, 254.0]], np.float32)
    xq, d = cpu_kernels.quantize_x_blocks(x, 4)
    np.testing.assert_array_equal(d, [[0.0, 2.0]])
    np.testing.assert_array_equal(xq, [[0, 0, 0, 0, 0, -1, 0, 127]])  # rint(0.5) = 0, rint(-1) = -1


# rows 1..8 against K and N off every multiple (quads, blocks of 32, 8-column vectors, panels)
SHAPES = [(1, 1, 1), (1, 7, 5), (2, 33, 47), (3, 130, 257), (4, 64, 16), (5, 1023, 301), (6, 2, 100),
          (7, 100, 31), (8, 257, 65)]


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_matmul_q8_against_reference(isa, rows, k, n):
    if isa not in paths_here():
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(rows * 1000 + k)
    x, q, scale = make(rng, rows, k, n)
    p = cpu_kernels.pack_int8(q)
    check(cpu_kernels.matmul_q8(x, p, scale, n, isa=isa), x, q, scale, cpu_kernels.X_BLOCK)


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("block", [4, 32, 128])
def test_matmul_q8_tiles_slices_threads_blocks(isa, block):
    """Forced column tiles and slices of K (each slice whole blocks of x), one thread or the pool,
    leading batch dims (a shared weight: all rows in one pass, more than 8 of them)."""
    if isa not in paths_here():
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(block)
    x, q, scale = make(rng, 11, 515, 300)
    p = cpu_kernels.pack_int8(q)
    outs = []
    for threads, tile_cols, k_slices in ((1, 0, 0), (0, 0, 0), (0, 64, 3), (2, 32, 5)):
        y = cpu_kernels.matmul_q8(x, p, scale, 300, isa=isa, max_threads=threads, tile_cols=tile_cols,
                                  k_slices=k_slices, x_block=block)
        check(y, x, q, scale, block)
        outs.append(np.asarray(y))
    np.testing.assert_array_equal(outs[0], outs[1])  # the thread count never changes a result
    y3 = cpu_kernels.matmul_q8(x.reshape(1, 11, 515), p, scale, 300, isa=isa, x_block=block)
    np.testing.assert_array_equal(np.asarray(y3)[0], outs[1])
    yv = jax.vmap(lambda r: cpu_kernels.matmul_q8(r, p, scale, 300, isa=isa, x_block=block))(x.reshape(11, 1, 515))
    check(np.asarray(yv)[:, 0], x, q, scale, block)


def test_matmul_q8_bf16_x_zeros_and_errors():
    rng = np.random.default_rng(5)
    x, q, scale = make(rng, 2, 96, 40)
    p = cpu_kernels.pack_int8(q)
    xb = jnp.asarray(x, jnp.bfloat16)
    check(cpu_kernels.matmul_q8(xb, p, scale, 40), np.asarray(xb, np.float32), q, scale, 32)
    zero = cpu_kernels.matmul_q8(np.zeros((1, 96), np.float32), p, scale, 40)
    np.testing.assert_array_equal(np.asarray(zero), 0.0)
    x[0, 3] = np.nan  # a NaN is not rounded away
    y = np.asarray(cpu_kernels.matmul_q8(x, p, scale, 40))
    assert np.isnan(y[0]).all() and np.isfinite(y[1]).all()
    with pytest.raises(ValueError, match="int8 panels"):
        cpu_kernels.matmul_q8(x, q, scale, 40)
    with pytest.raises(ValueError, match="x_block"):
        cpu_kernels.matmul_q8(x, p, scale, 40, x_block=30)
    with pytest.raises(ValueError, match="scale"):
        cpu_kernels.matmul_q8(x, p, scale[:-1], 40)


def test_dense_int8_dot_weight():
    rng = np.random.default_rng(1)
    x, q, scale = make(rng, 3, 96, 200)
    iw = cpu_kernels.Int8Weight(jnp.asarray(q), jnp.asarray(scale), cpu_kernels.pack_int8(q))
    check(jax.jit(ops.dense)(x, iw), x, q, scale, cpu_kernels.X_BLOCK)
    text = jax.jit(ops.dense).lower(jnp.zeros((1, 96)), iw).as_text()
    assert cpu_kernels.TARGET_Q8 in text
    many = rng.standard_normal((cpu_kernels.MAX_ROWS + 5, 96)).astype(np.float32)  # prefill: XLA on q
    np.testing.assert_allclose(np.asarray(jax.jit(ops.dense)(many, iw)), many @ (q * scale), rtol=1e-4, atol=1e-4)
    # differentiable straight through the activation rounding
    g = jax.grad(lambda x: ops.dense(x, iw).sum())(jnp.asarray(x[:1]))
    np.testing.assert_allclose(np.asarray(g)[0], (q * scale).sum(1), rtol=1e-4, atol=1e-4)


def test_quantize_modes():
    assert cpu_kernels.int8_mode("int8-wo") == "int8-wo" and cpu_kernels.int8_mode("int8-dot") == "int8-dot"
    want = "int8-dot" if cpu_kernels.best_isa() in cpu_kernels.INT8_DOT_ISAS else "int8-wo"
    assert cpu_kernels.int8_mode("int8") == want
    with pytest.raises(ValueError, match="unknown quantisation"):
        cpu_kernels.int8_mode("int4")


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_int8_dot_model_on_every_path(isa, loaded, monkeypatch):
    """The int8-dot model's decode with the path capped against the best path: the same sums up
    to the epilogue's rounding, so 1e-5 of the logit range and the same greedy tokens."""
    if isa not in paths_here():
        pytest.skip(f"this CPU has no {isa}")
    cfg, params = loaded["qwen3_next_moe"]
    q = cpu_kernels.quantize_params(params, "int8-dot")
    assert q.lm_head.panels is not None
    prompt = np.random.RandomState(8).randint(0, cfg.vocab_size, 7).tolist()
    monkeypatch.setenv("HYBRIDJAX_CPU_ISA", isa)
    ours = decode_logits(q, cfg, prompt, 4)
    monkeypatch.delenv("HYBRIDJAX_CPU_ISA")
    ref = decode_logits(q, cfg, prompt, 4)
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    assert err < 1e-5, (isa, err)
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_load_and_cli_int8_dot(hf_dirs, capsys):
    from hybridjax.cli import main

    cfg, q = hybridjax.load_hf(hf_dirs["qwen3_5_dense"], dtype="float32", quantize="int8-dot")
    up = q.layers[0].ffn.up
    assert isinstance(up, cpu_kernels.Int8Weight) and up.panels is not None
    np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_int8(up.panels, *up.shape)), np.asarray(up.q))
    _, wo = hybridjax.load_hf(hf_dirs["qwen3_5_dense"], dtype="float32", quantize="int8-wo")
    assert wo.layers[0].ffn.up.panels is None
    args = ["generate", "--no-compile-cache", "--prompt", "Hello", "--max-new-tokens", "3", "--quantize", "int8-dot"]
    assert main(args) == 0
    capsys.readouterr()
