"""The model against transformers, and the invariants of the functional cache.

Tolerances: both sides compute in float32, but in different orders (chunked vs recurrent
delta rule, fused vs separate matmuls), so errors are float32 rounding accumulated over a few
layers: we require max|ours - theirs| <= 1e-4 * max|theirs| (measured: about 1e-6).
Between two of our own paths (full prefill vs pieces vs token-by-token) the same bound holds.
"""

from __future__ import annotations

import numpy as np
import pytest
torch = pytest.importorskip("torch")  # checks against transformers: skipped without torch

import hybridjax

PARITY_RTOL = 1e-4
LENGTHS = (1, 7, 63, 64, 65, 200)


def err_ratio(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def torch_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def tokens_for(cfg, n, seed=0, batch=1):
    return np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, n)).astype(np.int32)


@pytest.mark.parametrize("arch", ["qwen3_next_moe", "qwen3_5_dense", "qwen3_5_multimodal", "qwen3_5_moe"])
def test_logits_match_transformers(arch, loaded, torch_models, jforward):
    cfg, params = loaded[arch]
    tokens = tokens_for(cfg, max(LENGTHS), seed=1)
    for n in LENGTHS:
        cache = hybridjax.init_cache(cfg, 1, 512)
        ours, _ = jforward(params, tokens[:, :n], cache, cfg)
        ref = torch_logits(torch_models[arch], tokens[:, :n])
        assert err_ratio(ours, ref) < PARITY_RTOL, (arch, n, err_ratio(ours, ref))


def test_ragged_batch_matches_transformers(loaded, torch_models, jforward):
    """A right-padded batch: each row's logits equal transformers' on that row alone."""
    cfg, params = loaded["qwen3_next_moe"]
    counts = np.array([65, 1, 30, 64], np.int32)
    tokens = tokens_for(cfg, 65, seed=2, batch=4)
    ours, cache = jforward(params, tokens, hybridjax.init_cache(cfg, 4, 256), cfg, token_counts=counts)
    np.testing.assert_array_equal(np.asarray(cache.lengths), counts)
    for row, n in enumerate(counts):
        ref = torch_logits(torch_models["qwen3_next_moe"], tokens[row : row + 1, :n])
        assert err_ratio(np.asarray(ours)[row : row + 1, :n], ref) < PARITY_RTOL, row


@pytest.mark.parametrize("arch", ["qwen3_next_moe", "qwen3_5_dense"])
def test_prefill_equals_pieces_equals_decode(arch, loaded, jforward):
    cfg, params = loaded[arch]
    tokens = tokens_for(cfg, 140, seed=3)
    full, full_cache = jforward(params, tokens, hybridjax.init_cache(cfg, 1, 256), cfg)

    pieces, cache = [], hybridjax.init_cache(cfg, 1, 256)
    for lo, hi in [(0, 64), (64, 65), (65, 130), (130, 140)]:
        out, cache = jforward(params, tokens[:, lo:hi], cache, cfg)
        pieces.append(np.asarray(out))
    assert err_ratio(np.concatenate(pieces, axis=1), full) < PARITY_RTOL

    steps, cache = [], hybridjax.init_cache(cfg, 1, 256)
    for t in range(tokens.shape[1]):
        out, cache = jforward(params, tokens[:, t : t + 1], cache, cfg)
        steps.append(np.asarray(out))
    assert err_ratio(np.concatenate(steps, axis=1), full) < PARITY_RTOL
    for a, b in zip(cache.layers, full_cache.layers):
        for x, y in zip(a.__dict__.values(), b.__dict__.values()):
            n = 140 if x.ndim == 4 and x.shape[1] >= 140 else None  # KV: compare the filled part
            assert err_ratio(x[:, :n], y[:, :n]) < PARITY_RTOL


def test_ragged_rows_equal_rows_alone_and_padding_is_inert(loaded, jforward):
    """Rows of a ragged batch (continued from a ragged cache) equal each row run alone;
    the pad tokens' values do not matter."""
    cfg, params = loaded["qwen3_5_multimodal"]
    counts1, counts2 = np.array([10, 3, 0]), np.array([5, 9, 7])
    t1, t2 = tokens_for(cfg, 10, seed=4, batch=3), tokens_for(cfg, 9, seed=5, batch=3)
    _, cache = jforward(params, t1, hybridjax.init_cache(cfg, 3, 128), cfg, token_counts=counts1)
    out, cache = jforward(params, t2, cache, cfg, token_counts=counts2)

    noisy1, noisy2 = t1.copy(), t2.copy()
    for row in range(3):  # different pad contents must not change anything real
        noisy1[row, counts1[row]:] = (noisy1[row, counts1[row]:] + 7) % cfg.vocab_size
        noisy2[row, counts2[row]:] = (noisy2[row, counts2[row]:] + 11) % cfg.vocab_size
    _, c_noisy = jforward(params, noisy1, hybridjax.init_cache(cfg, 3, 128), cfg, token_counts=counts1)
    out_noisy, _ = jforward(params, noisy2, c_noisy, cfg, token_counts=counts2)

    for row in range(3):
        seq = np.concatenate([t1[row, : counts1[row]], t2[row, : counts2[row]]])[None]
        alone, _ = jforward(params, seq, hybridjax.init_cache(cfg, 1, 128), cfg)
        mine = np.asarray(out)[row, : counts2[row]]
        assert err_ratio(mine, np.asarray(alone)[0, counts1[row]:]) < PARITY_RTOL, row
        np.testing.assert_array_equal(mine, np.asarray(out_noisy)[row, : counts2[row]])


def test_snapshot_is_a_reference(loaded, jforward):
    """Continue from one kept cache along two different suffixes: both equal the cold path,
    and the kept cache is unchanged (bit for bit)."""
    cfg, params = loaded["qwen3_next_moe"]
    prefix, s1, s2 = tokens_for(cfg, 40, seed=6), tokens_for(cfg, 9, seed=7), tokens_for(cfg, 17, seed=8)
    _, snap = jforward(params, prefix, hybridjax.init_cache(cfg, 1, 128), cfg)
    before = [np.array(x) for x in jax_leaves(snap)]
    for suffix in (s1, s2):
        warm, _ = jforward(params, suffix, snap, cfg)
        cold, _ = jforward(params, np.concatenate([prefix, suffix], 1), hybridjax.init_cache(cfg, 1, 128), cfg)
        assert err_ratio(warm, np.asarray(cold)[:, 40:]) < PARITY_RTOL
    for x, y in zip(before, jax_leaves(snap)):
        np.testing.assert_array_equal(x, np.asarray(y))


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_kv_capacity_grows_in_buckets(loaded):
    cfg, _ = loaded["qwen3_5_dense"]
    cache = hybridjax.init_cache(cfg, 2, 1000)
    assert cache.capacity == 64
    assert hybridjax.reserve(cache, 64).capacity == 64  # fits: same buffers, no new shape
    assert hybridjax.reserve(cache, 65).capacity == 128
    assert hybridjax.reserve(cache, 600).capacity == 1000  # capped at max_len
    with pytest.raises(ValueError, match="exceeds the cache's max_len of 1000"):
        hybridjax.reserve(cache, 1001)
    grown = hybridjax.reserve(cache, 200)
    np.testing.assert_array_equal(np.asarray(grown.layers[3].k[:, :64]), np.asarray(cache.layers[3].k))


def test_forward_rejects_bad_input(loaded):
    cfg, params = loaded["qwen3_5_dense"]
    cache = hybridjax.init_cache(cfg, 1, 16)
    with pytest.raises(ValueError, match="tokens must be int32"):
        hybridjax.forward(params, np.zeros((3,), np.int32), cache, cfg)
    with pytest.raises(ValueError, match="rows but the cache has 1"):
        hybridjax.forward(params, np.zeros((2, 3), np.int32), cache, cfg)
    with pytest.raises(ValueError, match="exceeds the cache's max_len"):
        hybridjax.forward(params, np.zeros((1, 17), np.int32), cache, cfg)
