"""Prometheus metrics: the engine's own (``engine:*``) and vLLM's (``vllm:*``) side by side.

One measurement per quantity feeds both names. Engine-side numbers (queue sizes, KV usage, prefix
cache, preemptions, KV transfers and store tiers) come from the stats snapshot the engine core
sends with every step; request latencies and token counts come from the front end's output
processor (engine/output_processor.py: IterationStats), which measures each sequence as vLLM's
front end does, with the request's clock started where the API server received it.

vLLM's names carry vLLM's meaning, types, labels (``model_name``, ``engine``: this instance has one
engine core, index "0"; ``finished_reason``) and bucket boundaries. The table below is vLLM 0.32's,
taken from its code: vllm/v1/metrics/loggers.py (PrometheusStatLogger: names, documentation,
labels, which bucket family) and vllm/v1/metrics/buckets.py (the boundaries); the meanings from
vllm/v1/metrics/stats.py. tests/fixtures/vllm_metrics/capture.py records it from vLLM itself and
tests/test_vllm_metrics.py holds this module to that record.

Where ours differ: ``engine:*`` latencies keep their own buckets, and count the requests a client
left (``engine:request_success_total{finished_reason="abort"}``, ``engine:e2e_request_latency_seconds``),
which vLLM counts nowhere. A prefill instance's hand-off (its request ends after the first token, a
decode instance continues it) is ``finished_reason="handed_off"`` in ours and ``"length"`` in
vLLM's, as vLLM's own prefill instance reports the one-token request its proxy sends it.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.ipc import EngineStats
from engine.output_processor import IterationStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)

# ---- vLLM 0.32 (vllm/v1/metrics/buckets.py) --------------------------------------------
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                                    10.0, 20.0, 40.0, 80.0)
# vLLM's FinishReason (vllm/v1/engine/__init__.py): every value is exported from the start, at 0.
VLLM_FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
VLLM_ENGINE = "0"  # vLLM's `engine` label: the engine core's index (one per instance here)
VLLM_LABELS = ["model_name", "engine"]


def vllm_request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's "request_tokens" family: 1, 2, 5, 10, 20, 50, ... up to max_model_len
    (buckets.py: build_1_2_5_buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


# name: (type, documentation) of the gauges and counters the stats snapshot feeds (loggers.py).
VLLM_ENGINE_FAMILIES = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prefix_cache_queries": ("counter", "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("counter", "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:num_preemptions": ("counter", "Cumulative number of preemption from the engine."),
}


class _EngineStatsCollector:
    def __init__(self, get_stats, model_name: str) -> None:
        self.get_stats = get_stats
        self.model_name = model_name

    def _counters_by(self, counters, label: str, stats_by: dict):
        """One counter family per (name, doc, field) of ``counters``, a sample per key of
        ``stats_by`` (labelled ``label``) with that stats object's ``field``."""
        for name, doc, field in counters:
            family = CounterMetricFamily(name, doc, labels=["model_name", label])
            for key, stats in sorted(stats_by.items()):
                family.add_metric([self.model_name, key], getattr(stats, field))
            yield family

    def collect(self):
        s: EngineStats = self.get_stats()
        label = [self.model_name]
        gauges = [
            ("engine:num_requests_running", "Requests in the running batch.", s.num_running),
            ("engine:num_requests_waiting", "Requests waiting to be scheduled (those waiting for their KV "
             "included).", s.num_waiting),
            ("engine:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s.kv_cache_usage),
            ("engine:kv_blocks_total", "KV blocks in the pool.", s.num_blocks),
            ("engine:kv_blocks_free", "KV blocks not held by any request (cached ones included).",
             s.num_free_blocks),
            ("engine:kv_blocks_cached", "KV blocks holding a reusable prefix.", s.num_cached_blocks),
            ("engine:kv_blocks_held", "KV blocks of finished requests held for a KV transfer.", s.kv_blocks_held),
            ("engine:num_requests_waiting_for_remote_kv", "Requests parked until their KV arrives (of the waiting).",
             s.num_waiting_for_remote_kv),
            ("engine:num_requests_held_for_transfer", "Finished requests whose KV a transfer still reads "
             "(a prefill instance's offers held).", s.num_held),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            yield g
        counters = [
            ("engine:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("engine:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("engine:num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions),
            ("engine:kv_transfer_bytes", "KV bytes sent to or received from peers.", s.kv_transfer_bytes),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            yield c
        # vLLM's names for the same numbers (one engine core: engine="0").
        vllm_values = {
            "vllm:num_requests_running": s.num_running,
            "vllm:num_requests_waiting": s.num_waiting,
            "vllm:kv_cache_usage_perc": s.kv_cache_usage,
            "vllm:prefix_cache_queries": s.prefix_cache_queries,
            "vllm:prefix_cache_hits": s.prefix_cache_hits,
            "vllm:num_preemptions": s.num_preemptions,
        }
        for name, (kind, doc) in VLLM_ENGINE_FAMILIES.items():
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=VLLM_LABELS)
            family.add_metric([self.model_name, VLLM_ENGINE], vllm_values[name])
            yield family
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
        # A decode instance's pulls by producer (its KV address), as /status kv_transfer.pulls.
        pull_counters = [
            ("engine:kv_pulls", "KV pulls from a prefill instance (those that timed out included).", "pulls"),
            ("engine:kv_pull_timeouts", "KV pulls from a prefill instance that timed out.", "timeouts"),
            ("engine:kv_pull_tokens", "Prompt tokens (whole blocks) pulled from a prefill instance.", "tokens"),
            ("engine:kv_pull_bytes", "KV bytes pulled from a prefill instance (completed pulls).", "bytes"),
            ("engine:kv_pull_seconds", "Seconds spent pulling KV from a prefill instance.", "seconds"),
        ]
        yield from self._counters_by(pull_counters, "peer", s.kv_pulls)
        tier_counters = [
            ("engine:kv_store_hits", "KV chunks loaded from a store tier.", "hits"),
            ("engine:kv_store_misses", "KV chunks looked up in a store tier and not found.", "misses"),
            ("engine:kv_store_stored_bytes", "KV bytes written to a store tier.", "bytes_stored"),
            ("engine:kv_store_loaded_bytes", "KV bytes loaded from a store tier.", "bytes_loaded"),
        ]
        yield from self._counters_by(tier_counters, "tier", s.kv_store)
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
    def __init__(self, model_name: str, get_stats, max_model_len: int | None = None) -> None:
        """``max_model_len``: bounds vLLM's per-request token histograms (left out without it)."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(get_stats, model_name))
        registry = self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=registry)

        def vllm_hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=registry).labels(model_name, VLLM_ENGINE)

        def vllm_counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, VLLM_LABELS, registry=registry).labels(model_name, VLLM_ENGINE)

        # ---- ours ----
        self.ttft = hist("engine:time_to_first_token_seconds", "Time from the request's arrival to a sequence's "
                         "first token.").labels(model_name)
        self.itl = hist("engine:inter_token_latency_seconds", "Time between a sequence's consecutive outputs "
                        "(engine-core steps).").labels(model_name)
        self.e2e = hist("engine:e2e_request_latency_seconds", "Time from the request's arrival to a sequence's end "
                        "(or its client leaving).").labels(model_name)
        self.queue_time = hist("engine:request_queue_time_seconds", "Time from the engine core's admission of a "
                               "sequence to its first schedule.").labels(model_name)
        self.kv_transfer_seconds = hist("engine:kv_transfer_seconds", "Duration of one KV transfer.")
        self.kv_store_load_seconds = Histogram("engine:kv_store_load_seconds", "Time to load one KV chunk.",
                                               ["model_name", "tier"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.success = Counter("engine:request_success", "Finished sequences by finish reason (abort: the client "
                               "left; handed_off: a prefill instance's hand-off).",
                               ["model_name", "finished_reason"], registry=registry)
        self.prompt_tokens = Counter("engine:prompt_tokens", "Prompt tokens of sequences that got their first "
                                     "output.", ["model_name"], registry=registry).labels(model_name)
        self.generation_tokens = Counter("engine:generation_tokens", "Tokens generated.", ["model_name"],
                                         registry=registry).labels(model_name)

        # ---- vLLM's (loggers.py) ----
        self.vllm_prompt_tokens = vllm_counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.vllm_generation_tokens = vllm_counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          VLLM_LABELS + ["finished_reason"], registry=registry)
        self.vllm_success = {reason: success.labels(model_name, VLLM_ENGINE, reason)
                             for reason in VLLM_FINISHED_REASONS}
        self.vllm_request_prompt_tokens = self.vllm_request_generation_tokens = None
        if max_model_len is not None:
            tokens_buckets = vllm_request_tokens_buckets(max_model_len)
            self.vllm_request_prompt_tokens = vllm_hist("vllm:request_prompt_tokens",
                                                        "Number of prefill tokens processed.", tokens_buckets)
            self.vllm_request_generation_tokens = vllm_hist("vllm:request_generation_tokens",
                                                            "Number of generation tokens processed.", tokens_buckets)
        self.vllm_ttft = vllm_hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                   VLLM_TIME_TO_FIRST_TOKEN_BUCKETS)
        self.vllm_itl = vllm_hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                  VLLM_INTER_TOKEN_LATENCY_BUCKETS)
        self.vllm_tpot = vllm_hist("vllm:request_time_per_output_token_seconds",
                                   "Histogram of time_per_output_token_seconds per request.",
                                   VLLM_INTER_TOKEN_LATENCY_BUCKETS)
        self.vllm_e2e = vllm_hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                  VLLM_REQUEST_LATENCY_BUCKETS)
        self.vllm_queue = vllm_hist("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    VLLM_REQUEST_LATENCY_BUCKETS)
        self.vllm_inference = vllm_hist("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        VLLM_REQUEST_LATENCY_BUCKETS)
        self.vllm_prefill = vllm_hist("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      VLLM_REQUEST_LATENCY_BUCKETS)
        self.vllm_decode = vllm_hist("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     VLLM_REQUEST_LATENCY_BUCKETS)

    def observe_requests(self, stats: IterationStats) -> None:
        """What the front end measured (engine/output_processor.py), under both names."""
        for ttft in stats.ttfts:
            self.ttft.observe(ttft)
            self.vllm_ttft.observe(ttft)
        for gap in stats.itls:
            self.itl.observe(gap)
            self.vllm_itl.observe(gap)
        if stats.prompt_tokens:
            self.prompt_tokens.inc(stats.prompt_tokens)
            self.vllm_prompt_tokens.inc(stats.prompt_tokens)
        if stats.generation_tokens:
            self.generation_tokens.inc(stats.generation_tokens)
            self.vllm_generation_tokens.inc(stats.generation_tokens)
        for f in stats.finished:
            self.success.labels(self.model_name, f.finish_reason).inc()
            self.e2e.observe(f.e2e)
            if f.queue_time is not None:
                self.queue_time.observe(f.queue_time)
            if f.client_abort:
                continue  # vLLM's front end records nothing of a request its client aborted
            reason = "length" if f.finish_reason == "handed_off" else f.finish_reason
            if reason in self.vllm_success:
                self.vllm_success[reason].inc()
            self.vllm_e2e.observe(f.e2e)
            for histogram, seconds in ((self.vllm_queue, f.queue_time), (self.vllm_prefill, f.prefill_time),
                                       (self.vllm_decode, f.decode_time), (self.vllm_inference, f.inference_time)):
                if seconds is not None:
                    histogram.observe(seconds)
            if f.time_per_output_token is not None:
                self.vllm_tpot.observe(f.time_per_output_token)
            if self.vllm_request_prompt_tokens is not None:
                self.vllm_request_prompt_tokens.observe(f.num_prompt_tokens)
                self.vllm_request_generation_tokens.observe(f.num_generation_tokens)

    def observe_stats(self, stats: EngineStats) -> None:
        for seconds in stats.kv_transfer_seconds:
            self.kv_transfer_seconds.labels(self.model_name).observe(seconds)
        for tier, t in stats.kv_store.items():
            for seconds in t.load_seconds:
                self.kv_store_load_seconds.labels(self.model_name, tier).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
