"""Routed MoE cost against the number of experts: hybridjax beside transformers, one run.

    python benchmarks/bench_moe.py [--quick] [--experts 8,64,128,512] [--topk 2,10]
                                   [--prefill 512] [--decode 32] [--repeats 3] [--threads 1] [--stat min]
    python benchmarks/bench_moe.py --crossover      # gathered vs grouped expert paths, few rows

For each (E, k) a random Qwen3-Next model is built by transformers (seed 0; hidden 512, 4 layers,
full attention every 4th, every layer MoE with E experts of FFN 256, top-k, a shared expert of
256, vocab 8192), saved as float32 safetensors and loaded by hybridjax (float32). Both libraries
then run, alternating round by round so that load drift hits both alike:

  prefill  tokens/s over one prompt of `--prefill` tokens, batch 1 (hybridjax: the jitted
           `generate.prefill`, cache pre-sized; transformers: `model(ids, logits_to_keep=1)`);
  decode   ms/token over `--decode` greedy steps after a 32-token prompt, batch 1 (hybridjax: a
           Python loop over `generate.decode_step_donating`; transformers: a loop of
           `model(next_id, past_key_values=...)`), argmax on each side.

The best (`--stat min`, default: the least-disturbed round on a machine shared with other
jobs) or the median of `--repeats` rounds after a warm-up. Ratios: each library's cost at E over its cost at the
smallest E of the same k (the issue's target: <= 1.5x at 128 vs 8), and hybridjax decode speed
over transformers' (target >= 1x). XLA:CPU uses all cores; torch `--threads` (default 1: on a
loaded 2-core machine torch with 2 threads decoded ~7x slower than with 1, spinning threads).

`--crossover` times `hybridjax.moe.routed_experts` alone (random weights, E = 128, hidden 512,
FFN 256) with path="gathered" and path="grouped" for 1..16 rows and k = 2, 10: where the two
cross is `hybridjax.moe.GATHER_MAX_PAIRS`.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SEED = 0
MODEL = dict(
    vocab_size=8192, hidden_size=512, num_hidden_layers=4, full_attention_interval=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=128,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, intermediate_size=1024, moe_intermediate_size=256,
    shared_expert_intermediate_size=256, mlp_only_layers=[], decoder_sparse_step=1,
    max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
    pad_token_id=None,
)
DECODE_PROMPT = 32


def prompt(n: int):
    import numpy as np

    return np.random.RandomState(SEED + n).randint(0, MODEL["vocab_size"], size=n).astype(np.int32)


def median_time(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def build(model_dir: Path, experts: int, topk: int):
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(SEED)
    cfg = Qwen3NextConfig(**MODEL, num_experts=experts, num_experts_per_tok=topk)
    model = Qwen3NextForCausalLM(cfg).eval()
    model.save_pretrained(model_dir)
    return model


def hybridjax_fns(model_dir: Path, a):
    import jax
    import jax.numpy as jnp

    import hybridjax
    from hybridjax import generate as hg
    from hybridjax.cache import init_cache

    cfg, params = hybridjax.load_hf(model_dir, dtype="float32")
    argmax = jax.jit(lambda logits: jnp.argmax(logits.reshape(logits.shape[0], -1, logits.shape[-1])[:, -1], axis=-1).astype(jnp.int32))
    tokens = prompt(a.prefill)[None]
    pre_cache = init_cache(cfg, 1, a.prefill, capacity=a.prefill)
    total = DECODE_PROMPT + a.decode

    def prefill():
        jax.block_until_ready(hg.prefill(params, tokens, pre_cache, cfg))

    def decode():  # returns seconds of the decode steps alone
        cache = init_cache(cfg, 1, total, capacity=total)
        logits, cache = hg.prefill(params, prompt(DECODE_PROMPT)[None], cache, cfg)
        tok = argmax(logits)
        jax.block_until_ready((tok, cache))
        t0 = time.perf_counter()
        for _ in range(a.decode):
            logits, cache = hg.decode_step_donating(params, tok, cache, cfg)
            tok = argmax(logits)
        jax.block_until_ready(tok)
        return time.perf_counter() - t0

    return prefill, decode, params


def torch_fns(model, a):
    import torch

    ids = torch.from_numpy(prompt(a.prefill)[None]).long()
    dec_ids = torch.from_numpy(prompt(DECODE_PROMPT)[None]).long()

    def prefill():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=True, logits_to_keep=1)

    def decode():
        with torch.inference_mode():
            out = model(input_ids=dec_ids, use_cache=True, logits_to_keep=1)
            pkv, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            for _ in range(a.decode):
                out = model(input_ids=tok, past_key_values=pkv, use_cache=True)
                pkv, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t0

    return prefill, decode


def measure(experts: int, topk: int, a) -> dict:
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="bench_moe_"))
    try:
        model = build(tmp, experts, topk)
        h_pre, h_dec, params = hybridjax_fns(tmp, a)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    torch.set_num_threads(a.threads)
    t_pre, t_dec = torch_fns(model, a)
    for fn in (h_pre, h_dec, t_pre, t_dec):  # warm-up (compilation excluded)
        fn()
    res = {k: [] for k in ("h_pre", "t_pre", "h_dec", "t_dec")}
    for _ in range(a.repeats):  # alternate the libraries round by round
        res["h_pre"].append(median_time(h_pre, 1))
        res["t_pre"].append(median_time(t_pre, 1))
        res["h_dec"].append(h_dec())
        res["t_dec"].append(t_dec())
    del model, params
    gc.collect()
    pick = min if a.stat == "min" else statistics.median
    med = {k: pick(v) for k, v in res.items()}
    return dict(
        E=experts, k=topk,
        h_prefill_tps=a.prefill / med["h_pre"], t_prefill_tps=a.prefill / med["t_pre"],
        h_decode_ms=1e3 * med["h_dec"] / a.decode, t_decode_ms=1e3 * med["t_dec"] / a.decode,
    )


def report(rows: list[dict]) -> None:
    print("\n| E | k | hybridjax decode ms/tok | transformers decode ms/tok | decode speed hj/tf | "
          "hybridjax prefill tok/s | transformers prefill tok/s | prefill speed hj/tf | "
          "hj decode cost vs smallest E | tf decode cost vs smallest E | hj prefill cost vs smallest E | "
          "tf prefill cost vs smallest E |")
    print("|" + "---|" * 12)
    for r in rows:
        base = min((b for b in rows if b["k"] == r["k"]), key=lambda b: b["E"])
        print(f"| {r['E']} | {r['k']} | {r['h_decode_ms']:.2f} | {r['t_decode_ms']:.2f} | "
              f"{r['t_decode_ms'] / r['h_decode_ms']:.2f}x | {r['h_prefill_tps']:.0f} | {r['t_prefill_tps']:.0f} | "
              f"{r['h_prefill_tps'] / r['t_prefill_tps']:.2f}x | {r['h_decode_ms'] / base['h_decode_ms']:.2f}x | "
              f"{r['t_decode_ms'] / base['t_decode_ms']:.2f}x | {base['h_prefill_tps'] / r['h_prefill_tps']:.2f}x | "
              f"{base['t_prefill_tps'] / r['t_prefill_tps']:.2f}x |", flush=True)


def crossover(a) -> None:
    import jax
    import jax.numpy as jnp

    from hybridjax import moe
    from hybridjax.params import MLPParams, MoEParams

    e, d, i = 128, 512, 256
    keys = jax.random.split(jax.random.PRNGKey(SEED), 6)
    p = MoEParams(router=jax.random.normal(keys[0], (d, e)) * 0.05, gate=jax.random.normal(keys[1], (e, d, i)) * 0.05,
                  up=jax.random.normal(keys[2], (e, d, i)) * 0.05, down=jax.random.normal(keys[3], (e, i, d)) * 0.05,
                  shared=MLPParams(gate=jnp.zeros((d, 1)), up=jnp.zeros((d, 1)), down=jnp.zeros((1, d))),
                  shared_gate=jnp.zeros((d, 1)))

    class Cfg:
        norm_topk_prob = True

        def __init__(self, k):
            self.num_experts_per_tok = k

        def __hash__(self):
            return self.num_experts_per_tok

        def __eq__(self, other):
            return isinstance(other, Cfg) and other.num_experts_per_tok == self.num_experts_per_tok

    fn = jax.jit(moe.routed_experts, static_argnames=("cfg", "path"))
    print("\n| rows | k | pairs | gathered ms | grouped ms | grouped / gathered |")
    print("|---|---|---|---|---|---|")
    for k in (2, 10):
        for n in (1, 2, 4, 8, 16):
            x = jax.random.normal(keys[4], (n, d))
            t = {}
            for path in ("gathered", "grouped"):
                run = lambda: jax.block_until_ready(fn(p, x, None, Cfg(k), path=path))  # noqa: E731
                run()
                t[path] = min(median_time(lambda: [run() for _ in range(10)], 1) for _ in range(a.repeats)) / 10 * 1e3
            print(f"| {n} | {k} | {n * k} | {t['gathered']:.3f} | {t['grouped']:.3f} | "
                  f"{t['grouped'] / t['gathered']:.2f}x |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="E = 8, 128; k = 2; prefill 128; decode 8")
    ap.add_argument("--experts", default="8,64,128,512")
    ap.add_argument("--topk", default="2,10")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stat", choices=("min", "median"), default="min",
                    help="over the repeats: min (the least-disturbed round on a shared machine) or median")
    ap.add_argument("--crossover", action="store_true")
    a = ap.parse_args(argv)
    if a.crossover:
        crossover(a)
        return 0
    if a.quick:
        a.experts, a.topk, a.prefill, a.decode, a.repeats = "8,128", "2", 128, 8, 2
    rows = []
    for k in (int(v) for v in a.topk.split(",")):
        for e in (int(v) for v in a.experts.split(",")):
            if k > e:  # top-k needs k experts: the k = 10 rows start at the next E
                print(f"E={e} k={k}: skipped (k > E)", flush=True)
                continue
            rows.append(measure(e, k, a))
            r = rows[-1]
            print(f"E={e} k={k}: hybridjax decode {r['h_decode_ms']:.2f} ms/tok, prefill {r['h_prefill_tps']:.0f} tok/s; "
                  f"transformers decode {r['t_decode_ms']:.2f} ms/tok, prefill {r['t_prefill_tps']:.0f} tok/s", flush=True)
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
