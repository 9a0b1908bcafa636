"""Speculative decoding with the MTP head (hybridjax.speculative).

- The verify pass's per-token GDN states, cut after n tokens, equal the cold path that fed only
  those n tokens (the "states" rollback).
- Greedy: identical tokens with and without speculation on all four tiny architectures (random
  weights and random MTP heads: low acceptance, the rejection path), ragged batches, both
  rollbacks, adaptive mode (plain steps between probing drafts); on the embedded default (trained
  MTP head: real acceptance, rows accepting different counts per step) also from a kept cache.
- Sampling: the output distribution of three tokens (8-token vocabulary, 2 drafts per step)
  matches the exact one computed from the model's own probabilities, with and without
  penalties / top-k, by a chi-square test; the same samples against a wrong reference are
  rejected (the test has power).

Tolerances: float32 on both paths; the verify pass and a decode step run the same token-by-token
recurrence, so logits agree to ~1e-6 (asserted <= 1e-4 relative, as test_model.py).
"""

from __future__ import annotations

import itertools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

pytest.importorskip("torch")  # hf_models builds checkpoints with transformers
import hf_models  # noqa: E402
import hybridjax
from hybridjax.config import config_from_dict
from hybridjax.default_model import TINY_CONFIG
from hybridjax.generate import generate
from hybridjax.model import forward_hidden
from hybridjax.params import init_params
from hybridjax.sampling import apply_penalties, filter_logits, sampling_params
from hybridjax.speculative import take_position

ARCHS = ["qwen3_next_moe", "qwen3_5_dense", "qwen3_5_multimodal", "qwen3_5_moe"]
PROMPTS = [[5, 9, 31, 2, 77, 40, 41], [101, 3, 3, 250]]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.fixture(scope="module")
def with_mtp(hf_dirs, torch_models, tmp_path_factory):
    """arch -> (cfg, params) of the tiny checkpoint given a random MTP head."""
    out = {}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp("spec") / arch
        shutil.copytree(hf_dirs[arch], d)
        hf_models.add_mtp_head(d, torch_models[arch])
        out[arch] = hybridjax.load_hf(d)
    return out


_hidden_all = jax.jit(forward_hidden, static_argnames=("cfg", "all_states"))


def test_per_token_states_cut_equal_the_cold_path(with_mtp):
    cfg, params = with_mtp["qwen3_next_moe"]
    rng = np.random.RandomState(0)
    cache = hybridjax.init_cache(cfg, 2, 64)
    _, cache = _hidden_all(params, rng.randint(0, cfg.vocab_size, (2, 6)), cache, cfg, token_counts=np.array([6, 3]))
    new = rng.randint(0, cfg.vocab_size, (2, 4)).astype(np.int32)
    _, every = _hidden_all(params, new, cache, cfg, all_states=True)
    for n in range(5):
        got = take_position(every, cache, jnp.array([n, max(n - 1, 0)], jnp.int32))
        _, want = _hidden_all(params, new, cache, cfg, token_counts=np.array([n, max(n - 1, 0)]))
        np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
        for a, b in zip(got.layers, want.layers):
            if isinstance(b, hybridjax.GDNState):  # KV: written past the cut too, invisible there
                assert rel(a.conv, b.conv) < 1e-6 and rel(a.ssm, b.ssm) < 1e-5, n


def assert_same_generation(a, b):
    assert a.token_lists() == b.token_lists()
    np.testing.assert_array_equal(np.asarray(a.cache.lengths), np.asarray(b.cache.lengths))
    assert rel(a.logits, b.logits) < 1e-4
    for x, y in zip(a.cache.layers, b.cache.layers):
        if isinstance(y, hybridjax.GDNState):
            assert rel(x.ssm, y.ssm) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_identical_with_speculation(arch, with_mtp):
    cfg, params = with_mtp[arch]
    kw = dict(max_new_tokens=[14, 9], max_len=64)
    plain = generate(params, cfg, PROMPTS, **kw)
    # adaptive on one arch: random heads are rejected, so it mixes plain steps with probing drafts
    adaptive = arch == "qwen3_5_moe"
    spec = generate(params, cfg, PROMPTS, speculative_tokens=2, adaptive=adaptive, **kw)
    assert_same_generation(spec, plain)
    drafted, steps = np.asarray(spec.drafted), np.asarray(spec.n_generated) - np.asarray(spec.accepted)
    every = 2 * (steps - 1)  # drafts when every step but the last drafts
    assert np.all(drafted > 0) and (np.all(drafted < every) if adaptive else np.all(drafted >= every))
    if arch == "qwen3_5_dense":  # the other rollback, and a stop token in the middle of a row
        stop = plain.token_lists()[0][5]
        kw["stop_ids"] = [stop]
        plain = generate(params, cfg, PROMPTS, **kw)
        assert plain.token_lists()[0][-1] == stop
        assert_same_generation(generate(params, cfg, PROMPTS, speculative_tokens=2, rollback="rerun", adaptive=False, **kw),
                               plain)


@pytest.fixture(scope="module")
def default():
    from hybridjax.default_model import default_model

    cfg, params, tok = default_model()
    prompts = [tok.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What does os.path.join do?", "How do I open a file?")]
    return cfg, params, prompts


def test_greedy_identical_on_the_trained_head_and_from_a_kept_cache(default):
    """Real acceptance (the default's trained MTP head): accepted drafts, rows accepting different
    numbers per step, continuing from a kept cache (a prefix-cache hit) gives the same tokens."""
    cfg, params, prompts = default
    kw = dict(max_new_tokens=[40, 33])
    empty = hybridjax.init_cache(cfg, 2, 256, capacity=256)  # one capacity for both calls: one compile
    plain = generate(params, cfg, prompts, cache=empty, **kw)
    spec = generate(params, cfg, prompts, cache=empty, speculative_tokens=3, **kw)
    assert_same_generation(spec, plain)
    rate = np.asarray(spec.accepted).sum() / np.asarray(spec.drafted).sum()
    assert rate > 0.2, rate  # the trained head drafts well on its own domain
    follow = prompts[::-1]  # continue both conversations from the kept caches (same shapes: no compile)
    a = generate(params, cfg, follow, cache=plain.cache, **kw)
    b = generate(params, cfg, follow, cache=spec.cache, speculative_tokens=3, **kw)
    assert_same_generation(b, a)


# --- sampling: the rejection rule keeps the distribution -------------------------------------

VOCAB, N_ROWS, NEW = 8, 3000, 3
PROMPT = [1, 5, 2, 2]


def small_model():
    cfg = config_from_dict(dict(TINY_CONFIG, vocab_size=VOCAB, eos_token_id=VOCAB - 1, hidden_size=32))
    return cfg, init_params(3, cfg, mtp=True)


def exact_distribution(cfg, params, sp) -> np.ndarray:
    """P(x1, x2, x3 | PROMPT) [V, V, V] of the plain sampler (penalties, filters) from the model's
    logits, by enumerating the 64 two-token continuations."""
    pairs = np.array(list(itertools.product(range(VOCAB), repeat=2)), np.int32)  # [64, 2]
    seqs = np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], axis=1)
    logits, _ = hybridjax.forward(params, seqs, hybridjax.init_cache(cfg, len(pairs), 64), cfg)
    logits = np.asarray(logits)[:, len(PROMPT) - 1 :]  # [64, 3, V]: for x1, x2 | x1, x3 | x1 x2
    sp64 = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x[:1], (len(pairs),)), sp)
    probs = []
    for t in range(3):
        seen = np.zeros((len(pairs), VOCAB), bool)
        seen[:, PROMPT] = True
        counts = np.zeros((len(pairs), VOCAB), np.int32)
        for j in range(t):
            seen[np.arange(len(pairs)), pairs[:, j]] = True
            counts[np.arange(len(pairs)), pairs[:, j]] += 1
        pen = apply_penalties(jnp.asarray(logits[:, t]), sp64, jnp.asarray(seen), jnp.asarray(counts))
        probs.append(np.asarray(jax.nn.softmax(filter_logits(pen, sp64), -1), np.float64))
    p = np.zeros((VOCAB,) * 3)
    for i, (a, b) in enumerate(pairs):
        p[a, b] = probs[0][i, a] * probs[1][i, b] * probs[2][i]
    return p


def chi2_pvalue(samples: np.ndarray, p: np.ndarray) -> float:
    counts = np.zeros(p.size)
    np.add.at(counts, np.ravel_multi_index(samples.T, p.shape), 1)
    expected = p.ravel() * len(samples)
    small = expected < 5  # pool the rare cells
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def test_rejection_sampling_keeps_the_distribution():
    cfg, params = small_model()
    half = N_ROWS // 2
    # rows 0..half: temperature 1; the rest: temperature 0.8, top-k 6, repetition and presence penalties
    sp = sampling_params(N_ROWS, temperature=[1.0] * half + [0.8] * half, top_k=[0] * half + [6] * half,
                         repetition_penalty=[1.0] * half + [1.6] * half, presence_penalty=[0.0] * half + [0.5] * half)
    g = generate(params, cfg, [PROMPT] * N_ROWS, max_new_tokens=NEW, seeds=range(N_ROWS), sampling=sp,
                 speculative_tokens=2, adaptive=False, max_len=16, stop_ids=())
    out = np.asarray(g.tokens)[:, :NEW]
    assert np.all(np.asarray(g.n_generated) == NEW)
    rate = np.asarray(g.accepted).sum() / np.asarray(g.drafted).sum()
    assert 0.1 < rate < 0.9, rate  # both the accept and the residual paths are exercised
    pick = lambda i: jax.tree_util.tree_map(lambda x: x[i : i + 1], sp)  # noqa: E731
    p_plain, p_pen = exact_distribution(cfg, params, pick(0)), exact_distribution(cfg, params, pick(half))
    assert chi2_pvalue(out[:half], p_plain) > 1e-3
    assert chi2_pvalue(out[half:], p_pen) > 1e-3
    assert chi2_pvalue(out[half:], p_plain) < 1e-6  # power: the wrong reference is rejected


def test_cli_speculative_tokens(hf_dirs, tmp_path, capsys):
    import json

    from hybridjax.cli import main

    d = tmp_path / "m"
    shutil.copytree(hf_dirs["qwen3_5_dense"], d)
    hf_models.add_mtp_head(d, hf_models.load_torch(d))
    base = ["generate", "--no-compile-cache", "--model", str(d), "--token-ids", "5,9,31,2", "--max-new-tokens", "6", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--speculative-tokens", "2"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["speculative"]["drafted"] > 0
    for extra, message in [(["--speculative-tokens", "5"], "speculative tokens must be in 1..4"),
                           (["--speculative-tokens", "2", "--stream"], "drop --stream")]:
        assert main([*base, *extra]) == 1
        assert message in capsys.readouterr().err
    assert main(["generate", "--no-compile-cache", "--model", str(hf_dirs["qwen3_5_dense"]), "--token-ids", "5,9", "--speculative-tokens", "1"]) == 1
    assert "needs an MTP head" in capsys.readouterr().err
