"""Prometheus metrics, named like vLLM's with an `engine:` prefix.

Engine-side numbers (queue sizes, KV usage, prefix cache, preemptions, token totals) come from
the stats snapshot the engine core sends with every step; request latencies are measured here,
in the API server, where the client's clock starts.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.ipc import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)


class _EngineStatsCollector:
    def __init__(self, get_stats, model_name: str) -> None:
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self):
        s: EngineStats = self.get_stats()
        label = [self.model_name]
        gauges = [
            ("engine:num_requests_running", "Requests in the running batch.", s.num_running),
            ("engine:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("engine:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s.kv_cache_usage),
            ("engine:kv_blocks_total", "KV blocks in the pool.", s.num_blocks),
            ("engine:kv_blocks_free", "KV blocks not held by any request (cached ones included).",
             s.num_free_blocks),
            ("engine:kv_blocks_cached", "KV blocks holding a reusable prefix.", s.num_cached_blocks),
            ("engine:kv_blocks_held", "KV blocks of finished requests held for a KV transfer.", s.kv_blocks_held),
            ("engine:num_requests_waiting_for_remote_kv", "Requests parked until their KV arrives (of the waiting).",
             s.num_waiting_for_remote_kv),
            ("engine:num_requests_held_for_transfer", "Finished requests whose KV a transfer still reads.",
             s.num_held),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            yield g
        counters = [
            ("engine:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("engine:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("engine:num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions),
            ("engine:prompt_tokens", "Prompt tokens accepted.", s.prompt_tokens),
            ("engine:generation_tokens", "Tokens generated.", s.generation_tokens),
            ("engine:kv_transfer_bytes", "KV bytes sent to or received from peers.", s.kv_transfer_bytes),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            yield c
        failures = CounterMetricFamily("engine:kv_transfer_failures", "KV transfers that failed, by reason.",
                                       labels=["model_name", "reason"])
        for reason, count in sorted(s.kv_transfer_failures.items()):
            failures.add_metric([self.model_name, reason], count)
        yield failures
        refused = CounterMetricFamily("engine:kv_socket_auth_failures", "Messages the KV server refused from peers "
                                      "without the deployment secret, by reason.", labels=["model_name", "reason"])
        for reason, count in sorted(s.kv_auth_failures.items()):
            refused.add_metric([self.model_name, reason], count)
        yield refused
        tier_counters = [
            ("engine:kv_store_hits", "KV chunks loaded from a store tier.", "hits"),
            ("engine:kv_store_misses", "KV chunks looked up in a store tier and not found.", "misses"),
            ("engine:kv_store_stored_bytes", "KV bytes written to a store tier.", "bytes_stored"),
            ("engine:kv_store_loaded_bytes", "KV bytes loaded from a store tier.", "bytes_loaded"),
        ]
        for name, doc, field in tier_counters:
            c = CounterMetricFamily(name, doc, labels=["model_name", "tier"])
            for tier, t in sorted(s.kv_store.items()):
                c.add_metric([self.model_name, tier], getattr(t, field))
            yield c
        rejected = CounterMetricFamily("engine:kv_store_rejected", "KV store entries refused on read and deleted "
                                       "(bad_tag: forged or altered; corrupt; wrong_format).",
                                       labels=["model_name", "tier", "reason"])
        for tier, t in sorted(s.kv_store.items()):
            for reason, count in sorted(t.rejected.items()):
                rejected.add_metric([self.model_name, tier, reason], count)
        yield rejected
        used = GaugeMetricFamily("engine:kv_store_used_bytes", "Bytes a KV store tier holds.",
                                 labels=["model_name", "tier"])
        for tier, t in sorted(s.kv_store.items()):
            used.add_metric([self.model_name, tier], t.used_bytes)
        yield used


class ServerMetrics:
    def __init__(self, model_name: str, get_stats) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(get_stats, model_name))

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.ttft = hist("engine:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("engine:inter_token_latency_seconds", "Time between consecutive output deltas.")
        self.e2e = hist("engine:e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue_time = hist("engine:request_queue_time_seconds",
                               "Time from arrival until the engine accepted the request.")
        self.kv_transfer_seconds = hist("engine:kv_transfer_seconds", "Duration of one KV transfer.")
        self.kv_store_load_seconds = Histogram("engine:kv_store_load_seconds", "Time to load one KV chunk.",
                                               ["model_name", "tier"], buckets=_LATENCY_BUCKETS,
                                               registry=self.registry)
        self.success = Counter("engine:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)

    def observe_request(self, finish_reasons: list[str], ttft: float | None, itls: list[float], e2e: float,
                        queue_time: float) -> None:
        label = self.model_name
        if ttft is not None:
            self.ttft.labels(label).observe(ttft)
        for gap in itls:
            self.itl.labels(label).observe(gap)
        self.e2e.labels(label).observe(e2e)
        self.queue_time.labels(label).observe(queue_time)
        for reason in finish_reasons:
            self.success.labels(label, reason).inc()

    def observe_stats(self, stats: EngineStats) -> None:
        for seconds in stats.kv_transfer_seconds:
            self.kv_transfer_seconds.labels(self.model_name).observe(seconds)
        for tier, t in stats.kv_store.items():
            for seconds in t.load_seconds:
                self.kv_store_load_seconds.labels(self.model_name, tier).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
