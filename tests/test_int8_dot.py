"""The int8 x int8 decode path (`cpu_kernels.quantize_int8_blocks` / `pack_int8` /
`pack_block_scales` / `matmul_q8`, `quantize_params(.., "int8-dot")`): the packing, the kernel
against a NumPy reference of the same math on every path this CPU has, and the model.

Tolerances.
- Kernel vs reference: both quantise x the same way (float32 operations in one order, rint half
  to even), so the int8 values and every block's integer dot are equal and exact (|dot| <=
  1024 * 127 * 127 < 2^24, exact in float32 too). The reference then sums float(dot_b) * dx_b *
  dw_b in float64 (exact to ~2^-50). The kernel rounds twice per block in float32 (dx_b * dw_b,
  then the fused multiply-add into the sum) and once per added slice of K, each by at most 2^-24
  of the running |sum|, itself at most A = sum_b |dot_b * dx_b * dw_b|: we allow
  (2 * blocks + 2) * 2^-24 * A. A wrong quantised value, a lost quad or a scale of the wrong
  block or column moves y by about dx_b * dw_b * |q| >> that bound.
- Paths against each other: the scalar path does the AVX2 path's float operations in the same
  order (a float32 product, then an fma per block), so their results are equal bit for bit.
- Model vs float32 (tests/test_int8.py, both modes): each weight within half a step of its block's
  max |w| / 127, never more than weight-only int8's per-column step, plus x rounded to int8 per
  block of 32, half a step of max |x_block| / 127 per value: at most about as much error again as
  weight-only int8's, so still inside 2% of the logit range (measured: 0.21%, 1.09% and 0.54%
  against weight-only's 0.24%, 0.70%, 0.53%); greedy tokens mostly equal.
"""

from __future__ import annotations

import collections
import functools

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


def reference(x, q, d, block):
    """(y, A, blocks): the kernel's math in NumPy, x [R, K] float32, q [K, N] int8, d [blocks, N]
    w's block scales; the sum in float64; A bounds |y| term by term (module docstring)."""
    xq, dx = cpu_kernels.quantize_x_blocks(x, block)
    k = x.shape[1]
    dw = np.asarray(d, np.float64)
    acc = np.zeros((x.shape[0], q.shape[1]), np.float64)
    mag = np.zeros_like(acc)
    for b in range(dx.shape[1]):
        sl = slice(b * block, min(k, (b + 1) * block))
        dot = xq[:, sl].astype(np.int64) @ q[sl].astype(np.int64)  # exact
        assert np.abs(dot).max(initial=0) < 2**24
        term = dot * dx[:, b : b + 1].astype(np.float64) * dw[b]
        acc = acc + term
        mag = mag + np.abs(term)
    return acc, mag, dx.shape[1]


def make(rng, rows, k, n, block=cpu_kernels.X_BLOCK, scale_dtype=jnp.float16):
    """x [rows, k] float32 and (q, d) = a weight [k, n] quantised per block, as NumPy arrays."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, ::7] *= 20  # outliers, so blocks get different scales
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:, ::3] *= rng.uniform(0.01, 10, (k, 1)).astype(np.float32)  # and so do w's blocks
    q, d = cpu_kernels.quantize_int8_blocks(w, block, scale_dtype)
    return x, np.asarray(q), np.asarray(d)


def q8(x, q, d, block=None, **kw):
    """matmul_q8 on (q, d) packed."""
    n = q.shape[1]
    return cpu_kernels.matmul_q8(x, cpu_kernels.pack_int8(q), cpu_kernels.pack_block_scales(d), n, x_block=block, **kw)


def check(y, x, q, d, block):
    ref, mag, blocks = reference(x, q, d, block)
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


def test_quantize_int8_blocks_and_pack_block_scales():
    """Per block of 32 k and column: |q| <= 127 with no clipping (the stored scale is rounded up),
    w within half a step of q * d, a block of zeros d = 1 and q = 0; the packed scales' layout
    and its exact inverse, in float16 and float32."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((70, 45)).astype(np.float32) * rng.uniform(1e-4, 10, (1, 45)).astype(np.float32)
    w[32:64, 5] = 0
    for dtype in (jnp.float16, jnp.float32):
        q, d = cpu_kernels.quantize_int8_blocks(w, 32, dtype)
        assert q.shape == (70, 45) and q.dtype == jnp.int8 and d.shape == (3, 45) and d.dtype == dtype
        q, d = np.asarray(q), np.asarray(d)
        d32 = np.repeat(d.astype(np.float32), 32, axis=0)[:70]
        amax = np.abs(np.pad(w, ((0, 26), (0, 0)))).reshape(3, 32, 45).max(1)
        # (XLA may divide by 127 as a multiply by its reciprocal: one float32 rounding either way)
        assert np.all(d.astype(np.float32) >= amax / 127 * (1 - 2**-23)) and np.abs(q).max() <= 127
        assert np.all(np.abs(q.astype(np.float32) * d32 - w) <= d32 * (0.5 + 1e-6))
        assert d[1, 5] == 1 and not q[32:64, 5].any()
        back = np.asarray(cpu_kernels.dequantize_int8_blocks(q, d))
        np.testing.assert_array_equal(back, q.astype(np.float32) * d32)
        s = cpu_kernels.pack_block_scales(d)
        assert s.shape == (2, 3 * 32) and s.dtype == dtype
        np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_block_scales(s, 45)), d)
        assert s[1, 2 * 32 + 3] == d[2, 35] and s[1, 31] == 0  # panel 1, block 2, lane 3; a padded column
    # float16 scales are float32's rounded up by less than one float16 step (2^-10 relative)
    d16 = np.asarray(cpu_kernels.quantize_int8_blocks(w, 32, jnp.float16)[1], np.float32)
    d32 = np.asarray(cpu_kernels.quantize_int8_blocks(w, 32, jnp.float32)[1])
    assert np.all(d16 >= d32) and np.all(d16 <= d32 * (1 + 2**-10) + 2**-24)


def test_quantize_x_blocks():
    x = np.array([[0.0] * 4 + [1.0, -2.0, 0.5, 254.0]], np.float32)
    xq, d = cpu_kernels.quantize_x_blocks(x, 4)
    np.testing.assert_array_equal(d, [[0.0, 2.0]])
    np.testing.assert_array_equal(xq, [[0, 0, 0, 0, 0, -1, 0, 127]])  # rint(0.5) = 0, rint(-1) = -1


# rows 1..8 against K and N off every multiple (quads, blocks of 32, 8-column vectors, panels)
SHAPES = [(1, 1, 1), (1, 7, 5), (2, 33, 47), (3, 130, 257), (4, 64, 16), (5, 1023, 301), (6, 2, 100),
          (7, 100, 31), (8, 257, 65)]


@pytest.mark.parametrize("scale_dtype", [jnp.float16, jnp.float32])
@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_matmul_q8_against_reference(isa, rows, k, n, scale_dtype):
    if isa not in paths_here():
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(rows * 1000 + k)
    x, q, d = make(rng, rows, k, n, scale_dtype=scale_dtype)
    check(q8(x, q, d, isa=isa), x, q, d, cpu_kernels.X_BLOCK)


@pytest.mark.parametrize("scale_dtype", [jnp.float16, jnp.float32])
def test_matmul_q8_same_bits_on_every_path(scale_dtype):
    rng = np.random.default_rng(9)
    x, q, d = make(rng, 5, 1023, 301, scale_dtype=scale_dtype)
    outs = {isa: np.asarray(q8(x, q, d, isa=isa)) for isa in paths_here()}
    for isa, y in outs.items():
        np.testing.assert_array_equal(y, outs["scalar"], err_msg=isa)


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("block", [4, 32, 128])
def test_matmul_q8_tiles_slices_threads_blocks(isa, block):
    """Forced column tiles and slices of K (each slice whole blocks of x), one thread or the pool,
    leading batch dims (a shared weight: all rows in one pass, more than 8 of them)."""
    if isa not in paths_here():
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(block)
    x, q, d = make(rng, 11, 515, 300, block)
    p, s = cpu_kernels.pack_int8(q), cpu_kernels.pack_block_scales(d)
    outs = []
    for threads, tile_cols, k_slices in ((1, 0, 0), (0, 0, 0), (0, 64, 3), (2, 32, 5)):
        y = cpu_kernels.matmul_q8(x, p, s, 300, isa=isa, max_threads=threads, tile_cols=tile_cols,
                                  k_slices=k_slices, x_block=block)
        check(y, x, q, d, block)
        outs.append(np.asarray(y))
    np.testing.assert_array_equal(outs[0], outs[1])  # the thread count never changes a result
    y3 = cpu_kernels.matmul_q8(x.reshape(1, 11, 515), p, s, 300, isa=isa, x_block=block)
    np.testing.assert_array_equal(np.asarray(y3)[0], outs[1])
    yv = jax.vmap(lambda r: cpu_kernels.matmul_q8(r, p, s, 300, isa=isa, x_block=block))(x.reshape(11, 1, 515))
    check(np.asarray(yv)[:, 0], x, q, d, block)


def test_matmul_q8_bf16_x_zeros_and_errors():
    rng = np.random.default_rng(5)
    x, q, d = make(rng, 2, 96, 40)
    p, s = cpu_kernels.pack_int8(q), cpu_kernels.pack_block_scales(d)
    xb = jnp.asarray(x, jnp.bfloat16)
    check(cpu_kernels.matmul_q8(xb, p, s, 40), np.asarray(xb, np.float32), q, d, 32)
    zero = cpu_kernels.matmul_q8(np.zeros((1, 96), np.float32), p, s, 40)
    np.testing.assert_array_equal(np.asarray(zero), 0.0)
    x[0, 3] = np.nan  # a NaN is not rounded away
    y = np.asarray(cpu_kernels.matmul_q8(x, p, s, 40))
    assert np.isnan(y[0]).all() and np.isfinite(y[1]).all()
    with pytest.raises(ValueError, match="int8 panels"):
        cpu_kernels.matmul_q8(x, q, s, 40)
    with pytest.raises(ValueError, match="x_block"):
        cpu_kernels.matmul_q8(x, p, s, 40, x_block=30)
    with pytest.raises(ValueError, match="block scales"):
        cpu_kernels.matmul_q8(x, p, s[:, :-32], 40)
    with pytest.raises(ValueError, match="block scales"):
        cpu_kernels.matmul_q8(x, p, s.astype(jnp.bfloat16), 40)
    with pytest.raises(ValueError, match="block scales"):  # blocks of 64 need half as many scales
        cpu_kernels.matmul_q8(x, p, s, 40, x_block=64)


def test_dense_int8_dot_weight():
    """Decode rows: int8 x int8 on the block-quantised panels; prefill rows: XLA's float32 matmul on
    the same panels dequantised (within float32 summation error of x @ (q * d): K roundings of at
    most 2^-24 of the running sum, bounded by |x| @ |w|); gradients straight through the rounding
    of x. Only the panels and their scales are held: no per-column q."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((96, 200)).astype(np.float32)
    w[:, ::3] *= rng.uniform(0.01, 10, (96, 1)).astype(np.float32)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    iw = cpu_kernels.quantize_params(collections.namedtuple("Ffn", "up")(w), "int8-dot").up
    assert iw.q is None and iw.scale is None and iw.shape == (96, 200) and iw.dtype == jnp.int8
    # 7 panels of 32 columns x 96 k in int8, and 3 blocks of float16 scales per column
    assert [a.nbytes for a in jax.tree_util.tree_leaves(iw)] == [7 * 32 * 96, 7 * 32 * 3 * 2]
    qb, db = (np.asarray(a) for a in cpu_kernels.quantize_int8_blocks(w))
    np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_int8(iw.panels, 96, 200)), qb)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_block_scales(iw.panel_scales, 200)), db)
    wb = np.asarray(cpu_kernels.dequantize_int8_blocks(qb, db))
    np.testing.assert_array_equal(np.asarray(cpu_kernels.plain_weight(iw)), wb)
    check(jax.jit(ops.dense)(x, iw), x, qb, db, cpu_kernels.X_BLOCK)
    text = jax.jit(ops.dense).lower(jnp.zeros((1, 96)), iw).as_text()
    assert cpu_kernels.TARGET_Q8 in text
    many = rng.standard_normal((cpu_kernels.DECODE_ROWS + 5, 96)).astype(np.float32)  # prefill: XLA
    text = jax.jit(ops.dense).lower(jnp.zeros(many.shape), iw).as_text()
    assert cpu_kernels.TARGET_Q8 not in text
    got = np.asarray(jax.jit(ops.dense)(many, iw))
    want = many.astype(np.float64) @ wb.astype(np.float64)
    assert np.all(np.abs(got - want) <= 96 * U32 * (np.abs(many) @ np.abs(wb)))
    # differentiable straight through the activation rounding, to the block-quantised weight
    g = jax.grad(lambda x: ops.dense(x, iw).sum())(jnp.asarray(x[:1]))
    np.testing.assert_allclose(np.asarray(g)[0], wb.sum(1), rtol=1e-4, atol=1e-4)
    gm = jax.grad(lambda x: ops.dense(x, iw).sum())(jnp.asarray(many))
    np.testing.assert_allclose(np.asarray(gm)[0], wb.sum(1), rtol=1e-4, atol=1e-4)


def test_int8_dot_params_hold_the_panels_only(loaded):
    """Every int8-dot projection holds its int8 panels (K and N padded to quads and panels) and a
    float16 scale per column per block of 32 k: 1 + 1/16 bytes per weight, no per-column q."""
    cfg, params = loaded["qwen3_next_moe"]
    q = cpu_kernels.quantize_params(params, "int8-dot")
    is_int8 = lambda x: isinstance(x, cpu_kernels.Int8Weight)  # noqa: E731
    weights = [x for x in jax.tree_util.tree_leaves(q, is_leaf=is_int8) if is_int8(x)]
    assert weights
    for iw in weights:
        k, n = iw.shape
        cols, quads, blocks = -(-n // 32) * 32, -(-k // 4) * 4, -(-k // 32)
        assert iw.q is None and iw.scale is None
        assert sum(a.nbytes for a in jax.tree_util.tree_leaves(iw)) == cols * quads + cols * blocks * 2


def test_int8_dot_prefill_logits_equal_the_dequantised_weights(loaded):
    """Prefill (more rows than the kernel's decode path takes, every projection and the head) of
    the int8-dot model against the float32 model whose projections are int8-dot's dequantised
    block weights (`plain_weight`): the same float32 weights through XLA's matmuls, only its
    summation order free to differ (as f32 with and without the kernel: tests/test_cpu_kernels.py),
    so 1e-5 of the logit range. (Prefill from a per-column q instead differs by ~1e-3 of it.)"""
    for arch in ("qwen3_5_dense", "qwen3_next_moe"):
        cfg, params = loaded[arch]
        q = cpu_kernels.quantize_params(params, "int8-dot")
        is_int8 = lambda x: isinstance(x, cpu_kernels.Int8Weight)  # noqa: E731
        ref_params = jax.tree_util.tree_map(lambda x: cpu_kernels.plain_weight(x) if is_int8(x) else x, q,
                                            is_leaf=is_int8)
        prompt = np.random.RandomState(5).randint(0, cfg.vocab_size, (1, cpu_kernels.MAX_ROWS + 4))
        fwd = jax.jit(functools.partial(hybridjax.forward, cfg=cfg))
        cache = hybridjax.init_cache(cfg, 1, 64, capacity=64)
        got = np.asarray(fwd(q, jnp.asarray(prompt, jnp.int32), cache)[0][0])
        want = np.asarray(fwd(ref_params, jnp.asarray(prompt, jnp.int32), cache)[0][0])
        err = float(np.abs(got - want).max() / np.abs(want).max())
        assert err < 1e-5, (arch, err)


def test_int8_dot_generate_equals_its_prefill_then_decode_steps(loaded):
    """generate's greedy tokens (prefill, then its decode loop) with int8-dot weights equal those of
    the library's own prefill and one-token decode steps, argmax by hand: both read the panels
    (XLA on them dequantised for the prompt, `matmul_q8` per token)."""
    from hybridjax.generate import decode_step, generate, prefill

    cfg, params = loaded["qwen3_5_dense"]
    q = cpu_kernels.quantize_params(params, "int8-dot")
    prompt = np.random.RandomState(6).randint(0, cfg.vocab_size, cpu_kernels.MAX_ROWS + 3).tolist()
    got = generate(q, cfg, [prompt], max_new_tokens=6).token_lists()[0]
    cache = hybridjax.init_cache(cfg, 1, 64, capacity=64)
    logits, cache = prefill(q, np.asarray([prompt], np.int32), cache, cfg)
    want = [int(np.argmax(logits[0]))]
    for _ in range(5):
        logits, cache = decode_step(q, np.asarray([want[-1]], np.int32), cache, cfg)
        want.append(int(np.argmax(logits[0])))
    assert got == want


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
    assert isinstance(up, cpu_kernels.Int8Weight) and up.panels is not None and up.panel_scales is not None
    assert up.panel_scales.dtype == cpu_kernels.Q8_SCALE_DTYPE
    _, wo = hybridjax.load_hf(hf_dirs["qwen3_5_dense"], dtype="float32", quantize="int8-wo")
    assert wo.layers[0].ffn.up.panels is None
    args = ["generate", "--no-compile-cache", "--prompt", "Hello", "--max-new-tokens", "3", "--quantize", "int8-dot"]
    assert main(args) == 0
    capsys.readouterr()
