"""Two source trees of hybridjax, A and B (e.g. main and a branch), timed turn by turn on the same long
agent trace, their runs alternated: profile_agent_turn.py (this folder's) with PYTHONPATH=A, then B,
then A again... Per turn: prompt and new tokens, TTFT, the engine's prefill calls of the turn (its
new tokens' prefill time, each call blocked on), and the excess TTFT - prefill calls.

    python benchmarks/ab_trees.py A_TREE B_TREE [--repeats 2] -- [profile_agent_turn.py flags]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run(tree: str, flags: list[str]) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, PYTHONPATH=tree)
        subprocess.run([sys.executable, str(HERE / "profile_agent_turn.py"), *flags, "--json", out.name], env=env,
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    runs: dict[str, list[list[dict]]] = {"A": [], "B": []}
    for rep in range(args.repeats):
        for name, tree in (("A", args.a), ("B", args.b)):
            before = load()
            runs[name].append(run(tree, rest))
            print(f"run {rep + 1} {name} ({tree}): load average {before} -> {load()}", flush=True)
    print(f"\nA = {args.a}, B = {args.b}; per turn, median over {args.repeats} runs each: TTFT, prefill calls of the "
          "turn (s), excess = TTFT - calls")
    print(f"{'turn':>4} {'prompt':>6} {'new':>5} {'ttft A':>7} {'calls A':>7} {'exc A':>6} {'ttft B':>7} {'calls B':>7} "
          f"{'exc B':>6}  exc A runs / exc B runs")
    med = statistics.median
    for i, r0 in enumerate(runs["A"][0]):
        cells, runs_txt = [], []
        for name in "AB":
            rows = [rs[i] for rs in runs[name]]
            exc = [r["ttft"] - r["call_s"] for r in rows]
            cells += [med(r["ttft"] for r in rows), med(r["call_s"] for r in rows), med(exc)]
            runs_txt.append(",".join(f"{e:.3f}" for e in exc))
        print(f"{r0['turn']:4d} {r0['prompt']:6d} {r0['new']:5d} " + " ".join(
            f"{c:{w}.3f}" for c, w in zip(cells, (7, 7, 6, 7, 7, 6))) + "  " + " / ".join(runs_txt))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
