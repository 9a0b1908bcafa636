"""The Pallas paged-attention kernel (pallas_kernels/paged_attention/pallas.py), on a CPU-only
machine three ways.

1. Numerically, in Pallas interpret mode, against the gather-everything reference and the XLA
   path: float32 and bfloat16, ragged rows (a row that sees no key, one key, exactly a page,
   one short of a page boundary, many pages, the whole table), pages shuffled through the pool
   beside garbage pages, table entries past a row's pages holding garbage and out-of-range
   ids, GQA, Dh 128 and 256, pages of 16 and 64, T = 1 (decode) and T = 3, 16 (verification),
   split-K with 1, some and many splits (splits with no pages included).
2. Lowered for CUDA from CPU: the Triton kernel is in the module (float32 and bf16), the
   interpreter is not; None picks it for decode only; the engine's decode step carries it.
3. Unchanged on CPU: implementation=None compiles to exactly the XLA path's program.

Where `triton` and `pallas_kernels/triton_offline.py` are installed, the kernel is also compiled
for sm_90 and sm_89 and checked for tensor cores, spills and shared memory.

Interpret mode is slow and compile time dominates on 2 cores: four small cases, each one
jitted program computing every implementation and split count at once, cached across tests.
Seeds are fixed.
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybridjax.pallas_kernels.paged_attention.api as api
from hybridjax.pallas_kernels.compat import cuda_target
from hybridjax.pallas_kernels.paged_attention import (
    MAX_DECODE_QUERIES,
    paged_attention,
    paged_attention_pallas,
    paged_attention_reference,
    paged_attention_xla,
)

# float32: every path computes the same float32 products and sums them in another order (one
# softmax over all keys; online softmax over 256-key blocks; over 16-key blocks, then merged
# across splits), so they differ by float32 rounding (eps 1.2e-7) of values of order 1;
# measured <= 1.8e-6 (printed with -s). 2e-5 leaves a 10x margin and catches any indexing or
# masking slip, which moves outputs by 1e-2 or more.
F32_ATOL = 2e-5
# bfloat16 q/k/v (unit roundoff u = 2^-8): scores are exact products of bf16 values summed in
# float32 on every path, but the kernel (like the XLA path) rounds the probabilities p to bf16
# before the p @ V dot (tensor cores), which moves an output by at most u * sum_i p_i |v_i| = u
# * A, with A the attention of the same queries over |v| (computed by the reference); each
# side's bf16 output rounding adds at most u |out|. So |kernel - reference| <= u (A + 2 |out|)
# elementwise; we assert <= 1.5x that (room for float32 rounding and |out| differing between
# the sides); measured at most 0.44 of the tolerance (0.66 of the bound).
BF16_BOUND_MARGIN = 1.5

FAST_COMPILE = {"xla_backend_optimization_level": 0}  # tiny programs: compile time is the cost

# name: dtype, T, page size S, heads Hq / Hkv, Dh, table width Np, each row's last query
# position (its keys are 0..that), and the split counts to run (None = the default).
CASES = {
    # a row with no key (-1), one key, one short of a page, exactly a page, one short of two,
    # many pages (83 = 5 pages + 4), the whole table (8 pages)
    "decode_f32": dict(dtype="float32", t=1, s=16, hq=4, hkv=2, dh=128, n_table=8,
                       ends=[-1, 0, 14, 15, 31, 83, 127], splits=(1, 3, None)),
    # 16 queries per row over pages of 64 (float32 steps 16 keys: 4 per page); 2 row blocks
    "verify_f32": dict(dtype="float32", t=16, s=64, hq=4, hkv=2, dh=256, n_table=3,
                       ends=[15, 63, 191], splits=(1, 2, None)),
    # Qwen3.5's head size and the engine's page size; bf16 steps 32 keys (2 per page)
    "decode_bf16": dict(dtype="bfloat16", t=1, s=64, hq=8, hkv=2, dh=256, n_table=4,
                        ends=[0, 62, 63, 202], splits=(1, None)),
    # bf16 with whole-page steps (64 keys of Dh 128), a few queries per row
    "verify_bf16": dict(dtype="bfloat16", t=3, s=64, hq=8, hkv=2, dh=128, n_table=3,
                        ends=[2, 66, 191], splits=(1, None)),
}


def make_problem(dtype, t, s, hq, hkv, dh, n_table, ends, seed=0, **_):
    """q [B, T, Hq, Dh]; a pool [P, S, Hkv, Dh] whose pages are shuffled, with spare pages of
    garbage; the page table [B, Np] (P past each row's pages, as the engine writes); q_pos
    [B, T] ending at `ends` (negative positions clamp at -1: no key)."""
    rng = np.random.default_rng(seed)
    b = len(ends)
    q_pos = np.maximum(np.asarray(ends)[:, None] - (t - 1) + np.arange(t)[None], -1).astype(np.int32)
    need = [(e + s) // s for e in ends]  # pages holding each row's keys
    assert max(need) <= n_table
    pool = sum(need) + 3  # 3 spare pages: garbage that must never be read
    order = rng.permutation(pool)
    table = np.full((b, n_table), pool, np.int32)
    used = 0
    for row, n in enumerate(need):
        table[row, :n] = order[used:used + n]
        used += n
    q, k, v = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((b, t, hq, dh), (pool, s, hkv, dh), (pool, s, hkv, dh)))
    dt = jnp.dtype(dtype)
    return jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(table), jnp.asarray(q_pos)


@functools.partial(jax.jit, static_argnames=("splits",), compiler_options=FAST_COMPILE)
def _all(q, k, v, table, q_pos, splits):
    """{name: [B, T, Hq, Dh]}: the reference, the XLA path and the kernel (interpret mode) at each
    split count; the default split count through the public entry point."""
    scale = q.shape[-1] ** -0.5
    out = {"reference": paged_attention_reference(q, k, v, table, q_pos, scale=scale),
           "xla": paged_attention_xla(q, k, v, table, q_pos, scale=scale)}
    for n in splits:
        if n is None:
            out["pallas"] = paged_attention(q, k, v, table, q_pos, implementation="pallas")
        else:
            out[f"pallas/{n}"] = paged_attention_pallas(q, k, v, table, q_pos, scale=scale, splits=n, interpret=True)
    return out


@functools.lru_cache(maxsize=None)
def results(name):
    case = CASES[name]
    args = make_problem(**case)
    return args, jax.device_get(_all(*args, splits=case["splits"]))


def _max_err_ratio(a, b, tol):
    """max |a - b| / tol, elementwise tol (or a number); 0/0 counts as 0."""
    err = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return float(np.max(np.where(err == 0, 0.0, err / tol)))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_xla(name):
    (q, _, v, _, q_pos), out = results(name)
    ref = out["reference"]
    assert float(np.abs(np.asarray(ref, np.float64)).max()) > 0.1  # a real signal, not all zeros
    if CASES[name]["dtype"] == "float32":
        tol = F32_ATOL
    else:  # elementwise: u (A + 2 |out|), see BF16_BOUND_MARGIN
        _, k, _, table, _ = results(name)[0]
        a = paged_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), jnp.abs(v.astype(jnp.float32)),
                                      table, q_pos, scale=q.shape[-1] ** -0.5)
        tol = BF16_BOUND_MARGIN * 2.0**-8 * (np.asarray(a, np.float64) + 2 * np.abs(np.asarray(ref, np.float64)))
    errors = {}
    for impl, o in out.items():
        assert o.shape == ref.shape and o.dtype == q.dtype, impl
        assert np.isfinite(np.asarray(o, np.float32)).all(), impl
        errors[impl] = tuple(_max_err_ratio(o, want, tol) for want in (ref, out["xla"]))
    print(f"{name}: max |err| / tolerance vs (reference, xla): {errors}")
    for impl, (e_ref, e_xla) in errors.items():
        assert e_ref < 1 and e_xla < 1, (impl, e_ref, e_xla)
    blind = np.asarray(q_pos)[:, -1] < 0
    for impl, o in out.items():  # a row whose queries see no key gets zeros
        assert not np.asarray(o, np.float32)[blind].any(), impl


def test_table_entries_past_a_rows_pages_are_never_read():
    """Garbage past each row's pages (negative ids, ids far past the pool, other rows' pages)
    and garbage in the spare pages leave the kernel's output bit for bit unchanged."""
    case = CASES["decode_f32"]
    (q, k, v, table, q_pos), out = results("decode_f32")
    pool = k.shape[0]
    rng = np.random.default_rng(1)
    garbage = np.asarray(table).copy()
    need = (np.asarray(case["ends"]) + case["s"]) // case["s"]
    for row, n in enumerate(need):
        garbage[row, n:] = rng.choice([-7, pool, pool + 1000, *np.asarray(table)[0, :1], *np.asarray(table)[-1]],
                                      size=garbage.shape[1] - n)
    spare = np.setdiff1d(np.arange(pool), np.asarray(table))
    assert len(spare) == 3
    k2, v2 = k.at[spare].set(1e4), v.at[spare].set(-1e4)  # would dominate any softmax that read them
    again = jax.device_get(_all(q, k2, v2, jnp.asarray(garbage), q_pos, splits=case["splits"]))
    for impl in out:
        np.testing.assert_array_equal(again[impl], out[impl], err_msg=impl)


def test_default_splits_cover_the_table_and_fill_a_gpu():
    from hybridjax.pallas_kernels.paged_attention.pallas import MAX_SPLITS, default_splits

    assert default_splits(1, 2, 1, 64) == MAX_SPLITS  # one sequence: split its pages
    assert default_splits(1, 2, 1, 3) == 3  # never more splits than pages
    assert default_splits(64, 2, 1, 64) == 1  # a full batch fills the GPU by itself
    assert default_splits(8, 2, 1, 64) == 8


# ---- lowering ----------------------------------------------------------------------------------

TRITON_CALL = "__gpu$xla.gpu.triton"
sds = jax.ShapeDtypeStruct


def _lower(impl, t, dtype, platform="cuda", b=3, hq=16, hkv=2, dh=256, s=64, pool=100, n_table=63):
    """The public entry point at Qwen3.5's attention head size (16 q / 2 kv heads of 256); the
    batch, pool and table sizes are not powers of two (Triton tiles must be; these are not tiles)."""
    args = (sds((b, t, hq, dh), dtype), sds((pool, s, hkv, dh), dtype), sds((pool, s, hkv, dh), dtype),
            sds((b, n_table), jnp.int32), sds((b, t), jnp.int32))
    with cuda_target() if platform == "cuda" else contextlib.nullcontext():
        return jax.jit(functools.partial(paged_attention, implementation=impl)).trace(*args).lower(
            lowering_platforms=(platform,))


def _kernels(text):
    return re.findall(r"custom_call @([\w$.]+)", text)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl, t", [("pallas", 1), (None, 1), (None, MAX_DECODE_QUERIES), ("pallas", 40)])
def test_lowers_for_cuda_with_the_triton_kernel(impl, t, dtype):
    text = _lower(impl, t, dtype).as_text()
    assert _kernels(text) == [TRITON_CALL]
    assert re.findall(r'name = "(\w+)"', text) == ["paged_attention"]
    assert "stablehlo.while" not in text  # the interpreter's loop over the grid is gone


def test_none_keeps_xla_for_prefill_chunks_and_shapes_the_kernel_cannot_take():
    assert TRITON_CALL not in _lower(None, MAX_DECODE_QUERIES + 1, jnp.bfloat16).as_text()
    assert TRITON_CALL not in _lower(None, 1, jnp.bfloat16, dh=80).as_text()  # Dh not a power of two
    assert TRITON_CALL not in _lower(None, 1, jnp.bfloat16, s=8).as_text()  # pages below 16 keys
    assert TRITON_CALL not in _lower("xla", 1, jnp.bfloat16).as_text()  # an explicit "xla" stays XLA on GPU


def _program(compiled):
    """A compiled module's HLO without source locations (metadata and the debug tables)."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    return "\n".join(line for line in text.splitlines()
                     if not re.match(r"(\d+ [{\"]|FileNames|FunctionNames|FileLocations|StackFrames)", line))


def test_cpu_default_is_exactly_the_xla_path():
    # The engine's attention on CPU is untouched: None compiles to the XLA path's program.
    kw = dict(b=4, t=1, dtype=jnp.float32, platform="cpu", hq=8, dh=128, pool=40, n_table=8)
    none, xla = _lower(None, **kw), _lower("xla", **kw)
    assert TRITON_CALL not in none.as_text()
    assert _program(none.compile()) == _program(xla.compile())
    # and an explicit "pallas" on CPU is the interpreter
    text = _lower("pallas", **kw).as_text()
    assert TRITON_CALL not in text and "stablehlo.while" in text


def test_engine_decode_step_carries_the_kernel_on_gpu():
    """Lowered for CUDA, the engine's decode step (T = 1) runs the paged kernel in its attention
    layer; a prefill chunk (T = 32 > MAX_DECODE_QUERIES) keeps the XLA path."""
    from hybridjax import engine_steps as steps
    from hybridjax.default_model import tiny_test_model

    cfg, params, _ = tiny_test_model()
    state = jax.eval_shape(lambda: steps.init_state(cfg, 2, 32, 16))
    rows, table = sds((2,), jnp.int32), sds((2, 8), jnp.int32)
    with cuda_target():
        decode = steps.decode.trace(params, state, rows, table, cfg).lower(lowering_platforms=("cuda",)).as_text()
    names = re.findall(r'name = "(\w+)"', decode)
    assert names.count("paged_attention") == sum(t == "full_attention" for t in cfg.layer_types) == 1, names
    chunk = sds((2, 32), jnp.int32)
    with cuda_target():
        prefill = steps.prefill_chunk.trace(params, state, rows, chunk, sds((2,), jnp.int32), table,
                                            sds((2,), bool), cfg).lower(lowering_platforms=("cuda",)).as_text()
    assert "paged_attention" not in re.findall(r'name = "(\w+)"', prefill)


@pytest.mark.parametrize("pages_per_row", [1, 2, 4])
def test_engine_decode_step_copies_no_pool_with_a_short_table(pages_per_row):
    """On CPU the decode step writes its token into the page pools in place for any table width.
    With a table of one attention block, XLA:CPU once inlined the block loop, fused the page gather
    with the write and copied every pool twice per step (6x slower at max_len 256)."""
    from hybridjax import engine_steps as steps
    from hybridjax.default_model import tiny_test_model

    cfg, params, _ = tiny_test_model()
    state = jax.eval_shape(lambda: steps.init_state(cfg, 2, 32, 16))
    rows, table = sds((1,), jnp.int32), sds((1, pages_per_row), jnp.int32)
    hlo = steps.decode.trace(params, state, rows, table, cfg, "xla").lower().compile().as_text()
    pool = re.escape(str(state.layers[cfg.layer_types.index("full_attention")].k.shape).replace(" ", "")[1:-1])
    copies = re.findall(rf"= f32\[{pool}\]\S* copy\(", hlo)
    assert not copies, copies


def test_a_bfloat16_pool_held_as_bits_gives_the_same_numbers():
    """On CPU a bfloat16 page pool is made as uint16 bits (`pool_dtype`): XLA:CPU converts a whole
    bfloat16 array to float32 to write into it or gather from it. Written and read as bits, the
    pool and the attention over it equal those of a bfloat16 pool, bit for bit."""
    from hybridjax import ops

    assert ops.pool_dtype(jnp.bfloat16) == jnp.uint16 and ops.pool_dtype(jnp.float32) == jnp.float32
    rng = np.random.default_rng(7)
    pool = jnp.asarray(rng.standard_normal((6, 16, 2, 32)), jnp.bfloat16)
    table, starts = jnp.array([[4, 1, 6], [2, 3, 6]], jnp.int32), jnp.array([20, 5], jnp.int32)  # 6: no page
    new = jnp.asarray(rng.standard_normal((2, 3, 2, 32)), jnp.float32)  # written at 20..22 and 5..7
    valid = jnp.array([[True, True, True], [True, True, False]])
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 32)), jnp.float32)
    positions = starts[:, None] + jnp.arange(3)

    @jax.jit
    def step(pool):
        written = ops.write_kv_paged(pool, new, table, starts, valid)
        return written, paged_attention_xla(q, written, written, table, positions, scale=0.2)

    plain, out = step(pool)
    bits, out_bits = step(jax.lax.bitcast_convert_type(pool, jnp.uint16))
    assert plain.dtype == jnp.bfloat16 and bits.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(ops.pool_values(bits)), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(out_bits), np.asarray(out))
    assert not np.array_equal(np.asarray(plain), np.asarray(pool))  # the write happened


def test_engine_decode_step_keeps_a_bfloat16_pool_as_bits():
    """A bfloat16 engine's decode step writes its token into each pool in place and gathers the
    pages it reads: no array of a pool's shape in float32 or bfloat16 anywhere in the compiled step
    (it had two per pool, converted whole every step: 0.2x of `generate` at max_len 4096)."""
    from hybridjax import engine_steps as steps
    from hybridjax.default_model import tiny_test_model

    cfg, params, _ = tiny_test_model()
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, params)
    state = jax.eval_shape(lambda: steps.init_state(cfg, 2, 32, 16, jnp.bfloat16))
    kv = state.layers[cfg.layer_types.index("full_attention")]
    assert kv.k.dtype == kv.v.dtype == jnp.uint16
    hlo = steps.decode.trace(params, state, sds((1,), jnp.int32), sds((1, 4), jnp.int32), cfg,
                             "xla").lower().compile().as_text()
    pool = re.escape(str(kv.k.shape).replace(" ", "")[1:-1])
    assert re.search(rf"u16\[{pool}\]", hlo)
    converted = re.findall(rf"(?:f32|bf16)\[{pool}\]", hlo)
    assert not converted, converted


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_engine_decode_step_copies_no_state_leaf(rows):
    """The decode step updates the rows' GDN states (and every other per-row leaf) in place. A
    one-row gather, fused into each reader of a donated leaf, once made XLA:CPU copy every GDN
    state leaf whole, twice per step (~7 ms of a 50 ms step on the 228M model: engine_steps._take)."""
    from hybridjax import engine_steps as steps
    from hybridjax.default_model import tiny_test_model

    cfg, params, _ = tiny_test_model()
    state = jax.eval_shape(lambda: steps.init_state(cfg, 4, 32, 16))
    hlo = steps.decode.trace(params, state, sds((rows,), jnp.int32), sds((rows, 4), jnp.int32), cfg,
                             "xla").lower().compile().as_text()
    leaves = {x.shape for x in jax.tree_util.tree_leaves(state.layers[cfg.layer_types.index("linear_attention")])}
    assert leaves and all(shape[0] == 4 for shape in leaves)
    copied = [c for shape in leaves
              for c in re.findall(rf"= f32\[{re.escape(str(shape).replace(' ', '')[1:-1])}\]\S* copy\(", hlo)]
    assert not copied, copied


# ---- choices that cannot run fail fast ---------------------------------------------------------


def _small(dh=16, s=16):
    return (jnp.zeros((1, 1, 2, dh)), jnp.zeros((4, s, 1, dh)), jnp.zeros((4, s, 1, dh)),
            jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32))


def test_no_queries():
    q, k, v, table, _ = _small()
    out = paged_attention(q[:, :0], k, v, table, jnp.zeros((1, 0), jnp.int32), implementation="pallas")
    assert out.shape == (1, 0, 2, 16) and out.dtype == q.dtype


def test_unknown_implementation_fails_fast():
    with pytest.raises(ValueError, match=r"'triton'.*\['pallas', 'reference', 'xla'\]"):
        paged_attention(*_small(), implementation="triton")


def test_pallas_on_unsupported_backend_fails_fast(monkeypatch):
    monkeypatch.setattr(api.jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="implementation='pallas' cannot run on the 'tpu' backend"):
        paged_attention(*_small(), implementation="pallas")


@pytest.mark.parametrize("dh, s, what", [(80, 16, "head dim Dh"), (16, 8, "page size S")])
def test_pallas_with_shapes_it_cannot_take_fails_fast(dh, s, what):
    with pytest.raises(ValueError, match=f"needs {what} to be a power of two >= 16"):
        paged_attention(*_small(dh, s), implementation="pallas")


# ---- compiled offline for GPUs (needs `triton` and pallas_kernels/triton_offline.py) -----------


@pytest.mark.parametrize("arch", [90, 89])
@pytest.mark.parametrize("dtype, t", [(jnp.bfloat16, 1), (jnp.bfloat16, MAX_DECODE_QUERIES), (jnp.float32, 1)])
def test_compiles_for_gpu_without_spills(dtype, t, arch):
    """The kernel at Qwen3.5's head size and the engine's page size, compiled for sm_90 / sm_89
    with the `triton` package (no GPU needed): bf16 on tensor cores, no spills, shared memory
    within the target's limit. Skipped where the offline compiler helper is not installed."""
    pytest.importorskip("triton")
    triton_offline = pytest.importorskip("hybridjax.pallas_kernels.triton_offline")
    [kernel] = triton_offline.triton_kernels(_lower("pallas", t, dtype))
    report = triton_offline.compile_kernel(kernel, arch)
    print(triton_offline.format_table([report]))
    assert report.tensor_core > 0 if dtype == jnp.bfloat16 else report.fma > 0
    assert not report.spills and report.shared_ok, report
