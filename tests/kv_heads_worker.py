"""Tensor parallelism past the KV heads (issue 22, part 4), run in a subprocess with 8 host devices.

A Qwen3.5 model with 8 query heads, 2 KV heads and 2 GDN key heads (8 value heads) on meshes
whose `tensor` axis exceeds both (data=2,tensor=4 and tensor=8). Prints one JSON report that
tests/test_sharding.py asserts on: logits against transformers in float64 (the truth) and against
one device, greedy tokens of `generate` and of the serving engine (paged pool), the shard shapes
of the KV projections, and the KV cache bytes each device holds.
`python tests/kv_heads_worker.py OUT_DIR`; XLA_FLAGS must ask for 8 host devices.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import hybridjax  # noqa: E402
from hybridjax.generate import generate  # noqa: E402
from hybridjax.sharding import bytes_per_device  # noqa: E402

MESHES = ("data=2,tensor=4", "tensor=8")
PROMPTS = ([5, 17, 42, 7, 99, 3, 250, 11, 64, 1, 2], [8, 1, 200, 33, 9, 12, 14, 100, 31, 7, 70])
NEW = 6


def build(root: Path) -> Path:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    import hf_models

    tiny = dict(hf_models.TINY, num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=2,
                linear_num_value_heads=8)
    torch.manual_seed(21)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**tiny, intermediate_size=64)).eval()
    return hf_models._save(model, root / "kv2", 21)


def truth(d: Path) -> np.ndarray:
    """transformers in float64: logits [B, T, vocab]."""
    import torch

    import hf_models

    model = hf_models.load_torch(d).double()
    with torch.no_grad():
        return model(torch.as_tensor(PROMPTS, dtype=torch.long)).logits.numpy()


def kv_bytes(cache, cfg) -> dict:
    """Bytes of the attention KV buffers per device: {max, min} over devices."""
    kv = [s for s, t in zip(cache.layers, cfg.layer_types) if t == "full_attention"]
    per = bytes_per_device(kv)
    return {"max": max(per.values()), "min": min(per.values()), "devices": len(per)}


def main(out: str) -> dict:
    from sharding_worker import engine_tokens

    d = build(Path(out))
    ref64 = truth(d)
    fwd = jax.jit(hybridjax.forward, static_argnames="cfg")
    cfg, params = hybridjax.load_hf(d, dtype="float32")
    cache = hybridjax.init_cache(cfg, len(PROMPTS), 64)
    one, one_cache = fwd(params, np.asarray(PROMPTS, np.int32), hybridjax.reserve(cache, len(PROMPTS[0])), cfg)
    report = {"scale": float(np.abs(ref64).max()), "one": {
        "err64": float(np.abs(np.asarray(one, np.float64) - ref64).max()),
        "tokens": generate(params, cfg, list(PROMPTS), max_new_tokens=NEW).token_lists(),
        "kv_bytes": kv_bytes(one_cache, cfg)}, "cases": {}}
    for spec in MESHES:
        mesh = hybridjax.make_mesh(spec)
        _, sharded = hybridjax.load_hf(d, dtype="float32", mesh=mesh)
        cache = hybridjax.init_cache(cfg, len(PROMPTS), 64, mesh=mesh)
        logits, new_cache = fwd(sharded, np.asarray(PROMPTS, np.int32), hybridjax.reserve(cache, len(PROMPTS[0])), cfg)
        kv = new_cache.layers[cfg.layer_types.index("full_attention")]
        full = cfg.layer_types.index("full_attention")
        case = {
            "err64": float(np.abs(np.asarray(logits, np.float64) - ref64).max()),
            "err_one": float(np.abs(np.asarray(logits) - np.asarray(one)).max()),
            "kv_shape": list(kv.k.shape), "kv_spec": str(kv.k.sharding.spec),
            "kv_shard": sorted({tuple(s.data.shape) for s in kv.k.addressable_shards}),
            "kv_bytes": kv_bytes(new_cache, cfg),
            "k_proj_shard": sorted({tuple(s.data.shape) for s in sharded.layers[full].mixer.k_proj.addressable_shards}),
            "q_proj_shard": sorted({tuple(s.data.shape) for s in sharded.layers[full].mixer.q_proj.addressable_shards}),
            "tokens": generate(sharded, cfg, list(PROMPTS), max_new_tokens=NEW,
                               cache=hybridjax.init_cache(cfg, len(PROMPTS), 64, mesh=mesh)).token_lists(),
        }
        if spec == "tensor=8":  # the paged engine too: its pool holds the replicated heads
            case["engine"] = engine_tokens(cfg, sharded)
            case["engine_ref"] = engine_tokens(cfg, params)
        report["cases"][spec] = case
    report["fp8_sharded_equal"] = fp8_sharded_equal(d, Path(out))
    return report


def fp8_sharded_equal(d: Path, out: Path) -> bool:
    """An FP8 copy (tests/test_fp8.py's quantiser, 16x24 blocks: partial ones) read slice by
    slice onto tensor=8 gives exactly the params of a one-device read."""
    from sharding_worker import same_params
    from test_fp8 import make_fp8

    fp8_dir, _ = make_fp8(d, out / "kv2-fp8", (16, 24))
    _, one = hybridjax.load_hf(fp8_dir, dtype="float32")
    _, many = hybridjax.load_hf(fp8_dir, dtype="float32", mesh=hybridjax.make_mesh("tensor=8"))
    return same_params(one, many)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), default=list))
