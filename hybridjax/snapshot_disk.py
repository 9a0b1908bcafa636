"""The prefix cache's disk tier: snapshots written as they are stored, kept past eviction and crashes.

Layout (snapshot format 4), one folder per model under the cache directory, `<dir>/<model_id>/`:

    manifest       append-only records: MAGIC, then each record as REC_MAGIC + length + SHA-256 + body
    pages/<hex>    one KV page (K and V of every attention layer), named by its content digest
                   (prefix_cache.page_digests): written once, whoever names it
    states/<hex>   one snapshot's recurrent state and logits, named by its key (namespace, tokens)

The engine thread hands each stored snapshot to `DiskTier.stored`: the pages it names that are not
known yet are gathered on the device then (in dispatch order, so a later step's donation cannot
change them) and a writer thread writes the files (each fsync'd, then renamed into place), then
appends one `put` record per snapshot to the manifest and fsyncs it. A record is appended only
after the files it names are durable, so a kill -9 loses at most what the writer had not finished
(about the last batch) and never leaves a record naming missing or partial files. At start-up the
manifest is read up to its first bad record (a torn tail is ignored, with a warning), the records
whose files are gone are dropped, files no record names are deleted, and the manifest is rewritten
with the live records only (atomically: written, fsync'd, renamed); it is also rewritten while
serving when dead records outnumber live ones.

A snapshot evicted from memory stays on disk; a lookup (`fetch`) that finds a longer prefix on
disk than in memory reads it back (files checked: their SHA-256, the page digests recomputed, the
tokens and namespace the state file was written for), and the store puts it back in memory. The
disk tier has its own byte budget, evicted by the store's policy (GDSF score or LRU); a page is
deleted once no record names it. Supersession (a conversation that moved on) deletes on disk too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import pickle
import queue
import struct
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from hybridjax.eviction import gdsf, victim
from hybridjax.prefix_cache import TMP_SUFFIX, _read_file, _write_file, page_digests

log = logging.getLogger("hybridjax.prefix_cache")

FORMAT_VERSION = 4
MAGIC = b"HJXMANIF"  # the manifest's first bytes; its first record says the format and model
REC_MAGIC = b"HJXR"
_REC_HEAD = struct.Struct("<4sI32s")  # magic, body length, SHA-256 of the body
MAX_BACKLOG = 512  # snapshots waiting for the writer; past it new ones are not persisted (counted)
PAGE_CHUNK = 8  # pages per device read or write: few programs to compile at start-up (1, 2, 4, 8 pages)
COMPACT_AFTER = 64  # the writer rewrites the manifest once dead records outnumber live ones and this


class FormatRefused(ValueError):
    """The directory holds a manifest this version does not read: it is left untouched."""


# --- the manifest: pure encoding and decoding ----------------------------------------------------
def encode_record(record: dict) -> bytes:
    body = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    return _REC_HEAD.pack(REC_MAGIC, len(body), hashlib.sha256(body).digest()) + body


class _PlainUnpickler(pickle.Unpickler):
    """Records hold only plain values (dict, list, tuple, str, bytes, int, float): no class at all."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"forbidden class {module}.{name} in a manifest record")


def decode_records(data: bytes) -> tuple[list[dict], int]:
    """(records, bytes they span) from a manifest's contents after MAGIC: reading stops at the first
    record that is cut short or fails its checksum (a torn tail; nothing after it is trusted)."""
    out, pos = [], 0
    while pos + _REC_HEAD.size <= len(data):
        magic, n, digest = _REC_HEAD.unpack_from(data, pos)
        body = data[pos + _REC_HEAD.size: pos + _REC_HEAD.size + n]
        if magic != REC_MAGIC or len(body) != n or hashlib.sha256(body).digest() != digest:
            break
        try:
            record = _PlainUnpickler(io.BytesIO(body)).load()
        except Exception:
            break
        if not isinstance(record, dict):
            break
        out.append(record)
        pos += _REC_HEAD.size + n
    return out, pos


def key_name(model_id: str, namespace: str, tokens: Sequence[int]) -> str:
    return hashlib.sha256(repr((model_id, namespace, tuple(tokens))).encode()).hexdigest()[:32]


# --- the index of what is on disk ------------------------------------------------------------------
@dataclasses.dataclass
class DiskEntry:
    name: str
    namespace: str
    kind: str
    tokens: tuple[int, ...]
    state_sha: bytes  # SHA-256 of the state file's body (its own header says the same)
    state_bytes: int
    pages: tuple[bytes, ...]  # page digests, in order
    page_bytes: int  # bytes of one page file
    hits: int = 0
    priority: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes as if it shared nothing (GDSF's cost)."""
        return self.state_bytes + len(self.pages) * self.page_bytes

    def record(self) -> dict:
        return {"op": "put", "name": self.name, "namespace": self.namespace, "kind": self.kind,
                "tokens": np.asarray(self.tokens, np.int32).tobytes(), "state_sha": self.state_sha,
                "state_bytes": self.state_bytes, "pages": list(self.pages), "page_bytes": self.page_bytes}

    @classmethod
    def from_record(cls, r: dict) -> "DiskEntry":
        return cls(r["name"], r["namespace"], r["kind"], tuple(np.frombuffer(r["tokens"], np.int32).tolist()),
                   r["state_sha"], int(r["state_bytes"]), tuple(r["pages"]), int(r["page_bytes"]))


class DiskIndex:
    """Entries (in least-recently-used order) and how many entries name each page."""

    def __init__(self, policy: str):
        self.policy = policy
        self.entries: OrderedDict[str, DiskEntry] = OrderedDict()
        self.page_refs: Counter = Counter()
        self.page_size: dict[bytes, int] = {}
        self.clock = 0.0  # GDSF's clock on disk
        self.nbytes = 0  # state files plus distinct page files


    def add(self, e: DiskEntry) -> None:
        e.priority = gdsf(self.clock, e.hits, len(e.tokens), e.nbytes)
        self.entries[e.name] = e
        self.nbytes += e.state_bytes
        for p in e.pages:
            if not self.page_refs[p]:
                self.nbytes += e.page_bytes
            self.page_refs[p] += 1
            self.page_size[p] = e.page_bytes

    def remove(self, name: str, evicted: bool = False) -> tuple[DiskEntry, list[bytes]] | None:
        """Drop an entry: (it, the pages no entry names any more), or None if absent."""
        e = self.entries.pop(name, None)
        if e is None:
            return None
        if evicted:
            self.clock = max(self.clock, e.priority)
        dead = []
        self.nbytes -= e.state_bytes
        for p in e.pages:
            self.page_refs[p] -= 1
            if self.page_refs[p] <= 0:
                self.nbytes -= self.page_size.pop(p)
                del self.page_refs[p]
                dead.append(p)
        return e, dead

    def touch(self, e: DiskEntry) -> None:
        e.hits += 1
        e.priority = gdsf(self.clock, e.hits, len(e.tokens), e.nbytes)
        self.entries.move_to_end(e.name)

    def longest(self, tokens: tuple, namespace: str, longer_than: int) -> DiskEntry | None:
        best = None
        for e in self.entries.values():
            n = len(e.tokens)
            if (e.namespace == namespace and longer_than < n <= len(tokens) and (best is None or n > len(best.tokens))
                    and tokens[:n] == e.tokens):
                best = e
        return best

    def victim(self) -> str:
        return victim(self.entries, self.policy)


# --- pages read from the device, written by the writer -----------------------------------------------
class _PageRead:
    """One gather of pages from the device (dispatched by the engine thread); the writer computes
    their digests once and drops the arrays after writing them."""

    def __init__(self, arrays, n: int):
        self.arrays, self.n = arrays, n  # (ks, vs): tuples over pools of [>= n, S, Hkv, Dh]
        self.digests: list[bytes] | None = None
        self.host: tuple | None = None  # (ks, vs) numpy, until the writer has written them

    def materialize(self) -> bool:
        """Digests (and host copies) computed once; False if the data was dropped before that."""
        if self.digests is None:
            if self.arrays is None:
                return False
            ks, vs = self.arrays
            ks = tuple(np.asarray(k)[: self.n] for k in ks)
            vs = tuple(np.asarray(v)[: self.n] for v in vs)
            self.host, self.digests, self.arrays = (ks, vs), page_digests(ks, vs), None
        return True

    def drop(self) -> None:
        self.arrays = self.host = None


@dataclasses.dataclass
class _Put:
    name: str
    namespace: str
    kind: str
    tokens: tuple[int, ...]
    cache: object
    logits: object
    pages: list[tuple[_PageRead, int]]


def buckets(limit: int) -> list[int]:
    """Page counts the device reads and writes are padded to (powers of two up to `limit`)."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit] if limit else out


def _pad(ids: list[int], sizes: list[int]) -> list[int]:
    """`ids` repeated at its last id up to the next size (a page read or written twice is the same)."""
    n = next((s for s in sizes if s >= len(ids)), len(ids))
    return list(ids) + [ids[-1]] * (n - len(ids))


class DiskTier:
    """Write-through persistence and the disk tier of one store (see the module docstring).

    `device`: the engine (`read_pages_async(ids)`, `write_pages(ids, ks, vs)`, `pages_per_row`);
    its methods run on the engine thread only, as do `stored`, `released` and `fetch`."""

    def __init__(self, directory: str | Path, model_id: str, device, *, max_bytes: int, policy: str = "gdsf"):
        self.root = Path(directory) / model_id
        self.model_id, self.device, self.max_bytes = model_id, device, max_bytes
        self.index = DiskIndex(policy)
        self.counters: Counter = Counter()
        self._lock = threading.Lock()  # the index: the writer changes it, the engine thread reads it
        self._known: dict[int, tuple[_PageRead, int]] = {}  # pool page id -> its read (engine thread)
        self._queue: queue.Queue = queue.Queue()
        self._dead_records = 0
        self._failed = False
        self._sizes = buckets(min(getattr(device, "pages_per_row", 0), PAGE_CHUNK))
        pool = getattr(device, "pool", None)
        self.page_tokens = pool.page_size if pool is not None else 0  # pages of another size cannot load
        self._open()
        self._manifest = open(self.root / "manifest", "ab")
        self._thread = threading.Thread(target=self._run, name="hybridjax-snapshot-writer", daemon=True)
        self._thread.start()

    # --- start-up --------------------------------------------------------------------------
    def _open(self) -> None:
        for sub in ("pages", "states"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.root / "manifest"
        data = path.read_bytes() if path.is_file() else b""
        if data and not data.startswith(MAGIC):
            raise FormatRefused(f"{path} is not a hybridjax snapshot manifest; move it away to use this directory")
        records, used = decode_records(data[len(MAGIC):])
        header = records[0] if records else None
        if header is not None and (header.get("op") != "header" or header.get("version") != FORMAT_VERSION
                                   or header.get("model_id") != self.model_id):
            raise FormatRefused(f"{path} is snapshot format {header.get('version')} for {header.get('model_id')}; "
                                f"this server reads format {FORMAT_VERSION} for {self.model_id}: move it away")
        if header is not None and header.get("page_tokens") != self.page_tokens:
            raise FormatRefused(f"{path} holds KV pages of {header.get('page_tokens')} tokens; this server's pages "
                                f"hold {self.page_tokens}: serve with --page-size {header.get('page_tokens')}, or "
                                "move the directory away")
        torn = len(data) - len(MAGIC) - used if data else 0
        if torn:
            log.warning("prefix cache: %s ends in %d bytes of a cut-short record (a crash mid-write); "
                        "ignored, the %d records before it are kept", path, torn, max(len(records) - 1, 0))
        pages = {p.name for p in (self.root / "pages").iterdir()}
        states = {p.name for p in (self.root / "states").iterdir()}
        dead = 0
        for r in records[1:]:
            if r.get("op") == "put":
                e = DiskEntry.from_record(r)
                self.index.remove(e.name)
                self.index.add(e)
            elif r.get("op") == "del":
                dead += 2 if self.index.remove(r["name"]) is not None else 1
        # Files are checked for the records that survive the replay only: a put that a later del
        # undid has rightly lost its files (the writer deletes them once the del is durable).
        gone = [e.name for e in self.index.entries.values()
                if e.name not in states or not all(p.hex() in pages for p in e.pages)]
        for name in gone:
            self.index.remove(name)
        if gone:
            log.warning("prefix cache: %d snapshot records in %s name files that are gone; dropped", len(gone), path)
        self._collect(pages, states)
        freed: list[Path] = []
        self._enforce_budget(freed)
        if header is None or torn or gone or dead or freed:
            self._rewrite()  # the live records only; durable before the files its evictions free are deleted
        for f in freed:
            f.unlink(missing_ok=True)
        self.counters["restored_records"] = len(self.index.entries)

    def _collect(self, pages: set[str], states: set[str]) -> None:
        """Delete files no live record names (a write cut short, an entry deleted) and temporaries."""
        live_pages = {p.hex() for p in self.index.page_refs}
        live_states = set(self.index.entries)
        n = 0
        for sub, names, live in (("pages", pages, live_pages), ("states", states, live_states)):
            for name in names - live:
                (self.root / sub / name).unlink(missing_ok=True)
                n += 1
        for tmp in self.root.glob("manifest*" + TMP_SUFFIX):
            tmp.unlink(missing_ok=True)
        if n:
            log.info("prefix cache: removed %d files no snapshot record names from %s", n, self.root)

    def _rewrite(self) -> None:
        """The manifest with the live records only: written aside, fsync'd, renamed (atomic)."""
        path = self.root / "manifest"
        tmp = path.with_name("manifest" + TMP_SUFFIX)
        body = MAGIC + encode_record({"op": "header", "version": FORMAT_VERSION, "model_id": self.model_id,
                                      "page_tokens": self.page_tokens})
        with self._lock:  # a hit may reorder the entries meanwhile
            live = list(self.index.entries.values())
        body += b"".join(encode_record(e.record()) for e in live)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        _fsync_dir(self.root)
        self._dead_records = 0

    # --- the engine thread -----------------------------------------------------------------
    def stored(self, snap) -> None:
        """Queue `snap` (just stored in memory) for writing; its new pages are read now."""
        if self._failed:
            return
        if self._queue.qsize() >= MAX_BACKLOG:
            self.counters["not_persisted_backlog"] += 1
            return
        unknown = [p for p in dict.fromkeys(snap.pages) if p not in self._known]
        for at in range(0, len(unknown), PAGE_CHUNK):
            chunk = unknown[at: at + PAGE_CHUNK]
            read = _PageRead(self.device.read_pages_async(_pad(chunk, self._sizes)), len(chunk))
            for i, p in enumerate(chunk):
                self._known[p] = (read, i)
        self._queue.put(_Put(key_name(self.model_id, snap.namespace, snap.tokens), snap.namespace, snap.kind,
                             snap.tokens, snap.cache, snap.logits, [self._known[p] for p in snap.pages]))

    def released(self, page: int) -> None:
        """No stored snapshot names pool page `page` any more: its id may soon hold other data."""
        self._known.pop(page, None)

    def superseded(self, namespace: str, tokens: tuple) -> None:
        """The conversation moved past this snapshot: delete it on disk too."""
        if not self._failed:
            self._queue.put(("del", key_name(self.model_id, namespace, tokens)))

    def fetch(self, tokens: tuple, namespace: str, longer_than: int):
        """The longest snapshot on disk in `namespace` that is a prefix of `tokens` and longer than
        `longer_than`, read and checked: (entry, cache, logits, ks, vs) with numpy arrays, or None."""
        with self._lock:
            e = self.index.longest(tokens, namespace, longer_than)
            if e is None:
                return None
            self.index.touch(e)
        try:
            payload = _read_file(self.root / "states" / e.name, digest=e.state_sha)
            if (payload.get("tokens") is None or tuple(payload["tokens"].tolist()) != e.tokens
                    or payload.get("namespace") != e.namespace or payload.get("model_id") != self.model_id):
                raise ValueError("the state file was written for another snapshot")
            ks, vs = [], []
            for digest in e.pages:
                page = _read_file(self.root / "pages" / digest.hex())
                k, v = tuple(page["k"]), tuple(page["v"])
                if page_digests(tuple(x[None] for x in k), tuple(x[None] for x in v)) != [digest]:
                    raise ValueError(f"page {digest.hex()[:12]} does not match its digest")
                ks.append(k)
                vs.append(v)
        except Exception as err:  # gone or damaged: never served; the record goes
            log.warning("prefix cache: the disk snapshot %s is unreadable (%s); dropped", e.name, err)
            self.counters["disk_read_errors"] += 1
            self._queue.put(("del", e.name))
            return None
        self.counters["disk_hits"] += 1
        layers = len(ks[0]) if ks else 0
        ks = tuple(np.stack([p[i] for p in ks]) for i in range(layers))
        vs = tuple(np.stack([p[i] for p in vs]) for i in range(layers))
        return e, payload["cache"], payload["logits"], ks, vs

    def write_pages(self, ids: list[int], ks, vs) -> None:
        """Pages `ids` of the device pool := ks, vs (in chunks padded to a compiled size by repetition)."""
        for at in range(0, len(ids), PAGE_CHUNK):
            chunk = list(ids[at: at + PAGE_CHUNK])
            padded = _pad(chunk, self._sizes)
            extra = len(padded) - len(chunk)

            def part(a):
                a = a[at: at + PAGE_CHUNK]
                return np.concatenate([a, np.repeat(a[-1:], extra, axis=0)]) if extra else a

            self.device.write_pages(padded, tuple(part(k) for k in ks), tuple(part(v) for v in vs))

    def warm(self) -> None:
        """Compile the padded page reads and writes now, before serving (a page read and written
        back unchanged), so that persisting never compiles on a live request."""
        for n in self._sizes:
            ks, vs = self.device.read_pages_async([0] * n)
            self.device.write_pages([0] * n, tuple(np.asarray(k) for k in ks), tuple(np.asarray(v) for v in vs))

    # --- the writer thread -----------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is durable."""
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout)

    def close(self) -> None:
        if self._thread.is_alive():
            self.flush()
            self._queue.put(None)
            self._thread.join()
        self._manifest.close()

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "disk_entries": len(self.index.entries), "disk_bytes": self.index.nbytes}

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            flushes = [item[1] for item in batch if isinstance(item, tuple) and item[0] == "flush"]
            stop = any(item is None for item in batch)
            work = [item for item in batch if item is not None and not (isinstance(item, tuple) and item[0] == "flush")]
            if work and not self._failed:
                try:
                    self._write_batch(work)
                except Exception as err:  # a full or read-only disk: one line, then memory only
                    self._failed = True
                    log.error("prefix cache: could not write snapshots to %s: %s; persistence is off until restart",
                              self.root, err)
            for done in flushes:
                done.set()
            if stop:
                return

    def _write_batch(self, work: list) -> None:
        """Write the files of each put (fsync'd), append its record, then the del records (the
        disk budget's too), fsync the manifest, and only then delete the files they free."""
        t0 = time.perf_counter()
        records, dead_files = [], []
        for item in work:
            if isinstance(item, _Put):
                entry = self._write_put(item)
                if entry is not None:
                    with self._lock:
                        self.index.add(entry)
                    records.append(entry.record())
            else:
                records += self._delete(item[1], dead_files, evicted=False)
        records += self._enforce_budget(dead_files)
        if not records:
            return
        _fsync_dir(self.root / "pages")
        _fsync_dir(self.root / "states")
        self._manifest.write(b"".join(encode_record(r) for r in records))
        self._manifest.flush()
        os.fsync(self._manifest.fileno())
        self.counters["records_written"] += len(records)
        self.counters["batches"] += 1
        self.counters["write_seconds"] += time.perf_counter() - t0
        for path in dead_files:
            path.unlink(missing_ok=True)
        with self._lock:
            live = len(self.index.entries)
        if self._dead_records > max(COMPACT_AFTER, live):
            self._manifest.close()
            self._rewrite()
            self._manifest = open(self.root / "manifest", "ab")
            self.counters["manifest_rewrites"] += 1

    def _write_put(self, item: _Put) -> DiskEntry | None:
        """Write the pages `item` names that are not on disk, then its state file (each fsync'd):
        its index entry, or None if it is on disk already or its page data is gone."""
        reads = {id(read): read for read, _ in item.pages}.values()
        if not all(read.materialize() for read in reads):
            self.counters["not_persisted_page_gone"] += 1
            return None
        try:
            with self._lock:
                if item.name in self.index.entries:
                    return None  # on disk already (equal by construction)
            digests, page_size = [], 0
            for read, i in item.pages:
                digest = read.digests[i]
                digests.append(digest)
                path = self.root / "pages" / digest.hex()
                if digest not in self.index.page_refs or not path.is_file():
                    if read.host is None:  # written and dropped, then deleted on disk since
                        self.counters["not_persisted_page_gone"] += 1
                        return None
                    _write_file(path, {"k": tuple(k[i] for k in read.host[0]), "v": tuple(v[i] for v in read.host[1])},
                                sync=True)
                    self.counters["pages_written"] += 1
                    self.counters["bytes_written"] += path.stat().st_size
                page_size = path.stat().st_size
            payload = {"version": FORMAT_VERSION, "model_id": self.model_id, "namespace": item.namespace,
                       "kind": item.kind, "tokens": np.asarray(item.tokens, np.int32),
                       "cache": jax.tree_util.tree_map(np.asarray, item.cache), "logits": np.asarray(item.logits)}
            state_path = self.root / "states" / item.name
            sha = _write_file(state_path, payload, sync=True)
            self.counters["bytes_written"] += state_path.stat().st_size
        finally:
            for read in reads:  # the digests stay: a later snapshot naming these pages finds them on disk
                read.drop()
        self.counters["snapshots_written"] += 1
        return DiskEntry(item.name, item.namespace, item.kind, tuple(item.tokens), sha, state_path.stat().st_size,
                         tuple(digests), page_size)

    def _delete(self, name: str, dead_files: list, evicted: bool) -> list[dict]:
        with self._lock:
            gone = self.index.remove(name, evicted=evicted)
        if gone is None:
            return []
        _, pages = gone
        dead_files.append(self.root / "states" / name)
        dead_files += [self.root / "pages" / p.hex() for p in pages]
        self._dead_records += 2  # its put and this del
        self.counters["disk_evictions" if evicted else "disk_deletes"] += 1
        return [{"op": "del", "name": name}]

    def _enforce_budget(self, dead_files: list) -> list[dict]:
        records = []
        while True:
            with self._lock:
                if not self.index.entries or self.index.nbytes <= self.max_bytes:
                    return records
                name = self.index.victim()
            records += self._delete(name, dead_files, evicted=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def attach_disk(engine, directory: str | Path) -> DiskTier:
    """Open `directory`'s disk tier for `engine`'s store (locked by the caller: `DirectoryLock`) and
    write every snapshot stored from now on. Snapshots an earlier version saved at shutdown
    (format 3 files) are read, verified as before, and written again in format 4; then their
    files go. Call before the engine starts."""
    store = engine.store
    tier = DiskTier(directory, store.model_id, engine, max_bytes=store.disk_bytes, policy=store.policy)
    try:
        tier.warm()
        store.set_disk(tier)
        old = engine.load_snapshots(directory)
        if old:
            tier.flush()
            store.remove_loaded_files(directory)
            log.info("prefix cache: converted %d snapshots of format 3 in %s to format %d", old, directory,
                     FORMAT_VERSION)
    except BaseException:
        store.set_disk(None)
        tier.close()
        raise
    return tier


def detach_disk(engine) -> DiskTier | None:
    """Make everything stored so far durable and stop writing (the engine is stopped)."""
    tier = engine.store.set_disk(None)
    if tier is not None:
        tier.close()
    return tier
