"""Prefill and decode throughput: hybridjax vs transformers on the same random Qwen3.5 weights.

    python benchmarks/bench_generate.py [--quick] [--dtypes float32,bfloat16] [--repeats 3]
                                        [--attn auto|sdpa|eager] [--threads 2] [--json OUT]

Builds a random Qwen3.5 dense text model with transformers (fixed seed; hidden 1024, 12 layers,
3 linear : 1 full attention, vocab 32000, untied head: ~0.23 B params), saves it as HF float32
safetensors in a temp dir, then measures, for each dtype, both libraries in that dtype:

  prefill  tokens/s over one prompt of T tokens (default T = 512 and 2048), batch 1
           hybridjax:    `hybridjax.generate.prefill` (jitted, cache pre-sized, block_until_ready)
           transformers: `model(ids, use_cache=True, logits_to_keep=1)` under inference_mode
                         (logits of the last position only, as both generate paths do)
  decode   tokens/s for N new greedy tokens (default 128) after a P-token prompt (default 128)
           hybridjax:    `hybridjax.generate.generate(max_new_tokens=N)` (prefill + lax.while_loop
                         in one jitted call) minus the median prefill time of the same prompt;
                         also a Python loop over `decode_step_donating` ("decode-loop" row)
           transformers: `model.generate(max_new_tokens=N, min_new_tokens=N, do_sample=False)`
                         minus the median prefill time of the same prompt

decode tok/s = N / (generate time - prefill time) for both libraries. Every timing is warmed up
once per shape (compilation excluded), repeated `--repeats` times, and the median is reported.
Each dtype runs in its own subprocess (memory is returned between dtypes); within it every
measurement is warmed up, then the libraries alternate, round by round, so that load drift on a
shared machine hits both alike. torch uses `--threads` intra-op threads; XLA:CPU uses all
cores (2 here). `--attn auto` times one longest prefill with sdpa and with eager per dtype and
keeps the faster. Greedy tokens of the two libraries are compared as a sanity check (float32
should agree; random weights give flat logits, so a late near-tie flip is possible).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
MODEL = dict(
    vocab_size=32000, hidden_size=1024, num_hidden_layers=12, full_attention_interval=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128,
    linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, intermediate_size=3072, max_position_embeddings=8192,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)
FULL = dict(prefill=(512, 2048), decode_prompt=128, new_tokens=128)
QUICK = dict(prefill=(128, 512), decode_prompt=32, new_tokens=32)


def prompt_tokens(n: int, vocab: int = MODEL["vocab_size"]):
    import numpy as np

    return np.random.RandomState(SEED + n).randint(0, vocab, size=n).astype(np.int32)


def timed(fn, repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of `repeats` calls of fn() after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def build_model(model_dir: Path) -> int:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(SEED)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**MODEL)).eval()
    model.save_pretrained(model_dir)  # float32 safetensors
    return sum(p.numel() for p in model.parameters())


# --- one worker process per dtype: both libraries, measurements interleaved ---------------------


def setup_hybridjax(a) -> list[tuple]:
    """(name, fn) pairs; fn() runs one measurement and returns its seconds."""
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp

    import hybridjax
    from hybridjax import generate as hg
    from hybridjax.cache import bucket, init_cache

    cfg, params = hybridjax.load_hf(a.model_dir, dtype=a.dtype)
    jax.block_until_ready(params)
    out = []

    def prefill(t: int, max_len: int, capacity: int):
        tokens = prompt_tokens(t)[None]
        cache = init_cache(cfg, 1, max_len, capacity=capacity)  # pre-sized: no growth while timed
        return lambda: _wall(lambda: jax.block_until_ready(hg.prefill(params, tokens, cache, cfg)))

    for t in a.prefill:
        out.append((f"prefill/{t}", prefill(t, t, t)))

    p, n = a.decode_prompt, a.new_tokens
    prompt = prompt_tokens(p)
    # The cache `generate` builds: max_len = bucketed prompt + bucketed output, reserved to p + n.
    max_len = hg.length_bucket(p) + hg.length_bucket(n)
    out.append(("decode/prompt_prefill", prefill(p, max_len, bucket(p + n, max_len))))

    def whole_call():
        t0 = time.perf_counter()
        g = hg.generate(params, cfg, [prompt.tolist()], max_new_tokens=n)
        jax.block_until_ready(g)
        TOKENS["hybridjax"] = g.token_lists()[0]
        return time.perf_counter() - t0

    out.append(("decode/generate", whole_call))

    if a.loop:
        argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))

        def step_loop():
            cache = init_cache(cfg, 1, p + n, capacity=bucket(p + n, p + n))
            logits, cache = hg.prefill(params, prompt[None], cache, cfg)  # fresh cache: donatable
            tok = argmax(logits)
            jax.block_until_ready((tok, cache))
            toks = []
            t0 = time.perf_counter()
            for _ in range(n):
                toks.append(tok)
                logits, cache = hg.decode_step_donating(params, tok, cache, cfg)
                tok = argmax(logits)
            jax.block_until_ready((tok, cache))
            dt = time.perf_counter() - t0
            TOKENS["hybridjax-loop"] = [int(x[0]) for x in toks]
            return dt

        out.append(("decode/loop", step_loop))
    return out


def _torch_prefill(model, ids):
    import torch

    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)


def setup_torch(a, info: dict) -> list[tuple]:
    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.set_num_threads(a.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    first = "sdpa" if a.attn == "auto" else a.attn
    model = Qwen3_5ForCausalLM.from_pretrained(a.model_dir, dtype=dtype, attn_implementation=first).eval()

    attn, info["attn_trials"] = a.attn, {}
    if a.attn == "auto":  # the faster of sdpa / eager on the longest prefill (after a warm-up)
        ids = torch.from_numpy(prompt_tokens(max(a.prefill))[None]).long()
        for impl in ("sdpa", "eager"):
            model.set_attn_implementation(impl)
            info["attn_trials"][impl] = min(timed(lambda: _torch_prefill(model, ids), 1))
        attn = min(info["attn_trials"], key=info["attn_trials"].get)
        model.set_attn_implementation(attn)
    info["attn"] = attn

    def prefill(t: int):
        ids = torch.from_numpy(prompt_tokens(t)[None]).long()
        return lambda: _wall(lambda: _torch_prefill(model, ids))

    out = [(f"prefill/{t}", prefill(t)) for t in a.prefill]
    p, n = a.decode_prompt, a.new_tokens
    ids = torch.from_numpy(prompt_tokens(p)[None]).long()
    out.append(("decode/prompt_prefill", prefill(p)))

    def gen():
        t0 = time.perf_counter()
        with torch.inference_mode():
            o = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )
        dt = time.perf_counter() - t0
        TOKENS["transformers"] = o[0, p:].tolist()
        return dt

    out.append(("decode/generate", gen))
    return out


TOKENS: dict[str, list[int]] = {}


def _wall(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker(a) -> dict:
    """Warm every measurement once, then run `repeats` rounds; within a round the two libraries
    alternate on each measurement, so slow drifts in machine load hit both alike."""
    info: dict = {}
    libs = {"hybridjax": setup_hybridjax(a), "transformers": setup_torch(a, info)}
    names = [name for name, _ in libs["hybridjax"]]
    plan = [(name, lib, fn) for name in names for lib, ms in libs.items() for nm, fn in ms if nm == name]
    times: dict = {lib: {} for lib in libs}
    for name, lib, fn in plan:  # warm-up: compiles every shape, fills allocator caches
        print(f"  warm-up {lib} {name}", file=sys.stderr, flush=True)
        fn()
    for r in range(a.repeats):
        for name, lib, fn in plan:
            times[lib].setdefault(name, []).append(fn())
        print(f"  round {r + 1}/{a.repeats} done", file=sys.stderr, flush=True)
    return {"times": times, "tokens": TOKENS, **info}


# --- driver --------------------------------------------------------------------------------


def run_worker(dtype: str, model_dir: Path, a, sizes: dict) -> dict:
    out = Path(model_dir) / f"result-{dtype}.json"
    cmd = [
        sys.executable, __file__, "--worker", "--dtype", dtype, "--model-dir", str(model_dir),
        "--out", str(out), "--repeats", str(a.repeats), "--threads", str(a.threads), "--attn", a.attn,
        "--prefill", ",".join(map(str, sizes["prefill"])), "--decode-prompt", str(sizes["decode_prompt"]),
        "--new-tokens", str(sizes["new_tokens"]),
    ] + ([] if a.no_loop else ["--loop"])
    load0 = os.getloadavg()[0]
    t0 = time.time()
    print(f"[{dtype}] running ...", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    res = json.loads(out.read_text())
    res["wall_s"] = time.time() - t0
    res["loadavg"] = (load0, os.getloadavg()[0])
    print(f"[{dtype}] done in {res['wall_s']:.0f}s (1-min load avg {load0:.2f} -> {res['loadavg'][1]:.2f})",
          file=sys.stderr, flush=True)
    return res


def med(xs) -> float:
    return statistics.median(xs)


def rows_for(dtype: str, res: dict, sizes: dict) -> list[tuple]:
    hj, hf = res["times"]["hybridjax"], res["times"]["transformers"]
    rows = [(dtype, "prefill", t, t / med(hj[f"prefill/{t}"]), t / med(hf[f"prefill/{t}"])) for t in sizes["prefill"]]
    n = sizes["new_tokens"]
    hf_dec = n / (med(hf["decode/generate"]) - med(hf["decode/prompt_prefill"]))
    hj_dec = n / (med(hj["decode/generate"]) - med(hj["decode/prompt_prefill"]))
    rows.append((dtype, "decode", n, hj_dec, hf_dec))
    if "decode/loop" in hj:
        rows.append((dtype, "decode-loop", n, n / med(hj["decode/loop"]), hf_dec))
    return rows


def agreement(a: list[int], b: list[int]) -> str:
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{same}/{min(len(a), len(b))} leading tokens equal"


def report(results: dict, sizes: dict, dtypes: list[str], threads: int, repeats: int) -> list[tuple]:
    """Print the markdown table and the notes under it; returns the table rows."""
    import jax
    import torch
    import transformers

    rows = [r for d in dtypes for r in rows_for(d, results[d], sizes)]
    attn = ", ".join(f"{d}: {results[d]['attn']}" for d in dtypes)
    print(f"\nhybridjax (jax {jax.__version__}) vs transformers {transformers.__version__} (torch {torch.__version__}, "
          f"{threads} threads, attention {attn}) on {os.cpu_count()} CPU cores; batch 1, median of "
          f"{repeats}; decode = {sizes['new_tokens']} greedy tokens after a {sizes['decode_prompt']}-token prompt\n")
    print("| dtype | phase | length | hybridjax tok/s | transformers tok/s | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for d, phase, n, hj, hf in rows:
        print(f"| {d} | {phase} | {n} | {hj:.1f} | {hf:.1f} | {hj / hf:.2f}x |")
    print()
    for d in dtypes:
        r, tok = results[d], results[d]["tokens"]
        line = f"{d}: greedy tokens, hybridjax generate vs transformers: {agreement(tok['hybridjax'], tok['transformers'])}"
        if "hybridjax-loop" in tok:
            line += f"; decode loop vs generate: {agreement(tok['hybridjax-loop'], tok['hybridjax'])}"
        print(line)
        if r["attn_trials"]:
            trials = ", ".join(f"{k} {v:.2f}s" for k, v in r["attn_trials"].items())
            print(f"{d}: transformers attention trial, prefill of {max(sizes['prefill'])} tokens: {trials}")
        spread = "; ".join(f"{lib} {name} {min(v):.2f}-{max(v):.2f}s" for lib, ms in r["times"].items()
                           for name, v in ms.items())
        print(f"{d}: wall {r['wall_s']:.0f}s, 1-min load avg {r['loadavg'][0]:.2f} -> {r['loadavg'][1]:.2f}; "
              f"min-max: {spread}")
    load = max(x for d in dtypes for x in results[d]["loadavg"])
    if load > (os.cpu_count() or 1):
        print(f"WARNING: 1-min load average reached {load:.1f} on {os.cpu_count()} cores: other processes shared "
              "the CPU, so figures are noisy; multi-threaded torch suffers most (its OpenMP barriers stall "
              "when a worker thread is descheduled). Rerun on an idle machine before quoting ratios.")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="prefill 128/512, decode 32 after 32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--attn", default="auto", choices=("auto", "sdpa", "eager"), help="transformers attention")
    ap.add_argument("--no-loop", action="store_true", help="skip the decode_step_donating loop")
    ap.add_argument("--model-dir", help="reuse / keep the HF model here (default: a temp dir)")
    ap.add_argument("--json", help="also write all raw timings here")
    # worker-only
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--prefill", help=argparse.SUPPRESS)
    ap.add_argument("--decode-prompt", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--new-tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        a.prefill = [int(x) for x in a.prefill.split(",")]
        Path(a.out).write_text(json.dumps(worker(a)))
        return 0

    sizes = QUICK if a.quick else FULL
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if bad or a.repeats < 1:
        print(f"error: --dtypes takes float32 and/or bfloat16 (got {bad}); --repeats >= 1", file=sys.stderr)
        return 2
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:
        model_dir = Path(a.model_dir or tmp)
        if not (model_dir / "config.json").is_file():
            model_dir.mkdir(parents=True, exist_ok=True)
            n_params = build_model(model_dir)
            print(f"built model: {n_params / 1e6:.1f} M params in {time.time() - t_start:.0f}s", file=sys.stderr)
        results = {d: run_worker(d, model_dir, a, sizes) for d in dtypes}

    rows = report(results, sizes, dtypes, a.threads, a.repeats)
    print(f"total {time.time() - t_start:.0f}s")
    if a.json:
        Path(a.json).write_text(json.dumps({"sizes": sizes, "rows": rows, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
