"""Two source trees of hybridjax, A and B, launched as `hybridjax serve` turn by turn: what a user
meets right after start-up. Each launch: time to ready (/health 200), then at once one 600-token
prompt, eight 16-token prompts (the median), another 600-token prompt; every request greedy with
max_tokens 1, so its time is the prompt's prefill and the first token.

    python benchmarks/ab_launches.py A_TREE B_TREE --model DIR [--mode cold|warm] [--rounds 2] [--max-len 4096]

cold: an empty compile cache per launch. warm: one cache per tree, filled by a first launch of
each that is not counted. A and B take turns going first; both see the same prompts in a round.
Each tree needs its C++ extension built in place (`python setup.py build_ext --inplace`). The
load average is printed per launch: compare within one run only.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_startup import Served, ids, load  # noqa: E402


def launch(tree: str, model: str, cache: str, max_len: int, seed: int, log: Path) -> dict:
    server = Served(model, Path(cache), max_len, log, code=Path(tree), chat=False)
    try:
        def first_token(prompt: list[int]) -> float:
            t = time.perf_counter()
            server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
            return time.perf_counter() - t

        long1 = first_token(ids(seed, 600))
        short = statistics.median(first_token(ids(seed + 1 + i, 16)) for i in range(8))
        long2 = first_token(ids(seed + 100, 600))
    finally:
        server.stop()
    return {"ready": server.ready, "long1": long1, "short": short, "long2": long2}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a_tree")
    p.add_argument("b_tree")
    p.add_argument("--model", required=True)
    p.add_argument("--mode", choices=("cold", "warm"), default="warm")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-len", type=int, default=4096)
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ab_launches_"))
    trees = {"A": a.a_tree, "B": a.b_tree}
    caches = {k: str(work / f"cache_{k}") for k in trees}
    if a.mode == "warm":
        for k, tree in trees.items():
            launch(tree, a.model, caches[k], a.max_len, 7, work / f"fill_{k}.log")
    print(f"{a.mode} launches, A = {a.a_tree}, B = {a.b_tree}; model {a.model}; --max-len {a.max_len}")
    print("| round | tree | ready s | first 600-token prompt s | 16-token prompts, median ms | second 600-token s | load |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for r in range(a.rounds):
        for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
            cache = caches[k] if a.mode == "warm" else str(work / f"cold_{k}_{r}")
            got = launch(trees[k], a.model, cache, a.max_len, 1000 * (r + 1), work / f"{k}_{r}.log")
            print(f"| {r} | {k} | {got['ready']:.2f} | {got['long1']:.2f} | {got['short'] * 1e3:.0f} | "
                  f"{got['long2']:.2f} | {load()} |", flush=True)
            if a.mode == "cold":
                shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
