"""Gated delta rule (Qwen3-Next / Qwen3.5 linear attention): one entry point, several backends.

Use `chunk_gated_delta_rule`; the reference and XLA functions are exported for tests and
benchmarks. The math is in README.md.
"""

from .api import RECURRENT_MAX_TOKENS, chunk_gated_delta_rule, l2norm
from .reference import recurrent_gated_delta_rule_reference
from .xla import chunk_gated_delta_rule_xla

__all__ = [
    "RECURRENT_MAX_TOKENS",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_xla",
    "l2norm",
    "recurrent_gated_delta_rule_reference",
]
