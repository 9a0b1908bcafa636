"""Sharding over a device mesh (issue 13): sharded runs give one device's logits and tokens.

The mesh cases need 8 host devices, which JAX fixes at start-up, so they run in one subprocess
(tests/sharding_worker.py: JAX start, model building and the one-device reference paid once)
and this file asserts on its JSON report. The two-process case runs the CLI twice over
jax.distributed (gloo collectives on CPU). Mesh-spec and divisibility errors run in-process.

Tolerance: float32 logits within 1e-5 (the issue's bound). Sharding only reorders float32
sums (all-reduces of row-parallel partial products), ~1e-7 relative per layer on these
logits (|logit| < 1); observed errors are ~1e-7.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from jax.sharding import AbstractMesh

import hybridjax
from hybridjax.config import config_from_dict
from hybridjax.sharding import AXES, MeshError, check_model, parse_spec, spec_for

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
TOL = 1e-5


def _env(devices: int) -> dict:
    # LLVM optimisation off: these tiny programs are compile-bound (~20% less compile time);
    # it changes no float semantics.
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=flags)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sharding_worker.py"), str(out), "--engine"],
                          env=_env(8), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def expected_shards(name: str, spec: str) -> dict[str, tuple]:
    """Shard shapes written out by hand from the tiny models' sizes (D 32, vocab 272, Hq 8,
    Hkv 4, Dh 16, Hk 4, K = V = 8, experts 4 of width 16), not computed from the rule table."""
    sizes = parse_spec(spec)
    t, e = sizes["tensor"], sizes["expert"]
    hv = 4 if name == "dense" else 8
    c = 2 * 4 * 8 + hv * 8  # GDN conv channels [q | k | v]
    out = {
        "embed": (272 // t, 32),
        "final_norm": (32,),
        "layers.0.input_norm": (32,),
        "layers.0.mixer.in_qkv": (32, c // t),
        "layers.0.mixer.conv": (4, c // t),
        "layers.0.mixer.in_z": (32, hv * 8 // t),
        "layers.0.mixer.in_b": (32, hv // t),
        "layers.0.mixer.A_log": (hv // t,),
        "layers.0.mixer.out_proj": (hv * 8 // t, 32),
        "layers.0.mixer.norm": (8,),
    }
    full = 3 if name == "dense" else 1  # the first full-attention layer
    out |= {
        f"layers.{full}.mixer.q_proj": (32, 8 * 2 * 16 // t),
        f"layers.{full}.mixer.k_proj": (32, 4 * 16 // t),
        f"layers.{full}.mixer.o_proj": (8 * 16 // t, 32),
    }
    if name == "dense":
        out |= {"layers.0.ffn.gate": (32, 64 // t), "layers.0.ffn.down": (64 // t, 32)}
    else:
        out |= {
            "lm_head": (32, 272 // t),
            "layers.0.ffn.gate": (4 // e, 32, 16 // t), "layers.0.ffn.down": (4 // e, 16 // t, 32),
            "layers.0.ffn.router": (32, 4), "layers.0.ffn.shared.up": (32, 24 // t),
            "layers.1.ffn.gate": (32, 48 // t),  # the dense layer of the MoE model
        }
    return out


CASES = [f"{m}:{s}" for m in ("dense", "moe") for s in ("tensor=2", "tensor=4", "expert=4", "data=2,tensor=2")]


@pytest.mark.parametrize("case", CASES)
def test_mesh_matches_one_device(report, case):
    c = report["cases"][case]
    assert c["logits_err"] <= TOL, (c["logits_err"], c["logits_scale"])
    assert c["tokens"] == c["ref_tokens"]
    assert len(c["tokens"][0]) == 8
    assert c["params_equal"]  # loaded slice by slice, bit for bit the one-device params
    name, spec = case.split(":")
    for path, shape in expected_shards(name, spec).items():
        full, shard_shapes, n_shards = c["shards"][path]
        assert shard_shapes == [list(shape)], (path, full, shard_shapes)
        assert n_shards == c["mesh_devices"]
    t = parse_spec(spec)["tensor"]
    heads = "'tensor'" if t > 1 else None
    if heads:  # the cache came out sharded by heads, rows on data when the mesh has it
        rows = "'data'" if "data" in spec else "None"
        assert c["ssm_spec"] == f"P({rows}, 'tensor')", c["ssm_spec"]
        assert c["kv_spec"] == f"P({rows}, None, 'tensor')", c["kv_spec"]


def test_every_checkpoint_layout_loads_sliced_as_on_one_device(report):
    layouts = report["layouts"]
    assert set(layouts) == {"qwen3_5_moe", "qwen3_5_moe:mtp head loaded", "qwen3_5_multimodal"}
    assert all(layouts.values()), layouts


def test_orbax_checkpoint_restores_onto_the_mesh(report):
    r = report["orbax"]
    assert r["same_values"] and r["same_shardings"] and r["mesh"]
    for path, shape in expected_shards("dense", "data=2,tensor=2").items():
        assert r["shards"][path][1] == [list(shape)], path


def test_engine_serves_the_same_with_a_mesh(report):
    """Engine on mesh tensor=2 x expert=2 (paged KV pool sharded by KV heads, batched decode,
    chunked prefill) gives one device's `generate` tokens; so does a repeat (a snapshot hit)."""
    e = report["engine"]
    assert e["mesh"][:2] == e["generate"]
    assert e["mesh"][2] == e["generate"][0]


def test_routed_experts_on_the_expert_axis_combine_then_reduce(report):
    """MoE on mesh expert=4: each device runs its own experts' pairs and the partial outputs are
    summed once per MoE layer, in decode (gathered path) and prefill (grouped path): one
    all-reduce of [N, D] per layer and nothing else (attention and GDN are replicated over
    `expert`); never an all-gather of the expert weights, which XLA's partitioner inserted
    around the routed gathers and grouped matmuls before they ran in shard_map."""
    c = report["moe_collectives"]
    assert c["moe_layers"] == 3
    assert c["decode"] == {"all-reduce": 3}
    assert c["prefill"] == {"all-reduce": 3}


def test_two_processes_match_one(report):
    """`hybridjax generate` over jax.distributed: 2 processes x 2 host devices, mesh tensor=4
    spanning both (gloo collectives), gives the greedy tokens one process computed on one device
    (the worker's reference; rows are independent, so its first row is this prompt alone)."""
    from sharding_worker import NEW, PROMPTS

    args = ["-m", "hybridjax.cli", "generate", "--model", report["dirs"]["moe"], "--json", "--no-compile-cache",
            "--token-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", str(NEW)]
    port = str(random.Random(os.getpid()).randrange(20000, 40000))
    procs = [subprocess.Popen([sys.executable, *args, "--mesh", "tensor=4", "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i)],
                              env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
    ref = report["cases"]["moe:tensor=2"]["ref_tokens"][0]
    assert len(ref) == NEW
    assert outs[0]["token_ids"] == outs[1]["token_ids"] == ref


# --- in-process: specs, errors, the rule table --------------------------------------------


def test_mesh_spec_errors():
    assert parse_spec("tensor=2, expert=4") == {"data": 1, "tensor": 2, "expert": 4}
    for spec, message in [("tensor=2,tensor=2", "given twice"), ("heads=2", "AXIS=SIZE"),
                          ("tensor=two", "not an integer"), ("data=0", ">= 1")]:
        with pytest.raises(MeshError, match=message):
            parse_spec(spec)
    with pytest.raises(MeshError, match="has 8 devices but there are 1"):
        hybridjax.make_mesh("data=2,tensor=4")
    assert dict(hybridjax.make_mesh("auto").shape) == dict.fromkeys(AXES, 1)


TINY = dict(model_type="qwen3_next", vocab_size=272, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=64, full_attention_interval=2,
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def test_heads_that_do_not_divide_are_an_error_saying_so():
    cfg = config_from_dict(TINY)
    check_model(cfg, AbstractMesh((1, 2, 2), AXES))
    check_model(cfg, AbstractMesh((1, 8, 1), AXES))  # 2 KV heads, 4 GDN key heads: replicated (issue 22)
    with pytest.raises(MeshError, match=r"query heads \(num_attention_heads\) = 8 does not divide evenly over tensor=16"):
        check_model(cfg, AbstractMesh((1, 16, 1), AXES))
    with pytest.raises(MeshError, match=r"experts \(num_experts\) = 6 does not divide evenly over expert=4"):
        check_model(cfg, AbstractMesh((1, 1, 4), AXES))
    from hybridjax.sharding import auto_sizes

    assert auto_sizes(8, cfg) == {"data": 4, "tensor": 2, "expert": 1}  # 6 experts do not split 4 ways


def test_rule_table():
    assert tuple(spec_for("layers.3.mixer.q_proj", (32, 256))) == (None, "tensor")
    assert tuple(spec_for("layers.3.mixer.o_proj", (128, 32))) == ("tensor", None)
    assert tuple(spec_for("layers.0.ffn.gate", (4, 32, 16))) == ("expert", None, "tensor")  # MoE
    assert tuple(spec_for("layers.0.ffn.gate", (32, 16))) == (None, "tensor")  # dense MLP
    assert tuple(spec_for("layers.0.ffn.shared.down", (16, 32))) == ("tensor", None)
    assert tuple(spec_for("mtp.layer.mixer.k_proj", (32, 64))) == (None, "tensor")
    assert tuple(spec_for("layers.0.mixer.norm", (8,))) == ()
    assert tuple(spec_for("embed", (272, 32))) == ("tensor", None)


def test_device_order_follows_the_spec(report):
    """The first axis of a spec varies slowest over the device list (a host boundary there)."""
    assert report["order"]["axes"] == ["expert", "tensor", "data"]
    assert report["order"]["ids"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hybridjax.make_mesh("auto").axis_names == ("data", "expert", "tensor")


def test_tensor_parallel_past_the_kv_heads(tmp_path):
    """Issue 22: 2 KV heads and 2 GDN key heads on tensor=4 (with data=2) and tensor=8. Each KV
    head is held by the shards whose query heads read it, so each device keeps one head: the KV
    cache per device is 1/4 of one device's on data=2,tensor=4 (half the rows, half the heads)
    and 1/2 on tensor=8 (all rows, half the heads); k_proj / v_proj are replicated, q_proj split.
    Logits within float32 noise of transformers in float64 (TOL, absolute, |logits| < 1; one
    device is 1.3e-7 off) and of one device; greedy tokens of generate and the engine equal."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "kv_heads_worker.py"), str(tmp_path)],
                          env=_env(8), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    one = r["one"]
    assert r["scale"] < 1 and one["err64"] < TOL
    expected = {"data=2,tensor=4": ([2, 64, 4, 16], [1, 64, 1, 16], one["kv_bytes"]["max"] // 4, [32, 64]),
                "tensor=8": ([2, 64, 8, 16], [2, 64, 1, 16], one["kv_bytes"]["max"] // 2, [32, 32])}
    for spec, (shape, shard, per_device, q_shard) in expected.items():
        case = r["cases"][spec]
        assert case["err64"] < TOL and case["err_one"] < TOL, (spec, case["err64"], case["err_one"])
        assert case["tokens"] == one["tokens"], spec
        assert case["kv_shape"] == shape and case["kv_shard"] == [shard], spec
        assert case["kv_bytes"] == {"max": per_device, "min": per_device, "devices": 8}, spec
        assert case["k_proj_shard"] == [[32, 2 * 16]] and case["q_proj_shard"] == [q_shard], spec
    assert r["cases"]["tensor=8"]["engine"] == r["cases"]["tensor=8"]["engine_ref"]
    assert r["fp8_sharded_equal"]  # block-wise fp8 read slice by slice onto the mesh (issue 22, part 3)
