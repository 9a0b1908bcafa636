"""Training on a device mesh: the loss and gradients on mesh `data=2,tensor=2` equal one
device's, and `hybridjax train --mesh` trains from them (tests/train_mesh_worker.py runs in a
subprocess with 4 host devices; JAX fixes the device count at start-up).

Tolerances (float32): the mesh reorders sums (row-parallel projections all-reduced over
`tensor`, the batch's gradients over `data`), ~1e-7 relative per op. The loss agrees within
1e-6 relative (observed: equal); each gradient leaf within 1e-4 of its own largest entry
(observed up to 2.4e-5, on the first GDN layer's gate parameters dt_bias and A_log, whose
gradients sum over every token, head and the backward of the chunked solve; most leaves ~1e-6),
and the global norm within 1e-5 relative (observed 4e-7).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_mesh")
    flags = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=flags)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "train_mesh_worker.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_loss_and_gradients_on_a_mesh_match_one_device(report):
    assert abs(report["mesh_loss"] - report["loss"]) <= 1e-6 * abs(report["loss"])
    assert report["batch_spec"] == "P('data',)"  # rows split: data parallelism
    assert any("tensor" in s for s in report["grad_specs"])  # gradients stay sharded like the params
    assert len(report["grads"]) > 20
    for path, (err, scale) in report["grads"].items():
        assert err <= 1e-4 * scale + 1e-9, (path, err, scale)


def test_train_cli_on_a_mesh_starts_from_the_same_loss_and_gradient(report):
    """`hybridjax train --mesh data=2,tensor=2`: step 1 (fresh params, the first batch) has one
    device's loss and gradient norm (before clipping); step 2 improves on it; the model is saved."""
    assert report["cli_code"] == 0
    first, second = report["cli_metrics"]
    assert abs(first["loss"] - report["loss"]) <= 1e-6 * report["loss"]
    assert abs(first["grad_norm"] - report["grad_norm"]) <= 1e-5 * report["grad_norm"]
    assert second["loss"] < first["loss"]
    assert report["cli_model_changed"]
