"""KV events (engine/kv_events.py): what the block pool reports, the wire format a vLLM
subscriber decodes, and a real `engine serve` publishing them: stored blocks carry the hashes
anyone computes from the tokens, evictions are reported, gaps are filled by replay, and off
loopback nothing is readable without the deployment secret."""
from __future__ import annotations

import json
import subprocess
import sys
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


# The subscriber's types of vLLM's examples/online_serving/kv_events_subscriber.py, with our
# hashes (bytes where vLLM's example has int): what a vLLM-format consumer decodes.
class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class _KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
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
    assert pool.kv_events == [BlockStored([hashes[0]], None, tokens[:16], 16, None, None),
                              BlockStored(hashes[1:], hashes[0], tokens[16:], 16, None, None)]
    pool.kv_events.clear()
    pool.free_blocks(reversed(blocks))
    assert pool.kv_events == []  # freed blocks stay cached (lazy eviction)
    pool.get_new_blocks(4)  # two empty blocks, then the two least recently freed cached ones
    assert pool.kv_events == [BlockRemoved([hashes[3], hashes[2]], None)]
    pool.kv_events.clear()
    pool.uncache(blocks)
    assert pool.kv_events == [BlockRemoved([hashes[0], hashes[1]], None)]


def test_wire_format_decodes_as_vllms():
    batch = KVEventBatch(1.5, [AllBlocksCleared(), BlockStored([b"h" * 32], None, [1, 2], 16, None, None),
                               BlockRemoved([b"h" * 32], None)])
    decoded = msgspec.msgpack.Decoder(_KVEventBatch).decode(msgspec.msgpack.encode(batch))
    assert decoded.ts == 1.5
    assert [type(e).__name__ for e in decoded.events] == ["_AllBlocksCleared", "_BlockStored", "_BlockRemoved"]
    assert decoded.events[1].block_hashes == [b"h" * 32] and decoded.events[1].token_ids == [1, 2]


def _config(pub: int, replay: int, host: str = "127.0.0.1") -> str:
    return json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://{host}:{pub}",
                       "replay_endpoint": f"tcp://{host}:{replay}"})


class _Subscriber:
    def __init__(self, pub: int, replay: int, secret: KVSecret | None = None) -> None:
        self.ctx = zmq.Context()
        self.sub, self.replay = self.ctx.socket(zmq.SUB), self.ctx.socket(zmq.DEALER)
        for sock in (self.sub, self.replay):
            sock.setsockopt(zmq.LINGER, 0)
            if secret is not None:
                sock.curve_serverkey = event_keys(secret, "server")[0]
                sock.curve_publickey, sock.curve_secretkey = event_keys(secret, "client")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        self.sub.connect(f"tcp://127.0.0.1:{pub}")
        self.replay.connect(f"tcp://127.0.0.1:{replay}")
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
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
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


def test_bad_kv_events_config_is_refused_naming_the_field():
    for bad, field in (('{"enable_kv_cache_events": true, "publisher": "nats"}', "publisher"),
                       ('{"enable_kv_cache_events": true, "endpoint": "http://x"}', "endpoint"),
                       ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
                       ('{"enable_kv_cache_events": true, "colour": 1}', "colour"),
                       ("not json", "kv-events-config")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(kv_events_config=bad)
    assert EngineConfig(kv_events_config='{"enable_kv_cache_events": false}').kv_events_config is None
