"""The rest of the OpenAI API (issue 14, parts 2 and 3) over real HTTP with the openai client:
log-probabilities, n > 1, echo (with the prompt's log-probabilities), tool_choice, response_format, GET /v1/models/{id}, unsupported fields, several
API keys, tool calling through a chat template that has tools, and multi-turn reuse through a
template that does not render the history as prompt + response (it drops the `<think>` the
generation prompt opened, as Qwen3.5's does).

The servers run the tiny random test model with the template below; they share compiled programs
with test_server's (same shapes)."""

from __future__ import annotations

import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from test_server import MODEL, RunningServer

from hybridjax.cache import init_cache
from hybridjax.default_model import tiny_test_model
from hybridjax.engine import Event, RequestHandle
from hybridjax.generate import prompt_logprobs, sampling_params
from hybridjax.model import forward
from hybridjax.tokenizer import Tokenizer

# ChatML with tools (Qwen3's hermes layout) and thinking: the generation prompt opens <think>,
# the history shows an answer without it (and without any thinking before </think>).
TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\nCall one as <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}
{{- '<|im_start|>assistant\n' + content }}
{%- for call in message.tool_calls or [] %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n' }}{%- endif %}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def template_tokenizer() -> Tokenizer:
    tok = tiny_test_model()[2]
    return Tokenizer(tok.backend, TEMPLATE, tok.special_tokens, tok.eos_token_ids)


@pytest.fixture(scope="module")
def server():
    s = RunningServer(tokenizer=template_tokenizer(), slots=4, max_len=512, warmup=False)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cold():
    s = RunningServer(tokenizer=template_tokenizer(), slots=4, max_len=512, warmup=False, prefix_cache=False)
    yield s
    s.stop()


def chat(server, messages, max_tokens=8, **kw):
    return server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                 temperature=kw.pop("temperature", 0), **kw)


def wait_idle(engine, timeout=60):
    deadline = time.time() + timeout
    while not engine.idle:
        assert time.time() < deadline, "the engine did not go idle"
        time.sleep(0.02)


# --- log-probabilities, n, echo ---------------------------------------------------------

def test_chat_logprobs_are_the_engines_and_stream_alike(server):
    msgs = [{"role": "user", "content": "Log-probabilities over HTTP."}]
    r = chat(server, msgs, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:  # greedy: each token is the most likely one
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.logprob == c.top_logprobs[0].logprob <= 0
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    streamed = []
    for ch in chat(server, msgs, logprobs=True, top_logprobs=3, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            streamed += ch.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    assert chat(server, msgs).choices[0].logprobs is None  # not asked: none
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        chat(server, msgs, top_logprobs=2)


def test_completion_logprobs_and_echo(server):
    c = server.client.completions
    r = c.create(model=MODEL, prompt="Completion logprobs", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == len(lp.token_logprobs)
    for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and top[t] == v == max(top.values())
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    plain = c.create(model=MODEL, prompt="Echo this", max_tokens=4, temperature=0)
    echoed = c.create(model=MODEL, prompt="Echo this", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Echo this" + plain.choices[0].text
    parts = [ch.choices[0].text for ch in c.create(model=MODEL, prompt="Echo this", max_tokens=4, temperature=0,
                                                   echo=True, stream=True) if ch.choices]
    assert parts[0] == "Echo this" and "".join(parts) == echoed.choices[0].text


def reference_prompt_logprobs(logits, ids, temperature=0.0, repetition_penalty=1.0) -> np.ndarray:
    """Independent of the server's path: log_softmax of `forward`'s logits [T, vocab] over the
    unpadded prompt (float64 in numpy), processed by hand as the sampler does: the repetition
    penalty on the tokens so far, then the temperature (1 when greedy)."""
    logits, out = np.asarray(logits, np.float64), []
    for i in range(len(ids) - 1):
        seen = np.isin(np.arange(logits.shape[1]), ids[: i + 1])
        x = logits[i]
        x = np.where(seen, np.where(x > 0, x / repetition_penalty, x * repetition_penalty), x) / (temperature or 1.0)
        out.append(x[ids[i + 1]] - x.max() - np.log(np.exp(x - x.max()).sum()))
    return np.array(out)


def test_echo_logprobs_score_the_prompt(server):
    """echo + logprobs: the prompt's tokens get log-probabilities (the first none, as OpenAI's),
    against `reference_prompt_logprobs` within 1e-4 (two float32 forwards of the tiny model, one
    padded to a bucket, agree to ~1e-5); the library call in chunks of 8 positions (the penalty's
    record of seen tokens crosses chunks) gives the same."""
    c, eng = server.client.completions, server.engine
    text = "abc def abc def abc def abc d"
    ids = eng.tokenizer.encode(text)
    n = len(ids)
    logits = jax.jit(forward, static_argnames="cfg")(eng.params, jnp.asarray([ids]),
                                                     init_cache(eng.cfg, 1, n, capacity=n), eng.cfg)[0][0]
    for temperature, rp in ((0.0, 1.0), (0.7, 1.3)):
        want = reference_prompt_logprobs(logits, ids, temperature, rp)
        r = c.create(model=MODEL, prompt=text, max_tokens=2, echo=True, logprobs=3, seed=1, temperature=temperature,
                     extra_body={"repetition_penalty": rp})
        lp = r.choices[0].logprobs
        assert "".join(lp.tokens[:n]) == text and "".join(lp.tokens) == r.choices[0].text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert np.abs(np.array(lp.token_logprobs[1:n]) - want).max() < 1e-4, (temperature, rp)
        for v, top in zip(lp.token_logprobs[1:n], lp.top_logprobs[1:n]):
            assert len(top) == 3 and max(top.values()) >= v - 1e-6
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunked = prompt_logprobs(eng.params, ids, eng.cfg, sampling_params(1, temperature=0.7, repetition_penalty=1.3),
                              chunk=8)
    assert n > 16 and np.abs(np.array([v for v, _ in chunked]) - want).max() < 1e-4
    with c.create(model=MODEL, prompt=text, max_tokens=2, echo=True, logprobs=3, seed=1, temperature=0.7,
                  extra_body={"repetition_penalty": 1.3}, stream=True) as stream:
        first = next(iter(stream))
    assert first.choices[0].text == text and first.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]


def test_n_choices_share_the_prompt_prefill(server):
    prompt = "Several choices from one prompt, please."  # >= 16 tokens: the others wait for its snapshot
    store = server.engine.store
    wait_idle(server.engine)
    before = store.counters["tokens_prefilled"]
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, n=3, seed=7)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert store.counters["tokens_prefilled"] - before == r.usage.prompt_tokens  # prefilled once
    assert 3 <= r.usage.completion_tokens <= 15 and r.usage.prompt_tokens == len(server.engine.tokenizer.encode(prompt))
    again = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, n=3, seed=7)
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]  # seed + i per choice
    assert len({ch.text for ch in r.choices}) > 1
    seen = {}
    for ch in chat(server, [{"role": "user", "content": "two streams"}], n=2, stream=True, max_tokens=3):
        for c in ch.choices:
            seen.setdefault(c.index, []).append(c.finish_reason)
    assert sorted(seen) == [0, 1] and all(v[-1] in ("stop", "length") for v in seen.values())


# --- the rest of the surface ---------------------------------------------------------------

def test_models_response_format_and_unsupported_fields(server):
    c = server.client
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-nope")
    assert e.value.body["code"] == "model_not_found" and "gpt-nope" in e.value.body["message"]
    msgs = [{"role": "user", "content": "format"}]
    assert chat(server, msgs, max_tokens=2, response_format={"type": "text"}).choices
    with pytest.raises(openai.BadRequestError, match="response_format") as e:
        chat(server, msgs, response_format={"type": "yaml"})
    assert e.value.body["param"].startswith("response_format")
    for extra in ({"guided_regex": "a+"}, {"functions": []}, {"frobnicate": 1}):
        with pytest.raises(openai.BadRequestError, match="unsupported parameter") as e:
            chat(server, msgs, extra_body=extra)
        assert e.value.body["param"] == next(iter(extra))
    with pytest.raises(openai.BadRequestError, match="unsupported parameter 'best_of'"):
        c.completions.create(model=MODEL, prompt="x", max_tokens=1, best_of=2)
    with pytest.raises(openai.BadRequestError, match="needs tools") as e:
        chat(server, msgs, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    assert chat(server, msgs, max_tokens=1, user="someone", extra_body={"metadata": {"a": "b"}}).choices  # no effect


def test_several_api_keys_each_with_its_own_cache():
    s = RunningServer(slots=4, max_len=512, warmup=False, api_keys=("key-a", "key-b"))
    try:
        a = openai.OpenAI(base_url=s.url + "/v1", api_key="key-a", max_retries=0)
        b = openai.OpenAI(base_url=s.url + "/v1", api_key="key-b", max_retries=0)
        msgs = [{"role": "user", "content": "Whose cache is this?"}]
        first = a.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
        other = b.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == other.usage.prompt_tokens_details.cached_tokens == 0
        again = a.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="key-c", max_retries=0).models.list()
    finally:
        s.stop()


# --- tool calling ------------------------------------------------------------------------------

def test_tools_are_rendered_by_the_template_and_tool_messages_accepted(server):
    tok = server.engine.tokenizer
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = chat(server, msgs, tools=TOOLS, max_tokens=1)
    assert with_tools.usage.prompt_tokens == len(tok.encode_chat(msgs, tools=TOOLS)) > len(tok.encode_chat(msgs))
    assert chat(server, msgs, tools=TOOLS, tool_choice="none", max_tokens=1).usage.prompt_tokens == len(
        tok.encode_chat(msgs))
    history = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = chat(server, history, tools=TOOLS, max_tokens=1)
    rendered = tok.render_chat([history[0], {**history[1], "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        history[2]], tools=TOOLS)
    assert '"arguments": {"city": "Paris"}' in rendered and "<tool_response>\nsunny, 21 C" in rendered
    assert r.usage.prompt_tokens == len(tok.encode(rendered))


def scripted(server, monkeypatch, text: str) -> list:
    """Make the engine 'generate' `text` (one event per character): the tiny model is random, and
    these tests are about how the server reads tool calls out of what a model writes. Returns the
    list the requests it receives go to."""
    tok, received = server.engine.tokenizer, []

    def submit(greq, loop=None):
        received.append(greq)
        h = RequestHandle(greq, loop)

        def run():
            for ch in text:
                tid = tok.encode(ch)[0]
                h.token_ids.append(tid)
                h.text += ch
                h._emit(Event(tid, ch))
            h.finish_reason = "stop"
            h._emit(Event(None, "", "stop"))

        threading.Thread(target=run, daemon=True).start()
        return h

    monkeypatch.setattr(server.engine, "submit", submit)
    return received


HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
QWEN35 = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n"
          "</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("text,content,args", [
    (HERMES, "Let me check.", {"city": "Paris", "days": 2}),
    (QWEN35, None, {"city": "42", "days": 3}),  # city is a string by the schema, days JSON
])
def test_tool_calls_are_parsed_streaming_or_not(server, monkeypatch, text, content, args):
    scripted(server, monkeypatch, text)
    msgs = [{"role": "user", "content": "Weather?"}]
    r = chat(server, msgs, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == args
    assert call.id.startswith("call_")
    parts, calls, finish = [], [], None
    for ch in chat(server, msgs, tools=TOOLS, stream=True):
        d = ch.choices[0].delta
        parts.append(d.content or "")
        calls += d.tool_calls or []
        finish = ch.choices[0].finish_reason or finish
    assert "<tool_call>" not in "".join(parts) and "".join(parts).strip() == (content or "")
    assert [c.function.name for c in calls] == ["get_weather"] and json.loads(calls[0].function.arguments) == args
    assert finish == "tool_calls"
    plain = chat(server, msgs)  # without tools the text is the text
    assert plain.choices[0].message.content == text and plain.choices[0].message.tool_calls is None


GET_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
JSON_OPENING = '<tool_call>\n{"name": "get_weather", "arguments": '


@pytest.mark.parametrize("choice,opening,generated,args", [
    (GET_WEATHER, JSON_OPENING, '{"city": "Paris", "days": 2}}\n</tool_call>', {"city": "Paris", "days": 2}),
    ("required", "<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     {"city": "Oslo"}),
])
def test_tool_choice_forces_the_calls_opening(server, monkeypatch, choice, opening, generated, args):
    """The prompt ends with the call's opening (after closing the thinking block the generation
    prompt opened), and what the model writes next is read as if it had written the opening."""
    received = scripted(server, monkeypatch, generated)
    tok, msgs = server.engine.tokenizer, [{"role": "user", "content": "Weather?"}]
    r = chat(server, msgs, tools=TOOLS, tool_choice=choice)
    assert received[0].prompt_ids == tok.encode(tok.render_chat(msgs, tools=TOOLS) + "\n</think>\n\n" + opening)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == args
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    parts, calls = [], []
    for ch in chat(server, msgs, tools=TOOLS, tool_choice=choice, stream=True):
        parts.append(ch.choices[0].delta.content or "")
        calls += ch.choices[0].delta.tool_calls or []
    assert "".join(parts) == "" and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == args


def test_tool_choice_names_a_function_among_the_tools(server):
    msgs = [{"role": "user", "content": "Weather?"}]
    for choice, message in (({"type": "function", "function": {"name": "get_time"}}, "'get_time' is not among"),
                            ({"type": "function"}, "a named tool_choice is")):
        with pytest.raises(openai.BadRequestError, match=message) as e:
            chat(server, msgs, tools=TOOLS, tool_choice=choice)
        assert e.value.body["param"] == "tool_choice"


def test_a_forced_call_is_the_responses_start_for_the_next_turn(server):
    """With the real (random) model: the forced opening is in the prompt, the answer is read from
    it on, and the next turn, with that answer in its history, prefills only its new message."""
    tok, eng = server.engine.tokenizer, server.engine
    msgs = [{"role": "user", "content": "Forced call, first turn."}]
    wait_idle(eng)
    r = chat(server, msgs, tools=TOOLS, tool_choice=GET_WEATHER)
    assert r.usage.prompt_tokens == len(tok.encode(tok.render_chat(msgs, tools=TOOLS) + "\n</think>\n\n"
                                                   + JSON_OPENING))
    m = r.choices[0].message
    if m.tool_calls:  # the random model happened to close valid JSON
        assert m.tool_calls[0].function.name == "get_weather"
    else:  # the block did not parse: it stays text, from the forced opening on
        assert m.content.startswith(JSON_OPENING)
    history = msgs + [m.model_dump(exclude_none=True), {"role": "user", "content": "And the second turn?"}]
    wait_idle(eng)
    usage = chat(server, history, tools=TOOLS).usage
    new = tok.encode("And the second turn?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens == len(new)


# --- multi-turn reuse through the template -------------------------------------------------------

def test_later_turns_prefill_only_the_new_message(server, cold):
    """The template drops the `<think>\\n` the generation prompt opened, so the next prompt is not
    prompt + response. After each answer the server prefills the next turn's prefix in idle time;
    from turn 2 on only the new message and the generation prompt are prefilled."""
    tok, eng = server.engine.tokenizer, server.engine
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a snapshot?"}]
    for turn in range(4):
        wait_idle(eng)  # the previous turn's background prefill is done
        if turn == 2:  # the streaming path too
            parts, usage = [], None
            for ch in chat(server, history, stream=True, stream_options={"include_usage": True}):
                parts += [c.delta.content or "" for c in ch.choices]
                usage = ch.usage or usage
            text = "".join(parts)
        else:
            r = chat(server, history)
            text, usage = r.choices[0].message.content, r.usage
        assert text == chat(cold, history).choices[0].message.content  # reuse changes nothing
        if turn:  # the engine's own counts: cached_tokens came from a snapshot, the rest was prefilled
            new = tok.encode(history[-1]["content"] + "<|im_end|>\n<|im_start|>assistant\n<think>\n")
            assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens == len(new), turn
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And question {turn + 2}?"}]
    wait_idle(eng)
    # Counted apart from requests: every request finished, and the background work shows on its own.
    finished = sum(server.metric(f'hybridjax_requests_finished_total{{reason="{r}"}}') for r in ("stop", "length", "cancelled"))
    assert finished == server.metric("hybridjax_requests_total")
    assert server.metric("hybridjax_background_prefills_total") >= 4


def test_tool_call_stream_splits_alike_wherever_the_text_breaks():
    from hybridjax.server.openai_format import ToolCallStream, split_tool_calls

    text = "Sure. " + HERMES + " and " + QWEN35 + " <tool_cal"
    want_content, want_calls = split_tool_calls(text)
    assert [c["function"]["name"] for c in want_calls] == ["get_weather", "get_weather"]
    strip = lambda calls: [c["function"] for c in calls]  # noqa: E731  (ids are fresh per call)
    for cut in range(len(text) + 1):
        s = ToolCallStream()
        a, calls_a = s.push(text[:cut])
        b, calls_b = s.push(text[cut:])
        c, calls_c = s.flush()
        assert "<tool_call>" not in a + b + c
        assert (a + b + c).strip() == want_content and strip(calls_a + calls_b + calls_c) == strip(want_calls), cut
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert split_tool_calls(broken) == (broken, [])  # what does not parse stays text
