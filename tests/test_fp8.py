"""Block-wise fp8 checkpoints (issue 22, part 3), quantised by the test itself in the published layout.

Like Qwen's `*-FP8` releases: every linear projection `*_proj.weight` is float8_e4m3fn with a float32
`*_proj.weight_scale_inv` per block (ceil-div, so partial edge blocks), everything else (embeddings,
lm_head, norms, router `mlp.gate`, `shared_expert_gate`, conv, gates) unquantised in bfloat16, and
`quantization_config` in config.json. The block quantiser and dequantiser here are written
independently of `hybridjax.conversion.fp8` (plain loops over blocks).

Checks: loaded weights equal the test's own dequantisation bit for bit; logits equal transformers
running the dequantised float32 weights (float32 both sides, different op order: bound 1e-4
relative, as in test_model.py); HF -> hybridjax -> HF gives the fp8 bytes and scales back exactly.
"""

from __future__ import annotations

import json
import math
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import hf_models
import hybridjax
from hybridjax.conversion.cli import main as convert_main
from hybridjax.conversion.hf import open_hf
from test_conversion import assert_bit_identical, read_safetensors
from test_model import PARITY_RTOL, err_ratio, tokens_for, torch_logits

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
NOT_CONVERTED = ["lm_head", "embed_tokens", "mlp.gate", "mlp.shared_expert_gate", "mtp.fc"]


def qwen3_5_odd(out):
    """A Qwen3.5 text model whose dims are not multiples of 128: hidden 96, MLP 200."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(7)
    cfg = Qwen3_5TextConfig(**{**hf_models.TINY, "hidden_size": 96, "head_dim": 32, "linear_key_head_dim": 16,
                               "linear_value_head_dim": 16}, intermediate_size=200, linear_num_key_heads=2,
                            linear_num_value_heads=4)
    return hf_models._save(Qwen3_5ForCausalLM(cfg).eval(), out, 7)


def is_quantised(name: str, x: np.ndarray) -> bool:
    return x.ndim == 2 and name.endswith("_proj.weight")


def quantise_blocks(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 weight, float32 scale_inv [ceil(R/bo), ceil(C/bi)]): each block scaled to fill e4m3."""
    bo, bi = block
    scale = np.ones((math.ceil(w.shape[0] / bo), math.ceil(w.shape[1] / bi)), np.float32)
    q = np.zeros(w.shape, E4M3)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].astype(np.float32)
            amax = float(np.abs(blk).max())
            scale[i, j] = amax / E4M3_MAX if amax > 0 else 1.0
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = (blk / scale[i, j]).astype(E4M3)
    return q, scale


def dequantise_blocks(q: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    bo, bi = block
    w = np.zeros(q.shape, np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].astype(np.float32) * scale[i, j]
    return w


def make_fp8(src, out, block):
    """(fp8 checkpoint dir, float32 dequantised twin dir that transformers loads)."""
    shutil.copytree(src, out)
    twin = out.parent / (out.name + "-dequantised")
    shutil.copytree(src, twin)
    tensors = load_file(src / "model.safetensors")
    fp8, deq = {}, {}
    for name, x in tensors.items():
        if is_quantised(name, x):
            q, s = quantise_blocks(x, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantise_blocks(q, s, block)
        else:
            fp8[name] = x.astype(ml_dtypes.bfloat16)
            deq[name] = fp8[name].astype(np.float32)
    save_file(fp8, out / "model.safetensors", metadata={"format": "pt"})
    save_file(deq, twin / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"activation_scheme": "dynamic", "quant_method": "fp8", "weight_block_size": list(block),
                                  "modules_to_not_convert": NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out, twin


@pytest.fixture(scope="module")
def fp8_dirs(hf_dirs, tmp_path_factory):
    """case -> (fp8 dir, dequantised twin, block): the published 128x128 block over odd dims, and a
    small block over Qwen3-Next (fused projections, per-expert weights, an MTP head) so that every
    tensor has several blocks per axis, partial ones included (32 / 24, 48 / 16 ...)."""
    root = tmp_path_factory.mktemp("fp8")
    odd = qwen3_5_odd(root / "odd")
    nxt = root / "next"
    shutil.copytree(hf_dirs["qwen3_next_moe"], nxt)
    hf_models.add_mtp_head(nxt, hf_models.load_torch(nxt))
    return {"odd-128": (*make_fp8(odd, root / "odd-fp8", (128, 128)), (128, 128)),
            "next-16x24": (*make_fp8(nxt, root / "next-fp8", (16, 24)), (16, 24))}


@pytest.mark.parametrize("case", ["odd-128", "next-16x24"])
def test_fp8_loads_as_its_dequantisation_and_matches_transformers(case, fp8_dirs, jforward):
    d, twin, _ = fp8_dirs[case]
    stored = read_safetensors(d / "model.safetensors")
    assert sum(x.dtype == E4M3 for x in stored.values()) > 10 and "model.embed_tokens.weight" in stored
    cfg, params = hybridjax.load_hf(d, dtype="float32")
    assert cfg.weight_block_size == fp8_dirs[case][2]
    _, want = hybridjax.load_hf(twin, dtype="float32")  # the test's own dequantisation, read plainly
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params.replace(extra={})),
                            jax.tree_util.tree_leaves(want.replace(extra={})), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    assert (params.mtp is not None) == (case == "next-16x24")
    assert sorted(params.extra) == sorted(n for n in stored if n.endswith("_scale_inv"))
    tokens = tokens_for(cfg, 11, seed=5)
    ours, _ = jforward(params, tokens, hybridjax.init_cache(cfg, 1, 64), cfg)
    assert err_ratio(ours, torch_logits(hf_models.load_torch(twin), tokens)) < PARITY_RTOL
    _, bf16 = hybridjax.load_hf(d, dtype="bfloat16")  # dequantised, then cast to the requested dtype
    assert bf16.layers[0].mixer.in_qkv.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16.layers[0].mixer.in_qkv),
                                  np.asarray(want.layers[0].mixer.in_qkv).astype(ml_dtypes.bfloat16))


def test_fp8_slices_dequantise_like_the_whole(fp8_dirs):
    """Sharded loading reads slices: a slice's dequantisation equals that slice of the whole."""
    d, _, _ = fp8_dirs["next-16x24"]
    with open_hf(d) as src:
        name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
        whole = src.reader.get(name)
        for idx in [(slice(0, 40), slice(0, 32)), (slice(17, 57), slice(5, 29)), (slice(70, 96), slice(23, 32))]:
            np.testing.assert_array_equal(src.reader.get_slice(name, idx), whole[idx])


@pytest.mark.parametrize("case", ["odd-128", "next-16x24"])
def test_fp8_round_trip_is_bitwise(case, fp8_dirs, tmp_path):
    src = fp8_dirs[case][0]
    assert convert_main(["--hf-dir", str(src), "--out", str(tmp_path / "ckpt"), "--quiet"]) == 0
    assert json.loads((tmp_path / "ckpt" / "hybridjax.json").read_text())["dtype"] == "bfloat16"
    assert convert_main(["--to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--quiet"]) == 0
    assert_bit_identical(src, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    (tmp_path / "mem").mkdir()  # straight from memory too, from a float32 load
    cfg, params = hybridjax.load_hf(src, dtype="float32")
    hybridjax.save_hf(params, cfg, tmp_path / "mem")
    got, want = read_safetensors(tmp_path / "mem" / "model.safetensors"), read_safetensors(src / "model.safetensors")
    for n, x in want.items():
        if x.dtype == E4M3 or n.endswith("_scale_inv"):
            assert got[n].dtype == x.dtype and got[n].tobytes() == x.tobytes(), n


def test_fp8_to_float16_is_refused(fp8_dirs, tmp_path, capsys):
    assert convert_main(["--hf-dir", str(fp8_dirs["odd-128"][0]), "--out", str(tmp_path / "c"), "--dtype", "float16",
                         "--quiet"]) == 1
    assert "fp8 weights convert to bfloat16 or float32" in capsys.readouterr().err
