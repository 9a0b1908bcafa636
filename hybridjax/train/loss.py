"""Training objective: masked next-token cross-entropy, plus the optional MTP term.

A batch is `{"tokens": int32 [B, T+1], "mask": float32 [B, T]}`: position t of the model reads
tokens[:, :T] and predicts tokens[:, t+1], counted with weight mask[:, t] (1 for every token of
plain text; 1 only on assistant tokens of chat data; 0 on padding). The MTP head predicts
tokens[:, t+2] from the hidden state at t and tokens[:, t+1] (mask[:, t+1]).

Cross-entropy runs in float32 on the final-normed hidden states. For a large vocabulary the
[N, vocab] logits are never held at once: the log-sum-exp is accumulated over vocabulary chunks
in a scan whose body is rematerialised in the backward, so memory is [N, VOCAB_CHUNK].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridjax import ops
from hybridjax.cache import init_cache
from hybridjax.config import Config
from hybridjax.model import forward_hidden, lm_head
from hybridjax.mtp import init_mtp_state, mtp_hidden
from hybridjax.params import Params

Array = jax.Array
f32 = jnp.float32

VOCAB_CHUNK = 16384  # vocabularies above this are processed in chunks of this many columns


def cross_entropy_sum(x: Array, head: Array, targets: Array, mask: Array, chunk: int = VOCAB_CHUNK) -> Array:
    """sum_n mask[n] * (logsumexp(x[n] @ head) - (x[n] @ head)[targets[n]]), in float32.

    x [N, D], head [D, vocab], targets [N] int32, mask [N].
    """
    vocab = head.shape[1]
    # The target logit directly: a gather of N head columns, the same for every chunking.
    tgt = jnp.einsum("nd,nd->n", x.astype(f32), head.T[targets].astype(f32))  # [N]
    if vocab <= chunk:
        lse = jax.nn.logsumexp(ops.dense(x, head, f32), axis=-1)
    else:
        lse = _chunked_logsumexp(x, head, chunk)
    return jnp.sum(mask.astype(f32) * (lse - tgt))


def _chunked_logsumexp(x: Array, head: Array, chunk: int) -> Array:
    """logsumexp over the vocabulary of x @ head, one [N, chunk] block at a time."""
    d, vocab = head.shape
    n_chunks = -(-vocab // chunk)
    w = jnp.pad(head, ((0, 0), (0, n_chunks * chunk - vocab)))
    w = w.reshape(d, n_chunks, chunk).transpose(1, 0, 2)  # [n_chunks, D, chunk]
    offsets = jnp.arange(n_chunks) * chunk

    @jax.checkpoint  # recompute each block's logits in the backward instead of storing them all
    def block(carry, xs):
        m, s = carry  # running max and sum of exp, [N]
        wc, off = xs
        logits = ops.dense(x, wc, f32)  # [N, chunk]
        logits = jnp.where(off + jnp.arange(chunk) < vocab, logits, -jnp.inf)  # padded columns
        m_new = jnp.maximum(m, logits.max(-1))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[:, None]).sum(-1)
        return (m_new, s), None

    n = x.shape[0]
    (m, s), _ = jax.lax.scan(block, (jnp.full((n,), -jnp.inf, f32), jnp.zeros((n,), f32)), (w, offsets))
    return m + jnp.log(s)


def loss_terms(params: Params, batch: dict, cfg: Config, *, mtp: bool = False, implementation=None) -> dict:
    """Summed (not averaged) losses of one batch: {"ce": main sum, "mtp": MTP sum (0 without)}.

    Runs the model from an empty cache over tokens[:, :T]; right padding is harmless (causal
    model, mask 0), so rows need no token counts.
    """
    tokens, mask = batch["tokens"], batch["mask"]
    b, t1 = tokens.shape
    t = t1 - 1
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    cache = init_cache(cfg, b, t, dtype=params.embed.dtype, capacity=t)
    x, _ = forward_hidden(params, inputs, cache, cfg, implementation=implementation)  # [B, T, D]
    head = lm_head(params)
    d = x.shape[-1]
    out = {"ce": cross_entropy_sum(x.reshape(-1, d), head, targets.reshape(-1), mask.reshape(-1))}
    if mtp:
        # hidden at t (< T-1) with token t+1 predicts token t+2.
        state = init_mtp_state(cfg, b, t - 1, params.embed.dtype)
        h, _ = mtp_hidden(params, x[:, :-1], inputs[:, 1:], state, jnp.zeros((b,), jnp.int32), cfg)
        out["mtp"] = cross_entropy_sum(h.reshape(-1, d), head, targets[:, 1:].reshape(-1), mask[:, 1:].reshape(-1))
    else:
        out["mtp"] = jnp.zeros((), f32)
    return out


def token_counts(mask: Array) -> tuple[Array, Array]:
    """(targets counted by the main loss, by the MTP loss) of a mask [..., T]."""
    return jnp.sum(mask, dtype=f32), jnp.sum(mask[..., 1:], dtype=f32)
