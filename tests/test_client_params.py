"""The parameters benchmark and OpenAI clients send (issue 25, part 1), over real HTTP with the
openai client: ignore_eos, min_tokens, stop_token_ids and logit_bias on /v1/chat/completions
and /v1/completions, streaming or not, and the 400s for bad values. The server runs the tiny
random test model (its char-level tokenizer: token ids are easy to name) and shares compiled
programs with test_server's. Greedy throughout, so every expectation is exact."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from test_server import MODEL, RunningServer

PROMPT = "hello there"


@pytest.fixture(scope="module")
def server():
    s = RunningServer(slots=4, max_len=512, warmup=False)
    yield s
    s.stop()


def complete(server, stream=False, **kw):
    """(token ids, finish_reason, usage.completion_tokens) of a greedy completion (logprobs give the ids)."""
    c = server.client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, stream=stream,
                                         **{"max_tokens": 12, **kw})
    if stream:
        chunks = list(c)
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        finish = next(ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason)
        usage = next(ch.usage for ch in chunks if ch.usage)
    else:
        text, finish, usage = c.choices[0].text, c.choices[0].finish_reason, c.usage
    return server.engine.tokenizer.encode(text), finish, usage.completion_tokens


def eos(server) -> int:
    return server.engine.tokenizer.eos_token_ids[0]


@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_gives_exactly_max_tokens(server, stream):
    push_eos = {"logit_bias": {str(eos(server)): 100}}  # greedy would end at once
    ids, finish, n = complete(server, stream, extra_body=push_eos)
    assert (ids, finish, n) == ([], "stop", 1)
    ids, finish, n = complete(server, stream, max_tokens=7, extra_body={**push_eos, "ignore_eos": True})
    assert finish == "length" and n == 7
    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                 temperature=0, max_tokens=5, extra_body={**push_eos, "ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_back_eos_and_stop_ids(server, stream):
    body = {"logit_bias": {str(eos(server)): 100}, "min_tokens": 4}
    ids, finish, n = complete(server, stream, extra_body=body)
    # EOS is banned for the first 4 tokens, then (biased up) it is the 5th and ends the response.
    assert finish == "stop" and n == 5 and len(ids) == 4 and eos(server) not in ids


def test_stop_token_ids_end_the_response(server):
    ids, finish, _ = complete(server, max_tokens=12, extra_body={"ignore_eos": True})
    assert finish == "length" and len(ids) == 12
    stop = ids[5]
    first = ids.index(stop)
    got, finish, n = complete(server, max_tokens=12, extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert got == ids[:first] and finish == "stop" and n == first + 1  # the stop token is not in the text
    # min_tokens past the first occurrence: the stop id is banned there, so the text changes
    got, finish, n = complete(server, max_tokens=12, extra_body={"ignore_eos": True, "stop_token_ids": [stop],
                                                                 "min_tokens": first + 1})
    assert got[:first] == ids[:first] and got[first] != stop and stop not in got


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_minus_100_bans_a_token(server, stream):
    ids, _, _ = complete(server, stream, max_tokens=12, extra_body={"ignore_eos": True})
    banned = ids[0]  # greedy picks it first
    got, _, _ = complete(server, stream, max_tokens=12, extra_body={"ignore_eos": True,
                                                                    "logit_bias": {str(banned): -100}})
    assert banned not in got and got[0] != banned
    forced = ids[-1]
    got, _, _ = complete(server, stream, max_tokens=6, extra_body={"ignore_eos": True, "logit_bias": {str(forced): 100}})
    assert got == [forced] * 6


def test_a_biased_row_leaves_its_neighbours_alone(server):
    alone, _, _ = complete(server, max_tokens=10, extra_body={"ignore_eos": True})
    biased = {"ignore_eos": True, "logit_bias": {str(alone[0]): -100}, "min_tokens": 3}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, server, max_tokens=10, extra_body=biased if i % 2 else {"ignore_eos": True})
                   for i in range(4)]
        results = [f.result() for f in futures]
    assert [r[0] for r in results[::2]] == [alone, alone]
    assert all(alone[0] not in r[0] for r in results[1::2])


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 50}, "min_tokens"),  # more than max_tokens
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [999999]}, "stop_token_ids"),
    ({"ignore_eos": "maybe"}, "ignore_eos"),
])
def test_bad_values_are_400s_naming_the_parameter(server, body, param):
    for call in (lambda: server.client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body),
                 lambda: server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                               max_tokens=4, stream=True, extra_body=body)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"].split(".")[0] == param, e.value.body


def test_json_output_with_a_tokenizer_the_grammar_engine_cannot_read_is_a_400(server):
    """The tiny model's char-level tokenizer is not one llguidance reads: no constraint can hold."""
    with pytest.raises(openai.BadRequestError, match="not available with this tokenizer") as e:
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                              response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"
