"""The cache: per-layer recurrent (GDN) and key/value (attention) state, as immutable pytrees.

`forward` never changes a cache; it returns a new one. A snapshot is therefore just a kept
reference (see docs/architecture.md). Attention KV capacity grows in power-of-two buckets (`reserve`)
so that decoding token by token does not change shapes, and so does not recompile, except
when a bucket fills.
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

from hybridjax import pytree
from hybridjax.config import FULL, Config

Array = jax.Array

MIN_CAPACITY = 64  # smallest KV bucket, in tokens


@pytree.dataclass
class GDNState:
    conv: Array  # [B, W-1, C] float32: the last W-1 pre-conv inputs
    ssm: Array  # [B, Hv, K, V] float32: the delta-rule state


@pytree.dataclass
class KVState:
    k: Array  # [B, S, Hkv, Dh]
    v: Array  # [B, S, Hkv, Dh]


@pytree.dataclass
class PagedKV:
    """Attention KV in the engine's page pool (see hybridjax.pages): pages shared by many rows.

    `table` names each row's pages in order; it is set per call (a row's key s is at
    page table[b, s // S], offset s % S) and is None in the pool the engine keeps.
    """

    k: Array  # [P, S, Hkv, Dh]
    v: Array  # [P, S, Hkv, Dh]
    table: Array | None = None  # [B, Np] int32; ids >= P mark pages a row does not have

    @property
    def page_size(self) -> int:
        return int(self.k.shape[1])


@pytree.dataclass
class Cache:
    layers: tuple  # tuple[GDNState | KVState | PagedKV, ...], aligned with the model's layers
    lengths: Array  # [B] int32: tokens seen by each row
    max_len: int = pytree.static(default=0)  # hard limit on tokens per row

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        """Tokens per row the KV buffers can hold now (max_len when there is no attention layer)."""
        kv = [s for s in self.layers if isinstance(s, KVState)]
        return int(kv[0].k.shape[1]) if kv else self.max_len


LayerState = Union[GDNState, KVState, PagedKV]


def bucket(n: int, max_len: int) -> int:
    """Smallest power-of-two capacity >= n (at least MIN_CAPACITY), capped at max_len."""
    cap = MIN_CAPACITY
    while cap < n:
        cap *= 2
    return min(cap, max_len)


def init_cache(cfg: Config, batch_size: int, max_len: int, dtype=jnp.float32, capacity: int | None = None,
               kv_shards: int = 1, zeros=jnp.zeros) -> Cache:
    """An empty cache for `batch_size` rows of up to `max_len` tokens each.

    KV buffers start at `capacity` tokens (default: the smallest bucket) and grow on demand.
    Buffers are made with `jnp.zeros` so that no two leaves share memory (donation needs that).
    `kv_shards`: the tensor shards the KV heads will be split over; with more shards than KV heads,
    each KV head is held once per shard that needs it (`Config.kv_heads_laid_out`). Placing the
    cache on a mesh is `hybridjax.sharding.init_cache` (the facade's `init_cache(..., mesh=)`).
    `zeros=np.zeros` makes host arrays, without tracing or running a device program.
    """
    if batch_size < 1 or max_len < 1:
        raise ValueError(f"init_cache: batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
    cap = bucket(capacity or 1, max_len)
    b, w = batch_size, cfg.linear_conv_kernel_dim
    layers = []
    for t in cfg.layer_types:
        if t == FULL:
            shape = (b, cap, cfg.kv_heads_laid_out(kv_shards), cfg.head_dim)
            layers.append(KVState(k=zeros(shape, dtype), v=zeros(shape, dtype)))
        else:
            hv, k, v = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
            layers.append(
                GDNState(
                    conv=zeros((b, w - 1, cfg.gdn_conv_dim), jnp.float32),
                    ssm=zeros((b, hv, k, v), jnp.float32),
                )
            )
    return Cache(layers=tuple(layers), lengths=zeros((b,), jnp.int32), max_len=int(max_len))


def with_capacity(cache: Cache, capacity: int) -> Cache:
    """The same cache with KV buffers padded (with zeros) to `capacity` tokens per row."""
    if capacity <= cache.capacity:
        return cache

    def grow(s: LayerState) -> LayerState:
        if not isinstance(s, KVState):
            return s
        pad = ((0, 0), (0, capacity - s.k.shape[1]), (0, 0), (0, 0))
        return KVState(k=jnp.pad(s.k, pad), v=jnp.pad(s.v, pad))

    return cache.replace(layers=tuple(grow(s) for s in cache.layers))


def reserve(cache: Cache, new_tokens) -> Cache:
    """Make room for `new_tokens` more real tokens per row (an int, or per-row counts [B]),
    growing KV buffers to the next bucket. Raises ValueError past `max_len`.

    Reads `cache.lengths` (a device-to-host copy), so call it outside jit.
    """
    needed = int(np.max(np.asarray(cache.lengths) + np.asarray(new_tokens), initial=0))
    if needed > cache.max_len:
        raise ValueError(f"sequence of {needed} tokens exceeds the cache's max_len of {cache.max_len}")
    if needed <= cache.capacity:
        return cache
    return with_capacity(cache, bucket(needed, cache.max_len))


def nbytes(tree) -> int:
    """Bytes held by the arrays of a cache (or any pytree)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def select_rows(cache: Cache, rows) -> Cache:
    """A cache holding only the given batch rows (a gather: a new value, the input is untouched)."""
    rows = jnp.asarray(rows, jnp.int32)
    return jax.tree_util.tree_map(lambda x: x[rows], cache)
