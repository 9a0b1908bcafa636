"""A new user's first answer: `make run` on a fresh clone, install included, to a first chat answer.

    python benchmarks/bench_make_run.py [--keep DIR]

Clones this checkout's HEAD into a temporary directory and runs `make run` there with an empty
XDG_CACHE_HOME (so pip's cache and the compilation cache start empty: every package is fetched
from the registry, every program compiled), as a new user on this machine would. It polls
http://127.0.0.1:8000/health (make run's port: it must be free), sends one chat completion of 16
tokens once the server is ready, then interrupts the server. Prints, in seconds from the launch:
when each line of make's output appeared (installing, loading, start-up, the URL), ready
(/health 200) and the first chat answer, with the load average. The issue's target (issue 23):
a first answer <= 90 s, install included, on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
URL = "http://127.0.0.1:8000"


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="clone into this (new) directory and keep it, instead of a temporary one")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(a.keep) if a.keep else Path(tmp)
        clone, cache = where / "clone", where / "cache"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        cache.mkdir(parents=True)
        print(f"load before: {load()}; clone of {ROOT} HEAD in {clone}; XDG_CACHE_HOME={cache}", flush=True)
        env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        t0 = time.perf_counter()
        proc = subprocess.Popen(["make", "run"], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

        def echo():  # make's own lines, timed: what the user sees, and when
            for line in proc.stdout:
                if "/health" not in line:
                    print(f"{time.perf_counter() - t0:7.1f} s | {line.rstrip()[:160]}", flush=True)

        threading.Thread(target=echo, daemon=True).start()
        client = httpx.Client(timeout=600)
        try:
            while True:
                if proc.poll() is not None:
                    print(f"make run exited with {proc.returncode} before it served")
                    return 1
                try:
                    if client.get(f"{URL}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            ready = time.perf_counter() - t0
            model = client.get(f"{URL}/v1/models").json()["data"][0]["id"]
            r = client.post(f"{URL}/v1/chat/completions", json=dict(
                model=model, messages=[{"role": "user", "content": "What does json.dumps do?"}], max_tokens=16,
                temperature=0))
            first = time.perf_counter() - t0
            r.raise_for_status()
            text = r.json()["choices"][0]["message"]["content"]
            print(f"\nready (/health 200) {ready:.1f} s; first chat answer {first:.1f} s (target <= 90 s); "
                  f"load after: {load()}\nanswer: {text!r}")
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
