"""Structured outputs and the Responses API, served over HTTP (openai client), embedded default model.

    python benchmarks/bench_structured.py [--tokens 120] [--repeats 3] [--json OUT]

1. Decode tokens/s with 1 and 4 concurrent streams, every stream constrained by a JSON schema
   (an array of `--tokens` // 2 digits: a fixed-length answer) vs none (ignore_eos, the same
   number of tokens), in one run, alternating round by round so load drift hits both alike.
   Rate = tokens after each stream's first / (last token - first token), summed over the streams
   of a round (aggregate), median over `--repeats` rounds. Constrained rows run in lockstep (the
   host computes each row's mask from the token just drawn, before the next step), so the
   constrained rate includes the host's mask time and the lost overlap.
2. Time to first token of a second turn after a long first turn (about 600 prompt tokens):
   through /v1/responses with previous_response_id (prefills the new input only), through chat
   completions with the whole conversation after the first turn went through chat completions
   too (chat reuse: also prefills only the new message), and the whole conversation cold (a fresh
   cache_salt: everything prefilled). Median over `--repeats`.
The server compiles every shape before serving (warmup), so no measurement includes compilation.
The machine may be shared: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridjax.default_model import default_model  # noqa: E402
from hybridjax.server.app import ServerConfig, build_engine, create_app  # noqa: E402

NAME = "default"


def start_server(slots: int):
    import socket

    cfg, params, tok = default_model()
    sc = ServerConfig(slots=slots, max_len=2048, warmup=True)
    engine, _ = build_engine(sc, cfg, params, tok, NAME)
    app = create_app(engine, NAME, warmup=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not (server.started and engine.ready.is_set()):
        time.sleep(0.2)
    return server, engine, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                         timeout=900)


def stream_times(client, seed: int, constrained: bool, tokens: int):
    """(tokens after the first, seconds from the first to the last) of one streamed completion."""
    digits = tokens // 2
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": digits, "maxItems": digits}
    kw = (dict(response_format={"type": "json_schema", "json_schema": {"name": "digits", "schema": schema}})
          if constrained else dict(extra_body={"ignore_eos": True}))
    s = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": f"Digits please #{seed}"}],
                                       max_tokens=tokens + 8 if constrained else tokens, temperature=0.8, seed=seed,
                                       stream=True, stream_options={"include_usage": True}, **kw)
    first = last = None
    n = 0
    for chunk in s:
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
    return n - 1, last - first, first, last


def decode_round(client, streams: int, constrained: bool, tokens: int, seed: int) -> float:
    with ThreadPoolExecutor(streams) as pool:
        res = list(pool.map(lambda i: stream_times(client, seed + i, constrained, tokens), range(streams)))
    total = sum(r[0] for r in res)
    return total / (max(r[3] for r in res) - min(r[2] for r in res))


def ttft(client, **kw) -> float:
    t0 = time.perf_counter()
    for ev in client.responses.create(stream=True, **kw):
        if ev.type == "response.output_text.delta":
            return time.perf_counter() - t0
    return float("nan")


def chat_ttft(client, messages, salt) -> float:
    t0 = time.perf_counter()
    for chunk in client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                stream=True, extra_body={"cache_salt": salt}):
        if chunk.choices and chunk.choices[0].delta.content:
            return time.perf_counter() - t0
    return float("nan")


def wait_idle(engine):
    while not engine.idle:
        time.sleep(0.01)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    load0 = open("/proc/loadavg").read().strip()
    t0 = time.perf_counter()
    server, engine, client = start_server(slots=4)
    print(f"server ready (compiled every shape) in {time.perf_counter() - t0:.0f} s; load average {load0}", flush=True)
    out = {"decode": {}, "ttft": {}}
    for streams in (1, 4):  # one warm round of each kind, then alternate
        for constrained in (False, True):
            decode_round(client, streams, constrained, args.tokens, 999)
        rates = {False: [], True: []}
        for r in range(args.repeats):
            for constrained in (False, True):
                rates[constrained].append(decode_round(client, streams, constrained, args.tokens, 100 * r))
        none, cons = statistics.median(rates[False]), statistics.median(rates[True])
        out["decode"][streams] = {"none": none, "json_schema": cons, "ratio": none / cons}
        print(f"decode, {streams} stream(s): none {none:.1f} tok/s, json_schema {cons:.1f} tok/s, "
              f"none/constrained {none / cons:.2f}x", flush=True)

    long_turn = " ".join(f"fact {i}: the sky is blue." for i in range(60))  # ~600 tokens
    times = {"responses": [], "chat_reuse": [], "chat_cold": []}
    for r in range(args.repeats + 1):
        salt = uuid.uuid4().hex
        first = client.responses.create(model=NAME, input=long_turn, max_output_tokens=16, temperature=0,
                                        extra_body={"cache_salt": salt})
        wait_idle(engine)
        t_resp = ttft(client, model=NAME, input="Summarise.", previous_response_id=first.id, max_output_tokens=8,
                      temperature=0, extra_body={"cache_salt": salt})
        wait_idle(engine)
        msgs = [{"role": "user", "content": long_turn}]
        salt2 = uuid.uuid4().hex
        answer = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, temperature=0,
                                                extra_body={"cache_salt": salt2}).choices[0].message.content
        wait_idle(engine)
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Summarise."}]
        t_reuse = chat_ttft(client, msgs, salt2)
        wait_idle(engine)
        t_cold = chat_ttft(client, msgs, uuid.uuid4().hex)
        wait_idle(engine)
        if r:  # the first round warms up
            times["responses"].append(t_resp)
            times["chat_reuse"].append(t_reuse)
            times["chat_cold"].append(t_cold)
    for k, v in times.items():
        out["ttft"][k] = statistics.median(v)
        print(f"second-turn TTFT, {k}: {1e3 * statistics.median(v):.0f} ms", flush=True)
    load1 = open("/proc/loadavg").read().strip()
    print(f"load average before {load0}, after {load1}")
    out["load"] = [load0, load1]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    server.should_exit = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
