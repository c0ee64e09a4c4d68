"""FAULTS.md 32 end to end: a stranger without the deployment secret, made of real clients (a
plain zmq DEALER that speaks the wire protocol, httpx, redis-py), against a real prefill,
decode and proxy and, for store-mode disaggregation, two instances sharing a real
redis-server. Every attempt is refused and counted, the victims' outputs are unchanged, and
nothing stays held afterwards. (Planted and altered disk entries, with a real file writer,
are in tests/test_store_security.py.)"""
from __future__ import annotations

import os
import random
import time

import httpx
import pytest
import redis
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine import LLM, SamplingParams
from engine.kv_transfer.p2p_wire import Challenge, Pull, Refused, Release
from engine.kv_transfer.params import token_digest
from engine.kv_transfer.secret import ENV_VAR, KVSecret, new_secret
from tests.disagg_utils import Disagg
from tests.server_utils import ServerProcess
from tests.test_p2p_worker import RawPeer

ENGINE_ARGS = ("--num-blocks", "128", "--max-model-len", "512", "--served-model-name", "tiny")


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.fixture(scope="module")
def colocated(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=128, max_model_len=512)
    yield lambda prompt: llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                      use_tqdm=False)[0].outputs[0].text
    llm.shutdown()


def _eventually(read, holds, timeout: float = 10.0):
    """``read()`` once ``holds`` of it (polled), else fails showing the last value."""
    deadline = time.monotonic() + timeout
    while not holds(value := read()):
        assert time.monotonic() < deadline, value
        time.sleep(0.1)
    return value


def _complete(url: str, prompt: list[int], **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra})


def test_a_stranger_on_the_kv_port_and_the_decode_api(tiny_llama, colocated, monkeypatch):
    monkeypatch.setenv("ENGINE_KV_SHM", "1")  # the prefill has a /dev/shm path that must not leak
    cluster = Disagg(str(tiny_llama), *ENGINE_ARGS, prefill_args=("--kv-lease-s", "120"))
    ctx = zmq.Context()
    try:
        victim = _prompt(1, 80)
        held = _complete(cluster.prefill.url, victim, kv_transfer_params={"do_remote_decode": True}
                         ).json()["kv_transfer_params"]
        status = cluster.prefill.status()
        engine_id = held["remote_engine_id"]
        assert status["kv_transfer"]["blocks_held"] == 5

        # 1. The KV port: without the secret, and with a wrong one, the stranger learns nothing
        #    and takes nothing; every refusal is counted.
        stranger = RawPeer(ctx, held["remote_kv_addr"])
        challenge = stranger.hello()
        assert isinstance(challenge, Challenge)
        assert isinstance(stranger.auth(KVSecret("a guessed secret, 32 bytes long!")), Refused)
        pull = Pull("t1", held["remote_request_id"], 0, 5, held["token_digest"])
        stranger.send(pull)  # tagged by a session the producer never opened
        assert isinstance(stranger.recv(), Refused)
        stranger.send_raw(*[os.urandom(32) for _ in range(2)])  # garbage
        assert isinstance(stranger.recv(), Refused)
        stranger.send(Release(held["remote_request_id"], held["token_digest"]))
        assert isinstance(stranger.recv(), Refused)
        wire = b"".join(stranger.replies)
        for private in (engine_id.encode(), b"/dev/shm", b"bs16", b"float32"):
            assert private not in wire, private
        stranger.close()
        # An oversized frame drops the stranger's connection before anything reads it.
        flood = RawPeer(ctx, held["remote_kv_addr"])
        monitor = flood.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        flood.send_raw(os.urandom(4 * 2**20))
        assert monitor.poll(10_000) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert not flood.replies
        flood.sock.disable_monitor()
        monitor.close(linger=0)
        flood.close()
        # (The engine reports its counters at least once a second.)
        _eventually(lambda: cluster.prefill.status()["kv_transfer"]["auth_failures"],
                    lambda r: r.get("proof") == 1 and r.get("unauthenticated", 0) >= 3)
        assert cluster.prefill.status()["kv_transfer"]["blocks_held"] == 5  # the release did nothing

        # 2. The decode API: parameters that would make D pull from somewhere else, or pull
        #    another request's KV, without P's signature are a 400 naming the field.
        for forged in ({**held, "remote_kv_addr": "tcp://127.0.0.1:9"}, {**held, "num_tokens": 79},
                       {**held, "token_digest": token_digest(_prompt(2, 80))},
                       {k: v for k, v in held.items() if k != "signature"}):
            resp = _complete(cluster.decode.url, victim, kv_transfer_params=forged)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == "kv_transfer_params.signature"

        # 3. The victim is untouched: its decode pulls all of its KV and answers exactly.
        resp = _complete(cluster.decode.url, victim, kv_transfer_params=held)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == colocated(victim)
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
        # And through the proxy, after all that, as usual.
        other = _prompt(3, 50)
        assert _complete(cluster.url, other).json()["choices"][0]["text"] == colocated(other)
        cluster.wait_idle()
        for srv in (cluster.prefill, cluster.decode):
            status = srv.status()
            assert status["requests"]["tracked_by_engine"] == 0 and status["kv_transfer"]["blocks_held"] == 0
        assert cluster.decode.status()["kv_transfer"]["failures"] == {}
    finally:
        ctx.destroy(linger=0)
        cluster.stop()


def test_a_stranger_with_write_access_to_the_shared_redis(tiny_llama, colocated, redis_server):
    """Store-mode disaggregation: P and D share a Redis; the stranger can write to it but has
    not the secret. For one victim it flips a byte in every entry P stored; for the next it
    writes a genuine entry of another prompt under each of the victim's keys. D refuses them
    (counted by reason), recomputes, and answers exactly; a promise the stranger wrote itself
    is a 400."""
    env = {ENV_VAR: new_secret()}
    args = (*ENGINE_ARGS, "--kv-store", redis_server.url, "--kv-chunk-tokens", "32")
    prefill = ServerProcess(str(tiny_llama), *args, env=env)
    decode = ServerProcess(str(tiny_llama), *args, env=env)
    try:
        r = redis.Redis.from_url(redis_server.url)
        seen: set[bytes] = set()
        for attempt, victim in enumerate((_prompt(4, 100), _prompt(5, 100))):
            promise = _complete(prefill.url, victim, kv_transfer_params={"do_remote_decode": True}
                                ).json()["kv_transfer_params"]
            assert promise["kv_store_tokens"] == 96 and promise["signature"]
            deadline = time.monotonic() + 30
            while len(keys := set(r.keys("*")) - seen) < 3:  # P's 3 chunks, written off its step thread
                assert time.monotonic() < deadline, keys
                time.sleep(0.05)
            for key in keys:
                value = r.get(key)
                if attempt == 0:  # altered: one byte of the KV flipped
                    donor = value
                    r.set(key, value[:-100] + bytes([value[-100] ^ 1]) + value[-99:])
                else:  # moved: a genuine entry of the first victim, under this victim's key
                    r.set(key, donor)
            seen |= keys
            before = decode.status()["kv_store"]["redis"]["rejected"].get("bad_tag", 0)
            resp = _complete(decode.url, victim, kv_transfer_params=promise)
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == colocated(victim)
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # all recomputed
            # A promise the stranger wrote itself is a 400.
            forged = {**promise, "kv_store_tokens": 64}
            resp = _complete(decode.url, victim, kv_transfer_params=forged)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params.signature"
            # The genuine promise replayed with another prompt promises nothing for it: no load
            # waits (10 s) for chunks that were never stored, the answer comes as fast as ever.
            stranger_prompt = _prompt(100 + attempt, 100)
            started = time.monotonic()
            resp = _complete(decode.url, stranger_prompt, kv_transfer_params=promise)
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == colocated(stranger_prompt)
            assert time.monotonic() - started < 5, "the replayed promise made the decode wait for its chunks"
            decode.wait_idle()
            # D stores the stranger's prompt too, off its step thread: its 3 chunks are not the
            # next victim's (a late one would be taken for P's and the victim's left genuine).
            seen |= _eventually(lambda: set(r.keys("*")) - seen, lambda new: len(new) >= 3)
            rejected = _eventually(lambda: decode.status()["kv_store"]["redis"]["rejected"],
                                   lambda r: r.get("bad_tag", 0) > before)
            assert set(rejected) == {"bad_tag"}, rejected
        assert 'engine:kv_store_rejected_total{model_name="tiny",reason="bad_tag",tier="redis"}' in decode.metrics()
        for srv in (prefill, decode):
            assert srv.status()["requests"]["tracked_by_engine"] == 0
    finally:
        decode.stop()
        prefill.stop()
