"""Prometheus exposition of the engine's and the snapshot store's counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybridjax.prefix_report import REASONS

STORE_COUNTERS = {
    "lookups": "prefix-cache lookups",
    "hits": "lookups that found a cached prefix",
    "exact_hits": "lookups whose whole prompt was cached (no model call)",
    "tokens_reused": "prompt tokens served from snapshots",
    "tokens_prefilled": "prompt tokens run through the model",
    "inserts": "snapshots stored",
}


class _Collector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        for name, help_ in (("requests", "requests submitted"), ("tokens_generated", "tokens generated"),
                            ("steps", "batched decode steps"), ("rejected_queue_full", "requests refused: queue full"),
                            ("errors", "engine errors"),
                            ("background_prefills", "idle-time prefills of a next chat turn's prefix")):
            c = CounterMetricFamily(f"hybridjax_{name}", help_)
            c.add_metric([], e.counters.get(name, 0))
            yield c
        fin = CounterMetricFamily("hybridjax_requests_finished", "finished requests", labels=["reason"])
        for reason in ("stop", "length", "cancelled", "error"):
            fin.add_metric([reason], e.counters.get(f"finished_{reason}", 0))
        yield fin
        for name, value, help_ in (("queue_depth", e.queue_depth, "requests waiting for a slot"),
                                   ("active_slots", e.active_slots, "slots running a request"),
                                   ("slots", e.slots, "slots"),
                                   ("kv_pages", e.pool.num_pages, "pages in the KV pool"),
                                   ("kv_pages_free", e.pool.free, "free pages in the KV pool"),
                                   ("kv_page_tokens", e.pool.page_size, "tokens per KV page")):
            g = GaugeMetricFamily(f"hybridjax_{name}", help_)
            g.add_metric([], value)
            yield g
        if e.programs is not None:  # start-up, seen from outside: the programs compiled or loaded so far
            every = e.shapes() + e.score_shapes()
            for name, value, help_ in (("programs", len(every), "programs the engine runs (compiled ahead or behind)"),
                                       ("programs_ready", sum(map(e.programs.has, every)),
                                        "of which compiled or loaded so far")):
                g = GaugeMetricFamily(f"hybridjax_{name}", help_)
                g.add_metric([], value)
                yield g
        for name, help_ in (("prefill_chunks", "prefill calls"), ("tokens_prefilled", "prompt tokens run through the model")):
            c = CounterMetricFamily(f"hybridjax_{name}", help_)
            c.add_metric([], e.counters.get(name, 0))
            yield c
        yield _cache_reasons(e)
        if getattr(e, "speculative_tokens", 0):
            yield from _speculative(e)
        if e.store is None:
            return
        stats = e.store.stats()
        for name, help_ in STORE_COUNTERS.items():
            c = CounterMetricFamily(f"hybridjax_prefix_cache_{name}", help_)
            c.add_metric([], stats.get(name, 0))
            yield c
        ev = CounterMetricFamily("hybridjax_prefix_cache_evictions", "snapshots evicted", labels=["reason"])
        miss = CounterMetricFamily("hybridjax_prefix_cache_misses", "lookups with no cached prefix", labels=["reason"])
        for key, value in stats.items():
            if key.startswith("evictions_"):
                ev.add_metric([key[len("evictions_"):]], value)
            elif key.startswith("misses_"):
                miss.add_metric([key[len("misses_"):]], value)
        yield ev
        yield miss
        for name, value in (("bytes", stats["bytes"]), ("entries", stats["entries"]), ("pages", stats["pages"])):
            g = GaugeMetricFamily(f"hybridjax_prefix_cache_{name}", f"snapshot {name} held")
            g.add_metric([], value)
            yield g
        if e.store.disk is not None:
            yield from _disk(e.store.disk.stats())


def _disk(stats: dict):
    """The disk tier (hybridjax.snapshot_disk): what it holds, writes, serves and drops."""
    for name, help_ in (("snapshots_written", "snapshots written to disk"),
                        ("disk_hits", "snapshots read back from disk on a hit"),
                        ("disk_evictions", "snapshots evicted from disk by its budget"),
                        ("disk_read_errors", "disk snapshots dropped as unreadable (never served)")):
        c = CounterMetricFamily(f"hybridjax_prefix_cache_{name}", help_)
        c.add_metric([], stats.get(name, 0))
        yield c
    c = CounterMetricFamily("hybridjax_prefix_cache_not_persisted", "snapshots not written to disk",
                            labels=["reason"])
    for reason in ("backlog", "page_gone"):
        c.add_metric([reason], stats.get(f"not_persisted_{reason}", 0))
    yield c
    for name, key in (("disk_bytes", "disk_bytes"), ("disk_entries", "disk_entries")):
        g = GaugeMetricFamily(f"hybridjax_prefix_cache_{name}", f"snapshot {name.split('_')[1]} on disk")
        g.add_metric([], stats[key])
        yield g


def _cache_reasons(e):
    """Requests by their cache report's reason (hybridjax.prefix_report): why prefixes were not longer."""
    c = CounterMetricFamily("hybridjax_prefix_cache_requests", "requests by the reason their cached prefix "
                            "was not longer (see the cache report)", labels=["reason"])
    for reason in REASONS:
        c.add_metric([reason], e.counters.get(f"cache_reason_{reason}", 0))
    return c


def _speculative(e):
    """Speculative decoding: counters, and the two ratios a dashboard wants (acceptance rate =
    accepted / drafted; mean accepted length = tokens a row gains per verify, accepted drafts + 1)."""
    drafted, accepted = e.counters.get("spec_drafted_tokens", 0), e.counters.get("spec_accepted_tokens", 0)
    rows = drafted // e.speculative_tokens  # row-steps that drafted
    for name, value, help_ in (("drafted_tokens", drafted, "tokens drafted by the MTP head"),
                               ("accepted_tokens", accepted, "drafted tokens the model accepted"),
                               ("verify_steps", e.counters.get("spec_verify_steps", 0), "batched verify steps"),
                               ("verify_rows", rows, "rows verified (each drafted K tokens)"),
                               ("snapshots_skipped", e.counters.get("snapshots_skipped_speculative", 0),
                                "response snapshots skipped: the row ran past a host-side stop")):
        c = CounterMetricFamily(f"hybridjax_speculative_{name}", help_)
        c.add_metric([], value)
        yield c
    for name, value, help_ in (("tokens", e.speculative_tokens, "drafts per step (K)"),
                               ("acceptance_rate", accepted / drafted if drafted else 0.0, "accepted / drafted tokens"),
                               ("mean_accepted_length", 1 + accepted / rows if rows else 0.0,
                                "tokens a drafting row gains per verify step (accepted drafts + 1)")):
        g = GaugeMetricFamily(f"hybridjax_speculative_{name}", help_)
        g.add_metric([], value)
        yield g


def render_metrics(engine) -> str:
    registry = CollectorRegistry()
    registry.register(_Collector(engine))
    return generate_latest(registry).decode()
