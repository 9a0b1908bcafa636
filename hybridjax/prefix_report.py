"""Why a request's cached prefix was as long as it was: the per-request cache report.

A lookup in the snapshot store (hybridjax.prefix_cache) returns the longest stored snapshot whose
tokens are a prefix of the request. `explain` says where that prefix came from (`source`: the kind
of snapshot, or "none") and why it was not longer (`reason`), from the store's state alone:

- `hit`: nothing the store holds or recently held shares more of the request than was reused;
  the rest of the prompt is new (turn 2 of a chat reusing turn 1 whole is a `hit`).
- `new_prefix`: nothing was reused and nothing the store holds shares a token with the request.
- `diverged_at:<k>`: a stored snapshot in the request's namespace shares k > matched tokens with
  the request but then differs (an edit in the middle); no snapshot sits between matched and k.
- `below_checkpoint_grid`: the same, with periodic checkpoints on, and the reuse is the grid point
  at or below k: a finer grid (--checkpoint-interval) would have reused more.
- `evicted`: a snapshot that was a longer prefix of the request was evicted (a bounded record of
  recent evictions remembers their tokens).
- `other_namespace`: a longer prefix is stored under another namespace of the same tenant (another
  `cache_salt` with the same API key). Other tenants' entries are never reported: that would tell
  one key what another key's prompts begin with.
- `cache_off`: the server runs without a prefix cache.

Precedence when several hold: evicted, other_namespace, then the divergence reasons.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

SOURCES = ("prompt", "response", "history", "checkpoint", "disk", "none")
# Label values for counters ("diverged_at:<k>" is counted as "diverged").
REASONS = ("hit", "new_prefix", "diverged", "below_checkpoint_grid", "evicted", "other_namespace", "cache_off")


@dataclasses.dataclass(frozen=True)
class CacheReport:
    matched_tokens: int
    source: str
    reason: str

    @property
    def label(self) -> str:
        """The reason without its position: a bounded set of values for metrics."""
        return self.reason.split(":", 1)[0].removesuffix("_at")

    def as_dict(self) -> dict:
        return {"matched_tokens": self.matched_tokens, "source": self.source, "reason": self.reason}


CACHE_OFF = CacheReport(0, "none", "cache_off")


def tenant(namespace: str) -> str:
    """The part of a namespace that names its owner: the server's namespaces are
    '<api-key digest>:<cache_salt>', so two salts of one key belong to one tenant."""
    return namespace.split(":", 1)[0]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class EvictionRecord:
    """The tokens of recently evicted snapshots, bounded by a total token count (oldest forgotten
    first), so a miss can say that a longer prefix was there and was evicted."""

    def __init__(self, max_tokens: int = 1 << 20):
        self.max_tokens = max_tokens
        self._items: deque[tuple[str, np.ndarray]] = deque()
        self._total = 0

    def add(self, namespace: str, tokens: np.ndarray) -> None:
        if len(tokens) > self.max_tokens:
            return
        # A copy: a snapshot's tokens may be a view of a longer request's array, which the bound
        # (in tokens) would not count.
        self._items.append((namespace, np.array(tokens)))
        self._total += len(tokens)
        while self._total > self.max_tokens:
            self._total -= len(self._items.popleft()[1])

    def discard(self, namespace: str, tokens: np.ndarray) -> None:
        """Forget an entry that is stored again (its tokens are no longer 'evicted')."""
        keep = [(ns, t) for ns, t in self._items if not (ns == namespace and np.array_equal(t, tokens))]
        if len(keep) != len(self._items):
            self._items = deque(keep)
            self._total = sum(len(t) for _, t in keep)

    def longest_prefix(self, namespace: str, request: np.ndarray) -> int:
        """The longest evicted entry of `namespace` that is a prefix of `request` (0: none)."""
        best = 0
        for ns, toks in self._items:
            n = len(toks)
            if ns == namespace and best < n <= len(request) and np.array_equal(request[:n], toks):
                best = n
        return best

    def __len__(self) -> int:
        return len(self._items)


def explain(matched: int, source: str, shared: int, elsewhere: int, evicted: int,
            checkpoint_interval: int) -> CacheReport:
    """The report for one lookup. `matched`/`source`: what the lookup reused (0/"none" on a miss);
    `shared`: the longest common prefix of the request with a stored snapshot of its namespace;
    `elsewhere`: the longest snapshot of the same tenant's other namespaces that is a prefix of the
    request; `evicted`: the longest evicted prefix of the request in its namespace
    (EvictionRecord.longest_prefix)."""
    elsewhere = elsewhere if elsewhere > matched else 0
    if evicted > matched and evicted >= elsewhere:
        return CacheReport(matched, source, "evicted")
    if elsewhere > matched:
        return CacheReport(matched, source, "other_namespace")
    if shared > matched:
        if checkpoint_interval > 0 and matched == (shared // checkpoint_interval) * checkpoint_interval:
            return CacheReport(matched, source, "below_checkpoint_grid")
        return CacheReport(matched, source, f"diverged_at:{shared}")
    return CacheReport(matched, source, "hit" if matched else "new_prefix")
