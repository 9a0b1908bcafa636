"""`hybridjax serve` across processes (issue 13): process 0 serves HTTP, process 1 replays its
engine steps (hybridjax.multihost), on a mesh spanning both.

Two processes x 2 host devices on 127.0.0.1 (jax.distributed, gloo collectives), mesh
`tensor=2,expert=2`: `tensor` is the first (slowest) axis, so the two tensor shards sit in
different processes and every layer's all-reduce crosses between them. The tiny test model
(saved as a model directory) is served with one slot; the answers must equal a one-device
engine's in this process, token for token (greedy and seeded sampling are deterministic, and
sharding only reorders float32 sums, ~1e-7 on logits far from ties on this model). Covered:
a cold prompt, an exact repeat (snapshot hit: no model call), a prompt extending the first (a
prefix hit: the snapshot's row state restored by number on the follower, its partial page
copied), a seeded sampled request, and a streamed one; then SIGTERM to process 0 stops both.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVE = ["--max-len", "128", "--page-size", "16", "--prefill-chunk", "16", "--slots", "1"]
ENGINE = dict(slots=1, max_len=128, page_size=16, prefill_chunk=16)
FIRST = "Hello world"
REQUESTS = [  # (prompt, max_tokens, temperature, seed)
    (FIRST, 12, 0.0, 0),
    (FIRST, 12, 0.0, 0),  # exact repeat
    (FIRST + "! How are you", 10, 0.0, 0),  # extends FIRST: prefix hit, partial page copied
    ("Sampled, seeded", 10, 0.9, 7),
]
STREAMED = ("A streamed request", 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(root: Path) -> Path:
    """The tiny test model as a directory `hybridjax serve --model` reads."""
    import hybridjax
    from hybridjax.default_model import TINY_CONFIG, tiny_test_model
    from hybridjax.tokenizer import save_tokenizer

    cfg, params, tok = tiny_test_model()
    d = root / "tiny"
    d.mkdir()
    hybridjax.save_hf(params, cfg, d)
    (d / "config.json").write_text(json.dumps({**TINY_CONFIG, "architectures": ["Qwen3_5ForCausalLM"]}))
    save_tokenizer(tok, d)
    return d


def reference() -> tuple[list[str], str]:
    """The same requests on a one-device engine in this process."""
    from hybridjax.default_model import tiny_test_model
    from hybridjax.engine import Engine, GenerationRequest

    cfg, params, tok = tiny_test_model()
    eng = Engine(cfg, params, tok, **ENGINE).start()
    try:
        def run(prompt, n, temperature=0.0, seed=0):
            req = GenerationRequest(tok.encode(prompt), max_tokens=n, temperature=temperature, seed=seed,
                                    stop_ids=tuple(tok.eos_token_ids) + tuple(cfg.eos_token_id))
            return eng.generate(req, timeout=300).text

        return [run(*r) for r in REQUESTS], run(*STREAMED)
    finally:
        eng.stop()


def _env() -> dict:
    flags = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=flags)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def test_two_processes_serve_as_one(tmp_path):
    d = model_dir(tmp_path)
    coordinator, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    logs = [open(tmp_path / f"p{i}.log", "w+") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "hybridjax.cli", "serve", "--model", str(d), "--port", str(port),
                               *SERVE, "--no-compile-cache", "--mesh", "tensor=2,expert=2",
                               "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2",
                               "--process-id", str(i)], env=_env(), stdout=logs[i], stderr=subprocess.STDOUT)
             for i in range(2)]

    def tail(i: int) -> str:
        logs[i].flush()
        return (tmp_path / f"p{i}.log").read_text()[-3000:]

    try:
        ref, ref_streamed = reference()  # while the two processes load and compile
        deadline = time.monotonic() + 300
        while True:
            assert all(p.poll() is None for p in procs), tail(0) + tail(1)
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready\n" + tail(0) + tail(1)
            time.sleep(0.5)

        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=t, seed=s).choices[0].text
               for p, n, t, s in REQUESTS]
        stream = client.completions.create(model="tiny", prompt=STREAMED[0], max_tokens=STREAMED[1], temperature=0,
                                           stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert got == ref
        assert streamed == ref_streamed
        assert all(len(t) > 0 for t in got)
        # The repeat was an exact hit and the extension a prefix hit (the paths replayed by number).
        assert "hybridjax_prefix_cache_exact_hits_total 1.0" in metrics, metrics
        assert "hybridjax_prefix_cache_hits_total 2.0" in metrics, metrics

        procs[0].send_signal(signal.SIGTERM)  # process 0 shuts down and tells process 1 to stop
        codes = [p.wait(timeout=90) for p in procs]
        assert codes == [128 + signal.SIGTERM, 0], tail(0) + tail(1)
        assert "process 0 stopped" in tail(1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for f in logs:
            f.close()


def test_a_follower_replays_the_engine_to_the_same_state():
    """In one process, on one device: an engine whose steps go through a StepLeader over a socket
    pair, and a Follower in a thread. After the test's requests (exact and prefix hits, and
    evictions from a two-entry store, whose row states process 0 releases), the follower made
    every call, its engine state equals the engine's bit for bit, and it holds exactly the row
    states process 0 still names."""
    import threading

    import jax
    import numpy as np

    from hybridjax.default_model import tiny_test_model
    from hybridjax.engine import Engine, GenerationRequest
    from hybridjax.multihost import Follower, StepLeader
    from hybridjax.prefix_cache import SnapshotStore

    cfg, params, tok = tiny_test_model()
    a, b = socket.socketpair()
    leader, follower, result = StepLeader([a]), Follower(cfg, params), []
    thread = threading.Thread(target=lambda: result.append(follower.run(b)), daemon=True)
    thread.start()
    store = SnapshotStore("replay", max_entries=2)
    eng = Engine(cfg, params, tok, store=store, calls=leader, **ENGINE).start()
    try:
        for prompt, n, temperature, seed in REQUESTS + [(p, 6, 0.0, 0) for p in ("one", "two", "three")]:
            eng.generate(GenerationRequest(tok.encode(prompt), max_tokens=n, temperature=temperature, seed=seed),
                         timeout=300)
    finally:
        eng.stop()
        leader.close()
        thread.join(timeout=60)
    assert result == [0]
    assert store.counters["evictions_entries"] > 0 and leader.calls == follower.calls > 20
    mine, theirs = jax.tree_util.tree_leaves(eng._state), jax.tree_util.tree_leaves(follower.state)
    assert len(mine) == len(theirs) and all(np.array_equal(x, y) for x, y in zip(mine, theirs))
    assert set(follower.handles) == set(leader._handle_of.values()) and follower.handles


def test_serve_across_processes_needs_a_mesh(capsys):
    from hybridjax.cli import main

    base = ["serve", "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"]
    assert main(base) == 1
    assert "needs --mesh" in capsys.readouterr().err
    assert main(base + ["--mesh", "tensor=2", "--prefix-cache-dir", "/tmp/x"]) == 1
    assert "--prefix-cache-dir" in capsys.readouterr().err


@pytest.mark.parametrize("obj", [os.system, eval, dict.fromkeys([1])])
def test_step_channel_refuses_classes_beyond_numpy(obj):
    """The step channel's unpickler builds numpy values and builtins only: a global such as
    os.system or eval is refused by name, plain data passes."""
    import io
    import pickle

    from hybridjax.multihost import _Unpickler

    payload = pickle.dumps(obj, protocol=5)
    if isinstance(obj, dict):
        assert _Unpickler(io.BytesIO(payload)).load() == obj
        return
    with pytest.raises(pickle.UnpicklingError, match="forbidden"):
        _Unpickler(io.BytesIO(payload)).load()
