"""Start-up as a user meets it: `hybridjax serve` in a subprocess, cold and warm, driven over HTTP.

    python benchmarks/bench_startup.py [--models default,qwen3.5] [--max-len N] [--code CHECKOUT --ready-only]
                                       [--kinds long,...] [--restart-early] [--json OUT]

For each model, two launches on one fresh compile-cache directory: cold (empty: the covering
programs compile before ready) and warm (a restart, once the cold launch has every program, as any
server that ran for a few minutes has: executables load from `<cache>/executables`;
`--restart-early`: as soon as the cold launch's requests are answered, the rest still compiling).
Models: `default`, the embedded default model (8.9M parameters); `qwen3.5`, the random
Qwen3.5-shaped model of bench_multiturn.py (0.23B parameters, float32, 12 layers, vocab 32000),
built in a temporary directory. Each launch prints:
  ready         launch to /health 200 (the covering programs exist; the rest compile behind),
                and the CPU seconds the server used until then (all its threads: on a busy
                machine the wall time stretches, the CPU time much less)
  first answer  launch to the end of a first request sent at ready (a chat completion of 8
                tokens; a completion of 8 tokens for a model without a chat template)
and, for each kind of request, its first time against a later one (the buckets it would use may
still be compiling behind: it runs on a compiled larger or smaller one): short request, long
prompt (600 tokens), 4 concurrent requests, exact repeat, echo + logprobs; the ratio first /
later, later being the median of three more (the issue's target: within 1.3x). Completion prompts are token ids, so any model's
tokenizer serves them. Every warm response is checked against the cold run's (greedy: same
tokens). The server's own start-up lines (what it compiled, on how many threads, how long each
took) are printed for each launch. The load average is printed beside the figures: on a shared
machine other jobs slow compiling most. `--code` runs another checkout's server (an earlier
commit, for a before/after on the same machine); `--ready-only`: launch figures only; `--kinds`: those
kinds only, in that order (`--kinds long`: a long prompt right after the first answer, as at ready).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has used so far, all its threads (user + system): unlike wall time,
    about the same on a busy machine as on a quiet one."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Served:
    """One `hybridjax serve` launch; `ready`: seconds from launch to /health 200."""

    def __init__(self, model: str | None, cache: Path, max_len: int, log: Path, code: Path = ROOT, chat: bool = True):
        self.chat = chat  # the model has a chat template
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "hybridjax.cli", "serve", "--port", str(self.port), "--compile-cache-dir",
               str(cache), "--max-len", str(max_len)] + (["--model", model] if model else [])
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(code)}, cwd=code, stdout=subprocess.DEVNULL,
                                     stderr=log.open("w"))
        self.client = httpx.Client(timeout=3600)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if self.client.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.1)
        self.ready = time.perf_counter() - self.t0
        self.cpu = cpu_seconds(self.proc.pid)
        self.model = self.client.get(self.url + "/v1/models").json()["data"][0]["id"]

    def all_programs(self, timeout: float = 900) -> float | None:
        """Seconds from launch until /metrics says every program exists (compiled or loaded, the
        rest of them behind); None for a server without those gauges (an older checkout)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            gauges = dict(line.split(" ", 1) for line in self.client.get(self.url + "/metrics").text.splitlines()
                          if line.startswith("hybridjax_programs"))
            if not gauges:
                return None
            if gauges["hybridjax_programs_ready"] == gauges["hybridjax_programs"]:
                return time.perf_counter() - self.t0
            time.sleep(0.5)
        raise RuntimeError(f"not every program exists {timeout:.0f} s after launch")

    def post(self, path: str, body: dict) -> dict:
        r = self.client.post(self.url + path, json={"model": self.model, "temperature": 0, **body})
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


LATER = 3  # later requests of each kind: their median is the "later" time (one was noise at 0.05-0.1 s)


def ids(seed: int, n: int) -> list[int]:
    """n token ids, the same for every model (below the smallest vocabulary, past special ids)."""
    return np.random.default_rng(seed).integers(16, 4000, n).tolist()


def kinds() -> dict:
    """name -> a function (server, i) -> response text(s), i = 0 first, 1.. later (other tokens)."""
    def short(s, i):
        if s.chat:
            return s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Hello number {i}!"}],
                                                   "max_tokens": 8})["choices"][0]["message"]["content"]
        return s.post("/v1/completions", {"prompt": ids(100 + i, 12), "max_tokens": 8})["choices"][0]["text"]

    def long(s, i):
        return s.post("/v1/completions", {"prompt": ids(200 + i, 600), "max_tokens": 4})["choices"][0]["text"]

    def batch(s, i):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda k: s.post("/v1/completions", {"prompt": ids(300 + 10 * i + k, 20),
                                                                      "max_tokens": 8})["choices"][0]["text"], range(4)))

    def repeat(s, i):
        body = {"prompt": ids(400 + i, 30), "max_tokens": 4}
        s.post("/v1/completions", body)
        t = time.perf_counter()
        out = s.post("/v1/completions", body)["choices"][0]["text"]
        return out, time.perf_counter() - t  # the repeat's own time

    def echo(s, i):
        r = s.post("/v1/completions", {"prompt": ids(500 + i, 24), "max_tokens": 1, "echo": True, "logprobs": 2})
        return r["choices"][0]["logprobs"]

    return {"short request": short, "long prompt (600 tokens)": long, "4 concurrent": batch, "exact repeat": repeat,
            "echo + logprobs": echo}


def run(model: str | None, cache: Path, max_len: int, name: str, logs: Path, code: Path, which: list[str],
        chat: bool, restart_early: bool = False) -> dict:
    log = logs / f"{name}.log"
    s = Served(model, cache, max_len, log, code, chat)
    try:
        kinds()["short request"](s, 0)
        out = {"ready": s.ready, "cpu to ready": s.cpu, "first answer": time.perf_counter() - s.t0, "load": load(),
               "kinds": {}}
        every = kinds()
        for kind in which:
            fn = every[kind]
            times, answers = [], []
            for i in range(1 + LATER):
                t = time.perf_counter()
                a = fn(s, i)
                spent = time.perf_counter() - t
                if isinstance(a, tuple):
                    a, spent = a
                times.append(spent)
                answers.append(a)
            out["kinds"][kind] = {"first": times[0], "later": float(np.median(times[1:])), "later all": times[1:],
                                  "answers": answers}
        if name.endswith("-cold") and not restart_early:  # a restart then finds every program kept, as after
            out["all programs"] = s.all_programs()      # any server that ran for a few minutes
        return out
    finally:
        s.stop()
        out_lines = [line for line in log.read_text().splitlines(True) if "start-up" in line or "loaded " in line]
        print(f"--- {name}: the server's start-up lines\n" + "".join(out_lines), flush=True)


def same(a, b) -> bool:
    """Equal answers: the same tokens and text; log-probabilities within 1e-3 (a generated
    token's may come from another program, e.g. a wider prefill chunk compiled since, whose
    float32 sums round differently)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) <= 1e-3
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def model_dirs(names: list[str], tmp: Path) -> dict:
    """name -> (model directory or None for the embedded default, has a chat template)."""
    out = {}
    for name in names:
        if name == "default":
            out[name] = (None, True)
        elif name == "qwen3.5":
            from benchmarks.bench_multiturn import MODEL, build_model_dir

            out[name] = (str(build_model_dir(tmp / "qwen3.5", MODEL["num_hidden_layers"])), False)
        else:  # a model directory of one's own
            out[name] = (name, (Path(name) / "tokenizer_config.json").exists())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,qwen3.5",
                    help="comma-separated: default (the embedded model), qwen3.5 (the 0.23B random Qwen3.5-shaped "
                         "model), or model directories")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose server runs (default: this one)")
    ap.add_argument("--ready-only", action="store_true", help="launch figures only, no request kinds")
    ap.add_argument("--kinds", default="",
                    help="comma-separated beginnings of the request kinds to time, in this order (e.g. 'long': the "
                         "long prompt right after the first answer); default: every kind")
    ap.add_argument("--restart-early", action="store_true",
                    help="restart as soon as the cold launch's requests are answered (the programs still compiling "
                         "behind then compile in the warm launch too), not once every program exists")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    names = list(kinds())
    which = [n for b in args.kinds.split(",") for n in names if n.startswith(b)] if args.kinds else names
    if args.ready_only:
        which = []
    print(f"load average at start: {load()}", flush=True)
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model, (path, chat) in model_dirs(args.models.split(","), Path(tmp)).items():
            cache, logs = Path(tmp) / f"cache-{len(res)}", Path(tmp)
            r = res[model] = {}
            for launch in ("cold", "warm"):
                r[launch] = run(path, cache, args.max_len, f"{model}-{launch}", logs, args.code, which, chat,
                                args.restart_early)
                every = r[launch].get("all programs")
                print(f"{model} {launch}: ready {r[launch]['ready']:.1f} s, first answer {r[launch]['first answer']:.1f} s"
                      + (f", every program {every:.1f} s" if every else "") + f" (load {r[launch]['load']})", flush=True)
            for kind in r["cold"]["kinds"]:
                a, b = r["cold"]["kinds"][kind]["answers"], r["warm"]["kinds"][kind]["answers"]
                assert same(a, b), f"{model}, {kind}: the warm server answered otherwise: {a} vs {b}"
            if args.json:  # each model's figures as soon as they exist
                args.json.write_text(json.dumps(res, indent=2))
    print(f"\ncode: {args.code}; --max-len {args.max_len}; load average at end: {load()}")
    print("\n| model | launch | ready (/health 200) | CPU seconds to ready | first answer | load average |"
          "\n|---|---|---:|---:|---:|---|")
    for model, r in res.items():
        for k in ("cold", "warm"):
            print(f"| {model} | {k} | {r[k]['ready']:.1f} s | {r[k]['cpu to ready']:.1f} s | {r[k]['first answer']:.1f} s "
                  f"| {r[k]['load']} |")
    if which:
        print("\n| model | request kind | cold: first | cold: later | ratio | warm: first | warm: later | ratio |"
              "\n|---|---|---:|---:|---:|---:|---:|---:|")
        for model, r in res.items():
            for kind in r["cold"]["kinds"]:
                c, w = r["cold"]["kinds"][kind], r["warm"]["kinds"][kind]
                print(f"| {model} | {kind} | {c['first']:.2f} s | {c['later']:.2f} s | {c['first'] / c['later']:.2f}x "
                      f"| {w['first']:.2f} s | {w['later']:.2f} s | {w['first'] / w['later']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
