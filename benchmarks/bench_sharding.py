"""Sharding: per-device bytes on paper for the real models, and prefill / decode time per mesh
on 8 host devices beside one device.

    python benchmarks/bench_sharding.py --paper          # arithmetic only, from the rule table
    python benchmarks/bench_sharding.py                  # measure (spawns itself with 8 host devices)

--paper evaluates `hybridjax.sharding.RULES` on the transformers default configs (Qwen3NextConfig:
Qwen3-Next-80B-A3B; Qwen3_5MoeTextConfig) for meshes of 8 GPUs and 2 hosts x 8: weight bytes per
device, KV bytes per token, GDN state per sequence, and the collectives XLA needs per decoded token
(docs/sharding.md explains each line).

What the measurement means on this machine: the 8 "devices" are XLA:CPU host devices sharing
2 cores (and the machine is shared by other jobs), so a mesh cannot be faster than one device
here: the ratios show the cost of partitioning (collectives become memory copies, more, smaller
ops), not the speed-up on real accelerators. Bytes per device are exact.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GB = 1e9


# --- on paper -------------------------------------------------------------------------------


PAPER_MODELS = {
    # transformers' defaults (checked: hidden 2048, 48 layers 3:1, 512 experts top-10 of width 512
    # + shared 512, attention 16q/2kv x 256, GDN 16qk/32v x 128, vocab 151936)
    "Qwen3-Next-80B-A3B (Qwen3NextConfig defaults)": ("next", {}),
    # transformers' Qwen3.5-MoE defaults: 40 layers, 256 experts top-8, vocab 248320 (~35B)
    "Qwen3.5-MoE (Qwen3_5MoeTextConfig defaults, ~35B-A3B)": ("3_5", {}),
    # not a published config: the Qwen3.5-MoE layout at the 80B model's depth and expert count
    "Qwen3.5-MoE at 80B shape (48 layers, 512 experts top-10; hypothetical)": (
        "3_5", {"num_hidden_layers": 48, "num_experts": 512, "num_experts_per_tok": 10}),
}


def _hf_config(name: str):
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    from hybridjax.config import config_from_dict

    kind, over = PAPER_MODELS[name]
    hf = (Qwen3NextConfig if kind == "next" else Qwen3_5MoeTextConfig)(**over)
    return config_from_dict(hf.to_dict())


def paper(cfg, sizes: dict, dtype_bytes: int = 2) -> dict:
    """Per-device bytes and per-token collective bytes for `cfg` on a mesh of `sizes`."""
    import jax
    from jax.sharding import AbstractMesh

    from hybridjax.config import FULL
    from hybridjax.params import FLOAT32_LEAVES, is_shape, param_shapes
    from hybridjax.sharding import AXES, param_specs

    mesh = AbstractMesh(tuple(sizes[a] for a in AXES), AXES)
    shapes = param_shapes(cfg)
    specs = param_specs(shapes, mesh)
    flat_shapes, _ = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    total = per_device = 0
    for (path, shape), spec in zip(flat_shapes, flat_specs):
        nbytes = 4 if getattr(path[-1], "name", "") in FLOAT32_LEAVES else dtype_bytes
        n = math.prod(shape)
        split = math.prod(sizes[a] for a in tuple(spec) if a is not None)
        total += n * nbytes
        per_device += n // split * nbytes
    t, e = sizes["tensor"], sizes["expert"]
    n_full = sum(x == FULL for x in cfg.layer_types)
    n_gdn = len(cfg.layer_types) - n_full
    kv_token = n_full * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes  # k and v, every full layer
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * 4
    d = cfg.hidden_size
    layers = len(cfg.layer_types)
    # Per decoded token (one sequence): all-reduces of [D] activations (model dtype) over the
    # axes a block's sum is split on, the GDN conv output moved from channel to head shards
    # (float32 [C]), and the vocabulary-sharded logits gathered for sampling (float32 [vocab]).
    allreduce = []
    if t > 1:
        allreduce += [("embedding lookup (vocab-sharded)", 1)]
        allreduce += [("mixer out (o_proj / out_proj, row-parallel)", layers)]
    if t * e > 1:
        allreduce += [("FFN out (down / experts, row-parallel + expert sum)", layers)]
    ar_bytes = sum(n for _, n in allreduce) * d * dtype_bytes
    gather_conv = n_gdn * cfg.gdn_conv_dim * 4 if t > 1 else 0
    gather_logits = cfg.vocab_size * 4 if t > 1 else 0
    return {
        "weights_total_GB": total / GB, "weights_per_device_GB": per_device / GB,
        "kv_per_token_per_device_KB": kv_token / t / 1e3,
        "gdn_state_per_seq_per_device_MB": n_gdn * (ssm + conv) / t / 1e6,
        "collectives_per_token": sum(n for _, n in allreduce) + (n_gdn if t > 1 else 0) + (1 if t > 1 else 0),
        "allreduce_payload_KB": ar_bytes / 1e3, "conv_reshard_KB": gather_conv / 1e3,
        "logits_gather_KB": gather_logits / 1e3,
        # ring all-reduce moves 2 (n-1)/n of the payload through each device; an all-gather (n-1)/n
        "ring_bytes_per_device_KB": (2 * (t * e - 1) / (t * e) * ar_bytes + (t - 1) / t * (gather_conv + gather_logits)) / 1e3,
    }


PAPER_MESHES = (
    ("8 GPUs: tensor=2,expert=4 (auto)", {"data": 1, "tensor": 2, "expert": 4}),
    ("8 GPUs: expert=8", {"data": 1, "tensor": 1, "expert": 8}),
    ("2x8: data=2,tensor=2,expert=4 (a replica per host)", {"data": 2, "tensor": 2, "expert": 4}),
    ("2x8: expert=8,tensor=2 (experts across hosts)", {"data": 1, "tensor": 2, "expert": 8}),
)


def print_paper(device_gb: float = 80.0, context: int = 32768) -> None:
    """Markdown tables (docs/sharding.md carries them)."""
    for name in PAPER_MODELS:
        cfg = _hf_config(name)
        print(f"\n**{name}**: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
              f"({sum(t == 'full_attention' for t in cfg.layer_types)} full attention), {cfg.num_experts} experts top-"
              f"{cfg.num_experts_per_tok} (width {cfg.moe_intermediate_size}, shared {cfg.shared_expert_intermediate_size}), "
              f"attention {cfg.num_attention_heads}q/{cfg.num_key_value_heads}kv x {cfg.head_dim}, GDN "
              f"{cfg.linear_num_key_heads}qk/{cfg.linear_num_value_heads}v x {cfg.linear_key_head_dim}, vocab {cfg.vocab_size}\n")
        print("| mesh | weights GB/dev (total) | KV KB/token/dev | GDN state MB/seq/dev | "
              f"seqs of {context // 1024}k in {device_gb:.0f} GB | collectives/token | all-reduce KB | conv reshard KB | "
              "logits gather KB | ring KB/dev |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for label, sizes in PAPER_MESHES:
            r = paper(cfg, sizes)
            free = device_gb - r["weights_per_device_GB"]
            per_seq_gb = (r["gdn_state_per_seq_per_device_MB"] * 1e6 + context * r["kv_per_token_per_device_KB"] * 1e3) / GB
            print(f"| {label} | {r['weights_per_device_GB']:.1f} ({r['weights_total_GB']:.0f}) | "
                  f"{r['kv_per_token_per_device_KB']:.2f} | {r['gdn_state_per_seq_per_device_MB']:.1f} | "
                  f"{int(free / per_seq_gb)} | {r['collectives_per_token']} | {r['allreduce_payload_KB']:.0f} | "
                  f"{r['conv_reshard_KB']:.0f} | {r['logits_gather_KB']:.0f} | {r['ring_bytes_per_device_KB']:.0f} |")


# --- measured ---------------------------------------------------------------------------------

MEASURED_MESHES = (("one device", None, 1), ("tensor=2", "tensor=2", 2), ("tensor=4", "tensor=4", 4),
                   ("tensor=8", "tensor=8", 8), ("expert=4", "expert=4", 4), ("data=2,tensor=4", "data=2,tensor=4", 8),
                   ("tensor=2,expert=4", "tensor=2,expert=4", 8))
BENCH_CONFIG = dict(model_type="qwen3_next", vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=8, head_dim=32, linear_num_key_heads=8, linear_num_value_heads=16,
                    linear_key_head_dim=32, linear_value_head_dim=32, intermediate_size=512, full_attention_interval=4,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)


def _time(fn, reps: int) -> float:
    fn()  # compile
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(batch: int, prompt: int, decode_steps: int, reps: int) -> None:
    import jax
    import numpy as np

    import hybridjax
    from hybridjax.config import config_from_dict
    from hybridjax.generate import decode_step_donating, prefill
    from hybridjax.sharding import bytes_per_device

    cfg = config_from_dict(BENCH_CONFIG)
    base = hybridjax.init_params(0, cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt)).astype(np.int32)
    rows, ref = [], None
    for label, spec, n in MEASURED_MESHES:
        mesh = hybridjax.make_mesh(spec, devices=jax.devices()[:n]) if spec else None
        params = hybridjax.shard_params(base, cfg, mesh) if mesh else base
        empty = hybridjax.init_cache(cfg, batch, prompt + decode_steps + 1, capacity=prompt + decode_steps + 1, mesh=mesh)

        def run_prefill():
            logits, cache = prefill(params, tokens, empty, cfg)
            logits.block_until_ready()
            return cache

        t_prefill = _time(run_prefill, reps)
        cache0 = run_prefill()
        tok = np.zeros((batch,), np.int32)

        def run_decode():
            cache = jax.tree_util.tree_map(lambda x: x.copy(), cache0)  # donated below
            start = time.perf_counter()
            for _ in range(decode_steps):
                logits, cache = decode_step_donating(params, tok, cache, cfg)
            logits.block_until_ready()
            return time.perf_counter() - start

        run_decode()
        t_decode = min(run_decode() for _ in range(reps)) / decode_steps
        hlo = _collectives(params, cache0, cfg, batch) if mesh else {}
        w = max(bytes_per_device(params).values())
        c = max(bytes_per_device(cache0).values())
        if ref is None:
            ref = (t_prefill, t_decode)
        rows.append((label, n, t_prefill * 1e3, t_prefill / ref[0], t_decode * 1e3, t_decode / ref[1], w / 1e6, c / 1e6,
                     " ".join(f"{k}:{v}" for k, v in sorted(hlo.items())) or "-"))
    print(f"model: {BENCH_CONFIG['num_hidden_layers']} layers, hidden {BENCH_CONFIG['hidden_size']}, "
          f"{BENCH_CONFIG['num_experts']} experts, float32; batch {batch}, prompt {prompt}, decode {decode_steps} steps; "
          f"best of {reps}. 8 XLA:CPU host devices on 2 shared cores (machine loaded by other jobs): the ratios "
          "show partitioning overhead, not accelerator speed-up.")
    print(f"{'mesh':20s} {'devs':>4s} {'prefill ms':>10s} {'x one':>6s} {'decode ms/step':>14s} {'x one':>6s} "
          f"{'weights MB/dev':>14s} {'cache MB/dev':>12s}  collectives in one decode step (compiled HLO)")
    for r in rows:
        print(f"{r[0]:20s} {r[1]:4d} {r[2]:10.1f} {r[3]:6.2f} {r[4]:14.2f} {r[5]:6.2f} {r[6]:14.2f} {r[7]:12.3f}  {r[8]}")


def _collectives(params, cache, cfg, batch: int) -> dict:
    """Collective ops XLA put in the compiled decode step, by kind (what the partitioner inserted)."""
    import collections
    import re

    import jax.numpy as jnp

    from hybridjax.cache import reserve
    from hybridjax.generate import _decode_jit

    tok, active = jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), bool)
    text = _decode_jit.lower(params, tok, active, reserve(cache, 1), cfg).compile().as_text()
    kinds = r"(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
    return dict(collections.Counter(re.findall(rf"= \S+ {kinds}(?:-start)?\(", text)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paper", action="store_true", help="print the on-paper numbers only")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if args.paper:
        print_paper()
        return 0
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", PYTHONPATH=str(ROOT))
        return subprocess.call([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env=env)
    measure(args.batch, args.prompt, args.decode_steps, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
