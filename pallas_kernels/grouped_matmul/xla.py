"""Grouped matmul for XLA (the CPU path): a loop over the non-empty groups, and inside it a
loop over tiles of that group's rows.

Work follows the rows, not the groups: each non-empty group's matrix is sliced once (XLA:CPU
copies a dynamic slice of a weight: ~25 us per 512 KB on the dev machine, so once per group,
not once per tile), then its rows go through in tiles of `tile_rows` starting at the group's
first row; a tile's rows past the group's end are computed and discarded. Empty groups cost
nothing. `jax.lax.ragged_dot` is not used: in JAX 0.10 it lowers to a dense computation on
CPU (G times the work).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_TILE_ROWS = 256  # rows per tile when groups are large (prefill with few experts)


def default_tile_rows(m: int, num_groups: int) -> int:
    """Rows per tile: the average group size rounded up to a power of two, in [1, MAX_TILE_ROWS].
    Few rows over many groups (decode) give tiles of one row: one matvec per (token, expert)."""
    avg = -(-m // num_groups)
    return min(MAX_TILE_ROWS, 1 << max(0, (avg - 1).bit_length()))


def _bounds(group_sizes):
    ends = jnp.cumsum(group_sizes)
    # Non-empty groups first (stable: in group order), so the loop visits only those.
    live = jnp.argsort(group_sizes == 0, stable=True).astype(jnp.int32)
    return ends - group_sizes, ends, live, jnp.sum(group_sizes > 0)


def gmm_xla(x, w, group_sizes, *, transpose_rhs: bool = False, tile_rows: int | None = None):
    """Same contract as `reference.gmm_reference`."""
    m, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    tm = tile_rows or default_tile_rows(m, w.shape[0])
    starts, ends, live, n_live = _bounds(group_sizes)
    xp = jnp.pad(x, ((0, tm), (0, 0)))  # a tile starting at any row < m stays in bounds
    contract = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

    def group(j, out):
        g = live[j]
        wg = w[g]  # sliced (copied) once per group
        s, e = starts[g], ends[g]

        def tile(t, out):
            r0 = s + t * tm
            rows = jax.lax.dynamic_slice_in_dim(xp, r0, tm)  # [tm, K]
            y = jax.lax.dot_general(rows, wg, contract, preferred_element_type=jnp.float32)  # [tm, N]
            keep = (r0 + jnp.arange(tm)) < e
            old = jax.lax.dynamic_slice_in_dim(out, r0, tm)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep[:, None], y, old), r0, 0)

        return jax.lax.fori_loop(0, (e - s + tm - 1) // tm, tile, out)

    out = jax.lax.fori_loop(0, n_live, group, jnp.zeros((m + tm, n), jnp.float32))
    return out[:m]


def tgmm_xla(x, dy, group_sizes, num_groups: int, *, tile_rows: int | None = None):
    """Same contract as `reference.tgmm_reference`."""
    m, k = x.shape
    n = dy.shape[1]
    tm = tile_rows or default_tile_rows(m, num_groups)
    starts, ends, live, n_live = _bounds(group_sizes)
    xp = jnp.pad(x, ((0, tm), (0, 0)))
    dyp = jnp.pad(dy, ((0, tm), (0, 0)))

    def group(j, dw):
        g = live[j]
        s, e = starts[g], ends[g]

        def tile(t, acc):
            r0 = s + t * tm
            keep = ((r0 + jnp.arange(tm)) < e)[:, None]
            rows = jnp.where(keep, jax.lax.dynamic_slice_in_dim(xp, r0, tm), 0)  # where, not *: no NaN * 0
            d = jnp.where(keep, jax.lax.dynamic_slice_in_dim(dyp, r0, tm), 0)
            return acc + jax.lax.dot_general(rows, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, (e - s + tm - 1) // tm, tile, jnp.zeros((k, n), jnp.float32))
        return jax.lax.dynamic_update_index_in_dim(dw, acc, g, 0)

    return jax.lax.fori_loop(0, n_live, group, jnp.zeros((num_groups, k, n), jnp.float32))
