"""The exact-prefix snapshot store.

A snapshot is (tokens, state, logits after the last token). In the engine the state is a row of
its paged cache: the ids of the KV pages the row had filled (shared with the conversation it
came from, by id; see hybridjax.pages) plus the row's small recurrent (GDN) state; the store
holds the pages through the pool's reference counts. Any pytree of arrays works as the state
(the library's `Cache` too). Storing one costs nothing and restoring one copies nothing but a
partial last page. Recurrent state cannot be trimmed, so reuse is exact-prefix: `lookup` returns
the longest stored snapshot whose tokens are a prefix of the request's, within the request's
namespace. A snapshot's tokens are its key (hybridjax.token_ids.Tokens): a prefix of a read-only
array that the request's other snapshots share, so a checkpoint copies no context and a lookup
compares the request once per shared array (`shared_lengths`).

Bounds: bytes (a buffer or page held by several snapshots is counted once), entry count and age
(TTL); eviction by saved prefill per byte aged by recency ("gdsf", the default) or
least-recently-used ("lru"), see hybridjax.eviction; the engine also evicts (same policy) when its
page pool runs short. Every lookup also explains itself (`Hit.report`, hybridjax.prefix_report). Inserting a prompt snapshot drops the prompt and response snapshots it strictly extends
when no other request used them and no other entry branches from them: the new prompt proves the
conversation moved past them (a chat keeps its newest turn, branch points survive). A response
snapshot supersedes nothing, since the next turn may not re-send the response token for token.
Thread-safe: the engine thread and the HTTP threads may call it concurrently.

Write-through persistence and a disk tier (the server's `--prefix-cache-dir`): with `disk` set
(hybridjax.snapshot_disk) every new snapshot is handed to it as it is stored, supersession deletes
on disk too, and a lookup first brings back from disk any longer prefix than memory holds (its
report says `source: disk`).

One-shot export (`save` / `load`, snapshot format 3; read by the disk tier to convert an old
directory): one file per snapshot and one file of the pages they name (each
page once), each with a SHA-256 checksum of its contents, written owner-only; a file that fails
its checksum, belongs to another model or is not ours is skipped with a warning, and `save`
only deletes files this store wrote or loaded. A snapshot names its pages by content (the
SHA-256 of each page's K and V, `page_digests`), recomputed from the page data at load: a
snapshot whose pages are not all in the pages file (a save cut short between the two writes,
another server's pages file) is skipped with a warning, never loaded with other pages. One
server per directory: `DirectoryLock` (flock, released by the kernel when the process dies).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import io
import logging
import os
import pickle
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np

from hybridjax.eviction import POLICIES, priority, victim
from hybridjax.pages import PagePool
from hybridjax.prefix_report import CacheReport, EvictionRecord, common_prefix, explain, tenant
from hybridjax.token_ids import Tokens

log = logging.getLogger(__name__)

KINDS = ("prompt", "response", "history", "checkpoint")
SUPERSEDABLE = ("prompt", "response")
PREFETCHED = 2  # disk reads kept for the lookups they were made for (`SnapshotStore.prefetch`): ~30 MB each at 30k tokens
FILE_SUFFIX = ".snapshot"
PAGES_SUFFIX = ".pages"
TMP_SUFFIX = ".tmp"
FORMAT_VERSION = 3  # 3: snapshots name their pages by content digest (2: by position in the pages file)
MAGIC = b"HJXSNAP2"  # then 32 bytes of SHA-256 over the rest, then a pickle


@dataclasses.dataclass
class Snapshot:
    key: Tokens  # the tokens it covers (`tokens` as a tuple)
    cache: object  # the row's state: a pytree of arrays (the engine: its GDN states), batch of one
    logits: jax.Array  # [vocab] float32: next-token logits after its tokens
    namespace: str = ""
    kind: str = "prompt"
    created: float = 0.0
    last_used: float = 0.0
    hits: int = 0
    pages: tuple[int, ...] = ()  # KV page ids covering its tokens, in order (paged engine)
    priority: float = 0.0  # eviction order under the "gdsf" policy (hybridjax.eviction)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.key.as_tuple()

    @property
    def length(self) -> int:
        return self.key.length

    @property
    def array(self) -> np.ndarray:
        """The tokens as int32 (a view of the key's array)."""
        return self.key.array

    def leaves(self) -> list:
        return jax.tree_util.tree_leaves(self.cache) + [self.logits]


@dataclasses.dataclass(frozen=True)
class Hit:
    snapshot: Snapshot | None
    reused: int  # tokens covered by the snapshot (0 on a miss)
    request_len: int
    report: CacheReport | None = None  # where the prefix came from and why it was not longer

    @property
    def exact(self) -> bool:
        """The snapshot covers the whole request: its stored logits replace any model call."""
        return self.snapshot is not None and self.reused == self.request_len


def _leaf_bytes(x) -> int:
    return int(x.size) * x.dtype.itemsize


class SnapshotStore:
    def __init__(self, model_id: str, *, max_bytes: int = 1 << 30, max_entries: int = 256, ttl_s: float = 3600.0,
                 clock=time.monotonic, policy: str = "gdsf", disk_bytes: int = 4 << 30):
        if policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {POLICIES}, got {policy!r}")
        self.model_id = model_id
        self.policy = policy
        self._age = 0.0  # GDSF's clock: the priority of the last snapshot evicted
        self.checkpoint_interval = 0  # the engine's periodic checkpoints (for the cache report)
        self._evicted = EvictionRecord()
        self.max_bytes, self.max_entries, self.ttl_s = max_bytes, max_entries, ttl_s
        self.clock = clock
        # LRU order (insertion order, a hit moved to the end). A plain dict, not an OrderedDict: the
        # latter looks each key up again while iterating, hashing every snapshot's token tuple (at
        # 28k tokens of one conversation's snapshots, 25 ms per pass over the store).
        self._entries: dict[tuple[str, tuple[int, ...]], Snapshot] = {}
        self._buffers: dict = {}  # id(leaf) -> [refcount, bytes, leaf]
        self._page_holds = np.zeros(0, np.int64)  # per pool page id: snapshots naming it (`_hold_pages`)
        self._nbytes = 0  # _buffers' bytes + held pages' bytes, kept as they come and go (checked on every insert)
        self._lock = threading.RLock()
        self._pool: PagePool | None = None
        self._page_bytes = 0
        self._files: set[str] = set()  # names of the files this store wrote or loaded
        self.counters: Counter = Counter()
        # The disk tier (hybridjax.snapshot_disk.DiskTier), attached by `attach_disk`; its budget.
        self.disk = None
        # Disk reads done ahead on a request's thread (`prefetch`), newest last, until a lookup takes one.
        self._fetched: dict[tuple[str, tuple[int, ...]], tuple] = {}
        self.disk_bytes = disk_bytes

    def set_disk(self, disk):
        """Attach a disk tier (None: detach); returns the one attached before. Under the lock, so
        no insert or lookup sees it change half way."""
        with self._lock:
            old, self.disk = self.disk, disk
            return old

    def use_pages(self, pool: PagePool, page_bytes: int) -> None:
        """Snapshots may name pages of `pool` (each `page_bytes` bytes over all layers): the store
        holds them through the pool's reference counts and counts each page's bytes once."""
        if self._entries:
            raise ValueError("attach the page pool before storing snapshots")
        self._pool, self._page_bytes = pool, page_bytes

    # --- accounting -----------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    @property
    def pages_held(self) -> int:
        """Distinct pages named by stored snapshots."""
        with self._lock:
            return int(np.count_nonzero(self._page_holds))

    def __len__(self) -> int:
        return len(self._entries)

    def _ref(self, snap: Snapshot, delta: int) -> None:
        held = [(id(leaf), _leaf_bytes(leaf), leaf) for leaf in snap.leaves()]
        for key, size, leaf in held:
            entry = self._buffers.get(key)
            if entry is None:
                entry = self._buffers[key] = [0, size, leaf]
                self._nbytes += size
            entry[0] += delta
            if entry[0] <= 0:
                del self._buffers[key]
                self._nbytes -= entry[1]
        if snap.pages:
            self._hold_pages(snap.pages, delta)
            if self._pool is not None:
                (self._pool.retain if delta > 0 else self._pool.release)(snap.pages)

    def _hold_pages(self, pages: Sequence[int], delta: int) -> None:
        """The store's count of snapshots naming each page, in one array over page ids (a page's
        bytes count once, while any snapshot names it). Vectorised: each checkpoint of a long
        context names every page before it (~470 at 30k tokens), and a dict entry per page cost
        ~0.5 ms per insert."""
        ids = np.asarray(pages, np.int64)
        if ids.max() >= len(self._page_holds):
            grown = np.zeros(max(int(ids.max()) + 1, 2 * len(self._page_holds)), np.int64)
            grown[: len(self._page_holds)] = self._page_holds
            self._page_holds = grown
        uniq = np.unique(ids)
        before = self._page_holds[uniq]
        np.add.at(self._page_holds, ids, delta)
        after = np.maximum(self._page_holds[uniq], 0)
        self._page_holds[uniq] = after
        lost = uniq[(before > 0) & (after == 0)]
        self._nbytes += (int(np.count_nonzero((before == 0) & (after > 0))) - len(lost)) * self._page_bytes
        if self.disk is not None:
            for page in lost.tolist():
                self.disk.released(page)  # the page id may hold other data from now on

    # --- lookup ---------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], namespace: str = "") -> Hit:
        """The longest snapshot in `namespace` whose tokens are a prefix of `tokens`."""
        return self.lookup_many([tokens], namespace=[namespace])[0]

    def lookup_many(self, requests: Sequence[Sequence[int] | Tokens], namespace: Sequence[str]) -> list[Hit]:
        """One pass over the store for a batch of requests (the engine's admission)."""
        with self._lock:
            self._expire()
            requests = [Tokens.of(r) for r in requests]
            from_disk = self._promote(requests, namespace) if self.disk is not None else set()
            by_ns: dict[str, list[Snapshot]] = {}
            for (ns, _), snap in self._entries.items():
                by_ns.setdefault(ns, []).append(snap)
            hits = []
            for request, ns in zip(requests, namespace):
                self.counters["lookups"] += 1
                mine = by_ns.get(ns, ())
                shared = shared_lengths(request, mine)
                best = max((s for s, k in zip(mine, shared) if k == s.length), key=lambda s: s.length, default=None)
                report = self._explain(request, ns, best, max(shared, default=0), by_ns)
                if best is not None and id(best) in from_disk:
                    report = dataclasses.replace(report, source="disk")
                if best is None:
                    self.counters["misses_empty_namespace" if ns not in by_ns else "misses_no_prefix"] += 1
                    hits.append(Hit(None, 0, len(request), report))
                    continue
                best.hits += 1
                best.last_used = self.clock()
                best.priority = priority(best, self._age, self._page_bytes)
                self._touch((ns, best.key))
                self.counters["hits"] += 1
                self.counters["tokens_reused"] += best.length
                if best.length == len(request):
                    self.counters["exact_hits"] += 1
                hits.append(Hit(best, best.length, len(request), report))
            return hits

    def _promote(self, requests: Sequence[Tokens], namespace) -> set[int]:
        """Bring back from the disk tier each request's longest prefix where it beats memory's
        (before any hit is handed out, so that the pages its pool allocation evicts are no hit's).
        Returns the ids of the snapshots brought back. Engine thread only (it writes device pages)."""
        out = set()
        for request, ns in zip(requests, namespace):
            mem = self._longest_in_memory(request, ns)
            got = self._take_fetched(request, ns, mem) or self.disk.fetch(request.as_tuple(), ns, mem)
            if got is None:
                continue
            entry, cache, logits, ks, vs = got
            ids: list[int] = []
            if entry.pages:
                if self._pool is None or not self.evict_until(lambda: self._pool.free >= len(entry.pages), "pages"):
                    continue
                ids = self._pool.alloc(len(entry.pages))
                self.disk.write_pages(ids, ks, vs)
            try:
                snap = self.insert(entry.tokens, jax.tree_util.tree_map(jax.numpy.asarray, cache),
                                   jax.numpy.asarray(logits), namespace=ns, kind=entry.kind, supersede=False,
                                   pages=ids, persist=False)
            finally:
                if ids:
                    self._pool.release(ids)  # the store holds them now (or nobody, if it evicted it at once)
            self.counters["disk_hits"] += 1
            out.add(id(snap))
        return out

    def _longest_in_memory(self, request: Tokens, ns: str) -> int:
        """The length of the longest snapshot of `ns` in memory that `request` starts with (0: none):
        what a disk read must beat. Under the lock."""
        mine = [s for (n, _), s in self._entries.items() if n == ns]
        return max((s.length for s, k in zip(mine, shared_lengths(request, mine)) if k == s.length), default=0)

    def prefetch(self, tokens: Sequence[int] | Tokens, namespace: str = "") -> bool:
        """Read now, on the caller's thread (a request's, before it is submitted), the disk snapshot
        a lookup of `tokens` would bring back, so that the engine thread's lookup (`_promote`) only
        writes its pages instead of reading and checking files (hundreds of pages at 30k tokens).
        Kept until a lookup takes it (the newest PREFETCHED only). True if one was read."""
        disk = self.disk
        if disk is None:
            return False
        request = Tokens.of(tokens)
        with self._lock:
            mem = self._longest_in_memory(request, namespace)
        got = disk.fetch(request.as_tuple(), namespace, mem)  # outside the lock: the engine's lookups go on
        if got is None:
            return False
        with self._lock:
            self._fetched[(namespace, got[0].tokens)] = got
            while len(self._fetched) > PREFETCHED:
                del self._fetched[next(iter(self._fetched))]
        return True

    def _take_fetched(self, request: Tokens, ns: str, longer_than: int):
        """The longest prefetched disk read (`prefetch`) of `ns` that starts `request` and beats
        memory's `longer_than` tokens, taken out; None if none. A read is a checked copy of a disk
        snapshot, valid whatever happened on disk since."""
        fits = [key for key in self._fetched if key[0] == ns and longer_than < len(key[1]) <= request.length
                and np.array_equal(request.array[: len(key[1])], np.asarray(key[1], np.int64))]
        if not fits:
            return None
        return self._fetched.pop(max(fits, key=lambda key: len(key[1])))

    def _explain(self, request: Tokens, ns: str, best: Snapshot | None, shared: int, by_ns: dict) -> CacheReport:
        """The cache report of one lookup (hybridjax.prefix_report): where its prefix came from,
        why it was not longer. `shared`: the longest common prefix of the request with a snapshot
        of its namespace. Cost: one prefix comparison per token array the tenant's other
        namespaces' snapshots share."""
        others = [s for n, snaps in by_ns.items() if n != ns and tenant(n) == tenant(ns) for s in snaps]
        elsewhere = max((s.length for s, k in zip(others, shared_lengths(request, others)) if k == s.length), default=0)
        return explain(best.length if best else 0, best.kind if best else "none", shared, elsewhere,
                       self._evicted.longest_prefix(ns, request.array), self.checkpoint_interval)

    # --- insertion and eviction -------------------------------------------------------
    def insert(self, tokens: Sequence[int] | Tokens, cache, logits: jax.Array, *, namespace: str = "",
               kind: str = "prompt", supersede: bool = True, pages: Sequence[int] = (),
               persist: bool = True) -> Snapshot:
        """Store a snapshot (the store takes its own hold on `pages`); an entry with the same
        tokens keeps its older value, equal by construction. `tokens` may be a `Tokens` (a prefix
        of a read-only array the caller shares, never writes). With a disk tier, a new snapshot is
        queued for writing unless `persist` is False (it came from disk)."""
        if kind not in KINDS:
            raise ValueError(f"snapshot kind must be one of {KINDS}, got {kind!r}")
        tokens = Tokens.of(tokens)
        now = self.clock()
        snap = Snapshot(tokens, cache, logits, namespace, kind, now, now, pages=tuple(np.asarray(pages, np.int64).tolist()))
        with self._lock:
            key = (namespace, tokens)
            if key in self._entries:
                old = self._entries[key]
                old.last_used = now
                if kind == "history" or old.kind in SUPERSEDABLE:
                    old.kind = kind if kind != "checkpoint" else old.kind
                self._touch(key)
                return old
            self._entries[key] = snap
            snap.priority = priority(snap, self._age, self._page_bytes)
            self._evicted.discard(namespace, snap.array)
            self._ref(snap, +1)
            self.counters["inserts"] += 1
            if self.disk is not None and persist:
                self.disk.stored(snap)
            if kind == "prompt" and supersede:
                self._drop_superseded(snap)
            self._enforce_bounds()
            return snap

    def _touch(self, key) -> None:
        """Mark `key` most recently used (to the end of the insertion order)."""
        self._entries[key] = self._entries.pop(key)

    def _drop_superseded(self, snap: Snapshot) -> None:
        ns, toks = snap.namespace, snap.key
        same_ns = [s for (n, _), s in self._entries.items() if n == ns and s is not snap]
        for old in same_ns:
            if old.kind not in SUPERSEDABLE or old.length >= toks.length or old.hits > 1 or not old.key.prefix_of(toks):
                continue
            # A branch point: some other entry extends `old` but is not on the new snapshot's path.
            branches = any(o.length > old.length and old.key.prefix_of(o.key) and not o.key.prefix_of(toks)
                           for o in same_ns if o is not old)
            if not branches:
                self._remove((ns, old.key), "superseded")

    def _remove(self, key, reason: str) -> None:
        snap = self._entries.pop(key)
        self._ref(snap, -1)
        self.counters[f"evictions_{reason}"] += 1
        if reason == "superseded" and self.disk is not None:
            self.disk.superseded(snap.namespace, snap.tokens)  # other evictions keep it on disk
        if reason not in ("superseded", "cleared"):  # gone though nothing covers it: a later miss says so
            self._evicted.add(snap.namespace, snap.array)
            self._age = max(self._age, snap.priority)

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        now = self.clock()
        for key in [k for k, s in self._entries.items() if now - s.last_used > self.ttl_s]:
            self._remove(key, "ttl")

    def expire(self) -> None:
        """Drop entries older than the TTL (also done on every lookup and insert)."""
        with self._lock:
            self._expire()

    def _enforce_bounds(self) -> None:
        self._expire()
        while len(self._entries) > self.max_entries:
            self._remove(victim(self._entries, self.policy), "entries")
        while self._entries and self.nbytes > self.max_bytes:
            self._remove(victim(self._entries, self.policy), "bytes")

    def evict_until(self, enough: Callable[[], bool], reason: str = "pages") -> bool:
        """Evict snapshots (by the store's policy) until `enough()` holds; False if it never does."""
        with self._lock:
            while not enough() and self._entries:
                self._remove(victim(self._entries, self.policy), reason)
            return enough()

    def clear(self) -> None:
        with self._lock:
            self._fetched.clear()
            for key in list(self._entries):
                self._remove(key, "cleared")

    def snapshots(self) -> list[Snapshot]:
        with self._lock:
            return list(self._entries.values())

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "entries": len(self._entries), "bytes": self.nbytes, "pages": self.pages_held}

    # --- persistence ----------------------------------------------------------------
    def save(self, directory: str | Path, read_pages: Callable | None = None) -> int:
        """Write every snapshot to `directory` (one file each, plus one file of the pages they
        name; written then renamed, owner-only). `read_pages(ids) -> (ks, vs)` reads pages from
        the device (numpy, tuples over attention layers) when snapshots name pages. Each snapshot
        names its pages by content digest, so a save cut short anywhere leaves no snapshot that
        would load with pages it was not saved with."""
        d = Path(directory)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        snaps = self.snapshots()
        page_ids = sorted({p for s in snaps for p in s.pages})
        if page_ids and read_pages is None:
            raise ValueError("these snapshots name KV pages: save needs read_pages")
        written = set()
        digest_of: dict[int, bytes] = {}
        if page_ids:
            ks, vs = read_pages(page_ids)
            ks, vs = tuple(np.asarray(k) for k in ks), tuple(np.asarray(v) for v in vs)
            digest_of = dict(zip(page_ids, page_digests(ks, vs)))
            name = f"{self.model_id}{PAGES_SUFFIX}"
            _write_file(d / name, {"version": FORMAT_VERSION, "model_id": self.model_id,
                                   "digests": [digest_of[p] for p in page_ids], "k": ks, "v": vs})
            written.add(name)
        for snap in snaps:
            name = hashlib.sha256(repr((self.model_id, snap.namespace, snap.tokens)).encode()).hexdigest()[:32] + FILE_SUFFIX
            _write_file(d / name, {
                "version": FORMAT_VERSION, "model_id": self.model_id, "namespace": snap.namespace,
                "kind": snap.kind, "tokens": np.array(snap.array),
                "cache": jax.tree_util.tree_map(np.asarray, snap.cache), "logits": np.asarray(snap.logits),
                "pages": [digest_of[p] for p in snap.pages],
            })
            written.add(name)
        for stale in self._files - written:  # ours, evicted since: never another model's files
            path = d / stale
            if path.is_file():
                path.unlink()
        self._files = written
        return len(snaps)

    def load(self, directory: str | Path, write_pages: Callable | None = None) -> int:
        """Load snapshots saved by `save` for this model; skip (with a warning) anything else,
        and any snapshot whose pages (by content digest) are not all in the pages file.
        `write_pages(ks, vs) -> ids` puts saved pages into the pool (each held once by the caller).
        Removes temporary files a save cut short left behind: call it with the directory locked
        (`DirectoryLock`), so that no other server is saving there."""
        d = Path(directory)
        if not d.is_dir():
            return 0
        remove_stale_temporaries(d)
        pages = self._load_pages(d / f"{self.model_id}{PAGES_SUFFIX}", write_pages)
        loaded = 0
        try:
            for path in sorted(d.glob("*" + FILE_SUFFIX)):
                if not path.is_file():
                    continue
                try:
                    p = _read_file(path)
                    if p.get("model_id") == self.model_id and p.get("version") != FORMAT_VERSION:
                        self._files.add(path.name)  # ours in an older format: the next save replaces it
                    if p.get("version") != FORMAT_VERSION or p.get("model_id") != self.model_id:
                        log.warning("prefix cache: %s belongs to another model or format; skipped", path.name)
                        continue
                    ids = tuple(pages.get(digest) for digest in p["pages"])
                    if None in ids:
                        log.warning("prefix cache: %s names pages that are not in %s%s (saved apart: a save cut "
                                    "short, or another server's); skipped", path.name, self.model_id, PAGES_SUFFIX)
                        self._files.add(path.name)  # stale: the next save deletes it
                        continue
                    cache = jax.tree_util.tree_map(jax.numpy.asarray, p["cache"])
                    # What survived before the restart survives it: no supersession while loading.
                    self.insert(p["tokens"].tolist(), cache, jax.numpy.asarray(p["logits"]), namespace=p["namespace"],
                                kind=p["kind"], supersede=False, pages=ids)
                    self._files.add(path.name)
                    loaded += 1
                except Exception as e:  # a corrupt file must never stop the server
                    log.warning("prefix cache: %s is unreadable (%s); skipped", path.name, e)
        finally:
            if pages and self._pool is not None:
                self._pool.release(list(pages.values()))  # the snapshots hold what they use; the rest is free again
        return loaded

    def remove_loaded_files(self, directory: str | Path) -> None:
        """Delete the files `load` read (ours: format 3), once their snapshots are kept elsewhere."""
        for name in self._files:
            (Path(directory) / name).unlink(missing_ok=True)
        self._files = set()

    def _load_pages(self, path: Path, write_pages: Callable | None) -> dict[bytes, int]:
        """digest -> pool id of every page in the pages file, the digests computed from the data."""
        if not path.is_file():
            return {}
        try:
            p = _read_file(path)
            if p.get("version") != FORMAT_VERSION or p.get("model_id") != self.model_id:
                raise ValueError("another model or format")
            if write_pages is None or self._pool is None:
                raise ValueError("no page pool to load pages into")
            self._files.add(path.name)
            ks, vs = tuple(p["k"]), tuple(p["v"])
            first: dict[bytes, int] = {}  # digest -> index of its first page (equal pages load once)
            for i, digest in enumerate(page_digests(ks, vs)):
                first.setdefault(digest, i)
            keep = list(first.values())
            ids = write_pages(tuple(k[keep] for k in ks), tuple(v[keep] for v in vs))
            return dict(zip(first, (int(i) for i in ids)))
        except Exception as e:
            log.warning("prefix cache: %s is unreadable (%s); snapshots that name pages are skipped", path.name, e)
            return {}


def shared_lengths(request: Tokens, snaps: Sequence[Snapshot]) -> list[int]:
    """The common prefix of `request` with each snapshot (its length where it is a prefix of the
    request). One numpy comparison per token array the snapshots share, not one per snapshot: a
    conversation's ~100 checkpoints at 28k tokens lie on about a dozen prompt arrays."""
    upto: dict[int, tuple[np.ndarray, int]] = {}  # id(array) -> (array, the longest snapshot on it)
    for s in snaps:
        base = s.key.base
        if s.length > upto.get(id(base), (None, 0))[1]:
            upto[id(base)] = (base, s.length)
    common = {i: len(request) if base is request.base else common_prefix(request.array, base[:n])
              for i, (base, n) in upto.items()}
    return [min(s.length, common.get(id(s.key.base), 0)) for s in snaps]


def page_digests(ks: Sequence[np.ndarray], vs: Sequence[np.ndarray]) -> list[bytes]:
    """SHA-256 of each page [i] of `ks`, `vs` (tuples over attention layers of [n, S, Hkv, Dh]):
    its K and V in every layer, with their dtypes and shapes. A snapshot names its pages by these."""
    out = []
    for i in range(len(ks[0]) if len(ks) else 0):
        h = hashlib.sha256()
        for a in (*ks, *vs):
            page = np.ascontiguousarray(a[i])
            h.update(f"{page.dtype.str}{page.shape}".encode())
            h.update(page.data)
        out.append(h.digest())
    return out


def remove_stale_temporaries(directory: Path) -> int:
    """Delete the temporary files (`*.snapshot.tmp`, `*.pages.tmp`) a save cut short left."""
    n = 0
    for suffix in (FILE_SUFFIX, PAGES_SUFFIX):
        for path in directory.glob("*" + suffix + TMP_SUFFIX):
            if path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)
                n += 1
    if n:
        log.info("prefix cache: removed %d temporary files a cut-short save left in %s", n, directory)
    return n


class DirectoryInUse(OSError):
    pass


class DirectoryLock:
    """An exclusive lock on a prefix-cache directory (flock on the directory itself, so a
    read-only directory can be locked too) for one server's life: a second server on the same
    directory gets `DirectoryInUse`. The kernel drops it when the process dies, so a server
    killed with -9 leaves no stale lock."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._fd: int | None = None
        self.acquire()

    def acquire(self) -> None:
        if self._fd is not None:
            return
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryInUse(f"the prefix cache directory {self.directory} is in use by another hybridjax "
                                 "server (one server per directory)") from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self):
        try:
            self.release()
        except Exception:  # at interpreter exit `os` may be gone; the kernel drops the lock anyway
            pass


def _write_file(path: Path, payload: dict, sync: bool = False) -> bytes:
    """MAGIC + sha256(body) + body, written to a temporary file (owner-only), fsync'd if `sync`
    (the disk tier's files must be durable before a manifest record names them), then renamed.
    Returns the body's SHA-256."""
    body = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    digest = hashlib.sha256(body).digest()
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + digest + body)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
        return digest
    except BaseException:  # a full disk, say: leave no temporary file behind
        tmp.unlink(missing_ok=True)
        raise


def _read_file(path: Path, digest: bytes | None = None) -> dict:
    """The payload of a `_write_file` file, its checksum verified (and equal to `digest` if given)."""
    data = path.read_bytes()
    head = len(MAGIC) + 32
    if len(data) < head or not data.startswith(MAGIC):
        raise ValueError("not a hybridjax snapshot file")
    if digest is not None and data[len(MAGIC):head] != digest:
        raise ValueError("not the file its record names (checksum differs)")
    if hashlib.sha256(data[head:]).digest() != data[len(MAGIC):head]:
        raise ValueError("checksum mismatch")
    payload = _SafeUnpickler(io.BytesIO(data[head:])).load()
    if not isinstance(payload, dict):
        raise ValueError("not a snapshot payload")
    return payload


class _SafeUnpickler(pickle.Unpickler):
    """Only numpy arrays and our cache dataclasses may come out of a snapshot file."""

    ALLOWED = {
        ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"), ("hybridjax.cache", "Cache"), ("hybridjax.cache", "GDNState"),
        ("hybridjax.cache", "KVState"), ("builtins", "tuple"),
        # Under pickle protocol 5 (what `save` writes) numpy rebuilds contiguous arrays with
        # `_frombuffer` (plain bytes + dtype + shape; object dtypes are refused by numpy), so
        # without it every saved snapshot was rejected on load.
        ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
    }

    # 16- and 8-bit floats (a bfloat16 model's pages and state) are ml_dtypes scalar types.
    ML_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float16"}

    def find_class(self, module, name):
        if ((module, name) in self.ALLOWED or module.startswith("numpy.dtypes")
                or (module == "ml_dtypes" and name in self.ML_DTYPES)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"forbidden class {module}.{name} in a snapshot file")


def model_identity(name: str, cfg, params) -> str:
    """A fingerprint of the model: config plus a digest of a few weights (cheap, stable)."""
    h = hashlib.sha256(repr(cfg).encode())
    h.update(name.encode())
    for leaf in jax.tree_util.tree_leaves(params)[:8]:
        if not leaf.is_fully_addressable:  # spans processes: read a local shard, launch nothing
            leaf = np.asarray(leaf.addressable_shards[0].data)
        elif all(d.platform == "cpu" for d in leaf.devices()):  # a view, no copy: slicing on the
            leaf = np.asarray(leaf)  # device was two compiled programs a leaf, 0.6 s of a warm start
        h.update(np.asarray(leaf.reshape(-1)[:4096]).tobytes())
    return h.hexdigest()[:24]


def history_boundary(tokenizer, messages: list[dict], prompt_ids: Sequence[int], **template_kwargs) -> int | None:
    """Tokens of the stable chat history: everything before the last user message, if the
    rendered prompt starts with it and it tokenizes to a prefix of `prompt_ids` (`template_kwargs`,
    e.g. tools, as the prompt was rendered with)."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if not last_user:
        return None
    try:
        head = tokenizer.render_chat(messages[:last_user], add_generation_prompt=False, **template_kwargs)
    except ValueError:
        return None
    ids = tokenizer.encode(head)
    if 0 < len(ids) < len(prompt_ids) and list(prompt_ids[: len(ids)]) == ids:
        return len(ids)
    return None

