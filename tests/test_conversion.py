"""`hybridjax convert`: HF -> checkpoint -> HF round trips, loading both kinds, every error.

Round trips must be bit-identical and give back every tensor of the source: the transforms of
conversion/names.py are exact inverses (transposes, reshapes, splits, stacks), nothing is cast
when the dtype is kept, and what the text model does not use (the multimodal Qwen3.5's vision
tower, `model.visual.*`) is carried verbatim in `params.extra`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # checks against transformers: skipped without torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from hybridjax import conversion
import hf_models
from mapped_helpers import mapped_files
import hybridjax
from hybridjax.conversion import checkpoint as ckpt_mod
from hybridjax.conversion import to_hf as to_hf_mod
from hybridjax.conversion import cli as convert_cli
from hybridjax.conversion.mapped import shard_file
from hybridjax.cli import model_logits


def main(argv):
    return convert_cli.main(argv, logits_fn=model_logits)

ARCHS = ["qwen3_next_moe", "qwen3_5_dense", "qwen3_5_multimodal", "qwen3_5_moe"]
VISION = "model.visual."


def convert(hf_dir, out, *extra) -> Path:
    assert main(["--hf-dir", str(hf_dir), "--out", str(out), "--quiet", *extra]) == 0
    return Path(out)


def export(ckpt, out, *extra) -> Path:
    assert main(["--to-hf", "--checkpoint", str(ckpt), "--out", str(out), "--quiet", *extra]) == 0
    return Path(out)


ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
             "I64": np.int64, "I32": np.int32}


def read_safetensors(f: Path) -> dict[str, np.ndarray]:
    """Every tensor of one file, parsed from the format itself (8-byte header length, JSON
    header, raw little-endian data), so that float8 reads too (safetensors' numpy reader has none)."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return {k: np.frombuffer(raw[8 + n + e["data_offsets"][0]: 8 + n + e["data_offsets"][1]], ST_DTYPES[e["dtype"]]).reshape(e["shape"])
            for k, e in header.items()}


def hf_tensors(d: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(read_safetensors(f))
    return out


def assert_bit_identical(src: Path, dst: Path) -> int:
    """Every tensor of src is in dst with the same dtype, shape and bytes, and nothing else;
    returns the number of vision-tower tensors."""
    a, b = hf_tensors(src), hf_tensors(dst)
    assert sorted(b) == sorted(a)
    for k, x in a.items():
        assert b[k].dtype == x.dtype and b[k].shape == x.shape, k
        assert b[k].tobytes() == x.tobytes(), k
    return sum(k.startswith(VISION) for k in a)


def leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype, p
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(p))


def bf16_copy(src: Path, dst: Path) -> Path:
    """An HF directory with every floating tensor cast to bfloat16 (gates included)."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        t = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(f).items()}
        save_file(t, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: convert(d, root / name) for name, d in hf_dirs.items()}


# --- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_identical(arch, hf_dirs, converted, tmp_path):
    back = export(converted[arch], tmp_path / "hf")
    vision = assert_bit_identical(hf_dirs[arch], back)
    assert (vision > 0) == (arch == "qwen3_5_multimodal")  # ... and it came back
    assert json.loads((back / "config.json").read_text()) == json.loads((hf_dirs[arch] / "config.json").read_text())
    assert (back / "generation_config.json").is_file() and not (back / "hybridjax.json").exists()


def test_round_trip_sharded_source_and_sharded_output(tmp_path):
    src = hf_models.qwen3_5_dense(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list(src.glob("*.safetensors"))) > 2
    back = export(convert(src, tmp_path / "ckpt"), tmp_path / "hf", "--max-shard-size", "20KB")
    assert_bit_identical(src, back)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    shards = sorted(back.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {f.name for f in shards}
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in hf_tensors(back).values())
    for f in shards:  # the size limit holds unless a single tensor exceeds it
        with safe_open(f, framework="numpy") as h:
            sizes = [h.get_tensor(k).nbytes for k in h.keys()]
        assert sum(sizes) <= 20_000 or len(sizes) == 1


def test_round_trip_bfloat16(hf_dirs, tmp_path):
    src = bf16_copy(hf_dirs["qwen3_next_moe"], tmp_path / "bf16")
    ckpt = convert(src, tmp_path / "ckpt")
    assert json.loads((ckpt / "hybridjax.json").read_text())["dtype"] == "bfloat16"
    back = export(ckpt, tmp_path / "hf")
    assert_bit_identical(src, back)  # A_log / dt_bias too: bf16 -> float32 -> bf16 is exact


def test_mtp_tensors_and_tokenizer_files_survive_the_round_trip(hf_dirs, tmp_path):
    src = tmp_path / "mtp"
    shutil.copytree(hf_dirs["qwen3_next_moe"], src)
    hf_models.add_mtp_head(src, hf_models.load_torch(src))
    side = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": "{}", "chat_template.jinja": "{{ x }}",
            "merges.txt": "a b\n", "notes.txt": "not a model file"}
    for name, text in side.items():
        (src / name).write_text(text)
    ckpt = convert(src, tmp_path / "ckpt")
    _, params = conversion.load(ckpt)
    assert params.mtp is not None and params.mtp.fc.shape == (64, 32)
    back = export(ckpt, tmp_path / "hf")
    assert_bit_identical(src, back)
    for d in (ckpt, back):
        assert {n: (d / n).read_text() for n in side if (d / n).exists()} == {n: t for n, t in side.items() if n != "notes.txt"}


def test_multimodal_with_mtp_head_round_trips_every_tensor(hf_dirs, tmp_path):
    """A Qwen3.5 multimodal checkpoint with both an MTP head and a vision tower: HF -> checkpoint
    -> HF gives back the same tensor set, bit for bit; the checkpoint holds the vision tower in
    params.extra (verbatim, also when it is stored in bfloat16) and the MTP head in params.mtp."""
    src = tmp_path / "mm"
    shutil.copytree(hf_dirs["qwen3_5_multimodal"], src)
    hf_models.add_mtp_head(src, hf_models.load_torch(src))
    t = load_file(src / "model.safetensors")
    vis = sorted(k for k in t if k.startswith(VISION))
    t[vis[0]] = t[vis[0]].astype(ml_dtypes.bfloat16)  # an odd dtype out must survive as it is
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    ckpt = convert(src, tmp_path / "ckpt")
    _, params = conversion.load(ckpt)
    assert params.mtp is not None and sorted(params.extra) == vis
    assert params.extra[vis[0]].dtype == ml_dtypes.bfloat16
    back = export(ckpt, tmp_path / "hf", "--max-shard-size", "40KB")
    assert assert_bit_identical(src, back) == len(vis) > 0 and any(k.startswith("mtp.") for k in hf_tensors(back))
    _, again = conversion.load(back)  # and the HF output loads the same params
    leaves_equal(again, params)


def test_tied_checkpoint_keeps_its_spare_lm_head_copy(hf_dirs, tmp_path):
    src = _corrupt(hf_dirs, tmp_path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].copy()))
    back = export(convert(src, tmp_path / "ckpt"), tmp_path / "hf")
    assert_bit_identical(src, back)


def test_dtype_conversion_casts_weights_but_not_gates(hf_dirs, loaded, tmp_path):
    ckpt = convert(hf_dirs["qwen3_5_dense"], tmp_path / "ckpt", "--dtype", "bfloat16")
    _, params = conversion.load(ckpt)
    leaves_equal(params, hybridjax.params.cast_params(loaded["qwen3_5_dense"][1], "bfloat16"))
    back = hf_tensors(export(ckpt, tmp_path / "hf"))
    for k, x in hf_tensors(hf_dirs["qwen3_5_dense"]).items():
        gate = k.endswith(("A_log", "dt_bias"))
        assert back[k].dtype == (np.float32 if gate else ml_dtypes.bfloat16), k
        np.testing.assert_array_equal(back[k], x if gate else x.astype(ml_dtypes.bfloat16))


def test_write_hf_from_params_in_memory(hf_dirs, loaded, tmp_path):
    """The library path for params that never were a checkpoint (e.g. after fine-tuning)."""
    cfg, params = loaded["qwen3_next_moe"]
    n, nbytes, shards = conversion.write_hf(params, cfg, tmp_path, max_shard_size="30KB")
    assert shards > 1 and n == len(hf_tensors(hf_dirs["qwen3_next_moe"]))
    assert_bit_identical(hf_dirs["qwen3_next_moe"], tmp_path)


# --- loading ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_the_same_params(arch, converted, loaded):
    cfg, params = conversion.load(converted[arch])
    assert cfg == loaded[arch][0]
    leaves_equal(params, loaded[arch][1])


@pytest.mark.parametrize("arch", ["qwen3_next_moe", "qwen3_5_multimodal"])
def test_checkpoint_gives_the_same_logits(arch, converted, loaded, jforward):
    """Shapes match tests/test_model.py (7 tokens, max_len 512) so the compiled forward is shared."""
    cfg, params = hybridjax.load(converted[arch])
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (1, 7)).astype(np.int32)
    ref, _ = jforward(loaded[arch][1], tokens, hybridjax.init_cache(cfg, 1, 512), cfg)
    got, _ = jforward(params, tokens, hybridjax.init_cache(cfg, 1, 512), cfg)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize("arch", ["qwen3_next_moe", "qwen3_5_multimodal", "qwen3_5_moe"])
def test_transformers_loads_the_export(arch, hf_dirs, converted, torch_models, tmp_path):
    back = export(converted[arch], tmp_path / "hf", "--max-shard-size", "50KB")
    model = hf_models.load_torch(back)
    tokens = torch.as_tensor(np.random.RandomState(2).randint(0, 97, (1, 9)))
    with torch.no_grad():
        got, ref = model(tokens).logits, torch_models[arch](tokens).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_load_either_kind_keeps_or_casts_dtype(hf_dirs, converted, tmp_path):
    cfg, p = conversion.load(hf_dirs["qwen3_5_dense"])  # dtype None: as stored (float32)
    assert p.embed.dtype == np.float32
    _, p = conversion.load(bf16_copy(hf_dirs["qwen3_5_dense"], tmp_path / "bf16"))
    assert p.embed.dtype == ml_dtypes.bfloat16 and p.layers[0].mixer.A_log.dtype == np.float32
    _, p = hybridjax.load(converted["qwen3_5_dense"], dtype="bfloat16")
    assert p.embed.dtype == ml_dtypes.bfloat16 and p.layers[0].mixer.dt_bias.dtype == np.float32
    assert p.lm_head is None and conversion.is_checkpoint(converted["qwen3_5_dense"])
    assert not conversion.is_checkpoint(hf_dirs["qwen3_5_dense"])
    files = {f.name for f in converted["qwen3_5_dense"].iterdir()}
    assert {"config.json", "hybridjax.json", "params", "generation_config.json"} <= files
    assert hybridjax.load_config(converted["qwen3_5_dense"]) == cfg


def test_a_load_maps_each_array_from_its_file(converted, loaded):
    """On one device a converted checkpoint's arrays are their files' pages, mapped copy-on-write
    (no copy, no orbax): each leaf's buffer lies in a mapping of its own shard file, and the
    values are the HF load's (test_checkpoint_loads_the_same_params checks every architecture)."""
    reader = ckpt_mod.CheckpointReader(converted["qwen3_5_multimodal"])
    params = reader.restore()
    leaves = conversion.hf.flat_leaves(params)
    assert reader.counts == {"mapped": len(leaves), "restored": 0} and any(p.startswith("extra.") for p in leaves)
    for path, x in leaves.items():
        assert mapped_files(x) == {str(shard_file(reader.params_dir / path, x.ndim))}, path
    leaves_equal(params.replace(extra={}), loaded["qwen3_5_multimodal"][1].replace(extra={}))


def test_a_donated_mapped_array_leaves_its_file_alone(converted, tmp_path):
    """Copy-on-write: a program that donates a mapped weight and writes its buffer changes neither
    the file nor a later load."""
    ck = shutil.copytree(converted["qwen3_5_dense"], tmp_path / "ck")
    _, params = hybridjax.load(ck)
    before = np.asarray(params.embed).copy()
    assert mapped_files(params.embed)
    bumped = jax.jit(lambda w: w + 1.0, donate_argnums=0)(params.embed)
    np.testing.assert_array_equal(np.asarray(bumped), before + 1.0)
    _, again = hybridjax.load(ck)
    np.testing.assert_array_equal(np.asarray(again.embed), before)


def test_a_checkpoint_replaced_while_loaded_keeps_the_loaded_weights(hf_dirs, converted, tmp_path):
    """`--force` writes a new directory and renames it into place: a model still mapping the old
    files keeps their data, and a new load reads the new checkpoint."""
    ck = shutil.copytree(converted["qwen3_5_dense"], tmp_path / "ck")
    _, params = hybridjax.load(ck)
    before = np.asarray(params.layers[0].ffn.gate).copy()
    convert(bf16_copy(hf_dirs["qwen3_5_dense"], tmp_path / "bf16"), ck, "--force")
    np.testing.assert_array_equal(np.asarray(params.layers[0].ffn.gate), before)
    _, now = hybridjax.load(ck)
    assert now.layers[0].ffn.gate.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(now.layers[0].ffn.gate), before.astype(ml_dtypes.bfloat16))


def test_other_layouts_and_dtypes_are_read_by_orbax(converted, tmp_path):
    """What is not mapped is restored as before: a checkpoint in orbax's OCDBT layout (how
    conversions wrote them until stop 52), and any array wanted in a dtype other than stored."""
    import orbax.checkpoint as ocp

    ck = converted["qwen3_5_dense"]
    reader = ckpt_mod.CheckpointReader(ck)
    ref = reader.restore()
    old = shutil.copytree(ck, tmp_path / "ocdbt", ignore=shutil.ignore_patterns("params"))
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False)
    ocp.Checkpointer(handler).save((old / "params").absolute(), args=ocp.args.PyTreeSave(ref))
    assert (old / "params" / "manifest.ocdbt").is_file()
    reader = ckpt_mod.CheckpointReader(old)
    leaves_equal(reader.restore(), ref)
    assert reader.counts["mapped"] == 0
    reader = ckpt_mod.CheckpointReader(ck, dtype="bfloat16")
    params = reader.restore()
    gates = sum(p.rsplit(".", 1)[-1] in ckpt_mod.FLOAT32_LEAVES for p in conversion.hf.flat_leaves(params))
    assert reader.counts == {"mapped": gates, "restored": len(jax.tree_util.tree_leaves(params)) - gates}
    leaves_equal(params, jax.tree_util.tree_map(lambda x, y: x.astype(y.dtype), ref, params))


@pytest.mark.parametrize("damage", ["index", "truncated", "missing"])
def test_a_damaged_shard_is_an_error_not_weights(converted, tmp_path, damage):
    """A shard whose index fails its crc32c, that is cut short, or that is gone fails the load with
    one CheckpointError naming the file, in any dtype asked for."""
    ck = shutil.copytree(converted["qwen3_5_dense"], tmp_path / "ck")
    shard = ck / "params" / "layers.1.ffn.down" / "c" / "0" / "0"
    raw = shard.read_bytes()
    if damage == "index":
        shard.write_bytes(raw[:-12] + bytes([raw[-12] ^ 1]) + raw[-11:])  # one bit of the nbytes field
    elif damage == "truncated":
        shard.write_bytes(raw[: len(raw) // 2])
    else:
        shard.unlink()
    for dtype in (None, "bfloat16"):
        with pytest.raises(conversion.CheckpointError, match=f"{shard}: (damaged|cannot read)") as e:
            hybridjax.load(ck, dtype=dtype)
        assert "\n" not in str(e.value)


# --- the CLI ----------------------------------------------------------------------------


def test_cli_reports_progress_kept_vision_and_verify(hf_dirs, tmp_path, capsys):
    assert main(["--hf-dir", str(hf_dirs["qwen3_5_multimodal"]), "--out", str(tmp_path / "c")]) == 0
    out, err = capsys.readouterr()
    assert "kept 21 vision-tower tensors (model.visual.*) verbatim in params.extra" in out
    assert "100%" in err and "77/77 arrays" in err  # the tqdm bar, on stderr (56 text + 21 vision)
    assert main(["--to-hf", "--checkpoint", str(tmp_path / "c"), "--out", str(tmp_path / "h"), "--quiet", "--verify"]) == 0
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("verify:")]
    assert "hybridjax(result) - logits hybridjax(source)| = 0 " in lines[0]
    assert "transformers(result)" in lines[1] and float(lines[1].split("= ")[1].split()[0]) < 1e-4
    assert "convert" not in err  # --quiet: no bar


def test_loading_reports_progress(hf_dirs, converted, capsys):
    """Loading, from HF safetensors or an orbax checkpoint, reports each param leaf and its bytes:
    to a factory, or as a tqdm bar on stderr when asked (by default only when stderr is a
    terminal, which it is not under pytest)."""
    for path in (hf_dirs["qwen3_5_dense"], converted["qwen3_5_dense"]):
        seen = []

        def factory(steps, total_bytes):
            seen.append([steps, total_bytes, 0, 0])

            def step(nbytes):
                seen[-1][2] += 1
                seen[-1][3] += nbytes
            return step

        _, params = conversion.load(path, progress=factory)
        leaves = jax.tree_util.tree_leaves(params)
        ((steps, total, calls, nbytes),) = seen
        assert calls == steps == len(leaves) and nbytes == total == sum(x.nbytes for x in leaves), path
        capsys.readouterr()
        conversion.load(path, progress=True)
        err = capsys.readouterr().err
        assert "load: 100%" in err and f"{steps}/{steps} tensors" in err
        conversion.load(path)
        assert capsys.readouterr().err == ""


def test_force_replaces_existing_output(hf_dirs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("x")
    convert(hf_dirs["qwen3_5_dense"], out, "--force")
    assert not (out / "stale").exists() and conversion.is_checkpoint(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging leftovers


def _corrupt(hf_dirs, tmp_path, fn, arch="qwen3_5_dense"):
    d = tmp_path / "bad"
    shutil.copytree(hf_dirs[arch], d)
    t = load_file(d / "model.safetensors")
    fn(t)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _sharded_missing_one(tmp_path):
    d = hf_models.qwen3_5_dense(tmp_path / "bad", max_shard_size="20KB")
    victim = sorted(d.glob("*.safetensors"))[1]
    victim.unlink()
    return d, victim.name


def _sharded_bad_index(tmp_path):
    d = hf_models.qwen3_5_dense(tmp_path / "bad", max_shard_size="20KB")
    (d / "model.safetensors.index.json").write_text('{"weight_map": ')
    return d


def _copy_with(hf_dirs, tmp_path, config=None, drop=()):
    d = tmp_path / "bad"
    shutil.copytree(hf_dirs["qwen3_5_dense"], d)
    if config is not None:
        (d / "config.json").write_text(config)
    for pattern in drop:
        for f in d.glob(pattern):
            f.unlink()
    return d


def _put(name, value):
    return lambda t: t.__setitem__(name, value)


HF_ERRORS = {
    "missing dir": (lambda t, h: t / "nowhere", "model directory not found: {d}"),
    "no safetensors": (lambda t, h: _copy_with(h, t, drop=["*.safetensors"]), "{d}: no *.safetensors files found"),
    "missing shard": (lambda t, h: _sharded_missing_one(t)[0],
                      "shard(s) listed in model.safetensors.index.json are missing: model-00002-of-"),
    "corrupt index": (lambda t, h: _sharded_bad_index(t), "{d}/model.safetensors.index.json: invalid JSON"),
    "missing tensor": (lambda t, h: _corrupt(h, t, lambda x: x.pop("model.layers.0.linear_attn.A_log")),
                       "checkpoint does not match config.json: missing tensors (1): model.layers.0.linear_attn.A_log"),
    "unknown tensor": (lambda t, h: _corrupt(h, t, _put("model.layers.0.bogus", np.zeros(2, np.float32))),
                       "unexpected tensors (1): model.layers.0.bogus"),
    "wrong shape": (lambda t, h: _corrupt(h, t, _put("model.layers.3.self_attn.k_proj.weight", np.zeros((8, 32), np.float32))),
                    "mis-shaped tensors: model.layers.3.self_attn.k_proj.weight (8, 32) -> layers.3.mixer.k_proj "
                    "has shape (32, 8), expected (32, 32)"),
    "unsupported arch": (lambda t, h: _copy_with(h, t, json.dumps({"model_type": "llama"})),
                         "config.json: model_type 'llama' is not supported"),
    "missing field": (lambda t, h: _copy_with(h, t, json.dumps({"model_type": "qwen3_next"})),
                      "config.json: missing required field 'num_hidden_layers'"),
    "invalid json": (lambda t, h: _copy_with(h, t, "{not json"), "config.json: invalid JSON"),
    "no config": (lambda t, h: _copy_with(h, t, drop=["config.json"]), "no config.json found at {d}/config.json"),
}


@pytest.mark.parametrize("case", HF_ERRORS)
def test_hf_errors_are_one_clear_line(case, hf_dirs, tmp_path, capsys):
    make, message = HF_ERRORS[case]
    d = make(tmp_path, hf_dirs)
    out = tmp_path / "out"
    assert main(["--hf-dir", str(d), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n")
    err = err.splitlines()[-1]  # (building a sharded source prints transformers' own bar before)
    assert err.startswith("hybridjax convert: error: ") and "convert:" not in err.split("error: ", 1)[1]
    assert message.format(d=d) in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_usage_and_checkpoint_errors(hf_dirs, converted, tmp_path, capsys):
    src, ck, out = hf_dirs["qwen3_5_dense"], converted["qwen3_5_dense"], tmp_path / "out"
    bad = tmp_path / "badck"
    shutil.copytree(ck, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 65}))
    noparams = tmp_path / "noparams"
    shutil.copytree(ck, noparams)
    shutil.rmtree(noparams / "params")
    oldfmt = tmp_path / "oldfmt"
    shutil.copytree(ck, oldfmt)
    (oldfmt / "hybridjax.json").write_text(json.dumps({"format": "hybridjax-orbax", "format_version": 99}))
    out.mkdir()
    cases = [
        (["--hf-dir", str(src), "--out", str(out)], f"output already exists: {out} (use --force to replace it)"),
        (["--hf-dir", str(src), "--out", str(src / "sub")], "overlaps the source directory"),
        # the source itself, spelled through `..`: --force must not replace it
        (["--hf-dir", str(src), "--out", os.path.join(out, os.path.relpath(src, out)), "--force"],
         "overlaps the source directory"),
        (["--out", str(tmp_path / "o")], "--hf-dir DIR is required"),
        (["--to-hf", "--out", str(tmp_path / "o")], "--to-hf needs --checkpoint DIR"),
        (["--checkpoint", str(ck), "--out", str(tmp_path / "o")], "--checkpoint is the source of --to-hf"),
        (["--to-hf", "--hf-dir", str(src), "--checkpoint", str(ck), "--out", str(tmp_path / "o")], "with --to-hf use --checkpoint"),
        (["--to-hf", "--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")], "checkpoint directory not found"),
        (["--to-hf", "--checkpoint", str(src), "--out", str(tmp_path / "o")], "not a converted hybridjax checkpoint (no hybridjax.json)"),
        (["--to-hf", "--checkpoint", str(ck), "--out", str(tmp_path / "o"), "--max-shard-size", "lots"], "invalid size 'lots'"),
        (["--to-hf", "--checkpoint", str(noparams), "--out", str(tmp_path / "o")], "the params directory params/ is missing"),
        (["--to-hf", "--checkpoint", str(oldfmt), "--out", str(tmp_path / "o")], "'format_version' 99 is not supported"),
        (["--to-hf", "--checkpoint", str(bad), "--out", str(tmp_path / "o")],
         "checkpoint does not match config.json: mis-shaped arrays: layers.0.ffn.gate has shape (32, 64), expected (32, 65)"),
    ]
    for argv, message in cases:
        assert main([*argv, "--quiet"]) == 1, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("hybridjax convert: error: ") and "\n" not in err, err
        assert message in err, (message, err)
        assert not (tmp_path / "o").exists()
    with pytest.raises(conversion.CheckpointError, match="mis-shaped arrays: layers.0.ffn.gate"):
        hybridjax.load(bad)


def test_failure_midway_leaves_nothing(hf_dirs, converted, tmp_path, monkeypatch, capsys):
    calls = []
    real_write = to_hf_mod.ShardWriter.write

    def flaky_write(self, name, arr):
        calls.append(name)
        if len(calls) == 10:
            raise OSError(28, "No space left on device", str(self.out_dir / "x.safetensors"))
        return real_write(self, name, arr)

    monkeypatch.setattr(to_hf_mod.ShardWriter, "write", flaky_write)
    out = tmp_path / "hf"
    assert main(["--to-hf", "--checkpoint", str(converted["qwen3_5_dense"]), "--out", str(out), "--quiet",
                 "--max-shard-size", "20KB"]) == 1
    assert "No space left on device" in capsys.readouterr().err and len(calls) == 10

    def broken_save(*a, **k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ckpt_mod, "_save_args", broken_save)
    assert main(["--hf-dir", str(hf_dirs["qwen3_5_dense"]), "--out", str(tmp_path / "ck"), "--quiet"]) == 1
    assert "Input/output error" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither output nor staging directory


@pytest.mark.parametrize("shape", [(3072, 1024), (1000, 1500), (2049, 777), (10, 20), (4, 5, 6)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_transposed_is_numpys_transpose(shape, dtype):
    # The tiled, threaded copy that loading uses for every nn.Linear weight: bit for bit x.T, for
    # sizes that are not whole tiles or whole thread bands, and the small / n-d fallback.
    from hybridjax.conversion.names import transposed

    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    got = transposed(x)
    assert got.flags.c_contiguous and got.dtype == x.dtype
    np.testing.assert_array_equal(got, x.T)
