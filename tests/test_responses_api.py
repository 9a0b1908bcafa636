"""/v1/responses (issue 25, part 3) over real HTTP with the openai client, on the tiny test model:
a conversation continued by previous_response_id reports every earlier token as cached and gives,
greedy, what the whole conversation gives through chat completions on a server without a cache;
streaming sends the typed events the client parses; store, GET, DELETE, count and TTL bounds,
and isolation by API key and cache_salt (404s in OpenAI's error shape)."""

from __future__ import annotations

import openai
import pytest
from test_server import MODEL, RunningServer
from test_server_openai import wait_idle

TURNS = ["Hello, who are you?", "Tell me more.", "And then?"]


@pytest.fixture(scope="module")
def server():
    s = RunningServer(slots=4, max_len=512, warmup=False)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cold():
    s = RunningServer(slots=4, max_len=512, warmup=False, prefix_cache=False)
    yield s
    s.stop()


def test_a_continuation_prefills_only_the_new_input_and_equals_chat(server, cold):
    tok = server.engine.tokenizer
    prev, messages = None, [{"role": "system", "content": "Be brief."}]
    for i, text in enumerate(TURNS):
        r = server.client.responses.create(model=MODEL, input=text, previous_response_id=prev, temperature=0,
                                           max_output_tokens=12, instructions="Be brief.")
        messages.append({"role": "user", "content": text})
        whole = cold.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
        assert r.output_text == whole.choices[0].message.content
        assert r.usage.input_tokens == whole.usage.prompt_tokens
        if i:  # every token of the earlier turns (system, user, assistant messages) was cached
            earlier = tok.encode_chat(messages[:-1], add_generation_prompt=False)
            assert r.usage.input_tokens_details.cached_tokens >= len(earlier)
            assert r.previous_response_id == prev
        messages.append({"role": "assistant", "content": r.output_text})
        prev = r.id
        wait_idle(server.engine)  # the next turn's prefix is prefilled in idle time


def test_streaming_sends_typed_events(server):
    plain = server.client.responses.create(model=MODEL, input="Stream this", temperature=0, max_output_tokens=10)
    events = list(server.client.responses.create(model=MODEL, input="Stream this", temperature=0,
                                                 max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.delta" in kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert events[-1].response.output_text == plain.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # a streamed response continues like any other
    wait_idle(server.engine)
    more = server.client.responses.create(model=MODEL, input="More", previous_response_id=events[-1].response.id,
                                          temperature=0, max_output_tokens=4)
    assert more.usage.input_tokens_details.cached_tokens > 0


def test_store_get_delete_and_404s(server):
    c = server.client
    r = c.responses.create(model=MODEL, input="Keep me", temperature=0, max_output_tokens=4)
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    c.responses.delete(r.id)
    for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id),
                 lambda: c.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "response_not_found" and r.id in e.value.body["message"]
    unstored = c.responses.create(model=MODEL, input="Forget me", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    # cache_salt is part of the namespace
    salted = c.responses.create(model=MODEL, input="Salted", max_output_tokens=2, extra_body={"cache_salt": "s1"})
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=MODEL, input="x", previous_response_id=salted.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(salted.id)
    assert c.responses.retrieve(salted.id, extra_query={"cache_salt": "s1"}).id == salted.id
    c.responses.create(model=MODEL, input="x", previous_response_id=salted.id, max_output_tokens=2,
                       extra_body={"cache_salt": "s1"})


def test_bounds_by_count_and_ttl(server):
    store = server.server.config.app.state.responses
    old_max, old_clock = store.max_entries, store.clock
    now = [1000.0]
    try:
        store.max_entries, store.clock = 2, lambda: now[0]
        ids = [server.client.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=1).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            server.client.responses.retrieve(ids[0])  # the least recently used went
        assert server.client.responses.retrieve(ids[2]).id == ids[2]
        now[0] += store.ttl_s + 1
        with pytest.raises(openai.NotFoundError):
            server.client.responses.retrieve(ids[2])  # expired
    finally:
        store.max_entries, store.clock = old_max, old_clock


def test_isolated_by_api_key_and_bad_input_is_a_400():
    s = RunningServer(slots=2, max_len=512, warmup=False, api_keys=("key-a", "key-b"))
    try:
        a = openai.OpenAI(base_url=s.url + "/v1", api_key="key-a", max_retries=0)
        b = openai.OpenAI(base_url=s.url + "/v1", api_key="key-b", max_retries=0)
        r = a.responses.create(model=MODEL, input="Mine", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=2)
        assert a.responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.BadRequestError) as e:
            a.responses.create(model=MODEL, input=[{"type": "image", "url": "x"}], max_output_tokens=2)
        assert e.value.body["param"] == "input"
        with pytest.raises(openai.BadRequestError) as e:
            a.responses.create(model=MODEL, input="x", max_output_tokens=0)
        assert e.value.body["param"] == "max_output_tokens"
    finally:
        s.stop()
