"""benchmarks/gpu_check.py cannot rot: its --dry-run (tiny shapes, CPU, Pallas interpreted) runs
here as a user runs it on the GPU image, from the checkout on PYTHONPATH, in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hybridjax.pallas_kernels.gated_delta_rule.mosaic import AVAILABLE as MOSAIC

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def run_script(*args, timeout=1800):  # a guard against a hang; ~70 s of CPU on an idle machine
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_dry_run_checks_every_kernel_and_writes_the_report(tmp_path):
    proc = run_script("--dry-run", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["dry_run"] and res["environment"]["backend"] == "cpu"
    assert not [k for k in res if k.endswith("_error")], res["notes"]
    # Every kernel, both policies, each against its reference within its tolerance.
    kernels = {(r["kernel"], r["policy"]) for r in res["kernels"]}
    names = {"delta rule forward (chunked)", "delta rule decode (T=1)", "delta rule backward",
             "paged attention decode", "grouped matmul"}
    mosaic = {("delta rule forward (mosaic)", "fast")} if MOSAIC else set()  # JAX 0.11+: bf16 "fast" only
    assert kernels == {(n, p) for n in names for p in ("exact", "fast")} | mosaic
    assert all(r["ok"] and r["error"] < r["tolerance"] for r in res["kernels"]), res["kernels"]
    # bf16 "fast" is not float32 in disguise: the delta rule's error shows bfloat16 rounding.
    fast = {r["kernel"]: r["error"] for r in res["kernels"] if r["policy"] == "fast"}
    assert fast["delta rule forward (chunked)"] > 1e-4
    for row in res["timing"]:
        assert row["ms"]["pallas"] > 0 and row["ms"]["xla"] > 0, row
        assert ("mosaic" in row["ms"]) == (MOSAIC and row["kernel"] == "delta rule prefill forward"), row
    assert "dry run: no fla" in res["notes"]
    m = res["model"]
    assert m["prefill_tok_s"] > 0 and m["ttft_cold_s"] > 0 and m["ttft_turn2_s"] > 0 and m["engine_decode_tok_s"] > 0
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| delta rule backward | fast |" in table and table in proc.stdout


def test_unknown_section_is_one_line_error(tmp_path):
    proc = run_script("--dry-run", "--skip", "kernels,bogus", tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "unknown section(s) ['bogus']" in proc.stderr and "Traceback" not in proc.stderr
