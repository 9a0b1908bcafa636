"""Optional checkpoint parts load optionally (issue 22, part 1).

A Qwen3-Next checkpoint whose MTP head is partial (norms and `mtp.fc`, no layer), absent though
config.json declares it, renamed, or mis-shaped still loads its text model; the head's tensors are
kept verbatim in `params.extra` (so HF -> hybridjax -> HF is lossless), one warning line says so,
and asking for speculative decoding is a one-line error. The text model is compared with
transformers loading the same directory (it ignores mtp.* and reports unknown tensors): both
compute in float32, so logits agree to float32 rounding over a few layers (bound 1e-4 relative, as
in test_model.py).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_models
import hybridjax
from hybridjax.engine import Engine
from hybridjax.generate import generate
from hybridjax.conversion import CheckpointError
from hybridjax.conversion.cli import main as convert_main
from test_conversion import assert_bit_identical
from test_model import PARITY_RTOL, err_ratio, tokens_for, torch_logits

ARCH = "qwen3_next_moe"


@pytest.fixture(scope="module")
def with_head(hf_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("opt") / "full"
    shutil.copytree(hf_dirs[ARCH], d)
    hf_models.add_mtp_head(d, hf_models.load_torch(d))
    return d


def variant(src, dst, edit, config_edit=None):
    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    edit(t)
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    if config_edit:
        raw = json.loads((dst / "config.json").read_text())
        config_edit(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def partial(t):  # what the issue saw: the norms and mtp.fc, no layer weights
    for n in [n for n in t if n.startswith("mtp.layers.")]:
        del t[n]


def renamed(t):  # a re-export that put the head under another name
    for n in [n for n in t if n.startswith("mtp.")]:
        t["model.mtp_block." + n[4:]] = t.pop(n)


def misshaped(t):
    t["mtp.fc.weight"] = np.zeros((32, 32), np.float32)


def no_head(t):
    for n in [n for n in t if n.startswith("mtp.")]:
        del t[n]


def declare_mtp(raw):
    raw["mtp_num_hidden_layers"] = 1


CASES = {
    "partial": (partial, None, "MTP head not loaded, speculative decoding unavailable: of its 4 mtp.* tensors, 25 missing"),
    "renamed": (renamed, declare_mtp, "but the checkpoint has no mtp.* tensors: speculative decoding unavailable; "
                                      "29 tensor(s) the text model does not use (model.mtp_block."),
    "misshaped": (misshaped, None, "1 mis-shaped (mtp.fc.weight (32, 32) (expected (32, 64)))"),
    "no_head": (no_head, declare_mtp, "config.json declares an MTP head (mtp_num_hidden_layers=1) but the checkpoint has no "
                                      "mtp.* tensors"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_text_model_loads_and_matches_transformers(case, with_head, tmp_path, caplog, jforward):
    edit, config_edit, message = CASES[case]
    d = variant(with_head, tmp_path / case, edit, config_edit)
    with caplog.at_level(logging.WARNING, logger="hybridjax.conversion"):
        cfg, params = hybridjax.load_hf(d)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0] and message in warnings[0], warnings
    assert params.mtp is None
    stored = load_file(d / "model.safetensors")
    unused = {n for n in stored if n.startswith(("mtp.", "model.mtp_block."))}
    assert set(params.extra) == unused
    for n in unused:  # verbatim
        assert np.asarray(params.extra[n]).tobytes() == stored[n].tobytes()
    tokens = tokens_for(cfg, 9, seed=3)
    ours, _ = jforward(params, tokens, hybridjax.init_cache(cfg, 1, 64), cfg)
    ref = torch_logits(hf_models.load_torch(d), tokens)
    assert err_ratio(ours, ref) < PARITY_RTOL


def test_partial_head_round_trips_bit_for_bit(with_head, tmp_path, capsys):
    src = variant(with_head, tmp_path / "partial", partial)
    assert convert_main(["--hf-dir", str(src), "--out", str(tmp_path / "ckpt"), "--quiet"]) == 0
    _, params = hybridjax.load(tmp_path / "ckpt")
    assert params.mtp is None and sorted(n for n in params.extra if n.startswith("mtp.")) == \
        ["mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"]
    assert convert_main(["--to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--quiet"]) == 0
    assert_bit_identical(src, tmp_path / "hf")
    # and straight from memory, without the converted checkpoint
    (tmp_path / "mem").mkdir()
    hybridjax.save_hf(hybridjax.load_hf(src, dtype=None)[1], hybridjax.load_config(src), tmp_path / "mem")
    assert_bit_identical(src, tmp_path / "mem")


def test_speculative_tokens_on_a_model_without_a_usable_head_is_one_line(with_head, tmp_path):
    d = variant(with_head, tmp_path / "partial", partial)
    argv = ["generate", "--no-compile-cache", "--model", str(d), "--token-ids", "5,9", "--max-new-tokens", "2",
            "--speculative-tokens", "2"]
    # a subprocess: what a user sees on stderr, the load warning included (pytest captures logging in-process)
    run = subprocess.run([sys.executable, "-m", "hybridjax.cli", *argv], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    err = run.stderr.strip().splitlines()
    assert len(err) == 2 and "MTP head not loaded, speculative decoding unavailable" in err[0], err
    assert err[1] == ("hybridjax generate: error: speculative decoding needs an MTP head, and this checkpoint's mtp.* "
                      "tensors do not form one (see the warning at load): run without --speculative-tokens")
    _, params = hybridjax.load_hf(d)
    with pytest.raises(ValueError, match="do not form one"):
        generate(params, hybridjax.load_config(d), [[5, 9]], max_new_tokens=2, speculative_tokens=2)
    with pytest.raises(ValueError, match="do not form one"):  # what `serve --speculative-tokens` builds first
        Engine(hybridjax.load_config(d), params, None, speculative_tokens=2)


def test_text_model_problems_stay_errors(with_head, tmp_path):
    d = variant(with_head, tmp_path / "bad", lambda t: t.pop("model.layers.0.linear_attn.out_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): model.layers.0.linear_attn.out_proj.weight"):
        hybridjax.load_hf(d)
