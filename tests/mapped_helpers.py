"""Where a jax.Array's buffer lives: the files mapped at its address (Linux: /proc/self/maps)."""

from __future__ import annotations

from pathlib import Path

import jax


def mapped_files(x: jax.Array) -> set[str]:
    """The files whose mappings in this process hold the buffer of `x`."""
    ptr = x.unsafe_buffer_pointer()
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(v, 16) for v in span.split("-"))
        if lo <= ptr < hi and len(rest) == 5:
            found.add(rest[4])
    return found
