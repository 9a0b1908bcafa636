"""The oracle: gather every page a row names into one contiguous buffer, then plain causal
softmax attention in float32. Slow and obvious on purpose; never optimised."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def paged_attention_reference(q, k_pages, v_pages, page_table, q_pos, *, scale):
    """q [B, T, Hq, Dh]; k_pages, v_pages [P, S, Hkv, Dh]; page_table [B, Np] int32;
    q_pos [B, T] int32 absolute query positions. Key s of row b lives at
    (page_table[b, s // S], s % S) and is visible to query t iff s <= q_pos[b, t].
    Returns [B, T, Hq, Dh] in q's dtype (a query that sees no key gets zeros)."""
    b, t, hq, dh = q.shape
    _, s, hkv, _ = k_pages.shape
    n = page_table.shape[1]
    ids = jnp.clip(page_table, 0, k_pages.shape[0] - 1)  # ids past the pool are never visible
    k = k_pages[ids].reshape(b, n * s, hkv, dh).astype(jnp.float32)  # [B, Np*S, Hkv, Dh]
    v = v_pages[ids].reshape(b, n * s, hkv, dh).astype(jnp.float32)
    k, v = jnp.repeat(k, hq // hkv, axis=2), jnp.repeat(v, hq // hkv, axis=2)  # query head h: kv head h // g
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k) * scale  # [B, Hq, T, Np*S]
    visible = jnp.arange(n * s)[None, None, :] <= q_pos[:, :, None]  # [B, T, Np*S]
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    probs = jnp.where(visible[:, None], jax.nn.softmax(scores, axis=-1), 0.0)  # rows with no key: 0
    return jnp.einsum("bhts,bshd->bthd", probs, v).astype(q.dtype)
