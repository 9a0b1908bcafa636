"""Over real HTTP: the per-request cache report, and speculative decoding on cache hits.

The guarantee tested: greedy answers of a `--speculative-tokens K` server on cache hits (an exact
repeat, the next turn, an edit in the middle) equal the cold answers of a plain server without a
cache, token for token. The model is the tiny one built to accept drafts (engine_helpers); its
tokenizer is char-level, one token per character, so equal texts are equal tokens."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from engine_helpers import speculative_test_model
from test_server import free_port

from hybridjax.server import ServerConfig, create_app
from hybridjax.server.app import build_engine
from hybridjax.tokenizer import char_level_tokenizer

VOCAB, SCALE, K = 32, 0.3, 3
KW = dict(slots=4, max_len=128, page_size=16, prefill_chunk=16, warmup=False)
NAME = "spec-cache"
rng = np.random.RandomState(1)
P = rng.randint(0, VOCAB, 40).tolist()  # three prefill chunks, across pages


class Server:
    def __init__(self, model, **kw):
        cfg, params = model
        sc = ServerConfig(**KW, **kw)
        self.engine, self.store = build_engine(sc, cfg, params, char_level_tokenizer(), NAME)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(self.engine, NAME, warmup=False)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)

    def complete(self, prompt, max_tokens=12) -> dict:
        r = httpx.post(self.url + "/v1/completions", timeout=600, json={
            "model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def model():
    return speculative_test_model(VOCAB, SCALE)


@pytest.fixture(scope="module")
def servers(model):
    spec = Server(model, speculative_tokens=K, checkpoint_interval=16)
    plain = Server(model, prefix_cache=False)
    yield spec, plain
    spec.stop()
    plain.stop()


def report(out: dict) -> dict:
    details = out["usage"]["prompt_tokens_details"]
    assert details["prefix_cache"]["matched_tokens"] == details["cached_tokens"]
    return details["prefix_cache"]


def text(out: dict) -> str:
    return out["choices"][0]["text"]


def test_speculative_answers_on_cache_hits_equal_cold_plain_answers(servers):
    spec, plain = servers
    tok = char_level_tokenizer()
    first = spec.complete(P)
    assert report(first) == {"matched_tokens": 0, "source": "none", "reason": "new_prefix"}
    cold = plain.complete(P)
    assert report(cold) == {"matched_tokens": 0, "source": "none", "reason": "cache_off"}
    assert text(first) == text(cold)

    repeat = spec.complete(P)  # the prompt snapshot: its stored logits give the first token
    assert report(repeat) == {"matched_tokens": len(P), "source": "prompt", "reason": "hit"}
    assert text(repeat) == text(cold)

    turn2 = P + tok.encode(text(first)) + [5, 6, 7]  # the answer sent back, then new tokens
    warm = spec.complete(turn2)
    r = report(warm)
    assert r["reason"] == "hit" and r["source"] in ("response", "prompt") and r["matched_tokens"] >= len(P)
    assert text(warm) == text(plain.complete(turn2))

    edited = P[:25] + [(P[25] + 1) % VOCAB] + P[26:]  # an edit in the middle: the checkpoint at 16
    warm = spec.complete(edited)
    assert report(warm) == {"matched_tokens": 16, "source": "checkpoint", "reason": "below_checkpoint_grid"}
    assert text(warm) == text(plain.complete(edited))

    assert spec.engine.counters["spec_accepted_tokens"] > 0  # drafts were accepted along the way
    metrics = httpx.get(spec.url + "/metrics").text
    assert 'hybridjax_prefix_cache_requests_total{reason="hit"} 2.0' in metrics
    assert 'hybridjax_prefix_cache_requests_total{reason="below_checkpoint_grid"} 1.0' in metrics


def test_stream_reports_in_its_last_chunk_and_the_log_line(servers, caplog):
    spec, _ = servers
    spec.complete(P)  # stores P's checkpoint at 16 (if the test above has not)
    prompt = P[:20] + [1, 2, 3]
    caplog.set_level(logging.INFO, logger="hybridjax.server")
    with httpx.stream("POST", spec.url + "/v1/completions", timeout=600, json={
            "model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    r = report(chunks[-1])
    assert r["source"] in ("prompt", "checkpoint") and r["matched_tokens"] >= 16
    deadline = time.time() + 30  # the line is logged once the stream has ended
    while not (lines := [m.getMessage() for m in caplog.records if m.getMessage().startswith("completion stream:")]):
        assert time.time() < deadline, "no log line for the request"
        time.sleep(0.05)
    assert f"(cached {r['matched_tokens']} from {r['source']}: {r['reason']})" in lines[-1]
