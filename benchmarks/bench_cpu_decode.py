"""Batch-1 decode on CPU against its memory-bandwidth bound: float32, bfloat16 and int8 weights,
with and without the CPU kernel (hybridjax.cpu_kernels), optionally beside llama.cpp's tg128.

    python benchmarks/bench_cpu_decode.py [--quick] [--model-dir DIR] [--repeats 5]
        [--prompt 128] [--new-tokens 128] [--modes f32-xla,f32-kernel,bf16-kernel,bf16-packed]
        [--step-rounds 20] [--agree-prompts 4] [--prefill-tokens 512]
        [--llama-bench PATH --gguf F32.gguf --gguf BF16.gguf] [--json OUT]

One process, one model (the random Qwen3.5 of bench_generate.py: hidden 1024, 12 layers 3:1,
vocab 32000, untied head, 228 M params; built once into --model-dir if absent). It measures:

  bound    a one-row float32 matvec over an 8192 x 8192 weight (two copies, alternated, so
           nothing stays in cache) with XLA's dot: GB/s. The bound of a decode step is the
           bytes it must read (every weight once; one row of the embedding) / that bandwidth.
           The same matvec through the kernel, in float32 and bfloat16, is shown beside it.
  decode   tok/s of the library's `hybridjax.generate.generate` (prefill + lax.while_loop
           decode, greedy) as (N - 1) / (t(N new tokens) - t(1 new token)), per mode:
             f32-xla      float32 weights, XLA's dots (HYBRIDJAX_CPU_KERNELS=0)
             f32-kernel   float32 weights, the kernel for the few-row matmuls
             bf16-kernel  bfloat16 weights, the kernel
             bf16-packed  bfloat16 weights in `--pack-for-decode`'s layouts (cpu_kernels.
                          pack_params): the projections also kept as packed panels (twice the
                          weight memory; 3x where prefill widens: its copy is then float32),
                          the kernel streaming the panels; on avx512 without AVX512_BF16 only
                          prefill's float32 copy (WidenedWeight); where pack_params keeps
                          nothing (scalar), panels anyway
             int8-kernel  weight-only int8 projections (cpu_kernels.quantize_params of the
                          float32 weights: q int8 + a float32 scale per output column), the
                          kernel's int8 path; embeddings and norms float32
             int8-xla     the same weights, XLA's dots over q widened (opt in with --modes)
             int8-dot-kernel  int8 with a float16 scale per column per block of 32 k instead,
                          held only packed in quads of K (quantize_params(.., "int8-dot")): x
                          rounded to int8 per block of 32, integer dots (cpu_kernels.matmul_q8);
                          prefill dequantises the panels
             bf16-xla     bfloat16 weights, XLA's dots (very slow: opt in with --modes)
             *-kernel-1t  the kernel on one thread per call (what sharing columns buys)
             f32-transposed  float32 in `--pack-for-decode`'s layout (cpu_kernels.pack_params):
                          the projections held transposed, [N, K], on the paths of
                          TRANSPOSED_ISAS (AVX2, AVX-512); elsewhere the same as f32-kernel
             f32-kernel-rows4, f32-kernel-rows8  float32, the avx2 path's weight rows per pass
                          forced to 4 or 8 (f32-kernel: each weight shape's first calls time both;
                          other paths: the same as f32-kernel)
           Modes alternate round by round, so load drift hits all alike; medians are shown.
  steps    with --step-rounds R: single decode steps (the donating jitted step), modes
           interleaved 4 steps at a time for R rounds, the bound's matvec timed in the same
           rounds; ms/step at the 10th percentile and the median, each against the bound taken
           at the same percentile.
  prefill  with --prefill-tokens P: tok/s of the library's prefill (`hybridjax.generate.prefill`,
           batch 1, P tokens into a fresh cache), modes alternated round by round, medians; and
           the bytes each mode's params hold (all of them, and per projection weight).
  accuracy bfloat16 and int8 against float32 (all with the kernel; each with f32-kernel among the
           modes), over --agree-prompts prompts (default 4, random tokens, lengths P, P+1, ...),
           teacher-forced on float32's greedy tokens: max |logit diff| / max |logit|, the mean
           KL(float32 || other) of the next-token distributions (nats: the figure llama.cpp's
           `llama-perplexity --kl-divergence` prints for its quantised models), and how often the
           argmax differs (a near-tie flip), with the float32 top-1 / top-2 margins where it does;
           then free-running greedy: leading tokens equal, per prompt.
  llama    with --llama-bench and --gguf (repeatable; benchmarks/make_gguf.py makes them):
           `llama-bench -p 0 -n 128 -d 128 -t 2 -r 1` once per GGUF in every decode round, after
           our modes, so load drift hits both alike; the median over rounds (and their range).

The load average is printed before and after: on a shared machine figures are noisy, and the
ratios within one run are what to quote.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

MODES = {  # name -> (param dtype, use the kernel, kernel threads per call: 0 = XLA's pool)
    "f32-xla": ("float32", False, 0),
    "f32-kernel": ("float32", True, 0),
    "bf16-kernel": ("bfloat16", True, 0),
    "bf16-xla": ("bfloat16", False, 0),
    "f32-kernel-1t": ("float32", True, 1),
    # the avx2 path's weight rows per pass for float32 decode forced (f32-kernel measures both per shape)
    "f32-kernel-rows4": ("float32", True, 0),
    "f32-kernel-rows8": ("float32", True, 0),
    # float32 projections held transposed where pack_params does so (cpu_kernels.TRANSPOSED_ISAS)
    "f32-transposed": ("float32", True, 0),
    "bf16-kernel-1t": ("bfloat16", True, 1),
    # bfloat16 projections also kept as packed panels for decode (cpu_kernels.pack_params)
    "bf16-packed": ("bfloat16", True, 0),
    "bf16-packed-1t": ("bfloat16", True, 1),
    # float32 weights quantised to weight-only int8 (cpu_kernels.quantize_params)
    "int8-kernel": ("float32", True, 0),
    "int8-xla": ("float32", False, 0),
    "int8-kernel-1t": ("float32", True, 1),
    # int8 per column per block of 32 k, packed in quads of K, x rounded to int8 per block (int8-dot)
    "int8-dot-kernel": ("float32", True, 0),
    "int8-dot-kernel-1t": ("float32", True, 1),
}


def weights_of(name: str) -> str:
    """Which weights a mode reads: its dtype, "int8" or "int8-dot" (bytes per token differ)."""
    return "int8-dot" if name.startswith("int8-dot") else "int8" if name.startswith("int8") else MODES[name][0]


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def median_time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# --- the bound ------------------------------------------------------------------------------


def matvec_bandwidth(repeats: int, size: int) -> dict[str, float]:
    """GB/s of one-row matvecs over size x size weights: XLA float32, the kernel f32 / bf16."""
    import jax
    import jax.numpy as jnp

    from hybridjax import cpu_kernels

    rng = np.random.default_rng(0)
    wf = [jnp.asarray(rng.standard_normal((size, size), np.float32)) for _ in range(2)]
    x = jnp.asarray(rng.standard_normal((1, size), np.float32))
    cases = {"xla f32": (jax.jit(lambda x, w: jnp.dot(x, w)), wf)}
    if cpu_kernels.available():
        wb = [w.astype(jnp.bfloat16) for w in wf]
        cases["kernel f32"] = (jax.jit(lambda x, w: cpu_kernels.matmul(x, w)), wf)
        cases["kernel bf16"] = (jax.jit(lambda x, w: cpu_kernels.matmul(x, w)), wb)
    times = {k: [] for k in cases}
    for k, (f, ws) in cases.items():
        jax.block_until_ready(f(x, ws[0]))
    for r in range(repeats * 4):
        for k, (f, ws) in cases.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, ws[r % 2]))
            times[k].append(time.perf_counter() - t0)
    return {k: ws[0].nbytes / statistics.median(times[k]) / 1e9 for k, (f, ws) in cases.items()}


def bytes_per_token(params, cfg) -> int:
    """Every weight once, but only one row of the embedding (a gather) unless it is the head."""
    import jax

    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    if params.lm_head is not None:
        total -= params.embed.nbytes - params.embed.nbytes // cfg.vocab_size
    return total


# --- decode per mode ------------------------------------------------------------------------


class Mode:
    """generate() traced under one kernel setting: its own jit of generate's body, swapped in
    around each call (the kernel choice is made at trace time)."""

    pass_rows = None  # the avx2 float32 weight rows per pass set last (None: measured)

    def __init__(self, name, params, cfg, use_kernel, threads):
        import jax

        from hybridjax import generate as hg

        self.name, self.params, self.cfg, self.use_kernel, self.threads = name, params, cfg, use_kernel, threads
        self.hg = hg
        self.gen_jit = jax.jit(functools.partial(hg._generate.__wrapped__), static_argnames=("cfg", "out_len"))
        self.step_jit = jax.jit(functools.partial(hg._decode.__wrapped__ if hasattr(hg._decode, "__wrapped__")
                                                  else hg._decode), static_argnames="cfg")
        self.prefill_jit = jax.jit(hg._prefill, static_argnames="cfg")

    def patched(self):  # a context for tracing; bench_kernel_ab swaps the kernel's call in it
        import contextlib

        return contextlib.nullcontext()

    def _env(self):  # read when a function is first traced, so set before every call
        os.environ["HYBRIDJAX_CPU_KERNELS"] = "1" if self.use_kernel else "0"
        os.environ["HYBRIDJAX_CPU_THREADS"] = str(self.threads)
        pass_rows = {"f32-kernel-rows4": 4, "f32-kernel-rows8": 8}.get(self.name)
        if self.use_kernel and Mode.pass_rows != pass_rows:  # process-wide, read at each call
            from hybridjax import cpu_kernels

            cpu_kernels.set_avx2_pass_rows(pass_rows)  # None: measure again, shape by shape
            Mode.pass_rows = pass_rows

    def generate(self, prompt, n):
        import jax

        self._env()
        saved, self.hg._generate = self.hg._generate, self.gen_jit
        try:
            out = self.hg.generate(self.params, self.cfg, [prompt], max_new_tokens=n)
            jax.block_until_ready(out)
        finally:
            self.hg._generate = saved
        return out

    def prefill(self, tokens, cache):
        """Logits after a prompt of `tokens` [1, P] run into `cache` in one prefill call."""
        import jax
        import jax.numpy as jnp

        self._env()
        counts = jnp.asarray([tokens.shape[1]], jnp.int32)
        return jax.block_until_ready(self.prefill_jit(self.params, jnp.asarray(tokens), counts, cache, cfg=self.cfg))

    def forced_logits(self, prompt, tokens):
        """Logits after the prompt and after each of `tokens`, fed one by one: [len+1, vocab]."""
        import jax.numpy as jnp

        from hybridjax.cache import init_cache

        self._env()
        cache = init_cache(self.cfg, 1, len(prompt) + len(tokens) + 16, capacity=len(prompt) + len(tokens) + 16)
        logits, cache = self.hg.prefill(self.params, np.asarray([prompt], np.int32), cache, self.cfg)
        out = [np.asarray(logits[0])]
        active = jnp.ones((1,), bool)
        for t in tokens:
            logits, cache = self.step_jit(self.params, jnp.asarray([t], jnp.int32), active, cache, cfg=self.cfg)
            out.append(np.asarray(logits[0]))
        return np.stack(out)


def run_decode(a, modes: dict, prompt) -> tuple[dict, list[dict]]:
    """Our modes' decode, and llama-bench's (one repetition per GGUF) in the same rounds, so
    that load drift on a shared machine hits both alike."""
    n = a.new_tokens
    for m in modes.values():  # compile both lengths
        m.generate(prompt, n)
        m.generate(prompt, 1)
    times = {name: {"n": [], "one": []} for name in modes}
    threads = [int(t) for t in str(a.threads).split(",")]
    llama_runs = {(g, t): [] for g in (a.gguf if a.llama_bench else []) for t in threads}
    for r in range(a.repeats):
        for name, m in modes.items():
            times[name]["n"] += median_time(lambda: m.generate(prompt, n), 1)
            times[name]["one"] += median_time(lambda: m.generate(prompt, 1), 1)
        for (g, t), runs in llama_runs.items():
            runs.append(llama_bench(a.llama_bench, g, t, n, a.prompt))
        print(f"  round {r + 1}/{a.repeats} (load {loadavg()})", file=sys.stderr, flush=True)
    out = {}
    for name, t in times.items():
        per_token = (statistics.median(t["n"]) - statistics.median(t["one"])) / (n - 1)
        out[name] = {"s_per_token": per_token, "tok_s": 1 / per_token, "raw": t}
    llama = [{**runs[0], "tok_s": statistics.median(r["tok_s"] for r in runs),
              "rounds": [r["tok_s"] for r in runs]} for runs in llama_runs.values()]
    return out, llama


def prefill_times(modes: dict, tokens: int, rounds: int) -> dict:
    """tok/s of one prefill of `tokens` random tokens per mode, modes alternated for `rounds`
    rounds (a fresh cache each call, made outside the timing); the median and the range."""
    from hybridjax.cache import init_cache

    import bench_generate

    prompt = np.asarray([bench_generate.prompt_tokens(tokens)], np.int32)
    fresh = {name: (lambda m=m: init_cache(m.cfg, 1, tokens + 16, capacity=tokens + 16)) for name, m in modes.items()}
    for name, m in modes.items():  # compile
        m.prefill(prompt, fresh[name]())
    times = {name: [] for name in modes}
    for r in range(rounds):
        for name, m in modes.items():
            cache = fresh[name]()
            t0 = time.perf_counter()
            m.prefill(prompt, cache)
            times[name].append(time.perf_counter() - t0)
        print(f"  prefill round {r + 1}/{rounds} (load {loadavg()})", file=sys.stderr, flush=True)
    return {name: {"tok_s": tokens / statistics.median(t), "tok_s_range": [tokens / max(t), tokens / min(t)],
                   "raw": t} for name, t in times.items()}


def bytes_held(params) -> dict:
    """Bytes the params hold: all of them, and per weight of the 2-d projections `dense` reads
    (cpu_kernels.DENSE_WEIGHTS: an Int8Weight's every array, against its K x N weights)."""
    import jax

    from hybridjax import cpu_kernels

    held, weights = 0, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=cpu_kernels.is_weight_layout):
        name = getattr(path[-1], "name", None)
        if name in cpu_kernels.DENSE_WEIGHTS and len(leaf.shape) == 2:
            held += sum(x.nbytes for x in jax.tree_util.tree_leaves(leaf))
            weights += leaf.shape[0] * leaf.shape[1]
    return {"total": sum(x.nbytes for x in jax.tree_util.tree_leaves(params)),
            "projection_bytes_per_weight": held / max(weights, 1)}


def step_times(modes: dict, prompt, rounds: int, steps: int, bound_size: int) -> dict:
    """Single decode steps (the donating jitted step, batch 1, after the prompt), modes interleaved
    `steps` at a time for `rounds` rounds, with the bound's one-row float32 matvec (XLA, two
    bound_size^2 weights alternated) timed in the same rounds. Returns seconds per call, all of
    them. Each step ends in a host sync (argmax, block_until_ready), which `generate`'s
    while_loop does not have: on a loaded machine every sync waits for the scheduler, a fixed
    cost per step that shrinks the bf16 / f32 ratio; `generate`'s figures are the decode speed."""
    import jax
    import jax.numpy as jnp

    from hybridjax.cache import init_cache

    state = {}
    for name, m in modes.items():
        m._env()
        step = jax.jit(functools.partial(m.hg._decode.__wrapped__ if hasattr(m.hg._decode, "__wrapped__")
                                         else m.hg._decode, cfg=m.cfg), donate_argnames="cache")
        with m.patched():
            cache = init_cache(m.cfg, 1, len(prompt) + rounds * steps + 16, capacity=len(prompt) + rounds * steps + 16)
            logits, cache = m.hg.prefill(m.params, np.asarray([prompt], np.int32), cache, m.cfg)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            logits, cache = step(m.params, tok, jnp.ones((1,), bool), cache)  # compiles under this mode
        state[name] = [step, jnp.argmax(logits, -1).astype(jnp.int32), cache]
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((bound_size, bound_size), np.float32)) for _ in range(2)]
    xv = jnp.asarray(rng.standard_normal((1, bound_size), np.float32))
    mv = jax.jit(lambda x, w: jnp.dot(x, w))
    jax.block_until_ready(mv(xv, ws[0]))
    out = {name: [] for name in modes}
    out["bound matvec"] = []
    active = jnp.ones((1,), bool)
    for r in range(rounds):
        for name, m in modes.items():
            step, tok, cache = state[name]
            m._env()
            for _ in range(steps):
                t0 = time.perf_counter()
                logits, cache = step(m.params, tok, active, cache)
                tok = jnp.argmax(logits, -1).astype(jnp.int32)
                jax.block_until_ready(tok)
                out[name].append(time.perf_counter() - t0)
            state[name][1:] = [tok, cache]
            t0 = time.perf_counter()
            jax.block_until_ready(mv(xv, ws[r % 2]))
            out["bound matvec"].append(time.perf_counter() - t0)
    out["bound_bytes"] = ws[0].nbytes
    return out


def accuracy_over_prompts(f32: Mode, other: Mode, prompts, n: int) -> dict:
    """`accuracy` for each prompt, pooled: flips over all teacher-forced steps, the worst error."""
    per = [accuracy(f32, other, p, n) for p in prompts]
    margins = [m for r in per for m in r["flip_margins"]]
    return {
        "prompts": len(per), "steps": sum(r["steps"] for r in per), "flips": sum(r["flips"] for r in per),
        "flip_margins": sorted(margins), "max_rel_err": max(r["max_rel_err"] for r in per),
        "median_rel_err": float(np.median([r["median_rel_err"] for r in per])),
        "max_abs_err": max(r["max_abs_err"] for r in per), "logit_range": max(r["logit_range"] for r in per),
        "median_margin": float(np.median([r["median_margin"] for r in per])),
        "mean_kl": float(np.mean([r["mean_kl"] for r in per])), "max_kl": max(r["max_kl"] for r in per),
        "free_running_equal_prefix": [r["free_running_equal_prefix"] for r in per], "n": n, "per_prompt": per,
    }


def accuracy(f32: Mode, other: Mode, prompt, n: int) -> dict:
    ref_tokens = f32.generate(prompt, n).token_lists()[0]
    bf_tokens = other.generate(prompt, n).token_lists()[0]
    lf = f32.forced_logits(prompt, ref_tokens[:-1])
    lb = other.forced_logits(prompt, ref_tokens[:-1])
    lpf = lf - np.logaddexp.reduce(lf, axis=-1, keepdims=True)  # log-softmax, float64 below
    lpb = lb - np.logaddexp.reduce(lb, axis=-1, keepdims=True)
    kl = (np.exp(lpf.astype(np.float64)) * (lpf.astype(np.float64) - lpb)).sum(-1)
    top2 = np.sort(lf, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    flips = np.nonzero(lf.argmax(-1) != lb.argmax(-1))[0]
    err = np.abs(lf - lb).max(-1) / np.abs(lf).max(-1)
    lead = next((i for i, (x, y) in enumerate(zip(ref_tokens, bf_tokens)) if x != y), min(len(ref_tokens), len(bf_tokens)))
    return {
        "max_rel_err": float(err.max()), "median_rel_err": float(np.median(err)),
        "max_abs_err": float(np.abs(lf - lb).max()), "logit_range": float(np.abs(lf).max()),
        "steps": len(lf), "flips": len(flips), "flip_margins": margin[flips].tolist(),
        "median_margin": float(np.median(margin)), "free_running_equal_prefix": lead, "n": n,
        "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
    }


def print_step_table(steps: dict, wbytes: dict, f32_bytes: int) -> None:
    """Per-step figures at the 10th percentile of time (fast: both cores ours) and the median;
    the bound's matvec the same way (its 10th percentile of time: its 90th of bandwidth)."""
    bw = {q: steps["bound_bytes"] / np.percentile(steps["bound matvec"], q) / 1e9 for q in (10, 50)}
    bound = {q: bw[q] * 1e9 / f32_bytes for q in (10, 50)}
    modes = [k for k in steps if k not in ("bound matvec", "bound_bytes")]
    rounds = len(steps["bound matvec"]) // max(len(modes), 1)
    print(f"\nsingle decode steps, modes interleaved ({rounds} rounds of 4 steps per mode; the bound's float32 "
          f"matvec timed once per mode per round): XLA matvec {bw[10]:.1f} GB/s (p10 of time), "
          f"{bw[50]:.1f} GB/s (median): bound {bound[10]:.1f} / {bound[50]:.1f} tok/s\n")
    print("| mode | ms/step p10 | ms/step median | tok/s p10 | x bound (p10 / p10) | x bound (median / median) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, t in steps.items():
        if name in ("bound matvec", "bound_bytes"):
            continue
        p10, p50 = np.percentile(t, 10), np.percentile(t, 50)
        print(f"| {name} | {1e3 * p10:.2f} | {1e3 * p50:.2f} | {1 / p10:.1f} | {1 / p10 / bound[10]:.2f} | "
              f"{1 / p50 / bound[50]:.2f} |")


# --- llama.cpp ------------------------------------------------------------------------------


def print_round_ratios(dec: dict, llama: list[dict], n: int) -> None:
    """Our tok/s over llama.cpp's, round by round (each round runs both, so a slow or fast spell
    of the shared machine hits the pair alike): median and range per (mode, GGUF)."""
    print("\nper-round ratio, our mode / llama.cpp (median [min-max] over rounds):\n")
    print("| mode | " + " | ".join(f"{Path(r['gguf']).name} -t {r['threads']}" for r in llama) + " |")
    print("|---|" + "---:|" * len(llama))
    for name, d in dec.items():
        ours = [(n - 1) / (t_n - t_1) for t_n, t_1 in zip(d["raw"]["n"], d["raw"]["one"])]
        cells = []
        for r in llama:
            q = [a / b for a, b in zip(ours, r["rounds"])]
            cells.append(f"{statistics.median(q):.2f}x [{min(q):.2f}-{max(q):.2f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")



def llama_bench(binary: str, gguf: str, threads: int, n: int, depth: int) -> dict:
    """tg<n> after a <depth>-token context (-d), as our decode runs after the prompt; one
    repetition (run_decode calls it once per round)."""
    cmd = [binary, "-m", gguf, "-p", "0", "-n", str(n), "-d", str(depth), "-t", str(threads), "-r", "1", "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(res.stdout)
    row = next(r for r in rows if r.get("n_gen") == n)
    return {"gguf": gguf, "threads": threads, "model_type": row.get("model_type", ""),
            "tok_s": row["avg_ts"], "stdev": row.get("stddev_ts", 0.0), "cmd": " ".join(cmd)}


# --- main -----------------------------------------------------------------------------------


def kernel_path(cpu_kernels) -> str:
    """The kernel's path as the calls take it, and the CPU's best when HYBRIDJAX_CPU_ISA caps it."""
    if not cpu_kernels.available():
        return "unavailable"
    isa, best = cpu_kernels.isa(), cpu_kernels.best_isa()
    return isa if isa == best else f"{isa}, capped by HYBRIDJAX_CPU_ISA on a CPU whose best is {best}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 new tokens after 32, 2 rounds, 4096^2 matvec")
    ap.add_argument("--model-dir", default=None, help="reuse / keep the HF model here (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--modes", default="f32-xla,f32-kernel,bf16-kernel,bf16-packed")
    ap.add_argument("--agree-prompts", type=int, default=4, help="prompts for the bf16 / int8 vs f32 agreement")
    ap.add_argument("--step-rounds", type=int, default=0,
                    help="also time single decode steps, modes interleaved, this many rounds of 4 steps each")
    ap.add_argument("--prefill-tokens", type=int, default=0,
                    help="also time a prefill of this many tokens per mode, modes alternated, --repeats rounds")
    ap.add_argument("--llama-bench", help="path of llama.cpp's llama-bench")
    ap.add_argument("--gguf", action="append", default=[], help="GGUF of the same weights (repeatable)")
    ap.add_argument("--threads", default="2", help="llama-bench threads; a comma list (2,1) runs each per round")
    ap.add_argument("--json", help="also write every figure here")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompt, a.new_tokens, a.repeats = 32, 32, 2
    modes_wanted = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes_wanted if m not in MODES]
    if bad or a.new_tokens < 2 or (a.llama_bench and not a.gguf):
        print(f"error: modes from {list(MODES)} (got {bad}); --new-tokens >= 2; --gguf with --llama-bench",
              file=sys.stderr)
        return 2

    import tempfile

    import jax

    import bench_generate
    import hybridjax
    from hybridjax import cpu_kernels

    load0 = loadavg()
    tmp = tempfile.TemporaryDirectory(prefix="bench_cpu_decode_")
    model_dir = Path(a.model_dir or tmp.name)
    if not (model_dir / "config.json").is_file():
        model_dir.mkdir(parents=True, exist_ok=True)
        print(f"building the model in {model_dir} ...", file=sys.stderr, flush=True)
        bench_generate.build_model(model_dir)
    if any(MODES[m][1] for m in modes_wanted) and not cpu_kernels.available():
        print(f"error: {cpu_kernels.load_error()}", file=sys.stderr)
        return 1

    print(f"matvec bandwidth (load {loadavg()}) ...", file=sys.stderr, flush=True)
    bw = matvec_bandwidth(a.repeats, 4096 if a.quick else 8192)

    loaded = {}
    modes = {}
    for name in modes_wanted:
        dtype, use_kernel, threads = MODES[name]
        if dtype not in loaded:
            loaded[dtype] = hybridjax.load_hf(model_dir, dtype=dtype)
            jax.block_until_ready(loaded[dtype][1])
        if weights_of(name) in ("int8", "int8-dot") and weights_of(name) not in loaded:
            c, p = loaded[dtype]
            layout = "int8-wo" if weights_of(name) == "int8" else "int8-dot"
            loaded[weights_of(name)] = (c, jax.block_until_ready(cpu_kernels.quantize_params(p, layout)))
        cfg, params = loaded[weights_of(name)]
        if name == "f32-transposed":
            params = jax.block_until_ready(cpu_kernels.pack_params(params))
        if name.endswith("-packed") or name.endswith("-packed-1t"):
            kept = cpu_kernels.pack_params(params)  # what --pack-for-decode keeps on this path
            params = jax.block_until_ready(cpu_kernels.pack_params(params, force=True) if kept is params else kept)
        modes[name] = Mode(name, params, cfg, use_kernel, threads)
    prompt = bench_generate.prompt_tokens(a.prompt).tolist()
    print(f"decode, {len(modes)} modes x {a.repeats} rounds ...", file=sys.stderr, flush=True)
    dec, llama = run_decode(a, modes, prompt)
    steps = step_times(modes, prompt, a.step_rounds, 4, 4096 if a.quick else 8192) if a.step_rounds else None
    pre = prefill_times(modes, a.prefill_tokens, a.repeats) if a.prefill_tokens else None
    acc = {}
    prompts = [prompt] + [bench_generate.prompt_tokens(a.prompt + i).tolist() for i in range(1, a.agree_prompts)]
    for other in ("bf16-kernel", "int8-kernel", "int8-dot-kernel"):
        if "f32-kernel" in modes and other in modes:
            print(f"{other} vs f32-kernel agreement over {len(prompts)} prompts ...", file=sys.stderr, flush=True)
            acc[other] = accuracy_over_prompts(modes["f32-kernel"], modes[other], prompts, a.new_tokens)
    load1 = loadavg()

    cfg = next(iter(loaded.values()))[0]
    wbytes = {d: bytes_per_token(p, c) for d, (c, p) in loaded.items()}
    bound_bw = bw["xla f32"]
    f32_bytes = wbytes.get("float32") or 2 * wbytes["bfloat16"]
    bound_tok_s = bound_bw * 1e9 / f32_bytes
    print(f"\nhybridjax decode on CPU (jax {jax.__version__}, {os.cpu_count()} cores, kernel path "
          f"{kernel_path(cpu_kernels)}); batch 1, "
          f"{a.new_tokens} greedy tokens after a {a.prompt}-token prompt, median of {a.repeats}; "
          f"load average {load0} -> {load1}\n")
    print("one-row matvec, " + ", ".join(f"{k}: {v:.1f} GB/s" for k, v in bw.items()))
    print(f"bytes read per token: float32 {f32_bytes / 1e6:.1f} MB"
          + (f", bfloat16 {wbytes['bfloat16'] / 1e6:.1f} MB" if "bfloat16" in wbytes else "")
          + (f", int8 {wbytes['int8'] / 1e6:.1f} MB" if "int8" in wbytes else "")
          + (f", int8-dot {wbytes['int8-dot'] / 1e6:.1f} MB" if "int8-dot" in wbytes else ""))
    print(f"bound (float32 bytes / XLA float32 matvec bandwidth): {bound_tok_s:.1f} tok/s "
          f"({1e3 / bound_tok_s:.2f} ms/token)\n")
    print("| mode | tok/s | ms/token | GB/s read | x bound (f32 tok/s) | x f32-xla |")
    print("|---|---:|---:|---:|---:|---:|")
    base = dec.get("f32-xla", {}).get("tok_s")
    for name, d in dec.items():
        wb = wbytes[weights_of(name)]
        rel = f"{d['tok_s'] / base:.2f}x" if base else "-"
        print(f"| {name} | {d['tok_s']:.1f} | {1e3 * d['s_per_token']:.2f} | {wb * d['tok_s'] / 1e9:.1f} | "
              f"{d['tok_s'] / bound_tok_s:.2f} | {rel} |")
    for r in llama:
        rel = f"{r['tok_s'] / base:.2f}x" if base else "-"
        print(f"| llama.cpp {Path(r['gguf']).name} -t {r['threads']} | {r['tok_s']:.1f} (rounds {min(r['rounds']):.1f}-{max(r['rounds']):.1f}) | "
              f"{1e3 / r['tok_s']:.2f} | - | {r['tok_s'] / bound_tok_s:.2f} | {rel} |")
    if llama:
        print_round_ratios(dec, llama, a.new_tokens)
    if steps:
        print_step_table(steps, wbytes, f32_bytes)
    if pre:
        held = {name: bytes_held(m.params) for name, m in modes.items()}
        first = next(iter(pre))
        base = pre[first]["tok_s"]
        print(f"\nprefill of {a.prefill_tokens} tokens (batch 1, median of {a.repeats} rounds, modes alternated), "
              f"and the bytes the params hold\n")
        print(f"| mode | prefill tok/s | rounds | x {first} | x {first}, per round: median [min-max] | params MB | "
              "bytes per projection weight |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, d in pre.items():
            lo, hi = d["tok_s_range"]
            # Same-round ratios: a slow spell of the machine slows the round's modes alike.
            ratios = [t0 / t for t0, t in zip(pre[first]["raw"], d["raw"])]
            print(f"| {name} | {d['tok_s']:.1f} | {lo:.1f}-{hi:.1f} | {d['tok_s'] / base:.2f}x | "
                  f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] | "
                  f"{held[name]['total'] / 1e6:.1f} | {held[name]['projection_bytes_per_weight']:.3f} |")
    for other, acc_ in acc.items():
        print(f"\n{other} vs f32-kernel logits (teacher-forced on float32's greedy tokens, {acc_['prompts']} "
              f"prompts, {acc_['steps']} steps): max |diff| {acc_['max_abs_err']:.3f} of max |logit| "
              f"{acc_['logit_range']:.2f} (rel {acc_['max_rel_err']:.4f}, median rel {acc_['median_rel_err']:.4f}); "
              f"KL(f32 || {other}) mean {acc_['mean_kl']:.2e} max {acc_['max_kl']:.2e} nats; "
              f"argmax differs at {acc_['flips']}/{acc_['steps']} steps, float32 top-1/top-2 margins there: "
              f"{', '.join(f'{m:.3f}' for m in acc_['flip_margins']) or '-'} (median margin {acc_['median_margin']:.3f}); "
              f"free-running greedy, leading tokens equal per prompt: "
              f"{', '.join(str(x) for x in acc_['free_running_equal_prefix'])} of {acc_['n']}")
    if max(os.getloadavg()) > (os.cpu_count() or 1):
        print("WARNING: the load average exceeded the core count: other processes shared the CPU; "
              "re-run on an idle machine before quoting absolute figures.")
    if a.json:
        Path(a.json).write_text(json.dumps({"bandwidth": bw, "bytes": wbytes, "bound_tok_s": bound_tok_s,
                                            "decode": dec, "prefill": pre, "accuracy": acc, "llama": llama, "steps": steps,
                                            "load": [load0, load1]}, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
