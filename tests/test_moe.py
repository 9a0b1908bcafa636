"""Routed MoE (hybridjax.moe) against the dense form, on the tiny MoE checkpoints' own layers.

The dense form below is the layer as it was before routing: every expert runs on every row and
a one-hot combine matrix of the top-k weights selects. It is the reference. Both compute in
float32 from the same routing, so they differ only in summation order: we require
max|routed - dense| <= 1e-5 * max|dense| (measured: ~1e-7). bfloat16: the routed form rounds
its hidden activations and output to bfloat16 (spacing 2^-8 ~ 4e-3 relative) where the float32
reference does not, so 2e-2 relative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax import layers, moe
from hybridjax.params import MoEParams

F32_RTOL, BF16_RTOL = 1e-5, 2e-2
ARCHS = ["qwen3_next_moe", "qwen3_5_moe"]
PATHS = ["grouped", "gathered"]


def dense_moe(p: MoEParams, xs, cfg):
    """The reference: every expert on every row, x [N, D] -> routed part [N, D] (float32)."""
    probs = jax.nn.softmax(jnp.dot(xs, p.router, preferred_element_type=jnp.float32), axis=-1)  # [N, E]
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    combine = jnp.zeros_like(probs).at[jnp.arange(xs.shape[0])[:, None], top_i].add(top_w)  # [N, E]

    def einsum(spec, a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(xs.dtype)

    h = jax.nn.silu(einsum("nd,edi->eni", xs, p.gate)) * einsum("nd,edi->eni", xs, p.up)
    experts = einsum("eni,eid->end", h, p.down)  # [E, N, D]
    return jnp.einsum("ne,end->nd", combine, experts.astype(jnp.float32))


def err_ratio(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def moe_layer(loaded, arch):
    cfg, params = loaded[arch]
    return cfg, next(layer.ffn for layer in params.layers if isinstance(layer.ffn, MoEParams))


def rows(cfg, n, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), (n, cfg.hidden_size), dtype)


_routed = jax.jit(moe.routed_experts, static_argnames=("cfg", "path"))


def routed(p, xs, valid, cfg, path):
    return _routed(p, xs, valid, cfg, path=path)


_dense = jax.jit(dense_moe, static_argnums=2)


def dense(p, xs, cfg):
    return _dense(p, xs, cfg)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", PATHS)
def test_routed_equals_dense(arch, path, loaded):
    cfg, p = moe_layer(loaded, arch)
    for n in (1, 5, 40):  # decode row, a few, a prefill chunk (experts get uneven groups)
        xs = rows(cfg, n, seed=n)
        got = routed(p, xs, None, cfg, path)
        assert err_ratio(got, dense(p, xs, cfg)) < F32_RTOL, (arch, path, n)


@pytest.mark.parametrize("path", PATHS)
def test_ties_in_router_scores(path, loaded):
    """Experts with identical router columns tie exactly; so do all experts under a zero router.
    top_k breaks ties by the lower index; routing then dispatches exactly that selection."""
    cfg, p = moe_layer(loaded, "qwen3_next_moe")
    router = p.router.at[:, 1].set(p.router[:, 0]).at[:, 3].set(p.router[:, 2])
    for r in (router, jnp.zeros_like(p.router)):
        q = p.replace(router=r)
        xs = rows(cfg, 9, seed=3)
        got = routed(q, xs, None, cfg, path)
        assert err_ratio(got, dense(q, xs, cfg)) < F32_RTOL, path
    chosen = moe.route(xs, jnp.zeros_like(p.router), cfg.num_experts_per_tok, cfg.norm_topk_prob).experts
    np.testing.assert_array_equal(np.asarray(chosen), np.tile(np.arange(cfg.num_experts_per_tok), (9, 1)))


@pytest.mark.parametrize("path", PATHS)
def test_pads_are_not_routed_and_rows_are_independent(path, loaded):
    """A ragged batch: valid rows equal the dense form on those rows alone; invalid rows get a
    zero routed part, whatever (even NaN) they hold."""
    cfg, p = moe_layer(loaded, "qwen3_5_moe")
    xs = rows(cfg, 8, seed=4)
    valid = jnp.array([1, 0, 1, 1, 0, 0, 1, 0], bool)
    xs_pad = jnp.where(valid[:, None], xs, jnp.nan)
    got = np.asarray(routed(p, xs_pad, valid, cfg, path))
    assert np.all(got[~np.asarray(valid)] == 0)
    ref = dense(p, xs[valid], cfg)
    assert err_ratio(got[np.asarray(valid)], ref) < F32_RTOL


@pytest.mark.parametrize("path", PATHS)
def test_gradients_equal_dense(path, loaded):
    cfg, p = moe_layer(loaded, "qwen3_next_moe")
    n = 6 if path == "gathered" else 24
    xs = rows(cfg, n, seed=5)
    valid = jnp.arange(n) < n - 1  # one pad row: no gradient flows through it
    ct = jax.random.normal(jax.random.PRNGKey(6), xs.shape)

    def loss_routed(p, xs):
        return jnp.sum(moe.routed_experts(p, xs, valid, cfg, path=path) * ct)

    def loss_dense(p, xs):
        return jnp.sum(jnp.where(valid[:, None], dense_moe(p, xs, cfg), 0) * ct)

    got = jax.jit(jax.grad(loss_routed, argnums=(0, 1)))(p, xs)
    ref = jax.jit(jax.grad(loss_dense, argnums=(0, 1)))(p, xs)
    for name in ("router", "gate", "up", "down"):
        assert err_ratio(getattr(got[0], name), getattr(ref[0], name)) < F32_RTOL, name
    assert err_ratio(got[1], ref[1]) < F32_RTOL


@pytest.mark.parametrize("path", PATHS)
def test_bfloat16(path, loaded):
    """bfloat16 weights and activations run and agree with the dense form computed in float32 from
    the same bfloat16 values (the dense form itself cannot run in bfloat16 on XLA:CPU in JAX 0.10:
    its batched einsum fails with "Unsupported element type for DotThunk: BF16 x BF16 = F32")."""
    cfg, p = moe_layer(loaded, "qwen3_5_moe")
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p)
    xs = rows(cfg, 5 if path == "gathered" else 33, seed=7, dtype=jnp.bfloat16)
    got = routed(p16, xs, None, cfg, path)
    assert got.dtype == jnp.bfloat16
    up = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), (p16, xs))
    assert err_ratio(got.astype(jnp.float32), dense(*up, cfg)) < BF16_RTOL


def test_layer_picks_a_path_and_keeps_the_shared_expert(loaded, monkeypatch):
    """layers.moe = routed (either path) + sigmoid-gated shared expert, for [B, T, D] inputs."""
    cfg, p = moe_layer(loaded, "qwen3_next_moe")
    x = rows(cfg, 2 * 7, seed=8).reshape(2, 7, -1)
    shared = layers.mlp(p.shared, x) * jax.nn.sigmoid(x @ p.shared_gate)
    ref = dense(p, x.reshape(14, -1), cfg).reshape(x.shape) + shared
    for max_pairs in (0, 1000):  # all grouped, all gathered
        monkeypatch.setattr(moe, "GATHER_MAX_PAIRS", max_pairs)
        got = jax.jit(layers.moe, static_argnums=2)(p, x, cfg, jnp.ones((2, 7), bool))  # fresh jit: retraced
        assert err_ratio(got, ref) < F32_RTOL


@pytest.mark.parametrize("path", PATHS)
def test_portable_paths_equal_dense(path, loaded, monkeypatch):
    """Without the CPU kernel (GPU, or a CPU without the extension): the XLA group loop and the
    per-pair loop, with pads, and their gradients."""
    monkeypatch.setattr(moe, "_cpu_kernel_ok", lambda x, w: False)
    cfg, p = moe_layer(loaded, "qwen3_next_moe")
    n = 5 if path == "gathered" else 40
    xs = rows(cfg, n, seed=9)
    valid = jnp.arange(n) != 2
    ct = jax.random.normal(jax.random.PRNGKey(10), xs.shape)

    def loss(f):
        return lambda p, xs: jnp.sum(jnp.where(valid[:, None], f(p, xs), 0) * ct)

    fn = jax.jit(lambda p, xs: moe.routed_experts(p, xs, valid, cfg, path=path))
    got = np.asarray(fn(p, xs))
    assert np.all(got[2] == 0)
    ref = dense(p, xs, cfg)
    assert err_ratio(got[np.asarray(valid)], np.asarray(ref)[np.asarray(valid)]) < F32_RTOL
    g = jax.jit(jax.grad(loss(lambda p, xs: moe.routed_experts(p, xs, valid, cfg, path=path))))(p, xs)
    gr = jax.jit(jax.grad(loss(lambda p, xs: dense_moe(p, xs, cfg))))(p, xs)
    for name in ("router", "gate", "up", "down"):
        assert err_ratio(getattr(g, name), getattr(gr, name)) < F32_RTOL, name
