"""Serving, measured as a user meets it: `hybridjax serve` in a subprocess, driven over HTTP.

    python benchmarks/bench_multiturn.py [--quick] [--baseline PATH] [--sections a,b,...] [--json OUT]

One run builds a random Qwen3.5-shaped model (float32; hidden 1024, 12 layers, 3 linear : 1
full attention, 8 q / 2 kv heads of 128, linear heads 8 k / 16 v of 64, intermediate 3072, vocab
32000, untied: 0.23 B parameters; --quick: 4 layers), saves it as a converted checkpoint with a
32000-token word-level tokenizer, and measures, with streaming /v1/completions requests whose
prompts are token ids (greedy, so every server gives the same tokens):

  startup   seconds from launching `hybridjax serve` to /health answering 200 (the covering
            programs exist, the rest compile behind), with an empty compilation cache directory
            and again with it warm (executables loaded); benchmarks/bench_startup.py says more.
  kinds     time to first token (TTFT) of each kind of request, the first time after start and a
            later time (each time on other random tokens): cold 1500-token prompt; turn 2 (the
            1500-token prompt + its 64-token response + 50 new tokens); exact repeat of a prompt;
            edits at token 700 and 1200 of a 1500-token prompt; cold 3000-token prompt. Ratios:
            cold / kind, from the later times. Default flags (4 slots, checkpoints every 256).
  store     bytes the snapshot store holds after a 3000-token prompt (64 tokens of response) and a
            second turn, against one KV copy of the longest sequence + each snapshot's own state
            (recurrent state and logits), from /metrics.
  gap       a stream decodes while a 4000-token prompt arrives: the longest gap between the
            stream's tokens during that prompt's prefill, against the prefill's time (its TTFT).
  decode    tokens/s of one stream (32-token prompt, 128 greedy tokens) through servers with 1, 4
            and 8 slots, beside `hybridjax.generate.generate` (one jitted call, in this process,
            timed the same way); aggregate tokens/s of 4 streams (4 slots) and 8 streams (8 slots);
            and the matmul bound: ideal(n) = generate's tok/s * n * t_mm(1) / t_mm(n), where t_mm(n)
            is one decode step's matmuls (every projection and the lm_head, float32) at n rows.

With --baseline PATH (a checkout of an earlier hybridjax, e.g. `git worktree add /tmp/base <rev>`)
the kinds, gap and decode sections also run against that code's server (its flags permitting), in
the same run, for a side-by-side. Servers run one at a time; the client (this process) only reads
sockets while they run. Other jobs on the machine add noise: the load average is printed at the
start and the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

MODEL = {
    "model_type": "qwen3_5_text", "vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 12,
    "full_attention_interval": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "intermediate_size": 3072,
    "max_position_embeddings": 16384, "tie_word_embeddings": False, "eos_token_id": 31999,
}
SEED = 0
DECODE_PROMPT, DECODE_TOKENS = 32, 128


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --- the model on disk ------------------------------------------------------------------


def build_model_dir(root: Path, layers: int) -> Path:
    """A converted checkpoint of the random model, with a tokenizer that decodes every id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hybridjax.conversion.checkpoint import save_checkpoint
    from hybridjax.config import config_from_dict
    from hybridjax.params import init_params

    spec = {**MODEL, "num_hidden_layers": layers}
    src = root / "src"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(spec))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(MODEL["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(src / "tokenizer.json"))
    cfg = config_from_dict(spec)
    return save_checkpoint(init_params(SEED, cfg), root / "model", config_dir=src)


# --- a server in a subprocess -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`hybridjax serve` from `code` (a checkout), on a free port; `startup` = launch to /health 200."""

    def __init__(self, code: Path, model: Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(code)}
        cmd = [sys.executable, "-m", "hybridjax.cli", "serve", "--model", str(model), "--port", str(self.port), *flags]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {' '.join(cmd)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        self.startup = time.perf_counter() - t0
        # One keep-alive client, as real clients hold one: building an httpx.Client costs 50-130 ms
        # here (its SSL context), which a per-request client would add to every time to first token.
        self.client = httpx.Client(timeout=3600)

    def stop(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def metric(self, name: str) -> float:
        for line in self.client.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stream(self, prompt: list[int], max_tokens: int, on_token=None) -> dict:
        """Stream a completion; returns ttft, token times (from the send), tokens (by text)."""
        body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        times, texts = [], []
        with self.client.stream("POST", self.url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                text = chunk["choices"][0]["text"] if chunk.get("choices") else ""
                if text:
                    times.append(time.perf_counter() - t0)
                    texts.append(text)
                    if on_token:
                        on_token(times[-1])
        return {"ttft": times[0] if times else None, "times": times, "tokens": [int(w[1:]) for t in texts for w in t.split()]}


# --- sections -------------------------------------------------------------------------------


def rand_tokens(rng, n: int) -> list[int]:
    return rng.integers(0, MODEL["vocab_size"] - 1, n).tolist()  # never the eos id


def kinds(srv: Server, rng) -> dict:
    """TTFT per kind of request, first time and later time."""
    out = {}
    for when in ("first", "later"):
        p = rand_tokens(rng, 1500)
        r = {"cold 1500": srv.stream(p, 64)}
        response = r["cold 1500"]["tokens"]
        r["exact repeat"] = srv.stream(p, 1)  # before turn 2, whose prompt supersedes p's snapshot
        r["turn 2 (+50)"] = srv.stream(p + response + rand_tokens(rng, 50), 1)
        for at in (700, 1200):
            edited = list(p)
            edited[at] = (edited[at] + 1) % (MODEL["vocab_size"] - 1)
            r[f"edit at {at}"] = srv.stream(edited, 1)
        r["cold 3000"] = srv.stream(rand_tokens(rng, 3000), 1)
        for kind, res in r.items():
            out.setdefault(kind, {})[when] = res["ttft"]
        log(f"kinds ({when}): " + ", ".join(f"{k} {v['ttft']:.3f}s" for k, v in r.items()))
    return out


def store_bytes(srv: Server, rng, kv_token_bytes: int, state_bytes: int) -> dict:
    p = rand_tokens(rng, 3000)
    first = srv.stream(p, 64)
    srv.stream(p + first["tokens"] + rand_tokens(rng, 50), 64)
    held = srv.metric("hybridjax_prefix_cache_bytes")
    entries = srv.metric("hybridjax_prefix_cache_entries")
    longest = 3000 + 64 + 50 + 64
    ideal = longest * kv_token_bytes + entries * state_bytes
    return {"bytes": held, "entries": entries, "one_kv_copy_plus_states": ideal, "ratio": held / ideal}


def gap(srv: Server, rng) -> dict:
    """The longest gap of a running stream while a 4000-token prompt is prefilled."""
    stream_times, long_res = [], {}
    started = threading.Event()

    def on_token(t):
        stream_times.append(time.perf_counter())
        if len(stream_times) >= 5:
            started.set()

    th = threading.Thread(target=lambda: srv.stream(rand_tokens(rng, 32), 800, on_token))
    th.start()
    started.wait(600)
    t_send = time.perf_counter()
    long_res.update(srv.stream(rand_tokens(rng, 4000), 1))
    t_first = t_send + long_res["ttft"]
    th.join()
    during = [t for t in stream_times if t_send <= t <= t_first]
    edges = [t_send] + during + [t_first]
    longest = max(b - a for a, b in zip(edges, edges[1:]))
    return {"long_prefill_s": long_res["ttft"], "longest_gap_s": longest, "ratio": longest / long_res["ttft"],
            "stream_tokens_during": len(during)}


def decode_rate(res: dict) -> float:
    t = res["times"]
    return (len(t) - 1) / (t[-1] - t[0])


def aggregate(srv: Server, rng, n: int) -> float:
    results = [None] * n
    ths = [threading.Thread(target=lambda i=i: results.__setitem__(i, srv.stream(rand_tokens(rng, DECODE_PROMPT), DECODE_TOKENS)))
           for i in range(n)]
    t0 = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    starts = [t0 + r["times"][0] for r in results]
    ends = [t0 + r["times"][-1] for r in results]
    return sum(len(r["times"]) - 1 for r in results) / (max(ends) - min(starts))


def generate_rate(cfg, params) -> float:
    """`generate`'s decode tok/s: (128 - 1) tokens over the difference of two whole calls."""
    from hybridjax.generate import generate

    prompt = [list(range(1, DECODE_PROMPT + 1))]

    def timed(n):
        generate(params, cfg, prompt, max_new_tokens=n, max_len=256)  # compile
        t = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(generate(params, cfg, prompt, max_new_tokens=n, max_len=256).tokens)
            t.append(time.perf_counter() - t0)
        return min(t)

    return (DECODE_TOKENS - 1) / (timed(DECODE_TOKENS) - timed(1))


def matmul_step(cfg, params, n: int) -> float:
    """Seconds for one decode step's matmuls (every 2-D weight, chained x @ W) at n rows."""
    weights = [w for w in jax.tree_util.tree_leaves(params) if w.ndim == 2 and w is not params.embed]

    @jax.jit
    def step(x, ws):
        acc = 0.0
        for w in ws:
            acc = acc + jnp.sum(jnp.dot(x[:, : w.shape[0]], w, preferred_element_type=jnp.float32))
        return acc

    x = jnp.ones((n, max(w.shape[0] for w in weights)), jnp.float32)
    step(x, weights).block_until_ready()
    t = []
    for _ in range(7):
        t0 = time.perf_counter()
        step(x, weights).block_until_ready()
        t.append(time.perf_counter() - t0)
    return statistics.median(t)


# --- main -------------------------------------------------------------------------------------


def new_flags(cache_dir: str, **kw) -> list[str]:
    return ["--compile-cache-dir", cache_dir] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]


def run_code(name: str, code: Path, model: Path, sections: set, cache_dir: str | None, rng_seed: int, res: dict) -> None:
    """Every section but startup against one checkout's server."""
    flags = (lambda **kw: new_flags(cache_dir, **kw)) if cache_dir else (lambda **kw: [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])
    rng = np.random.default_rng(rng_seed)
    r = res.setdefault(name, {})
    if "kinds" in sections:
        srv = Server(code, model, *flags())
        try:
            r["kinds"] = kinds(srv, rng)
        finally:
            srv.stop()
    if "gap" in sections:
        srv = Server(code, model, *flags())
        try:
            srv.stream(rand_tokens(rng, 4000), 1)  # compile what this code compiles lazily
            r["gap"] = gap(srv, rng)
            log(f"{name} gap: {r['gap']}")
        finally:
            srv.stop()
    if "decode" in sections:
        r["decode"] = {}
        for slots in (1, 4, 8):
            srv = Server(code, model, *flags(slots=slots))
            try:
                srv.stream(rand_tokens(rng, DECODE_PROMPT), DECODE_TOKENS)  # warm
                one = statistics.median(decode_rate(srv.stream(rand_tokens(rng, DECODE_PROMPT), DECODE_TOKENS))
                                        for _ in range(3))
                r["decode"][f"1 stream, {slots} slots"] = one
                if slots > 1:
                    aggregate(srv, rng, slots)  # warm the batch shapes
                    r["decode"][f"{slots} streams, {slots} slots"] = aggregate(srv, rng, slots)
            finally:
                srv.stop()
        log(f"{name} decode: {r['decode']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 layers instead of 12")
    ap.add_argument("--baseline", type=Path, help="a checkout of earlier code to run beside")
    ap.add_argument("--sections", default="startup,kinds,store,gap,decode")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    layers = 4 if args.quick else 12
    log(f"load average at start: {load()}")
    res: dict = {"load_start": load()}
    from hybridjax.config import config_from_dict
    from hybridjax.params import init_params

    cfg = config_from_dict({**MODEL, "num_hidden_layers": layers})
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_dir(Path(tmp), layers)
        cache_dir = str(Path(tmp) / "jax-cache")
        if "startup" in sections:
            cold = Server(ROOT, model, *new_flags(cache_dir))
            cold.stop()
            warm = Server(ROOT, model, *new_flags(cache_dir))
            warm.stop()
            res["startup"] = {"cold compile cache": cold.startup, "warm compile cache": warm.startup}
            log(f"startup: {res['startup']}")
        run_code("hybridjax", ROOT, model, sections, cache_dir, SEED, res)
        if "store" in sections:
            srv = Server(ROOT, model, *new_flags(cache_dir))
            try:
                kv_token = 2 * sum(t == "full_attention" for t in cfg.layer_types) * cfg.num_key_value_heads * cfg.head_dim * 4
                gdn = sum(t != "full_attention" for t in cfg.layer_types) * (
                    cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
                    + (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim) * 4
                res["hybridjax"]["store"] = store_bytes(srv, np.random.default_rng(SEED + 1), kv_token, gdn + cfg.vocab_size * 4)
                log(f"store: {res['hybridjax']['store']}")
            finally:
                srv.stop()
        if args.baseline:
            run_code("baseline", args.baseline.resolve(), model, sections - {"store"}, None, SEED, res)
        if "decode" in sections:
            params = init_params(SEED, cfg)
            res["generate tok/s"] = generate_rate(cfg, params)
            t1 = matmul_step(cfg, params, 1)
            res["matmul bound"] = {n: res["generate tok/s"] * n * t1 / matmul_step(cfg, params, n) for n in (1, 4, 8)}
    res["load_end"] = load()
    log(f"load average at end: {load()}")
    report(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


def report(res: dict) -> None:
    print(f"\nload average: start {res['load_start']}, end {res['load_end']}")
    if "startup" in res:
        print("\n| start-up (launch to /health 200) | seconds |\n|---|---:|")
        for k, v in res["startup"].items():
            print(f"| {k} | {v:.1f} |")
    names = [n for n in ("hybridjax", "baseline") if n in res]
    if any("kinds" in res[n] for n in names):
        print("\n| kind | " + " | ".join(f"{n} first | {n} later | {n} cold/kind" for n in names) + " |")
        print("|---|" + "---:|---:|---:|" * len(names))
        for kind in res["hybridjax"]["kinds"]:
            cells = []
            for n in names:
                k = res[n]["kinds"][kind]
                cold = res[n]["kinds"]["cold 1500"]["later"]
                cells.append(f"{k['first']:.3f} s | {k['later']:.3f} s | {cold / k['later']:.1f}x")
            print(f"| {kind} | " + " | ".join(cells) + " |")
    if "store" in res.get("hybridjax", {}):
        s = res["hybridjax"]["store"]
        print(f"\nstore after a 3000-token conversation: {s['bytes'] / 2**20:.1f} MiB in {s['entries']:.0f} snapshots; "
              f"one KV copy + per-snapshot states {s['one_kv_copy_plus_states'] / 2**20:.1f} MiB: {s['ratio']:.2f}x")
    for n in names:
        if "gap" in res[n]:
            g = res[n]["gap"]
            print(f"\n{n}: 4000-token prefill {g['long_prefill_s']:.2f} s; longest stream gap {g['longest_gap_s']:.2f} s "
                  f"({g['ratio']:.2f}x of the prefill; {g['stream_tokens_during']} stream tokens meanwhile)")
    if "generate tok/s" in res:
        print(f"\n`generate` decode: {res['generate tok/s']:.1f} tok/s; matmul bound at 1/4/8 rows: "
              + ", ".join(f"{v:.1f}" for v in res["matmul bound"].values()))
        print("\n| decode | " + " | ".join(f"{n} tok/s | / generate | / bound" for n in names) + " |")
        print("|---|" + "---:|---:|---:|" * len(names))
        for k in res["hybridjax"]["decode"]:
            rows = int(k.split()[0])
            bound = res["matmul bound"][rows if rows in (1, 4, 8) else 1]
            cells = [f"{res[n]['decode'][k]:.1f} | {res[n]['decode'][k] / res['generate tok/s']:.2f} | "
                     f"{res[n]['decode'][k] / bound:.2f}" for n in names]
            print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
