"""Start-up as a user meets it: `hybridjax serve` in a subprocess, cold and warm, driven over HTTP.

    python benchmarks/bench_startup.py [--model DIR] [--max-len N] [--code CHECKOUT --ready-only] [--json OUT]

For the model (default: the embedded default model), two launches on one fresh compile-cache
directory: cold (empty: every program compiles) and warm (a restart: executables load from
`<cache>/executables`). Each prints:
  ready         launch to /health 200 (the covering programs exist; the rest compile behind)
  first answer  launch to the end of a first chat completion (8 tokens) sent at ready
and, for each kind of request, its first time against a later one (the buckets it would use may
still be compiling behind: it runs on a compiled larger or smaller one): short chat, long prompt
(~600 tokens), 4 concurrent requests, exact repeat, echo + logprobs. Every response is checked
against the cold run's (greedy: same tokens). The load average is printed beside the figures:
on a shared machine other jobs slow compiling most. `--code` runs another checkout's server (an
earlier commit, for a before/after on the same machine); `--ready-only`: launch figures only.
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

ROOT = Path(__file__).resolve().parents[1]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """One `hybridjax serve` launch; `ready`: seconds from launch to /health 200."""

    def __init__(self, model: str | None, cache: Path, max_len: int, log: Path, code: Path = ROOT):
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
        self.model = self.client.get(self.url + "/v1/models").json()["data"][0]["id"]

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


def kinds() -> dict:
    """name -> a function (server, i) -> response text(s), i = 0 first, 1 later (other text)."""
    def chat(s, i):
        return s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Hello number {i}!"}],
                                               "max_tokens": 8})["choices"][0]["message"]["content"]

    def long(s, i):
        text = " ".join(f"word{j % 50}" for j in range(300 + i))  # ~600 tokens
        return s.post("/v1/completions", {"prompt": text, "max_tokens": 4})["choices"][0]["text"]

    def batch(s, i):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda k: s.post("/v1/completions", {"prompt": f"Batch {i} row {k}: tell me",
                                                                      "max_tokens": 8})["choices"][0]["text"], range(4)))

    def repeat(s, i):
        body = {"prompt": f"The same prompt, again {i}", "max_tokens": 4}
        s.post("/v1/completions", body)
        t = time.perf_counter()
        out = s.post("/v1/completions", body)["choices"][0]["text"]
        return out, time.perf_counter() - t  # the repeat's own time

    def echo(s, i):
        r = s.post("/v1/completions", {"prompt": f"Score this prompt {i}", "max_tokens": 1, "echo": True, "logprobs": 2})
        return r["choices"][0]["logprobs"]["token_logprobs"]

    return {"short chat": chat, "long prompt (~600 tokens)": long, "4 concurrent": batch, "exact repeat": repeat,
            "echo + logprobs": echo}


def run(model: str | None, cache: Path, max_len: int, name: str, logs: Path, code: Path, ready_only: bool) -> dict:
    s = Served(model, cache, max_len, logs / f"{name}.log", code)
    try:
        chat = kinds()["short chat"]
        chat(s, 0)
        out = {"ready": s.ready, "first answer": time.perf_counter() - s.t0, "load": load(), "kinds": {}}
        for kind, fn in ({} if ready_only else kinds()).items():
            times, answers = [], []
            for i in (0, 1):
                t = time.perf_counter()
                a = fn(s, i)
                spent = time.perf_counter() - t
                if isinstance(a, tuple):
                    a, spent = a
                times.append(spent)
                answers.append(a)
            out["kinds"][kind] = {"first": times[0], "later": times[1], "answers": answers}
        return out
    finally:
        s.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the embedded default model)")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose server runs (default: this one)")
    ap.add_argument("--ready-only", action="store_true", help="launch figures only, no request kinds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    print(f"load average at start: {load()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache, logs = Path(tmp) / "cache", Path(tmp)
        res = {"cold": run(args.model, cache, args.max_len, "cold", logs, args.code, args.ready_only)}
        print(f"cold: ready {res['cold']['ready']:.1f} s", flush=True)
        res["warm"] = run(args.model, cache, args.max_len, "warm", logs, args.code, args.ready_only)
        print(f"warm: ready {res['warm']['ready']:.1f} s", flush=True)
        print("".join(line for line in (logs / "warm.log").read_text().splitlines(True) if "start-up" in line or "serving" in line))
    for kind in res["cold"]["kinds"]:
        a, b = res["cold"]["kinds"][kind]["answers"], res["warm"]["kinds"][kind]["answers"]
        assert a == b, f"{kind}: the warm server answered otherwise: {a} vs {b}"
    print(f"\ncode: {args.code}; model: {args.model or 'the embedded default'}, --max-len {args.max_len}; "
          f"load average at end: {load()}")
    print("\n| launch | ready (/health 200) | first answer | load average |\n|---|---:|---:|---|")
    for k in ("cold", "warm"):
        r = res[k]
        print(f"| {k} | {r['ready']:.1f} s | {r['first answer']:.1f} s | {r['load']} |")
    print("\n| request kind | cold: first | cold: later | warm: first | warm: later |\n|---|---:|---:|---:|---:|")
    for kind in res["cold"]["kinds"]:
        c, w = res["cold"]["kinds"][kind], res["warm"]["kinds"][kind]
        print(f"| {kind} | {c['first']:.2f} s | {c['later']:.2f} s | {w['first']:.2f} s | {w['later']:.2f} s |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
