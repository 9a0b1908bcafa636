"""The engine with speculative decoding: `Engine(speculative_tokens=K)`, `serve --speculative-tokens`.

The model is the tiny test architecture with a 32-token vocabulary and weights chosen so that
drafts are often right: every layer's output projections scaled by 0.3 (the residual stream
stays close to the token's embedding, so the tied LM head often repeats the last token) and an
MTP head whose `fc` reads only the embedding (it drafts "the same token again"). About half the
drafts are accepted, so rows accept anything from 0 to K drafts in one step, and stop on
drafts; a random head accepts ~1% and would test only the rejection path.

- Greedy: four concurrent requests of different lengths give the same tokens with K = 3 as
  `generate` without drafts (the plain engine equals `generate`: tests/test_engine.py; a plain
  engine here would double this module's compile time); a stop id and a budget that end a row
  on a draft.
- Snapshots: a response snapshot holds exactly the response's tokens and its recurrent state,
  logits, hidden state, KV pages and MTP pages equal one cold pass over those tokens; a hit on it
  (a longer conversation) and an exact repeat under speculation equal the cold path.
- /metrics: drafted, accepted, verify steps, acceptance rate; log-probabilities of accepted
  drafts; seeded sampling is reproducible.
- `serve --speculative-tokens` through real HTTP (openai client), and the CLI flag; a stop string
  (seen by the host after the row may have accepted drafts past it) leaves no wrong snapshot:
  every snapshot's logits equal a cold pass over its tokens.
- The adaptive engine (plain steps while drafting does not pay) mixes both kinds of step and
  gives the same tokens.
- Warm-up compiles the speculative step: serving all of the above compiles nothing more.

Tolerances: float32 everywhere; the engine's chunked prefill and verify passes against one cold
pass differ by summation order only (~1e-6), asserted <= 1e-4 relative as test_model.py.
The engines share one configuration, so the HTTP server's engine reuses their compiled programs.
"""

from __future__ import annotations

import functools
import socket
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import uvicorn

from engine_helpers import speculative_test_model

import hybridjax
import hybridjax.engine_steps as steps
from hybridjax.cache import GDNState, KVState
from hybridjax.engine import Engine, GenerationRequest
from hybridjax.generate import generate
from hybridjax.model import forward_hidden, lm_logits
from hybridjax.mtp import init_mtp_state, mtp_hidden
from hybridjax.prefix_cache import SnapshotStore
from hybridjax.server.metrics import render_metrics
from hybridjax.tokenizer import char_level_tokenizer

VOCAB, SCALE, K = 32, 0.3, 3
# Chunks of 16 tokens (one prefill shape: compile time dominates this module), pages of 16.
KW = dict(slots=4, max_len=128, page_size=16, prefill_chunk=16)
ENGINE_STEPS = ("spec_decode", "prefill_chunk", "sample_first", "setup_row", "read_row", "copy_page")
rng = np.random.RandomState(0)
PROMPTS = [rng.randint(0, VOCAB, n).tolist() for n in (5, 17, 30, 9)]  # across pages and chunks
MAX_TOKENS = [20, 13, 25, 30]
REF_TOKENS = [30, 13, 25, 30]  # the cold path runs row 0 further: the continuation of its conversation
TIMEOUT = 600


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.fixture(scope="module")
def model():
    return speculative_test_model(VOCAB, SCALE)


@pytest.fixture(scope="module")
def reference(model):
    """The cold path: `generate` without drafts, all four prompts in one call."""
    cfg, params = model
    g = generate(params, cfg, PROMPTS, max_new_tokens=REF_TOKENS, max_len=KW["max_len"], stop_ids=())
    return g.token_lists()


_compiled = {}


@pytest.fixture(scope="module")
def engines(model):
    """(drafting on every step, adaptive), warmed up: every program they run is compiled before
    the first request (the last test checks that serving compiled nothing more)."""
    cfg, params = model
    fixed = Engine(cfg, params, None, store=SnapshotStore("spec"), speculative_tokens=K, speculative_adaptive=False,
                   **KW)
    adaptive = Engine(cfg, params, None, store=None, speculative_tokens=K, speculative_adaptive=True, **KW)
    # plain steps are compiled too: a constrained row decodes without drafts (engine._dispatch)
    assert {("spec_decode", 4, K + 1), ("decode", 4, 1)} <= set(fixed.shapes())
    assert {("spec_decode", 4, K + 1), ("decode", 4, 1)} <= set(adaptive.shapes())
    fixed.warmup()
    adaptive.warmup()
    _compiled.update({name: getattr(steps, name)._cache_size() for name in ENGINE_STEPS + ("decode",)})
    yield fixed.start(), adaptive.start()
    fixed.stop()
    adaptive.stop()


@pytest.fixture(scope="module")
def spec(engines):
    return engines[0]


def run_all(eng, prompts, max_tokens, **kw):
    handles = [eng.submit(GenerationRequest(list(p), max_tokens=m, **kw)) for p, m in zip(prompts, max_tokens)]
    for h in handles:
        events = list(h.events(timeout=TIMEOUT))
        assert [e.token_id for e in events[:-1]] == h.token_ids and events[-1].finish_reason == h.finish_reason
    return handles


def wait_idle(eng):
    deadline = time.time() + TIMEOUT
    while not eng.idle:
        assert time.time() < deadline
        time.sleep(0.01)


# --- greedy: the same tokens --------------------------------------------------------------


def test_greedy_same_tokens_as_without_drafts(spec, reference):
    before = dict(spec.counters)
    got = run_all(spec, PROMPTS, MAX_TOKENS)
    assert [h.token_ids for h in got] == [r[:m] for r, m in zip(reference, MAX_TOKENS)]
    assert all(h.finish_reason == "length" for h in got)
    drafted = spec.counters["spec_drafted_tokens"] - before.get("spec_drafted_tokens", 0)
    accepted = spec.counters["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
    steps_ = spec.counters["spec_verify_steps"] - before.get("spec_verify_steps", 0)
    assert 0.2 < accepted / drafted < 0.9, (accepted, drafted)  # both the accepting and the rejecting paths
    assert steps_ < max(MAX_TOKENS) - 1  # steps that gained several tokens per row
    # rows that end by max_tokens: the host knows where their caches end at once
    assert spec.counters["spec_snapshots_waiting"] == before.get("spec_snapshots_waiting", 0)


def test_adaptive_engine_mixes_plain_and_drafting_steps(engines, reference):
    """The adaptive engine measures both kinds of step (then picks by step time and acceptance):
    the tokens are the same whatever it picks."""
    eng = engines[1]
    got = run_all(eng, PROMPTS, MAX_TOKENS)
    assert [h.token_ids for h in got] == [r[:m] for r, m in zip(reference, MAX_TOKENS)]
    assert 0 < eng.counters["spec_verify_steps"] < eng.counters["steps"]


def test_a_row_that_stops_on_an_accepted_draft(spec, reference):
    """A stop id and a budget met by a draft in the middle of a step end the row there."""
    row = reference[3]
    i = next(i for i in range(3, len(row)) if row[i] not in row[:i])  # first occurrence, not the first token
    stopped, short = run_all(spec, [PROMPTS[3], PROMPTS[2]], [30, 11], stop_ids=(row[i],))
    assert stopped.token_ids == row[: i + 1] and stopped.finish_reason == "stop"
    assert short.token_ids == reference[2][:11] and short.finish_reason == "length"


# --- snapshots ------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="cfg")
def _cold_pass(params, tokens, n, cfg):
    """One pass over the first n of tokens [1, T] from scratch: (hidden [1, n, D], cache, the MTP layer's KV of
    the pairs (h_{p-1}, x_p) at p, with h_{-1} = 0, as the engine keeps them)."""
    cache = hybridjax.init_cache(cfg, 1, KW["max_len"], capacity=KW["max_len"])
    hidden, cache = forward_hidden(params, tokens, cache, cfg, token_counts=n[None])
    prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
    _, mtp = mtp_hidden(params, prev, tokens, init_mtp_state(cfg, 1, KW["max_len"]), jnp.zeros((1,), jnp.int32), cfg)
    return hidden, cache, mtp


def test_response_snapshot_holds_the_response_and_equals_a_cold_pass(spec, model):
    cfg, params = model
    prompt = PROMPTS[1]
    h = run_all(spec, [prompt], [23])[0]
    wait_idle(spec)
    full = prompt + h.token_ids
    snaps = [s for s in spec.store.snapshots() if s.kind == "response" and list(s.tokens) == full[: len(s.tokens)]
             and len(s.tokens) > len(prompt)]
    assert snaps, "no response snapshot"
    snap = max(snaps, key=lambda s: len(s.tokens))
    n = len(snap.tokens)
    assert n in (len(full), len(full) - 1)  # every token, or all but the last (never fed)
    tokens = np.zeros((1, 64), np.int32)  # one padded width: one compile whatever n is
    tokens[0, :n] = snap.tokens
    hidden, cold, mtp = _cold_pass(params, tokens, jnp.int32(n), cfg)
    hidden = hidden[:, :n]
    assert rel(snap.logits, lm_logits(params, hidden[0, -1])) < 1e-4
    gdn = [s for s in cold.layers if isinstance(s, GDNState)]
    for got, want in zip(snap.cache[:-1], gdn):
        assert rel(got.conv, want.conv) < 1e-4 and rel(got.ssm, want.ssm) < 1e-4
    assert rel(snap.cache[-1][0], hidden[0, -1]) < 1e-4

    # KV pages: the model's attention layers, then the MTP layer's pairs (h_{p-1}, x_p) at p
    ks, vs = steps.read_pages(spec._state, np.asarray(snap.pages, np.int32))
    flat = lambda x: np.asarray(x).reshape((-1,) + x.shape[2:])[:n]  # noqa: E731  [pages, S, ...] -> [n, ...]
    kv = [s for s in cold.layers if isinstance(s, KVState)]
    for k, v, want in zip(ks, vs, kv + [mtp]):
        assert rel(flat(k), want.k[0, :n]) < 1e-4 and rel(flat(v), want.v[0, :n]) < 1e-4


def test_cache_hits_under_speculation_equal_the_cold_path(spec, reference):
    """An exact repeat (no model call before the first token) and the conversation's next turn
    (its response sent back, resuming from the response snapshot) give the cold path's tokens."""
    n = MAX_TOKENS[0]
    longer = PROMPTS[0] + reference[0][:n]  # greedy: its continuation is the rest of reference[0]
    prefilled = spec.counters["tokens_prefilled"]
    repeat = run_all(spec, [PROMPTS[0]], [n])[0]
    follow = run_all(spec, [longer], [REF_TOKENS[0] - n])[0]
    assert repeat.token_ids == reference[0][:n] and repeat.cached_tokens == len(PROMPTS[0])
    assert follow.token_ids == reference[0][n:]
    assert follow.cached_tokens >= len(longer) - 1  # the response snapshot (all but the last token, or all)
    assert spec.counters["tokens_prefilled"] - prefilled <= 1


def assert_snapshots_are_their_tokens(eng, model):
    """Every snapshot in the engine's store: its logits are a cold pass's after its tokens."""
    cfg, params = model
    for snap in eng.store.snapshots():
        n = len(snap.tokens)
        tokens = np.zeros((1, 64), np.int32)
        tokens[0, :n] = snap.tokens
        hidden, _, _ = _cold_pass(params, tokens, jnp.int32(n), cfg)
        assert rel(snap.logits, lm_logits(params, hidden[0, n - 1])) < 1e-4, (snap.kind, n)


def test_host_side_stops_leave_only_right_snapshots(spec, model, reference):
    """Stop ids past the device's first MAX_STOPS are seen by the host only, a step late (as
    stop strings are): the row may have accepted drafts past the stop (no snapshot), or the
    step in flight drafts on it, and the response snapshot waits for that step's outputs: kept
    if it accepted no draft. Either way every snapshot is its tokens' state."""
    filler = tuple(range(VOCAB, VOCAB + steps.MAX_STOPS))  # never drawn: the device's stop list is full
    row = reference[3]
    firsts = [i for i in range(1, 24) if row[i] not in row[:i]]  # each token's first occurrence
    before = dict(spec.counters)
    for i in firsts:  # one at a time: the greedy tokens, and so where the row stops, are known
        h = run_all(spec, [PROMPTS[3]], [30], stop_ids=filler + (row[i],))[0]
        assert h.token_ids == row[: i + 1] and h.finish_reason == "stop"
    wait_idle(spec)
    stored = {tuple(s.tokens) for s in spec.store.snapshots() if s.kind == "response"}
    assert any(tuple(PROMPTS[3] + row[: i + 1]) in stored for i in firsts)  # the whole response, stop included
    sampled = [spec.submit(GenerationRequest(list(PROMPTS[3]), max_tokens=24, stop_ids=filler + (row[firsts[1]],),
                                             temperature=1.0, seed=seed)) for seed in range(8)]  # 4 rows a step
    for h in sampled:
        list(h.events(timeout=TIMEOUT))
        assert h.finish_reason == "length" or h.token_ids.index(row[firsts[1]]) == len(h.token_ids) - 1
    wait_idle(spec)
    delta = {key: spec.counters[key] - before.get(key, 0) for key in ("snapshots_skipped_speculative",
                                                                      "spec_snapshots_waiting")}
    assert_snapshots_are_their_tokens(spec, model)
    assert delta["snapshots_skipped_speculative"] > 0 and delta["spec_snapshots_waiting"] > 0, delta


# --- metrics, sampling ------------------------------------------------------------------------


def metric(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_metrics_count_drafts_and_acceptance(spec):
    text = render_metrics(spec)
    drafted = metric(text, "hybridjax_speculative_drafted_tokens_total")
    accepted = metric(text, "hybridjax_speculative_accepted_tokens_total")
    steps_ = metric(text, "hybridjax_speculative_verify_steps_total")
    assert drafted == spec.counters["spec_drafted_tokens"] > 0 and 0 < accepted <= drafted
    assert drafted % K == 0 and steps_ == spec.counters["spec_verify_steps"] > 0
    assert metric(text, "hybridjax_speculative_acceptance_rate") == pytest.approx(accepted / drafted)
    assert metric(text, "hybridjax_speculative_mean_accepted_length") == pytest.approx(1 + accepted / (drafted / K))
    assert "hybridjax_speculative_tokens 3.0" in text


def test_log_probabilities_of_accepted_drafts(spec, reference):
    """Greedy with logprobs: each token (a draft or a drawn one) is its position's most likely,
    and its log-probability is the top one's."""
    h = run_all(spec, [PROMPTS[2]], [MAX_TOKENS[2]], logprobs=2)[0]
    assert h.token_ids == reference[2]
    for token, (lp, top) in zip(h.token_ids, h.logprobs):
        assert top[0][0] == token and lp == top[0][1] and lp <= 0 and top[1][1] <= lp


def test_seeded_sampling_is_reproducible(spec):
    kw = dict(temperature=0.9, top_p=0.95, seed=7)
    a, b = (run_all(spec, [PROMPTS[2]], [16], **kw)[0].token_ids for _ in range(2))
    assert a == b and len(a) == 16 and all(0 <= t < VOCAB for t in a)


# --- the server -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_with_speculative_tokens_over_http(model, reference):
    from hybridjax.server import ServerConfig, create_app
    from hybridjax.server.app import build_engine

    cfg, params = model
    tok = char_level_tokenizer()
    sc = ServerConfig(slots=KW["slots"], max_len=KW["max_len"], page_size=KW["page_size"],
                      prefill_chunk=KW["prefill_chunk"], speculative_tokens=K, warmup=False)
    engine, _ = build_engine(sc, cfg, params, tok, "spec-test")
    assert engine.speculative_tokens == K
    app = create_app(engine, "spec-test", warmup=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not server.started:
            assert time.time() < deadline
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        out = client.completions.create(model="spec-test", prompt=PROMPTS[1], max_tokens=13, temperature=0)
        full = tok.decode(reference[1], skip_special_tokens=False)
        assert out.choices[0].text == full
        # A stop string, seen by the host after the row may have accepted drafts past it.
        full = tok.decode(reference[3], skip_special_tokens=False)
        cut = next(i for i in range(4, len(full) - 2) if full[i : i + 2] not in full[: i + 1])
        out = client.completions.create(model="spec-test", prompt=PROMPTS[3], max_tokens=30, temperature=0,
                                        stop=[full[cut : cut + 2]])
        assert out.choices[0].finish_reason == "stop" and out.choices[0].text == full[:cut]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 0 < metric(text, "hybridjax_speculative_accepted_tokens_total") <= metric(
            text, "hybridjax_speculative_drafted_tokens_total")
        wait_idle(engine)
        assert_snapshots_are_their_tokens(engine, model)  # stop string or not
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_cli_serve_passes_speculative_tokens(monkeypatch):
    import hybridjax.cli as cli
    import hybridjax.cli.serve as cli_serve
    import hybridjax.server

    seen = {}
    monkeypatch.setattr(hybridjax.server, "serve", lambda sc, *a, **kw: seen.setdefault("sc", sc) and 0)
    monkeypatch.setattr(hybridjax.server.app, "bind", lambda host, port: None)  # the port may be taken here
    from types import SimpleNamespace as NS

    cfg, params = NS(num_hidden_layers=1, max_position_embeddings=64), NS(embed=NS(dtype="float32"))
    monkeypatch.setattr(cli_serve, "load_model", lambda *a: (cfg, params, object(), "m"))
    monkeypatch.setattr(cli_serve, "_size", lambda params: (0, 0))
    monkeypatch.setattr(cli_serve, "use_compile_cache", lambda *a: None)
    cli.main(["serve", "--speculative-tokens", "2", "--speculative-adaptive", "--no-compile-cache"])
    assert seen["sc"].speculative_tokens == 2 and seen["sc"].speculative_adaptive


def test_after_warmup_the_engines_compiled_nothing(spec):
    """Everything above (batches of 1-4 rows, hits, repeats, stops, sampling, the HTTP server's
    engine of the same configuration) ran only programs the warm-up had compiled."""
    assert {name: getattr(steps, name)._cache_size() for name in ENGINE_STEPS + ("decode",)} == _compiled


def test_spec_policy_backs_off_probes_that_lose():
    """`SpecPolicy` (pure host logic): while drafting loses (a drafting step twice a plain one's
    time for one token), probes come after 16, 32, then every 64 steps; when drafting wins, plain probes
    back off alike; a flip of the choice restarts the gap at 16."""
    from hybridjax.scheduler import SpecPolicy

    pol = SpecPolicy()

    def run(n, t_spec, gain):
        kinds = []
        for _ in range(n):
            d = pol.draft(4)
            pol.record(d, 4, t_spec if d else 1.0, gain if d else None)
            kinds.append(d)
        return kinds

    kinds = run(2000, 2.0, 1.0)
    assert kinds[0] and not kinds[1]  # measures both kinds first
    probes = [i for i, d in enumerate(kinds) if d][1:]
    assert [b - a for a, b in zip(probes, probes[1:])][:5] == [32, 64, 64, 64, 64]
    assert sum(kinds) <= 2 + 2000 // 64 + 2  # overhead (t_spec / t_plain - 1) / 64 once settled
    kinds = run(400, 1.0, 3.0)  # drafting now pays (3 tokens at a plain step's time): the next probe sees it
    assert all(kinds[100:112]) and 300 - 300 // 16 <= sum(kinds[100:]) < 300  # plain probes, backing off
