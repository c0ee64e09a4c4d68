"""A trace that shows a slow request: P and D on hosts of their own (network namespaces,
tests/multihost.py), D's link rate-limited with tc tbf. The client's request goes through the
proxy; in the spans exported to a real OTLP/HTTP receiver (on the bridge, reachable from every
host), D's kv_pull span holds most of the time from the client's request to D's first token, with
the bytes pulled, the producer's address and a duration of bytes / rate.

Skipped with the reason where hosts cannot be made (not root, no iproute2); CI runs as root."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests import multihost
from tests.conftest import make_tiny_model
from tests.disagg_utils import ProxyProcess
from tests.otlp_receiver import OTLPReceiver
from tests.server_utils import REPO, ServerProcess

pytestmark = pytest.mark.skipif(multihost.unavailable() is not None, reason=str(multihost.unavailable()))

ARGS = ("--num-blocks", "512", "--max-model-len", "2048", "--served-model-name", "tiny")
KV_PORT = 14581
RATE_BITS = 2e6
PROMPT_TOKENS = 2000
BYTES_PER_TOKEN = 256  # the tiny model's KV: 2 layers x K,V x 2 heads x 16 dims x bf16


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, smollm2_dir):
    model = make_tiny_model(tmp_path_factory.mktemp("traced-llama"), "llama", tie_word_embeddings=True,
                            max_position_embeddings=2048)
    network = multihost.Network()
    servers = []
    receiver = None
    try:
        p_host, d_host = network.add("prefill"), network.add("decode")
        receiver = OTLPReceiver(host=network.client_address)
        secret = tmp_path_factory.mktemp("secret") / "secret"
        subprocess.run([sys.executable, "-m", "entrypoints.cli", "secret", str(secret)], cwd=REPO, check=True,
                       capture_output=True)
        common = (*ARGS, "--kv-secret-file", str(secret), "--otlp-traces-endpoint", receiver.url)
        env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
        prefill = ServerProcess(str(model), *common, "--role", "prefill", "--kv-port", str(KV_PORT),
                                "--kv-ip", p_host.address, host=p_host, wait=False, env=env)
        decode = ServerProcess(str(model), *common, "--role", "decode", host=d_host, wait=False, env=env)
        servers += [prefill, decode]
        for server in servers:
            server.wait_ready()
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
        try:
            proxy = ProxyProcess([prefill.url], [decode.url], "--kv-secret-file", str(secret),
                                 "--otlp-traces-endpoint", receiver.url)
        finally:
            del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
        servers.append(proxy)
        yield receiver, prefill, decode, proxy, d_host, p_host
    finally:
        for server in reversed(servers):
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait(10)
        if receiver is not None:
            receiver.close()
        network.close()


def test_the_pull_over_a_slow_link_holds_most_of_the_time_to_first_token(hosts):
    receiver, prefill, decode, proxy, d_host, p_host = hosts
    trace_id = "5" * 32
    prompt = [(i * 104729) % 30000 + 3 for i in range(PROMPT_TOKENS)]
    d_host.limit("2mbit", burst="16kb")
    try:
        resp = httpx.post(f"{proxy.url}/v1/completions", timeout=120,
                          headers={"traceparent": f"00-{trace_id}-{'6' * 16}-01"},
                          json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    finally:
        d_host.unlimit()
    assert resp.status_code == 200, resp.text
    wanted = {("engine-proxy", "proxy_request"), ("engine-decode", "kv_pull"), ("engine-decode", "first_step"),
              ("engine-prefill", "prefill")}
    spans = receiver.wait_for(lambda all_: wanted <= {(s.service, s.name) for s in all_ if s.trace_id == trace_id})
    mine = {(s.service, s.name): s for s in spans if s.trace_id == trace_id}
    proxy_span, pull = mine["engine-proxy", "proxy_request"], mine["engine-decode", "kv_pull"]
    first_step = mine["engine-decode", "first_step"]
    # Time to D's first token, as the client's request saw it: from the proxy's receipt to D's first step's end.
    ttft_d = (first_step.end_ns - proxy_span.start_ns) / 1e9
    assert pull.seconds > 0.5 * ttft_d, f"pull {pull.seconds:.2f}s of {ttft_d:.2f}s"
    expected = pull.attributes["engine.kv.bytes"] * 8 / RATE_BITS
    assert pull.attributes["engine.kv.bytes"] == PROMPT_TOKENS * BYTES_PER_TOKEN
    assert abs(pull.seconds - expected) <= 0.3 * expected, f"pull {pull.seconds:.2f}s, bytes/rate {expected:.2f}s"
    assert pull.attributes["engine.kv.peer"] == f"tcp://{p_host.address}:{KV_PORT}"
    assert pull.attributes["engine.kv.outcome"] == "ok"
    # Nothing else in the trace comes near it: P's prefill is a small part.
    assert mine["engine-prefill", "prefill"].seconds < 0.25 * pull.seconds
