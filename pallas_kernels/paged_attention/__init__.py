"""Attention of new queries over a KV cache held in a pool of fixed-size pages.

Use `paged_attention`; the reference, XLA and Pallas functions are exported for tests and
benchmarks.
The layout and the math are in README.md.
"""

from .api import IMPLEMENTATIONS, paged_attention
from .pallas import MAX_DECODE_QUERIES, paged_attention_pallas
from .pool import pool_dtype, pool_values, to_pool
from .reference import paged_attention_reference
from .xla import paged_attention_xla

__all__ = ["IMPLEMENTATIONS", "MAX_DECODE_QUERIES", "paged_attention", "paged_attention_pallas",
           "paged_attention_reference", "paged_attention_xla", "pool_dtype", "pool_values", "to_pool"]
