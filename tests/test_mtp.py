"""The multi-token-prediction head: loaded from `mtp.*` tensors into `params.mtp`, its forward
against a torch version written from vLLM's qwen3_next_mtp / qwen3_5_mtp (tests/hf_models.py,
`TorchMTP`, with transformers' own decoder layer), incremental == whole, and the round trip
through a converted checkpoint back to HF tensors.

Tolerance: float32 on both sides, different op order: max|ours - theirs| <= 1e-4 * max|theirs|
(as test_model.py; measured ~1e-6).
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # checks against transformers: skipped without torch

from hybridjax import conversion
import hf_models
import hybridjax
from hybridjax.model import forward_hidden
from hybridjax.mtp import init_mtp_state, mtp_forward

RTOL = 1e-4
T = 20


def err_ratio(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


_mtp = jax.jit(mtp_forward, static_argnames=("cfg",))


@pytest.fixture(scope="module")
def with_mtp(hf_dirs, torch_models, tmp_path_factory):
    """arch -> (HF dir with an MTP head, the head as TorchMTP)."""
    out = {}
    for arch in ("qwen3_5_dense", "qwen3_next_moe", "qwen3_5_multimodal"):
        d = tmp_path_factory.mktemp("mtp") / arch
        shutil.copytree(hf_dirs[arch], d)
        out[arch] = (d, hf_models.add_mtp_head(d, torch_models[arch]))
    return out


def _text(model):
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


@pytest.mark.parametrize("arch", ["qwen3_5_dense", "qwen3_next_moe", "qwen3_5_multimodal"])
def test_mtp_matches_torch_reference(arch, with_mtp, torch_models):
    d, head = with_mtp[arch]
    cfg, params = hybridjax.load_hf(d)
    assert params.mtp is not None
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, T + 1)).astype(np.int32)
    tokens, nxt = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        hidden = _text(torch_models[arch])(input_ids=torch.as_tensor(tokens, dtype=torch.long)).last_hidden_state
        pos = torch.arange(T)[None].expand(2, T)
        ref_logits, ref_out = head(hidden, torch.as_tensor(nxt, dtype=torch.long), pos)
    # Our main model's hidden states equal torch's (the MTP head's input).
    ours_h, _ = forward_hidden(params, tokens, hybridjax.init_cache(cfg, 2, 64), cfg)
    assert err_ratio(ours_h, hidden.numpy()) < RTOL

    starts = np.zeros(2, np.int32)
    logits, out, state = _mtp(params, hidden.numpy(), nxt, init_mtp_state(cfg, 2, 64), starts, cfg)
    assert logits.shape == (2, T, cfg.vocab_size)
    assert err_ratio(logits, ref_logits.numpy()) < RTOL, err_ratio(logits, ref_logits.numpy())
    assert err_ratio(out, ref_out.numpy()) < RTOL

    # From a state: the first 13 positions, then the other 7, give the same logits.
    a, _, st = _mtp(params, hidden.numpy()[:, :13], nxt[:, :13], init_mtp_state(cfg, 2, 64), starts, cfg)
    b, _, st = _mtp(params, hidden.numpy()[:, 13:], nxt[:, 13:], st, starts + 13, cfg)
    assert err_ratio(np.concatenate([a, b], axis=1), logits) < RTOL
    assert err_ratio(st.k[:, :T], state.k[:, :T]) < RTOL


def test_mtp_survives_convert_and_export(with_mtp, tmp_path):
    from hybridjax.conversion.cli import main

    src, _ = with_mtp["qwen3_next_moe"]
    side = {"tokenizer.json": '{"version": "1.0"}', "chat_template.jinja": "{{ x }}"}
    for name, text in side.items():
        (src / name).write_text(text)
    assert main(["--hf-dir", str(src), "--out", str(tmp_path / "ckpt"), "--quiet"]) == 0
    _, from_ckpt = conversion.load(tmp_path / "ckpt")
    _, from_hf = hybridjax.load_hf(src)
    assert from_ckpt.mtp is not None
    for a, b in zip(jax.tree_util.tree_leaves(from_ckpt.mtp), jax.tree_util.tree_leaves(from_hf.mtp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert main(["--to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--quiet"]) == 0
    from safetensors.numpy import load_file

    want, got = load_file(src / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(want) == sorted(got) and any(n.startswith("mtp.") for n in got)
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)


def test_no_mtp_head_is_a_clear_error(loaded):
    cfg, params = loaded["qwen3_5_dense"]
    assert params.mtp is None
    with pytest.raises(ValueError, match="no MTP head"):
        mtp_forward(params, np.zeros((1, 2, cfg.hidden_size), np.float32), np.zeros((1, 2), np.int32),
                    init_mtp_state(cfg, 1, 64), np.zeros(1, np.int32), cfg)


def test_partial_mtp_head_is_kept_not_loaded(with_mtp, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "partial"
    shutil.copytree(with_mtp["qwen3_5_dense"][0], d)
    tensors = load_file(d / "model.safetensors")
    del tensors["mtp.norm.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    # issue 22: a partial head never blocks the text model; it is kept verbatim, not loaded
    _, params = hybridjax.load_hf(d)
    assert params.mtp is None and "mtp.fc.weight" in params.extra and "mtp.norm.weight" not in params.extra
