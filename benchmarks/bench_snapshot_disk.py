"""The disk tier's costs (hybridjax.snapshot_disk): write throughput, how far the writer lags
behind the engine, restart time, and a disk hit against a cold prefill.

    python benchmarks/bench_snapshot_disk.py [--prompts 24] [--tokens 600] [--dir /tmp/hjx-disk]

Serves `--prompts` distinct prompts of about `--tokens` tokens on the embedded default model with
a disk tier, then reports: the writer's throughput (bytes and snapshots written per second of its
own time), the lag (seconds from the last request's answer until everything is durable), the
restart (opening the manifest, compiling the page programs), and the time to first token of a
prompt served from disk against the same prompt cold (the disk hit's greedy tokens must equal cold's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

from hybridjax.default_model import default_model
from hybridjax.engine import Engine, GenerationRequest
from hybridjax.prefix_cache import SnapshotStore
from hybridjax.snapshot_disk import attach_disk, detach_disk


def _engine() -> Engine:
    cfg, params, tok = default_model()
    return Engine(cfg, params, tok, store=SnapshotStore("bench-disk", max_bytes=1 << 30), slots=4, max_len=2048,
                  checkpoint_interval=256)


def _ask(eng: Engine, prompt: list[int], n: int = 4):
    t0 = time.perf_counter()
    h = eng.submit(GenerationRequest(list(prompt), n))
    first = None
    for _ in h.events(timeout=600):
        if first is None:
            first = time.perf_counter() - t0
    return h, first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--dir", default="/tmp/hjx-bench-disk")
    args = ap.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    tok = default_model()[2]
    prompts = [tok.encode((f"Prompt {i}: " + "the quick brown fox jumps over the lazy dog. " * 200))[: args.tokens]
               for i in range(args.prompts)]

    eng = _engine()
    attach_disk(eng, args.dir)
    eng.start()
    _ask(eng, prompts[0][:40])  # compile outside the measurement
    for p in prompts:
        _ask(eng, p)
    t_last = time.perf_counter()
    eng.store.disk.flush()
    lag = time.perf_counter() - t_last
    eng.stop()
    stats = detach_disk(eng).stats()
    mb = stats["bytes_written"] / 2**20
    print(f"written: {stats['snapshots_written']} snapshots, {stats['pages_written']} pages, {mb:.1f} MB in "
          f"{stats['batches']} batches; writer time {stats['write_seconds']:.2f} s "
          f"({mb / stats['write_seconds']:.1f} MB/s, {stats['snapshots_written'] / stats['write_seconds']:.0f} "
          f"snapshots/s); durable {lag:.3f} s after the last answer")

    cold_eng = _engine()  # no disk tier: the cold path, on the same programs
    cold_eng.start()
    _ask(cold_eng, prompts[0][:40])
    cold_h, cold_ttft = _ask(cold_eng, prompts[-1])
    cold_eng.stop()

    eng = _engine()
    t0 = time.perf_counter()
    tier = attach_disk(eng, args.dir)
    opened = time.perf_counter() - t0
    eng.start()
    _ask(eng, prompts[0][:40])
    h, ttft = _ask(eng, prompts[-1])
    eng.stop()
    detach_disk(eng)
    assert h.cache_report.source == "disk" and h.token_ids == cold_h.token_ids, (h.cache_report, h.token_ids)
    print(f"restart: {len(tier.index.entries)} records, {tier.index.nbytes / 2**20:.1f} MB on disk, "
          f"attach (manifest + page programs) {opened:.2f} s")
    print(f"time to first token, {len(prompts[-1])}-token prompt: disk hit {ttft * 1e3:.1f} ms, "
          f"cold {cold_ttft * 1e3:.1f} ms (same greedy tokens); load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
