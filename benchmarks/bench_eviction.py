"""Which snapshots the store keeps under a tight budget: GDSF against LRU on one replay.

    python benchmarks/bench_eviction.py [--cache-mb 4096] [--shape 80b|default] [--seed 0] [--json OUT]

A host-level replay: no model runs. Requests go through `hybridjax.prefix_cache.SnapshotStore`
as the engine sends them (lookup, then a prompt snapshot and a response snapshot that share the
conversation's KV pages by id, each with its own copy of the recurrent state and logits), with
the store's real byte accounting: a page is `hybridjax.pages.page_bytes` of the chosen shape (64
tokens, bfloat16 KV), a snapshot's recurrent state the bytes of the shape's GDN state (float32,
sized with `jax.eval_shape(init_cache)`, held as a zero-copy view so the replay uses no memory).
Not modelled: periodic checkpoints, history snapshots, idle-time next-turn prefills, the page
pool's own evictions (the pool is large enough here; the byte budget decides).

The workload, interleaved at random (seeded): coding-agent traces (a shared 3k-token system prompt
with tool definitions, a task, then 10-30 rounds of an assistant turn of 50-300 tokens and a tool
result of 300-1500 tokens, each request the whole transcript), multi-turn chats (3-8 turns of a
20-200-token message and a 50-300-token answer) and one-off prompts (200-2000 tokens, never
repeated). Reported per policy, both in one run on the same request sequence: prefill tokens
saved (tokens served from snapshots), the hit rate (requests that reused anything), and both per
kind of traffic.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import jax
import numpy as np

from hybridjax.cache import init_cache
from hybridjax.config import config_from_dict
from hybridjax.pages import PagePool, page_bytes, pages_for
from hybridjax.prefix_cache import SnapshotStore

PAGE = 64
SHAPES = {
    # Qwen3-Next-80B-A3B's cache shapes: 48 layers, 3 linear : 1 full attention.
    "80b": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4),
    # The embedded default model's.
    "default": None,
}


def shape_config(name: str):
    if name == "default":
        from hybridjax.default_model import default_model

        return default_model()[0]
    from hybridjax.default_model import TINY_CONFIG

    return config_from_dict(dict(TINY_CONFIG, **SHAPES[name], vocab_size=151936))


def gdn_bytes(cfg) -> int:
    """Bytes of one row's recurrent state (every linear-attention layer's conv and ssm state)."""
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, PAGE))
    leaves = [layer for layer in cache.layers if hasattr(layer, "ssm")]
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for layer in leaves for x in (layer.conv, layer.ssm))


def workload(seed: int, agents: int = 6, chats: int = 20, one_offs: int = 120) -> list[tuple[str, list, list]]:
    """(kind, prompt, answer) of every request in arrival order: a session's next prompt is this
    prompt + this answer (as the client sends it back) + its new message or tool result."""
    rng = random.Random(seed)
    fresh = iter(range(1, 10**9))
    new = lambda n: [next(fresh) for _ in range(n)]  # noqa: E731  tokens never seen before

    def session(kind, prompt, turns, answer_len, message_len):
        steps = []
        for _ in range(turns):
            answer = new(rng.randint(*answer_len))
            steps.append((kind, prompt, answer))
            prompt = prompt + answer + new(rng.randint(*message_len))
        return steps

    system = new(3000)  # one coding agent's system prompt and tool definitions, shared by its traces
    sessions = [session("agent", system + new(rng.randint(100, 400)), rng.randint(10, 30), (50, 300), (300, 1500))
                for _ in range(agents)]
    sessions += [session("chat", new(rng.randint(50, 300)), rng.randint(3, 8), (50, 300), (20, 200))
                 for _ in range(chats)]
    sessions += [session("one-off", new(rng.randint(200, 2000)), 1, (50, 300), (0, 0)) for _ in range(one_offs)]
    out = []
    while sessions:  # interleave: any session's next request, at random
        s = rng.randrange(len(sessions))
        out.append(sessions[s].pop(0))
        if not sessions[s]:
            sessions.pop(s)
    return out


def replay(requests, policy: str, max_bytes: int, state_bytes: int, pbytes: int) -> dict:
    pool = PagePool(1 << 22, PAGE)
    store = SnapshotStore("bench", max_bytes=max_bytes, max_entries=1 << 20, ttl_s=None, policy=policy)
    store.use_pages(pool, pbytes)
    zero = np.zeros((1,), np.float32)
    logits_shape = (151936,)  # a Qwen vocabulary of float32 logits per snapshot
    stats = {k: {"requests": 0, "hits": 0, "prompt": 0, "saved": 0} for k in ("agent", "chat", "one-off", "all")}
    for kind, prompt, answer in requests:
        hit = store.lookup(prompt)
        for k in (kind, "all"):
            s = stats[k]
            s["requests"] += 1
            s["hits"] += hit.reused > 0
            s["prompt"] += len(prompt)
            s["saved"] += hit.reused
        # The row's pages: the snapshot's full pages by id, fresh pages for the rest.
        shared = list(hit.snapshot.pages[: hit.reused // PAGE]) if hit.snapshot else []
        pool.retain(shared)
        row = shared + pool.alloc(pages_for(len(prompt) + len(answer), PAGE) - len(shared))
        for tokens, kind_ in ((prompt, "prompt"), (prompt + answer, "response")):
            # Counted by the store, not allocated: zero-copy views of the right sizes.
            state = {"gdn": np.broadcast_to(zero, (state_bytes // 4,))}
            store.insert(tokens, state, np.broadcast_to(zero, logits_shape), kind=kind_,
                         pages=row[: pages_for(len(tokens), PAGE)])
        pool.release(row)
    for s in stats.values():
        s["hit_rate"] = s["hits"] / max(s["requests"], 1)
        s["saved_share"] = s["saved"] / max(s["prompt"], 1)
    return {"stats": stats, "evictions": {k: v for k, v in store.counters.items() if k.startswith("evictions_")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-mb", type=float, default=4096.0)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="80b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with open("/proc/loadavg") as f:
        print("load average:", f.read().split()[:3])
    cfg = shape_config(args.shape)
    state_bytes, pbytes = gdn_bytes(cfg), page_bytes(cfg, PAGE, np.dtype("bfloat16"))
    requests = workload(args.seed)
    print(f"shape {args.shape}: recurrent state {state_bytes / 2**20:.1f} MB per snapshot, "
          f"KV {pbytes / PAGE / 1024:.1f} KB per token; budget {args.cache_mb:.0f} MB; {len(requests)} requests, "
          f"{sum(len(p) for _, p, _ in requests)} prompt tokens")
    results = {}
    for policy in ("lru", "gdsf"):
        t0 = time.perf_counter()
        results[policy] = replay(requests, policy, int(args.cache_mb * 2**20), state_bytes, pbytes)
        results[policy]["seconds"] = time.perf_counter() - t0
    print(f"{'policy':6} {'kind':8} {'requests':>8} {'hit rate':>8} {'prompt tok':>11} {'saved tok':>10} {'saved %':>8}")
    for policy, r in results.items():
        for kind, s in r["stats"].items():
            print(f"{policy:6} {kind:8} {s['requests']:8d} {s['hit_rate']:8.2f} {s['prompt']:11d} {s['saved']:10d} "
                  f"{100 * s['saved_share']:7.1f}%")
        print(f"{policy:6} replay took {r['seconds']:.1f} s; evictions {r['evictions']}")
    lru, gdsf = results["lru"]["stats"]["all"], results["gdsf"]["stats"]["all"]
    print(f"gdsf / lru: prefill tokens saved {gdsf['saved'] / max(lru['saved'], 1):.2f}x, "
          f"hit rate {gdsf['hit_rate']:.2f} vs {lru['hit_rate']:.2f}")
    with open("/proc/loadavg") as f:
        print("load average:", f.read().split()[:3])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
