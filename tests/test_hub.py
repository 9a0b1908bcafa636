"""Hub ids (issue 22, part 2): `ORG/NAME[@REVISION]` resolves through huggingface_hub's cache.

No network here: the tests lay out a hub cache on disk the way huggingface_hub does
(`hub/models--ORG--NAME/{refs/<branch>, snapshots/<commit>/<file> -> ../../blobs/<sha256>}`) and
run with HF_HUB_OFFLINE=1, in process (the library) and in a subprocess (the CLI, with HF_HOME).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import hybridjax
from hybridjax.conversion import CheckpointError
from hybridjax.conversion.hub import parse_hub_id, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(hub: os.PathLike, repo: str, src, commit: str = COMMIT, refs=("main",)):
    """Put the files of `src` into a hub cache at `hub` as snapshot `commit` of `repo`."""
    from pathlib import Path

    repo_dir = Path(hub) / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(Path(src).iterdir()):
        data = f.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo_dir / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hf_home(tmp_path, hf_dirs, monkeypatch):
    """HF_HOME with one cached model, tiny/qwen35 (main and tag v1), the library offline."""
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    lay_out_hub_cache(home / "hub", "tiny/qwen35", hf_dirs["qwen3_5_dense"], refs=("main", "v1"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


def test_parse_hub_id():
    assert parse_hub_id("Qwen/Qwen3.5-0.8B") == ("Qwen/Qwen3.5-0.8B", None)
    assert parse_hub_id("Qwen/Qwen3-Next-80B-A3B-Instruct-FP8@refs/pr/3") == ("Qwen/Qwen3-Next-80B-A3B-Instruct-FP8", "refs/pr/3")
    for not_an_id in ("/abs/path", "./rel/dir", "a/b/c", "model", "../x", "a/..", "~/m/x"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_hub_id_loads_from_the_cache_offline(hf_home, hf_dirs):
    want = hybridjax.load_hf(hf_dirs["qwen3_5_dense"])[1]
    for ref in ("tiny/qwen35", "tiny/qwen35@main", "tiny/qwen35@v1", f"tiny/qwen35@{COMMIT}"):
        assert resolve_model(ref) == hf_home / "hub/models--tiny--qwen35/snapshots" / COMMIT
        got = hybridjax.load(ref, dtype="float32", progress=False)[1]
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert hybridjax.load_hf("tiny/qwen35")[0] == hybridjax.load_config(hf_dirs["qwen3_5_dense"])


def test_a_local_directory_wins(hf_home, hf_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf_dirs["qwen3_next_moe"], tmp_path / "tiny" / "qwen35")  # same spelling, other model
    assert resolve_model("tiny/qwen35").resolve() == tmp_path / "tiny" / "qwen35"
    assert hybridjax.load_hf("tiny/qwen35")[0].family == "qwen3_next"


@pytest.mark.parametrize("ref, message", [
    ("nobody/nothing", "nobody/nothing: not in the Hugging Face cache ({hub}) and downloads are off (HF_HUB_OFFLINE=1): "
                       "unset HF_HUB_OFFLINE to download it, or pass a local model directory"),
    ("tiny/qwen35@v9", "tiny/qwen35@v9: not in the Hugging Face cache"),
    ("no/such/dir", "model directory not found: no/such/dir (pass a model directory or a Hugging Face id ORG/NAME)"),
])
def test_unresolvable_references_are_one_clear_line(hf_home, ref, message):
    with pytest.raises(CheckpointError) as e:
        resolve_model(ref)
    assert str(e.value).startswith(message.format(hub=hf_home / "hub")) and "\n" not in str(e.value)


def _cli(args, home, cwd):
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "hybridjax.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_cli_reads_hub_ids_through_hf_home(hf_home, tmp_path):
    """`convert --hf-dir ORG/NAME@REV` and a missing id offline, as a user runs them."""
    run = _cli(["convert", "--hf-dir", "tiny/qwen35@v1", "--out", str(tmp_path / "ckpt"), "--quiet"], hf_home, tmp_path)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "ckpt" / "hybridjax.json").is_file()
    run = _cli(["generate", "--model", "nobody/nothing", "--token-ids", "1,2", "--no-compile-cache"], hf_home, tmp_path)
    assert run.returncode == 1
    assert run.stderr.strip() == (
        f"hybridjax generate: error: nobody/nothing: not in the Hugging Face cache ({hf_home / 'hub'}) and downloads are "
        "off (HF_HUB_OFFLINE=1): unset HF_HUB_OFFLINE to download it, or pass a local model directory")


def test_unreachable_hub_is_one_clear_line(tmp_path):
    """Online mode with the hub unreachable (HF_ENDPOINT at a closed local port) and nothing cached."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_ENDPOINT": "http://127.0.0.1:9",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("HF_HUB_OFFLINE", None)
    run = subprocess.run([sys.executable, "-m", "hybridjax.cli", "generate", "--model", "nobody/nothing", "--token-ids", "1,2",
                          "--no-compile-cache"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 1
    assert run.stderr.strip() == (
        f"hybridjax generate: error: nobody/nothing: cannot reach the Hugging Face Hub and the model is not in the cache "
        f"({tmp_path / 'home' / 'hub'}): check the network (or HF_ENDPOINT), or pass a local model directory")
