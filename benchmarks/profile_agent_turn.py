"""Where a continuation's time to first token goes: bench_agent's trace, one turn at a time, timed
piece by piece.

    python benchmarks/profile_agent_turn.py [--rounds 10] [--tool-tokens 250,320] [--gap 0] [--cold] [--served]

The server of bench_agent.py (in-process, the embedded default model), started and then left to
finish compiling every shape (`ready` comes while the rest still compile behind), on one
kept-alive client connection. Every device call of the engine is timed with `block_until_ready` on its
outputs (so the host and the device no longer overlap: the sum is an upper bound of the device
time; with --served only the prefill calls are, as bench_agent times a turn, and a small call
counts what it costs the host there); the host pieces around them (admission, the store's lookup and inserts, snapshot points,
template rendering and tokenizing in the server) are timed too. Per turn, one line of the
client's TTFT split into:
  server_in   request sent -> the engine's `submit` (HTTP, parsing, rendering, tokenizing)
  queued      submit -> admission (a background prefill or a previous step in the slot)
  admit       the admission itself (lookup, page copy, setup_row)
  prefill     each prefill call: tokens / padded width, seconds; and the snapshot after it
  out         first token emitted -> the client has its first chunk
With --cold every request gets a new cache_salt (the cold replay of bench_agent); with --ab N the
trace is replayed N times with the engine's chunk plan (`prefill_call_tokens`) and N times without,
interleaved, and the per-turn medians compared.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time

import httpx
import jax

import bench_agent
from bench_agent import trace
from hybridjax.default_model import DEFAULT_NAME
from hybridjax.server import create_app
from hybridjax.server.app import build_engine

EVENTS: list[tuple] = []  # (t_start, t_end, what, detail)


def timed(obj, name, what=None, block=False, detail=None):
    """Replace obj.name by a wrapper that records (start, end, what, detail(args))."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        if block:
            jax.block_until_ready(out)
        EVENTS.append((t0, time.perf_counter(), what or name, detail(*a, **k) if detail else None))
        return out

    setattr(obj, name, wrapper)


def instrument(engine, tok, served: bool = False):
    """served: block on the prefill calls only (as bench_agent times a turn), so a small call
    counts its dispatch and whatever it runs inline, not the device work queued behind it."""
    calls = engine.calls
    timed(calls, "prefill_chunk", "prefill_call", True,
          lambda params, state, rows, tokens, counts, *r, **k: (tuple(tokens.shape), counts.tolist()))
    for name in ("setup_row", "copy_page", "read_row", "sample_first", "decode", "set_bits"):
        timed(calls, name, name, not served)
    timed(engine.loop, "_admit", "admit")
    timed(engine.loop, "_snapshot", "snapshot", detail=lambda slot, row, kind, *a, **k: (kind, slot.pos))
    timed(engine.loop, "_process", "process")
    timed(engine.store, "lookup_many", "lookup")
    timed(engine.store, "insert", "store_insert")
    timed(engine, "submit", "submit", detail=lambda req, *a, **k: len(req.prompt_ids))
    timed(engine, "prefill_in_background", "background_submit", detail=lambda ids, *a, **k: len(ids))
    timed(tok, "render_chat", "render_chat")
    timed(tok, "encode", "encode", detail=lambda text, *a, **k: len(text))
    import hybridjax.engine as eng_mod
    from hybridjax.server import lanes, schemas, structured

    timed(lanes, "decode_body", "decode_body")
    timed(structured, "grammar_for", "grammar_for")
    timed(structured, "checked", "grammar_checked")
    validate = schemas.ChatCompletionRequest.model_validate.__func__

    def model_validate(cls, *a, **k):
        t0 = time.perf_counter()
        out = validate(cls, *a, **k)
        EVENTS.append((t0, time.perf_counter(), "validate", None))
        return out

    schemas.ChatCompletionRequest.model_validate = classmethod(model_validate)

    emit = eng_mod.RequestHandle._emit

    def _emit(self, event):
        EVENTS.append((time.perf_counter(), time.perf_counter(), "emit", (self.request.max_tokens, event.token_id)))
        return emit(self, event)

    eng_mod.RequestHandle._emit = _emit


def ask(client, messages, salt) -> dict:
    """bench_agent's request, its times as perf_counter instants (ttft: when the first token came)."""
    out = bench_agent.ask(client, messages, salt)
    return dict(out, ttft=out["t0"] + out["ttft"], end=out["t0"] + out["total"])


def breakdown(turn, prev_prompt, ev):
    """One turn's pieces from EVENTS between its send and its first content chunk."""
    t0, t1 = turn["t0"], turn["ttft"]
    mine = [e for e in ev if t0 <= e[0] <= t1]
    sub = next(e for e in mine if e[2] == "submit" and e[3] == turn["prompt"])
    first_emit = next(e for e in mine if e[2] == "emit" and e[0] >= sub[1] and e[3][0] > 0)
    admits = [e for e in mine if e[2] == "admit" and e[0] >= sub[1] and e[1] - e[0] > 0.0005]
    calls = [e for e in mine if e[2] == "prefill_call" and sub[1] <= e[0] <= first_emit[0]]
    bg_calls = [e for e in mine if e[2] == "prefill_call" and e[0] < sub[1]]
    snaps = [e for e in mine if e[2] == "snapshot" and sub[1] <= e[0] <= first_emit[0]]
    dec = [e for e in mine if e[2] in ("decode", "process") and sub[1] <= e[0] <= first_emit[0]]
    render = sum(e[1] - e[0] for e in mine if e[2] in ("render_chat", "encode") and e[1] <= sub[0])
    row = dict(turn=turn["i"], prompt=turn["prompt"], new=turn["prompt"] - prev_prompt, cached=turn["cached"],
               ttft=t1 - t0, server_in=sub[0] - t0, render_encode=render,
               queued=(admits[0][0] - sub[1]) if admits else None, admit=sum(e[1] - e[0] for e in admits[:1]),
               calls=[(e[3][0][1], e[3][1][0], round(e[1] - e[0], 4)) for e in calls],
               call_s=sum(e[1] - e[0] for e in calls),
               snap_s=sum(e[1] - e[0] for e in snaps), snaps=[e[3] for e in snaps],
               decode_s=sum(e[1] - e[0] for e in dec),
               out=t1 - first_emit[0], before_turn_bg_calls=len(bg_calls))
    arr = next(e for e in mine if e[2] == "arrival")
    row["pieces"] = {"arrival": arr[0] - t0}
    for name in ("decode_body", "validate", "grammar_for", "grammar_checked", "render_chat", "encode"):
        for j, e in enumerate(x for x in mine if x[2] == name and x[1] <= sub[0]):
            row["pieces"][f"{name}{j}"] = (round(e[0] - t0, 4), round(e[1] - e[0], 4))
    row["other"] = row["ttft"] - (row["server_in"] + (row["queued"] or 0) + row["admit"] + row["call_s"]
                                  + row["snap_s"] + row["out"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tool-tokens", default="250,320")
    ap.add_argument("--gap", type=float, default=0.0)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--served", action="store_true",
                    help="block on the prefill calls only, not on each small call (as bench_agent)")
    ap.add_argument("--ab", type=int, default=0, help="replays of each chunk plan (planned, plain), interleaved")
    ap.add_argument("--checkpoint-interval", type=int, default=None)
    ap.add_argument("--executable-dir", default=None, help="keep compiled programs here between runs")
    ap.add_argument("--max-len", type=int, default=None, help="the server's context (bench_agent --max-len)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tool_tokens = tuple(int(x) for x in args.tool_tokens.split(","))
    cfg, params, tok, sc = bench_agent.agent_server_config(args.max_len)
    sc.executable_dir = args.executable_dir
    if args.checkpoint_interval is not None:
        sc.checkpoint_interval = args.checkpoint_interval
    engine, _ = build_engine(sc, cfg, params, tok, DEFAULT_NAME)
    port = 18000 + random.randint(0, 999)
    url = f"http://127.0.0.1:{port}"
    app = create_app(engine, DEFAULT_NAME, warmup=True)

    async def arrival(scope, receive, send):  # the request's headers are in
        if scope["type"] == "http":
            EVENTS.append((time.perf_counter(), time.perf_counter(), "arrival", scope["path"]))
        await app(scope, receive, send)

    server, thread = bench_agent.serve_until_compiled(arrival, engine, port)
    instrument(engine, tok, args.served)
    with open("/proc/loadavg") as f:
        print("load average at start:", f.read().split()[:3])
    rows = []
    try:
        requests = trace(0, args.rounds, tool_tokens, tok)
        planned = engine.sched.prefill_call_tokens
        ab = {}
        for rep in range(args.ab or 1):
            for setting in ((planned, None) if args.ab else (planned,)):
                engine.sched.prefill_call_tokens = setting
                turns = []
                with httpx.Client(base_url=url, timeout=600) as client:  # one kept-alive connection, as an agent
                    for i, messages in enumerate(requests):
                        salt = f"cold-{time.time_ns()}" if args.cold else f"trace-{rep}-{setting}"
                        turns.append(dict(ask(client, messages, salt), i=i + 1))
                        time.sleep(args.gap)
                time.sleep(0.5)
                prev = 0
                for t in turns:
                    r = breakdown(t, prev, EVENTS)
                    ab.setdefault(setting, []).append(r)
                    if setting == planned and rep == 0:
                        rows.append(r)
                    prev = t["prompt"]
        if args.ab:
            print("A/B of the prefill chunk plan (prefill_call_tokens), per turn: ttft / prefill-call seconds, "
                  "median over", args.ab, "replays each, interleaved")
            import statistics
            for setting, rs in ab.items():
                per = {}
                for r in rs:
                    per.setdefault(r["turn"], []).append((r["ttft"], r["call_s"], len(r["calls"])))
                print(f"  prefill_call_tokens={setting}: " + " ".join(
                    f"{k}:{statistics.median(x[0] for x in v):.3f}/{statistics.median(x[1] for x in v):.3f}"
                    f"({v[0][2]})" for k, v in sorted(per.items())))
                print(f"    sum of median ttft over turns 2..: "
                      f"{sum(statistics.median(x[0] for x in v) for k, v in per.items() if k > 1):.3f} s")
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    with open("/proc/loadavg") as f:
        print("load average at end:", f.read().split()[:3])
    print(f"{'turn':>4} {'prompt':>6} {'new':>4} {'cached':>6} {'ttft':>6} {'srv_in':>6} {'(tmpl)':>6} {'queued':>6} "
          f"{'admit':>6} {'calls':>6} {'snaps':>6} {'out':>6} {'other':>6}  calls (tokens/width s), snapshots")
    for r in rows:
        q = r["queued"] if r["queued"] is not None else float("nan")
        print(f"{r['turn']:4d} {r['prompt']:6d} {r['new']:4d} {r['cached']:6d} {r['ttft']:6.3f} {r['server_in']:6.3f} "
              f"{r['render_encode']:6.3f} {q:6.3f} {r['admit']:6.3f} {r['call_s']:6.3f} {r['snap_s']:6.3f} "
              f"{r['out']:6.3f} {r['other']:6.3f}  {' '.join(f'{c}/{w} {s:.3f}' for w, c, s in r['calls'])}"
              f"  {r['snaps']} bg-calls-before:{r['before_turn_bg_calls']}")
    for r in rows:
        print(r["turn"], r["pieces"], "submit at", round(r["server_in"], 4))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
