"""benchmarks/widen_model.py: a widened checkpoint computes what its source computes.

Source: a tiny transformers-made Qwen3.5 dense checkpoint (tests/hf_models.py, tied embeddings,
norm weights moved off their init) with a random MTP head, widened with F = 3 (hidden 32 -> 96,
not a power of two: float32 weights, division by 3 rounded) and G = 2 (MLP 64 -> 128). Compared,
each side against the source through the same implementation:
  - hybridjax logits (`load_hf` + `forward`) and transformers' logits (`Qwen3_5ForCausalLM`);
  - the MTP head (`hybridjax.mtp.mtp_forward`): logits equal, its hidden output is F copies.
Tolerance: float32 with sums of F times as many terms in another order, and weights / 3 rounded:
max|wide - source| <= 1e-5 * max|source| (measured 2e-7 to 5e-7).
The embedded default, widened by powers of two, keeps bfloat16 weights bit for bit (x / 2**n
is exact).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # checks against transformers: skipped without torch

import hf_models
import hybridjax
from hybridjax.model import forward_hidden
from hybridjax.mtp import init_mtp_state, mtp_forward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import widen_model  # noqa: E402

F, G = 3, 2
RTOL = 1e-5
T = 12


def err_ratio(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("widen")
    src = hf_models.qwen3_5_dense(root / "src")
    hf_models.add_mtp_head(src, hf_models.load_torch(src))
    return src, widen_model.widen_dir(src, root / "wide", F, G)


@pytest.fixture(scope="module")
def tokens():
    return np.random.RandomState(0).randint(0, 272, (2, T)).astype(np.int32)


def test_config_and_shapes(dirs):
    src, wide = dirs
    a, b = (json.loads((d / "config.json").read_text()) for d in dirs)
    assert b["hidden_size"] == F * a["hidden_size"] and b["intermediate_size"] == G * a["intermediate_size"]
    assert a["tie_word_embeddings"] and not b["tie_word_embeddings"]
    assert b["num_attention_heads"] == a["num_attention_heads"] and b["head_dim"] == a["head_dim"]


_fwd = jax.jit(hybridjax.forward, static_argnames=("cfg",))
_mtp = jax.jit(mtp_forward, static_argnames=("cfg",))


def test_hybridjax_logits_and_mtp_match(dirs, tokens):
    (cfg, params), (wcfg, wparams) = (hybridjax.load_hf(d, dtype="float32") for d in dirs)
    assert wparams.mtp is not None and wcfg.hidden_size == F * cfg.hidden_size

    def run(c, p):
        logits, _ = _fwd(p, tokens, hybridjax.reserve(hybridjax.init_cache(c, 2, 64), T), c)
        hidden, _ = forward_hidden(p, tokens, hybridjax.init_cache(c, 2, 64), c)
        return np.asarray(logits), np.asarray(hidden)

    (la, ha), (lb, hb) = run(cfg, params), run(wcfg, wparams)
    assert err_ratio(lb, la) < RTOL, err_ratio(lb, la)
    assert err_ratio(hb, np.tile(ha, F)) < RTOL  # the final-normed stream is F copies

    nxt = np.roll(tokens, -1, axis=1)
    starts = np.zeros(2, np.int32)
    ma, oa, _ = _mtp(params, ha, nxt, init_mtp_state(cfg, 2, 64), starts, cfg)
    mb, ob, _ = _mtp(wparams, hb, nxt, init_mtp_state(wcfg, 2, 64), starts, wcfg)
    assert err_ratio(mb, ma) < RTOL, err_ratio(mb, ma)
    assert err_ratio(ob, np.tile(np.asarray(oa), F)) < RTOL
    assert np.abs(np.asarray(ma)).max() > 1e-3  # not a degenerate comparison


def test_transformers_logits_match(dirs, tokens):
    a, b = (hf_models.load_torch(d) for d in dirs)
    assert type(b).__name__ == "Qwen3_5ForCausalLM"
    assert b.lm_head.weight.data_ptr() != b.model.embed_tokens.weight.data_ptr()  # untied
    with torch.no_grad():
        la, lb = (m(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.numpy() for m in (a, b))
    assert err_ratio(lb, la) < RTOL, err_ratio(lb, la)


def test_bfloat16_default_widens_exactly(tmp_path):
    from safetensors import safe_open

    src = widen_model.DEFAULT_SRC
    wide = widen_model.widen_dir(src, tmp_path / "w", 2, 2)
    with safe_open(src / "model.safetensors", "pt") as a, safe_open(wide / "model.safetensors", "pt") as b:
        emb, w_emb, head = a.get_tensor("model.embed_tokens.weight"), b.get_tensor("model.embed_tokens.weight"), \
            b.get_tensor("lm_head.weight")
        assert w_emb.dtype == head.dtype == torch.bfloat16
        assert torch.equal(w_emb, emb.repeat(1, 2)) and torch.equal(head * 2, emb.repeat(1, 2))
        down, w_down = a.get_tensor("model.layers.0.mlp.down_proj.weight"), b.get_tensor("model.layers.0.mlp.down_proj.weight")
        assert torch.equal(w_down * 2, down.repeat(2, 2))
        fc, w_fc = a.get_tensor("mtp.fc.weight"), b.get_tensor("mtp.fc.weight")
        d = fc.shape[0]
        assert torch.equal(w_fc * 2, torch.cat([fc[:, :d].repeat(2, 2), fc[:, d:].repeat(2, 2)], dim=1))


def test_unknown_tensor_is_refused():
    with pytest.raises(ValueError, match="no widening rule"):
        widen_model.widen_tensor("model.layers.0.mlp.experts.gate_up_proj", np.zeros((2, 4, 4), np.float32), 2, 2)
