"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3-Next, as a pure function.

Follows vLLM's `Qwen3NextMultiTokenPredictor` / `Qwen3_5MultiTokenPredictor`
(vllm/model_executor/models/qwen3_next_mtp.py, qwen3_5_mtp.py):

    e = pre_fc_norm_embedding(embed(next_token))       (1 + w) RMSNorms
    h = pre_fc_norm_hidden(hidden)                      hidden: the main model's final-normed state
    x = fc([e | h])                                     embedding first, then hidden
    x = decoder_layer(x)                                full attention (+ MLP, or MoE in MoE models)
    out = norm(x);  logits = lm_head(out)               embeddings and LM head shared

At position t, `hidden` is the main model's state after token t and `next_token` is token t+1;
the logits predict token t+2. The layer's attention keeps its own KV state, at the positions of
`hidden` (vLLM gives the MTP layer the target positions), so a drafter can run it from a cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridjax import ops, sharding
from hybridjax.cache import KVState
from hybridjax.config import Config
from hybridjax.layers import decoder_layer
from hybridjax.model import lm_logits
from hybridjax.params import Params

Array = jax.Array


def init_mtp_state(cfg: Config, batch_size: int, capacity: int, dtype=jnp.float32) -> KVState:
    """An empty KV state for the MTP layer's attention: k, v [B, capacity, Hkv, Dh]."""
    shape = (batch_size, capacity, cfg.num_key_value_heads, cfg.head_dim)
    return KVState(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def mtp_forward(
    params: Params,
    hidden: Array,
    next_tokens: Array,
    state: KVState,
    starts: Array,
    cfg: Config,
) -> tuple[Array, Array, KVState]:
    """One MTP step over T positions.

    hidden [B, T, D]: the main model's final-normed hidden states at positions starts + t;
    next_tokens [B, T] int32: the token after each of those positions; state: the MTP
    attention's KV state (capacity >= starts + T); starts [B]: tokens already in `state`.
    Returns (float32 logits [B, T, vocab] for the token two ahead, the head's own final-normed
    hidden [B, T, D] (what a second draft step chains), new KV state).
    """
    out, state = mtp_hidden(params, hidden, next_tokens, state, starts, cfg)
    return lm_logits(params, out), out, state


def mtp_hidden(params: Params, hidden: Array, next_tokens: Array, state: KVState, starts: Array, cfg: Config,
               valid: Array | None = None, implementation: str | None = None):
    """`mtp_forward` without the LM head: (final-normed hidden [B, T, D], new KV state).
    valid [B, T] (optional): positions whose keys are written (the engine's page pool drops the
    rest); implementation: attention over a page pool (see `hybridjax.model.forward`)."""
    p = params.mtp
    if p is None:
        raise ValueError("mtp_forward: these params have no MTP head (params.mtp is None)")
    eps = cfg.rms_norm_eps
    with sharding.mesh_scope(params.mesh):  # sharded params: ops see their mesh while tracing
        e = ops.rms_norm(params.embed[next_tokens], p.pre_fc_norm_embedding, eps)  # [B, T, D]
        h = ops.rms_norm(hidden.astype(e.dtype), p.pre_fc_norm_hidden, eps)
        x = ops.dense(jnp.concatenate([e, h], axis=-1), p.fc)  # [B, T, 2D] @ [2D, D]
        if valid is None:  # the layer is attention: valid only decides which keys are written
            valid = jnp.ones(next_tokens.shape, bool)
        x, state = decoder_layer(p.layer, x, state, starts, valid, cfg, implementation)
        return ops.rms_norm(x, p.norm, eps), state
