"""The body of tests/test_sharding.py, run in a subprocess with 8 host devices.

JAX fixes its device count at start-up, so the mesh cases run here, all in one process (JAX's
start and the single-device reference are paid once), and print one JSON report the test
asserts on. `python tests/sharding_worker.py OUT_DIR [--engine]`; XLA_FLAGS must ask for 8
host devices before this file imports jax.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import hybridjax  # noqa: E402
from hybridjax.generate import generate  # noqa: E402

# (spec, devices): every mesh the issue names, on a prefix of the 8 host devices.
MESHES = (("tensor=2", 2), ("tensor=4", 4), ("expert=4", 4), ("data=2,tensor=2", 4))
PROMPTS = ([5, 17, 42, 7, 99, 3, 250, 11, 64], [8, 1, 200, 33])  # ragged: right padding in play
NEW = 8


def build_models(root: Path) -> dict[str, Path]:
    """Tiny HF checkpoints whose head counts divide by 4: Qwen3.5 dense (split projections, tied
    embeddings) and Qwen3-Next MoE (fused in_proj_qkvz / in_proj_ba, per-expert tensors, Hv = 2 Hk,
    a dense layer among the MoE ones)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    import hf_models

    tiny = dict(hf_models.TINY, num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4)
    torch.manual_seed(11)
    dense = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**tiny, intermediate_size=64, linear_num_value_heads=4,
                                                 tie_word_embeddings=True)).eval()
    torch.manual_seed(12)
    moe = Qwen3NextForCausalLM(Qwen3NextConfig(**tiny, **hf_models.MOE, intermediate_size=48, linear_num_value_heads=8,
                                               mlp_only_layers=[1], full_attention_interval=2)).eval()
    return {"dense": hf_models._save(dense, root / "dense", 11), "moe": hf_models._save(moe, root / "moe", 12)}


def shard_shapes(params) -> dict[str, list]:
    """A few leaves' shard shape on every device (all devices must agree on it)."""
    from hybridjax.conversion.hf import flat_leaves

    out = {}
    for path, x in flat_leaves(params.replace(mesh=None)).items():
        shapes = {tuple(s.data.shape) for s in x.addressable_shards}
        out[path] = [list(x.shape), [list(s) for s in sorted(shapes)], len(x.addressable_shards)]
    return out


def run_case(params, cfg) -> dict:
    """Greedy `generate` (one compiled program: prefill, then decode in a while loop) on a cache
    made by init_cache(mesh=...); its logits are those after every row's last token."""
    cache = hybridjax.init_cache(cfg, len(PROMPTS), 64, mesh=params.mesh)
    gen = generate(params, cfg, list(PROMPTS), max_new_tokens=NEW, cache=cache)
    gdn = gen.cache.layers[cfg.layer_types.index("linear_attention")]
    kv = gen.cache.layers[cfg.layer_types.index("full_attention")]
    return {
        "logits": np.asarray(gen.logits), "tokens": gen.token_lists(),
        "ssm_spec": str(getattr(gdn.ssm.sharding, "spec", None)),
        "kv_spec": str(getattr(kv.k.sharding, "spec", None)),
    }


def engine_tokens(cfg, params) -> list[list[int]]:
    """Greedy outputs of the serving engine (paged KV pool, chunked prefill, batched decode) for
    PROMPTS submitted together, then the first again (an exact-prefix snapshot hit)."""
    from hybridjax.engine import Engine, GenerationRequest
    from hybridjax.prefix_cache import SnapshotStore

    eng = Engine(cfg, params, None, store=SnapshotStore("sharding"), slots=2, max_len=64, page_size=16,
                 prefill_chunk=16).start()
    try:
        handles = [eng.submit(GenerationRequest(list(p), max_tokens=NEW)) for p in PROMPTS]
        outs = [list(h.events(timeout=600)) and h.token_ids for h in handles]
        again = eng.submit(GenerationRequest(list(PROMPTS[0]), max_tokens=NEW))
        list(again.events(timeout=600))
        return outs + [again.token_ids]
    finally:
        eng.stop()


def same_params(one, many) -> bool:
    """Sharded params equal one device's, leaf by leaf, bit for bit."""
    from hybridjax.conversion.hf import flat_leaves

    a, b = flat_leaves(one.replace(mesh=None)), flat_leaves(many.replace(mesh=None))
    return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def sliced_loads_agree(root: Path, names=("qwen3_5_moe", "qwen3_5_multimodal")) -> dict[str, bool]:
    """Checkpoint layouts of tests/hf_models.py beyond the two models of the mesh cases (which
    cover Qwen3-Next's fused projections and per-expert tensors, and Qwen3.5's split ones):
    transformers' fused experts with an MTP head, and the multimodal prefix, loaded onto mesh
    tensor=2 x expert=2, equal the one-device load bit for bit."""
    import hf_models

    mesh = hybridjax.make_mesh("tensor=2,expert=2", devices=jax.devices()[:4])
    out = {}
    for name in names:
        d = hf_models.BUILDERS[name](root / f"layout_{name}")
        if name == "qwen3_5_moe":
            hf_models.add_mtp_head(d, hf_models.load_torch(d))
        _, one = hybridjax.load_hf(d, dtype="float32")
        _, many = hybridjax.load_hf(d, dtype="float32", mesh=mesh)
        out[name] = same_params(one, many)
        if name == "qwen3_5_moe":
            out[name + ":mtp head loaded"] = many.mtp is not None
    return out


def collectives(params, cfg, tokens: int) -> dict[str, int]:
    """Collective ops in the compiled forward of 2 rows x `tokens` tokens (1: the MoE layers'
    gathered path; 16: the grouped path) on a cache of 64."""
    import re
    from collections import Counter

    cache = hybridjax.reserve(hybridjax.init_cache(cfg, 2, 64, mesh=params.mesh), 64)
    fwd = jax.jit(hybridjax.forward, static_argnames=("cfg",))
    hlo = fwd.lower(params, np.zeros((2, tokens), np.int32), cache, cfg).compile().as_text()
    return dict(Counter(re.findall(r" (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)\(", hlo)))


def main(out_dir: str, engine: bool = False) -> dict:
    root = Path(out_dir)
    report = {"devices": jax.device_count(), "cases": {}, "timings": {}}
    m = hybridjax.make_mesh("expert=2,tensor=4")
    report["order"] = {"axes": list(m.axis_names), "ids": [[d.id for d in row] for row in m.devices.reshape(2, 4)]}
    t0 = time.perf_counter()
    dirs = build_models(root)
    report["dirs"] = {k: str(v) for k, v in dirs.items()}
    t0 = time.perf_counter()
    report["layouts"] = sliced_loads_agree(root)
    report["timings"]["layouts"] = time.perf_counter() - t0
    report["timings"]["build"] = time.perf_counter() - t0
    for name, d in dirs.items():
        t = time.perf_counter()
        cfg, params = hybridjax.load_hf(d, dtype="float32")
        ref = run_case(params, cfg)
        report["timings"][f"{name}:one device"] = time.perf_counter() - t
        for spec, n in MESHES:
            t = time.perf_counter()
            mesh = hybridjax.make_mesh(spec, devices=jax.devices()[:n])
            _, sharded = hybridjax.load_hf(d, dtype="float32", mesh=mesh)
            got = run_case(sharded, cfg)
            got["params_equal"] = same_params(params, sharded)
            report["cases"][f"{name}:{spec}"] = {
                "logits_err": float(np.abs(got["logits"] - ref["logits"]).max()),
                "logits_scale": float(np.abs(ref["logits"]).max()),
                "tokens": got["tokens"], "ref_tokens": ref["tokens"], "params_equal": got["params_equal"],
                "ssm_spec": got["ssm_spec"], "kv_spec": got["kv_spec"],
                "shards": shard_shapes(sharded), "mesh_devices": n,
            }
            if name == "moe" and spec == "expert=4":
                report["moe_collectives"] = {"moe_layers": sum(map(bool, cfg.moe_layers)),
                                             "decode": collectives(sharded, cfg, 1),
                                             "prefill": collectives(sharded, cfg, 16)}
            report["timings"][f"{name}:{spec}"] = time.perf_counter() - t
        if name == "dense":  # a converted (orbax) checkpoint restores straight onto the mesh
            from hybridjax.conversion import convert_hf
            from hybridjax.conversion.hf import flat_leaves

            mesh = hybridjax.make_mesh("data=2,tensor=2", devices=jax.devices()[:4])
            convert_hf(d, root / "dense_ckpt", dtype="float32")
            _, restored = hybridjax.load(root / "dense_ckpt", mesh=mesh)
            _, read = hybridjax.load_hf(d, dtype="float32", mesh=mesh)
            a, b = flat_leaves(restored.replace(mesh=None)), flat_leaves(read.replace(mesh=None))
            report["orbax"] = {
                "same_values": all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in b) and a.keys() == b.keys(),
                "same_shardings": all(a[k].sharding == b[k].sharding for k in b),
                "shards": shard_shapes(restored), "mesh": restored.mesh is not None,
            }
        if engine and name == "moe":
            t = time.perf_counter()
            mesh = hybridjax.make_mesh("data=1,tensor=2,expert=2", devices=jax.devices()[:4])
            # One device's engine is checked against generate by test_engine.py; here the sharded
            # engine is checked against one device's generate.
            report["engine"] = {"generate": ref["tokens"], "mesh": engine_tokens(cfg, hybridjax.shard_params(params, cfg, mesh))}
            report["timings"]["engine"] = time.perf_counter() - t
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], "--engine" in sys.argv)))
