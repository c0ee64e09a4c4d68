"""engine ray-serve's decode deployment autoscaled (1:2 replicas, one per node) through a
scale-up, a scale-down and a node loss in one run, under load, on a local multi-node Ray
cluster (ray.cluster_utils.Cluster); no prefill deployment (--prefill-replicas 0), KV-aware
routing. No request is lost on the way:

- a load step (six streams at a time, against a target of two per replica) makes Serve start
  the second replica; every stream of the step ends whole and right;
- two long streams, one on each replica, are below the target: Serve removes a replica while
  both stream, the removed one drains (its stream ends whole and right), then its engine exits;
- the last replica's node is lost under four requests: each is answered whole and right (the
  ingress sends it once more, to the replacement Serve starts on a spare node).

Skipped with the reason when Ray is not installed (pip install 'engine[ray]'); CI installs it."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="needs Ray: pip install 'engine[ray]'")

from ray import serve  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from entrypoints.ray_serve.app import RayServeOptions, build_app  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402
from tests.ray_cluster import cluster  # noqa: E402,F401 - the module's cluster
from tests.server_utils import free_port, pid_alive  # noqa: E402

MAX_LEN = 8192
ENGINE_ARGS = ["--num-blocks", "2048", "--max-model-len", str(MAX_LEN), "--served-model-name", "tiny"]
APP = "scale"
TAIL_TOKENS = 7900  # ~30 s here: they must outlast Serve's decision to scale down


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with a long context: streams long enough to outlast Serve's delays."""
    return make_tiny_model(tmp_path_factory.mktemp("ray-long-llama"), "llama", tie_word_embeddings=True,
                           max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def url(cluster, long_llama):
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    options = RayServeOptions(
        str(long_llama), prefill_replicas=(0, 0), decode_replicas=(1, 2), engine_args=ENGINE_ARGS,
        # Down after 10 s: Serve's clock starts as the load step winds down, and both long
        # streams must be placed (a few seconds here) before it removes a replica.
        routing="kv-aware", target_ongoing_requests=2, upscale_delay_s=1, downscale_delay_s=10,
        autoscaling_config={"metrics_interval_s": 0.5, "look_back_period_s": 2},
        ingress_actor_options={"num_cpus": 0, "resources": {"head": 0.01}})  # the ingress stays
    serve.run(build_app(options), name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete(APP)


@pytest.fixture(scope="module")
def reference(long_llama):
    llm = LLM(str(long_llama), num_blocks=256, max_model_len=MAX_LEN)
    yield llm
    llm.shutdown()


def _prompt(k: int) -> list[int]:
    return [(k * 7919 + i * 104729) % 40000 + 3 for i in range(200)]


def _running() -> int:
    return serve.status().applications[APP].deployments["decode"].replica_states.get("RUNNING", 0)


def _engines(url: str) -> list[str]:
    """The decode engines' URLs, as the ingress follows them."""
    return [i["url"] for i in httpx.get(f"{url}/status", timeout=10).json()["kv_routing"]]


def _engine_status(engine_url: str) -> dict:
    return httpx.get(f"{engine_url}/status", timeout=10).json()


def _stream(url: str, k: int, max_tokens: int) -> tuple[int, str, str, int]:
    """A streamed completion of prompt ``k``: (k, text, finish reason, completion tokens); an
    error event raises."""
    text, finish, tokens = "", None, 0
    body = {"prompt": _prompt(k), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event["choices"]:
                    text += event["choices"][0]["text"]
                    finish = event["choices"][0]["finish_reason"] or finish
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return k, text, finish, tokens


def _complete(url: str, k: int, max_tokens: int) -> tuple[int, str, str, int]:
    body = {"prompt": _prompt(k), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return k, choice["text"], choice["finish_reason"], resp.json()["usage"]["completion_tokens"]


class _Requests:
    """Requests on threads; ``answers`` gets each one's result or exception."""

    def __init__(self) -> None:
        self.answers: list = []
        self.threads: list[threading.Thread] = []

    def start(self, fn, *args) -> threading.Thread:
        def run() -> None:
            try:
                self.answers.append(fn(*args))
            except Exception as exc:  # noqa: BLE001 - reported with the others
                self.answers.append(exc)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)
        return thread

    def join(self, timeout: float = 300) -> None:
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), "a request hung"


def _assert_whole_and_right(llm: LLM, answers: list, max_tokens: int) -> None:
    """Every answer ended by its length, none cut; each begins as a single instance's answer
    (thousands of greedy tokens of a random model meet a near-tie somewhere, where another
    batch may round the other way)."""
    assert answers
    for answer in answers:
        assert not isinstance(answer, Exception), answer
    starts = llm.generate([_prompt(a[0]) for a in answers],
                          SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for (k, text, finish, tokens), start in zip(answers, starts):
        assert (finish, tokens) == ("length", max_tokens), (k, finish, tokens)
        assert text.startswith(start.outputs[0].text), k


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: {serve.status().applications[APP].deployments['decode']}"
        time.sleep(0.25)


def _replica_nodes() -> list[str]:
    from ray.util.state import list_actors
    actors = list_actors(filters=[("class_name", "=", f"ServeReplica:{APP}:decode"), ("state", "=", "ALIVE")])
    return [a["node_id"] for a in actors]


def test_scale_up_then_a_draining_scale_down_then_a_node_lost_lose_no_request(url, cluster, reference):
    assert _running() == 1
    # 1. A load step: six streams at a time, each followed by another, until Serve has started
    # the second replica and it serves (however long its engine takes to start here).
    step, stop, k = _Requests(), threading.Event(), iter(range(10_000))

    def keep_streaming() -> list:
        done = []
        while not stop.is_set():
            done.append(_stream(url, next(k), 300))
        return done
    for _ in range(6):
        step.start(keep_streaming)
    _wait(lambda: _running() == 2, 300, "Serve never started the second decode replica")
    _wait(lambda: len(_engines(url)) == 2, 60, "the ingress never followed the second replica")
    stop.set()
    step.join()  # (its answers are checked at the end: Serve's clock runs meanwhile)

    # 2. Two long streams, one on each replica (the router sends the second to the replica
    # without one), below the target: Serve removes one replica while both stream.
    engines = _engines(url)
    pids = {e: _engine_status(e)["engine_pid"] for e in engines}
    tail = _Requests()
    for n in (1, 2):
        tail.start(_stream, url, 100_000 + n, TAIL_TOKENS)
        _wait(lambda: sum(_engine_status(e)["requests"]["running"] for e in engines) == n, 60,
              f"stream {n} never ran")
    running = {e: _engine_status(e)["requests"]["running"] for e in engines}
    assert sorted(running.values()) == [1, 1], running
    _wait(lambda: _running() == 1, 120, "Serve never scaled the decode deployment down")
    assert all(t.is_alive() for t in tail.threads), "a stream ended before the scale-down: nothing drained"
    tail.join()
    _assert_whole_and_right(reference, tail.answers, TAIL_TOKENS)  # the removed replica's stream too
    _wait(lambda: sum(pid_alive(p) for p in pids.values()) == 1, 60, "the removed replica's engine outlived it")

    # 3. The last replica's node lost under four requests (not streamed): each is sent once
    # more, to the replacement Serve starts on a spare node.
    _wait(lambda: len(_replica_nodes()) == 1, 60, "the removed replica's actor outlived it")
    [node_id] = _replica_nodes()
    [engine] = [e for e in engines if pid_alive(pids[e])]
    lost = _Requests()
    for n in range(4):
        lost.start(_complete, url, 200_000 + n, 1500)
    _wait(lambda: _engine_status(engine)["requests"]["running"] == 4, 60, "the requests never all ran")
    cluster_, nodes = cluster
    [node] = [n for n in nodes if n.node_id == node_id]
    cluster_.remove_node(node, allow_graceful=False)
    lost.join()
    _assert_whole_and_right(reference, lost.answers, 1500)
    _wait(lambda: not pid_alive(pids[engine]), 60, "the lost node's engine outlived its replica")
    assert node_id not in _replica_nodes() and _running() >= 1
    _assert_whole_and_right(reference, [a for batch in step.answers for a in (
        batch if isinstance(batch, list) else [batch])], 300)
