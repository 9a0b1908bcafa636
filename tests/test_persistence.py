"""Persisted snapshots load with exactly the pages they were saved with, or not at all (issue 28).

Two ways a directory ends up with snapshot files beside a pages file they were not saved with:
a save killed between writing the pages file and the snapshot files (reproduced exactly: save,
serve more, save elsewhere, and put that second pages file in place of the first, which is the
state a kill -9 at that moment leaves), and two servers of one model saving into one directory.
After either, a fresh engine loads the directory and every snapshot it loaded is used for a
request whose greedy answer must equal the cold path's (`engine_helpers.cold`) token for token;
the snapshots whose pages are gone must be skipped with a warning. Around the directory, the
server: a second server on it is refused in one line, a failed write is one log line, and the
temporary files of a save cut short are removed at start.

Engines use the engine tests' configuration (`engine_helpers.ENGINE_KW`), so compiled programs
are shared; every prompt is 17..26 tokens, so a prompt plus its response stays in cold's range.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import pytest
from engine_helpers import ENGINE_KW, cold, ids, run, serve_cold_checked
from test_server import MODEL, RunningServer, free_port

from hybridjax import cli
from hybridjax.default_model import tiny_test_model
from hybridjax.engine import Engine
from hybridjax.prefix_cache import PAGES_SUFFIX, DirectoryInUse, SnapshotStore

MODEL_ID = "persist-binding"
NEW = 6  # tokens per first answer: a prompt of <= 26 tokens and its response snapshot fit in 32
# Different from their first token on, so no two share a page (or a 16-token checkpoint).
PROMPTS = [ids(f"{c} persisted prompt, side") for c in "ABCDE"]
OTHERS = [ids(f"{c} other server's prompt") for c in "VWXYZ"]


def _engine(**kw) -> Engine:
    cfg, params, tok = tiny_test_model()
    # LRU: the tests evict the oldest conversation (prompt 0's) by evicting until it is gone.
    return Engine(cfg, params, tok, store=SnapshotStore(MODEL_ID, policy="lru"), checkpoint_interval=16,
                  **{**ENGINE_KW, **kw})


def _check_against_cold(directory, prompts) -> int:
    """Load `directory` into a fresh engine; every loaded snapshot, asked for exactly its tokens,
    and every prompt must give the cold answer. Returns how many snapshots loaded."""
    eng = _engine()
    n = eng.load_snapshots(directory)
    loaded = [s.tokens for s in eng.store.snapshots()]
    assert len(loaded) == n
    eng.start()
    try:
        for tokens in loaded:  # each hits its own snapshot (an exact hit: no model call for the first token)
            h = run(eng, list(tokens), 3)
            assert h.cached_tokens == len(tokens), (len(tokens), h.cached_tokens)
            assert h.token_ids == cold(list(tokens), 3), f"a loaded snapshot of {len(tokens)} tokens answers wrong"
        for p in prompts:
            assert run(eng, p, NEW).token_ids == cold(p, NEW)
    finally:
        eng.stop()
    return n


def _conversation(store: SnapshotStore, prompt) -> list:
    """The snapshots of `prompt`'s conversation (its checkpoint, prompt and response)."""
    return [s for s in store.snapshots() if tuple(prompt[:len(s.tokens)]) == s.tokens[:len(prompt)]]


def test_a_save_cut_short_after_the_pages_file_loads_nothing_wrong(tmp_path, caplog):
    first, scratch = tmp_path / "cache", tmp_path / "second-save"
    a = _engine()
    serve_cold_checked(a, PROMPTS[:3], NEW)
    saved = a.save_snapshots(first)
    # Between the two saves prompt 0's snapshots go (their pages are freed and reused) and new
    # prompts are served: the second save's pages file has other pages at other positions.
    gone = _conversation(a.store, PROMPTS[0])
    assert gone and a.store.evict_until(lambda: not _conversation(a.store, PROMPTS[0]), "test")
    serve_cold_checked(a, PROMPTS[3:], NEW)
    a.save_snapshots(scratch)
    # kill -9 right after the second save renamed its pages file into place:
    shutil.copyfile(scratch / f"{MODEL_ID}{PAGES_SUFFIX}", first / f"{MODEL_ID}{PAGES_SUFFIX}")

    with caplog.at_level(logging.WARNING, logger="hybridjax.prefix_cache"):
        n = _check_against_cold(first, PROMPTS[:3])
    assert n == saved - len(gone) > 0  # prompts 1 and 2 still find their pages (by content); prompt 0's are skipped
    assert caplog.text.count("names pages that are not in") == len(gone), caplog.text


def test_two_servers_saving_into_one_directory_never_mix_their_pages(tmp_path, caplog):
    d = tmp_path / "shared"
    a, b = _engine(), _engine()
    serve_cold_checked(a, PROMPTS[:2], NEW)
    serve_cold_checked(b, OTHERS[:2], NEW)
    na = a.save_snapshots(d)
    nb = b.save_snapshots(d)  # replaces the pages file a's snapshots name
    with caplog.at_level(logging.WARNING, logger="hybridjax.prefix_cache"):
        n = _check_against_cold(d, PROMPTS[:2] + OTHERS[:2])
    assert n == nb and caplog.text.count("names pages that are not in") == na


# --- the server around the directory ----------------------------------------------------------


def test_a_second_server_on_the_directory_is_refused(tmp_path):
    d = str(tmp_path / "locked")
    s = RunningServer(slots=4, max_len=512, warmup=False, cache_dir=d)
    try:
        with pytest.raises(DirectoryInUse, match="is in use by another hybridjax server"):
            RunningServer(slots=4, max_len=512, warmup=False, cache_dir=d)
        # as an operator meets it: the CLI, in its own process, says so in one line before loading a model
        r = subprocess.run([sys.executable, "-m", "hybridjax.cli", "serve", "--prefix-cache-dir", d, "--port",
                            str(free_port()), "--no-warmup", "--no-compile-cache"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == cli.EXIT_ERROR and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1] == (f"hybridjax serve: error: the prefix cache directory {d} is in use "
                                                     "by another hybridjax server (one server per directory)"), r.stderr
        assert "loading" not in r.stderr
    finally:
        s.stop()
    RunningServer(slots=4, max_len=512, warmup=False, cache_dir=d).stop()  # released at shutdown


def test_a_failed_write_is_one_log_line_and_leaves_no_temporary_file(tmp_path, caplog):
    d = tmp_path / "cache"
    d.mkdir()
    (d / "cut-short.snapshot.tmp").write_bytes(b"half a file")  # what a killed format-3 save leaves
    s = RunningServer(slots=4, max_len=512, warmup=False, cache_dir=str(d))
    try:
        assert not (d / "cut-short.snapshot.tmp").exists()  # removed at start
        states = d / s.store.model_id / "states"
        states.rmdir()
        states.write_bytes(b"")  # the snapshot writer cannot write there any more
        with caplog.at_level(logging.INFO):
            for text in ("Save me if you can.", "And me, twice."):
                s.client.completions.create(model=MODEL, prompt=text, max_tokens=2)
            assert s.store.disk.flush(60)
    finally:
        with caplog.at_level(logging.INFO):
            s.stop()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert errors[0].exc_info is None and f"could not write snapshots to {d}" in errors[0].getMessage()
    assert "Not a directory" in errors[0].getMessage()
    assert not [p for p in d.rglob("*.tmp")]
