"""The hybrid language model: `forward(params, tokens, cache, cfg) -> (logits, new_cache)`.

No jit here and no sampling (those live in generate.py). `forward` runs any number of tokens
from any cache position, for a batch whose rows may carry different numbers of real tokens
(`token_counts`, right padding): a row's logits and state do not depend on its padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridjax import cpu_kernels, ops, sharding
from hybridjax.cache import Cache, reserve
from hybridjax.config import Config
from hybridjax.layers import decoder_layer
from hybridjax.params import Params

Array = jax.Array


def forward(
    params: Params,
    tokens: Array,
    cache: Cache,
    cfg: Config,
    *,
    token_counts: Array | None = None,
    implementation: str | None = None,
    last_logits_only: bool = False,
) -> tuple[Array, Cache]:
    """Run tokens [B, T] (int32) through the model from `cache`.

    token_counts [B] (optional): real tokens per row, the rest right padding (default: all T).
    Returns float32 logits [B, T, vocab] (positions past a row's count are meaningless), or
    [B, 1, vocab] at each row's last real token with `last_logits_only`, and the new cache, whose `lengths` advanced by token_counts. The input cache is not modified.
    Outside jit the KV buffers grow as needed; under jit the caller reserves room first
    (`hybridjax.cache.reserve`), since shapes are fixed there.
    implementation: the kernels' backend (the delta rule, and attention over a page pool):
    "xla", "pallas", "reference", or None (Pallas when lowered for a GPU, XLA elsewhere).
    """
    x, cache = forward_hidden(params, tokens, cache, cfg, token_counts=token_counts,
                              implementation=implementation, last_only=last_logits_only)
    return lm_logits(params, x), cache


def forward_hidden(
    params: Params,
    tokens: Array,
    cache: Cache,
    cfg: Config,
    *,
    token_counts: Array | None = None,
    implementation: str | None = None,
    last_only: bool = False,
    all_states: bool = False,
) -> tuple[Array, Cache]:
    """`forward` without the LM head: the final-normed hidden states [B, T, D] (or [B, 1, D] at
    each row's last real token with `last_only`), the input of the LM head and of the MTP head.

    all_states (speculative verification): every GDN layer of the returned cache holds its state
    after each of the T tokens (conv [B, T, W-1, C], ssm [B, T, Hv, K, V]), to be cut at a chosen
    token by `hybridjax.speculative.take_position`; KV is written for every real token."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"forward: tokens must be int32 [B, T], got shape {tokens.shape}")
    b, t = tokens.shape
    if b != cache.batch_size:
        raise ValueError(f"forward: tokens have {b} rows but the cache has {cache.batch_size}")
    counts = jnp.full((b,), t, jnp.int32) if token_counts is None else jnp.asarray(token_counts, jnp.int32)
    if not isinstance(cache.lengths, jax.core.Tracer):
        cache = reserve(cache, t if isinstance(counts, jax.core.Tracer) else counts)

    starts = cache.lengths
    valid = jnp.arange(t)[None, :] < counts[:, None]  # [B, T]
    states = []
    with sharding.mesh_scope(params.mesh):  # sharded params: ops see their mesh while tracing
        x = params.embed[tokens]  # [B, T, D]
        for layer, state in zip(params.layers, cache.layers):
            x, state = decoder_layer(layer, x, state, starts, valid, cfg, implementation, all_states)
            states.append(state)
    if last_only:  # prefill needs one row of logits, not T: skip the big vocab matmul
        last = jnp.maximum(counts - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
    x = ops.rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    return x, cache.replace(layers=tuple(states), lengths=starts + counts)


def lm_head(params: Params) -> Array:
    """The LM head [D, vocab] (the embedding table, transposed, when tied)."""
    return params.embed.T if params.lm_head is None else cpu_kernels.plain_weight(params.lm_head)


def lm_logits(params: Params, x: Array) -> Array:
    """float32 logits [..., vocab] of final-normed hidden states x [..., D]."""
    with sharding.mesh_scope(params.mesh):
        if params.lm_head is None:  # tied: the embedding [vocab, D] is read in place, never copied as .T
            return ops.dense(x, params.embed, jnp.float32, transposed=True)
        return ops.dense(x, params.lm_head, jnp.float32)
