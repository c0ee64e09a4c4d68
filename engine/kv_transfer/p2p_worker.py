"""Disaggregated prefill over pyzmq: the worker half, which moves the bytes.

It composes the two jobs, each in its own file: ``P2PProducer`` serves ``drop_select`` pulls of
the lookup buffer (only on an instance with a KV port), ``P2PConsumer`` pulls into the blocks
the scheduler allocated. The wire format is in ``p2p_wire``. Here: where the KV tensor lives.
With ENGINE_KV_SHM=1 a producer on CPU keeps it in a /dev/shm file, so consumers on the same
host are lent blocks and copy them with one memcpy instead of receiving them over a socket.

Both halves open every socket with a challenge-response keyed by the deployment ``secret``
(with none, by a published key: no authentication, for loopback only); ``encrypt`` adds CURVE
on every socket. Same-host shared-memory copies never cross a network and are not encrypted.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading

import torch
import zmq

from engine import timeline
from engine.kv_transfer.base import KVConnectorWorker
from engine.kv_transfer.p2p import P2PMetadata
from engine.kv_transfer.p2p_consumer import P2PConsumer
from engine.kv_transfer.p2p_producer import STAGING_BYTES, P2PProducer
from engine.kv_transfer.p2p_wire import DEFAULT_CHUNK_BYTES
from engine.kv_transfer.secret import KVSecret
from engine.outputs import KVConnectorOutput, KVConnectorStats

__all__ = ["DEFAULT_CHUNK_BYTES", "STAGING_BYTES", "P2PConnectorWorker"]

logger = logging.getLogger("engine.kv_transfer")


def _remove_stale_shm_files() -> None:
    """KV files of producers that died without cleaning up (named engine-kv-<pid>-<id>)."""
    for name in os.listdir("/dev/shm"):
        if not name.startswith("engine-kv-"):
            continue
        try:
            pid = int(name.split("-")[2])
            os.kill(pid, 0)
        except (ValueError, IndexError):
            continue
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        except PermissionError:
            pass


class P2PConnectorWorker(KVConnectorWorker):
    def __init__(self, engine_id: str, fingerprint: str, bind_ip: str | None, port: int | None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, secret: KVSecret | None = None,
                 encrypt: bool = False) -> None:
        if encrypt and secret is None:
            raise ValueError("--kv-encrypt needs the deployment secret (--kv-secret-file or ENGINE_KV_SECRET): "
                             "the CURVE keys are derived from it")
        if encrypt and not zmq.has("curve"):
            raise ValueError("--kv-encrypt needs a libzmq built with CURVE, which this pyzmq lacks")
        self.engine_id = engine_id
        self.fingerprint = fingerprint
        self.bind_ip, self.port = bind_ip, port
        self.kv: torch.Tensor | None = None
        self.shm_path = ""  # the shared-memory file holding our KV tensor, if any
        self._ctx = zmq.Context()
        self._lock = threading.Lock()  # guards stats and each side's hand-over state
        self.counters = {"bytes_sent": 0, "bytes_received": 0, "seconds": [], "failures": {}, "shm_loads": 0,
                      "dropped_messages": 0, "lease_renewals": 0, "dropped_replies": 0, "abandoned_sends": 0,
                      "auth_failures": {}, "pulls": {}}  # the producer's refusals by reason: see auth_failures()
        self.producer = None if port is None else P2PProducer(
            self._ctx, self._lock, self.counters, engine_id, fingerprint, bind_ip, port, chunk_bytes, secret, encrypt)
        self.consumer = P2PConsumer(self._ctx, self._lock, self.counters, fingerprint, chunk_bytes, secret, encrypt)

    def kv_cache_file(self, shape, dtype, device) -> str | None:
        """Private memory unless ENGINE_KV_SHM=1: then a producer on CPU keeps its KV in a shared-memory
        file that same-host consumers map. Opt-in because, in benchmarks/disagg_shm_ab.py at 512 tokens,
        it measured +4.2/+6.6% P->D TTFT against +1.7/+1.1% with private KV (later runs on a noisier VM
        scatter both ways; see the README), for a faster same-host pull (5.9 vs 2.0 GB/s in
        benchmarks/disagg.py: less time to the second token, not the first). A non-CPU device or too
        little room in /dev/shm keep it private (peers use the socket)."""
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= dim
        if self.producer is None or torch.device(device).type != "cpu" or not os.path.isdir("/dev/shm"):
            return None
        _remove_stale_shm_files()  # also when off: files of crashed producers from before
        if os.environ.get("ENGINE_KV_SHM", "0") != "1":
            return None
        stat = os.statvfs("/dev/shm")
        if nbytes > 0.9 * stat.f_bavail * stat.f_frsize:  # a full tmpfs would SIGBUS on first touch
            logger.warning("/dev/shm has %.1f GiB free, too little for the %.1f GiB KV cache: same-host "
                           "peers will use the socket", stat.f_bavail * stat.f_frsize / 2**30, nbytes / 2**30)
            return None
        path = f"/dev/shm/engine-kv-{os.getpid()}-{self.engine_id}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # KV is private to this user
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.shm_path = path
        return path

    def register_kv_caches(self, kv_caches: torch.Tensor) -> None:
        # kv_caches: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv = kv_caches
        self.consumer.start(kv_caches)
        if self.producer is not None:
            self.producer.start(kv_caches, self.shm_path)

    def start_load_kv(self, metadata: P2PMetadata | None) -> None:
        if metadata is None:
            if self.producer is not None:
                self.producer.announce([])  # an earlier step's announcement that was never offered ends
            return
        if self.producer is not None:
            self.producer.withdraw(metadata.withdrawals)
            self.producer.announce(metadata.sends)
        self.consumer.submit(metadata)

    def save_kv(self, metadata: P2PMetadata | None) -> None:
        """After the step that computed their last prompt token, once its output is on its way
        (the model runner's save_kv): the offers go up. A pull that comes first waits for them
        (P2PProducer.announce)."""
        if metadata is not None and self.producer is not None:
            timeline.mark("kv.offered", *(spec.req_id for spec in metadata.sends))
            self.producer.offer(metadata.sends)

    def get_finished(self) -> KVConnectorOutput:
        sending = self.producer.take_finished() if self.producer is not None else set()
        recving, failed, traces = self.consumer.loads.take_with_traces()
        return KVConnectorOutput(sending, recving, set(failed), failed, load_traces=traces)

    def stats(self) -> KVConnectorStats:
        with self._lock:
            seconds, self.counters["seconds"] = self.counters["seconds"], []
            return KVConnectorStats(self.counters["bytes_sent"] + self.counters["bytes_received"],
                                    dict(self.counters["failures"]), seconds, dict(self.counters["auth_failures"]),
                                    pulls={peer: dict(p) for peer, p in self.counters["pulls"].items()})

    def auth_failures(self) -> dict[str, int]:
        """Messages the producer refused, by reason, since start: ``proof`` (a handshake whose
        proof did not verify) and ``unauthenticated`` (anything else from a peer without a
        session). The consumer's own failed handshakes are load failures, reason ``auth``."""
        with self._lock:
            return dict(self.counters["auth_failures"])

    def shutdown(self) -> None:
        self.consumer.shutdown()
        if self.producer is not None:
            self.producer.shutdown()
        self._ctx.term()
        if self.shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)
