"""Coding-agent transcripts replayed through /v1/chat/completions with `tools`, cache on and defeated.

    python benchmarks/bench_agent.py [--rounds 10] [--tool-tokens 250,320] [--traces 1] [--gap 0]
                                     [--max-len 4096] [--executable-dir DIR] [--json OUT]

The server runs in this process (uvicorn in a thread, as tests/test_server.py does), on the embedded
default model (float32, 8 layers, hidden 256, vocab 4096, context 4096), every shape compiled
before the first request (--max-len: a longer context than the model's 4096 positions, for
transcripts of 16k-32k tokens where the host's per-request costs show; the server is ready sooner and compiles the rest behind: the replay
waits for that); the client (httpx, streaming, one kept-alive connection per replay) runs in the
same process and mostly waits.

A trace: a system prompt, tool definitions (read_file, run_tests), a task, then `--rounds` rounds of
[assistant: reasoning + a read_file call] -> [tool: file text of --tool-tokens tokens]. The chat
template is the model's ChatML with tools, Qwen3.5-style in that it drops an assistant's reasoning
(`reasoning_content`) from the history. The assistant turns are sent as the client has them (a
replay: the model's own answers, 8 tokens each, are discarded), so each request is the whole
transcript so far and ends with the newest tool result.

Per turn: prompt tokens, cached tokens, new tokens (prompt - the previous request's prompt), time to
first token (first content or tool-call chunk), and the cold prefill time of the same prompt (the
replay with the cache defeated: a new `cache_salt` per request). Over the trace: cached share against
its bound (1 - new / prompt, summed over turns) and total time, cache on vs defeated. The turn's
TTFT is set against the prefill of its new tokens as the engine ran it: its own prefill calls (each
call blocked on and timed, those that start between the request and its first token); the excess,
TTFT - those calls, is the host's per-request cost (target: 50 ms). The older estimate, cold TTFT x
new / prompt ("cold new, est."), assumes a constant per-token cost: at long contexts a token costs
more the later it comes (a 256-token call takes 0.11 s at 2k tokens, ~0.45 s at 26k), so it
undercounts the prefill and overstates the excess. The greedy answers (content and tool calls,
streamed) of the two replays are compared turn by turn: a cache hit must not change them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import threading
import time

import httpx
import jax
import uvicorn

from hybridjax.default_model import DEFAULT_NAME, default_model
from hybridjax.server import ServerConfig, create_app
from hybridjax.server.app import freeze_what_start_up_made
from hybridjax.server.app import build_engine
from hybridjax.tokenizer import Tokenizer, chatml_template

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite, return its output.",
                                      "parameters": {"type": "object", "properties": {"filter": {"type": "string"}}}}},
]
SYSTEM = ("You are a coding agent working in a Python repository. Read the files you need with the tools, "
          "think before each call, keep changes small, and run the tests before you finish.")


def reasoning_dropping_template() -> str:
    """ChatML with tools; an assistant's `reasoning_content` is rendered only in the last message,
    so the history carries none (as Qwen3.5's template drops earlier thinking)."""
    plain = chatml_template()
    head = "{{- '<|im_start|>' + message['role'] + '\\n' + text }}"
    assert head in plain
    think = ("{{- '<|im_start|>' + message['role'] + '\\n' }}"
             "{%- if message['role'] == 'assistant' and loop.last and message['reasoning_content'] is defined "
             "and message['reasoning_content'] %}{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}"
             "{%- endif %}{{- text }}")
    return plain.replace(head, think)


def file_text(rng: random.Random, tok, n_tokens: int) -> str:
    """Python-looking text of about `n_tokens` tokens."""
    lines, text = [], ""
    while len(tok.encode(text)) < n_tokens:
        k = rng.randint(0, 999)
        lines.append(rng.choice([f"def handler_{k}(request, cache):", f"    value = cache.get('{k}') or {k}",
                                 f"    return compute(value, {k % 7})", f"class Store{k}:", f"# see issue {k}",
                                 f"    if value > {k}:", "        raise ValueError('bad value')", ""]))
        text = "\n".join(lines)
    return text


def trace(seed: int, rounds: int, tool_tokens: tuple[int, int], tok) -> list[list[dict]]:
    """The request messages of each round of one trace."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task {seed}: the cache tests fail after the last change; find out why "
                                            "and fix it."}]
    requests = []
    for r in range(rounds):
        path = f"src/module_{seed}_{r}.py"
        messages.append({"role": "assistant", "content": "",
                         "reasoning_content": f"The failure may come from {path}; I should read it before editing.",
                         "tool_calls": [{"id": f"call_{r}", "type": "function",
                                         "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{r}",
                         "content": file_text(rng, tok, rng.randint(*tool_tokens))})
        requests.append([dict(m) for m in messages])
    return requests


def ask(client: httpx.Client, messages: list[dict], salt: str) -> dict:
    body = {"model": DEFAULT_NAME, "messages": messages, "tools": TOOLS, "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    t0 = time.perf_counter()
    ttft, usage, answer, first_chunk = None, None, [], None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            first_chunk = first_chunk or time.perf_counter()
            for c in chunk.get("choices", []):
                d = c.get("delta", {})
                answer.append([d.get("content"), [{k: v for k, v in tc.items() if k != "id"}  # ids are random
                                                  for tc in d.get("tool_calls") or []]])
                if ttft is None and (d.get("content") or d.get("tool_calls") or c.get("finish_reason")):
                    ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    return {"ttft": ttft, "total": time.perf_counter() - t0, "prompt": usage["prompt_tokens"], "answer": answer,
            "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "report": usage["prompt_tokens_details"].get("prefix_cache"),
            "t0": t0, "first_chunk": first_chunk}  # perf_counter times (profile_agent_turn.py)


def time_prefill_calls(engine) -> list[tuple[float, float]]:
    """Have the engine block on each prefill call and record its (start, end) perf_counter times in
    the list returned (appended as calls run): a turn's own prefill time is the sum over the calls
    that start between its request and its first token."""
    spans: list[tuple[float, float]] = []
    call = engine.calls.prefill_chunk

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = jax.block_until_ready(call(*args, **kwargs))
        spans.append((t0, time.perf_counter()))
        return out

    engine.calls.prefill_chunk = timed
    return spans


def own_prefill_s(turn: dict, spans: list[tuple[float, float]]) -> float:
    """Seconds of the prefill calls that started between `turn`'s request and its first token."""
    return sum(end - start for start, end in spans if turn["t0"] <= start <= turn["t0"] + turn["ttft"])


def serve_until_compiled(app, engine, port: int):
    """Serve `app` on `port` in a thread; return (server, thread) once /health answers and every
    shape is compiled (the rest compile behind, on the same cores, and until then a prefill runs in
    narrower calls)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    while httpx.get(f"http://127.0.0.1:{port}/health").status_code != 200 if server.started else True:
        time.sleep(0.5)
    ready = time.perf_counter() - t0
    while engine.compiling:
        time.sleep(0.5)
    print(f"server ready in {ready:.0f} s, every shape compiled in {time.perf_counter() - t0:.0f} s")
    return server, thread


def replay(url: str, requests: list[list[dict]], salt: str | None, gap: float, engine) -> list[dict]:
    """Each request after the previous answer, `gap` seconds later (the agent running its tool), on one
    kept-alive connection, as an agent's client sends them (a new httpx client per request costs
    ~45 ms of its own before sending: its SSL context)."""
    out = []
    with httpx.Client(base_url=url, timeout=600) as client:
        for i, messages in enumerate(requests):
            background = engine.counters["background_prefills"]
            out.append(ask(client, messages, salt if salt is not None else f"cold-{time.time_ns()}-{i}"))
            time.sleep(gap)
            out[-1]["background_prefills"] = engine.counters["background_prefills"] - background
    return out


def agent_server_config(max_len: int | None):
    """(cfg, params, tokenizer, ServerConfig) of the replay: the default model with the
    reasoning-dropping template, one slot, a context of `max_len` tokens (None: the model's)."""
    cfg, params, tok0 = default_model()
    if max_len:  # RoPE has no table: more positions only change the bound
        cfg = dataclasses.replace(cfg, max_position_embeddings=max(max_len, cfg.max_position_embeddings))
    tok = Tokenizer(tok0.backend, reasoning_dropping_template(), tok0.special_tokens, tok0.eos_token_ids)
    return cfg, params, tok, ServerConfig(slots=1, max_len=max_len or cfg.max_position_embeddings, warmup=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tool-tokens", default="300,400", help="min,max tokens of each tool result")
    ap.add_argument("--traces", type=int, default=1)
    ap.add_argument("--gap", type=float, default=0.0,
                    help="seconds between an answer and the next request (the tool running); not in the totals")
    ap.add_argument("--executable-dir", default=None,
                    help="keep the compiled programs here between runs (a rerun loads them: quicker start-up)")
    ap.add_argument("--max-len", type=int, default=None,
                    help="the server's context in tokens (default: the model's, 4096); more raises the model's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tool_tokens = tuple(int(x) for x in args.tool_tokens.split(","))
    with open("/proc/loadavg") as f:
        print("load average at start:", f.read().split()[:3])
    cfg, params, tok, sc = agent_server_config(args.max_len)
    sc.executable_dir = args.executable_dir
    engine, _ = build_engine(sc, cfg, params, tok, DEFAULT_NAME)
    port = 18000 + random.randint(0, 999)
    url = f"http://127.0.0.1:{port}"
    app = create_app(engine, DEFAULT_NAME, warmup=True)
    freeze_what_start_up_made(engine)  # as `hybridjax serve` does
    server, thread = serve_until_compiled(app, engine, port)
    spans = time_prefill_calls(engine)
    results = []
    try:
        for t in range(args.traces):
            requests = trace(t, args.rounds, tool_tokens, tok)
            warm = replay(url, requests, f"trace-{t}", args.gap, engine)
            cold = replay(url, requests, None, args.gap, engine)
            results.append({"warm": warm, "cold": cold})
            print(f"\ntrace {t}: {args.rounds} rounds, gap {args.gap} s; idle-time next-turn prefills that ended "
                  f"within a warm turn + its gap: {sum(w['background_prefills'] for w in warm)}")
            print(f"{'turn':>4} {'prompt':>6} {'new':>5} {'cached':>6} {'reason':>10} {'ttft':>7} {'calls':>7} "
                  f"{'excess':>7} {'cold ttft':>9} {'cold new, est.':>14}")
            prev = 0
            for i, (w, c) in enumerate(zip(warm, cold)):
                new = w["prompt"] - prev
                w["new"], w["calls"], w["cold_new"] = new, own_prefill_s(w, spans), c["ttft"] * new / c["prompt"]
                print(f"{i + 1:4d} {w['prompt']:6d} {new:5d} {w['cached']:6d} {w['report']['reason']:>10} "
                      f"{w['ttft']:7.3f} {w['calls']:7.3f} {w['ttft'] - w['calls']:7.3f} {c['ttft']:9.3f} "
                      f"{w['cold_new']:14.3f}")
                prev = w["prompt"]
            prompt = sum(w["prompt"] for w in warm)
            share = sum(w["cached"] for w in warm) / prompt
            bound = 1 - sum(w["new"] for w in warm) / prompt
            tw, tc = sum(w["total"] for w in warm), sum(c["total"] for c in cold)
            print(f"cached share {share:.3f} (bound 1 - new/prompt: {bound:.3f}); total time cache on {tw:.2f} s, "
                  f"defeated {tc:.2f} s: {tc / tw:.2f}x; turns with ttft <= their own prefill calls + 50 ms: "
                  f"{sum(w['ttft'] <= w['calls'] + 0.05 for w in warm)}/{len(warm)}; greedy answers equal to the "
                  f"cold ones: {sum(w['answer'] == c['answer'] for w, c in zip(warm, cold))}/{len(warm)}")
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    with open("/proc/loadavg") as f:
        print("load average at end:", f.read().split()[:3])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
