"""The CPU small-row matmul (hybridjax.cpu_kernels) against jnp.dot, on every path this CPU has,
and the model's decode with the kernel against without it.

Tolerances. The kernel adds each product to a float32 sum, rounding each time, so against the
exact sum its error is at most n * 2^-24 * (|x| @ |w|) (recursive summation of n terms; n = K,
or 2K on the avx512bf16 path with a float32 x, which adds hi and lo products separately), and
the float32 reference `jnp.dot(..., precision=HIGHEST)` carries up to K * 2^-24 * (|x| @ |w|)
more. That split writes x as bf16 hi + bf16 lo, exact to 2^-16 relatively (bf16 keeps 8
significant bits, twice): another 2^-16 * (|x| @ |w|). Measured errors are far below.

If the extension is not built these tests FAIL (CI has a compiler, so a missing build is a
bug); set HYBRIDJAX_ALLOW_NO_CPU_KERNELS=1 to skip them on a machine that truly has none.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybridjax
from hybridjax import cpu_kernels, ops
from hybridjax.generate import generate

from decode_helpers import decode_logits

U32 = 2.0**-24  # float32 unit roundoff
SPLIT = 2.0**-16  # how well bf16 hi + lo represents a float32 x


@pytest.fixture(autouse=True, scope="module")
def _extension_built():
    if not cpu_kernels.available():
        msg = f"CPU kernel extension unavailable: {cpu_kernels.load_error()}"
        if os.environ.get("HYBRIDJAX_ALLOW_NO_CPU_KERNELS") == "1":
            pytest.skip(msg)
        pytest.fail(msg + " (set HYBRIDJAX_ALLOW_NO_CPU_KERNELS=1 only on a machine without a C++ compiler)")


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def paths_here() -> list[str]:
    return list(cpu_kernels.ISAS[: cpu_kernels.ISAS.index(cpu_kernels.best_isa()) + 1])


def need(isa: str) -> None:
    if isa not in paths_here():  # a hardware fact, not a missing build
        pytest.skip(f"this CPU has no {isa} (best: {cpu_kernels.best_isa()})")


def make_w(rng, k, n, wdtype, transposed=False):
    """(w as the kernel takes it, scale or None, the same weight as float32 [K, N])."""
    if wdtype == "int8":
        q, scale = cpu_kernels.quantize_int8(rng.standard_normal((k, n)))
        dense = q.astype(jnp.float32) * scale
        return (q.T if transposed else q), scale, dense
    w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), wdtype)
    wf = w.astype(jnp.float32)
    return w, None, (wf.T if transposed else wf)


def assert_close(y, x, w_kn, split: bool):
    """y ~ x @ w_kn (batched like jnp.matmul) against XLA in float32, within the bound above."""
    xf = jnp.asarray(x, jnp.float32)
    ref = np.asarray(jnp.matmul(xf, w_kn, precision=jax.lax.Precision.HIGHEST))
    scale = np.asarray(jnp.matmul(jnp.abs(xf), jnp.abs(w_kn), precision=jax.lax.Precision.HIGHEST))
    k = xf.shape[-1]
    terms = 2 * k if split else k
    bound = ((terms + k) * U32 + (SPLIT if split else 0.0)) * scale + 1e-30
    y = np.asarray(y)
    assert y.shape == ref.shape and y.dtype == np.float32
    worst = float(np.max(np.abs(y - ref) / bound))
    assert worst <= 1.0, f"error {worst:.2f}x the bound"


# rows 1..8 against sizes that are no multiple of any vector width (8, 16, 32 lanes)
SHAPES = [(1, 1, 1), (1, 7, 5), (2, 33, 47), (3, 130, 257), (4, 64, 16), (5, 1023, 301), (6, 2, 100),
          (7, 100, 31), (8, 257, 65)]


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
def test_matches_jnp_dot_on_awkward_shapes(isa, wdtype):
    need(isa)
    rng = np.random.default_rng(0)
    f = jax.jit(functools.partial(cpu_kernels.matmul, isa=isa, tile_cols=64))  # several tiles
    for r, k, n in SHAPES:
        w, scale, w_kn = make_w(rng, k, n, wdtype)
        for xdtype in ("float32", "bfloat16"):
            x = jnp.asarray(rng.standard_normal((r, k)), xdtype)
            split = isa == "avx512bf16" and wdtype == "bfloat16" and xdtype == "float32"
            assert_close(f(x, w, scale), x, w_kn, split)


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
def test_transposed_weight(isa, wdtype):
    """w [N, K] read in place (the tied head): equals x @ w.T. Three rows or more take another
    loop (x interleaved): K shorter than one vector, a tail in K, one and many columns."""
    need(isa)
    rng = np.random.default_rng(1)
    f = jax.jit(functools.partial(cpu_kernels.matmul, transposed=True, isa=isa, tile_cols=64))
    for r, k, n in [(1, 7, 5), (3, 33, 130), (8, 1023, 70), (2, 64, 1), (4, 5, 9), (6, 48, 1)]:
        w, scale, w_kn = make_w(rng, k, n, wdtype, transposed=True)
        for xdtype in ("float32", "bfloat16"):
            x = jnp.asarray(rng.standard_normal((r, k)), xdtype)
            split = isa == "avx512bf16" and wdtype == "bfloat16" and xdtype == "float32"
            assert_close(f(x, w, scale), x, w_kn, split)


# (rows, K, N, k_slices): slices that do not divide K, an odd K (a bf16 pair at a slice's end),
# slices shorter than a row block, more slices asked for than K has 16-row blocks.
SLICED = [(1, 1001, 37, 3), (3, 257, 33, 5), (8, 64, 100, 4), (5, 33, 16, 9)]


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
def test_k_slices_match_jnp_dot(isa, wdtype):
    """K cut into slices whose partial sums the caller adds (narrow weights): every path, with
    and without column tiles, rows 1-8."""
    need(isa)
    rng = np.random.default_rng(5)
    for i, (r, k, n, slices) in enumerate(SLICED):
        w, scale, w_kn = make_w(rng, k, n, wdtype)
        f = jax.jit(functools.partial(cpu_kernels.matmul, isa=isa, tile_cols=32 * (i % 2), k_slices=slices))
        for xdtype in ("float32", "bfloat16"):
            x = jnp.asarray(rng.standard_normal((r, k)), xdtype)
            split = isa == "avx512bf16" and wdtype == "bfloat16" and xdtype == "float32"
            assert_close(f(x, w, scale), x, w_kn, split)


def test_auto_plan_slices_narrow_weights_and_ignores_the_threads():
    """A weight of >= 256 KB with few columns is cut along K by default (four items). The plan
    depends on the shape only, so one thread and the pool give bitwise the same result, and a
    row's result does not depend on the other rows; vmap and while_loop see the same."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((8, 1001)), jnp.float32)
    for wdtype in ("float32", "bfloat16"):
        w = jnp.asarray(rng.standard_normal((1001, 300)), wdtype)  # 0.6-1.2 MB, N < 1024: 4 slices
        wf = w.astype(jnp.float32)
        for isa in paths_here():
            split = isa == "avx512bf16" and wdtype == "bfloat16"
            pool = np.asarray(cpu_kernels.matmul(x, w, isa=isa))
            assert_close(pool, x, wf, split)
            one = np.asarray(cpu_kernels.matmul(x, w, isa=isa, max_threads=1))
            np.testing.assert_array_equal(one, pool, err_msg=f"{wdtype} {isa} threads")
            for rows in (1, 3):
                part = np.asarray(cpu_kernels.matmul(x[:rows], w, isa=isa))
                np.testing.assert_array_equal(part, pool[:rows], err_msg=f"{wdtype} {isa} {rows} rows")
        # vmap over rows (folded into one pass over w) and a while_loop carrying the rows
        vm = jax.jit(jax.vmap(cpu_kernels.matmul, (0, None)))(x[:, None], w)[:, 0]
        np.testing.assert_array_equal(np.asarray(vm), np.asarray(cpu_kernels.matmul(x, w)))
        w_sq = jnp.asarray(rng.standard_normal((1001, 1001)) * 0.03, wdtype)

        def loop(mm):
            body = lambda c: (c[0] + 1, jnp.tanh(mm(c[1], w_sq)))  # noqa: E731
            return jax.jit(lambda v: jax.lax.while_loop(lambda c: c[0] < 3, body, (0, v))[1])(x[:2])

        ref = loop(lambda a, b: jnp.dot(a, b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST))
        np.testing.assert_allclose(np.asarray(loop(cpu_kernels.matmul)), np.asarray(ref), rtol=1e-4, atol=1e-4)


def test_the_best_path_follows_the_cpu_flags():
    """cpuid in the kernel agrees with what the kernel reports to /proc/cpuinfo (Linux, x86)."""
    flags = cpu_flags()
    if not flags or "fpu" not in flags:
        pytest.skip("no x86 /proc/cpuinfo")
    want = ("avx512bf16" if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags
            else "avx512" if {"avx512f", "avx512bw", "avx512vl"} <= flags
            else "avx2" if {"avx2", "fma"} <= flags else "scalar")
    assert cpu_kernels.best_isa() == want


def test_rows_are_independent_of_the_batch_bitwise():
    """A row's result does not depend on the other rows (the engine's slots, a prefill chunk's
    tokens): same order of operations for every row count, on every path. Past one block of 8
    rows a weight wider than 1024 columns is cut into narrower tiles (matmul.cc), never into
    other K slices: the 1100-column weights check that."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((40, 300)), jnp.float32)
    for wdtype in ("float32", "bfloat16"):
        for shape, transposed in (((300, 200), False), ((300, 1100), False), ((1100, 300), True)):
            w = jnp.asarray(rng.standard_normal(shape), wdtype)
            for isa in paths_here():
                full = np.asarray(cpu_kernels.matmul(x, w, isa=isa, transposed=transposed))
                for rows in (1, 3, 5, 8, 9, 16, 17, 32):
                    part = np.asarray(cpu_kernels.matmul(x[:rows], w, isa=isa, transposed=transposed))
                    np.testing.assert_array_equal(part, full[:rows], err_msg=f"{wdtype} {shape} {isa} {rows}")
            assert_close(full, x, w.astype(jnp.float32).T if transposed else w.astype(jnp.float32),
                         wdtype == "bfloat16" and cpu_kernels.best_isa() == "avx512bf16")


def test_avx2_float32_decode_reads_whole_rows_over_fixed_slices():
    """On AVX2 a float32 weight of >= 256 KB and up to 16384 columns met by one or two rows is
    read in whole-width blocks over four slices of K, without prefetches (matmul.cc,
    Avx2Prefetch); a wider one keeps the general tiles (20000 columns: four, no slices). The
    slices come from the shape alone: more rows take narrower tiles over the same slices, so
    each row's result is the same bits. A forced tiling with those slices gives the same bits
    (the plan is the one described), and another slice count differs (the check can fail)."""
    need("avx2")
    rng = np.random.default_rng(11)
    for (k, n), slices in (((64, 12000), 4), ((128, 3000), 4), ((64, 20000), 1)):
        x = jnp.asarray(rng.standard_normal((12, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        full = np.asarray(cpu_kernels.matmul(x, w, isa="avx2"))
        assert_close(full, x, w, False)
        for rows in (1, 2, 3, 8, 9):
            part = np.asarray(cpu_kernels.matmul(x[:rows], w, isa="avx2"))
            np.testing.assert_array_equal(part, full[:rows], err_msg=f"{k}x{n}, {rows} rows")
        one = np.asarray(cpu_kernels.matmul(x[:1], w, isa="avx2"))
        forced = np.asarray(cpu_kernels.matmul(x[:1], w, isa="avx2", tile_cols=1024, k_slices=slices))
        np.testing.assert_array_equal(one, forced, err_msg=f"{k}x{n}: not {slices} slices")
        other = slices - 1 if slices > 1 else 2
        other_plan = np.asarray(cpu_kernels.matmul(x[:1], w, isa="avx2", tile_cols=1024, k_slices=other))
        assert not np.array_equal(one, other_plan), f"{k}x{n}: {other} slices gave the same bits"


def test_avx2_float32_decode_pass_rows_change_no_bits_and_are_measured():
    """One or two rows against such a float32 weight read 4 or 8 weight rows per pass (matmul.cc,
    NextPassRows): the same bits either way, a slice of K ending mid-pass included (K = 140: slices
    of 48, 48, 44 rows). Unless forced, each shape's first calls alternate the two, and after 8 of
    each the faster serves that shape; during and after, the results do not move."""
    need("avx2")
    rng = np.random.default_rng(12)
    k, n = 140, 3000  # 1.7 MB: past the 256 KB where the kernel cuts K into four slices
    x = jnp.asarray(rng.standard_normal((2, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    try:
        by_rows = {}
        for pass_rows in (4, 8):
            cpu_kernels.set_avx2_pass_rows(pass_rows)
            by_rows[pass_rows] = [np.asarray(cpu_kernels.matmul(x[:r], w, isa="avx2")) for r in (1, 2)]
            assert cpu_kernels.avx2_pass_rows(k, n) == pass_rows
        for r in (0, 1):
            np.testing.assert_array_equal(by_rows[4][r], by_rows[8][r])
            assert_close(by_rows[8][r], x[:r + 1], w, False)
        cpu_kernels.set_avx2_pass_rows(None)
        assert cpu_kernels.avx2_pass_rows(k, n) is None  # measuring starts over
        for _ in range(16):  # 8 calls of each
            assert cpu_kernels.avx2_pass_rows(k, n) is None
            np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul(x[:1], w, isa="avx2")), by_rows[4][0])
        assert cpu_kernels.avx2_pass_rows(k, n) in (4, 8)
        np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul(x, w, isa="avx2")), by_rows[4][1])
        with pytest.raises(ValueError, match="4 or 8"):
            cpu_kernels.set_avx2_pass_rows(6)
    finally:
        cpu_kernels.set_avx2_pass_rows(None)


def test_vmap_over_x_w_both_and_nested():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 3, 40)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 70)), jnp.bfloat16)
    ws = jnp.asarray(rng.standard_normal((4, 40, 70)), jnp.bfloat16)
    f = cpu_kernels.matmul
    wf, wsf = w.astype(jnp.float32), ws.astype(jnp.float32)
    split = cpu_kernels.best_isa() == "avx512bf16"
    assert_close(jax.vmap(f, (0, None))(x, w), x, wf, split)
    assert_close(jax.vmap(f, (None, 0))(x[0], ws), jnp.broadcast_to(x[0], (4, 3, 40)), wsf, split)
    assert_close(jax.vmap(f)(x, ws), x, wsf, split)
    nested = jax.jit(jax.vmap(jax.vmap(f, (0, None)), (0, None)))(x[:, :, None], w)  # [4, 3, 1, 70]
    assert_close(nested[:, :, 0], x, wf, split)
    q, scale = cpu_kernels.quantize_int8(rng.standard_normal((40, 70)))
    scales = jnp.stack([scale * (i + 1) for i in range(4)])
    y = jax.vmap(lambda a, s: f(a, q, s))(x, scales)  # batched scale, shared q
    assert_close(y, x, q.astype(jnp.float32)[None] * scales[:, None], False)


def test_inside_while_loop_and_grad():
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((40, 40)) * 0.2, jnp.float32)
    x0 = jnp.asarray(rng.standard_normal((2, 40)), jnp.float32)

    def run(mm):
        body = lambda c: (c[0] + 1, jnp.tanh(mm(c[1], w)))  # noqa: E731
        return jax.jit(lambda v: jax.lax.while_loop(lambda c: c[0] < 5, body, (0, v))[1])(x0)

    ours = run(cpu_kernels.matmul)
    ref = run(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-6)
    # custom_jvp: gradients go through XLA's dot
    loss = lambda mm: lambda a, b: jnp.sum(jnp.sin(mm(a, b)))  # noqa: E731
    g = jax.grad(loss(cpu_kernels.matmul), (0, 1))(x0, w)
    g_ref = jax.grad(loss(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)), (0, 1))(x0, w)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_columns_are_shared_with_the_pool_threads():
    """With max_threads=1 no helper runs; by default XLA's pool threads take tiles too (on a
    loaded machine a helper may start late and find no work, so allow many tries)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core")
    x = jnp.ones((1, 1024), jnp.float32)
    w = jnp.ones((1024, 4096), jnp.bfloat16)  # 8 MB, 8 tiles
    one = jax.jit(functools.partial(cpu_kernels.matmul, max_threads=1))
    pool = jax.jit(cpu_kernels.matmul)
    jax.block_until_ready((one(x, w), pool(x, w)))
    before = cpu_kernels.helper_items()
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(one(x, w)), np.full((1, 4096), 1024.0, np.float32))
    assert cpu_kernels.helper_items() == before
    for _ in range(200):
        np.testing.assert_array_equal(np.asarray(pool(x, w)), np.full((1, 4096), 1024.0, np.float32))
        if cpu_kernels.helper_items() > before:
            break
    assert cpu_kernels.helper_items() > before


def test_bad_input_is_rejected():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="x \\[..., R, K\\]"):
        cpu_kernels.matmul(x, jnp.ones((9, 4), jnp.float32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.matmul(x.astype(jnp.float16), jnp.ones((8, 4), jnp.float32))
    with pytest.raises(ValueError, match="int8"):
        cpu_kernels.matmul(x, jnp.ones((8, 4), jnp.int8))
    with pytest.raises(ValueError, match="scale"):
        cpu_kernels.matmul(x, jnp.ones((8, 4), jnp.int8), jnp.ones((5,)))
    with pytest.raises(ValueError, match="unknown CPU kernel path"):
        cpu_kernels.matmul(x, jnp.ones((8, 4), jnp.float32), isa="sse9")


def test_env_caps_the_path_for_a_fallback(monkeypatch):
    """HYBRIDJAX_CPU_ISA selects a fallback at trace time; the result stays right."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((1, 77)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((77, 33)), jnp.bfloat16)
    monkeypatch.setenv("HYBRIDJAX_CPU_ISA", "scalar")
    lowered = jax.jit(lambda x, w: cpu_kernels.matmul(x, w)).lower(x, w).as_text()  # fresh trace
    assert "isa = 0" in lowered, lowered
    assert_close(cpu_kernels.matmul(x, w), x, w.astype(jnp.float32), False)
    monkeypatch.setenv("HYBRIDJAX_CPU_ISA", "nonsense")
    with pytest.raises(ValueError, match="unknown CPU kernel path"):
        cpu_kernels.matmul(x, w)


def test_dense_sends_decode_and_narrow_prefill_rows_to_the_kernel_and_wider_to_xla(monkeypatch):
    """Up to 16 rows of float32 weights and 32 of bfloat16 (a one-row prefill chunk of 16 or 32
    tokens) stream through the kernel; int8 weights stay at decode's 8 rows."""
    assert (cpu_kernels.max_rows(jnp.float32), cpu_kernels.max_rows(jnp.bfloat16),
            cpu_kernels.max_rows(jnp.int8), cpu_kernels.max_rows(jnp.float16)) == (16, 32, 8, 0)
    for dtype in (jnp.float32, jnp.bfloat16):
        w = jnp.ones((64, 48), dtype)

        def hlo(rows):  # a fresh function each time: the choice is made at trace time
            return jax.jit(lambda x, w: ops.dense(x, w)).lower(jnp.ones((rows, 64), dtype), w).as_text()

        limit = cpu_kernels.max_rows(dtype)
        assert cpu_kernels.TARGET in hlo(1) and cpu_kernels.TARGET in hlo(limit), dtype
        assert cpu_kernels.TARGET not in hlo(limit + 1), dtype
    monkeypatch.setenv("HYBRIDJAX_CPU_KERNELS", "0")
    assert cpu_kernels.TARGET not in hlo(1)


def test_bf16_prefill_widens_to_float32_where_the_cpu_has_no_bf16_dot(monkeypatch):
    """Prefill rows of a bf16 weight: XLA's float32 dot on widened operands (default below
    avx512bf16) or its bf16 dot (`direct`); the products are exact either way (bf16 x bf16 fits a
    float32 mantissa), so both meet the float32 bound, transposed (the tied head) too."""
    rng = np.random.default_rng(14)
    w = jnp.asarray(rng.standard_normal((96, 80)), jnp.bfloat16)
    rows = cpu_kernels.max_rows(jnp.bfloat16) + 8  # more than the kernel takes
    x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.bfloat16)
    want = cpu_kernels.best_isa() != "avx512bf16"
    monkeypatch.delenv("HYBRIDJAX_CPU_BF16_PREFILL", raising=False)
    assert cpu_kernels.widen_bf16_prefill() == want
    for mode in ("widen", "direct"):
        monkeypatch.setenv("HYBRIDJAX_CPU_BF16_PREFILL", mode)
        for transposed, wk in ((False, w), (True, w.T)):
            f = jax.jit(lambda x, w, t=transposed: ops.dense(x, w, jnp.float32, transposed=t))  # fresh trace
            hlo = f.lower(x, wk).as_text()
            assert ("tensor<96x80xf32>" in hlo or "tensor<80x96xf32>" in hlo) == (mode == "widen"), (mode, transposed)
            assert_close(f(x, wk), x, w.astype(jnp.float32), False)
    monkeypatch.setenv("HYBRIDJAX_CPU_BF16_PREFILL", "sometimes")
    with pytest.raises(ValueError, match="widen or direct"):
        cpu_kernels.widen_bf16_prefill()


def test_a_missing_extension_warns_once_and_dense_uses_xla(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_load", lambda: (None, "simulated: no .so"))
    cpu_kernels.warn_unavailable.cache_clear()
    x, w = jnp.ones((1, 16), jnp.float32), jnp.ones((16, 8), jnp.float32)
    with caplog.at_level(logging.WARNING, logger="hybridjax.cpu_kernels"):
        for _ in range(3):
            hlo = jax.jit(lambda x, w: ops.dense(x, w)).lower(x, w).as_text()
            np.testing.assert_array_equal(np.asarray(ops.dense(x, w)), np.full((1, 8), 16.0, np.float32))
    assert cpu_kernels.TARGET not in hlo
    warned = [r for r in caplog.records if "simulated: no .so" in r.getMessage()]
    assert len(warned) == 1
    cpu_kernels.warn_unavailable.cache_clear()


# --- the model: decode with the kernel against decode without it -------------------------


# qwen3_5_dense has the tied head (transposed path), qwen3_next_moe an untied one and MoE. Not
# qwen3_next_moe in bfloat16: XLA:CPU rejects the bf16 expert einsum of a 9-token prefill
# ("Unsupported element type for DotThunk: BF16 x BF16 = F32"), with or without this kernel.
@pytest.mark.parametrize("arch, dtype", [("qwen3_5_dense", "float32"), ("qwen3_5_dense", "bfloat16"),
                                         ("qwen3_next_moe", "float32")])
def test_model_decode_with_kernel_equals_without(arch, dtype, loaded, monkeypatch):
    """Same weights, one-token decode steps through the kernel and through XLA's dots.
    float32: both are float32 accumulations in different orders: 1e-5 of the logit range.
    bfloat16: activations are rounded to bf16 between layers on both sides, in different
    places, so one bf16 ulp (2^-8) of drift per layer is possible: we allow 5e-2 of the range
    and require the same greedy tokens (random tiny models have well-separated maxima)."""
    cfg, params = loaded[arch]
    params = hybridjax.params.cast_params(params, dtype)
    prompt = np.random.RandomState(7).randint(0, cfg.vocab_size, 9).tolist()
    with_kernel = decode_logits(params, cfg, prompt, 6)
    monkeypatch.setenv("HYBRIDJAX_CPU_KERNELS", "0")
    without = decode_logits(params, cfg, prompt, 6)
    rtol = 1e-5 if dtype == "float32" else 5e-2
    err = np.abs(with_kernel - without).max() / np.abs(without).max()
    assert err < rtol, err
    np.testing.assert_array_equal(with_kernel.argmax(-1), without.argmax(-1))


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_model_decode_on_every_path_equals_without_kernel(isa, loaded, monkeypatch):
    """The model's decode with the path capped (HYBRIDJAX_CPU_ISA, read at trace time), so an
    AVX-512 machine runs the avx2 and scalar paths through the whole model too: float32 [K, N]
    weights, then bfloat16 packed panels (avx2 and avx512 widen the pairs; scalar reads them in
    plain C++), against XLA's dots. Tolerances as in the tests above."""
    need(isa)
    cfg, params = loaded["qwen3_5_dense"]
    bf = hybridjax.params.cast_params(params, "bfloat16")
    packed = cpu_kernels.pack_params(bf.replace(lm_head=jnp.asarray(bf.embed.T)), force=True)
    prompt = np.random.RandomState(8).randint(0, cfg.vocab_size, 7).tolist()
    monkeypatch.setenv("HYBRIDJAX_CPU_ISA", isa)
    ours = decode_logits(params, cfg, prompt, 4), decode_logits(packed, cfg, prompt, 4)
    monkeypatch.delenv("HYBRIDJAX_CPU_ISA")
    monkeypatch.setenv("HYBRIDJAX_CPU_KERNELS", "0")
    refs = decode_logits(params, cfg, prompt, 4), decode_logits(packed, cfg, prompt, 4)
    for got, ref, rtol in zip(ours, refs, (1e-5, 5e-2)):
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < rtol, (isa, err)
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_generate_with_kernel_equals_without_for_a_batch(loaded, monkeypatch):
    """The library's generate (lax.while_loop decode, 3 ragged rows) gives the same greedy
    tokens with and without the kernel."""
    cfg, params = loaded["qwen3_5_dense"]
    prompts = [np.random.RandomState(s).randint(0, cfg.vocab_size, n).tolist() for s, n in ((1, 5), (2, 11), (3, 1))]
    ours = generate(params, cfg, prompts, max_new_tokens=12).token_lists()
    monkeypatch.setenv("HYBRIDJAX_CPU_KERNELS", "0")
    jax.clear_caches()  # generate's jit was traced with the kernel
    try:
        ref = generate(params, cfg, prompts, max_new_tokens=12).token_lists()
    finally:
        monkeypatch.delenv("HYBRIDJAX_CPU_KERNELS")
        jax.clear_caches()
    assert ours == ref


# --- packed bfloat16 panels (pack_bf16 / matmul_packed / PackedWeight) -------------------
# Same sums as the [K, N] bf16 path (bf16 products, float32 accumulation, in another order),
# so the same bound (assert_close), on every path: avx512bf16 streams the panels, the others
# read them with plain C++.


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_packed_matches_jnp_dot_on_awkward_shapes(isa):
    need(isa)
    rng = np.random.default_rng(10)
    for i, (r, k, n) in enumerate(SHAPES + [(1, 1001, 37), (8, 64, 100)]):
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
        p = cpu_kernels.pack_bf16(w)
        assert p.shape == (-(-n // 32), -(-k // 2) * 64) and p.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_bf16(p, k, n)), np.asarray(w))
        # default plan, several column tiles, and forced K slices (odd K: a pair at a slice's end)
        for tc, ks in ((0, 0), (64, 0), (32 * (i % 2), 3)):
            f = jax.jit(functools.partial(cpu_kernels.matmul_packed, n=n, isa=isa, tile_cols=tc, k_slices=ks))
            for xdtype in ("float32", "bfloat16"):
                x = jnp.asarray(rng.standard_normal((r, k)), xdtype)
                split = isa == "avx512bf16" and xdtype == "float32"
                assert_close(f(x, p), x, w.astype(jnp.float32), split)


def test_packed_plan_ignores_the_threads_and_rows_are_independent():
    """A packed weight of >= 256 KB is cut into column tiles (whole K each); the result is
    bitwise the same for any thread count, and a row's result does not depend on the others."""
    rng = np.random.default_rng(11)
    k, n = 515, 1000  # 1 MB of bf16: four items
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    p = cpu_kernels.pack_bf16(w)
    x = jnp.asarray(rng.standard_normal((8, k)), jnp.bfloat16)
    for isa in paths_here():
        one = np.asarray(cpu_kernels.matmul_packed(x, p, n, isa=isa, max_threads=1))
        np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul_packed(x, p, n, isa=isa, max_threads=2)), one)
        for rows in (1, 3):
            np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul_packed(x[:rows], p, n, isa=isa)), one[:rows])
        assert_close(one, x, w.astype(jnp.float32), False)


def test_packed_under_vmap_while_loop_and_grad():
    rng = np.random.default_rng(12)
    k, n = 40, 70
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    ws = jnp.asarray(rng.standard_normal((4, k, n)), jnp.bfloat16)
    p, ps = cpu_kernels.pack_bf16(w), jax.vmap(cpu_kernels.pack_bf16)(ws)
    x = jnp.asarray(rng.standard_normal((4, 3, k)), jnp.bfloat16)
    f = functools.partial(cpu_kernels.matmul_packed, n=n)
    wf, wsf = w.astype(jnp.float32), ws.astype(jnp.float32)
    assert_close(jax.jit(jax.vmap(f, (0, None)))(x, p), x, wf, False)
    assert_close(jax.vmap(f)(x, ps), x, wsf, False)
    assert_close(jax.vmap(f, (None, 0))(x[0], ps), jnp.broadcast_to(x[0], (4, 3, k)), wsf, False)

    sq = jnp.asarray(rng.standard_normal((k, k)) * 0.2, jnp.bfloat16)
    sqp = cpu_kernels.pack_bf16(sq)
    x0 = jnp.asarray(rng.standard_normal((2, k)), jnp.float32)

    def run(mm):
        body = lambda c: (c[0] + 1, jnp.tanh(mm(c[1])))  # noqa: E731
        return jax.jit(lambda v: jax.lax.while_loop(lambda c: c[0] < 5, body, (0, v))[1])(x0)

    ours = run(lambda v: cpu_kernels.matmul_packed(v, sqp, k))
    ref = run(lambda v: cpu_kernels.matmul(v, sq))  # the [K, N] kernel: the same bf16 products
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-6)
    # custom_jvp: the tangent goes through XLA's dot on the unpacked weight
    loss = lambda a, b: jnp.sum(jnp.sin(cpu_kernels.matmul_packed(a, b, k)))  # noqa: E731
    gx, gp = jax.grad(loss, (0, 1))(x0, sqp)
    gx_ref, gw_ref = jax.grad(lambda a, b: jnp.sum(jnp.sin(cpu_kernels.matmul(a, b))), (0, 1))(x0, sq)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_ref), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(cpu_kernels.unpack_bf16(gp, k, k), np.float32),
                               np.asarray(gw_ref, np.float32), rtol=1e-2, atol=1e-2)


def test_packed_bad_input_is_rejected():
    x = jnp.ones((2, 8), jnp.bfloat16)
    p = cpu_kernels.pack_bf16(jnp.ones((8, 40), jnp.bfloat16))  # [2, 256]
    with pytest.raises(ValueError, match="panels"):
        cpu_kernels.matmul_packed(x, p, 70)  # n does not fit the panels
    with pytest.raises(ValueError, match="panels"):
        cpu_kernels.matmul_packed(jnp.ones((2, 9), jnp.bfloat16), p, 40)
    with pytest.raises(ValueError, match="panels"):
        cpu_kernels.matmul_packed(x, p.astype(jnp.float32), 40)


def test_dense_streams_packed_panels_for_few_rows_and_xla_reads_the_plain_weight():
    rng = np.random.default_rng(13)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
    pw = cpu_kernels.PackedWeight(w, cpu_kernels.pack_bf16(w))

    def hlo(rows):
        return jax.jit(lambda x, w: ops.dense(x, w)).lower(jnp.ones((rows, 64), jnp.bfloat16), pw).as_text()

    limit = cpu_kernels.max_rows(jnp.bfloat16)
    assert cpu_kernels.TARGET_PACKED in hlo(1) and cpu_kernels.TARGET_PACKED in hlo(limit)
    assert cpu_kernels.TARGET_PACKED not in hlo(limit + 1)
    for rows in (1, 8, 9, limit, limit + 1):
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16)
        y = jax.jit(lambda x, w: ops.dense(x, w, jnp.float32))(x, pw)
        assert_close(y, x, w.astype(jnp.float32), False)


def test_pack_params_packs_the_projections_only(loaded, hf_dirs):
    cfg, params = loaded["qwen3_5_dense"]
    bf = hybridjax.params.cast_params(params, "bfloat16")
    packed = cpu_kernels.pack_params(bf, force=True)
    leaves = jax.tree_util.tree_leaves_with_path(packed, is_leaf=lambda x: isinstance(x, cpu_kernels.PackedWeight))
    names = {jax.tree_util.keystr(kp).split(".")[-1] for kp, x in leaves if isinstance(x, cpu_kernels.PackedWeight)}
    assert names and names <= cpu_kernels.DENSE_WEIGHTS and "embed" not in names
    f32 = cpu_kernels.pack_params(params, force=True)  # float32: no panels; held transposed where that is faster
    assert not any(isinstance(x, cpu_kernels.PackedWeight) for x in jax.tree_util.tree_leaves(
        f32, is_leaf=cpu_kernels.is_weight_layout))
    assert (f32 is params) == (cpu_kernels.isa() not in cpu_kernels.TRANSPOSED_ISAS)
    if cpu_kernels.best_isa() in cpu_kernels.PACKED_ISAS:  # elsewhere pack_params leaves params as they are
        _, at_load = hybridjax.load_hf(hf_dirs["qwen3_5_dense"], dtype="bfloat16", pack_for_decode=True)
        assert isinstance(at_load.layers[0].ffn.up, cpu_kernels.PackedWeight)
    back = cpu_kernels.unpack_params(packed)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(bf)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(bf)):
        assert a.dtype == b.dtype and (a is b or np.array_equal(np.asarray(a), np.asarray(b)))


@pytest.mark.parametrize("mode", ["widen", "direct"])
def test_a_packed_weight_keeps_prefill_widened_where_prefill_widens(loaded, monkeypatch, mode):
    """Where bf16 prefill widens to float32 (no bf16 dot instruction), `pack_params` keeps
    prefill's copy widened at load, so a prefill step converts no weight (XLA:CPU's converts were
    about half of bf16 prefill's gap to float32) and computes the very numbers of the widening
    path: bf16 x bf16 products are exact in float32, and both run XLA's float32 matmul on equal
    operands, so the logits are bit-identical. Where prefill runs bf16 directly the copy stays
    bf16. Either way the weight's dtype stays bfloat16 and unpacking gives the bf16 weight back
    exactly."""
    monkeypatch.setenv("HYBRIDJAX_CPU_BF16_PREFILL", mode)
    cfg, params = loaded["qwen3_5_dense"]
    bf = hybridjax.params.cast_params(params, "bfloat16")
    packed = cpu_kernels.pack_params(bf, force=True)
    up = packed.layers[0].ffn.up
    assert up.dtype == jnp.bfloat16 and up.w.dtype == (jnp.float32 if mode == "widen" else jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.plain_weight(up)), np.asarray(bf.layers[0].ffn.up))

    rows = cpu_kernels.max_rows(jnp.bfloat16) + 8  # a wide prefill chunk's rows: XLA's matmul, not the kernel
    x = jnp.asarray(np.random.default_rng(3).standard_normal((rows, up.shape[0])), jnp.bfloat16)

    def weight_converts(w):  # bf16 -> f32 converts of a whole weight in the step lowered for CPU
        k, n = up.shape
        text = jax.jit(lambda x, w: ops.dense(x, w)).lower(x, w).as_text()
        return text.count(f"(tensor<{k}x{n}xbf16>) -> tensor<{k}x{n}xf32>")

    assert (weight_converts(bf.layers[0].ffn.up), weight_converts(up)) == ((1, 0) if mode == "widen" else (0, 0))

    prompt = jnp.asarray(np.random.RandomState(5).randint(0, cfg.vocab_size, (1, rows)), jnp.int32)
    fwd = jax.jit(functools.partial(hybridjax.forward, cfg=cfg))  # traced under this mode

    def prefill(p):
        return np.asarray(fwd(p, prompt, hybridjax.init_cache(cfg, 1, 64, capacity=64))[0])

    np.testing.assert_array_equal(prefill(packed), prefill(bf))


def test_a_widened_weight_decodes_from_bf16_and_prefills_from_its_float32_copy(loaded, monkeypatch):
    """`WidenedWeight` (pack_params on avx512 without AVX512_BF16; built by hand here, so every
    CPU runs it): decode rows stream its bf16 weight through the kernel, bit for bit what the
    plain bf16 weight gives; wider rows run XLA's float32 matmul on its float32 copy, converting
    no weight in the step, bit for bit the widening path's numbers (bf16 x bf16 products are
    exact in float32). So the model's prefill logits and greedy decode equal the plain bf16
    model's exactly, and unpacking gives the bf16 weights back."""
    monkeypatch.setenv("HYBRIDJAX_CPU_BF16_PREFILL", "widen")
    cfg, params = loaded["qwen3_5_dense"]
    bf = hybridjax.params.cast_params(params, "bfloat16")

    def widen(path, leaf):
        name = getattr(path[-1], "name", None) if path else None
        if name in cpu_kernels.DENSE_WEIGHTS and getattr(leaf, "ndim", 0) == 2:
            return cpu_kernels.WidenedWeight(leaf.astype(jnp.float32), leaf)
        return leaf

    wide = jax.tree_util.tree_map_with_path(widen, bf)
    up, plain = wide.layers[0].ffn.up, bf.layers[0].ffn.up
    assert up.dtype == jnp.bfloat16 and up.w.dtype == jnp.float32 and up.shape == plain.shape
    back = cpu_kernels.unpack_params(wide)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(bf)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(bf)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))

    rng = np.random.default_rng(4)
    dense = jax.jit(lambda x, w: ops.dense(x, w, jnp.float32))
    k, n = up.shape
    for rows in (1, cpu_kernels.max_rows(jnp.bfloat16), cpu_kernels.max_rows(jnp.bfloat16) + 8):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(dense(x, up)), np.asarray(dense(x, plain)))
    text = jax.jit(lambda x, w: ops.dense(x, w)).lower(x, up).as_text()
    assert f"(tensor<{k}x{n}xbf16>) -> tensor<{k}x{n}xf32>" not in text  # no weight converted per call
    assert cpu_kernels.TARGET not in text
    assert cpu_kernels.TARGET in jax.jit(lambda x, w: ops.dense(x, w)).lower(x[:1], up).as_text()

    rows = cpu_kernels.max_rows(jnp.bfloat16) + 8
    prompt = jnp.asarray(np.random.RandomState(5).randint(0, cfg.vocab_size, (1, rows)), jnp.int32)
    fwd = jax.jit(functools.partial(hybridjax.forward, cfg=cfg))
    np.testing.assert_array_equal(*(np.asarray(fwd(p, prompt, hybridjax.init_cache(cfg, 1, 64, capacity=64))[0])
                                    for p in (wide, bf)))
    prompts = [np.random.RandomState(s).randint(0, cfg.vocab_size, n).tolist() for s, n in ((1, 5), (2, 11))]
    assert (generate(wide, cfg, prompts, max_new_tokens=8).token_lists()
            == generate(bf, cfg, prompts, max_new_tokens=8).token_lists())


def test_a_capped_path_makes_the_layout_choices_of_a_cpu_with_only_that_path(loaded, monkeypatch):
    """HYBRIDJAX_CPU_ISA caps the layouts as well as the calls (`isa()`): capped to avx2, any x86
    CPU packs bf16 panels, reads "int8" as int8-dot and widens bf16 prefill, as an AVX2-only CPU
    does, so an AVX-512 machine runs (and tests) what AVX2 users get; capped to avx512 it keeps
    only prefill's float32 copy (`WidenedWeight`) and weight-only int8; capped to scalar it packs
    nothing and keeps weight-only int8; a cap above the CPU's best gives the best."""
    need("avx2")
    _, params = loaded["qwen3_5_dense"]
    bf = hybridjax.params.cast_params(params, "bfloat16")

    def packed(p):
        return any(isinstance(x, cpu_kernels.PackedWeight) for x in jax.tree_util.tree_leaves(
            p, is_leaf=lambda x: isinstance(x, cpu_kernels.PackedWeight)))

    monkeypatch.setenv("HYBRIDJAX_CPU_ISA", "avx2")
    assert cpu_kernels.isa() == "avx2"
    assert packed(cpu_kernels.pack_params(bf))
    assert cpu_kernels.int8_mode("int8") == "int8-dot" and cpu_kernels.widen_bf16_prefill()
    if "avx512" in paths_here():  # avx512 without bf16: panels would be read by AVX2 code
        monkeypatch.setenv("HYBRIDJAX_CPU_ISA", "avx512")
        up = cpu_kernels.pack_params(bf).layers[0].ffn.up
        assert isinstance(up, cpu_kernels.WidenedWeight) and up.w.dtype == jnp.float32
        assert not packed(cpu_kernels.pack_params(bf)) and cpu_kernels.int8_mode("int8") == "int8-wo"
        monkeypatch.setenv("HYBRIDJAX_CPU_BF16_PREFILL", "direct")  # nothing to widen: nothing kept
        assert cpu_kernels.pack_params(bf) is bf
        monkeypatch.delenv("HYBRIDJAX_CPU_BF16_PREFILL")
    monkeypatch.setenv("HYBRIDJAX_CPU_ISA", "scalar")
    assert cpu_kernels.isa() == "scalar"
    assert cpu_kernels.pack_params(bf) is bf and cpu_kernels.int8_mode("int8") == "int8-wo"
    monkeypatch.setenv("HYBRIDJAX_CPU_ISA", "avx512bf16")
    assert cpu_kernels.isa() == cpu_kernels.best_isa()
    monkeypatch.delenv("HYBRIDJAX_CPU_ISA")
    assert cpu_kernels.isa() == cpu_kernels.best_isa()


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_a_transposed_weight_is_read_in_place_by_the_kernel_and_by_xla(monkeypatch, isa):
    """`TransposedWeight` (pack_params' float32 layout on AVX2) holds w as [N, K]. Decode rows read
    each output's weights as one contiguous row (the kernel's transposed path: four columns at a
    time, a weight of >= 256 KB cut into four items of whole rows, K and N with tails here); wider
    rows run XLA's matmul on the [N, K] array itself (no transpose or copy of it in the compiled
    step). Each within the float32 bound of x @ w, a row's result the same at any kernel row count,
    and the weight it stands for given back exactly."""
    need(isa)
    monkeypatch.setenv("HYBRIDJAX_CPU_ISA", isa)
    rng = np.random.default_rng(21)
    k, n = 260, 1001  # 1 MB: four items of 256 rows, the last 233 (a column left over from groups of 4)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    tw = cpu_kernels.TransposedWeight(jnp.asarray(np.ascontiguousarray(np.asarray(w).T)))
    assert tw.shape == (k, n) and tw.dtype == jnp.float32 and tw.ndim == 2
    np.testing.assert_array_equal(np.asarray(cpu_kernels.plain_weight(tw)), np.asarray(w))
    dense = jax.jit(lambda x, w: ops.dense(x, w, jnp.float32))
    x = jnp.asarray(rng.standard_normal((40, k)), jnp.float32)
    limit = cpu_kernels.max_rows(jnp.float32)
    ys = {rows: np.asarray(dense(x[:rows], tw)) for rows in (1, 2, 3, 5, limit, 40)}
    for rows, y in ys.items():
        assert_close(y, x[:rows], w, False)
        if rows <= limit:
            np.testing.assert_array_equal(y[:1], ys[1], err_msg=f"{rows} rows")
    kernel_step = dense.lower(x[:1], tw).as_text()
    assert cpu_kernels.TARGET in kernel_step and "transposed = true" in kernel_step
    assert f"isa = {cpu_kernels.ISAS.index(isa)} : i64" in kernel_step
    wide_step = dense.lower(x, tw).compile().as_text()
    assert cpu_kernels.TARGET not in wide_step and "transpose(" not in wide_step and "copy(" not in wide_step
    with pytest.raises(ValueError, match="tied head"):
        ops.dense(x[:1], tw, transposed=True)


def test_pack_params_holds_float32_projections_transposed_on_avx2(loaded, monkeypatch):
    """On the paths of `TRANSPOSED_ISAS` (avx2 here, the path every x86 CPU in use has) `pack_params`
    holds every float32 projection as a `TransposedWeight` (the same memory), the embedding as it is. Decode's logits then agree with
    the plain weights' within float32 rounding (each output's sum runs in another order), greedy
    generation gives the same tokens, and unpacking gives the weights back exactly. Capped to
    scalar nothing changes."""
    need("avx2")
    monkeypatch.setenv("HYBRIDJAX_CPU_ISA", "avx2")
    cfg, params = loaded["qwen3_5_dense"]
    held = cpu_kernels.pack_params(params)
    layouts = jax.tree_util.tree_leaves_with_path(held, is_leaf=cpu_kernels.is_weight_layout)
    names = {jax.tree_util.keystr(kp).split(".")[-1] for kp, x in layouts if isinstance(x, cpu_kernels.TransposedWeight)}
    assert names and names <= cpu_kernels.DENSE_WEIGHTS and "embed" not in names
    up = held.layers[0].ffn.up
    assert isinstance(up, cpu_kernels.TransposedWeight) and up.shape == params.layers[0].ffn.up.shape
    back = cpu_kernels.unpack_params(held)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompt = np.random.RandomState(8).randint(0, cfg.vocab_size, 9).tolist()
    ours, ref = decode_logits(held, cfg, prompt, 6), decode_logits(params, cfg, prompt, 6)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert 0 < err < 1e-4, err  # float32 sums in another order: close, and not the same code path
    prompts = [np.random.RandomState(s).randint(0, cfg.vocab_size, n).tolist() for s, n in ((1, 5), (2, 11), (3, 1))]
    assert (generate(held, cfg, prompts, max_new_tokens=12).token_lists()
            == generate(params, cfg, prompts, max_new_tokens=12).token_lists())
    monkeypatch.setenv("HYBRIDJAX_CPU_ISA", "scalar")
    assert cpu_kernels.pack_params(params) is params


def test_model_decode_with_packed_weights_equals_without_kernel(loaded, monkeypatch):
    """bfloat16 params packed for decode (the tied head untied, so the LM head is packed too):
    one-token steps through the packed kernel against XLA's dots on the plain weights
    (tolerance as in the bf16 case above: activations are rounded to bf16 between layers, in
    different places), then generate's while_loop over a ragged batch against the unpacked
    kernel: the same greedy tokens."""
    cfg, params = loaded["qwen3_5_dense"]
    bf = hybridjax.params.cast_params(params, "bfloat16")
    bf = bf.replace(lm_head=jnp.asarray(bf.embed.T))
    packed = cpu_kernels.pack_params(bf, force=True)
    assert isinstance(packed.lm_head, cpu_kernels.PackedWeight)
    prompt = np.random.RandomState(7).randint(0, cfg.vocab_size, 9).tolist()
    ours = decode_logits(packed, cfg, prompt, 6)
    monkeypatch.setenv("HYBRIDJAX_CPU_KERNELS", "0")
    ref = decode_logits(bf, cfg, prompt, 6)
    monkeypatch.delenv("HYBRIDJAX_CPU_KERNELS")
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < 5e-2, err
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    prompts = [np.random.RandomState(s).randint(0, cfg.vocab_size, n).tolist() for s, n in ((1, 5), (2, 11), (3, 1))]
    assert (generate(packed, cfg, prompts, max_new_tokens=12).token_lists()
            == generate(bf, cfg, prompts, max_new_tokens=12).token_lists())
