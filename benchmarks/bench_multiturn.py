"""Multi-turn chat on the engine: time to first token with the snapshot store, without it, and
the lower bound; plus aggregate decode throughput at 1, 4 and 8 streams beside the matmul bound.

    python benchmarks/bench_multiturn.py [--quick] [--repeats 3] [--ttft-slots 1,4] [--json OUT]

One process, a random Qwen3.5 dense text model built directly in hybridjax (float32; hidden
1024, 12 layers, 3 linear : 1 full attention, 8 q / 2 kv heads of 128, linear heads 8 k / 16 v
of 64, intermediate 3072, vocab 32000, untied head: ~0.23 B params). Token ids are random.

Time to first token of the next turn. For a target prompt length P (2048 and 8192; --quick:
512 and 2048) the chat is: history H = P - 128 random tokens, the previous turn's response
(R = 64 greedy tokens the engine generates), and U = 63 new tokens. P - 1 fits the KV bucket P,
so neither path pays for a bucket crossing or for padding past P.
  cached  an Engine with a SnapshotStore served the previous turn (prompt H, max_tokens R), which
          left its response snapshot (H + R tokens). Timed: submit of the next turn
          (H + R + U tokens, max_tokens 1) to its first token event. The engine looks up the
          snapshot, prefills the U new tokens from it, writes the row into its batched cache and
          runs one batched decode step. Before every repeat the store is restored to what the
          previous turn left (the kept snapshot values are re-inserted: free, they are
          references), since a repeat's own prompt snapshot supersedes the response snapshot,
          as it should in a linear chat; each repeat sends different new tokens.
  cold    the same prompts on an Engine with store=None (checkpoint_interval 0: one prefill of
          P - 1 tokens, padded to P). Not warmed up separately: the previous turn (H tokens, also
          padded to P, on an engine with the same slot count) compiled the same shapes.
  bound   `hybridjax.generate.prefill` of the U new tokens from the response snapshot's cache,
          then one `decode_step_donating` of the greedy token, timed directly (no engine); run
          right before and right after the cached requests of each repeat, the mean kept.
With --ttft-slots 1,4 the cached path runs on a 1-slot and a 4-slot engine (sharing the store);
cold runs on a 1-slot engine. Ratios: cold / cached (target >= 20x at 8k) and cached / bound (target <= 1.2x). A further
instrumented request per length splits the cached TTFT into the engine's admission steps
(every wrapped call blocks until its outputs are ready, so the parts add up).

Decode throughput. For n in (1, 4, 8): an Engine with n slots (store=None), n requests with
distinct 16-token prompts and max_tokens 64 are queued before the engine starts, so all are
admitted together; aggregate tok/s = tokens after each stream's first / (last event - first
event). The bound for batching: one jitted function doing one decode step's matmuls (every
layer's projections and MLP, and the lm_head, as plain `x @ W` in float32, chained as in the
model) at x of n rows, t_mm(n); ideal(n) = tok/s(1) * n * t_mm(1) / t_mm(n). Target: measured /
ideal >= 0.8 at 8 streams. For attribution the engine's jitted decode step
(`sample_and_decode_donating`), its sampler (`next_token`) and the forward alone
(`decode_step_donating`) are timed at n rows too. Measurements run in rounds (each round: every
n, matmul step, step pieces, engine run) so that the ratios compare numbers taken under the
same machine load; the ratio is formed per round and its median reported.

Compilation is excluded: every configuration runs once untimed with the same shapes; medians
of --repeats runs are reported. Other jobs on the machine add noise: the load average is
printed at the start and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import hybridjax.engine as engine_mod  # noqa: E402
from hybridjax.cache import init_cache, nbytes  # noqa: E402
from hybridjax.config import FULL, config_from_dict  # noqa: E402
from hybridjax.engine import Engine, GenerationRequest  # noqa: E402
from hybridjax.generate import (  # noqa: E402
    _next_token_jit, decode_step_donating, init_sampler, pad_prompts, prefill, sample_and_decode_donating,
)
from hybridjax.params import GDNParams, init_params  # noqa: E402
from hybridjax.prefix_cache import SnapshotStore  # noqa: E402
from hybridjax.sampling import sampling_params  # noqa: E402

MODEL = {
    "model_type": "qwen3_5_text", "vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 12,
    "full_attention_interval": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "intermediate_size": 3072,
    "max_position_embeddings": 16384, "tie_word_embeddings": False,
}
FULL_RUN = dict(layers=12, prompts=(2048, 8192), repeats=3)
QUICK_RUN = dict(layers=4, prompts=(512, 2048), repeats=2)
MAX_LEN = 16384
RESPONSE = 64  # R: the previous turn's response tokens
NEW = 63  # U: the next turn's new tokens (H + R + U = P - 1 fits the KV bucket P)
STREAM_PROMPT = 16
DECODE_TOKENS = 64
SEED = 0


def med(xs) -> float:
    return statistics.median(xs)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def first_token_time(engine: Engine, prompt: list[int], max_tokens: int = 1, **kw):
    """(seconds from submit to the first token event, finished handle)."""
    t0 = time.perf_counter()
    h = engine.submit(GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, **kw))
    ttft = None
    for ev in h.events(timeout=3600):
        if ttft is None and ev.token_id is not None:
            ttft = time.perf_counter() - t0
    if h.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"request ended with {h.finish_reason!r}")
    return ttft, h


# --- time to first token ---------------------------------------------------------------------


class Restorable:
    """The store's entries after the previous turn, re-inserted before every repeat."""

    def __init__(self, store: SnapshotStore):
        self.store = store
        self.saved = store.snapshots()  # LRU order, oldest first

    def restore(self) -> None:
        self.store.clear()
        for s in self.saved:
            self.store.insert(s.tokens, s.cache, s.logits, namespace=s.namespace, kind=s.kind)


class Breakdown:
    """Wrap the engine's steps (module globals and store methods) with blocking timers."""

    def __init__(self, store: SnapshotStore):
        self.store, self.t = store, {}
        self._orig = {}
        self.done = False  # set after the first decode step: later calls (the finish) are not counted

    def _wrap(self, name, fn, label=None):
        def timed(*args, **kwargs):
            key = label(args) if label else name
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            if not self.done:
                self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - t0
                self.done = key.startswith("decode step")
            return out
        return timed

    def __enter__(self):
        for name in ("prefill", "write_row_donating", "init_sampler", "sample_and_decode_donating"):
            self._orig[name] = getattr(engine_mod, name)
        engine_mod.prefill = self._wrap("prefill (suffix)", engine_mod.prefill)
        engine_mod.write_row_donating = self._wrap(
            "write_row", engine_mod.write_row_donating,
            label=lambda a: "write_row (cache, logits)" if isinstance(a[0], tuple) else "write_row (sampler)")
        engine_mod.init_sampler = self._wrap("init_sampler (row)", engine_mod.init_sampler)
        engine_mod.sample_and_decode_donating = self._wrap("decode step (batched)", engine_mod.sample_and_decode_donating)
        self._lookup, self._insert = self.store.lookup_many, self.store.insert
        self.store.lookup_many = self._wrap("store lookup", self._lookup)
        self.store.insert = self._wrap("store insert (prompt snapshot)", self._insert)
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(engine_mod, name, fn)
        del self.store.lookup_many, self.store.insert  # back to the class methods
        return False


def ttft_for_length(cfg, params, p: int, slots_list: list[int], repeats: int) -> list[dict]:
    """TTFT rows for next-turn prompt length p - 1, one per engine slot count. All engines share
    one store (a snapshot is a batch-of-one cache, usable by any engine of the same model); the
    previous turn runs on the first engine; cold runs once, at the first slot count."""
    rng = np.random.default_rng(SEED + p)
    h_len = p - RESPONSE - NEW - 1
    history = rng.integers(0, cfg.vocab_size, h_len).tolist()
    new_tokens = [rng.integers(0, cfg.vocab_size, NEW).tolist() for _ in range(repeats + 2)]

    store = SnapshotStore("bench-multiturn", max_bytes=8 << 30)
    engines = {s: Engine(cfg, params, None, slots=s, max_len=MAX_LEN, store=store, checkpoint_interval=0).start()
               for s in slots_list}
    t0 = time.perf_counter()
    prev = engines[slots_list[0]].generate(GenerationRequest(prompt_ids=history, max_tokens=RESPONSE), timeout=3600)
    log(f"P={p}: previous turn ({h_len} prompt + {RESPONSE} tokens) in {time.perf_counter() - t0:.1f}s")
    response = prev.token_ids
    resp = [s for s in store.snapshots() if s.kind == "response"]
    assert len(resp) == 1 and len(resp[0].tokens) == h_len + RESPONSE, [(s.kind, len(s.tokens)) for s in store.snapshots()]
    resp = resp[0]
    saved = Restorable(store)
    prompts = [history + response + u for u in new_tokens]
    assert len(prompts[0]) == p - 1
    cold_eng = Engine(cfg, params, None, slots=slots_list[0], max_len=MAX_LEN, store=None, checkpoint_interval=0).start()

    def bound(i):
        t0 = time.perf_counter()
        tokens, counts = pad_prompts([new_tokens[i]])
        logits, cache = prefill(params, tokens, resp.cache, cfg, counts)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits, cache = jax.block_until_ready(decode_step_donating(params, tok, cache, cfg))
        return time.perf_counter() - t0, int(tok[0])

    def bound_parts(i):
        tokens, counts = pad_prompts([new_tokens[i]])
        t0 = time.perf_counter()
        logits, cache = jax.block_until_ready(prefill(params, tokens, resp.cache, cfg, counts))
        t1 = time.perf_counter()
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        jax.block_until_ready(decode_step_donating(params, tok, cache, cfg))
        return t1 - t0, time.perf_counter() - t1

    rows = {s: {"P": p, "history": h_len, "prompt": p - 1, "suffix": NEW, "slots": s, "cached": [], "cold": [],
                "bound": [], "first_tokens_equal": 0, "compared": 0} for s in slots_list}
    for i in range(repeats + 1):  # i == 0: warm-up (compiles every shape), not kept
        # The bound runs right before and right after the cached requests (its mean is kept),
        # so that a drift in machine load does not favour either side.
        t_before, _ = bound(i)
        cached = {}
        for s, eng in engines.items():
            saved.restore()
            cached[s] = first_token_time(eng, prompts[i])
            assert cached[s][1].cached_tokens == h_len + RESPONSE, (cached[s][1].cached_tokens, h_len + RESPONSE)
        t_after, tok_bound = bound(i)
        t_bound = (t_before + t_after) / 2
        if i == 0:  # the previous turn compiled every shape the cold path uses (same buckets)
            log(f"P={p}: warm-up done")
            continue
        t_cold, hc = first_token_time(cold_eng, prompts[i])
        for s, (t_cached, h) in cached.items():
            r = rows[s]
            r["cached"].append(t_cached)
            r["bound"].append(t_bound)
            r["cold"].append(t_cold)
            r["compared"] += 1
            r["first_tokens_equal"] += int(h.token_ids[0] == tok_bound == hc.token_ids[0])
        log(f"P={p} repeat {i}: cached " + ", ".join(f"{t * 1e3:.0f} ms ({s} slots)" for s, (t, _) in cached.items())
            + f", bound {t_bound * 1e3:.0f} ms, cold {t_cold * 1e3:.0f} ms")

    # Where the cached time goes: one more request with every engine step wrapped in a blocking timer.
    parts = [bound_parts(repeats + 1) for _ in range(2)][-1]
    for s, eng in engines.items():
        saved.restore()
        with Breakdown(store) as bd:
            t_instr, _ = first_token_time(eng, prompts[repeats + 1])
        rows[s]["bound_parts"] = {"prefill (suffix)": parts[0], "decode step": parts[1]}
        rows[s]["breakdown"] = dict(bd.t)
        rows[s]["breakdown_ttft"] = t_instr
        eng.stop()
    cold_eng.stop()
    return list(rows.values())


# --- decode throughput and the matmul bound --------------------------------------------------


def decode_run(eng: Engine, prompts: list[list[int]]) -> float:
    """Queue one request per prompt, start the engine (all are admitted together), return the
    aggregate decode rate: tokens after each stream's first / (last event - first event)."""
    handles = [eng.submit(GenerationRequest(prompt_ids=pr, max_tokens=DECODE_TOKENS)) for pr in prompts]
    stamps = [[] for _ in handles]

    def consume(h, out):
        for ev in h.events(timeout=3600):
            if ev.token_id is not None:
                out.append(time.perf_counter())

    threads = [threading.Thread(target=consume, args=(h, s)) for h, s in zip(handles, stamps)]
    for t in threads:
        t.start()
    eng.start()
    for t in threads:
        t.join()
    eng.stop()
    assert all(len(s) == DECODE_TOKENS for s in stamps), [len(s) for s in stamps]
    t_first, t_last = min(s[0] for s in stamps), max(s[-1] for s in stamps)
    return sum(len(s) - 1 for s in stamps) / (t_last - t_first)


def matmul_weights(params):
    """Per layer: the mixer's projections, then the MLP's; and the lm_head."""
    layers = []
    for lp in params.layers:
        m = lp.mixer
        mixer = ("gdn", (m.in_qkv, m.in_z, m.in_b, m.in_a, m.out_proj)) if isinstance(m, GDNParams) else \
            ("attn", (m.q_proj, m.k_proj, m.v_proj, m.o_proj))
        layers.append((mixer, (lp.ffn.gate, lp.ffn.up, lp.ffn.down)))
    head = params.embed.T if params.lm_head is None else params.lm_head
    return layers, head


def make_matmul_step(kinds):
    """One decode step's matmuls as plain `x @ W`, chained like the model (cheap glue only)."""

    def step(x, layers, head):
        h = x
        for kind, (mixer, (gate, up, down)) in zip(kinds, layers):
            if kind == "gdn":
                qkv_w, z_w, b_w, a_w, out_w = mixer
                qkv, z, b, a = h @ qkv_w, h @ z_w, h @ b_w, h @ a_w
                v = qkv[:, -out_w.shape[0]:]
                y = (v * jnp.tanh(z) + jnp.sum(b + a, axis=-1, keepdims=True) * 1e-3) @ out_w
            else:
                q_w, k_w, v_w, o_w = mixer
                q, k, v = h @ q_w, h @ k_w, h @ v_w
                y = (q[:, : o_w.shape[0]] + jnp.sum(k + v, axis=-1, keepdims=True) * 1e-3) @ o_w
            h = jnp.tanh(h + y)
            h = jnp.tanh(h + (jax.nn.silu(h @ gate) * (h @ up)) @ down)
        return h @ head

    return jax.jit(step)


def time_fn(fn, n_calls: int = 15, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(n_calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return med(ts)


def matmul_fn(cfg, params, n: int):
    layers, head = matmul_weights(params)
    kinds = [k for (k, _), _ in layers]
    layers = [(w, ffn) for (_, w), ffn in layers]
    step = make_matmul_step(kinds)
    x = jnp.asarray(np.random.default_rng(n).standard_normal((n, cfg.hidden_size)), jnp.float32)
    return lambda: step(x, layers, head)


def step_alone_fns(cfg, params, n: int, capacity: int = 128) -> dict:
    """The engine's jitted decode step (sample + forward, donating), its sampler alone and the
    forward alone (`decode_step_donating`), at n rows and KV capacity 128 (as in the engine runs)."""
    st = {"cache": init_cache(cfg, n, MAX_LEN, capacity=capacity),
          "logits": jnp.asarray(np.random.default_rng(n).standard_normal((n, cfg.vocab_size)), jnp.float32),
          "sampler": init_sampler(sampling_params(n), [0] * n, cfg.vocab_size),
          "fwd_cache": init_cache(cfg, n, MAX_LEN, capacity=capacity)}
    active, toks = jnp.ones((n,), bool), jnp.zeros((n,), jnp.int32)

    def step():
        tok, st["logits"], st["cache"], st["sampler"] = sample_and_decode_donating(
            params, st["logits"], st["cache"], st["sampler"], active, cfg)
        return tok

    def sampler():
        return _next_token_jit(st["logits"], st["sampler"])

    def forward():
        logits, st["fwd_cache"] = decode_step_donating(params, toks, st["fwd_cache"], cfg)
        return logits

    return {"step": step, "sampler": sampler, "forward": forward}


def decode_section(cfg, params, streams: list[int], repeats: int) -> dict:
    """Rounds: in each, for every n, the matmul-only step, the engine's step pieces alone and one
    engine run with n streams, so that all of them see the same machine load. Round 0 warms up."""
    rng = np.random.default_rng(SEED + 1000)
    prompts = {n: [rng.integers(0, cfg.vocab_size, STREAM_PROMPT).tolist() for _ in range(n)] for n in streams}
    engines = {n: Engine(cfg, params, None, slots=n, max_len=MAX_LEN, store=None) for n in streams}
    mm = {n: matmul_fn(cfg, params, n) for n in streams}
    alone = {n: step_alone_fns(cfg, params, n) for n in streams}
    res = {n: {"rate": [], "mm": [], "step": [], "sampler": [], "forward": []} for n in streams}
    for rnd in range(repeats + 1):
        for n in streams:
            t_mm = time_fn(mm[n], n_calls=7, warmup=2 if rnd == 0 else 1)
            t_alone = {k: time_fn(f, n_calls=5, warmup=2 if rnd == 0 else 1) for k, f in alone[n].items()}
            rate = decode_run(engines[n], prompts[n])
            if rnd:
                res[n]["rate"].append(rate)
                res[n]["mm"].append(t_mm)
                for k, v in t_alone.items():
                    res[n][k].append(v)
            log(f"decode round {rnd}{' (warm-up)' if rnd == 0 else ''}: {n} streams {rate:.1f} tok/s, "
                f"matmul step {t_mm * 1e3:.0f} ms, engine step alone {t_alone['step'] * 1e3:.0f} ms")
    return res


# --- driver ----------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="prompts 512/2048, 4 layers, 2 repeats")
    ap.add_argument("--repeats", type=int, help="timed repeats per configuration (median reported)")
    ap.add_argument("--prompts", help="comma-separated next-turn prompt lengths P (history = P - 128)")
    ap.add_argument("--layers", type=int, help="decoder layers (default 12; --quick 4)")
    ap.add_argument("--ttft-slots", default="1,4", help="engine slots for the TTFT runs (cold runs at the first)")
    ap.add_argument("--streams", default="1,4,8", help="concurrent streams for decode throughput")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--json", help="also write all raw timings here")
    a = ap.parse_args(argv)

    run = dict(QUICK_RUN if a.quick else FULL_RUN)
    if a.repeats:
        run["repeats"] = a.repeats
    if a.prompts:
        run["prompts"] = tuple(int(x) for x in a.prompts.split(","))
    if a.layers:
        run["layers"] = a.layers
    ttft_slots = [int(x) for x in a.ttft_slots.split(",")]
    streams = [int(x) for x in a.streams.split(",")]

    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    cfg = config_from_dict({**MODEL, "num_hidden_layers": run["layers"]})
    params = jax.block_until_ready(init_params(SEED, cfg))
    n_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
    log(f"model: {n_params / 1e6:.1f} M params, {nbytes(params) / 2**20:.0f} MiB float32, "
        f"{run['layers']} layers ({sum(t == FULL for t in cfg.layer_types)} full attention)")

    results = {"run": run, "n_params": n_params, "ttft": [], "decode": {}}
    if not a.skip_ttft:
        for p in run["prompts"]:
            results["ttft"].extend(ttft_for_length(cfg, params, p, ttft_slots, run["repeats"]))
    if not a.skip_decode:
        results["decode"] = decode_section(cfg, params, streams, run["repeats"])
    results["wall_s"] = time.perf_counter() - t_start
    results["loadavg"] = (load0, os.getloadavg()[0])
    report(results, cfg)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


def report(r: dict, cfg) -> None:
    ms = lambda s: f"{s * 1e3:.0f}" if s >= 0.1 else f"{s * 1e3:.1f}"  # noqa: E731
    run = r["run"]
    print(f"\nhybridjax multi-turn benchmark: jax {jax.__version__}, {jax.devices()[0].platform}, "
          f"{r['n_params'] / 1e6:.0f} M params float32, {run['layers']} layers, "
          f"median of {run['repeats']} (wall {r['wall_s']:.0f}s, load avg {r['loadavg'][0]:.1f} -> {r['loadavg'][1]:.1f})")
    if r["ttft"]:
        print(f"\nTime to first token of the next turn (history H, response R={RESPONSE}, new U={NEW}; "
              "prompt = H + R + U; the cache hit covers H + R)")
        print("| prompt | history | slots | cached ms | cold ms | bound ms | cold / cached | cached / bound | same 1st token |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for t in r["ttft"]:
            c, b, cold = med(t["cached"]), med(t["bound"]), med(t["cold"])
            print(f"| {t['prompt']} | {t['history']} | {t['slots']} | {ms(c)} | {ms(cold)} | {ms(b)} | "
                  f"{cold / c:.1f}x | {c / b:.2f}x | {t['first_tokens_equal']}/{t['compared']} |")
        print("\nWhere the cached TTFT goes (one instrumented request; each step blocks until ready), ms:")
        for t in r["ttft"]:
            parts = ", ".join(f"{k} {ms(v)}" for k, v in t["breakdown"].items())
            other = t["breakdown_ttft"] - sum(t["breakdown"].values())
            bp = ", ".join(f"{k} {ms(v)}" for k, v in t["bound_parts"].items())
            print(f"- P={t['prompt']} slots={t['slots']}: total {ms(t['breakdown_ttft'])} = {parts}, rest {ms(other)}"
                  f"  |  bound: {bp}")
    if r["decode"]:
        d = {int(n): v for n, v in r["decode"].items()}
        print(f"\nAggregate decode throughput ({STREAM_PROMPT}-token prompts, {DECODE_TOKENS} tokens per stream, store off). "
              "Per round: ideal(n) = tok/s(1) * n * t_mm(1) / t_mm(n); medians over rounds")
        print("| streams | tok/s | ms / step | matmul-only step ms | t_mm(n) / t_mm(1) | ideal tok/s | measured / ideal | "
              "engine step alone ms | sampler alone ms | forward alone ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n, v in d.items():
            rounds = range(len(v["rate"]))
            if 1 in d:
                one = d[1]
                ideal = [one["rate"][i] * n * one["mm"][i] / v["mm"][i] for i in rounds]
                mm_ratio = med([v["mm"][i] / one["mm"][i] for i in rounds])
                ratio = med([v["rate"][i] / ideal[i] for i in rounds])
                ideal_s, ratio_s, mmr_s = f"{med(ideal):.1f}", f"{ratio:.2f}", f"{mm_ratio:.2f}"
            else:
                ideal_s = ratio_s = mmr_s = "-"
            tok_s = med(v["rate"])
            print(f"| {n} | {tok_s:.1f} | {n / tok_s * 1e3:.0f} | {med(v['mm']) * 1e3:.0f} | {mmr_s} | {ideal_s} | {ratio_s} | "
                  f"{med(v['step']) * 1e3:.0f} | {med(v['sampler']) * 1e3:.1f} | {med(v['forward']) * 1e3:.0f} |")
    print("\nTargets: cached / bound <= 1.2x and cold / cached >= 20x at 8k; decode measured / ideal >= 0.8 at 8 streams.")


if __name__ == "__main__":
    sys.exit(main())
