"""Grouped matmul: rows sorted by group, each group times its own matrix (the routed experts of
a mixture-of-experts layer). Use `grouped_matmul`; the reference and XLA functions are exported
for tests and benchmarks. The contract and the layout are in README.md.
"""

from .api import IMPLEMENTATIONS, grouped_matmul
from .common import group_tiles
from .pallas import gmm_pallas
from .reference import gmm_reference, group_ids, tgmm_reference
from .xla import default_tile_rows, gmm_xla, tgmm_xla

__all__ = ["IMPLEMENTATIONS", "default_tile_rows", "gmm_pallas", "gmm_reference", "gmm_xla", "group_ids",
           "group_tiles", "grouped_matmul",
           "tgmm_reference", "tgmm_xla"]
