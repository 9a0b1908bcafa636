"""Prometheus exposition of the engine's and the snapshot store's counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
        for reason in ("stop", "length", "cancelled"):
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
        for name, help_ in (("prefill_chunks", "prefill calls"), ("tokens_prefilled", "prompt tokens run through the model")):
            c = CounterMetricFamily(f"hybridjax_{name}", help_)
            c.add_metric([], e.counters.get(name, 0))
            yield c
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


def render_metrics(engine) -> str:
    registry = CollectorRegistry()
    registry.register(_Collector(engine))
    return generate_latest(registry).decode()
