"""Disaggregated prefill over pyzmq: the worker half, which moves the bytes.

Producer: a ROUTER socket (tcp, plus ipc for peers on the same host) serves ``drop_select``
pulls of the lookup buffer. An entry leaves the buffer when it is selected or when its lease
ends; either way the scheduler is told (``finished_sending``) and frees the blocks only then.

Consumer: a DEALER socket per peer pulls into the blocks the scheduler allocated. Every
pull has a fresh transfer id, a deadline and in-order chunks whose dtype, shape and length
are checked before a byte is written (the transports already checksum their bytes; a sender
may add a CRC32, which is then verified too); anything else (late, duplicate, reordered,
truncated frames, or frames for a cancelled transfer) is dropped. A failed peer socket is
closed and re-created, so stale state never survives into the next handshake.

Same host: the producer's KV tensor lives in a /dev/shm file (when /dev/shm has room). A
consumer on the same host maps it and, on a pull, is lent the blocks (``ShmGrant``): it copies
them straight into its own blocks (one memcpy, no socket bytes) and returns the loan
(``ShmDone``). The producer keeps the blocks until then, or until the lease ends; in that case
it answers ``ShmAck(ok=False)`` and the consumer discards what it copied.

Socket path (other hosts, or no shared memory): the producer gathers each chunk of scattered
blocks into one of two slots of a private staging buffer, counted in the KV budget, and sends
the slot as a zero-copy frame; it gathers chunk k+1 while chunk k is on the wire and reuses a
slot only after zmq has released it (backpressure instead of growth).

Wire format: frame 0 is a msgspec message; chunk data follows as one raw frame.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
import zlib

import msgspec
import torch
import zmq

from engine.kv_transfer.base import KVConnectorWorker, contiguous_runs
from engine.kv_transfer.p2p import LoadSpec, P2PMetadata, SendSpec, ipc_path
from engine.outputs import KVConnectorOutput

logger = logging.getLogger("engine.kv_transfer")

PROTOCOL_VERSION = 1
NUM_PULLERS = 4
DEFAULT_CHUNK_BYTES = 16 * 2**20  # staging memory: two chunks in flight (double buffering)


class Hello(msgspec.Struct, tag="hello"):
    fingerprint: str
    version: int = PROTOCOL_VERSION


class HelloReply(msgspec.Struct, tag="hello_reply"):
    ok: bool
    engine_id: str
    fingerprint: str
    message: str = ""
    # Same-host fast path: the producer's KV tensor lives in this shared-memory file.
    shm_path: str = ""
    shm_shape: list[int] = []


class Pull(msgspec.Struct, tag="pull"):
    transfer_id: str
    request_id: str
    start_block: int
    num_blocks: int
    shm: bool = False  # the consumer will copy straight out of the producer's shared KV tensor


class ShmGrant(msgspec.Struct, tag="shm_grant"):
    """The blocks to copy; they stay untouched until ShmDone (or the lease) ends the loan."""
    transfer_id: str
    block_ids: list[int]


class ShmDone(msgspec.Struct, tag="shm_done"):
    transfer_id: str
    request_id: str


class ShmAck(msgspec.Struct, tag="shm_ack"):
    """ok=False: the lease ran out while the consumer copied, so the copy may be torn."""
    transfer_id: str
    ok: bool


class Release(msgspec.Struct, tag="release"):
    request_id: str


class Chunk(msgspec.Struct, tag="chunk"):
    transfer_id: str
    status: str  # "ok" | "not_found" | "error"
    message: str = ""
    seq: int = 0
    num_chunks: int = 0
    first_block: int = 0
    num_blocks: int = 0
    dtype: str = ""
    shape: list[int] = []
    nbytes: int = 0
    crc32: int = 0


WireMessage = Hello | HelloReply | Pull | Release | Chunk | ShmGrant | ShmDone | ShmAck


def _released(tracker: zmq.MessageTracker | None, timeout: float = 30.0) -> bool:
    """Whether zmq is done with a zero-copy frame (its memory may be reused)."""
    if tracker is None:
        return True
    try:
        tracker.wait(timeout)
        return True
    except zmq.NotDone:
        return False


def _inject_fault(fault: str | None, header: Chunk, payload: memoryview) -> list[tuple[Chunk, memoryview]]:
    """The chunk messages to put on the wire, damaged on purpose when a test asks for it:
    the consumer must reject every one of these without writing a byte."""
    if fault is None:
        return [(header, payload)]
    if fault.startswith("delay="):
        time.sleep(float(fault.split("=", 1)[1]))
        return [(header, payload)]
    changed = msgspec.structs.replace
    if fault == "corrupt":  # flipped bits under a checksum of the original bytes
        damaged = bytearray(payload)
        damaged[len(damaged) // 2] ^= 0xFF
        return [(changed(header, crc32=zlib.crc32(payload)), memoryview(damaged))]
    return {
        "drop": [],
        "truncate": [(header, payload[:payload.nbytes // 2])],
        "duplicate": [(header, payload), (header, payload)],
        "reorder": [(changed(header, seq=header.seq + 1), payload), (header, payload)],
        "bad_dtype": [(changed(header, dtype="float16"), payload)],
        "bad_shape": [(changed(header, shape=[*header.shape[:2], header.shape[2] + 1, *header.shape[3:]]), payload)],
    }[fault]


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
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.engine_id = engine_id
        self.fingerprint = fingerprint
        self.chunk_bytes = chunk_bytes
        self.kv: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._buffer: dict[str, SendSpec] = {}  # the lookup buffer: request id -> KV on offer
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed: dict[str, str] = {}
        self._cancelled: set[str] = set()
        self._outstanding: set[str] = set()  # loads queued or running
        self._jobs: queue.Queue[LoadSpec | tuple[str, str]] = queue.Queue()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self.stats = {"bytes_sent": 0, "bytes_received": 0, "seconds": [], "failures": {}, "shm_loads": 0}
        # Several pullers, each with its own peer sockets: a transfer that stalls (a dropped
        # frame waits for its deadline) never holds up the others.
        self._threads = [threading.Thread(target=self._pull_loop, name=f"kv-pull-{i}", daemon=True)
                         for i in range(NUM_PULLERS)]
        self.bind_ip, self.port = bind_ip, port
        self.shm_path = ""
        self._staging: torch.Tensor | None = None  # uint8 [2 * slot_bytes], producers only
        # request id -> (entry, transfer id, blocks granted) while a same-host consumer copies
        self._lent: dict[str, tuple[SendSpec, str, int]] = {}
        if port is not None:
            self._threads.append(threading.Thread(target=self._serve_loop, name="kv-serve", daemon=True))
            self._server_ready = threading.Event()

    # ---- engine-facing -----------------------------------------------------------------
    def allocate_kv_cache(self, shape, dtype, device) -> torch.Tensor:
        """A producer on CPU keeps its KV in a shared-memory file that same-host consumers map
        (measured: no slower for the forward pass than private memory). ENGINE_KV_SHM=0, a
        non-CPU device or too little room in /dev/shm keep it private (peers use the socket)."""
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= dim
        if (self.port is None or torch.device(device).type != "cpu" or not os.path.isdir("/dev/shm")
                or os.environ.get("ENGINE_KV_SHM", "1") == "0"):
            return super().allocate_kv_cache(shape, dtype, device)
        _remove_stale_shm_files()
        stat = os.statvfs("/dev/shm")
        if nbytes > 0.9 * stat.f_bavail * stat.f_frsize:  # a full tmpfs would SIGBUS on first touch
            logger.warning("/dev/shm has %.1f GiB free, too little for the %.1f GiB KV cache: same-host "
                           "peers will use the socket", stat.f_bavail * stat.f_frsize / 2**30, nbytes / 2**30)
            return super().allocate_kv_cache(shape, dtype, device)
        path = f"/dev/shm/engine-kv-{os.getpid()}-{self.engine_id}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # KV is private to this user
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.shm_path = path
        kv = torch.from_file(path, shared=True, size=nbytes // dtype.itemsize, dtype=dtype).view(shape)
        kv.zero_()  # commit the pages now, so no forward pass pays for page faults
        return kv

    def register_kv_caches(self, kv_caches: torch.Tensor) -> None:
        # kv_caches: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv = kv_caches
        self.block_shape = list(kv_caches.shape[3:])
        self.bytes_per_block = kv_caches[:, :, 0].numel() * kv_caches.element_size()
        self.blocks_per_chunk = max(1, self.chunk_bytes // self.bytes_per_block)
        self.slot_bytes = self.blocks_per_chunk * self.bytes_per_block
        if self.port is not None:  # socket sends gather into two slots of this buffer
            self._staging = torch.empty(2 * self.slot_bytes, dtype=torch.uint8)
        for t in self._threads:
            t.start()
        if self.port is not None and not self._server_ready.wait(10):
            raise RuntimeError(f"KV server did not bind port {self.port}")

    def start_load_kv(self, metadata: P2PMetadata | None) -> None:
        if metadata is None:
            return
        with self._lock:
            for spec in metadata.sends:
                self._buffer[spec.req_id] = spec
            # A cancel for a load that already finished is moot (and would linger).
            self._cancelled.update(r for r in metadata.cancels if r in self._outstanding)
            self._outstanding.update(spec.req_id for spec in metadata.loads)
        for spec in metadata.loads:
            self._jobs.put(spec)
        for addr, remote_request_id in metadata.releases:
            self._jobs.put((addr, remote_request_id))

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            out = KVConnectorOutput(self._done_sending, self._done_recving, set(self._failed), dict(self._failed))
            self._done_sending, self._done_recving, self._failed = set(), set(), {}
        return out

    def transfer_stats(self) -> tuple[int, dict[str, int], list[float]]:
        with self._lock:
            seconds, self.stats["seconds"] = self.stats["seconds"], []
            return (self.stats["bytes_sent"] + self.stats["bytes_received"], dict(self.stats["failures"]), seconds)

    def shutdown(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(2)
        self._ctx.term()
        if self.shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)

    # ---- producer ----------------------------------------------------------------------
    def _serve_loop(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://{self.bind_ip}:{self.port}")
        sock.bind(ipc_path(self.port))
        self._server_ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    frames = sock.recv_multipart()
                    identity = frames[0]
                    try:
                        msg = msgspec.msgpack.decode(frames[-1], type=WireMessage)
                    except msgspec.DecodeError:
                        logger.warning("dropped an undecodable KV control message")
                        continue
                    if isinstance(msg, Hello):
                        ok = msg.fingerprint == self.fingerprint and msg.version == PROTOCOL_VERSION
                        message = "" if ok else (f"incompatible KV peer: theirs {msg.fingerprint} (v{msg.version}), "
                                                 f"ours {self.fingerprint} (v{PROTOCOL_VERSION})")
                        sock.send_multipart([identity, msgspec.msgpack.encode(HelloReply(
                            ok, self.engine_id, self.fingerprint, message, self.shm_path,
                            list(self.kv.shape) if self.shm_path else []))])
                    elif isinstance(msg, Pull) and msg.shm and self.shm_path and not self._has_fault(msg):
                        self._lend(sock, identity, msg)
                    elif isinstance(msg, ShmDone):
                        with self._lock:
                            lent = self._lent.get(msg.request_id)
                            ok = lent is not None and lent[1] == msg.transfer_id
                            if ok:
                                del self._lent[msg.request_id]
                                self._done_sending.add(msg.request_id)
                                self.stats["bytes_sent"] += lent[2] * self.bytes_per_block
                        sock.send_multipart([identity, msgspec.msgpack.encode(ShmAck(msg.transfer_id, ok))])
                    elif isinstance(msg, Pull):
                        self._send(sock, identity, msg)
                    elif isinstance(msg, Release):
                        with self._lock:
                            if self._buffer.pop(msg.request_id, None) is not None:
                                self._done_sending.add(msg.request_id)
                self._expire_leases()
        finally:
            sock.close(linger=0)

    def _has_fault(self, pull: Pull) -> bool:
        with self._lock:
            entry = self._buffer.get(pull.request_id)
        return entry is not None and entry.fault is not None

    def _lend(self, sock, identity: bytes, pull: Pull) -> None:
        with self._lock:
            entry = self._buffer.pop(pull.request_id, None)
            if entry is not None:
                self._lent[pull.request_id] = (entry, pull.transfer_id, pull.num_blocks)
        if entry is None:
            reply = Chunk(pull.transfer_id, "not_found", f"no KV held for {pull.request_id} (expired, sent or unknown)")
        else:
            reply = ShmGrant(pull.transfer_id, entry.block_ids[pull.start_block:pull.start_block + pull.num_blocks])
        sock.send_multipart([identity, msgspec.msgpack.encode(reply)])

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, e in self._buffer.items() if e.lease_deadline < now]
            for rid in expired:
                del self._buffer[rid]
                self._done_sending.add(rid)
            for rid in [rid for rid, (e, _, _) in self._lent.items() if e.lease_deadline < now]:
                del self._lent[rid]  # a consumer copying now gets ok=False and discards its copy
                self._done_sending.add(rid)
        for rid in expired:
            logger.warning("KV lease of %s expired before any decode pulled it; blocks freed", rid)

    def _send(self, sock, identity: bytes, pull: Pull) -> None:
        with self._lock:  # drop_select: the entry leaves the buffer as it is selected
            entry = self._buffer.pop(pull.request_id, None)
        if entry is None:
            sock.send_multipart([identity, msgspec.msgpack.encode(Chunk(
                pull.transfer_id, "not_found", f"no KV held for {pull.request_id} (expired, sent or unknown)"))])
            return
        try:
            blocks = entry.block_ids[pull.start_block:pull.start_block + pull.num_blocks]
            if len(blocks) != pull.num_blocks:
                sock.send_multipart([identity, msgspec.msgpack.encode(Chunk(
                    pull.transfer_id, "error", f"asked for {pull.num_blocks} blocks from {pull.start_block}, "
                                               f"held {len(entry.block_ids)}"))])
                return
            start = time.perf_counter()
            if self._send_chunks(sock, identity, pull.transfer_id, blocks, entry.fault):
                with self._lock:
                    self.stats["seconds"].append(time.perf_counter() - start)
        finally:
            with self._lock:
                self._done_sending.add(pull.request_id)

    def _send_chunks(self, sock, identity: bytes, transfer_id: str, blocks: list[int], fault: str | None) -> bool:
        """Gather chunk k into slot k % 2 once zmq has released the slot's previous chunk.
        False: the wire stalled and the transfer was abandoned."""
        per_chunk = self.blocks_per_chunk
        num_chunks = -(-len(blocks) // per_chunk)
        in_flight: list[zmq.MessageTracker | None] = [None, None]
        for seq in range(num_chunks):
            slot = seq % 2
            if not _released(in_flight[slot]):
                return False
            ids = blocks[seq * per_chunk:(seq + 1) * per_chunk]
            raw = self._staging[slot * self.slot_bytes:][:len(ids) * self.bytes_per_block]
            data = self._gather(ids, raw)  # raw as [num_layers, 2, len(ids), block_size, heads, head_dim]
            payload = memoryview(raw.numpy())
            header = Chunk(transfer_id, "ok", seq=seq, num_chunks=num_chunks, first_block=seq * per_chunk,
                           num_blocks=len(ids), dtype=str(data.dtype).removeprefix("torch."),
                           shape=list(data.shape), nbytes=payload.nbytes)
            in_flight[slot] = None
            for h, frame in _inject_fault(fault, header, payload):
                in_flight[slot] = sock.send_multipart([identity, msgspec.msgpack.encode(h), frame],
                                                      copy=False, track=True)
            with self._lock:
                self.stats["bytes_sent"] += payload.nbytes
        return all(_released(tracker) for tracker in in_flight)

    def _gather(self, ids: list[int], raw: torch.Tensor) -> torch.Tensor:
        """Copy blocks ``ids`` into the staging bytes ``raw``; returns them viewed as KV."""
        out = raw.view(self.kv.dtype).view(self.kv.shape[0], 2, len(ids), *self.block_shape)
        index = torch.tensor(ids, dtype=torch.int64, device=self.kv.device)
        if self.kv.device.type == "cpu":
            torch.index_select(self.kv, 2, index, out=out)
        else:
            out.copy_(self.kv.index_select(2, index))
        return out

    # ---- consumer ----------------------------------------------------------------------
    def _pull_loop(self) -> None:
        peers: dict[str, zmq.Socket] = {}
        try:
            while not self._stop.is_set():
                try:
                    job = self._jobs.get(timeout=0.1)
                except queue.Empty:
                    continue
                if isinstance(job, tuple):  # a release: fire and forget, the lease is the backstop
                    addr, remote_request_id = job
                    if addr not in peers:
                        peer, error = self._connect(addr, time.monotonic() + 5)
                        if peer is None:
                            continue
                        peers[addr] = peer
                    peers[addr][0].send(msgspec.msgpack.encode(Release(remote_request_id)))
                    continue
                error = self._load(job, peers)
                with self._lock:
                    self._cancelled.discard(job.req_id)
                    self._outstanding.discard(job.req_id)
                    if error is None:
                        self._done_recving.add(job.req_id)
                    else:
                        self._failed[job.req_id] = error
                        reason = error.split(":")[0]  # errors start with their reason
                        self.stats["failures"][reason] = self.stats["failures"].get(reason, 0) + 1
                if error is not None:
                    logger.warning("KV load of %s from %s failed: %s", job.req_id, job.remote_addr, error)
                    peer = peers.pop(job.remote_addr, None)
                    if peer is not None:  # drop anything queued or in flight on it
                        peer[0].close(linger=0)
        finally:
            for sock, _ in peers.values():
                sock.close(linger=0)

    def _connect(self, addr: str, deadline: float) -> tuple[tuple | None, str | None]:
        """(socket, the peer's shared KV tensor or None), or an error."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        sock.send(msgspec.msgpack.encode(Hello(self.fingerprint)))
        reply = self._recv(sock, deadline, lambda m: isinstance(m, HelloReply))
        if isinstance(reply, str):
            sock.close(linger=0)
            return None, f"{reply} (handshake with {addr})"
        if not reply.ok:
            sock.close(linger=0)
            return None, f"incompatible: {reply.message}"
        return (sock, self._map_peer_kv(addr, reply)), None

    def _map_peer_kv(self, addr: str, reply: HelloReply) -> torch.Tensor | None:
        if not (addr.startswith("ipc://") and reply.shm_path and os.path.exists(reply.shm_path)):
            return None
        shape = list(reply.shm_shape)
        if len(shape) != self.kv.dim() or shape[:2] + shape[3:] != list(self.kv.shape[:2]) + self.block_shape:
            return None
        numel = 1
        for dim in shape:
            numel *= dim
        try:
            return torch.from_file(reply.shm_path, shared=True, size=numel, dtype=self.kv.dtype).view(shape)
        except (RuntimeError, OSError) as exc:
            logger.warning("cannot map %s (%s); using the socket path", reply.shm_path, exc)
            return None

    def _recv(self, sock, deadline: float, accept, req_id: str | None = None):
        """The next accepted message (with its raw frames), or an error string."""
        while True:
            if req_id is not None and req_id in self._cancelled:
                return "cancelled: the request ended"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout: no KV before the deadline"
            if self._stop.is_set():
                return "shutdown"
            if not sock.poll(min(50, int(remaining * 1000) + 1)):
                continue
            frames = sock.recv_multipart(copy=False)
            try:
                msg = msgspec.msgpack.decode(frames[0].buffer, type=WireMessage)
            except msgspec.DecodeError:
                continue
            if accept(msg):
                return (msg, frames) if req_id is not None else msg

    def _load(self, job: LoadSpec, peers: dict) -> str | None:
        """Pull one request's KV into its blocks; None on success, else "<reason>: <detail>"."""
        addr = job.remote_addr
        peer = peers.get(addr)
        if peer is None:
            peer, error = self._connect(addr, job.deadline)
            if peer is None:
                return error
            peers[addr] = peer
        sock, peer_kv = peer
        transfer_id = uuid.uuid4().hex
        start = time.perf_counter()
        sock.send(msgspec.msgpack.encode(Pull(transfer_id, job.remote_request_id, job.start_block,
                                              len(job.block_ids), shm=peer_kv is not None)))
        got = self._recv(sock, job.deadline, lambda m: getattr(m, "transfer_id", None) == transfer_id, job.req_id)
        if isinstance(got, str):
            return got
        first, frames = got
        if isinstance(first, ShmGrant):
            error = self._copy_shm(sock, peer_kv, job, transfer_id, first)
        elif isinstance(first, Chunk):  # the producer chose the socket path
            error = self._receive_chunks(sock, job, transfer_id, first, frames)
        else:
            error = f"frame rejected: unexpected {type(first).__name__}"
        if error is None:
            with self._lock:
                self.stats["shm_loads"] += isinstance(first, ShmGrant)
                self.stats["bytes_received"] += len(job.block_ids) * self.bytes_per_block
                self.stats["seconds"].append(time.perf_counter() - start)
        return error

    def _copy_shm(self, sock, peer_kv: torch.Tensor, job: LoadSpec, transfer_id: str, grant: ShmGrant) -> str | None:
        if len(grant.block_ids) != len(job.block_ids) or max(grant.block_ids, default=0) >= peer_kv.shape[2]:
            return "frame rejected: bad shared-memory grant"
        self._copy_blocks(peer_kv, grant.block_ids, job.block_ids)
        sock.send(msgspec.msgpack.encode(ShmDone(transfer_id, job.remote_request_id)))
        got = self._recv(sock, job.deadline, lambda m: isinstance(m, ShmAck) and m.transfer_id == transfer_id,
                         job.req_id)
        if isinstance(got, str):
            return got
        return None if got[0].ok else "timeout: the producer's lease ended during the copy"

    def _copy_blocks(self, peer_kv: torch.Tensor, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """One copy per run of consecutive blocks, straight from the peer's tensor into ours."""
        for src, dst, n in contiguous_runs(src_blocks, dst_blocks):
            self.kv[:, :, dst:dst + n].copy_(peer_kv[:, :, src:src + n])

    def _receive_chunks(self, sock, job: LoadSpec, transfer_id: str, chunk: Chunk, frames) -> str | None:
        dst = torch.tensor(job.block_ids, dtype=torch.int64, device=self.kv.device)
        expected_seq, done_blocks = 0, 0
        dtype = str(self.kv.dtype).removeprefix("torch.")
        while True:
            if chunk.status != "ok":
                return f"{chunk.status}: {chunk.message}"
            expected_shape = [self.kv.shape[0], 2, chunk.num_blocks, *self.block_shape]
            problem = None
            if chunk.seq != expected_seq or chunk.first_block != done_blocks:
                problem = f"out of order: chunk {chunk.seq} at block {chunk.first_block}, expected {expected_seq}"
            elif chunk.dtype != dtype or chunk.shape != expected_shape:
                problem = f"bad header: {chunk.dtype}{chunk.shape}, expected {dtype}{expected_shape}"
            elif len(frames) != 2 or frames[1].buffer.nbytes != chunk.nbytes:
                problem = f"truncated: {sum(f.buffer.nbytes for f in frames[1:])} of {chunk.nbytes} bytes"
            elif chunk.crc32 and zlib.crc32(frames[1].buffer) != chunk.crc32:
                problem = "corrupt: checksum mismatch"
            elif done_blocks + chunk.num_blocks > len(job.block_ids):
                problem = "too many blocks"
            if problem is not None:
                return f"frame rejected: {problem}"
            raw = torch.frombuffer(frames[1].buffer, dtype=torch.uint8)
            data = raw.view(self.kv.dtype).view(expected_shape).to(self.kv.device)
            self.kv.index_copy_(2, dst[done_blocks:done_blocks + chunk.num_blocks], data)
            done_blocks += chunk.num_blocks
            expected_seq += 1
            if expected_seq == chunk.num_chunks:
                return None if done_blocks == len(job.block_ids) else (
                    f"frame rejected: got {done_blocks} of {len(job.block_ids)} blocks")
            got = self._recv(sock, job.deadline, lambda m: isinstance(m, Chunk) and m.transfer_id == transfer_id,
                             job.req_id)
            if isinstance(got, str):
                return got
            chunk, frames = got
