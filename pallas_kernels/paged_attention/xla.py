"""Paged attention for XLA (the CPU path): a loop over blocks of pages with an online softmax.

Each iteration gathers `block_pages` pages of every row ([B, block_pages * S, Hkv, Dh]) and
folds them into a running max, denominator and weighted sum (flash-decoding's recurrence), so
the work follows the longest row's real length, not the page table's capacity, and one
compiled program serves every length. Heads lead and each kv head's g x T queries form one
matrix, as in hybridjax.ops.attention (plain batched matmuls on XLA:CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .pool import pool_values

BLOCK_TOKENS = 256  # keys per loop iteration: few iterations for typical lengths, small gathers


def paged_attention_xla(q, k_pages, v_pages, page_table, q_pos, *, scale, block_pages=None):
    """Same contract as `reference.paged_attention_reference`; pools may hold bits (`pool`)."""
    b, t, hq, dh = q.shape
    _, s, hkv, _ = k_pages.shape
    g, n = hq // hkv, page_table.shape[1]
    bp = min(block_pages or max(1, BLOCK_TOKENS // s), n)
    # At least two blocks (the second only padding): a loop XLA can prove runs once is inlined, and
    # XLA:CPU then fuses the page gather with the step's page write and copies whole pools per step.
    n_blocks_max = max(2, -(-n // bp))
    table = jnp.pad(page_table, ((0, 0), (0, n_blocks_max * bp - n)))  # padding is never visible
    table = jnp.clip(table, 0, k_pages.shape[0] - 1)
    span = bp * s  # keys per block
    n_blocks = (jnp.max(q_pos) + span) // span  # blocks up to the furthest visible key

    qh = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, dh)
    qh_pos = jnp.tile(q_pos, (1, g))[:, None, :, None]  # [B, 1, g*T, 1], rows ordered (g, t)

    def block(i, carry):
        m, denom, acc = carry  # [B, Hkv, gT], [B, Hkv, gT], [B, Hkv, gT, Dh]
        ids = jax.lax.dynamic_slice_in_dim(table, i * bp, bp, axis=1)  # [B, bp]
        kb = pool_values(k_pages[ids]).reshape(b, span, hkv, dh).transpose(0, 2, 1, 3)  # [B, Hkv, span, Dh]
        vb = pool_values(v_pages[ids]).reshape(b, span, hkv, dh).transpose(0, 2, 1, 3)
        scores = jnp.einsum("bhqd,bhkd->bhqk", qh, kb.astype(q.dtype), preferred_element_type=jnp.float32) * scale
        key_pos = i * span + jnp.arange(span)
        scores = jnp.where(key_pos[None, None, None, :] <= qh_pos, scores, -jnp.inf)  # [B, Hkv, gT, span]
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # nothing visible yet: keep exp finite
        p = jnp.exp(scores - base[..., None])
        rescale = jnp.exp(m - base)  # 0 while m is -inf
        denom = denom * rescale + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, denom, acc * rescale[..., None] + pv

    init = (jnp.full((b, hkv, g * t), -jnp.inf, jnp.float32), jnp.zeros((b, hkv, g * t), jnp.float32),
            jnp.zeros((b, hkv, g * t, dh), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(0, n_blocks, block, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.astype(q.dtype).reshape(b, hkv, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, dh)
