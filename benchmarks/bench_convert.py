"""Conversion and load times, and peak memory, for a small real-sized Qwen3.5 model.

    python benchmarks/bench_convert.py [--work-dir DIR] [--keep]

Builds a random Qwen3.5 text model with transformers (fixed seed; hidden 1024, 12 layers,
vocab 32k, untied head: ~0.3 B params, 1.2 GB in float32), saves it as HF float32, then
times, each step in a fresh process so that peak RSS (ru_maxrss) is its own:

    HF load          conversion.load(hf_dir)             (safetensors -> transforms -> device)
    checkpoint load  conversion.load(converted_dir)      (each array mapped from its file)
    OCDBT load       the same params in orbax's OCDBT layout, as conversions wrote them before
                     stop 52 (orbax restore into abstract shapes)
    convert          HF -> checkpoint, and checkpoint -> HF

A load's time includes reading one byte of every 4 KiB page of every param (a mapped array's
pages are read when first touched: this makes the rows compare).

Files were just written, so reads are from the page cache (warm); both loads get the same
advantage. "cpu s": process CPU time (all threads). "- after imports": peak RSS minus the RSS
after imports, what the step itself holds; "peak anon": the sampled peak of private memory
above the same point (ru_maxrss also counts memory-mapped safetensors pages, which are page
cache the kernel can drop).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(
    vocab_size=32768, hidden_size=1024, num_hidden_layers=12, intermediate_size=3072,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=False,
)


def rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class AnonPeak:
    """Samples RssAnon (private memory, without mapped file pages) every few ms: ru_maxrss also
    counts the page-cache pages of memory-mapped safetensors files, which the kernel can drop."""

    def __init__(self, every: float = 0.005):
        import threading

        self.peak, self.every, self.stop = 0.0, every, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @staticmethod
    def now_mb() -> float:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("RssAnon:")) / 1024

    def _run(self):
        while not self.stop.wait(self.every):
            self.peak = max(self.peak, self.now_mb())

    def done(self) -> float:
        self.stop.set()
        self.thread.join()
        return max(self.peak, self.now_mb())


def measured(fn) -> dict:
    base, anon_base = rss_now_mb(), AnonPeak.now_mb()
    sampler = AnonPeak()
    cpu, t = time.process_time(), time.perf_counter()
    fn()
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    return {"seconds": seconds, "cpu": cpu, "peak_mb": peak_rss_mb(), "base_mb": base, "anon_peak_mb": sampler.done() - anon_base}


# --- steps, each run in its own process --------------------------------------------------


def build(hf_dir: str) -> dict:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**MODEL)).eval()
    model.save_pretrained(hf_dir)
    return {"params": sum(p.numel() for p in model.parameters())}


def _import_conversion():
    """conversion plus orbax, which conversion imports lazily: loaded before the clock starts,
    so no row pays an import the others do not."""
    import orbax.checkpoint  # noqa: F401

    from hybridjax import conversion

    return conversion


def step_load(path: str, dtype: str | None) -> dict:
    import jax
    import numpy as np

    conversion = _import_conversion()

    def load_and_touch():
        params = jax.block_until_ready(conversion.load(path, dtype=dtype)[1])
        for x in jax.tree_util.tree_leaves(params):  # one byte a page: a mapped page is read when touched
            np.asarray(x).reshape(-1).view(np.uint8)[::4096].sum()

    return measured(load_and_touch)


def step_ocdbt(ckpt: str, out: str) -> dict:
    """A copy of a converted checkpoint with its params in orbax's OCDBT layout (the earlier format)."""
    import orbax.checkpoint as ocp

    conversion = _import_conversion()
    _, params = conversion.load(ckpt)
    shutil.copytree(ckpt, out, ignore=shutil.ignore_patterns("params"), dirs_exist_ok=True)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False)
    ocp.Checkpointer(handler).save((Path(out) / "params").absolute(), args=ocp.args.PyTreeSave(params), force=True)
    return {}


def step_convert(src: str, out: str, dtype: str | None) -> dict:
    conversion = _import_conversion()

    return measured(lambda: conversion.convert_hf(src, out, dtype=dtype, force=True))


def step_export(ckpt: str, out: str) -> dict:
    conversion = _import_conversion()

    return measured(lambda: conversion.export_hf(ckpt, out, force=True))


STEPS = {"build": build, "load": step_load, "convert": step_convert, "export": step_export, "ocdbt": step_ocdbt}


def child(name: str, *args) -> dict:
    """Run one step in a fresh interpreter; it prints its result as the last line of JSON."""
    code = (f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'benchmarks')!r});"
            f"import bench_convert as b; print(json.dumps(b.STEPS[{name!r}](*{list(args)!r})))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode:
        sys.exit(f"step {name} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def dir_mb(d: Path) -> float:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, help="where to build the model (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_convert_"))
    work.mkdir(parents=True, exist_ok=True)
    hf, ck32, ck16, back = work / "hf", work / "ckpt_f32", work / "ckpt_bf16", work / "hf_back"
    old32 = work / "ckpt_f32_ocdbt"
    try:
        if not (hf / "config.json").is_file():
            t = time.perf_counter()
            n = child("build", str(hf))["params"]
            print(f"built random Qwen3.5 ({n / 1e6:.0f} M params, {dir_mb(hf):.0f} MiB float32) in {time.perf_counter() - t:.0f} s")
        rows = [
            ("convert HF -> ckpt (float32)", child("convert", str(hf), str(ck32), None)),
            ("convert HF -> ckpt (bfloat16)", child("convert", str(hf), str(ck16), "bfloat16")),
            ("convert ckpt -> HF (float32)", child("export", str(ck32), str(back))),
        ]
        child("ocdbt", str(ck32), str(old32))
        rows += [
            ("load HF dir (float32)", child("load", str(hf), None)),
            ("load ckpt (float32)", child("load", str(ck32), None)),
            ("load ckpt, OCDBT (float32)", child("load", str(old32), None)),
            ("load HF dir -> bfloat16", child("load", str(hf), "bfloat16")),
            ("load ckpt (bfloat16)", child("load", str(ck16), None)),
        ]
        print(f"\nmodel files: HF {dir_mb(hf):.0f} MiB, ckpt float32 {dir_mb(ck32):.0f} MiB, ckpt bfloat16 {dir_mb(ck16):.0f} MiB")
        print(f"{'step':32s} {'wall s':>7s} {'cpu s':>6s} {'peak RSS MiB':>13s} {'- after imports':>16s} {'peak anon MiB':>14s}")
        for name, r in rows:
            print(f"{name:32s} {r['seconds']:7.2f} {r['cpu']:6.2f} {r['peak_mb']:13.0f} {r['peak_mb'] - r['base_mb']:16.0f}"
                  f" {r['anon_peak_mb']:14.0f}")
        r = dict(rows)
        for what in ("seconds", "cpu"):
            f32 = r["load HF dir (float32)"][what] / r["load ckpt (float32)"][what]
            bf16 = r["load HF dir -> bfloat16"][what] / r["load ckpt (bfloat16)"][what]
            mapped = r["load ckpt, OCDBT (float32)"][what] / r["load ckpt (float32)"][what]
            print(f"load speed-up ({'wall' if what == 'seconds' else 'cpu'}): checkpoint vs HF dir float32 {f32:.1f}x, "
                  f"bfloat16 {bf16:.1f}x; mapped vs OCDBT layout float32 {mapped:.1f}x")
        print(f"machine load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
              " (wall times stretch with it; cpu times much less)")
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
