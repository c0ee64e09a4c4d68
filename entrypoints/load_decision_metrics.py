"""Prometheus metrics of the load-or-recompute decision (engine/kv_transfer/load_cost.py), from
the stats snapshot the engine core sends with every step. Kept apart from metrics.py (vLLM's
names) and registered on its registry by the API server; nothing is exported without tiers."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class LoadDecisionCollector:
    def __init__(self, get_stats, model_name: str) -> None:
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self):
        d = self.get_stats().kv_load_decision
        if not d:
            return
        name = self.model_name
        decisions = CounterMetricFamily(
            "engine:kv_load_decisions", "Admissions with KV available from a tier, by what was done: load (all "
            "of it), partial (a first part loaded, the rest computed), recompute (none loaded).",
            labels=["model_name", "decision"])
        for decision, count in sorted(d["decisions"].items()):
            decisions.add_metric([name, decision], count)
        yield decisions
        tokens = CounterMetricFamily("engine:kv_load_decision_tokens", "Tokens available from a tier, loaded or "
                                     "computed instead.", labels=["model_name", "outcome"])
        tokens.add_metric([name, "loaded"], d["tokens_loaded"])
        tokens.add_metric([name, "recomputed"], d["tokens_recomputed"])
        yield tokens
        rates = GaugeMetricFamily("engine:kv_source_load_bytes_per_second", "Estimated load rate of each KV "
                                  "source (a seed until measured: measured=\"false\").",
                                  labels=["model_name", "source", "measured"])
        for source, r in sorted(d["sources"].items()):
            rates.add_metric([name, source, str(r["measured"]).lower()], r["bytes_per_s"])
        yield rates
        prefill = GaugeMetricFamily("engine:prefill_tokens_per_second", "Estimated prefill rate of a 256-token "
                                    "chunk after this many cached tokens (the fitted cost model).",
                                    labels=["model_name", "context_tokens"])
        for ctx, rate in sorted((d.get("prefill") or {}).get("tokens_per_s", {}).items(), key=lambda i: int(i[0])):
            if rate is not None:
                prefill.add_metric([name, ctx], rate)
        yield prefill
