"""P, two D's and the proxy on separate hosts (network namespaces with their own hostnames and
addresses: tests/multihost.py), started as the multi-host recipe in docs/disaggregation.md
says: one deployment secret copied to every host, the KV port on the host's own address, with
and without --kv-encrypt. The test process is a client host without the secret.

- P->D across hosts gives a single instance's answers, the KV pulled over TCP;
- the client can neither pull a prefill's KV, nor make the decode instance connect anywhere, nor
  read its KV events;
- the link to P cut in the middle of a 2k-token pull: the answer is still right (recomputed
  within the decode's deadline), and once the link is back both sides end idle;
- the proxy's link to one decode host cut: every request is answered by the other, the
  streamed ones showing P's first token once;
- D's host gone (killed, unplugged) in the middle of a pull: P frees the KV by itself;
- the proxy's hand-offs avoid a decode host behind a slow link, once it has seen a pull cross it;
- over a rate-limited link the second token (D's first) comes bytes / rate after P's first;
- a Redis tier on its own host partitioned away: skipped within its timeout, back with the link;
- P's host gone after its answer: D loads the prompt from the shared Redis tier instead.

Skipped with the reason where hosts cannot be made (not root, no iproute2); CI runs as root."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_transfer.p2p import LoadSpec, P2PMetadata
from engine.kv_transfer.p2p_worker import P2PConnectorWorker
from engine.kv_transfer.secret import load_kv_secret
from engine.kv_transfer.params import token_digest
from tests import multihost
from tests.conftest import make_tiny_model
from tests.disagg_utils import ProxyProcess
from tests.server_utils import REPO, ServerProcess, wait_for
from tests.stress.workload import assert_invariants
from tests.test_kv_events import _Subscriber

pytestmark = pytest.mark.skipif(multihost.unavailable() is not None, reason=str(multihost.unavailable()))

ARGS = ("--num-blocks", "512", "--max-model-len", "2048", "--served-model-name", "tiny")
KV_PORT = 14579
LOAD_TIMEOUT_S = 5
LEASE_S = 4
PROXY_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with a 2k context (2k-token prompts)."""
    return make_tiny_model(tmp_path_factory.mktemp("multihost-llama"), "llama", tie_word_embeddings=True,
                           max_position_embeddings=2048)


@pytest.fixture(scope="module")
def single(model):
    llm = LLM(str(model), num_blocks=512, max_model_len=2048)
    yield lambda prompt: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                      use_tqdm=False)[0].outputs[0].text
    llm.shutdown()


class Deployment:
    """The README's recipe on three hosts: `engine secret` once, the file copied to each host."""

    def __init__(self, model, tmp_path, encrypt: bool) -> None:
        self.network = multihost.Network()
        self.servers: list = []
        try:
            self.p_host, self.d_host, self.d2_host, self.x_host = (
                self.network.add(n) for n in ("prefill", "decode", "decode2", "proxy"))
            made = self.secret = _new_secret(tmp_path / "secret")
            secrets = {}
            for host in (self.p_host, self.d_host, self.d2_host, self.x_host):
                (tmp_path / host.name).mkdir()
                secrets[host.name] = str(shutil.copy(made, tmp_path / host.name / "secret"))
            extra = ("--kv-encrypt",) if encrypt else ()
            self.prefill = ServerProcess(
                str(model), *ARGS, "--role", "prefill", "--kv-port", str(KV_PORT), "--kv-ip", self.p_host.address,
                "--kv-lease-s", str(LEASE_S), "--kv-secret-file", secrets["prefill"], *extra,
                host=self.p_host, wait=False)
            self.servers.append(self.prefill)
            self.decode, self.decode2 = (ServerProcess(
                str(model), *ARGS, "--role", "decode", "--kv-load-timeout-s", str(LOAD_TIMEOUT_S),
                "--kv-events", "--kv-secret-file", secrets[host.name], *extra, host=host, wait=False)
                for host in (self.d_host, self.d2_host))
            self.servers += [self.decode, self.decode2]
            for server in self.servers:
                server.wait_ready()
            self.proxy = ProxyProcess([self.prefill.url], [self.decode.url, self.decode2.url], "--kv-secret-file",
                                      secrets["proxy"], "--timeout", str(PROXY_TIMEOUT_S), host=self.x_host)
            self.servers.append(self.proxy)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        for server in reversed(self.servers):
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait(10)
        self.network.close()


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "encrypted"])
def deployment(request, model, tmp_path_factory):
    deployment = Deployment(model, tmp_path_factory.mktemp("hosts"), encrypt=request.param)
    yield deployment
    deployment.close()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 3 for i in range(n)]


def _complete(url: str, prompt: list[int], **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra})


def test_p_to_d_across_hosts_equals_a_single_instance(deployment, single):
    for n in (5, 300, 2000):
        prompt = _prompt(n, n)
        resp = _complete(deployment.proxy.url, prompt)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["choices"][0]["text"] == single(prompt)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == n  # pulled, not recomputed
    # Over TCP between the hosts' own addresses (their hostnames differ: no same-host ipc path).
    params = _complete(deployment.prefill.url, _prompt(1, 40),
                       kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
    assert params["remote_kv_addr"] == f"tcp://{deployment.p_host.address}:{KV_PORT}"
    assert params["remote_host_id"].startswith("prefill/")
    httpx.post(f"{deployment.prefill.url}/v1/kv/release", json={"kv_transfer_params": params}, timeout=10)
    assert deployment.decode.status()["kv_transfer"]["bytes"] + deployment.decode2.status()["kv_transfer"]["bytes"] > 0
    for server in (deployment.prefill, deployment.decode, deployment.decode2):
        assert_invariants(server)


def test_a_client_without_the_secret_cannot_pull_or_steer(deployment):
    prompt = _prompt(2, 300)
    params = _complete(deployment.prefill.url, prompt,
                       kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
    # Pull: the client knows where the KV is, its request id and its tokens, but not the secret.
    stranger = P2PConnectorWorker("stranger", "any", "127.0.0.1", None)
    try:
        stranger.register_kv_caches(torch.zeros(2, 2, 64, 16, 2, 16))
        stranger.start_load_kv(P2PMetadata(loads=[LoadSpec(
            "steal", params["remote_kv_addr"], params["remote_request_id"], 0, list(range(19)),
            time.monotonic() + 5, token_digest(prompt))]))
        deadline = time.monotonic() + 15
        while True:
            out = stranger.get_finished()
            if out.finished_recving or out.failed_recving:
                break
            assert time.monotonic() < deadline, "the stranger's pull neither failed nor finished"
            time.sleep(0.05)
        assert out.failed_recving == {"steal"} and not out.finished_recving, out
    finally:
        stranger.shutdown()
    # Steer: unsigned parameters pointing the decode instance at the client's own address.
    listener = socket.socket()
    listener.bind((deployment.network.client_address, 0))
    listener.listen()
    listener.settimeout(2)
    forged = {"do_remote_prefill": True, "remote_kv_addr": f"tcp://{deployment.network.client_address}:"
              f"{listener.getsockname()[1]}", "remote_request_id": "x", "num_tokens": len(prompt),
              "token_digest": token_digest(prompt)}
    resp = _complete(deployment.decode.url, prompt, kv_transfer_params=forged)
    assert resp.status_code == 400 and "signature" in resp.text, resp.text
    with pytest.raises(socket.timeout):
        listener.accept()  # nobody came
    listener.close()
    # Read the KV event stream (which tells what every instance caches): nothing, where a
    # subscriber with the secret gets the replay.
    info = deployment.decode.status()["kv_events"]
    ports = [int(info[k].rsplit(":", 1)[1]) for k in ("endpoint", "replay_endpoint")]
    assert info["endpoint"].startswith(f"tcp://{deployment.d_host.address}:")
    stranger_sub = _Subscriber(*ports, host=deployment.d_host.address)
    insider = _Subscriber(*ports, secret=load_kv_secret(str(deployment.secret)), host=deployment.d_host.address)
    try:
        assert stranger_sub.replayed(0, timeout_ms=1500) is None
        assert insider.replayed(0) is not None
    finally:
        stranger_sub.close()
        insider.close()
    # The real hand-off is untouched: the decode instance, which has the secret, pulls it whole.
    resp = _complete(deployment.decode.url, prompt, kv_transfer_params=params)
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 300
    assert_invariants(deployment.prefill)
    assert_invariants(deployment.decode)


def test_the_link_to_the_prefill_cut_mid_pull_recomputes_within_the_deadline(deployment, single):
    """The pull of a 2k-token prompt's KV runs over a 1 Mbit/s link (several seconds); the link
    is cut once D waits for it. D gives up at its deadline and computes the prompt itself."""
    prompt = _prompt(3, 2000)
    answer: list[httpx.Response] = []
    deployment.p_host.limit("1mbit", burst="16kb")
    try:
        started = time.monotonic()
        client = threading.Thread(target=lambda: answer.append(_complete(deployment.proxy.url, prompt)))
        client.start()
        wait_for(lambda: _waiting_for_kv(deployment) == 1, timeout=60)
        deployment.p_host.cut()
        client.join(LOAD_TIMEOUT_S + 60)
        assert answer, "no answer"
        assert time.monotonic() - started < LOAD_TIMEOUT_S + 60
        resp = answer[0]
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == single(prompt)
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed
        assert deployment.decode.status()["kv_transfer"]["failures"] or deployment.decode2.status()["kv_transfer"]["failures"]
    finally:
        deployment.p_host.plug()
        deployment.p_host.unlimit()
    # Once the link is back both sides end idle (P's send is abandoned or its lease ends).
    assert_invariants(deployment.decode)
    assert_invariants(deployment.decode2)
    assert_invariants(deployment.prefill, timeout=LEASE_S + 30)


def _waiting_for_kv(deployment) -> int:
    return sum(s.status()["requests"]["waiting_for_remote_kv"] for s in (deployment.decode, deployment.decode2))


def _streamed_text(url: str, prompt: list[int]) -> str:
    text = ""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += event["choices"][0]["text"]
    return text


def test_a_decode_host_cut_off_from_the_proxy_leaves_the_other_to_answer(deployment, single):
    """The proxy's connections to decode2 time out (no refusal: the link is down). The first
    request that tries it pays the connect timeout and goes to the other decode; the rest go
    there at once. Streamed answers show P's first token once, whichever decode continues.
    (A request written to an idle pooled connection at the moment of the cut may have reached
    D, so it is never resent: it waits for the proxy's --timeout. The proxy drops idle
    connections after 2 s; the test starts after that.)"""
    deployment.d2_host.cut()
    time.sleep(2.5)
    try:
        started = time.monotonic()
        for i in range(4):
            prompt = _prompt(10 + i, 200)
            if i % 2:
                assert _streamed_text(deployment.proxy.url, prompt) == single(prompt)
            else:
                resp = _complete(deployment.proxy.url, prompt)
                assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == single(prompt), resp.text
        assert time.monotonic() - started < 4 * 5 + 10  # at most one connect timeout (5 s) paid
    finally:
        deployment.d2_host.plug()
    wait_for(lambda: deployment.decode2.status()["requests"]["in_flight_http"] == 0, timeout=30)
    for server in (deployment.prefill, deployment.decode, deployment.decode2):
        assert_invariants(server)


def _pulls(server) -> dict:
    return server.status()["kv_transfer"]["pulls"]


def _paths(deployment) -> dict[str, float | None]:
    """The proxy's estimate per decode url: seconds per 1k tokens pulled from the prefill."""
    status = httpx.get(f"{deployment.proxy.url}/status", timeout=10).json()
    return {p["decode"]: p["seconds_per_1k_tokens"] for p in status["transfer_paths"]}


def test_the_proxy_sends_hand_offs_around_a_slow_link(deployment, single):
    """decode2's link limited to 2 Mbit/s: a 1000-token prompt's KV takes about 1 s there and
    next to nothing to decode. Once the proxy has seen a pull over each path (the decode
    instances' pull totals, which it polls), its hand-offs go to decode, though both are idle."""
    fast, slow = deployment.decode, deployment.decode2
    seeds = iter(range(100, 200))

    def served(n: int) -> None:
        for _ in range(n):
            prompt = _prompt(next(seeds), 1000)
            resp = _complete(deployment.proxy.url, prompt)
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == single(prompt), resp.text

    def slow_path_seen() -> bool:
        estimates = _paths(deployment)
        known = estimates.get(fast.url), estimates.get(slow.url)
        return None not in known and known[1] > 5 * known[0]

    deployment.d2_host.limit("2mbit", burst="16kb")
    try:
        for _ in range(10):  # until a pull has crossed the slow link and the proxy has polled
            if slow_path_seen():
                break
            served(1)
            time.sleep(1.5)
        assert slow_path_seen(), (httpx.get(f"{deployment.proxy.url}/status").json(), _pulls(fast), _pulls(slow))
        before = sum(p["pulls"] for p in _pulls(slow).values())
        served(6)
        assert sum(p["pulls"] for p in _pulls(slow).values()) == before, _paths(deployment)
    finally:
        deployment.d2_host.unlimit()
    for server in (deployment.prefill, fast, slow):
        assert_invariants(server)


def test_the_second_token_comes_bytes_over_rate_after_the_first(deployment):
    """Both decode links limited to 2 Mbit/s (about 2 s for this prompt's KV): the streamed answer's first token is P's (the link
    plays no part in it), and the second, D's first, comes after the pull: within 20% of the
    bytes D pulled divided by the link's rate."""
    rate_bits = 2e6
    decodes = (deployment.decode, deployment.decode2)
    for host in (deployment.d_host, deployment.d2_host):
        host.limit("2mbit", burst="16kb")
    try:
        before = {s.url: sum(p["bytes"] for p in _pulls(s).values()) for s in decodes}
        arrived = []
        body = {"prompt": _prompt(300, 2000), "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{deployment.proxy.url}/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                # Text only: D's stream opens with an empty event as soon as it has the request.
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    arrived.append(time.monotonic())
        pulled = sum(sum(p["bytes"] for p in _pulls(s).values()) - before[s.url] for s in decodes)
    finally:
        for host in (deployment.d_host, deployment.d2_host):
            host.unlimit()
    assert pulled == 2000 * 256  # the tiny model's KV: 2 layers x K,V x 2 heads x 16 dims x bf16
    expected = pulled * 8 / rate_bits
    gap = arrived[1] - arrived[0]
    assert abs(gap - expected) <= 0.2 * expected, f"1st->2nd token {gap:.2f}s, bytes/rate {expected:.2f}s"
    for server in decodes:
        assert_invariants(server)


def test_the_decode_host_gone_mid_pull_leaves_the_prefill_clean(deployment):
    """Last (it takes the decode host down): D's processes killed and its link unplugged in the
    middle of a slow pull, so neither P's socket nor the proxy's connection hears a FIN. P
    abandons the send and frees the KV; the client gets an error at the proxy's deadline."""
    prompt = _prompt(4, 2000)
    deployment.d_host.limit("1mbit", burst="16kb")
    deployment.d2_host.limit("1mbit", burst="16kb")
    answer: list = []
    client = threading.Thread(target=lambda: answer.append(_complete_or_error(deployment.proxy.url, prompt)))
    client.start()
    pulling: list = []

    def pull_started() -> bool:
        for server, host in ((deployment.decode, deployment.d_host), (deployment.decode2, deployment.d2_host)):
            if server.status()["requests"]["waiting_for_remote_kv"]:
                pulling.append((server, host))
                return True
        return False
    wait_for(pull_started, timeout=60)
    victim, host = pulling[0]
    gone = time.monotonic()
    host.cut()
    victim.kill()
    assert_invariants(deployment.prefill, timeout=LEASE_S + 30)
    client.join(PROXY_TIMEOUT_S + 30)
    assert answer and time.monotonic() - gone < PROXY_TIMEOUT_S + 30
    assert answer[0] in (502, 504), answer  # the proxy's error (D unreachable or past its deadline)


def _complete_or_error(url: str, prompt: list[int]):
    try:
        return _complete(url, prompt).status_code
    except httpx.HTTPError as exc:
        return exc


def _redis_on(host) -> subprocess.Popen:
    """A redis-server on ``host``'s address (no persistence: the tests' data only)."""
    return subprocess.Popen(host.command(
        ["redis-server", "--bind", host.address, "--port", "6379", "--save", "", "--appendonly", "no",
         "--protected-mode", "no"]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _new_secret(path):
    """A deployment secret made as the recipe says (engine secret PATH)."""
    subprocess.run([sys.executable, "-m", "entrypoints.cli", "secret", str(path)], cwd=REPO, check=True,
                   capture_output=True)
    return path


def test_redis_partitioned_away_is_skipped_and_comes_back(model, single, tmp_path):
    """A shared Redis tier on its own host, the engine on another. The link to Redis is cut (no
    refusal: calls hang until their 1 s timeout): the engine keeps answering, right and without
    stalling, the tier off; once the link is back the tier turns on again and stores."""
    network = multihost.Network()
    redis_proc = engine = None
    try:
        redis_host, engine_host = network.add("redis"), network.add("engine")
        redis_proc = _redis_on(redis_host)
        secret = _new_secret(tmp_path / "secret")
        engine = ServerProcess(str(model), *ARGS, "--kv-store", f"redis://{redis_host.address}:6379/0",
                               "--kv-chunk-tokens", "64", "--kv-secret-file", str(secret), host=engine_host)
        stored = lambda: engine.status()["kv_store"]["redis"]["bytes_stored"]  # noqa: E731
        first = _prompt(20, 300)
        assert _complete(engine.url, first).json()["choices"][0]["text"] == single(first)
        wait_for(lambda: stored() > 0, timeout=30, state=engine.status)
        redis_host.cut()
        try:
            for i, prompt in enumerate([first, _prompt(21, 300), _prompt(22, 300)]):
                started = time.monotonic()
                resp = _complete(engine.url, prompt)
                assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == single(prompt)
                assert time.monotonic() - started < 10, f"request {i} stalled on the cut-off Redis"
            wait_for(lambda: "unavailable" in engine.log_path.read_text(), timeout=30)
        finally:
            redis_host.plug()
        wait_for(lambda: "is back" in engine.log_path.read_text(), timeout=30)
        before = stored()
        later = _prompt(23, 300)
        assert _complete(engine.url, later).json()["choices"][0]["text"] == single(later)
        wait_for(lambda: stored() > before, timeout=30, state=engine.status)
        assert_invariants(engine)
    finally:
        if engine is not None and engine.proc.poll() is None:
            engine.stop()
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait(10)
        network.close()


def test_the_prefill_host_gone_after_its_answer_leaves_decode_the_shared_tier(model, single, tmp_path):
    """P and D share a Redis tier on a third host. P answers (its prompt's chunks go to Redis),
    then its host is gone: processes killed, link down, so D's pull hears nothing at all. D
    gives up at its deadline and loads the prompt from Redis instead of computing it."""
    import redis
    network = multihost.Network()
    redis_proc = prefill = decode = None
    try:
        redis_host, p_host, d_host = network.add("redis"), network.add("prefill"), network.add("decode")
        redis_proc = _redis_on(redis_host)
        secret = _new_secret(tmp_path / "secret")
        store = ("--kv-store", f"redis://{redis_host.address}:6379/0", "--kv-chunk-tokens", "32",
                 "--kv-secret-file", str(secret))
        prefill = ServerProcess(str(model), *ARGS, *store, "--role", "prefill", "--kv-port", str(KV_PORT),
                                "--kv-ip", p_host.address, host=p_host, wait=False)
        decode = ServerProcess(str(model), *ARGS, *store, "--role", "decode", "--kv-load-timeout-s",
                               str(LOAD_TIMEOUT_S), host=d_host, wait=False)
        prefill.wait_ready()
        decode.wait_ready()
        prompt = _prompt(30, 120)  # 3 chunks of 32 tokens and a trailing one of a block
        params = _complete(prefill.url, prompt, kv_transfer_params={"do_remote_decode": True}).json()[
            "kv_transfer_params"]
        stored = redis.Redis(host=redis_host.address, port=6379, socket_timeout=5)
        wait_for(lambda: len(stored.keys("*")) == 4, timeout=30)  # P's writes land off its step thread
        p_host.cut()
        prefill.kill()
        started = time.monotonic()
        resp = _complete(decode.url, prompt, kv_transfer_params=params)
        assert time.monotonic() - started < LOAD_TIMEOUT_S + 10
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == single(prompt), resp.text
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 112  # every whole block
        status = decode.status()
        assert status["kv_transfer"]["failures"] == {"timeout": 1}
        assert status["kv_store"]["redis"]["hits"] == 4
        assert_invariants(decode)
    finally:
        for server in (decode, prefill):
            if server is not None and server.proc.poll() is None:
                server.stop()
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait(10)
        network.close()
