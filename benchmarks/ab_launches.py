"""Two source trees of hybridjax, A and B, launched as `hybridjax serve` turn by turn: what a user
meets right after start-up. Each launch: time to ready (/health 200), then at once one 600-token
prompt, eight 16-token prompts (the median), another 600-token prompt; every request greedy with
max_tokens 1, so its time is the prompt's prefill and the first token.

    python benchmarks/ab_launches.py A_TREE B_TREE --model DIR [--mode cold|warm] [--rounds 2] [-- serve flags]

cold: an empty compile cache per launch. warm: one cache per tree, filled by a first launch of
each that is not counted. A and B take turns going first; both see the same prompts in a round.
Each tree needs its C++ extension built in place (`python setup.py build_ext --inplace`). The
load average is printed per launch: compare within one run only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_startup import free_port, ids, load  # noqa: E402


def launch(tree: str, model: str, cache: str, flags: list[str], seed: int, log: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "hybridjax.cli", "serve", "--port", str(port),
                                 "--compile-cache-dir", cache, "--model", model, *flags],
                                stderr=err, stdout=subprocess.DEVNULL, cwd=tree, env={**os.environ, "PYTHONPATH": tree})
        try:
            client = httpx.Client(timeout=600)
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"the server of {tree} exited; see {log}")
                try:
                    if client.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            ready = time.perf_counter() - t0
            name = client.get(url + "/v1/models").json()["data"][0]["id"]

            def first_token(prompt: list[int]) -> float:
                t = time.perf_counter()
                client.post(url + "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 1,
                                                           "temperature": 0}).raise_for_status()
                return time.perf_counter() - t

            long1 = first_token(ids(seed, 600))
            short = statistics.median(first_token(ids(seed + 1 + i, 16)) for i in range(8))
            long2 = first_token(ids(seed + 100, 600))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait()
    return {"ready": ready, "long1": long1, "short": short, "long2": long2}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a_tree")
    p.add_argument("b_tree")
    p.add_argument("--model", required=True)
    p.add_argument("--mode", choices=("cold", "warm"), default="warm")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    work = Path(tempfile.mkdtemp(prefix="ab_launches_"))
    trees = {"A": a.a_tree, "B": a.b_tree}
    caches = {k: str(work / f"cache_{k}") for k in trees}
    if a.mode == "warm":
        for k, tree in trees.items():
            launch(tree, a.model, caches[k], flags, 7, work / f"fill_{k}.log")
    print(f"{a.mode} launches, A = {a.a_tree}, B = {a.b_tree}; model {a.model}; serve flags {flags}")
    print("| round | tree | ready s | first 600-token prompt s | 16-token prompts, median ms | second 600-token s | load |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for r in range(a.rounds):
        for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
            cache = caches[k] if a.mode == "warm" else str(work / f"cold_{k}_{r}")
            got = launch(trees[k], a.model, cache, flags, 1000 * (r + 1), work / f"{k}_{r}.log")
            print(f"| {r} | {k} | {got['ready']:.2f} | {got['long1']:.2f} | {got['short'] * 1e3:.0f} | "
                  f"{got['long2']:.2f} | {load()} |", flush=True)
            if a.mode == "cold":
                shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
