"""OpenTelemetry tracing (entrypoints/tracing.py, engine/request_trace.py).

- in process, with the SDK's in-memory exporter: a real engine core's record of a traced request
  becomes queue, prefill and decode spans under the request's span; the proxy's span passes the
  client's trace on; an unsampled request is not recorded by the core;
- end to end through a real OTLP/HTTP receiver (tests/otlp_receiver.py): `engine serve` continues
  the client's traceparent; a repeated prefix evicted from the device pool is loaded from the CPU
  tier, and its span names the tier; P, D and the proxy share one trace, P's and D's request spans
  children of the proxy's, D's pull span with its bytes and peer, P's offer with its lease;
- without the opentelemetry packages the flag is refused at start, by name.

The slowed pull (a rate-limited link between host namespaces) is in test_tracing_multihost.py."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine import LLM, SamplingParams
from entrypoints import tracing
from tests.disagg_utils import Disagg
from tests.otlp_receiver import OTLPReceiver
from tests.server_utils import REPO, ServerProcess

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # the batch exporter's delay, ms (5000 by default)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 3 for i in range(n)]


@pytest.fixture
def memory_tracer():
    exporter = InMemorySpanExporter()
    tracing.init_tracer("unused", "engine-test", exporter=exporter)
    yield exporter
    tracing.shutdown()


def _run_traced(llm: LLM, prompt: list[int], max_tokens: int, traced: bool) -> list:
    """The core's outputs of one request added with ``traced``."""
    core = llm.engine.core
    core.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), traced=traced)
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    return outputs


def test_a_real_core_records_a_traced_request_and_spans_are_built_from_it(tiny_llama, memory_tracer):
    llm = LLM(str(tiny_llama), num_blocks=64, long_prefill_token_threshold=64)
    try:
        outputs = _run_traced(llm, _prompt(1, 150), 5, traced=True)
        untraced = _run_traced(llm, _prompt(2, 150), 5, traced=False)
    finally:
        llm.shutdown()
    traces = [o.trace for o in outputs if o.trace is not None]
    assert len(traces) == 2  # with its first token and with its end, nothing in between
    trace = traces[-1]
    assert trace.prefill_chunks == 3 and trace.prefill_tokens == 150  # 64 + 64 + 22
    assert trace.arrival <= trace.admitted <= trace.scheduled <= trace.first_token <= trace.finished
    assert trace.decode_tokens == 5 and trace.finish_reason == "length"
    assert all(o.trace is None for o in untraced)

    spans = tracing.start_request_spans({"traceparent": TRACEPARENT}, trace.arrival, "r", "both", {})
    assert spans.traced
    spans.record(0, {0: trace})
    spans.end({"gen_ai.usage.completion_tokens": 5}, {})
    by_name = {s.name: s for s in memory_tracer.get_finished_spans()}
    root = by_name["llm_request"]
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert format(root.parent.span_id, "016x") == CLIENT_SPAN
    for name in ("queue", "prefill", "decode"):
        assert by_name[name].parent.span_id == root.context.span_id
    assert by_name["prefill"].attributes["engine.prefill.chunks"] == 3
    assert by_name["decode"].attributes["engine.decode.tokens"] == 5
    assert by_name["prefill"].end_time <= by_name["decode"].start_time
    assert root.attributes["engine.finish_reason"] == "length"


def test_the_proxy_span_continues_the_client_trace_and_is_passed_on(memory_tracer):
    span = tracing.start_proxy_span({"traceparent": TRACEPARENT}, 0.0, "least-loaded")
    headers = tracing.inject({"X-Request-Id": "x"})
    span.decided("remote", "long_prompt")
    span.chose("prefill", "http://p")
    span.end(200)
    by_name = {s.name: s for s in memory_tracer.get_finished_spans()}
    proxy = by_name["proxy_request"]
    assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{proxy.context.span_id:016x}-01"
    assert format(proxy.parent.span_id, "016x") == CLIENT_SPAN
    route = by_name["route"]
    assert route.parent.span_id == proxy.context.span_id
    assert dict(route.attributes) == {"engine.route.policy": "least-loaded", "engine.route.path": "remote",
                                      "engine.route.reason": "long_prompt", "engine.route.prefill_instance": "http://p"}


def test_an_unsampled_request_is_not_recorded(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")  # the SDK's own setting
    exporter = InMemorySpanExporter()
    tracing.init_tracer("unused", "engine-test", exporter=exporter)
    try:
        spans = tracing.start_request_spans({}, 0.0, "r", "both", {})
        assert not spans.traced  # so the core is not asked to record anything
        spans.end({}, {})
    finally:
        tracing.shutdown()
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize("command", [["serve", "MODEL"], ["proxy", "--instance", "http://127.0.0.1:1"]])
def test_the_flag_is_refused_without_the_packages(command, tiny_llama):
    """The SDK and the exporter not importable (the API is: FastAPI brings it): the process
    exits at once naming what to install."""
    argv = [str(tiny_llama) if a == "MODEL" else a for a in command] + ["--otlp-traces-endpoint", "http://x"]
    code = ("import sys; sys.modules['opentelemetry.sdk'] = sys.modules['opentelemetry.exporter'] = None\n"
            f"from entrypoints.cli import main; sys.exit(main({argv!r}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert ("opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http" in result.stderr
            and "engine[otel]" in result.stderr), result.stderr[-2000:]
    assert "KV cache" not in result.stderr  # refused before any model was loaded


# ---- end to end, through a real OTLP/HTTP receiver -------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama, receiver):
    server = ServerProcess(str(tiny_llama), "--num-blocks", "64", "--max-model-len", "1024", "--kv-chunk-tokens",
                           "32", "--kv-store", "cpu:64MiB", "--served-model-name", "tiny",
                           "--otlp-traces-endpoint", receiver.url, env=FAST_EXPORT)
    yield server
    server.stop()


def _complete(url: str, prompt: list[int], max_tokens: int = 4, headers: dict | None = None) -> httpx.Response:
    resp = httpx.post(f"{url}/v1/completions", timeout=60, headers=headers or {}, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp


def _spans_of(receiver: OTLPReceiver, trace_id: str, names: set[str]) -> dict:
    spans = receiver.wait_for(lambda all_: names <= {s.name for s in all_ if s.trace_id == trace_id})
    return {s.name: s for s in spans if s.trace_id == trace_id}


def test_serve_continues_the_client_traceparent(server, receiver):
    _complete(server.url, _prompt(3, 100), headers={"traceparent": TRACEPARENT})
    spans = _spans_of(receiver, CLIENT_TRACE, {"llm_request", "queue", "prefill", "decode"})
    root = spans["llm_request"]
    assert root.parent_id == CLIENT_SPAN and root.service == "engine-both" and root.kind == 2  # SERVER
    for name in ("queue", "prefill", "decode"):
        assert spans[name].parent_id == root.span_id
        assert root.start_ns <= spans[name].start_ns <= spans[name].end_ns <= root.end_ns
    assert root.attributes["gen_ai.usage.prompt_tokens"] == 100
    assert root.attributes["gen_ai.usage.completion_tokens"] == 4
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert spans["prefill"].attributes["engine.prefill.tokens_computed"] == 100


def test_the_span_names_the_validated_client_id_not_a_raw_header(server, receiver):
    """The body's request_id wins over X-Request-Id; the header, unchecked then, must not reach
    the span (an exporter would carry whatever a client put there, 8,000 characters of it here)."""
    trace_id = "7" * 32
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                      headers={"traceparent": f"00-{trace_id}-{'8' * 16}-01", "X-Request-Id": "x" * 8000},
                      json={"prompt": _prompt(9, 20), "max_tokens": 2, "request_id": "mine"})
    assert resp.status_code == 200, resp.text
    root = _spans_of(receiver, trace_id, {"llm_request"})["llm_request"]
    assert root.attributes["engine.client_request_id"] == "mine"


def test_a_request_the_engine_refuses_still_has_its_span(server, receiver):
    """A request the engine core refuses after the span began (here: D-style conditional
    admission, 409, its prompt longer than the caller's max_local_prefill_tokens) ends its span
    with the status and the reason: the traces operators need most are the failing ones."""
    trace_id = "5" * 32
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                      headers={"traceparent": f"00-{trace_id}-{'6' * 16}-01"},
                      json={"prompt": _prompt(7, 100), "max_tokens": 2,
                            "kv_transfer_params": {"max_local_prefill_tokens": 8}})
    assert resp.status_code == 409, resp.text
    root = _spans_of(receiver, trace_id, {"llm_request"})["llm_request"]
    assert root.attributes["http.response.status_code"] == 409
    assert "error.type" in root.attributes


def test_a_tier_hit_has_a_load_span_naming_its_tier(server, receiver):
    """A prefix computed once, pushed out of the 64-block device pool by two other prompts, comes
    back from the CPU tier: the request's kv_load span has a kv_tier_load child for tier cpu."""
    prompt = _prompt(4, 150)
    _complete(server.url, prompt, max_tokens=1)
    for seed in (5, 6):  # 2 x 480 tokens: more than the pool holds beside it
        _complete(server.url, _prompt(seed, 480), max_tokens=1)
    server.wait_idle()
    trace_id = "1" * 32
    resp = _complete(server.url, prompt, max_tokens=2, headers={"traceparent": f"00-{trace_id}-{'2' * 16}-01"})
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    spans = _spans_of(receiver, trace_id, {"llm_request", "kv_load", "kv_tier_load", "prefill"})
    load, tier = spans["kv_load"], spans["kv_tier_load"]
    assert tier.parent_id == load.span_id and load.parent_id == spans["llm_request"].span_id
    assert tier.attributes["engine.kv.tier"] == "cpu"
    assert tier.attributes["engine.kv.chunks"] >= 1 and tier.attributes["engine.kv.bytes"] > 0
    assert tier.attributes["engine.kv.tokens"] == load.attributes["engine.kv.tokens"] > 0
    assert load.attributes["engine.kv.outcome"] == "ok" and load.attributes["engine.kv.source"] == "tiers"
    assert load.start_ns <= tier.start_ns <= tier.end_ns <= load.end_ns
    prefill = spans["prefill"].attributes
    assert prefill["engine.prefill.tokens_from_cpu"] == load.attributes["engine.kv.tokens"]
    # What the pool and the tier held is what the client is told was cached; the rest computed.
    assert prefill["engine.prefill.tokens_cached"] + prefill["engine.prefill.tokens_external"] == cached
    assert prefill["engine.prefill.tokens_external"] == load.attributes["engine.kv.tokens"]
    assert prefill["engine.prefill.tokens_computed"] == 150 - cached


@pytest.fixture(scope="module")
def disagg(tiny_llama, receiver):
    flag = ("--otlp-traces-endpoint", receiver.url)
    saved = {k: os.environ.get(k) for k in FAST_EXPORT}
    os.environ.update(FAST_EXPORT)  # for the proxy, which takes no env of its own
    try:
        deployment = Disagg(str(tiny_llama), "--num-blocks", "64", "--max-model-len", "1024", *flag, proxy_args=flag)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    yield deployment
    deployment.proxy.stop()
    deployment.prefill.stop()
    deployment.decode.stop()


def test_one_trace_across_proxy_prefill_and_decode(disagg, receiver):
    trace_id = "3" * 32
    _complete(disagg.url, _prompt(7, 200), headers={"traceparent": f"00-{trace_id}-{'4' * 16}-01"})
    spans = receiver.wait_for(lambda all_: {("engine-proxy", "proxy_request"), ("engine-prefill", "llm_request"),
                                            ("engine-decode", "llm_request"), ("engine-decode", "kv_pull")}
                              <= {(s.service, s.name) for s in all_ if s.trace_id == trace_id})
    mine = {(s.service, s.name): s for s in spans if s.trace_id == trace_id}
    proxy, route = mine["engine-proxy", "proxy_request"], mine["engine-proxy", "route"]
    p, d = mine["engine-prefill", "llm_request"], mine["engine-decode", "llm_request"]
    assert proxy.parent_id == "4" * 16  # the client's span
    assert route.parent_id == p.parent_id == d.parent_id == proxy.span_id
    assert route.attributes["engine.route.path"] == "remote"
    assert route.attributes["engine.route.prefill_instance"] == disagg.prefill.url
    assert route.attributes["engine.route.decode_instance"] == disagg.decode.url
    offer, pull = mine["engine-prefill", "kv_offer"], mine["engine-decode", "kv_pull"]
    assert offer.parent_id == p.span_id and pull.parent_id == d.span_id
    assert pull.attributes["engine.kv.peer"] == offer.attributes["engine.kv.offer.address"]
    assert pull.attributes["engine.kv.bytes"] > 0 and pull.attributes["engine.kv.outcome"] == "ok"
    assert pull.attributes["engine.kv.retries"] == 0
    assert 0 < offer.attributes["engine.kv.offer.lease_s"] <= 120
    assert p.end_ns <= pull.start_ns  # D pulls what P offered
    first_step = mine["engine-decode", "first_step"]
    assert pull.end_ns <= first_step.end_ns and first_step.parent_id == d.span_id
    assert d.attributes["engine.finish_reason"] == "length" and p.attributes["engine.role"] == "prefill"
