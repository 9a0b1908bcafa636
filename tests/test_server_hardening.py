"""The server against hostile or careless clients (issue 14, part 1), over real HTTP with httpx,
http.client and the openai client: body size, prompt length checked before tokenizing,
tokenizing off the event loop, 400s naming the field for values a client controls (also before a
stream starts), 500s that keep the connection, abandoned requests cancelled, ports validated.

One server for the module, compiled on demand (no warm-up): its shapes are test_server's, so
in one process they are compiled once."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import re
import threading
import time

import httpx
import pytest
from test_server import MODEL, RunningServer

from hybridjax import cli

LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def server():
    s = RunningServer(slots=4, max_len=512, warmup=False, max_body_bytes=LIMIT)
    yield s
    s.stop()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def raw_post(server, path, raw: bytes, **kw):
    return httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=120, **kw)


def is_openai_error(r, status, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_a_body_over_the_limit_is_a_413(server):
    big = json.dumps({"model": MODEL, "prompt": "x" * (LIMIT + 10), "max_tokens": 1}).encode()
    err = is_openai_error(raw_post(server, "/v1/completions", big), 413)
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]

    def chunked():  # no content-length: the limit holds while reading
        for i in range(0, len(big), 16384):
            yield big[i:i + 16384]

    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"},
                   timeout=120)
    is_openai_error(r, 413)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(server, monkeypatch):
    tok = server.engine.tokenizer
    calls = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    long = "y" * 200_000  # under the body limit, 400x the context
    err = is_openai_error(post(server, "/v1/completions", {"model": MODEL, "prompt": long, "max_tokens": 1}), 400,
                          "prompt")
    assert err["code"] == "context_length_exceeded"
    body = {"model": MODEL, "messages": [{"role": "user", "content": long}], "max_tokens": 1}
    assert is_openai_error(post(server, "/v1/chat/completions", body), 400, "messages")["code"] == "context_length_exceeded"
    assert calls == []  # neither was tokenized
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "short", "max_tokens": 1})
    assert r.status_code == 200 and calls  # a prompt that may fit is


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    """While one request's prompt is being tokenized (held here), /health still answers."""
    tok = server.engine.tokenizer
    entered, release = threading.Event(), threading.Event()
    real = tok.encode

    def slow_encode(text, *a, **k):
        if "SLOW" in text:
            entered.set()
            release.wait(20)
        return real(text, *a, **k)

    monkeypatch.setattr(tok, "encode", slow_encode)
    with cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, server, "/v1/completions", {"model": MODEL, "prompt": "SLOW one", "max_tokens": 1})
        assert entered.wait(30)
        try:
            t0 = time.perf_counter()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            assert time.perf_counter() - t0 < 5  # on the event loop it would wait for the release (20 s)
        finally:
            release.set()
        assert pending.result().status_code == 200


BAD_VALUES = [  # (field, value as JSON text): each a 400 naming the field, never a 500
    ("seed", "-2"), ("seed", str(2**32)), ("top_k", str(2**31)), ("repetition_penalty", "1e-300"),
    ("repetition_penalty", "Infinity"), ("temperature", "NaN"), ("top_p", "-Infinity"), ("max_tokens", "0"),
    ("n", "0"), ("logprobs", "21"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_client_controlled_values_are_400s_naming_the_field(server, stream):
    for field, value in BAD_VALUES:
        raw = ('{"model": "%s", "prompt": "hello", "max_tokens": 2, "stream": %s, "%s": %s}'
               % (MODEL, json.dumps(stream), field, value))
        r = raw_post(server, "/v1/completions", raw.encode())
        is_openai_error(r, 400, field)  # a stream too: validated before it starts
    # lone surrogates, in a prompt and in a message
    r = raw_post(server, "/v1/completions", b'{"model": "%s", "prompt": "a\\ud800", "stream": %s}'
                 % (MODEL.encode(), json.dumps(stream).encode()))
    is_openai_error(r, 400, "prompt")
    r = raw_post(server, "/v1/chat/completions",
                 b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udc00b"}]}' % MODEL.encode())
    is_openai_error(r, 400, "messages.0.content")


def test_seed_minus_one_means_random(server):
    outs = set()
    for _ in range(3):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Random seed", "max_tokens": 8, "seed": -1,
                                             "temperature": 1.0})
        assert r.status_code == 200
        outs.add(r.json()["choices"][0]["text"])
    assert len(outs) > 1


def test_malformed_json_is_a_400(server):
    deep = b'{"model": "x", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    assert "nested too deeply" in is_openai_error(raw_post(server, "/v1/completions", deep), 400)["message"]
    deeper = b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # more values than any prompt
    assert "JSON values" in is_openai_error(raw_post(server, "/v1/completions", deeper), 413)["message"]
    huge = b'{"model": "%s", "prompt": "x", "max_tokens": %s}' % (MODEL.encode(), b"9" * 5000)
    is_openai_error(raw_post(server, "/v1/completions", huge), 400)
    is_openai_error(raw_post(server, "/v1/completions", b"\xff\xfe{"), 400)
    is_openai_error(raw_post(server, "/v1/completions", b"[1, 2]"), 400)


def test_an_unexpected_error_is_a_500_that_keeps_the_connection(server, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("internal detail")

    monkeypatch.setattr(server.engine.tokenizer, "encode", boom)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        body = json.dumps({"model": MODEL, "prompt": "boom", "max_tokens": 1})
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        r = conn.getresponse()
        payload = json.loads(r.read())
        assert r.status == 500 and payload["error"]["type"] == "server_error"
        assert "internal detail" not in json.dumps(payload)
        assert (r.getheader("connection") or "").lower() != "close"
        sock = conn.sock
        assert sock is not None  # the client keeps it: the server did not ask to close
        monkeypatch.undo()
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
        assert conn.sock is sock  # the same connection served the next request
    finally:
        conn.close()


def test_a_non_streaming_request_is_cancelled_when_its_client_leaves(server):
    """The worker is paused, so the request waits in the queue while its client gives up;
    when the worker runs again the request is dropped as cancelled: no token is generated."""
    eng = server.engine
    before_cancelled = server.metric('hybridjax_requests_finished_total{reason="cancelled"}')
    before_tokens = server.metric("hybridjax_tokens_generated_total")
    eng.stop()
    try:
        with pytest.raises(httpx.ReadTimeout):
            post_timeout = httpx.Timeout(30, read=1.0)
            httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "abandon", "max_tokens": 300},
                       timeout=post_timeout)
        deadline = time.time() + 30
        while not (eng._waiting and all(h.cancelled.is_set() for h in list(eng._waiting))):
            assert time.time() < deadline, "the abandoned request was not cancelled"
            time.sleep(0.05)
    finally:
        eng.start()
    deadline = time.time() + 60
    while server.metric('hybridjax_requests_finished_total{reason="cancelled"}') < before_cancelled + 1:
        assert time.time() < deadline
        time.sleep(0.05)
    assert server.metric("hybridjax_tokens_generated_total") == before_tokens


def test_one_log_line_per_request(server, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="hybridjax.server"):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "log me", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "hybridjax.server"]
    assert any(re.fullmatch(r"completion: prompt 6 tokens \(cached \d+ from \w+: [^)]+\), generated 3, ttft [\d.]+ s, [\d.]+ tok/s, "
                            r"length", line) for line in lines), lines


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_serve_rejects_a_port_out_of_range(port, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--port", port])
    assert e.value.code == 2
    assert "--port" in capsys.readouterr().err
