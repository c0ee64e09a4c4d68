"""KV events (engine/kv_events.py): what the block pool reports, the wire format a vLLM
subscriber decodes, and a real `engine serve` publishing them: stored blocks carry the hashes
anyone computes from the tokens, evictions are reported, gaps are filled by replay, and off
loopback nothing is readable without the deployment secret."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import types
from typing import Any, Optional, Union

import httpx
import msgspec
import pytest
import zmq

from engine.block_pool import BlockHasher, BlockPool
from engine.config import EngineConfig
from engine.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    event_keys,
)
from engine.kv_transfer.secret import KVSecret, new_secret
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.server_utils import REPO, ServerProcess, free_port


# A consumer's types in vLLM 0.32's shape (the batch an array, each event a map tagged "type"),
# knowing only the fields of vLLM's examples/online_serving/kv_events_subscriber.py and with our
# hashes (bytes where vLLM's example has int): a consumer that knows fewer fields ignores the
# rest. (tests/test_vllm_kv_events.py holds the engine to vLLM's own bytes and decoder.)
class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _BlockStored(_KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: Optional[bytes]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class _BlockRemoved(_KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: Optional[str]


class _AllBlocksCleared(_KVCacheEvent, tag="AllBlocksCleared"):
    pass


class _KVEventBatch(_EventBatch):
    events: list[Union[_BlockStored, _BlockRemoved, _AllBlocksCleared]]


def test_block_pool_reports_stored_runs_and_removals():
    pool = BlockPool(6, enable_caching=True)
    pool.kv_events = []
    blocks = pool.get_new_blocks(4)
    hashes = [bytes([i]) * 32 for i in range(4)]
    tokens = list(range(64))
    pool.cache_full_blocks(blocks, hashes, 0, 1, tokens, 16)
    pool.cache_full_blocks(blocks, hashes, 0, 4, tokens, 16)  # block 0 again: not reported twice
    assert pool.kv_events == [BlockStored([hashes[0]], None, tokens[:16], 16, None, "GPU", None, None, 0),
                              BlockStored(hashes[1:], hashes[0], tokens[16:], 16, None, "GPU", None, None, 0)]
    pool.kv_events.clear()
    pool.free_blocks(reversed(blocks))
    assert pool.kv_events == []  # freed blocks stay cached (lazy eviction)
    pool.get_new_blocks(4)  # two empty blocks, then the two least recently freed cached ones
    assert pool.kv_events == [BlockRemoved([hashes[3], hashes[2]], "GPU", 0)]
    pool.kv_events.clear()
    pool.uncache(blocks)
    assert pool.kv_events == [BlockRemoved([hashes[0], hashes[1]], "GPU", 0)]


def test_block_pool_names_blocks_by_event_hashes_when_given():
    """vLLM's hashes (--prefix-caching-hash-algo): stores and the removals after them name the
    blocks the same way; the salt rides as the first block's extra key."""
    pool = BlockPool(4, enable_caching=True)
    pool.kv_events = []
    blocks = pool.get_new_blocks(3)
    hashes, names = [bytes([i]) * 32 for i in range(3)], [101, 102, 103]
    tokens = list(range(48))
    pool.cache_full_blocks(blocks, hashes, 0, 2, tokens, 16, names, "tenant")
    pool.cache_full_blocks(blocks, hashes, 2, 3, tokens, 16, names, "tenant")
    assert pool.kv_events == [BlockStored([101, 102], None, tokens[:32], 16, None, "GPU", None,
                                          [("tenant",), None], 0),
                              BlockStored([103], 102, tokens[32:], 16, None, "GPU", None, [None], 0)]
    pool.kv_events.clear()
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(4)
    assert pool.kv_events == [BlockRemoved([103, 102, 101], "GPU", 0)]
    assert pool._event_names == {}  # nothing kept for blocks no longer cached


def test_wire_format_is_vllm_0_32s_tagged_maps():
    """vLLM 0.32's shape: the batch an array, each event a map tagged "type" with its fields in
    vLLM's order, those with a default left out while they hold it (the proof against vLLM's
    own bytes and decoder: tests/test_vllm_kv_events.py)."""
    event = BlockStored([7], 6, [1, 2], 2, None, "GPU", None, [("s",)], 0)
    batch = KVEventBatch(1.0, [event, BlockRemoved([7], "GPU", 0), AllBlocksCleared()], data_parallel_rank=0)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert raw == [1.0, [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": 6, "token_ids": [1, 2],
                          "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
                          "extra_keys": [["s"]], "group_idx": 0},
                         {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
                         {"type": "AllBlocksCleared"}], 0]
    assert list(raw[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys", "group_idx"]


def test_wire_format_decodes_as_vllms():
    batch = KVEventBatch(1.5, [AllBlocksCleared(), BlockStored([b"h" * 32], None, [1, 2], 16, None, "GPU", None,
                                                               [("salt",)], 0),
                               BlockRemoved([b"h" * 32], "GPU", 0)])
    decoded = msgspec.msgpack.Decoder(_KVEventBatch).decode(msgspec.msgpack.encode(batch))
    assert decoded.ts == 1.5
    assert [type(e).__name__ for e in decoded.events] == ["_AllBlocksCleared", "_BlockStored", "_BlockRemoved"]
    assert decoded.events[1].block_hashes == [b"h" * 32] and decoded.events[1].token_ids == [1, 2]


def _config(pub: int, replay: int, host: str = "127.0.0.1") -> str:
    return json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://{host}:{pub}",
                       "replay_endpoint": f"tcp://{host}:{replay}"})


class _Subscriber:
    def __init__(self, pub: int, replay: int, secret: KVSecret | None = None, host: str = "127.0.0.1") -> None:
        self.ctx = zmq.Context()
        self.sub, self.replay = self.ctx.socket(zmq.SUB), self.ctx.socket(zmq.DEALER)
        for sock in (self.sub, self.replay):
            sock.setsockopt(zmq.LINGER, 0)
            if secret is not None:
                sock.curve_serverkey = event_keys(secret, "server")[0]
                sock.curve_publickey, sock.curve_secretkey = event_keys(secret, "client")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        self.sub.connect(f"tcp://{host}:{pub}")
        self.replay.connect(f"tcp://{host}:{replay}")
        self.decoder = msgspec.msgpack.Decoder(_KVEventBatch)

    def live(self, timeout_ms: int = 5000) -> list[tuple[int, _KVEventBatch]]:
        """Every batch published until nothing came for ``timeout_ms``."""
        out = []
        while self.sub.poll(timeout_ms):
            _, seq, payload = self.sub.recv_multipart()
            out.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
            timeout_ms = 500
        return out

    def replayed(self, start: int, timeout_ms: int = 5000) -> list[tuple[int, _KVEventBatch]] | None:
        if not self.replay.poll(timeout_ms, zmq.POLLOUT):
            return None  # no connection to send on (a failed CURVE handshake leaves none)
        try:
            self.replay.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
        except zmq.Again:
            return None  # the connection dropped between the poll and the send (its handshake failed)
        out = []
        while self.replay.poll(timeout_ms):
            _, seq, payload = self.replay.recv_multipart()
            if seq == END_OF_REPLAY:
                return out
            out.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
        return None  # no answer

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _root_hasher(server: ServerProcess) -> BlockHasher:
    info = server.status()["kv_events"]
    return BlockHasher(info["block_size"], bytes.fromhex(info["root_block_hash"]))


def _hashes(hasher: BlockHasher, tokens: list[int]) -> list[bytes]:
    request = Request("r", tokens, SamplingParams(), frozenset(), 1, hasher)
    return request.block_hashes


def test_a_server_publishes_what_it_caches_and_evicts_and_replays_gaps(tiny_llama):
    pub, replay = free_port(), free_port()
    server = ServerProcess(str(tiny_llama), "--num-blocks", "16", "--max-model-len", "256",
                           "--kv-events-config", _config(pub, replay))
    sub = _Subscriber(pub, replay)
    try:
        history = sub.replayed(0)
        assert history and history[0][0] == 0 and isinstance(history[0][1].events[0], _AllBlocksCleared)
        hasher = _root_hasher(server)
        prompt = list(range(100, 150))  # 50 tokens: 3 full blocks
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        batches = sub.live()
        stored = [e for _, b in batches for e in b.events if isinstance(e, _BlockStored)]
        assert [h for e in stored for h in e.block_hashes] == _hashes(hasher, prompt)
        assert stored[0].parent_block_hash is None and stored[0].token_ids == prompt[:48]
        # 16 blocks: three more 100-token prompts (7 blocks each) evict the first prompt's blocks.
        for seed in (1, 2, 3):
            other = [1000 * seed + i for i in range(100)]
            assert httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": other},
                              timeout=60).status_code == 200
        later = sub.live()
        removed = {h for _, b in later for e in b.events if isinstance(e, _BlockRemoved) for h in e.block_hashes}
        assert set(_hashes(hasher, prompt)) <= removed
        # Sequence numbers have no gaps; a replay from any point returns the same batches.
        seqs = [s for s, _ in history + batches + later]
        seqs = sorted(set(seqs))
        assert seqs == list(range(seqs[-1] + 1))
        again = sub.replayed(batches[0][0])
        assert [(s, msgspec.msgpack.encode(b)) for s, b in again] == \
               [(s, msgspec.msgpack.encode(b)) for s, b in batches + later]
    finally:
        sub.close()
        server.stop()


class _BlockStored032(_KVCacheEvent, tag="BlockStored"):
    """vLLM 0.32's BlockStored as far as the engine sets it, int hashes
    (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default)."""
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple]]] = None
    group_idx: Optional[int] = None


class _BlockRemoved032(_KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None


class _KVEventBatch032(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[_BlockStored032, _BlockRemoved032, _AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


def vllm_subscriber(server: ServerProcess) -> _Subscriber:
    """A subscriber of an instance started with --kv-events (ports from its /status), decoding
    vLLM 0.32's events with integer hashes."""
    info = server.status()["kv_events"]
    sub = _Subscriber(*(int(info[k].rsplit(":", 1)[1]) for k in ("endpoint", "replay_endpoint")))
    sub.decoder = msgspec.msgpack.Decoder(_KVEventBatch032)
    return sub


def test_kv_events_with_vllm_hashes_match_what_a_router_computes(tiny_llama, monkeypatch):
    """--kv-events (ports the instance chooses, shown in /status) with --prefix-caching-hash-algo
    sha256_cbor and PYTHONHASHSEED unset (vLLM's fixed root, H("vllm-none-hash")): every block the
    events announce is one a router computes from the prompt with vLLM's algorithm, salted
    requests included; and engine proxy's router, following the same /status, predicts the hit.
    (The hasher itself is held to hashes real vLLM computed: tests/test_vllm_block_hash.py.)"""
    from engine.vllm_block_hash import VllmBlockHasher
    from entrypoints.kv_router import KVRouter

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # neither the instance nor the router has one
    server = ServerProcess(str(tiny_llama), "--num-blocks", "32", "--max-model-len", "256", "--kv-events",
                           "--prefix-caching-hash-algo", "sha256_cbor")
    info = server.status()["kv_events"]
    # vLLM's root is never shown (with PYTHONHASHSEED set, the seed would be found from it).
    assert info["hash_algo"] == "sha256_cbor" and info["block_size"] == 16 and info["root_block_hash"] is None
    sub = vllm_subscriber(server)
    router = KVRouter()
    try:
        router.watch(server.url, info)
        assert sub.replayed(0)  # connected: the start-up batch
        prompts = {None: list(range(300, 350)), "tenant-a": list(range(300, 350))}  # 3 full blocks each
        for salt, prompt in prompts.items():
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        stored = [e for _, b in sub.live() for e in b.events if isinstance(e, _BlockStored032)]
        announced = [h for e in stored for h in e.block_hashes]
        expected = [h for salt, p in prompts.items() for h in VllmBlockHasher("sha256_cbor", 16).prompt_hashes(p, salt)]
        assert announced == expected
        assert [e.extra_keys for e in stored] == [[None, None, None], [("tenant-a",), None, None]]
        assert all(e.medium == "GPU" and e.group_idx == 0 for e in stored)
        deadline = time.monotonic() + 10
        while len(router.indexes[server.url].hashes) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        candidates = [types.SimpleNamespace(url=server.url, in_flight=0)]
        for salt in (None, "tenant-a", "tenant-b"):
            _, hit = router.choose(candidates, router.prompt_blocks(prompts["tenant-a"], salt))
            assert hit == (0 if salt == "tenant-b" else 48)
    finally:
        router.stop()
        sub.close()
        server.stop()


def test_off_loopback_events_need_the_secret_and_strangers_read_nothing(tiny_llama, tmp_path):
    pub, replay = free_port(), free_port()
    refused = subprocess.run([sys.executable, "-m", "entrypoints.cli", "serve", str(tiny_llama),
                              "--kv-events-config", _config(pub, replay, host="0.0.0.0")],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "without a deployment secret" in refused.stderr, refused.stderr
    secret = new_secret()
    server = ServerProcess(str(tiny_llama), "--num-blocks", "32", "--max-model-len", "256",
                           "--kv-events-config", _config(pub, replay, host="0.0.0.0"),
                           env={"ENGINE_KV_SECRET": secret})
    stranger, insider = _Subscriber(pub, replay), _Subscriber(pub, replay, KVSecret(secret))
    try:
        assert insider.replayed(0)  # the start-up batch
        assert stranger.replayed(0, timeout_ms=1000) is None
        body = {"prompt": list(range(200, 240)), "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert insider.live()
        assert stranger.live(timeout_ms=1000) == []
    finally:
        stranger.close()
        insider.close()
        server.stop()


def test_kv_events_flags():
    """--kv-events: ports chosen at bind on the API's host; with --kv-events-config, or
    --prefix-caching-hash-algo without events on, a refusal naming the flags."""
    import argparse

    from entrypoints.cli import kv_events_config

    def args(**kw):
        return argparse.Namespace(**{"kv_events": False, "kv_events_config": None, "prefix_caching_hash_algo": None,
                                     "host": "127.0.0.1", **kw})
    assert kv_events_config(args(kv_events=True))["endpoint"] == "tcp://127.0.0.1:0"
    assert kv_events_config(args(kv_events=True, host="::1"))["replay_endpoint"] == "tcp://[::1]:0"
    assert kv_events_config(args(kv_events_config="{}")) == "{}"
    with pytest.raises(ValueError, match="give one"):
        kv_events_config(args(kv_events=True, kv_events_config="{}"))
    with pytest.raises(ValueError, match="needs them on"):
        EngineConfig(prefix_caching_hash_algo="sha256")
    with pytest.raises(ValueError, match="needs them on"):
        EngineConfig(prefix_caching_hash_algo="sha256", kv_events_config='{"enable_kv_cache_events": false}')
    with pytest.raises(ValueError, match="sha256_cbor"):
        EngineConfig(prefix_caching_hash_algo="md5")


def test_bad_kv_events_config_is_refused_naming_the_field():
    for bad, field in (('{"enable_kv_cache_events": true, "publisher": "nats"}', "publisher"),
                       ('{"enable_kv_cache_events": true, "endpoint": "http://x"}', "endpoint"),
                       ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
                       ('{"enable_kv_cache_events": true, "colour": 1}', "colour"),
                       ("not json", "kv-events-config")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(kv_events_config=bad)
    assert EngineConfig(kv_events_config='{"enable_kv_cache_events": false}').kv_events_config is None
