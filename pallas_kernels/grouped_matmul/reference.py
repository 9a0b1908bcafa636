"""The oracle: every row multiplied by its own group's matrix, gathered row by row, in float32.
Slow and obvious on purpose (it materialises a [M, K, N] weight per call); never optimised."""

from __future__ import annotations

import jax.numpy as jnp


def group_ids(group_sizes, m: int):
    """The group of each of m rows (rows sorted by group); rows past sum(group_sizes) get G."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")


def gmm_reference(x, w, group_sizes, *, transpose_rhs: bool = False):
    """x [M, K], w [G, K, N] (or [G, N, K] with transpose_rhs), group_sizes [G] int32 with rows
    of x sorted by group. Returns float32 [M, N]: row m times its group's matrix; rows past
    sum(group_sizes) are zeros."""
    gid = group_ids(group_sizes, x.shape[0])
    live = gid < w.shape[0]
    wr = w[jnp.minimum(gid, w.shape[0] - 1)].astype(jnp.float32)  # [M, K, N] or [M, N, K]
    spec = "mk,mnk->mn" if transpose_rhs else "mk,mkn->mn"
    y = jnp.einsum(spec, x.astype(jnp.float32), wr)
    return jnp.where(live[:, None], y, 0.0)


def tgmm_reference(x, dy, group_sizes, num_groups: int):
    """The weight gradient: out[g] = x_g^T @ dy_g over group g's rows. x [M, K], dy [M, N];
    returns float32 [G, K, N] (zeros for empty groups; rows past the groups are ignored)."""
    gid = group_ids(group_sizes, x.shape[0])
    onehot = (gid[:, None] == jnp.arange(num_groups)[None, :]).astype(jnp.float32)  # [M, G]
    return jnp.einsum("mg,mk,mn->gkn", onehot, x.astype(jnp.float32), dy.astype(jnp.float32))
