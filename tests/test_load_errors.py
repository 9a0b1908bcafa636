"""Errors a user meets while loading a model are one line each from the CLI, saying what to do
(issue 22, part 5): no such path, no such hub id offline, a directory without config.json, an
unsupported model_type, a quantisation method hybridjax does not read."""

from __future__ import annotations

import json
import shutil

import pytest

from hybridjax.cli import main


def _copy(hf_dirs, tmp_path, edit=None, drop=None):
    d = tmp_path / "model"
    shutil.copytree(hf_dirs["qwen3_5_dense"], d)
    if drop:
        (d / drop).unlink()
    if edit:
        raw = json.loads((d / "config.json").read_text())
        edit(raw)
        (d / "config.json").write_text(json.dumps(raw))
    return d


CASES = {
    "no such path": (lambda h, t: t / "nowhere",
                     "model directory not found: {d} (pass a model directory or a Hugging Face id ORG/NAME)"),
    "no such id offline": (lambda h, t: "nobody/nothing",
                           "nobody/nothing: not in the Hugging Face cache ({hub}) and downloads are off (HF_HUB_OFFLINE=1): "
                           "unset HF_HUB_OFFLINE to download it, or pass a local model directory"),
    "no config.json": (lambda h, t: _copy(h, t, drop="config.json"),
                       "no config.json found at {d}/config.json: a model directory holds the Hugging Face config.json and "
                       "*.safetensors (or is a converted hybridjax checkpoint); check the path"),
    "unsupported model_type": (lambda h, t: _copy(h, t, lambda r: r.update(model_type="llama")),
                               "config.json: model_type 'llama' is not supported; expected one of ['qwen3_5', "),
    "unknown quantisation": (lambda h, t: _copy(h, t, lambda r: r.update(quantization_config={"quant_method": "awq"})),
                             "config.json: quantization_config.quant_method 'awq' is not supported (hybridjax reads "
                             "unquantised and block-wise fp8 checkpoints): use the unquantised or the -FP8 release of the model"),
}


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


@pytest.mark.parametrize("command", ["generate", "convert"])
@pytest.mark.parametrize("case", list(CASES))
def test_loading_errors_are_one_line(case, command, hf_dirs, tmp_path, offline_hub, capsys):
    make, message = CASES[case]
    d = make(hf_dirs, tmp_path)
    if command == "generate":
        argv = ["generate", "--no-compile-cache", "--model", str(d), "--token-ids", "1,2"]
    else:
        argv = ["convert", "--hf-dir", str(d), "--out", str(tmp_path / "out"), "--quiet"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"hybridjax {command}: error: " + message.format(d=d, hub=offline_hub)), err
