"""Gated delta rule (Qwen3-Next / Qwen3.5 linear attention): one entry point, several backends.

Use `chunk_gated_delta_rule`; the reference, XLA and Pallas functions and the custom-VJP
wrapper are exported for tests and benchmarks. The math is in README.md.
"""

from .api import IMPLEMENTATIONS, RECURRENT_MAX_TOKENS, chunk_gated_delta_rule, l2norm
from .backward import gated_delta_rule_backward, gated_delta_rule_with_vjp
from .chunk import chunk_gated_delta_rule_pallas
from .recurrent import recurrent_gated_delta_rule_pallas
from .reference import recurrent_gated_delta_rule_reference
from .xla import chunk_gated_delta_rule_xla

__all__ = [
    "IMPLEMENTATIONS",
    "RECURRENT_MAX_TOKENS",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_pallas",
    "chunk_gated_delta_rule_xla",
    "gated_delta_rule_backward",
    "gated_delta_rule_with_vjp",
    "l2norm",
    "recurrent_gated_delta_rule_pallas",
    "recurrent_gated_delta_rule_reference",
]
