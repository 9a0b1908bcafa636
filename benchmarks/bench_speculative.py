"""Speculative decoding with the MTP head: decode tokens/s for K = 0..4 drafts and the acceptance.

    python benchmarks/bench_speculative.py [--new-tokens 128] [--repeats 3] [--ks 0,1,2,3,4]
                                           [--rollback states,rerun] [--streams 1] [--json OUT]
                                           [--model default|wide] [--widen F,G] [--model-dir DIR]

Model: the embedded default (`hybridjax.default_model`, its trained MTP head), float32; or
(`--model wide`) the default widened by `benchmarks/widen_model.py` (hidden size x F, MLP x G,
default 4,4: 105 M params, the same function, so the same tokens and acceptance as the default,
but a decode step that streams 12x the weights), or any HF directory with an MTP head
(`--model-dir`). The default is so small that a decode step is overhead-bound (verifying K + 1
tokens costs much more than a plain step); the wide model is closer to a real one on CPU.
Prompts: a few Python-documentation questions in the default's chat template (what it was
trained on), greedy. For each K (K = 0: plain `generate`) and each rollback ("states": keep the
GDN state after every verified token and pick one; "rerun": keep the pre-verify cache and feed
the accepted tokens again):

  decode tok/s = generated tokens / (generate time - prefill time), where prefill time is the
  median of `generate(max_new_tokens=1)` with the same K (same prompt, same compiled program
  family); every shape is warmed up first (compilation excluded), then the Ks alternate round by
  round so load drift on the shared machine hits all alike; best of `--repeats` (the least disturbed).
  acceptance = accepted drafts / proposed drafts; tok/step = mean tokens per drafting step
  (1 + accepted drafts per step). Greedy tokens of every K are checked against K = 0's.
  "+adapt": adaptive mode (steps without drafts while the acceptance estimate is below
  `speculative.MIN_RATE[K]`, a probe every `PROBE_EVERY` steps); `--head random` gives a head
  whose drafts are (almost) never accepted: the worst case, and the cost of a drafting step.

Engine section (`--sections engine`): the serving engine (`Engine(speculative_tokens=K)`, 4
slots, no snapshot store) decoding `--streams` concurrent requests of `--new-tokens` each (no stop
tokens), K = 0 the plain engine. decode tok/s = tokens after each request's first /
(last token's time - first token's time, over all requests); a first round compiles what the
round runs (not timed), then the Ks alternate round by round; best of `--repeats`. acceptance
from the engine's counters; tokens of every K are checked against K = 0's. "fixed": every
step drafts (the engine's default); "adaptive": plain steps while drafting does not pay
(`scheduler.SpecPolicy`); "drafting" = the share of steps that drafted.

The machine is shared with other agents: compare figures of one run only, as ratios to K = 0;
each table prints the load average when it is printed. "cpu tok/s": the same count over the
process's CPU time (`time.process_time`, all its threads) instead of wall time: time this
process waits for a core while others run is not in it, so at a load of 6-8 on 2 cores it is far
steadier than wall time (measured: wall repeats of one K spread 1.1-8.5 s, CPU 1.05-1.08 s); it
still sees other processes' use of memory bandwidth and caches, and spinning threads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # widen_model

QUESTIONS = [
    "What does the os.path.join function do?",
    "How do I read a file line by line in Python?",
    "Explain the difference between a list and a tuple.",
    "What is a generator expression?",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", default="0,1,2,3,4")
    ap.add_argument("--rollback", default="states,rerun")
    ap.add_argument("--adaptive", choices=["off", "on", "both"], default="both",
                    help="fixed K every step, adaptive (plain steps while acceptance is low), or both")
    ap.add_argument("--streams", default="1", help="comma-separated batch sizes (rows decoded together)")
    ap.add_argument("--head", choices=["trained", "random"], default="trained",
                    help="the default's trained MTP head, or a random one (acceptance ~0: the worst case)")
    ap.add_argument("--sections", default="library,engine", help="library (generate), engine (the serving engine)")
    ap.add_argument("--model", choices=["default", "wide"], default="default",
                    help="the embedded default, or the default widened by benchmarks/widen_model.py (--widen)")
    ap.add_argument("--widen", default="4,4", help="F,G for --model wide: hidden size x F, MLP size x G")
    ap.add_argument("--model-dir", help="an HF model directory with an MTP head (overrides --model)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    rows = []
    if "library" in args.sections.split(","):
        rows += bench_library(args)
    if "engine" in args.sections.split(","):
        rows += bench_engine(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def loadavg() -> str:
    """The machine's load average (1, 5, 15 min), printed beside the figures (a shared machine)."""
    import os

    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def load(args):
    import atexit
    import os
    import shutil
    import tempfile

    import hybridjax
    from hybridjax.default_model import default_model
    from hybridjax.tokenizer import Tokenizer

    if args.model_dir or args.model == "wide":
        path = args.model_dir
        if not path:  # widening takes seconds: made afresh in a temporary directory
            import widen_model

            f, g = (int(x) for x in args.widen.split(","))
            tmp = tempfile.mkdtemp(prefix="bench_spec_")
            atexit.register(shutil.rmtree, tmp, ignore_errors=True)
            path = os.path.join(tmp, f"wide-{f}-{g}")
            widen_model.widen_dir(widen_model.DEFAULT_SRC, path, f, g)
        cfg, params = hybridjax.load(path, dtype="float32")
        tok = Tokenizer.from_dir(path, cfg.eos_token_id)
        args.model_name = f"{args.model_dir or 'widened default'} (hidden {cfg.hidden_size}, MLP {cfg.intermediate_size})"
    else:
        cfg, params, tok = default_model()
        args.model_name = "default model"
    if args.head == "random":
        from hybridjax.params import init_params

        params = params.replace(mtp=init_params(1, cfg, mtp=True).mtp)
    prompts = [tok.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    return cfg, params, tok, prompts


def bench_engine(args) -> list:
    import jax

    from hybridjax.engine import Engine, GenerationRequest

    cfg, params, tok, prompts_all = load(args)
    ks = [int(k) for k in args.ks.split(",")]
    print(f"\nengine: {args.model_name} ({sum(x.size for x in jax.tree_util.tree_leaves(params)) / 1e6:.1f} M params), "
          f"float32, 4 slots, {args.new_tokens} new tokens per stream, greedy, {args.head} MTP head; "
          "machine shared with other agents", flush=True)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.adaptive]
    configs = [(0, False)] + [(k, a) for a in modes for k in ks if k]
    engines = {(k, a): Engine(cfg, params, tok, store=None, slots=4, max_len=1024, speculative_tokens=k,
                              speculative_adaptive=a).start() for k, a in configs}
    rows = []
    try:
        for streams in [int(s) for s in args.streams.split(",")]:
            prompts = [prompts_all[i % len(prompts_all)] for i in range(streams)]

            def run(k):
                eng = engines[k]  # k: (K, adaptive)
                handles = [eng.submit(GenerationRequest(p, max_tokens=args.new_tokens)) for p in prompts]
                first, last, cpu0 = [], [], None
                for h in handles:
                    for i, _ in enumerate(h.events()):
                        if i == 0:
                            first.append(time.perf_counter())
                            cpu0 = time.process_time() if cpu0 is None else cpu0  # the first request's first token
                    last.append(time.perf_counter())
                tokens = sum(len(h.token_ids) - 1 for h in handles)
                return (tokens / (max(last) - min(first)), tokens / (time.process_time() - cpu0)), \
                    [h.token_ids for h in handles]

            results = {}
            for c in configs:  # compile what a round runs (not timed)
                _, toks = run(c)
                results[c] = dict(tok_s=[], cpu_tok_s=[], same_tokens=toks == results[configs[0]]["ref"] if results else True, ref=toks)
            counts = {c: dict(engines[c].counters) for c in configs}
            for _ in range(args.repeats):
                for c in configs:
                    wall, cpu = run(c)[0]
                    results[c]["tok_s"].append(wall)
                    results[c]["cpu_tok_s"].append(cpu)
            print(f"\nengine, streams={streams}, {loadavg()}")
            print(f"{'K':>2} {'mode':>8} {'decode tok/s':>12} {'vs K=0':>7} {'cpu tok/s':>9} {'vs K=0':>7} {'accept':>7} "
                  f"{'tok/step':>8} {'drafting':>8} {'same':>5}")
            base = cbase = None
            for (k, adaptive), r in results.items():
                c0, c1 = counts[(k, adaptive)], engines[(k, adaptive)].counters
                steps = c1["steps"] - c0.get("steps", 0)
                share = (c1["spec_verify_steps"] - c0.get("spec_verify_steps", 0)) / steps if steps else 0.0
                drafted = c1["spec_drafted_tokens"] - c0.get("spec_drafted_tokens", 0)
                accepted = c1["spec_accepted_tokens"] - c0.get("spec_accepted_tokens", 0)
                rate = accepted / drafted if drafted else float("nan")
                tps, ctps = max(r["tok_s"]), max(r["cpu_tok_s"])
                base, cbase = base or tps, cbase or ctps
                per_step = 1 + k * rate if k else 1.0
                mode = "-" if not k else "adaptive" if adaptive else "fixed"
                print(f"{k:>2} {mode:>8} {tps:>12.1f} {tps / base:>6.2f}x {ctps:>9.1f} {ctps / cbase:>6.2f}x {rate:>7.2f} "
                      f"{per_step:>8.2f} {share:>8.2f} {str(r['same_tokens']):>5}", flush=True)
                rows.append(dict(section="engine", k=k, mode=mode, streams=streams, decode_tok_s=tps, ratio=tps / base,
                                 cpu_tok_s=ctps, cpu_ratio=ctps / cbase,
                                 acceptance=rate, tokens_per_step=per_step, drafting_share=share,
                                 same_tokens=r["same_tokens"], load=loadavg()))
    finally:
        for eng in engines.values():
            eng.stop()
    return rows


def bench_library(args) -> list:

    import jax
    import numpy as np

    from hybridjax.generate import generate

    cfg, params, tok, prompts_all = load(args)
    ks = [int(k) for k in args.ks.split(",")]
    rollbacks = args.rollback.split(",")
    rows = []
    print(f"{args.model_name} ({sum(x.size for x in jax.tree_util.tree_leaves(params)) / 1e6:.1f} M params), float32, "
          f"{args.new_tokens} new tokens, greedy, {args.head} MTP head; machine shared with other agents", flush=True)
    for streams in [int(s) for s in args.streams.split(",")]:
        prompts = [prompts_all[i % len(prompts_all)] for i in range(streams)]
        modes = {"off": [False], "on": [True], "both": [False, True]}[args.adaptive]
        configs = [(0, "-")] + [(k, rb + ("+adapt" if a else "")) for a in modes for k in ks if k for rb in rollbacks
                                if not (a and rb == "rerun")]

        def run(k, rb, n):
            kw = dict(speculative_tokens=k, rollback=rb.split("+")[0], adaptive=rb.endswith("+adapt")) if k else {}
            # no stop tokens: every row makes exactly n tokens, so all Ks decode the same amount
            g = generate(params, cfg, prompts, max_new_tokens=n, max_len=1024, stop_ids=(), **kw)
            jax.block_until_ready(g.tokens)
            return g

        ref = None
        results = {}
        for k, rb in configs:  # warm up (compile) both shapes, check tokens
            run(k, rb, 1)
            g = run(k, rb, args.new_tokens)
            toks = g.token_lists()
            if k == 0:
                ref = toks
            same = toks == ref
            acc = (int(np.sum(g.accepted)), int(np.sum(g.drafted))) if k else (0, 0)
            results[(k, rb)] = dict(k=k, rollback=rb, streams=streams, same_tokens=same, accepted=acc[0], drafted=acc[1],
                                    full=[], prefill=[], cpu_full=[], cpu_prefill=[])
        for _ in range(args.repeats):  # best of the repeats: the least disturbed by other processes
            for k, rb in configs:
                for name, n in (("prefill", 1), ("full", args.new_tokens)):
                    t, c = time.perf_counter(), time.process_time()
                    run(k, rb, n)
                    results[(k, rb)][name].append(time.perf_counter() - t)
                    results[(k, rb)]["cpu_" + name].append(time.process_time() - c)
        base = cbase = None
        print(f"\nstreams={streams}, {loadavg()}")
        print(f"{'K':>2} {'rollback':>12} {'decode tok/s':>12} {'vs K=0':>7} {'cpu tok/s':>9} {'vs K=0':>7} {'accept':>7} "
              f"{'tok/step':>8} {'same':>5}")
        for (k, rb), r in results.items():
            dec = min(r["full"]) - min(r["prefill"])
            tps = streams * (args.new_tokens - 1) / dec
            ctps = streams * (args.new_tokens - 1) / (min(r["cpu_full"]) - min(r["cpu_prefill"]))
            base, cbase = base or tps, cbase or ctps
            rate = r["accepted"] / r["drafted"] if r["drafted"] else float("nan")
            per_step = 1 + k * rate if k else 1.0
            r.update(decode_tok_s=tps, ratio=tps / base, cpu_tok_s=ctps, cpu_ratio=ctps / cbase, acceptance=rate, tokens_per_step=per_step, load=loadavg())
            print(f"{k:>2} {rb:>12} {tps:>12.1f} {tps / base:>6.2f}x {ctps:>9.1f} {ctps / cbase:>6.2f}x {rate:>7.2f} "
                  f"{per_step:>8.2f} {str(r['same_tokens']):>5}", flush=True)
            rows.append({key: v for key, v in r.items() if key not in ("full", "prefill", "cpu_full", "cpu_prefill")})
    return rows


if __name__ == "__main__":
    sys.exit(main())
