"""No client can starve the others, and no input gives a 500 (issue 28), over real HTTP:

- echo + logprobs requests are scored in a lane of their own, bounded like the queue: a burst
  of them neither delays a plain request nor waits without end (429 past the bound);
- large bodies are parsed off the event loop, and a body of millions of tiny JSON values is
  refused before parsing (json.loads holds the GIL, so no thread would help);
- a silent connection, a trickled body and one connection too many are dropped or answered;
- a tiny top_p or temperature and a lone surrogate in a key are answered, never a 500;
- a client gone mid-body is one log line; requests failed in the engine are counted.

Servers run in this process without warm-up; their shapes are test_server's.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import select
import socket
import threading
import time

import httpx
import pytest
from test_server import MODEL, RunningServer

from hybridjax.server import lanes

MAX_QUEUE = 16
LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def server():
    s = RunningServer(slots=4, max_len=512, warmup=False, max_body_bytes=LIMIT, max_queue=MAX_QUEUE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded():
    """Short timeouts and room for 4 connections (it serves nothing that needs the model)."""
    s = RunningServer(slots=4, max_len=512, warmup=False, header_timeout_s=1.0, body_timeout_s=1.0,
                      max_connections=4)
    yield s
    s.stop()


def post(server, path, body, timeout=120):
    return httpx.post(server.url + path, json=body, timeout=timeout)


def raw_post(server, path, raw: bytes):
    return httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=120)


def error_of(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


# --- echo + logprobs ------------------------------------------------------------------------

BURST = 40  # more than the default thread pool's threads (at most 32): all of them, before


def test_an_echo_logprobs_burst_does_not_hold_up_a_plain_request(server, monkeypatch):
    """Scoring is held (an event) while 40 echo + logprobs requests arrive: 16 (the queue's
    bound) wait in the scoring lane, the rest are refused at once, and a plain request is
    answered meanwhile: it waited behind none of them. (Before, scoring ran on the threads that
    tokenize every request: the plain request waited for the whole burst.)"""
    entered, release = threading.Event(), threading.Event()
    real = server.engine.prompt_logprobs

    def held(*a, **k):
        entered.set()
        assert release.wait(120)
        return real(*a, **k)

    monkeypatch.setattr(server.engine, "prompt_logprobs", held)
    echo = {"model": MODEL, "prompt": "Score every token of this prompt.", "max_tokens": 1, "echo": True,
            "logprobs": 1, "temperature": 0}
    with cf.ThreadPoolExecutor(BURST) as pool:
        burst = [pool.submit(post, server, "/v1/completions", echo) for _ in range(BURST)]
        try:
            assert entered.wait(60)
            plain = post(server, "/v1/completions", {"model": MODEL, "prompt": "plain", "max_tokens": 2}, timeout=60)
            assert plain.status_code == 200 and not release.is_set()
            deadline = time.time() + 60  # every request past the lane's bound is refused while scoring is held
            while sum(f.done() for f in burst) < BURST - MAX_QUEUE:
                assert time.time() < deadline, sum(f.done() for f in burst)
                time.sleep(0.05)
            refused = [f.result() for f in burst if f.done()]
            assert len(refused) == BURST - MAX_QUEUE
            for r in refused:
                assert error_of(r, 429)["code"] == "queue_full"
        finally:
            release.set()
        answered = [f.result() for f in burst if f.result().status_code == 200]
    assert len(answered) == MAX_QUEUE
    lp = answered[0].json()["choices"][0]["logprobs"]
    assert lp["tokens"][0] == "S" and lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) > 30


# --- bodies ---------------------------------------------------------------------------------


def test_a_large_body_is_parsed_off_the_event_loop(server, monkeypatch):
    """While a large body is being parsed (held here), /health still answers."""
    entered, release = threading.Event(), threading.Event()
    real = lanes.decode_body

    def held(raw):
        if b"HOLD" in raw:
            entered.set()
            assert release.wait(60)
        return real(raw)

    monkeypatch.setattr(lanes, "decode_body", held)
    body = {"model": MODEL, "prompt": "HOLD", "max_tokens": 1, "user": "u" * (lanes.INLINE_BODY_BYTES + 1)}
    with cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, server, "/v1/completions", body)
        assert entered.wait(60)
        try:
            assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
            assert not pending.done()
        finally:
            release.set()
        assert pending.result().status_code == 200


def test_a_body_of_millions_of_tiny_values_is_refused_before_parsing(server):
    """An ignored field of empty arrays: under the size limit, over the bound on JSON values."""
    raw = b'{"model": "%s", "prompt": "x", "max_tokens": 1, "user": [%s[]]}' % (MODEL.encode(), b"[]," * 80_000)
    assert len(raw) < LIMIT
    err = error_of(raw_post(server, "/v1/completions", raw), 413)
    assert err["code"] == "request_too_large" and "JSON values" in err["message"]
    # an honest large body (a token-id prompt of the whole context) is parsed
    ids = [i % 100 + 1 for i in range(400)]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "user": "v" * 70_000})
    assert r.status_code == 200, r.text


# --- values the sampler must accept, messages that must encode -------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_tiny_sampling_values_are_accepted(server, stream):
    """Values validation lets through and float32 rounds to 0 or to a subnormal."""
    for extra in ({"top_p": 1e-300}, {"top_p": 5e-324, "temperature": 1.0},
                  {"temperature": 1e-40, "logprobs": 2}, {"temperature": 1e-300, "min_p": 1e-300}):
        body = {"model": MODEL, "prompt": "tiny values", "max_tokens": 3, "stream": stream, "seed": 1, **extra}
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, (extra, r.text)
        if stream:
            lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and not any('"error"' in ln for ln in lines), (extra, r.text)
        else:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length", extra


def test_a_lone_surrogate_in_a_key_is_a_400(server):
    for raw in (b'{"model": "%s", "prompt": "x", "\\ud800": 1}' % MODEL.encode(),
                b'{"model": "%s", "messages": [{"role": "user", "content": "x", "\\udc00k": "y"}]}' % MODEL.encode()):
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        err = error_of(raw_post(server, path, raw), 400)
        assert "lone surrogate" in err["message"] and "\\ud" in err["param"], err


# --- failures are counted, disconnects are one line --------------------------------------------


def test_a_request_that_fails_in_the_engine_is_counted(server, monkeypatch):
    before = server.metric('hybridjax_requests_finished_total{reason="error"}')

    def boom(*a, **k):
        raise RuntimeError("admission broke")

    monkeypatch.setattr(server.engine.loop, "_start", boom)  # admission (hybridjax.engine.DeviceLoop)
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "fail me", "max_tokens": 2})
    assert error_of(r, 500)["type"] == "server_error"
    monkeypatch.undo()
    assert server.metric('hybridjax_requests_finished_total{reason="error"}') == before + 1


def test_a_client_gone_mid_body_is_one_log_line(server, caplog):
    with caplog.at_level(logging.INFO, logger="hybridjax.server"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 1000\r\n\r\n{\"model\": ")
        deadline = time.time() + 30
        while "disconnected before sending its whole body" not in caplog.text:
            assert time.time() < deadline, caplog.text
            time.sleep(0.05)
    ours = [r for r in caplog.records if r.name == "hybridjax.server"]
    assert not [r for r in ours if r.exc_info or r.levelno >= logging.ERROR], [r.getMessage() for r in ours]


def test_a_client_that_half_closes_after_sending_gets_its_answer(server):
    body = json.dumps({"model": MODEL, "prompt": "half closed", "max_tokens": 3, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        s.shutdown(socket.SHUT_WR)  # done sending, still listening
        reply = _closed_within(s, 120)
    final = reply[reply.index(b"HTTP/1.1 200 "):]  # after an interim 100 Continue, if any
    answer = json.loads(final.split(b"\r\n\r\n", 1)[1])
    assert answer["usage"]["completion_tokens"] == 3


# --- slow, silent and too many connections -------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection (fails if it stays open)."""
    sock.settimeout(seconds)
    data = b""
    while True:
        chunk = sock.recv(65536)  # socket.timeout here: the server held the connection
        if not chunk:
            return data
        data += chunk


def test_a_silent_connection_is_closed(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        assert _closed_within(s, 30) == b""
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:  # headers that never end
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        assert _closed_within(s, 30) == b""


def test_a_trickled_body_is_dropped_with_a_408(guarded):
    """The client still trickles as the server answers: the server must drain it (a lingering
    close), else closing with its bytes unread resets the connection under the client's read
    (without the drain, two of three tries failed here)."""
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", guarded.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 1000000\r\n\r\n{")
            deadline = time.time() + 30
            while not select.select([s], [], [], 0.0002)[0]:  # a byte every 0.2 ms: it would take 200 s
                assert time.time() < deadline, "the trickling client was never dropped"
                s.sendall(b" ")
            reply = _closed_within(s, 30)
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_one_connection_too_many_is_answered_503(guarded):
    silent = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(4)]
    try:
        with socket.create_connection(("127.0.0.1", guarded.port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            reply = _closed_within(s, 30)
        assert reply.startswith(b"HTTP/1.1 503 "), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    finally:
        for s in silent:
            s.close()
    deadline = time.time() + 30
    while True:  # the silent ones gone, it serves again
        try:
            if httpx.get(guarded.url + "/health", timeout=10).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.time() < deadline
        time.sleep(0.1)
