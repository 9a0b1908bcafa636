"""How a page pool stores its values: bfloat16 KV on CPU as its uint16 bits.

XLA:CPU writes into a bfloat16 array (dynamic-update-slice, scatter) and gathers from one by
converting the whole array to float32 first (and back after a write): for the engine's pools,
every page of every attention layer, twice per decode step. A bfloat16 engine at max_len 4096
decoded at 0.2x of `generate`'s speed (benchmarks/README.md, stop 54). The same update on
uint16 runs in place, and a gather of uint16 moves only the pages it reads. So on CPU a pool of
bfloat16 values is made as uint16 (`pool_dtype`); writers store bits (`to_pool`), readers
view what they gathered as bfloat16 (`pool_values`). Other dtypes, and other backends, store
values as they are, and both functions leave them alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BITS = jnp.dtype(jnp.uint16)  # the storage of bfloat16 values (the only 16-bit float the models load in)


def pool_dtype(dtype):
    """The dtype to make a page pool of `dtype` values with (on the default backend)."""
    return BITS if jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu" else jnp.dtype(dtype)


def pool_values(x):
    """Pool storage (all of it, or pages gathered from it) as values: uint16 bits as bfloat16."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BITS else x


def to_pool(values, pool):
    """`values` as `pool` stores them: cast to its value dtype, then as bits if it holds bits."""
    if pool.dtype == BITS:
        return jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), BITS)
    return values.astype(pool.dtype)
