"""The threads beside the forward pass (the KV connectors' pull, serve and tier threads) run their
torch ops on themselves alone: a big KV copy there starts no OpenMP team, so libgomp keeps
spinning at the forward pass's barriers (engine/side_threads.py says why that matters: a decode
instance decoded at 11.6 instead of 6.7 ms a token once one of them had).

A team is seen as it is: native threads started during the measurement that Python does not know
(zmq's I/O threads, named ZMQbg, aside)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.kv_transfer.p2p import ipc_path
from engine.kv_transfer.stores import ChunkFormat
from engine.kv_transfer.stores.cpu import CPUStore
from engine.kv_transfer.tiered import ChunkLoad, TieredMetadata, TierLoad
from engine.kv_transfer.tiered_worker import TieredConnectorWorker, TieredStore
from engine.side_threads import side_thread
from tests.test_p2p_worker import _consumer_of, _load_result, _sent, _transfer, kv_tensor_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")

# [layers, k/v, blocks, block_size, kv heads, head dim]: a block of every layer is 32K floats,
# so a copy of a few blocks is far above ATen's grain for splitting an op across threads.
SHAPE = (4, 2, 32, 16, 4, 64)


def threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def openmp_workers_since(before: set[int]) -> set[int]:
    """Threads of this process started since ``before`` (its thread ids then) that are neither
    Python's nor zmq's: OpenMP team workers. (A thread that existed before is never counted,
    even a Python thread that is ending and has left threading.enumerate().)"""
    python = {t.native_id for t in threading.enumerate()}
    found = set()
    for tid in threads() - before - python:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read()
        except FileNotFoundError:  # ended meanwhile
            continue
        if not name.startswith("ZMQ"):
            found.add(tid)
    return found


@pytest.fixture(autouse=True)
def two_threads():
    """Two OpenMP threads for torch's ops, whatever this machine has, and the main thread's
    team started, as the forward pass has it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    big_copy()
    yield
    torch.set_num_threads(before)


def big_copy() -> None:
    x = torch.randn(1 << 22)
    index = torch.arange(0, x.numel(), 3)
    x.index_copy_(0, index, x.index_select(0, index) * 2)


def workers_started_in(make_thread) -> set[int]:
    """The OpenMP workers that appear while a thread made by ``make_thread(body)`` runs a big copy
    (measured before it ends: a thread's team ends with it)."""
    before = threads()
    seen: list[set[int]] = []

    def body() -> None:
        big_copy()
        seen.append(openmp_workers_since(before))
    thread = make_thread(body)
    thread.start()
    thread.join(30)
    return seen[0]


def test_a_side_threads_ops_start_no_openmp_team_where_a_plain_threads_do():
    # The measure works: a plain thread's big copy starts a team of its own.
    assert workers_started_in(lambda body: threading.Thread(target=body)), "no team seen: the measure is blind"
    assert workers_started_in(lambda body: side_thread(body, "test-side")) == set()


def test_a_side_thread_leaves_every_other_threads_count_alone():
    counts = {}
    thread = side_thread(lambda: counts.setdefault("side", torch.get_num_threads()), "test-side")
    thread.start()
    thread.join(30)
    later = threading.Thread(target=lambda: counts.setdefault("later", torch.get_num_threads()))
    later.start()
    later.join(30)
    # torch.set_num_threads(1) there would have made every thread started later single-threaded.
    assert counts == {"side": 1, "later": 2}
    assert torch.get_num_threads() == 2


def test_another_openmp_runtime_in_the_process_is_not_the_one_set():
    """Another package's copy of libgomp mapped beside torch's (a wheel's bundled one, the
    system's): the setting must reach the runtime ATen uses, not the first copy found. In a
    process of its own: two runtimes must not linger in this one."""
    # By its path: by name, the loader would hand back torch's copy (same soname).
    other = next((p for p in ("/usr/lib/x86_64-linux-gnu/libgomp.so.1", "/usr/lib64/libgomp.so.1",
                              "/usr/lib/aarch64-linux-gnu/libgomp.so.1") if os.path.exists(p)), None)
    if other is None:
        pytest.skip("no system libgomp to map beside torch's")
    script = (f"import ctypes, torch; ctypes.CDLL({other!r}); torch.set_num_threads(2)\n"
              "from engine.side_threads import side_thread\n"
              "seen = []\n"
              "t = side_thread(lambda: seen.append(torch.get_num_threads()), 'test-side'); t.start(); t.join(30)\n"
              "print(seen)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1]", out.stderr


def test_a_p2p_transfer_starts_no_openmp_team(monkeypatch):
    """The producer's gather (its serve thread) and the consumer's scatter (its pull threads),
    over the socket (P's KV is private by default; the shared-memory loan copies in pieces too
    small to split)."""
    monkeypatch.setenv("ENGINE_KV_SHM", "0")
    from engine.kv_transfer.p2p_worker import P2PConnectorWorker
    from tests.server_utils import free_port
    producer = P2PConnectorWorker("p", "fp", "127.0.0.1", free_port())
    producer.register_kv_caches(kv_tensor_for(producer, SHAPE))
    producer.kv.copy_(torch.randn(SHAPE))
    consumer = _consumer_of(SHAPE)
    try:
        before = threads()
        src, dst = list(range(0, 24, 2)), list(range(8, 20))
        out = _transfer(producer, consumer, "r", src, dst, ipc_path(producer.port))
        assert out.finished_recving == {"r"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, dst], producer.kv[:, :, src])
        assert consumer.counters["shm_loads"] == 0
        _sent(producer, "r")
        assert openmp_workers_since(before) == set()
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_tier_load_starts_no_openmp_team():
    """The tier's loaders copy a chunk into the paged KV."""
    fmt = ChunkFormat("m:float32:bs16", torch.float32, (SHAPE[0], 2, 8, *SHAPE[3:]))
    store = CPUStore(1 << 30, fmt)
    worker = TieredConnectorWorker(TieredStore([store]))
    worker.register_kv_caches(torch.zeros(SHAPE))
    try:
        chunk = torch.randn(fmt.shape)
        store.put("chunk", chunk)
        before = threads()
        worker.start_load_kv(TieredMetadata(loads=[TierLoad("r", [ChunkLoad("chunk", 0, list(range(10, 18)))])]))
        out = _load_result(worker)
        assert out.finished_recving == {"r"}, out.failure_reasons
        assert torch.equal(worker.kv[:, :, 10:18], chunk)
        time.sleep(0.05)
        assert openmp_workers_since(before) == set()
    finally:
        worker.shutdown()
