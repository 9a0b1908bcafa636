"""The tile schedule shared by the grouped-matmul forms that run all tiles at once."""

from __future__ import annotations

import jax.numpy as jnp


def group_tiles(group_sizes, m: int, tm: int):
    """Tiles of rows sorted by group, aligned to each group's first row (a group of up to tm
    rows is one tile, so its matrix is read once): group g's tile j covers rows
    start_g + j * tm + [0, tm), of which the first `count` belong to the group.
    At most ceil(m / tm) + min(G, m) tiles (a static bound); unused tiles get group -1 and
    count 0. Returns start [T], count [T], group [T], all int32."""
    g = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    n_tiles = (group_sizes + tm - 1) // tm
    cum = jnp.cumsum(n_tiles)
    t = jnp.arange(-(-m // tm) + min(g, m))
    grp = jnp.minimum(jnp.searchsorted(cum, t, side="right"), g - 1)
    start = starts[grp] + (t - (cum - n_tiles)[grp]) * tm
    used = t < cum[-1]
    count = jnp.where(used, jnp.clip(ends[grp] - start, 0, tm), 0)
    return start.astype(jnp.int32), count.astype(jnp.int32), jnp.where(used, grp, -1).astype(jnp.int32)
