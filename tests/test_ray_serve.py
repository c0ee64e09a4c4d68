"""engine ray-serve on a local multi-node Ray cluster (ray.cluster_utils.Cluster: several
raylets on this machine, each a node with its own CPUs): prefill and decode deployments of real
engine instances, one per node, behind the OpenAI ingress.

- answers through Serve equal a colocated instance, over the remote path (the KV pulled by the
  decode replica) and the local one (a short prompt the decode replica prefills itself),
  streamed or not, completions and chat;
- the deployment secret reaches the replicas without a file, and no log holds it;
- KV-aware routing (Serve request routers over the replicas' KV events) keeps a conversation on
  the decode replica that holds its KV;
- the decode replica's node removed while requests run: those not streaming yet are answered
  right by another replica, the streaming ones end with an error, nothing hangs, Serve starts
  a replacement and the dead node's engine is gone.

Skipped with the reason when Ray is not installed (pip install 'engine[ray]'); CI installs it."""
from __future__ import annotations

import glob
import json
import os

import httpx
import pytest

ray = pytest.importorskip("ray", reason="needs Ray: pip install 'engine[ray]'")

from ray import serve  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from entrypoints.ray_serve.app import RayServeOptions, build_app  # noqa: E402
from tests.ray_cluster import cluster  # noqa: E402,F401 - the module's cluster
from tests.server_utils import free_port  # noqa: E402

ENGINE_ARGS = ["--num-blocks", "256", "--max-model-len", "1024", "--served-model-name", "tiny"]
SECRET = "ray-serve-test-secret-" + os.urandom(16).hex()


@pytest.fixture(scope="module")
def url(cluster, tiny_llama, receiver):
    port = free_port()
    # The HTTP entry on the head node only: every node's Serve proxy binds the same address on
    # this one machine, and a client connected through the lost node's proxy would lose its
    # connection with that node (as it would on real machines: put a load balancer in front).
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    options = RayServeOptions(str(tiny_llama), engine_args=ENGINE_ARGS, max_local_prefill_tokens=64,
                              ingress_actor_options={"num_cpus": 0, "resources": {"head": 0.01}},  # it stays
                              otlp_traces_endpoint=receiver.url)
    serve.run(build_app(options, secret=SECRET), name="engine", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete("engine")


@pytest.fixture(scope="module")
def colocated(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=256, max_model_len=1024)
    yield llm
    llm.shutdown()


def _want(llm: LLM, prompt: list[int]) -> str:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text


def _streamed(url: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                choice = event["choices"][0]
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def test_answers_through_serve_equal_a_colocated_instance(url, colocated):
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for n in (20, 300):  # local on the decode replica, then through the prefill replica
        prompt = [(n * 7919 + i * 104729) % 40000 + 3 for i in range(n)]
        resp = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == _want(colocated, prompt)
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (0 if n == 20 else n)  # the remote path: every prompt token pulled, none computed
        fresh = [t + 1 for t in prompt]
        assert _streamed(f"{url}/v1/completions", {**body, "prompt": fresh}) == _want(colocated, fresh)
    messages = [{"role": "user", "content": "Tell me about Ray Serve. " * 20}]
    want = colocated.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    resp = httpx.post(f"{url}/v1/chat/completions", json={**body, "messages": messages}, timeout=120)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == want, resp.text
    assert _streamed(f"{url}/v1/chat/completions", {**body, "messages": messages}) == want
    assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"


def test_one_trace_through_the_ingress_and_both_replicas(url, receiver):
    """--otlp-traces-endpoint on engine ray-serve: the ingress continues the client's traceparent
    and passes its span to the prefill and decode replicas, whose request spans are its children."""
    trace_id, parent = "3" * 32, "4" * 16
    resp = httpx.post(f"{url}/v1/completions", timeout=120, headers={"traceparent": f"00-{trace_id}-{parent}-01"},
                      json={"model": "tiny", "prompt": list(range(200, 400)), "max_tokens": 4, "temperature": 0,
                            "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    spans = receiver.wait_for(lambda all_: {("engine-prefill", "llm_request"), ("engine-decode", "llm_request")}
                              <= {(s.service, s.name) for s in all_ if s.trace_id == trace_id})
    mine = [s for s in spans if s.trace_id == trace_id]
    ingress = next(s for s in mine if s.service == "engine-ingress" and s.name == "proxy_request")
    assert ingress.parent_id == parent
    for service in ("engine-prefill", "engine-decode"):
        request = next(s for s in mine if s.service == service and s.name == "llm_request")
        assert request.parent_id == ingress.span_id


def test_replicas_get_the_secret_through_ray_and_no_log_holds_it(url, cluster):
    prefill = serve.get_deployment_handle("prefill", app_name="engine")
    status = prefill.status.remote().result(timeout_s=30)
    assert status["kv_transfer"]["auth_failures"] == {}
    import tempfile
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    logs = [p for p in glob.glob(f"{session_dir}/logs/**/*", recursive=True) if os.path.isfile(p)]
    engine_logs = glob.glob(f"{tempfile.gettempdir()}/engine-prefill-*.log")
    assert engine_logs  # the engines' own logs too
    logs += engine_logs
    assert logs
    for path in logs:
        with open(path, "rb") as f:
            assert SECRET.encode() not in f.read(), path
    # Nor on a command line anyone on the node can read.
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    assert SECRET.encode() not in f.read()
            except OSError:
                pass


def test_kv_aware_routing_keeps_a_conversation_where_its_kv_is(url, tiny_llama, colocated):
    """--routing kv-aware: Serve's request router for both deployments is the engine's KV-aware
    policy over the replicas' KV events. A conversation's first turn goes through the prefill
    replica (its KV pulled by one decode replica); every later turn (its history plus 40 new
    tokens, fewer than max_local_prefill_tokens) goes to that decode replica, which serves it
    from its prefix cache: no further pulls. Least-loaded routing would send each later turn to
    the other of two idle replicas half the time (which declines it: the remote path again)."""
    import time
    options = RayServeOptions(str(tiny_llama), decode_replicas=(2, 2), engine_args=ENGINE_ARGS,
                              max_local_prefill_tokens=64, replica_cpus=0.25, routing="kv-aware",
                              ingress_actor_options={"num_cpus": 0, "resources": {"head": 0.01}})
    serve.run(build_app(options, secret=SECRET), name="kv", route_prefix="/kv")
    base = f"{url}/kv"  # the same Serve HTTP proxy, another application
    try:
        prompt = [(7 * 7919 + i * 104729) % 40000 + 3 for i in range(300)]
        body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
        for turn in range(8):
            resp = httpx.post(f"{base}/v1/completions", json={**body, "prompt": prompt}, timeout=120)
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == _want(colocated, prompt)
            if turn == 0:  # the router must see the decode's pulled blocks (not only P's) first
                deadline = time.monotonic() + 60
                while sum(1 for i in httpx.get(f"{base}/status", timeout=10).json()["kv_routing"]
                          if i["index_blocks"]) < 2:
                    assert time.monotonic() < deadline, httpx.get(f"{base}/status").json()
                    time.sleep(0.5)
            prompt = prompt + [(turn * 31 + i * 7) % 40000 + 3 for i in range(40)]
        engines = [i["url"] for i in httpx.get(f"{base}/status", timeout=10).json()["kv_routing"]]
        assert len(engines) == 3  # the prefill and both decode replicas, followed
        pulls = {}
        for engine_url in engines:
            by_producer = httpx.get(f"{engine_url}/status", timeout=10).json()["kv_transfer"]["pulls"]
            pulls[engine_url] = sum(p["pulls"] for p in by_producer.values())
        assert sum(pulls.values()) == 1, pulls  # the first turn's pull only
    finally:
        serve.delete("kv")


def _chat_hit_rate(base: str, conversations: int = 6, turns: int = 4) -> float:
    """The routing benchmark's chat workload, small and sequential: every turn resends the
    history plus a new message; the conversations come back in a different (seeded) order each
    round. Cached prompt tokens / prompt tokens, from each answer's usage."""
    import random
    words = "river stone garden light window paper music winter orange market letter forest".split()
    rngs = [random.Random(1000 + c) for c in range(conversations)]
    histories: list[list[dict]] = [[] for _ in range(conversations)]
    cached = prompt = 0
    for turn in range(turns):
        order = list(range(conversations))
        random.Random(turn).shuffle(order)
        for c in order:
            text = f"Turn {turn}. " + " ".join(rngs[c].choice(words) for _ in range(40))
            histories[c].append({"role": "user", "content": text})
            resp = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
                "messages": histories[c], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            answer = resp.json()
            histories[c].append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            prompt += answer["usage"]["prompt_tokens"]
    return cached / prompt


def test_kv_aware_routing_on_ray_hits_the_cache_as_engine_proxy_does(url, tiny_llama):
    """Two replicas whose pools hold half the conversations each: on Ray (decode replicas, no
    prefill deployment, the engine's request router) and behind engine proxy --routing
    kv-aware (plain instances), the same chat workload hits the prefix cache within 10% (the
    issue's target), and well above what routing blind to the cache gets."""
    import time

    from tests.disagg_utils import ProxyProcess
    from tests.server_utils import ServerProcess
    pool = ["--num-blocks", "64", "--max-model-len", "1024"]  # 3 of the 6 conversations each
    options = RayServeOptions(str(tiny_llama), prefill_replicas=(0, 0), decode_replicas=(2, 2), engine_args=pool,
                              replica_cpus=0.25, routing="kv-aware",
                              ingress_actor_options={"num_cpus": 0, "resources": {"head": 0.01}})
    serve.run(build_app(options, secret=SECRET), name="chat", route_prefix="/chat")
    base = f"{url}/chat"
    try:
        httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=60)
        deadline = time.monotonic() + 60
        while len(httpx.get(f"{base}/status", timeout=10).json()["kv_routing"]) < 2:  # both followed
            assert time.monotonic() < deadline, httpx.get(f"{base}/status", timeout=10).text
            time.sleep(0.5)
        on_ray = _chat_hit_rate(base)
    finally:
        serve.delete("chat")
    servers = [ServerProcess(str(tiny_llama), *pool, "--kv-events", wait=False) for _ in range(2)]
    proxy = None
    try:
        for server in servers:
            server.wait_ready()
        proxy = ProxyProcess([], [], *[a for s in servers for a in ("--instance", s.url)], "--routing", "kv-aware")
        deadline = time.monotonic() + 30
        while not all(i["last_seq"] >= 0 for i in httpx.get(f"{proxy.url}/status", timeout=5).json()["kv_routing"]):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        behind_proxy = _chat_hit_rate(proxy.url)
    finally:
        if proxy is not None:
            proxy.stop()
        for server in servers:
            server.stop()
    # Measured here: 0.51 on Ray, 0.43 behind engine proxy; 0.29 on Ray routing blind to the cache.
    assert behind_proxy > 0.35, behind_proxy
    assert on_ray >= 0.9 * behind_proxy, (on_ray, behind_proxy)


def _replica_node(deployment: str) -> str:
    from ray.util.state import list_actors
    actors = list_actors(filters=[("class_name", "=", f"ServeReplica:engine:{deployment}"), ("state", "=", "ALIVE")])
    assert len(actors) == 1, actors
    return actors[0]["node_id"]


def _complete_or_error(url: str, body: dict, into: list) -> None:
    try:
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
        into.append((resp.status_code, resp.json()))
    except (httpx.HTTPError, ValueError) as exc:
        into.append(exc)


def _stream_until_end(url: str, body: dict, into: list) -> None:
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=180) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as exc:
        events.append(exc)
    into.append(events)


def test_a_node_lost_under_load_loses_no_request_silently(url, cluster, colocated):
    """Last (it takes a node). The decode replica's node is removed while two non-streaming and
    two streaming requests run on it (long generations)."""
    import threading
    import time

    from tests.server_utils import pid_alive
    decode = serve.get_deployment_handle("decode", app_name="engine")
    engine_pid = decode.status.remote().result(timeout_s=30)["engine_pid"]
    node_id = _replica_node("decode")
    body = {"max_tokens": 600, "temperature": 0, "ignore_eos": True}
    prompts = [[(k * 7919 + i * 104729) % 40000 + 3 for i in range(300)] for k in range(50, 54)]
    answers: list = []
    streams: list = []
    threads = [threading.Thread(target=_complete_or_error, args=(url, {**body, "prompt": p}, answers))
               for p in prompts[:2]]
    threads += [threading.Thread(target=_stream_until_end, args=(url, {**body, "prompt": p}, streams))
                for p in prompts[2:]]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while decode.status.remote().result(timeout_s=30)["requests"]["running"] < 4:
        assert time.monotonic() < deadline, "the requests never all ran on the decode replica"
        time.sleep(0.2)
    cluster_, nodes = cluster
    [node] = [n for n in nodes if n.node_id == node_id]
    cluster_.remove_node(node, allow_graceful=False)
    for t in threads:
        t.join(240)
        assert not t.is_alive(), "a request hung on the lost node"
    want = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
    for status_and_body in answers:  # retried on the replacement: whole and right
        assert not isinstance(status_and_body, Exception), status_and_body
        status, answer = status_and_body
        assert status == 200, answer
    texts = sorted(a[1]["choices"][0]["text"] for a in answers)
    expected = sorted(colocated.generate(prompts[:2], want, use_tqdm=False)[i].outputs[0].text for i in range(2))
    assert texts == expected
    for events in streams:  # they were streaming: an error event, then the end
        assert events and events[-1] == "[DONE]", events[-3:]
        assert any('"error"' in e for e in events if isinstance(e, str)), events[-3:]
    deadline = time.monotonic() + 60
    while pid_alive(engine_pid):
        assert time.monotonic() < deadline, "the lost node's engine outlived its replica"
        time.sleep(0.5)
    assert _replica_node("decode") != node_id  # the replacement, on the spare node
    prompt = prompts[0][:100]
    resp = httpx.post(f"{url}/v1/completions", json={"max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                                       "prompt": prompt}, timeout=120)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == _want(colocated, prompt)


def test_replica_counts_and_the_config_files_arguments_are_checked():
    from entrypoints.ray_serve.app import app_builder, parse_replicas
    assert parse_replicas("3") == (3, 3) and parse_replicas("1:8") == (1, 8) and parse_replicas(2) == (2, 2)
    for bad in ("0", "4:2", "x", "1:", ":3", "-1:2"):
        with pytest.raises(ValueError):
            parse_replicas(bad)
    assert parse_replicas("0", none_allowed=True) == (0, 0)  # --prefill-replicas 0: no prefill deployment
    for bad in ("0:2", "0:0:1", "-1"):
        with pytest.raises(ValueError):
            parse_replicas(bad, none_allowed=True)
    with pytest.raises(ValueError, match="unknown engine ray-serve arguments: replicas"):
        app_builder({"model": "m", "replicas": 3})
    assert app_builder({"model": "m", "prefill_replicas": "1:4", "decode_replicas": 2, "replica_cpus": 2,
                        "engine_args": ["--max-model-len", 4096]}) is not None
    app = app_builder({"model": "m", "prefill_replicas": 0, "decode_replicas": "1:2", "replica_gpus": 1})
    decode = app._bound_deployment.init_args[1]._bound_deployment  # the ingress's second argument
    assert decode.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert app._bound_deployment.init_args[0] is None  # no prefill deployment
    assert decode.init_args[1] == "both"  # so whole engines, not KV consumers
    with pytest.raises(ValueError, match="whole number"):
        app_builder({"model": "m", "replica_gpus": 0.5})
    with pytest.raises(ValueError, match="prefill_replicas is 0"):
        app_builder({"model": "m", "prefill_replicas": 0, "max_local_prefill_tokens": 0})


def test_a_removed_prefill_replica_keeps_its_held_offers_until_they_are_pulled():
    """Serve's graceful shutdown of a prefill replica (EngineReplica.__del__, after its open
    requests finished): its engine gets SIGTERM only once it holds no KV for a decode replica,
    or its lease ended. The engine here is a stand-in: a /status that reports held offers, and
    a process to stop."""
    import subprocess
    import sys
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from entrypoints.ray_serve.replica import EngineReplica
    held = {"n": 2}

    class Status(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = json.dumps({"requests": {"held_for_transfer": held["n"]}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def replica(role: str, lease_s: float) -> EngineReplica:
        r = EngineReplica.__new__(EngineReplica)  # what __init__ sets, without Ray and an engine
        r.role, r.lease_s, r.url = role, lease_s, f"http://127.0.0.1:{server.server_port}"
        r.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        return r
    try:
        pulled_later = threading.Timer(2.0, lambda: held.update(n=0))  # the decode replicas pull
        pulled_later.start()
        prefill, start = replica("prefill", 30.0), time.monotonic()
        prefill.__del__()
        assert 2.0 <= time.monotonic() - start < 10 and prefill.proc.poll() is not None
        held["n"] = 1  # never pulled: the lease (1 s here) ends it
        prefill, start = replica("prefill", 1.0), time.monotonic()
        prefill.__del__()
        assert 1.0 <= time.monotonic() - start < 10 and prefill.proc.poll() is not None
        decode, start = replica("decode", 30.0), time.monotonic()  # holds nothing for anyone
        decode.__del__()
        assert time.monotonic() - start < 2 and decode.proc.poll() is not None
    finally:
        server.shutdown()
