"""Serving across processes beside one process on the same mesh, over real HTTP.

    python benchmarks/bench_multihost.py [--model DIR] [--tokens 64] [--requests 3]

Runs `hybridjax serve` three ways, one after the other, on the same model and requests:
  one device          one process, no mesh (the reference)
  1 process, 4 devs   one process with 4 host devices, mesh tensor=2,expert=2
  2 processes x 2     two processes (jax.distributed, gloo over 127.0.0.1), the same mesh:
                      process 0 serves HTTP, process 1 replays its steps (hybridjax.multihost)
and reports, per setup, the mean time of a greedy completion of `--tokens` tokens after a
warm-up request (decode dominated; prompts differ, so no snapshot hit), and the ratio to the
one-process mesh. It also times the step channel alone: describing and pickling one decode
step as process 0 does, and its size on the wire.

What it means here: the "devices" are XLA:CPU host devices on 2 shared cores, and gloo moves
the cross-process all-reduces through loopback TCP; the figure is the overhead of the
multi-process machinery (collectives between processes, the step channel), not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVE = ["--max-len", "512", "--page-size", "16", "--prefill-chunk", "32", "--slots", "2", "--no-compile-cache"]
MESH = "tensor=2,expert=2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices: int) -> dict:
    e = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    e.pop("JAX_COMPILATION_CACHE_DIR", None)
    return e


def launch(model: list[str], processes: int, devices: int, mesh: bool, logdir: Path):
    port, coord = free_port(), free_port()
    procs = []
    for i in range(processes):
        cmd = [sys.executable, "-m", "hybridjax.cli", "serve", *model, "--port", str(port), *SERVE]
        if mesh:
            cmd += ["--mesh", MESH]
        if processes > 1:
            cmd += ["--coordinator", f"127.0.0.1:{coord}", "--num-processes", str(processes), "--process-id", str(i)]
        log = open(logdir / f"{processes}x{devices}_{i}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env(devices), stdout=log, stderr=subprocess.STDOUT))
    return f"http://127.0.0.1:{port}", procs


def wait_ready(url: str, procs, timeout: float = 900) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a server process exited during start-up")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def complete(url: str, prompt: str, tokens: int) -> tuple[float, int, str]:
    t = time.perf_counter()
    name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": name, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600).json()
    if "usage" not in r:
        raise RuntimeError(f"the server answered {r}")
    return time.perf_counter() - t, r["usage"]["completion_tokens"], r["choices"][0]["text"]


def measure(label, model, processes, devices, mesh, args, logdir) -> dict:
    url, procs = launch(model, processes, devices, mesh, logdir)
    try:
        ready = wait_ready(url, procs)
        complete(url, "warm-up request", args.tokens)
        times, counts, texts = [], [], []
        for i in range(args.requests):
            dt, n, text = complete(url, f"Request number {i}: tell me about the standard library", args.tokens)
            times.append(dt)
            counts.append(n)
            texts.append(text)
        return {"label": label, "ready_s": ready, "mean_s": sum(times) / len(times),
                "tok_s": sum(counts) / sum(times), "texts": texts}
    finally:
        procs[0].send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()


def channel_cost(rounds: int = 2000) -> tuple[float, int]:
    """Microseconds to describe and pickle one decode step (2 rows, 32 pages each) as the leader
    does, and the bytes it sends."""
    import numpy as np

    from hybridjax.multihost import _encode

    rows = np.array([0, 1], np.int32)
    table = np.arange(64, dtype=np.int32).reshape(2, 32)
    args = ("params", "state", rows, table, "cfg", "xla")
    t = time.perf_counter()
    for _ in range(rounds):
        wire, _ = _encode(args, {})
        body = pickle.dumps(([], "decode", wire, ("K", {})), protocol=5)
    return (time.perf_counter() - t) / rounds * 1e6, len(body)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the embedded default model)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=3)
    args = p.parse_args(argv)
    model = ["--model", args.model] if args.model else []
    logdir = Path(tempfile.mkdtemp(prefix="bench_multihost_"))
    us, nbytes = channel_cost()
    results = [measure("one device", model, 1, 1, False, args, logdir),
               measure("1 process, 4 devs", model, 1, 4, True, args, logdir),
               measure("2 processes x 2", model, 2, 2, True, args, logdir)]
    base = results[1]["mean_s"]
    print(f"greedy completions of {args.tokens} tokens, {args.requests} requests after a warm-up; mesh {MESH}; "
          "XLA:CPU host devices on 2 shared cores (machine loaded by other jobs)")
    print(f"{'setup':20s} {'ready s':>8s} {'s/request':>10s} {'tok/s':>8s} {'x 1-process mesh':>17s}  same text")
    for r in results:
        same = r["texts"] == results[0]["texts"]
        print(f"{r['label']:20s} {r['ready_s']:8.1f} {r['mean_s']:10.3f} {r['tok_s']:8.1f} {r['mean_s'] / base:17.2f}  {same}")
    print(f"step channel: {us:.1f} us to describe and pickle one decode step; {nbytes} bytes per follower")
    print(json.dumps({"logs": str(logdir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
