"""OpenTelemetry spans across engine proxy, the prefill and the decode instances (and the KV
transfer between them), exported over OTLP/HTTP: ``--otlp-traces-endpoint URL``, vLLM's flag.

One trace per request: the proxy continues the client's W3C ``traceparent`` (or starts a trace),
and passes its own span on to P and D in the same header, so each instance's ``llm_request`` span
is its child. An instance builds its spans when the request ends, from the timestamps the engine
core recorded for it (engine/request_trace.py: queue, prefill, KV loads and pulls, decode), as
vLLM's front end builds its request span from the core's timestamps; the core itself has no
OpenTelemetry. The SDK's own settings apply (``OTEL_TRACES_SAMPLER``, ``OTEL_SERVICE_NAME``,
``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, ...); a request whose span is not sampled is not traced in
the core either. Without the flag nothing here runs.

The packages are an optional extra (``pip install engine[otel]``); without them the flag is
refused at start, naming what to install (``check_available``).
"""
from __future__ import annotations

import contextvars
import importlib.util
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.kv_transfer.params import KVTransferParams
    from engine.request_trace import KVLoadTrace, SequenceTrace

# Module -> the package that provides it (what `engine[otel]` installs).
PACKAGES = {"opentelemetry.trace": "opentelemetry-api", "opentelemetry.sdk.trace": "opentelemetry-sdk",
            "opentelemetry.exporter.otlp.proto.http.trace_exporter": "opentelemetry-exporter-otlp-proto-http"}

_tracer = None  # set by init_tracer: tracing is on
_provider = None
# The proxy's span of the request being handled (its headers to P and D carry it).
_proxy_span: contextvars.ContextVar = contextvars.ContextVar("engine_proxy_span", default=None)


def check_available() -> None:
    """Raises SystemExit naming the missing packages, if any."""
    missing = []
    for module, package in PACKAGES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(package)
    if missing:
        raise SystemExit(f"--otlp-traces-endpoint needs the OpenTelemetry packages {', '.join(missing)}: "
                         "pip install 'engine[otel]'")


def init_tracer(endpoint: str, service_name: str, exporter=None) -> Any:
    """Turns tracing on for this process: spans go to ``endpoint`` over OTLP/HTTP (protobuf), in
    batches, or to ``exporter`` (tests: the SDK's in-memory exporter, synchronously). The
    service is ``service_name`` unless OTEL_SERVICE_NAME says otherwise."""
    global _tracer, _provider
    check_available()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))  # the sampler: OTEL_TRACES_SAMPLER
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _tracer, _provider = provider.get_tracer("engine"), provider
    return _tracer


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Exports what is still batched, then stops (a server's end)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


OFFSET_REFRESH_S = 10.0
_offset = (float("-inf"), 0)  # (when taken, wall clock minus monotonic clock in ns)


def wall_ns(monotonic: float) -> int:
    """A time.monotonic() of this host as the wall-clock nanoseconds spans are stamped with. One
    offset between the clocks, re-read every OFFSET_REFRESH_S (each reading of the two clocks
    differs by a little: converting every time with a fresh one would misorder adjacent spans)."""
    global _offset
    now = time.monotonic()
    if now - _offset[0] > OFFSET_REFRESH_S:
        _offset = (now, time.time_ns() - time.monotonic_ns())
    return _offset[1] + int(monotonic * 1e9)


def _context(headers) -> Any:
    from opentelemetry.propagate import extract
    return extract({k.lower(): v for k, v in headers.items()})


def _child(parent, name: str, start: float, end: float, attributes: dict) -> Any:
    from opentelemetry import trace
    span = _tracer.start_span(name, context=trace.set_span_in_context(parent), start_time=wall_ns(start),
                              attributes={k: v for k, v in attributes.items() if v is not None})
    span.end(end_time=wall_ns(max(start, end)))
    return span


# ---- engine proxy ----------------------------------------------------------------------
class ProxySpan:
    """The proxy's span of one client request, and its routing decision (a ``route`` child:
    the policy, the path taken and why, the instances chosen)."""

    def __init__(self, headers, received: float, policy: str) -> None:
        from opentelemetry.trace import SpanKind
        self.received, self.policy = received, policy
        self.span = _tracer.start_span("proxy_request", context=_context(headers), kind=SpanKind.SERVER,
                                       start_time=wall_ns(received))
        self.path = self.reason = None
        self.decided_at: float | None = None
        self.chosen: dict[str, str] = {}
        self._ended = False

    def decided(self, path: str, reason: str) -> None:
        self.path, self.reason, self.decided_at = path, reason, time.monotonic()

    def chose(self, role: str, url: str) -> None:
        self.chosen[role] = url

    def end(self, status: int) -> None:
        if self._ended:
            return
        self._ended = True
        now = time.monotonic()
        _child(self.span, "route", self.received, self.decided_at or now, {
            "engine.route.policy": self.policy, "engine.route.path": self.path or "replica",
            "engine.route.reason": self.reason, "engine.route.prefill_instance": self.chosen.get("prefill"),
            "engine.route.decode_instance": self.chosen.get("decode")})
        self.span.set_attribute("http.response.status_code", status)
        self.span.end(end_time=wall_ns(now))


def start_proxy_span(headers, received: float, policy: str) -> ProxySpan | None:
    """The proxy's span for a client request (None with tracing off), current until ended."""
    if _tracer is None:
        return None
    span = ProxySpan(headers, received, policy)
    _proxy_span.set(span)
    return span


async def traced_request(headers, policy: str, handle):
    """``await handle()`` (a router's handling of one client request) inside its span when
    tracing is on: ended with the response's status, or 500 when it raised."""
    span = start_proxy_span(headers, time.monotonic(), policy)
    if span is None:
        return await handle()
    try:
        response = await handle()
    except BaseException:
        span.end(500)
        raise
    return end_with_response(span, response)


def end_with_response(span: ProxySpan, response):
    """Ends ``span`` when ``response`` is sent: at once, or for a stream once its body ended."""
    from fastapi.responses import StreamingResponse
    if not isinstance(response, StreamingResponse):
        span.end(response.status_code)
        return response
    body = response.body_iterator

    async def ending():
        try:
            async for chunk in body:
                yield chunk
        finally:
            span.end(response.status_code)
    response.body_iterator = ending()
    return response


def current_proxy_span() -> ProxySpan | None:
    return _proxy_span.get()


def inject(headers: dict) -> dict:
    """``headers`` plus the traceparent of the proxy span being handled, if any (for P and D)."""
    span = _proxy_span.get()
    if span is None:
        return headers
    from opentelemetry import trace
    from opentelemetry.propagate import inject as otel_inject
    otel_inject(headers, context=trace.set_span_in_context(span.span))
    return headers


# ---- an instance (engine serve) ----------------------------------------------------------
class RequestSpans:
    """An instance's ``llm_request`` span of one HTTP request (vLLM's name and ``gen_ai.*``
    attributes), child of the caller's traceparent, and, when it ends, one set of children per
    sequence from the core's record (engine/request_trace.py)."""

    def __init__(self, headers, received: float, request_id: str, role: str, attributes: dict) -> None:
        from opentelemetry.trace import SpanKind
        self.received = received
        self.span = _tracer.start_span("llm_request", context=_context(headers), kind=SpanKind.SERVER,
                                       start_time=wall_ns(received))
        self.traced = self.span.is_recording()  # sampled: only then does the core record anything
        if self.traced:
            self.span.set_attributes({"gen_ai.request.id": request_id, "engine.role": role,
                                      **{k: v for k, v in attributes.items() if v is not None}})
        self.traces: dict[tuple[int, int], SequenceTrace] = {}  # (prompt, sequence) -> latest
        self._ended = False

    def record(self, prompt_index: int, traces: dict[int, SequenceTrace] | None) -> None:
        for index, trace in (traces or {}).items():
            self.traces[prompt_index, index] = trace

    def end(self, attributes: dict, offers: dict[int, KVTransferParams]) -> None:
        """Ends the request's span with ``attributes`` (usage, latencies, finish reasons);
        ``offers``: per prompt, the hand-off this instance answered with (a prefill's)."""
        if self._ended:
            return
        self._ended = True
        now = time.monotonic()
        if self.traced:
            self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})
            for (prompt, index), trace in sorted(self.traces.items()):
                _sequence_spans(self.span, trace, now, {"engine.prompt_index": prompt, "engine.sequence": index},
                                offers.get(prompt) if index == 0 else None)
        self.span.end(end_time=wall_ns(now))


def start_request_spans(headers, received: float, request_id: str, role: str,
                        attributes: dict) -> RequestSpans | None:
    return None if _tracer is None else RequestSpans(headers, received, request_id, role, attributes)


def _sequence_spans(parent, t: SequenceTrace, now: float, ids: dict, offer: KVTransferParams | None) -> None:
    finished = t.finished or now
    admitted = t.admitted or t.scheduled or finished
    _child(parent, "queue", t.arrival, admitted, {**ids, "gen_ai.latency.time_in_queue": admitted - t.arrival})
    for load in t.loads:
        _load_span(parent, load, ids)
    if t.prefill_tokens:
        start = t.scheduled or admitted
        end = t.first_token or finished
        tiers: dict[str, int] = {}
        for load in t.loads:
            for tier, counted in load.tiers.items():
                tiers[tier] = tiers.get(tier, 0) + counted.tokens
        _child(parent, "prefill", start, end, {
            **ids, "engine.prefill.chunks": t.prefill_chunks, "engine.prefill.tokens_computed": t.prefill_tokens,
            "engine.prefill.tokens_cached": t.cached_tokens, "engine.prefill.tokens_external": t.external_tokens,
            **{f"engine.prefill.tokens_from_{tier}": n for tier, n in tiers.items()},
            "gen_ai.usage.prompt_tokens": t.prompt_tokens, "gen_ai.latency.time_in_model_prefill": end - start})
    elif t.loads and t.first_token is not None:  # a decode instance: the KV came, then its first step
        arrived = max(load.end for load in t.loads)
        _child(parent, "first_step", arrived, t.first_token, {
            **ids, "engine.kv.tokens_external": t.external_tokens, "engine.prefill.tokens_cached": t.cached_tokens})
    if t.first_token is not None and t.finish_reason != "handed_off":  # (a prefill's ends at its first token)
        _child(parent, "decode", t.first_token, finished, {
            **ids, "engine.decode.tokens": t.decode_tokens, "engine.decode.preemptions": t.preemptions,
            "gen_ai.latency.time_in_model_decode": finished - t.first_token})
    if offer is not None and offer.do_remote_prefill and offer.remote_kv_addr:
        _child(parent, "kv_offer", finished, finished, {
            **ids, "engine.kv.offer.address": offer.remote_kv_addr, "engine.kv.offer.tokens": offer.num_tokens,
            "engine.kv.offer.expires_at": offer.expires_at or None,
            "engine.kv.offer.lease_s": (offer.expires_at - time.time()) if offer.expires_at else None})
    parent.set_attribute("engine.finish_reason" if not ids["engine.sequence"] else
                         f"engine.finish_reason.{ids['engine.sequence']}", t.finish_reason or "")


def _load_span(parent, load: KVLoadTrace, ids: dict) -> None:
    name = "kv_pull" if load.source == "p2p" else "kv_load"
    span = _child(parent, name, load.start, load.end, {
        **ids, "engine.kv.source": load.source, "engine.kv.tokens": load.tokens, "engine.kv.bytes": load.bytes,
        "engine.kv.seconds": load.end - load.start, "engine.kv.peer": load.peer,
        "engine.kv.attempts": load.attempts, "engine.kv.retries": load.attempts - 1,
        "engine.kv.outcome": load.outcome, "engine.kv.error": load.error})
    # Per tier, one child: what it supplied and the seconds its reads took (laid end to end from
    # the load's start, in lookup order: their sum is exact, their placement is not).
    at = load.start
    for tier, counted in load.tiers.items():
        _child(span, "kv_tier_load", at, at + counted.seconds, {
            **ids, "engine.kv.tier": tier, "engine.kv.chunks": counted.chunks, "engine.kv.tokens": counted.tokens,
            "engine.kv.bytes": counted.bytes, "engine.kv.seconds": counted.seconds})
        at += counted.seconds
