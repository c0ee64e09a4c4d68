"""The P2P worker halves in one process over real zmq sockets: the same-host shared-memory
loan (scattered blocks, two consumers at once, a copy that outlives the lease), the socket
path through the staging buffer (multi-chunk), and the fallback when shared memory is off."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from engine.kv_transfer.p2p import LoadSpec, P2PMetadata, SendSpec, ipc_path
from engine.kv_transfer.p2p_worker import P2PConnectorWorker
from tests.server_utils import free_port

SHAPE = (2, 2, 64, 4, 2, 8)  # [layers, k/v, blocks, block_size, kv heads, head dim]
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4


def _producer() -> P2PConnectorWorker:
    worker = P2PConnectorWorker("p", "fp", "127.0.0.1", free_port(), chunk_bytes=3 * BLOCK_BYTES)  # 3-block chunks
    kv = worker.allocate_kv_cache(SHAPE, torch.float32, torch.device("cpu"))
    kv.copy_(torch.randn(SHAPE))
    worker.register_kv_caches(kv)
    return worker


@pytest.fixture
def producer():
    worker = _producer()
    yield worker
    worker.shutdown()
    assert worker.shm_path and not os.path.exists(worker.shm_path)  # the KV file is removed


def _consumer() -> P2PConnectorWorker:
    worker = P2PConnectorWorker("d", "fp", None, None)
    worker.register_kv_caches(torch.zeros(SHAPE))
    return worker


def _transfer(producer, consumer, rid: str, src: list[int], dst: list[int], addr: str, lease_s: float = 30):
    producer.start_load_kv(P2PMetadata(sends=[SendSpec(rid, src, len(src) * 4, time.monotonic() + lease_s)]))
    consumer.start_load_kv(P2PMetadata(loads=[LoadSpec(rid, addr, rid, 0, dst, time.monotonic() + 10)]))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        out = consumer.get_finished()
        if out.finished_recving or out.failed_recving:
            return out
        time.sleep(0.005)
    raise AssertionError("transfer never finished")


def _sent(producer, rid: str) -> None:
    deadline = time.monotonic() + 10
    while rid not in producer.get_finished().finished_sending:
        assert time.monotonic() < deadline, "the producer never released its blocks"
        time.sleep(0.005)


@pytest.mark.parametrize("tcp", [False, True], ids=["same-host-shm", "tcp"])
def test_scattered_transfer(producer, tcp):
    consumer = _consumer()
    try:
        src = random.Random(0).sample(range(64), 11)  # 4 socket chunks, the last one short
        dst = random.Random(1).sample(range(64), 11)
        addr = f"tcp://127.0.0.1:{producer.port}" if tcp else ipc_path(producer.port)
        out = _transfer(producer, consumer, "r1", src, dst, addr)
        assert out.finished_recving == {"r1"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, dst], producer.kv[:, :, src])
        assert consumer.stats["shm_loads"] == (0 if tcp else 1)
        _sent(producer, "r1")
    finally:
        consumer.shutdown()


def test_shared_memory_off_uses_the_socket(monkeypatch):
    monkeypatch.setenv("ENGINE_KV_SHM", "0")
    producer, consumer = _producer(), _consumer()
    try:
        assert not producer.shm_path
        out = _transfer(producer, consumer, "r", list(range(7)), list(range(7, 14)), ipc_path(producer.port))
        assert out.finished_recving == {"r"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, 7:14], producer.kv[:, :, :7])
        assert consumer.stats["shm_loads"] == 0
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_two_consumers_at_once(producer):
    consumers = [_consumer(), _consumer()]
    try:
        outs = {}
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, _transfer(
            producer, consumers[i], f"r{i}", list(range(i * 20, i * 20 + 20)), list(range(20)), ipc_path(producer.port))))
            for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, c in enumerate(consumers):
            assert outs[i].finished_recving == {f"r{i}"}, outs[i].failure_reasons
            assert torch.equal(c.kv[:, :, :20], producer.kv[:, :, i * 20:i * 20 + 20])
    finally:
        for c in consumers:
            c.shutdown()


def test_copy_that_outlives_the_lease_is_discarded(producer, monkeypatch):
    """The producer may reuse lent blocks once the lease ends; a consumer still copying must
    then fail the load (and recompute) rather than keep a copy that may be torn."""
    consumer = _consumer()
    copy = consumer._copy_blocks
    monkeypatch.setattr(consumer, "_copy_blocks", lambda *a: (time.sleep(1.0), copy(*a)))
    try:
        out = _transfer(producer, consumer, "slow", list(range(9)), list(range(9)), ipc_path(producer.port),
                        lease_s=0.5)
        assert out.failed_recving == {"slow"}
        assert "lease ended" in out.failure_reasons["slow"]
        _sent(producer, "slow")
        monkeypatch.setattr(consumer, "_copy_blocks", copy)  # the next transfer works
        out = _transfer(producer, consumer, "next", list(range(9)), list(range(9, 18)), ipc_path(producer.port))
        assert out.finished_recving == {"next"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, 9:18], producer.kv[:, :, :9])
    finally:
        consumer.shutdown()
