"""KV-aware routing (entrypoints/kv_router.py): the index follows an instance's KV events,
fills gaps from the replay socket and starts over after a restart; `engine proxy --routing
kv-aware` over plain replicas sends a conversation back to the instance that holds it, with the
outputs a single instance gives, and moves on when an instance dies."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import zmq

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher, KVEventsConfig
from entrypoints.kv_router import REPLAY_TIMEOUT_MS, EventSubscriber, InstanceIndex
from tests.disagg_utils import ProxyProcess
from tests.server_utils import ServerProcess, free_port, wait_for

ENGINE_ARGS = ("--num-blocks", "128", "--max-model-len", "1024")
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _stored(*hashes: bytes) -> BlockStored:
    return BlockStored(list(hashes), None, [], 16, None, "GPU", None)


def _publisher() -> tuple[KVEventPublisher, KVEventsConfig]:
    config = KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{free_port()}",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}", buffer_steps=4)
    return KVEventPublisher(config), config


def test_cost_trades_cached_tokens_against_load_within_the_skew_limit():
    """Fed by hand (no processes): the holder of a 1024-token prefix wins against idle replicas
    while it has a few more open requests (32 tokens each), and is passed over once it has
    more than --kv-max-skew above the least loaded, however much it holds."""
    from types import SimpleNamespace

    from entrypoints.kv_router import KVRouter, PromptBlocks
    router = KVRouter(load_weight=32, max_skew=8)
    hashes = [bytes([i]) * 32 for i in range(64)]  # a 1024-token prompt in 16-token blocks
    key = ("engine", 16, "00" * 32)
    for url in ("a", "b"):
        router.hasher_keys[url] = key
        router.indexes[url] = InstanceIndex(url)
    router.indexes["a"].hashes.update(hashes)
    prompt = PromptBlocks(1024, {key: hashes})
    pick = lambda a_open, b_open: router.choose(  # noqa: E731
        [SimpleNamespace(url="a", in_flight=a_open), SimpleNamespace(url="b", in_flight=b_open)], prompt)
    assert pick(0, 0) == (pick(0, 0)[0], 1024) and pick(0, 0)[0].url == "a"
    assert pick(8, 0)[0].url == "a"  # 8 more open: 256 tokens of load against 1024 cached
    assert pick(9, 0) == (pick(9, 0)[0], 0) and pick(9, 0)[0].url == "b"  # past the skew limit
    assert pick(9, 1)[0].url == "a"  # the limit is relative to the least loaded


def test_index_catches_up_from_the_replay_and_fills_gaps():
    publisher, config = _publisher()
    try:
        publisher.publish([_stored(b"a"), _stored(b"b")])  # before anyone listens
        time.sleep(0.2)
        index = InstanceIndex("x")
        subscriber = EventSubscriber(index, config.endpoint, config.replay_endpoint, config.topic)
        subscriber.start()
        wait_for(lambda: index.hashes == {b"a", b"b"}, timeout=10, state=lambda: index)
        assert index.last_seq == 1  # seq 0 is the start-up AllBlocksCleared
        publisher.publish([BlockRemoved([b"a"], "GPU")])
        wait_for(lambda: index.hashes == {b"b"}, timeout=10, state=lambda: index)
        # A gap: the subscriber asks the replay socket for what it missed.
        index.last_seq -= 1  # as if batch 2 had been lost
        index.hashes.add(b"a")
        publisher.publish([_stored(b"c")])
        wait_for(lambda: index.hashes == {b"b", b"c"}, timeout=10, state=lambda: index)
        assert index.resyncs == 0
        # A gap the replay buffer (4 batches) no longer covers: start over from what it has.
        for name in (b"d", b"e", b"f", b"g"):
            publisher.publish([_stored(name)])
        wait_for(lambda: b"g" in index.hashes, timeout=10, state=lambda: index)
        index.last_seq = 0  # as if batches 1-7 had been lost
        publisher.publish([_stored(b"h")])
        wait_for(lambda: b"h" in index.hashes, timeout=10, state=lambda: index)
        assert index.resyncs == 1 and index.hashes == {b"e", b"f", b"g", b"h"}
        # A restart: numbering starts again with AllBlocksCleared.
        subscriber.stop()
        subscriber.join(5)
    finally:
        publisher.shutdown()
    index.apply(0, type("B", (), {"events": [AllBlocksCleared()]})())
    assert index.hashes == set()


def test_events_over_ipv6_with_ports_chosen_at_bind():
    """--kv-events on an IPv6 --host: the sockets bind (port 0: chosen then, and reported) and a
    router follows them."""
    publisher = KVEventPublisher(KVEventsConfig(True, endpoint="tcp://[::1]:0", replay_endpoint="tcp://[::1]:0"))
    try:
        assert publisher.endpoint.startswith("tcp://[::1]:") and not publisher.endpoint.endswith(":0")
        index = InstanceIndex("x")
        subscriber = EventSubscriber(index, publisher.endpoint, publisher.replay_endpoint, "kv-events")
        subscriber.start()
        wait_for(lambda: index.last_seq == 0, timeout=10, state=lambda: index)
        publisher.publish([_stored(b"a")])
        wait_for(lambda: index.hashes == {b"a"}, timeout=10, state=lambda: index)
        subscriber.stop()
        subscriber.join(5)
    finally:
        publisher.shutdown()


def test_a_router_without_the_secret_learns_nothing_and_never_hangs():
    """The instance's sockets are CURVE servers (it has a secret); the router has none. Its
    handshakes fail, which leaves zmq no connection to queue a replay request on: the router
    must give up on the replay (index empty), not block in the send, and stop when told."""
    from engine.kv_transfer.secret import KVSecret
    config = KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{free_port()}",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    publisher = KVEventPublisher(config, secret=KVSecret("the-deployment-secret-0123456789"))
    try:
        publisher.publish([_stored(b"a")])
        index = InstanceIndex("x")
        subscriber = EventSubscriber(index, config.endpoint, config.replay_endpoint, config.topic)
        subscriber.replay = subscriber._socket(zmq.DEALER, config.replay_endpoint)
        wait_for(lambda: not subscriber.replay.poll(0, zmq.POLLOUT), timeout=10)  # the handshake failed
        replaying = threading.Thread(target=subscriber._replay, args=(0,), daemon=True)
        replaying.start()
        replaying.join(REPLAY_TIMEOUT_MS / 1000 + 5)
        assert not replaying.is_alive(), "the replay request blocked"
        assert index.hashes == set() and index.last_seq == -1
        subscriber.start()  # the whole watcher: starts, learns nothing, stops when told
        time.sleep(1)
        subscriber.stop()
        subscriber.join(REPLAY_TIMEOUT_MS / 1000 + 5)
        assert not subscriber.is_alive(), "the watcher did not stop"
        assert index.hashes == set()
    finally:
        publisher.shutdown()


@pytest.fixture(scope="module")
def replicas(tiny_llama):
    servers = []
    # One with the ports it chooses (--kv-events), one with vLLM's config and fixed ports.
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}",
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    for flags in (("--kv-events",), ("--kv-events-config", json.dumps(events))):
        servers.append(ServerProcess(str(tiny_llama), *ENGINE_ARGS, *flags, wait=False))
    for server in servers:
        server.wait_ready()
    yield servers
    for server in servers:
        if server.proc.poll() is None:
            server.stop()


@pytest.fixture(scope="module")
def proxy(replicas):
    proxy = ProxyProcess([], [], *[a for s in replicas for a in ("--instance", s.url)], "--routing", "kv-aware")
    wait_for(lambda: all(i["last_seq"] >= 0 for i in _routing(proxy).values()), timeout=20,
             state=lambda: _routing(proxy))
    yield proxy
    proxy.stop()


def _routing(proxy: ProxyProcess) -> dict[str, dict]:
    return {i["url"]: i for i in httpx.get(f"{proxy.url}/status", timeout=5).json()["kv_routing"]}


def _home(replicas: list[ServerProcess]) -> ServerProcess:
    return max(replicas, key=lambda s: s.status()["kv_blocks"]["cached"])


def test_a_conversation_keeps_landing_where_its_kv_is(replicas, proxy, tiny_llama):
    reference = ServerProcess(str(tiny_llama), *ENGINE_ARGS)
    try:
        history: list[dict] = []
        homes = []
        for turn in range(4):
            history.append({"role": "user", "content": f"turn {turn}: " + "tell me more " * 20})
            body = {"messages": history, **GREEDY}
            answer = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            expected = httpx.post(f"{reference.url}/v1/chat/completions", json=body, timeout=60).json()
            assert answer.json()["choices"][0]["message"] == expected["choices"][0]["message"]
            history.append(answer.json()["choices"][0]["message"])
            homes.append(_home(replicas).url)
            wait_for(lambda: sum(i["index_blocks"] for i in _routing(proxy).values()) > 0, timeout=10)
        routing = _routing(proxy)
        assert len(set(homes)) == 1, homes  # every turn on the instance that held the history
        home = routing[homes[0]]
        # Turns 2-4 found most of their prompt (the history) in the index.
        assert home["routed"] == 4 and home["predicted_hit_rate"] > 0.5, routing
    finally:
        reference.stop()


def test_the_router_matches_a_salted_prompt_only_under_its_salt(replicas, proxy):
    """cache_salt: the proxy hashes a prompt as the instances hash it under its salt, so the same
    salt finds its KV and another salt is predicted (and given) nothing."""
    def predicted(salt: str) -> tuple[int, int]:
        before = sum(i["predicted_hits"] for i in _routing(proxy).values())
        body = {"prompt": list(range(700, 800)), "cache_salt": salt, **GREEDY}
        answer = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        hits = sum(i["predicted_hits"] for i in _routing(proxy).values()) - before
        return hits, answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    indexed = sum(i["index_blocks"] for i in _routing(proxy).values())
    assert predicted("tenant-a") == (0, 0)
    wait_for(lambda: sum(i["index_blocks"] for i in _routing(proxy).values()) >= indexed + 6, timeout=10,
             state=lambda: _routing(proxy))
    assert predicted("tenant-a") == (96, 96)
    assert predicted("tenant-b") == (0, 0)


def test_a_restarted_instance_starts_with_an_empty_index(replicas, proxy):
    body = {"prompt": list(range(300, 400)), **GREEDY}
    assert httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60).status_code == 200
    home = _home(replicas)
    wait_for(lambda: _routing(proxy)[home.url]["index_blocks"] >= 6, timeout=10, state=lambda: _routing(proxy))
    home.stop()
    restarted = ServerProcess(*home.args, port=home.port)
    replicas[replicas.index(home)] = restarted
    wait_for(lambda: _routing(proxy)[home.url]["index_blocks"] == 0, timeout=20, state=lambda: _routing(proxy))
    assert httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60).status_code == 200
    # And its events are followed again, wherever they are now (with --kv-events: new ports).
    again = {"prompt": list(range(700, 800)), **GREEDY}
    assert httpx.post(f"{restarted.url}/v1/completions", json=again, timeout=60).status_code == 200
    wait_for(lambda: _routing(proxy)[home.url]["index_blocks"] >= 6, timeout=20, state=lambda: _routing(proxy))


def test_a_dead_instance_is_skipped_before_anything_was_sent(replicas, proxy):
    body = {"prompt": list(range(500, 600)), **GREEDY}
    first = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60)
    assert first.status_code == 200
    home = _home(replicas)
    home.kill()  # the one holding the prompt: the proxy's first choice
    again = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
