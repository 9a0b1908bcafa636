"""Weight-only int8 as a model mode (`cpu_kernels.Int8Weight`, `quantize_params(.., "int8-wo")`,
`hybridjax.load(..., quantize="int8")`, `--quantize int8`; the int8 x int8 path that "int8" picks
on AVX2 is tested in tests/test_int8_dot.py): the kernel's int8 path through the
whole model on every ISA path this CPU has, against XLA on the same int8 weights, and the int8
model against the float32 one.

Tolerances.
- int8 model, kernel vs XLA (same q and scale): both compute (x @ q) * scale in float32 with
  sums in different orders, as the float32 model does with and without the kernel
  (tests/test_cpu_kernels.py): 1e-5 of the logit range, and the same greedy tokens.
- int8 vs float32 model: each weight moves by at most half a step, scale / 2 with scale =
  max |w[:, n]| / 127, so a projection's output moves by about (amax / sigma) / (127 sqrt(12))
  ~ 1% of its own RMS for the tiny test models' Gaussian weights (amax ~ 3-4 sigma over K = 64-128
  rows), partly cancelling over a few layers. Measured (8 steps, teacher-forced): 0.24% of the
  logit range for qwen3_5_dense, 0.70% for qwen3_next_moe, 0.53% in bfloat16; we allow 2%, and
  require most greedy tokens equal (all were; a near tie may flip one).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybridjax
from hybridjax import cpu_kernels, ops

from decode_helpers import decode_logits

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernel extension not built")


def paths_here() -> list[str]:
    return list(cpu_kernels.ISAS[: cpu_kernels.ISAS.index(cpu_kernels.best_isa()) + 1])


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_quantize_params_quantises_the_projections_only(loaded):
    cfg, params = loaded["qwen3_next_moe"]  # untied head, MoE router and experts
    q = cpu_kernels.quantize_params(params, "int8-wo")  # int8-dot's layout: tests/test_int8_dot.py
    leaves = jax.tree_util.tree_leaves_with_path(q, is_leaf=lambda x: isinstance(x, cpu_kernels.Int8Weight))
    names = {jax.tree_util.keystr(kp).split(".")[-1] for kp, x in leaves if isinstance(x, cpu_kernels.Int8Weight)}
    assert names and names <= cpu_kernels.INT8_WEIGHTS and "lm_head" in names
    assert "router" not in names and "embed" not in names
    for kp, x in leaves:
        if isinstance(x, cpu_kernels.Int8Weight):
            assert x.q.dtype == jnp.int8 and x.scale.dtype == jnp.float32 and x.scale.shape == x.q.shape[1:]
    w = params.lm_head
    back = cpu_kernels.plain_weight(q.lm_head)  # dequantised: within half a step per column
    step = np.asarray(q.lm_head.scale)
    assert np.all(np.abs(np.asarray(back) - np.asarray(w)) <= step / 2 * (1 + 1e-6))
    assert cpu_kernels.quantize_params(q).lm_head is q.lm_head  # idempotent: Int8Weight stays
    with pytest.raises(ValueError, match="unknown quantisation 'int4'"):
        cpu_kernels.quantize_params(params, "int4")


def test_dense_int8_rows_to_the_kernel_and_prefill_widened(monkeypatch):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 200)).astype(np.float32)
    iw = cpu_kernels.Int8Weight(*cpu_kernels.quantize_int8(w))
    ref_w = np.asarray(cpu_kernels.plain_weight(iw))
    for rows in (1, 3, cpu_kernels.DECODE_ROWS + 5):  # kernel, kernel, XLA (int8: decode rows only)
        x = rng.standard_normal((rows, 96)).astype(np.float32)
        y = jax.jit(ops.dense)(x, iw)
        np.testing.assert_allclose(np.asarray(y), x @ ref_w, rtol=1e-4, atol=1e-4)
        xb = jnp.asarray(x, jnp.bfloat16)  # a bf16 model's activations
        yb = jax.jit(ops.dense)(xb, iw)
        assert yb.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(yb, np.float32), np.asarray(xb, np.float32) @ ref_w, rtol=2e-2, atol=2e-2)
    text = jax.jit(ops.dense).lower(jnp.zeros((1, 96)), iw).as_text()
    assert cpu_kernels.TARGET in text
    with pytest.raises(ValueError, match="transposed"):
        ops.dense(jnp.zeros((1, 200)), iw, transposed=True)


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_int8_model_decode_on_every_path_equals_xla(isa, loaded, monkeypatch):
    """Decode of the int8 model with the path capped (HYBRIDJAX_CPU_ISA) against XLA's matmul on
    the same int8 weights: 1e-5 of the range, the same greedy tokens."""
    if isa not in paths_here():
        pytest.skip(f"this CPU has no {isa} (best: {cpu_kernels.best_isa()})")
    cfg, params = loaded["qwen3_next_moe"]
    q = cpu_kernels.quantize_params(params, "int8-wo")  # int8-dot rounds x too: tests/test_int8_dot.py
    prompt = np.random.RandomState(8).randint(0, cfg.vocab_size, 7).tolist()
    monkeypatch.setenv("HYBRIDJAX_CPU_ISA", isa)
    ours = decode_logits(q, cfg, prompt, 4)
    monkeypatch.delenv("HYBRIDJAX_CPU_ISA")
    monkeypatch.setenv("HYBRIDJAX_CPU_KERNELS", "0")
    ref = decode_logits(q, cfg, prompt, 4)
    assert rel_err(ours, ref) < 1e-5, (isa, rel_err(ours, ref))
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


@functools.lru_cache(maxsize=None)
def _forward(cfg):
    return jax.jit(functools.partial(hybridjax.forward, cfg=cfg))


def forced_logits(params, cfg, prompt, steps, tokens=None):
    """[1 + steps, vocab]: the logits after the prompt (prefill), then after each of `steps`
    tokens fed one decode step at a time: `tokens` (teacher forcing), or greedy when None.
    Returns (logits, the tokens fed)."""
    fwd = _forward(cfg)
    cache = hybridjax.init_cache(cfg, 1, 64, capacity=64)
    logits, cache = fwd(params, jnp.asarray([prompt], jnp.int32), cache)
    out, fed = [np.asarray(logits[0, -1])], []
    for i in range(steps):
        fed.append(int(out[-1].argmax()) if tokens is None else tokens[i])
        logits, cache = fwd(params, jnp.asarray([[fed[-1]]], jnp.int32), cache)
        out.append(np.asarray(logits[0, -1]))
    return np.stack(out), fed


@pytest.mark.parametrize("mode", ["int8-wo", "int8-dot"])
@pytest.mark.parametrize("arch, dtype", [("qwen3_5_dense", "float32"), ("qwen3_next_moe", "float32"),
                                         ("qwen3_5_dense", "bfloat16")])
def test_int8_model_against_float32(arch, dtype, mode, loaded):
    """Teacher-forced on the unquantised model's greedy tokens (prefill through XLA's widened
    matmul, then decode steps through the kernel: weight-only, or int8 x int8 with x rounded per
    block): the int8 model's logits within 2% of the range (module docstring; in bfloat16 both
    sides round activations alike), greedy tokens mostly equal."""
    cfg, params = loaded[arch]
    params = hybridjax.params.cast_params(params, dtype)
    q = cpu_kernels.quantize_params(params, mode)
    prompt = np.random.RandomState(3).randint(0, cfg.vocab_size, 9).tolist()
    ref, tokens = forced_logits(params, cfg, prompt, 7)
    got, _ = forced_logits(q, cfg, prompt, 7, tokens)
    err = rel_err(got, ref)
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    print(f"{arch} {dtype}: {mode} vs unquantised logits, max |diff| / max |logit| = {err:.4f}, argmax agree {agree:.2f}")
    assert err < 2e-2, err
    assert agree >= 0.75, (got.argmax(-1), ref.argmax(-1))


def test_the_cli_offers_the_library_quantize_modes():
    """The CLI keeps its own copy (it parses arguments without importing the kernels): the same."""
    from hybridjax.cli.common import QUANTIZE_MODES

    assert QUANTIZE_MODES == cpu_kernels.QUANTIZE_MODES


def test_load_and_cli_quantize(hf_dirs, loaded, capsys):
    from hybridjax.cli import main
    from hybridjax.default_model import default_model
    from hybridjax.generate import generate

    cfg, q = hybridjax.load_hf(hf_dirs["qwen3_5_dense"], dtype="float32", quantize="int8")
    assert isinstance(q.layers[0].ffn.up, cpu_kernels.Int8Weight)
    ref = cpu_kernels.quantize_params(loaded["qwen3_5_dense"][1])  # "int8": this CPU's layout, either one
    for got, want in zip(jax.tree_util.tree_leaves(q.layers[0].ffn.up), jax.tree_util.tree_leaves(ref.layers[0].ffn.up)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for bad, match in (({"quantize": "int4"}, "quantize must be one of int8"),
                       ({"quantize": "int8", "pack_for_decode": True}, "two decode layouts")):
        with pytest.raises(ValueError, match=match):
            hybridjax.load_hf(hf_dirs["qwen3_5_dense"], **bad)

    dcfg, params, tok = default_model("float32")
    prompt = tok.encode("Hello")
    args = ["generate", "--no-compile-cache", "--prompt", "Hello", "--max-new-tokens", "5", "--json", "--quantize", "int8"]
    assert main(args) == 0
    expect = generate(cpu_kernels.quantize_params(params), dcfg, [prompt], max_new_tokens=5,
                      stop_ids=tok.eos_token_ids).token_lists()[0]
    assert json.loads(capsys.readouterr().out)["token_ids"] == expect
    for flags, msg in ((["--mesh", "tensor=1"], "--quantize int8 runs on one device: drop --mesh"),
                       (["--dtype", "bfloat16", "--pack-for-decode"], "two decode layouts")):
        assert main(args + flags) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err
    with pytest.raises(SystemExit) as e:
        main(args[:-1] + ["int4"])
    assert e.value.code == 2
