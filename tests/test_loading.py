"""Config parsing and HF checkpoint loading: layouts, prefixes, shards, errors."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

pytest.importorskip("torch")  # hf_models builds checkpoints with transformers
import hf_models  # noqa: E402
import hybridjax
from hybridjax.conversion import CheckpointError
from hybridjax.config import ConfigError, config_from_dict


def leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_configs_parse(loaded):
    cfg, _ = loaded["qwen3_next_moe"]
    assert cfg.family == "qwen3_next" and cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.moe_layers == (True, False, True, True) and cfg.rotary_dim == 4
    cfg, _ = loaded["qwen3_5_multimodal"]
    assert cfg.family == "qwen3_5" and cfg.linear_num_value_heads == 4 and not cfg.moe_layers
    assert loaded["qwen3_5_dense"][0].tie_word_embeddings and loaded["qwen3_5_dense"][1].lm_head is None
    assert loaded["qwen3_5_moe"][0].moe_layers == (True,) * 4
    hash(cfg)  # static jit argument


BASE = dict(model_type="qwen3_5_text", vocab_size=10, hidden_size=8, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=4, linear_value_head_dim=4, intermediate_size=8)


def test_config_forms():
    cfg = config_from_dict({**BASE, "full_attention_interval": 2, "rope_theta": 5.0, "partial_rotary_factor": 0.5})
    assert cfg.layer_types[1] == "full_attention" and cfg.rope_theta == 5.0 and cfg.rotary_dim == 4
    cfg = config_from_dict({**BASE, "rope_parameters": {"rope_theta": 7.0, "partial_rotary_factor": 1.0}})
    assert cfg.rope_theta == 7.0 and cfg.rotary_dim == 8 and cfg.layer_types[3] == "full_attention"
    wrapped = config_from_dict({"model_type": "qwen3_5", "text_config": {k: v for k, v in BASE.items() if k != "model_type"}})
    assert wrapped.family == "qwen3_5" and wrapped.hidden_size == 8


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({"linear_num_value_heads": 3}, "'linear_num_value_heads' \\(3\\) must be a multiple of 'linear_num_key_heads'"),
    ({"layer_types": ["full_attention"]}, "'layer_types' has 1 entries but 'num_hidden_layers' is 4"),
    ({"layer_types": ["full_attention", "mamba", "full_attention", "full_attention"]}, "'layer_types\\[1\\]' is 'mamba'"),
    ({"num_attention_heads": 3, "num_key_value_heads": 2}, "'num_attention_heads' \\(3\\) must be a multiple of 'num_key_value_heads'"),
    ({"hidden_size": None}, "missing required field 'hidden_size'"),
])
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**BASE, **change})


def test_sharded_checkpoint_loads_the_same(tmp_path, hf_dirs):
    sharded = hf_models.qwen3_5_dense(tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    leaves_equal(hybridjax.load_hf(sharded)[1], hybridjax.load_hf(hf_dirs["qwen3_5_dense"])[1])


def test_missing_shard_is_named(tmp_path):
    sharded = hf_models.qwen3_5_dense(tmp_path / "sharded", max_shard_size="20KB")
    victim = sorted(sharded.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"shard\\(s\\) listed in model.safetensors.index.json are missing: {victim.name}"):
        hybridjax.load_hf(sharded)


def test_index_without_weight_map_is_named(tmp_path):
    sharded = hf_models.qwen3_5_dense(tmp_path / "sharded", max_shard_size="20KB")
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: no 'weight_map' object"):
        hybridjax.load_hf(sharded)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_mtp_tensors_load_into_the_mtp_head(tmp_path, hf_dirs):
    from safetensors.numpy import load_file

    d = _copy(hf_dirs["qwen3_next_moe"], tmp_path / "m")
    hf_models.add_mtp_head(d, hf_models.load_torch(d))
    _, params = hybridjax.load_hf(d)
    np.testing.assert_array_equal(np.asarray(params.mtp.fc), load_file(d / "model.safetensors")["mtp.fc.weight"].T)
    assert params.extra == {}


def test_fused_expert_layout_equals_per_expert(tmp_path, hf_dirs, loaded):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, D], experts.down_proj [E, D, I])
    loads to the same params as the per-expert layout."""
    d = _copy(hf_dirs["qwen3_5_moe"], tmp_path / "fused")
    t = load_file(d / "model.safetensors")
    cfg = loaded["qwen3_5_moe"][0]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        per = lambda n: [t.pop(f"{p}.{e}.{n}_proj.weight") for e in range(cfg.num_experts)]  # noqa: E731
        gate, up, down = per("gate"), per("up"), per("down")
        t[f"{p}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        t[f"{p}.down_proj"] = np.stack(down)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    leaves_equal(hybridjax.load_hf(d)[1], loaded["qwen3_5_moe"][1])


def _edit(d, fn):
    t = load_file(d / "model.safetensors")
    fn(t)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})


def test_checkpoint_errors_name_the_tensors(tmp_path, hf_dirs):
    d = _copy(hf_dirs["qwen3_5_dense"], tmp_path / "bad")
    _edit(d, lambda t: (t.pop("model.layers.0.linear_attn.A_log"), t.__setitem__("model.layers.0.bogus", np.zeros(2, np.float32))))
    with pytest.raises(CheckpointError) as e:
        hybridjax.load_hf(d)
    assert "missing tensors (1): model.layers.0.linear_attn.A_log" in str(e.value)
    assert "unexpected tensors (1): model.layers.0.bogus" in str(e.value)

    d = _copy(hf_dirs["qwen3_5_dense"], tmp_path / "shape")
    _edit(d, lambda t: t.__setitem__("model.layers.3.self_attn.k_proj.weight", np.zeros((8, 32), np.float32)))
    with pytest.raises(CheckpointError, match=r"mis-shaped tensors: model.layers.3.self_attn.k_proj.weight \(8, 32\) -> layers.3.mixer.k_proj"):
        hybridjax.load_hf(d)

    with pytest.raises(CheckpointError, match="model directory not found"):
        hybridjax.load_hf(tmp_path / "nowhere")
    d = _copy(hf_dirs["qwen3_5_dense"], tmp_path / "cfg")
    (d / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
    with pytest.raises(ConfigError, match="model_type 'mamba2' is not supported"):
        hybridjax.load_hf(d)


def test_bfloat16_load_keeps_gates_float32(hf_dirs):
    _, params = hybridjax.load_hf(hf_dirs["qwen3_5_dense"], dtype="bfloat16")
    gdn = params.layers[0].mixer
    assert params.embed.dtype == np.dtype("bfloat16") and gdn.in_qkv.dtype == np.dtype("bfloat16")
    assert gdn.A_log.dtype == np.float32 and gdn.dt_bias.dtype == np.float32
