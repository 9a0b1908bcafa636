"""The OpenAI-compatible server over real HTTP on 127.0.0.1, driven by the `openai` client
and httpx. Servers run in this process (uvicorn in a thread), so compiled functions are
shared between them; each has its own engine, store and port."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from hybridjax.default_model import TINY_NAME, tiny_test_model
from hybridjax.server import ServerConfig, create_app
from hybridjax.server.app import build_engine
from hybridjax.server.connections import uvicorn_options

MODEL = TINY_NAME


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, tokenizer=None, model=None, **kw):
        """A server on the tiny test model (`model`: another (name, (cfg, params, tokenizer));
        `tokenizer`: another chat template, say), configured by ServerConfig's fields."""
        name, (cfg, params, tok) = model or (TINY_NAME, tiny_test_model())
        sc = ServerConfig(**kw)
        self.engine, self.store = build_engine(sc, cfg, params, tokenizer or tok, name)
        app = create_app(self.engine, name, api_key=sc.api_key, api_keys=sc.api_keys, cache_dir=sc.cache_dir,
                         warmup=sc.warmup, max_body_bytes=sc.max_body_bytes, body_timeout_s=sc.body_timeout_s)
        api_key = sc.api_key or (sc.api_keys[0] if sc.api_keys else None)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The protocol and bounds `serve` runs with (hybridjax.server.connections).
        options = uvicorn_options(dataclasses.replace(sc, host="127.0.0.1", port=self.port))
        self.server = uvicorn.Server(uvicorn.Config(app, **options, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0, timeout=300)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@pytest.fixture(scope="module")
def cached():
    s = RunningServer(slots=4, max_len=512, checkpoint_interval=16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def uncached():
    s = RunningServer(slots=4, max_len=512, prefix_cache=False)
    yield s
    s.stop()


def chat(server, messages, max_tokens=10, **kw):
    return server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                 temperature=0, **kw)


def test_three_turn_chat_reuses_cache_and_matches_cache_off(cached, uncached):
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]
    covered = 0
    for turn in range(3):
        warm, cold = chat(cached, history), chat(uncached, history)
        text = warm.choices[0].message.content
        assert text == cold.choices[0].message.content  # greedy output does not depend on the cache
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        if turn:
            # The whole earlier conversation (prompts and responses) came from snapshots.
            assert warm.usage.prompt_tokens_details.cached_tokens >= covered > 0
        covered = warm.usage.prompt_tokens + warm.usage.completion_tokens
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And turn {turn + 2}?"}]


def test_prompt_diverging_in_the_middle_resumes_from_checkpoint(cached):
    a = list(range(1, 60))
    b = a[:37] + [90, 91, 92, 93, 94, 95]
    first = cached.client.completions.create(model=MODEL, prompt=a, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = cached.client.completions.create(model=MODEL, prompt=b, max_tokens=3, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == 32  # the checkpoint at 32 <= 37


def test_sixteen_concurrent_streams_equal_each_alone(cached, uncached):
    prompts = [f"Question {i}: {'why ' * (i % 5)}?" for i in range(16)]

    def stream(i):
        chunks = cached.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompts[i]}], max_tokens=6 + i % 3,
            temperature=0, stream=True, extra_body={"cache_salt": f"c{i}"})  # own namespaces
        parts, usage = [], None
        for ch in chunks:
            if ch.choices and ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
            usage = ch.usage or usage
        return "".join(parts), usage

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(stream, range(16)))
    for i, (text, usage) in enumerate(results):
        alone = chat(uncached, [{"role": "user", "content": prompts[i]}], max_tokens=6 + i % 3)
        assert text == alone.choices[0].message.content, i
        assert usage.completion_tokens == alone.usage.completion_tokens


def test_namespaces_are_isolated(cached):
    msgs = [{"role": "user", "content": "Isolation check, please."}]
    assert chat(cached, msgs, extra_body={"cache_salt": "alice"}).usage.prompt_tokens_details.cached_tokens == 0
    assert chat(cached, msgs, extra_body={"cache_salt": "bob"}).usage.prompt_tokens_details.cached_tokens == 0
    again = chat(cached, msgs, extra_body={"cache_salt": "alice"})
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens  # exact hit


def test_errors_have_status_and_message(cached):
    c, url = cached.client, cached.url
    with pytest.raises(openai.NotFoundError, match="the model 'nope' does not exist"):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|context is 512 tokens"):
        c.completions.create(model=MODEL, prompt="x" * 600, max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x" * 100, max_tokens=500)
    assert e.value.body["param"] == "max_tokens"
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid JSON body" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 99999], "max_tokens": 2})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_metrics_expose_store_counters(cached):
    text = httpx.get(cached.url + "/metrics").text
    for name in ("hybridjax_prefix_cache_lookups_total", "hybridjax_prefix_cache_hits_total",
                 "hybridjax_prefix_cache_exact_hits_total", "hybridjax_prefix_cache_tokens_reused_total",
                 "hybridjax_prefix_cache_tokens_prefilled_total", "hybridjax_prefix_cache_bytes",
                 "hybridjax_prefix_cache_evictions_total", "hybridjax_prefix_cache_misses_total"):
        assert name in text, name
    assert cached.metric("hybridjax_prefix_cache_hits_total") > 0
    # start-up progress: every program the engine runs, and those that exist
    engine = cached.engine
    every = engine.shapes() + engine.score_shapes()
    assert cached.metric("hybridjax_programs") == len(every)
    before = sum(map(engine.programs.has, every))  # (more may come into being behind meanwhile)
    assert before <= cached.metric("hybridjax_programs_ready") <= sum(map(engine.programs.has, every))


def test_disconnected_stream_frees_its_slot(cached):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 400,
            "stream": True, "temperature": 0}
    before = cached.metric('hybridjax_requests_finished_total{reason="cancelled"}')
    with httpx.stream("POST", cached.url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    deadline = time.time() + 60
    while cached.metric("hybridjax_active_slots") > 0:
        assert time.time() < deadline, "slot not freed after the client went away"
        time.sleep(0.1)
    assert cached.metric('hybridjax_requests_finished_total{reason="cancelled"}') == before + 1


def test_auth_queue_bound_and_eviction():
    s = RunningServer(slots=1, max_len=512, max_queue=1, api_key="sekret", cache_entries=2, warmup=False)
    try:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="invalid or missing API key"):
            bad.models.list()
        # The queue bound, made deterministic: with the engine worker paused nothing is admitted,
        # so the first request waits (queue depth 1 = max_queue) and the next gets 429. Timing a
        # busy slot against a racing request instead was flaky: a tiny model decodes 300 tokens
        # faster than a loaded CI machine schedules the second client.
        headers = {"authorization": "Bearer sekret"}
        s.engine.stop()
        with cf.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, s.url + "/v1/completions", headers=headers, timeout=300,
                                  json={"model": MODEL, "prompt": "queued", "max_tokens": 2})
            deadline = time.time() + 60
            while s.engine.queue_depth < 1:
                assert time.time() < deadline, "the request never reached the queue"
                time.sleep(0.02)
            r429 = httpx.post(s.url + "/v1/completions", headers=headers, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert r429.status_code == 429 and r429.json()["error"]["code"] == "queue_full"
            assert "queue is full" in r429.json()["error"]["message"]
            s.engine.start()  # the waiting request is served once the worker runs again
        assert waiting.result().status_code == 200
        for p in ("one", "two", "three"):  # entry bound 2: the oldest goes
            s.client.completions.create(model=MODEL, prompt=f"eviction {p}", max_tokens=1)
        assert s.metric('hybridjax_prefix_cache_evictions_total{reason="entries"}') > 0
        assert s.metric("hybridjax_prefix_cache_entries") <= 2
    finally:
        s.stop()


def test_snapshots_persist_across_restart(tmp_path):
    d = str(tmp_path / "snaps")
    prompt = "Persist me across a restart, please."
    s = RunningServer(slots=4, max_len=512, cache_dir=d)
    try:
        first = s.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    finally:
        s.stop()  # saves on shutdown
    (tmp_path / "snaps" / "garbage.snapshot").write_bytes(b"not a snapshot")  # skipped with a warning
    s = RunningServer(slots=4, max_len=512, cache_dir=d)
    try:
        again = s.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
        assert again.choices[0].text == first.choices[0].text
    finally:
        s.stop()


def test_completion_streams_open_with_text_and_chat_streams_with_the_role(cached):
    body = {"model": MODEL, "prompt": "Stream opening check.", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", cached.url + "/v1/completions", json=body, timeout=120) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
    assert first["choices"][0]["text"] != ""  # no empty chunk before anything is computed
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", cached.url + "/v1/chat/completions", json=body, timeout=120) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_health_says_loading_until_the_engine_serves():
    (cfg, params, tok), name = tiny_test_model(), TINY_NAME
    engine, _ = build_engine(ServerConfig(slots=4, max_len=512), cfg, params, tok, name)
    release = threading.Event()
    engine.warmup = lambda *a, **kw: release.wait(60)  # a warm-up that takes until released
    engine.background_shapes = lambda: []  # and nothing to compile behind
    app = create_app(engine, name)
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        assert client.get("/health").status_code == 503 and client.get("/health").json() == {"status": "loading"}
        release.set()
        assert engine.ready.wait(60)
        assert client.get("/health").json() == {"status": "ok"}


def test_no_request_waits_for_fastapi_to_read_an_endpoints_source(monkeypatch):
    """FastAPI looks up an endpoint's source lines (for its error messages) on the endpoint's first
    request, tokenizing the whole function: ~5 ms on the first chat request, the first turn of an
    agent's trace (issue 26). The app has it done before serving; no request reads source."""
    import asyncio
    import inspect

    import fastapi.routing

    from hybridjax.server import app as app_mod

    (cfg, params, tok), name = tiny_test_model(), TINY_NAME
    engine, _ = build_engine(ServerConfig(slots=1, max_len=128), cfg, params, tok, name)  # never started
    real, read = inspect.getsourcelines, []
    monkeypatch.setattr(inspect, "getsourcelines", lambda obj: read.append(getattr(obj, "__name__", obj)) or real(obj))

    async def first_requests(app) -> list[int]:
        transport = httpx.ASGITransport(app=app)  # no lifespan: the engine stays down
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            # A model this server does not serve: a 404 from the endpoint itself, after FastAPI's part.
            bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
                      "/v1/completions": {"prompt": "x"}, "/v1/responses": {"input": "x"}}
            return [(await client.post(path, json={"model": "none", **body})).status_code for path, body in bodies.items()]

    app = create_app(engine, name, warmup=False)
    read.clear()  # what create_app read before serving is what it is for
    assert asyncio.run(first_requests(app)) == [404, 404, 404]
    assert read == []
    # The check can fail: an app that does not have it done reads each endpoint's source on its first request.
    monkeypatch.setattr(app_mod, "_locate_endpoints_now", lambda app: None)
    if hasattr(fastapi.routing, "_extract_endpoint_context"):
        assert asyncio.run(first_requests(create_app(engine, name, warmup=False))) == [404, 404, 404]
        assert {"chat_completions", "completions"} <= set(read), read
