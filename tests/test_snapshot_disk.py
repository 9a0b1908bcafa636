"""The prefix cache's disk tier (hybridjax.snapshot_disk, issue 26 item 2).

Snapshots are written as they are stored, with an fsync'd append-only manifest, so a kill -9 loses
at most what the writer had not finished; a restart restores the rest, and a snapshot evicted from
memory comes back from disk on a hit. Every restored or disk-tier snapshot is checked the one way
that matters: the request that uses it gives the cold path's greedy tokens (`engine_helpers.cold`,
or a server without a prefix cache), token for token.

The in-process "crash": an engine whose writer has made its queue durable (`flush`) and is then
dropped without closing, which is the state a kill -9 leaves once the writer caught up; the real
kill -9 of a `hybridjax serve` process is tested too (`test_kill_9_mid_traffic_...`).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import ENGINE_KW, cold, enc, ids, run, serve_cold_checked
from test_server import RunningServer, free_port

from hybridjax.default_model import DEFAULT_NAME, TINY_NAME, default_model, tiny_test_model
from hybridjax.engine import Engine
from hybridjax.prefix_cache import SnapshotStore, _read_file, _write_file
from hybridjax import cli, snapshot_disk
from hybridjax.snapshot_disk import MAGIC, FormatRefused, attach_disk, decode_records, detach_disk, encode_record

MODEL_ID = "disk-tier"
NEW = 6
PROMPTS = [ids(f"{c} durable prompt, side") for c in "ABCDEF"]


def _engine(**store_kw) -> Engine:
    cfg, params, tok = tiny_test_model()
    return Engine(cfg, params, tok, store=SnapshotStore(MODEL_ID, policy="lru", **store_kw), checkpoint_interval=16,
                  **ENGINE_KW)


def _serve_then_crash(directory, prompts, **store_kw) -> Engine:
    """Serve `prompts` with a disk tier, let the writer catch up, and drop the engine unclosed."""
    eng = _engine(**store_kw)
    attach_disk(eng, directory)
    serve_cold_checked(eng, prompts, NEW)
    assert eng.store.disk.flush(60)
    return eng


def _restart(directory, **store_kw) -> Engine:
    eng = _engine(**store_kw)
    attach_disk(eng, directory)
    assert len(eng.store) == 0  # restored lazily: everything comes back as a disk hit
    return eng


def _every_disk_snapshot_answers_cold(eng: Engine) -> int:
    """Ask for exactly the tokens of each snapshot on disk: an exact hit from disk, cold's tokens."""
    entries = [e.tokens for e in eng.store.disk.index.entries.values()]
    eng.start()
    try:
        for tokens in entries:
            h = run(eng, list(tokens), 3)
            assert (h.cached_tokens, h.cache_report.source) == (len(tokens), "disk"), (len(tokens), h.cache_report)
            assert h.token_ids == cold(list(tokens), 3), f"a disk snapshot of {len(tokens)} tokens answers wrong"
    finally:
        eng.stop()
        detach_disk(eng)
    return len(entries)


def test_every_snapshot_written_before_a_crash_is_restored_and_answers_cold(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_disk, "PAGE_CHUNK", 1)  # a snapshot's pages move in several chunks
    a = _serve_then_crash(tmp_path, PROMPTS[:3])
    written = a.store.disk.counters["snapshots_written"]
    assert written == a.store.counters["inserts"] > 0
    b = _restart(tmp_path)
    assert len(b.store.disk.index.entries) == written
    assert _every_disk_snapshot_answers_cold(b) == written



def test_a_disk_hit_read_ahead_is_what_the_engine_thread_uses(tmp_path):
    """`Engine.prefetch` (a request's thread) reads the disk snapshot; the engine thread's lookup
    takes it and reads no file, and the answer is still the cold path's."""
    _serve_then_crash(tmp_path, PROMPTS[:1])
    b = _restart(tmp_path)
    prompt = PROMPTS[0] + enc(" and more?")
    assert b.prefetch(prompt) and len(b.store._fetched) == 1

    def no_read(*a, **k):
        raise AssertionError("the engine thread read the disk")

    b.store.disk.fetch = no_read
    b.start()
    try:
        h = run(b, prompt, 3)
    finally:
        b.stop()
        del b.store.disk.fetch
        detach_disk(b)
    assert h.cache_report.source == "disk" and h.cached_tokens == len(PROMPTS[0])
    assert not b.store._fetched and h.token_ids == cold(prompt, 3)


def test_a_torn_manifest_tail_is_ignored_and_the_records_before_it_restore(tmp_path, caplog):
    a = _serve_then_crash(tmp_path, PROMPTS[:2])
    written = len(a.store.disk.index.entries)
    manifest = tmp_path / MODEL_ID / "manifest"
    data = manifest.read_bytes()
    records, used = decode_records(data[len(MAGIC):])
    assert used == len(data) - len(MAGIC) and len(records) == written + 1  # the header, then one put each
    manifest.write_bytes(data[:-25])  # a kill -9 in the middle of appending the last record
    with caplog.at_level(logging.WARNING, logger="hybridjax.prefix_cache"):
        b = _restart(tmp_path)
    assert "cut-short record" in caplog.text, caplog.text
    assert len(b.store.disk.index.entries) == written - 1
    # The restart rewrote the manifest without the tail, and deleted the files only the torn record named.
    assert decode_records(manifest.read_bytes()[len(MAGIC):])[1] == len(manifest.read_bytes()) - len(MAGIC)
    assert len(list((tmp_path / MODEL_ID / "states").iterdir())) == written - 1
    assert _every_disk_snapshot_answers_cold(b) == written - 1


def test_a_damaged_disk_snapshot_is_never_served(tmp_path, caplog):
    _serve_then_crash(tmp_path, PROMPTS[:1])
    b = _restart(tmp_path)
    for page in (tmp_path / MODEL_ID / "pages").iterdir():  # one flipped byte in every page file
        raw = bytearray(page.read_bytes())
        raw[-1] ^= 1
        page.write_bytes(bytes(raw))
    b.start()
    try:
        with caplog.at_level(logging.WARNING, logger="hybridjax.prefix_cache"):
            h = run(b, PROMPTS[0], NEW)
        assert h.token_ids == cold(PROMPTS[0], NEW)
        assert h.cache_report.source != "disk" and h.cached_tokens == 0
        assert "is unreadable" in caplog.text
    finally:
        b.stop()
        detach_disk(b)


def test_the_disk_budget_holds_and_no_file_outlives_its_records(tmp_path, caplog):
    budget = 60_000  # bytes: about two conversations of the tiny model
    a = _serve_then_crash(tmp_path, PROMPTS, disk_bytes=budget)
    tier = a.store.disk
    root = tmp_path / MODEL_ID
    on_disk = sum(f.stat().st_size for sub in ("pages", "states") for f in (root / sub).iterdir())
    assert tier.counters["disk_evictions"] > 0
    assert on_disk == tier.index.nbytes <= budget, (on_disk, tier.index.nbytes)
    assert {f.name for f in (root / "states").iterdir()} == set(tier.index.entries)
    assert {f.name for f in (root / "pages").iterdir()} == {p.hex() for p in tier.index.page_refs}
    with caplog.at_level(logging.WARNING, logger="hybridjax.prefix_cache"):
        b = _restart(tmp_path, disk_bytes=budget)
    # An evicted snapshot's put record precedes its del: its files are rightly gone, and not a loss.
    assert "files that are gone" not in caplog.text, caplog.text
    assert set(b.store.disk.index.entries) == set(tier.index.entries)
    # The answers below are written to disk too; under this budget their writes would evict the
    # entries still to be asked (least recently used first), so the check runs with room to spare.
    b.store.disk.max_bytes = 1 << 30
    _every_disk_snapshot_answers_cold(b)


def test_bfloat16_pages_and_states_read_back(tmp_path):
    # A bfloat16 model's pages are bfloat16 (an ml_dtypes type): they must load, bit for bit.
    k = np.asarray(jnp.arange(12, dtype=jnp.float32).reshape(1, 3, 4), dtype=jnp.bfloat16)
    digest = _write_file(tmp_path / "page", {"k": (k,), "v": (k,)}, sync=True)
    back = _read_file(tmp_path / "page", digest=digest)["k"][0]
    assert back.dtype == k.dtype and back.tobytes() == k.tobytes()


def test_a_format_3_directory_is_read_and_converted(tmp_path):
    old = _engine()
    old.start()
    try:
        for p in PROMPTS[:2]:
            run(old, p, NEW)
    finally:
        old.stop()
    saved = old.save_snapshots(tmp_path)  # what a clean shutdown of an earlier version left
    assert saved > 0 and list(tmp_path.glob("*.snapshot"))
    eng = _engine()
    attach_disk(eng, tmp_path)
    assert not list(tmp_path.glob("*.snapshot")) and not list(tmp_path.glob("*.pages"))  # converted, then gone
    assert len(eng.store.disk.index.entries) == saved
    detach_disk(eng)
    assert _every_disk_snapshot_answers_cold(_restart(tmp_path)) == saved


def test_a_manifest_of_another_format_is_refused_and_left_untouched(tmp_path):
    root = tmp_path / MODEL_ID
    root.mkdir()
    manifest = MAGIC + encode_record({"op": "header", "version": 5, "model_id": MODEL_ID})
    (root / "manifest").write_bytes(manifest)
    with pytest.raises(FormatRefused, match="is snapshot format 5 .* this server reads format 4"):
        attach_disk(_engine(), tmp_path)
    assert (root / "manifest").read_bytes() == manifest
    # pages of another size (a restart with another --page-size) would not fit the pool
    manifest = MAGIC + encode_record({"op": "header", "version": 4, "model_id": MODEL_ID, "page_tokens": 64})
    (root / "manifest").write_bytes(manifest)
    with pytest.raises(FormatRefused, match="holds KV pages of 64 tokens; this server's pages hold 16: serve with "
                                            "--page-size 64"):
        attach_disk(_engine(), tmp_path)
    assert (root / "manifest").read_bytes() == manifest


def test_the_disk_budget_without_a_directory_is_a_one_line_error(capsys):
    assert cli.main(["serve", "--prefix-cache-disk-mb", "10"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hybridjax serve: error: --prefix-cache-disk-mb needs --prefix-cache-dir (the directory the "
                   "disk tier lives in)"], err


def test_the_manifest_is_compacted_when_dead_records_dominate(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_disk, "COMPACT_AFTER", 0)
    a = _serve_then_crash(tmp_path, PROMPTS[:2])
    tier = a.store.disk
    keep = next(iter(tier.index.entries.values()))
    gone = [e for e in tier.index.entries.values() if e is not keep]
    for e in gone:  # what the store does when a conversation moves past its snapshots
        tier.superseded(e.namespace, e.tokens)
    assert tier.flush(60) and tier.counters["manifest_rewrites"] >= 1
    records, _ = decode_records((tmp_path / MODEL_ID / "manifest").read_bytes()[len(MAGIC):])
    assert [r["op"] for r in records] == ["header", "put"] and records[1]["name"] == keep.name
    assert [f.name for f in (tmp_path / MODEL_ID / "states").iterdir()] == [keep.name]
    b = _restart(tmp_path)
    assert list(b.store.disk.index.entries) == [keep.name]
    assert _every_disk_snapshot_answers_cold(b) == 1


# --- the server ------------------------------------------------------------------------------------


def _chat(server_url: str, messages: list[dict], model: str = DEFAULT_NAME, max_tokens: int = 8) -> dict:
    r = httpx.post(server_url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _report(out: dict) -> dict:
    return out["usage"]["prompt_tokens_details"]["prefix_cache"]


def test_a_snapshot_evicted_from_memory_comes_back_from_disk(tmp_path):
    # About two snapshots fit in memory: three other conversations push the first one out.
    s = RunningServer(slots=2, max_len=512, warmup=False, cache_dir=str(tmp_path), cache_mb=0.1,
                      checkpoint_interval=0)
    try:
        first = [{"role": "user", "content": "Tell me about the disk tier."}]
        a1 = _chat(s.url, first, TINY_NAME)
        for other in ("What is a page?", "Why fsync?", "Name a prime."):
            _chat(s.url, [{"role": "user", "content": other}], TINY_NAME)
        prompt = s.engine.tokenizer.encode(s.engine.tokenizer.render_chat(first, add_generation_prompt=True))
        assert not [x for x in s.store.snapshots() if tuple(prompt[:len(x.tokens)]) == x.tokens[:len(prompt)]]
        assert s.store.disk.flush(60)
        a2 = _chat(s.url, first, TINY_NAME)
        assert _report(a2) == {"matched_tokens": len(prompt), "source": "disk", "reason": "hit"}
        assert a2["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
        assert a2["choices"][0]["message"] == a1["choices"][0]["message"]  # a1 was the cold answer
        assert s.metric("hybridjax_prefix_cache_disk_hits_total") >= 1
        assert 0 < s.metric("hybridjax_prefix_cache_disk_bytes") <= 4096 * 2**20
    finally:
        s.stop()


def _serve_process(directory: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridjax.cli", "serve", "--prefix-cache-dir", str(directory),
                             "--port", str(port), "--no-warmup", "--no-compile-cache", "--max-len", "1024",
                             "--checkpoint-interval", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_ready(proc: subprocess.Popen, url: str) -> None:
    deadline = time.time() + 300
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not come up")


def test_kill_9_mid_traffic_then_restart_the_next_turn_is_a_disk_hit_equal_to_cold(tmp_path):
    turn1 = [{"role": "user", "content": "Remember the number 4096, please."}]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve_process(tmp_path, port)
    try:
        _wait_ready(proc, url)
        answer = _chat(url, turn1)["choices"][0]["message"]["content"]
        for i in range(4):  # more traffic, the last of it still running when the process dies
            _chat(url, [{"role": "user", "content": f"Unrelated question {i}."}])
        time.sleep(1.5)  # the writer's about-one-second window
        burst = [subprocess.Popen([sys.executable, "-c", (
            "import httpx,sys; httpx.post(sys.argv[1], json={'model': sys.argv[3], 'max_tokens': 64, "
            "'messages': [{'role': 'user', 'content': sys.argv[2]}]}, timeout=60)"),
            url + "/v1/chat/completions", f"in flight {i}", DEFAULT_NAME], stderr=subprocess.DEVNULL) for i in range(3)]
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        for b in burst:
            b.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Which number was it?"}]
    proc = _serve_process(tmp_path, port)
    try:
        _wait_ready(proc, url)
        warm = _chat(url, turn2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    report = _report(warm)
    assert report["source"] == "disk" and report["matched_tokens"] > 0, report
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == report["matched_tokens"]
    cold_server = RunningServer(model=(DEFAULT_NAME, default_model()), slots=4, max_len=1024, warmup=False,
                                prefix_cache=False)
    try:
        assert _chat(cold_server.url, turn2)["choices"][0]["message"] == warm["choices"][0]["message"]
    finally:
        cold_server.stop()
