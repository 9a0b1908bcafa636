"""Token ids as read-only int32 arrays, and the prefix keys that share them.

The snapshot store (hybridjax.prefix_cache) keys each snapshot by its tokens. A request's prompt
becomes one read-only array (`frozen_ids`, once per request: `GenerationRequest.prompt_array`) and
each of its snapshots is a `Tokens` prefix of it, so a long prefill's checkpoints copy nothing.
Plain numpy: the scheduler's side of the engine imports this without jax.
"""

from __future__ import annotations

import numpy as np


class Tokens:
    """A snapshot's tokens as the store keys them: the first `length` ids of a read-only int32
    array that several keys may share. A request's checkpoints are prefixes of its one prompt
    array (a view each, not a copy of the whole context per snapshot); two keys on one array
    compare by length alone. Hashed once. The tuple of Python ints (tests, file names of the saved
    snapshots) is made only when asked for."""

    __slots__ = ("base", "length", "_hash", "_tuple")

    def __init__(self, base: np.ndarray, length: int | None = None):
        if base.dtype != np.int32 or base.ndim != 1 or base.flags.writeable:
            raise ValueError("Tokens needs a read-only 1-d int32 array (`frozen_ids`)")
        self.base = base
        self.length = len(base) if length is None else int(length)
        if not 0 <= self.length <= len(base):
            raise ValueError(f"length {self.length} outside the array's {len(base)} tokens")
        self._hash: int | None = None
        self._tuple: tuple[int, ...] | None = None

    @classmethod
    def of(cls, tokens) -> "Tokens":
        """`tokens` as a key: itself if it is one, else a read-only copy of the ids."""
        return tokens if isinstance(tokens, Tokens) else cls(frozen_ids(tokens))

    @property
    def array(self) -> np.ndarray:
        return self.base[: self.length]

    def as_tuple(self) -> tuple[int, ...]:
        if self._tuple is None:
            self._tuple = tuple(self.array.tolist())
        return self._tuple

    def __len__(self) -> int:
        return self.length

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self.array.tobytes())
        return self._hash

    def __eq__(self, other) -> bool:
        if not isinstance(other, Tokens):
            return NotImplemented
        return self.length == other.length and (self.base is other.base or np.array_equal(self.array, other.array))

    def prefix_of(self, other: "Tokens") -> bool:
        """Whether these tokens start `other` (no comparison when both share one array)."""
        if self.length > other.length:
            return False
        return self.base is other.base or np.array_equal(other.base[: self.length], self.array)

    def __repr__(self) -> str:
        return f"Tokens({self.length} ids)"


def frozen_ids(tokens) -> np.ndarray:
    """Token ids as a read-only int32 array (one conversion in C); an array that already is one is
    shared, not copied: its owner must not write it (the engine's prompt arrays never change)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.ndim == 1 and not tokens.flags.writeable:
        return tokens
    array = np.array(tokens, np.int64).astype(np.int32)  # int64 first: ids as Python ints of any size
    array.flags.writeable = False
    return array
