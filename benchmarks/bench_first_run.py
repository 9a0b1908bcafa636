"""An executable's first run against its later runs: prefill as XLA:CPU compiles it by default,
without YNNPACK fusions, or with only one kind of them (`xla_cpu_experimental_ynn_fusion_type` as a
compile option: `--settings default,no-ynn,dots,reduce`, all four by default).

    python benchmarks/bench_first_run.py [--model-dir DIR] [--tokens 128,256,512] [--rounds 2] [--runs 5]
                                         [--settings default,no-ynn]

XLA:CPU's YNNPACK fusions build their runtime at an executable's first run, not when compiling,
so a server's first request of each width pays it (issue 23: the first long prompt after a start
is up to 2x the later ones). Without those fusions the first run is as the later ones, but the
later ones are slower: this script measures both sides of that trade (benchmarks/README.md, stops
48 and 51). Each (round, setting) is a fresh process, as a server's start is: it loads the model
(default: the 0.23B random Qwen3.5-shaped model of bench_multiturn), compiles
`hybridjax.generate`'s prefill of one row of each width, and times its first `--runs` calls.
Prints, per width: the first call, the median of the later ones, first / later, and the later
calls' speed against the default compile's in the same round, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# setting -> the YNNPACK fusion types compiled (None: XLA's default, which is individual dots and
# reductions in jaxlib 0.10.2: the same fusions as "dots+reduce")
SETTINGS = {"default": None, "no-ynn": "", "dots": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
            "reduce": "LIBRARY_FUSION_TYPE_REDUCE"}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def one_process(model_dir: str, setting: str, widths: list[int], runs: int) -> dict:
    """In this (fresh) process: {width: [seconds of each call]} for `setting`'s compile."""
    import jax
    import numpy as np

    import hybridjax
    from hybridjax.cache import init_cache
    from hybridjax.generate import _prefill_jit, _prepare_prefill

    cfg, params = hybridjax.load(model_dir, progress=False)
    types = SETTINGS[setting]
    options = {} if types is None else {"xla_cpu_experimental_ynn_fusion_type": types}
    out = {}
    for width in widths:
        tokens = np.random.RandomState(width).randint(0, cfg.vocab_size, (1, width)).astype(np.int32)
        tokens, counts, cache = _prepare_prefill(tokens, None, init_cache(cfg, 1, max(widths) * 2))
        exe = _prefill_jit.lower(params, tokens, counts, cache, cfg).compile(options)
        seconds = []
        for _ in range(runs):
            t0 = time.perf_counter()
            jax.block_until_ready(exe(params, tokens, counts, cache))
            seconds.append(time.perf_counter() - t0)
        out[width] = seconds
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="a model directory (default: build the 0.23B Qwen3.5-shaped model)")
    ap.add_argument("--tokens", default="128,256,512", help="comma-separated prefill widths (one row)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5, help="calls per width and process (the first, then the later)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)} (default is always measured)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # SETTING: one process's measurement, as JSON
    a = ap.parse_args(argv)
    widths = [int(t) for t in a.tokens.split(",")]
    # XLA's default compile is always measured: the later calls' speed is against it
    settings = ["default"] + [s for s in a.settings.split(",") if s != "default"]
    if a.child:
        print(json.dumps(one_process(a.model_dir, a.child, widths, a.runs)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = a.model_dir
        if model_dir is None:
            from benchmarks.bench_multiturn import MODEL, build_model_dir

            model_dir = str(build_model_dir(Path(tmp) / "qwen3.5", MODEL["num_hidden_layers"]))
        print(f"model {model_dir}; widths {widths}; {a.runs} calls per process; load before: {load()}", flush=True)
        rows = []
        for r in range(a.rounds):
            got = {}
            for setting in settings:
                child = subprocess.run([sys.executable, __file__, "--child", setting, "--model-dir", model_dir,
                                        "--tokens", a.tokens, "--runs", str(a.runs)], check=True, capture_output=True,
                                       text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
                got[setting] = {int(w): s for w, s in json.loads(child.stdout.splitlines()[-1]).items()}
            for width in widths:
                later_default = statistics.median(got["default"][width][1:])
                for setting in settings:
                    first, later = got[setting][width][0], statistics.median(got[setting][width][1:])
                    rows.append((r + 1, width, setting, first, later, first / later, later_default / later))
            print(f"round {r + 1} done, load {load()}", flush=True)
    print("\n| round | width | compile | first call | later (median) | first / later | later speed vs default |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r, width, setting, first, later, ratio, speed in rows:
        print(f"| {r} | 1x{width} | {setting} | {first:.3f} s | {later:.3f} s | {ratio:.2f}x | {speed:.2f}x |")
    print(f"\nload after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
