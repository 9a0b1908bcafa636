"""Progress of reading or writing a model, tensor by tensor.

Every loader and writer here takes `progress(steps, total_bytes)`, a factory called once the sizes
are known, which returns a callback taking the bytes of each step (a tensor or param leaf).
`TensorBar` is that factory as a tqdm bar on stderr; `load_progress` picks the loaders' default.
"""

from __future__ import annotations

import sys
from typing import Callable

Progress = Callable[[int, int], Callable[[int], None]]


class TensorBar:
    """tqdm bar over bytes with a count of `unit`s, on stderr; `close` clears a failed bar."""

    def __init__(self, unit: str, desc: str):
        self.bar, self.unit, self.desc = None, unit, desc

    def __call__(self, n_tensors: int, total_bytes: int) -> Callable[[int], None]:
        from tqdm import tqdm

        self.bar = bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=self.desc,
                              file=sys.stderr, dynamic_ncols=True)
        count = [0]

        def step(nbytes: int) -> None:
            count[0] += 1
            bar.set_postfix_str(f"{count[0]}/{n_tensors} {self.unit}", refresh=False)
            bar.update(nbytes)
            if count[0] == n_tensors:
                bar.close()

        return step

    def close(self, failed: bool = False) -> None:
        if self.bar is not None:
            self.bar.leave = not failed  # an interrupted bar would only hide the error line
            self.bar.close()


def load_progress(progress: bool | Progress | None) -> Progress | None:
    """A loader's `progress` argument as a factory: True a bar, None a bar when stderr is a
    terminal (so logs, pipes and tests stay quiet), False none, or the caller's own factory."""
    if callable(progress):
        return progress
    if progress or (progress is None and sys.stderr.isatty()):
        return TensorBar("tensors", "load")
    return None
