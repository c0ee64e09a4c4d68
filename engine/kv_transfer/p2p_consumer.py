"""Disaggregated prefill, consumer side: pulls KV from producers into the blocks the
scheduler allocated.

A DEALER socket per peer (per puller thread) pulls. Every pull has a fresh transfer id, a
deadline and in-order chunks whose dtype, shape and length are checked before a byte is written
(the transports already checksum their bytes; a sender may add a CRC32, which is then verified
too); anything else (late, duplicate, reordered, truncated frames, or frames for a cancelled
transfer) is dropped. A failed peer socket is closed and re-created, so stale state never
survives into the next handshake.

Authentication (``p2p_wire``): a peer is sent nothing about us or our requests until it has
proved it holds the deployment secret, and a peer that cannot, or that refuses our proof, fails
the load as ``auth``. With ``encrypt`` every socket is a CURVE client (keys derived from the
secret); a failed transport handshake (one side encrypts, the other not, or other secrets) is
seen on a socket monitor and fails the load at once, as ``auth`` too, also where zmq reconnects
a socket we keep (a producer restarted on its address with other settings).

Same host: the consumer maps the producer's shared-memory KV file and, when lent the blocks
(``ShmGrant``), copies them straight into its own (one memcpy, no socket bytes), then returns the
loan (``ShmDone``); ``ShmAck(ok=False)`` means the lease ended meanwhile and the copy is discarded.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
import zlib

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.kv_transfer.base import LoadBook, contiguous_runs, queued
from engine.kv_transfer.device_copies import off_step_stream
from engine.kv_transfer.p2p import LoadSpec, P2PMetadata, ReleaseSpec, RenewSpec
from engine.kv_transfer.p2p_peers import Peer, PeerCache, close_monitored, monitored_socket
from engine.kv_transfer.p2p_wire import (
    FRAME_SLACK_BYTES, NO_AUTH_SECRET, NONCE_BYTES, Auth, Challenge, Chunk, ChunkLayout, Hello, HelloReply, Pull,
    Refused, Release, Renew, SessionTag, ShmAck, ShmDone, ShmGrant, curve_keys, decode, encode, proof,
    proof_ok,
)
from engine.kv_transfer.secret import KVSecret
from engine.side_threads import side_thread
from engine.request_trace import KVLoadTrace

logger = logging.getLogger("engine.kv_transfer")

NUM_PULLERS = 4
# Releases and renewals go out on a thread of their own, so they never wait behind pulls nor
# make a pull wait. Fire and forget: the lease is the backstop. A peer that could not be
# reached is skipped for a while (renewals to a dead prefill would otherwise each wait out a
# connect), and messages beyond the queue's bound are dropped.
CONTROL_CONNECT_S = 2.0
UNREACHABLE_SKIP_S = 10.0
MAX_CONTROL_QUEUE = 4096
MAX_PEERS_COUNTED = 64  # producers whose pulls /status reports (only signed offers make one)


UNSENDABLE = "unreachable: our connection to the KV peer takes nothing"
TRANSPORT_FAILED = "auth: the transport handshake failed"


REFUSED = "auth: the KV peer refused us"


class P2PConsumer:
    """Pulls on ``NUM_PULLERS`` threads, releases and renewals on one more. ``stats`` and
    ``lock`` are shared with the producer of the same worker; everything else here is the
    consumer's own."""

    def __init__(self, ctx: zmq.Context, lock: threading.Lock, stats: dict, fingerprint: str,
                 chunk_bytes: int, secret: KVSecret | None, encrypt: bool) -> None:
        self._ctx, self._lock, self.stats = ctx, lock, stats
        self.fingerprint = fingerprint
        self._secret, self._encrypt = secret or NO_AUTH_SECRET, encrypt
        self.chunk_bytes = chunk_bytes
        self.kv: torch.Tensor | None = None
        self.loads = LoadBook()
        self._jobs: queue.Queue[LoadSpec] = queue.Queue()
        self._control: queue.Queue[ReleaseSpec | RenewSpec] = queue.Queue(MAX_CONTROL_QUEUE)
        self._stop = threading.Event()
        # Several pullers, each with its own peer sockets: a transfer that stalls (a dropped
        # frame waits for its deadline) never holds up the others.
        self._threads = [side_thread(self._pull_loop, f"kv-pull-{i}")
                         for i in range(NUM_PULLERS)]
        self._threads.append(side_thread(self._control_loop, "kv-control"))

    def start(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.layout = ChunkLayout.of(kv, self.chunk_bytes)
        for t in self._threads:
            t.start()

    def submit(self, metadata: P2PMetadata) -> None:
        self.loads.submit([spec.req_id for spec in metadata.loads], metadata.cancels)
        for spec in metadata.loads:
            self._jobs.put(spec)
        for message in (*metadata.releases, *metadata.renewals):
            try:
                self._control.put_nowait(message)
            except queue.Full:
                with self._lock:
                    self.stats["dropped_messages"] += 1

    def take_finished(self) -> tuple[set[str], dict[str, str]]:
        """(loads done, loads failed with their reason) since the last call."""
        return self.loads.take()

    def shutdown(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(2)

    def _pull_loop(self) -> None:
        peers = PeerCache()
        try:
            for job in queued(self._jobs, self._stop, idle=peers.tidy):
                peers.tidy()
                started, began = time.perf_counter(), time.monotonic()
                attempts = 1
                try:
                    error, attempts = self._load(job, peers)
                except Exception as exc:  # (zmq out of sockets, a bug): this load fails, the puller goes on
                    logger.exception("KV load of %s failed", job.req_id)
                    error = f"internal: {type(exc).__name__}: {exc}"
                reason = None if error is None else error.split(":")[0]  # errors start with their reason
                with self._lock:
                    if reason is not None:
                        self.stats["failures"][reason] = self.stats["failures"].get(reason, 0) + 1
                    if reason in (None, "timeout"):  # what the link cost (a refusal says nothing of it)
                        self._count_pull(job, time.perf_counter() - started, timed_out=reason is not None)
                self.loads.finish(job.req_id, error, KVLoadTrace(
                    "p2p", began, time.monotonic(), len(job.block_ids) * self.layout.block_shape[0],
                    0 if error is not None else len(job.block_ids) * self.layout.bytes_per_block,
                    job.peer or job.remote_addr, attempts, reason or "ok", error))
                if error is not None:
                    logger.warning("KV load of %s from %s failed: %s", job.req_id, job.remote_addr, error)
                    peers.drop(job.remote_addr)
        finally:
            peers.close()

    def _control_loop(self) -> None:
        peers = PeerCache()
        unreachable: dict[str, float] = {}  # address -> until when it is skipped
        try:
            for job in queued(self._control, self._stop, idle=peers.tidy):
                peers.tidy()
                try:
                    self._send_control(job, peers, unreachable)
                except Exception:  # (a bug): this message is lost, the thread goes on
                    logger.exception("KV %s to %s failed", type(job).__name__, job.remote_addr)
                    peers.drop(job.remote_addr)
                    _mark_unreachable(unreachable, job.remote_addr)
        finally:
            peers.close()

    def _send_control(self, job: ReleaseSpec | RenewSpec, peers: PeerCache, unreachable: dict[str, float]) -> None:
        """Sends a release or renewal, unless its producer is being skipped or cannot be reached."""
        addr = job.remote_addr
        if addr not in peers:
            if unreachable.get(addr, 0.0) > time.monotonic():
                return
            peer, _ = self._connect(addr, time.monotonic() + CONTROL_CONNECT_S)
            if peer is None:
                _mark_unreachable(unreachable, addr)
                return
            unreachable.pop(addr, None)
            peers.put(addr, peer)
        kind = Release if isinstance(job, ReleaseSpec) else Renew
        # Never waits: a peer that takes nothing (gone without a FIN) is dropped.
        if not peers.get(addr).send(kind(job.remote_request_id, job.token_digest), patience_s=0.0):
            peers.drop(addr)
            _mark_unreachable(unreachable, addr)

    def _connect(self, addr: str, deadline: float) -> tuple[Peer | None, str | None]:
        """An authenticated peer, or an error."""
        sock, monitor = monitored_socket(self._ctx)
        peer = None
        try:
            # Chunk frames are the largest thing a producer sends; zmq drops the connection of a
            # peer that sends more (the transfer then fails by its deadline), so a broken or
            # hostile peer cannot make us allocate without bound.
            sock.setsockopt(zmq.MAXMSGSIZE, self.layout.slot_bytes + FRAME_SLACK_BYTES)
            # The producer sends replies and KV to whichever connection holds our routing id, and
            # a new one may claim it the moment ours is gone (while sends to us may still be under
            # way). zmq's own ids are a counter; this one cannot be guessed (it is seen only on the
            # path, in the clear unless encrypted).
            sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
            if self._encrypt:
                sock.curve_serverkey = curve_keys(self._secret, "server")[0]
                sock.curve_publickey, sock.curve_secretkey = curve_keys(self._secret, "client")
            sock.connect(addr)
            peer, error = self._handshake(sock, monitor, addr, deadline)
            if peer is None and error.startswith(REFUSED):
                # The producer proved it holds our secret, then refused our proof: our open
                # challenge was pushed out (a flood of strangers' handshakes). Once more.
                peer, error = self._handshake(sock, monitor, addr, deadline)
        finally:
            if peer is None:
                close_monitored(sock, monitor)
        return peer, error

    def _handshake(self, sock, monitor, addr: str, deadline: float) -> tuple[Peer | None, str | None]:
        nonce_c = os.urandom(NONCE_BYTES)
        sock.send(encode(Hello(nonce_c)))
        challenge = self._recv(sock, deadline, lambda m: isinstance(m, Challenge), monitor=monitor)
        if isinstance(challenge, str):
            return None, f"{challenge} (handshake with {addr})"
        # Nothing about us (not even our fingerprint) goes to a peer that cannot prove it holds the secret.
        if not proof_ok(self._secret, challenge.proof, b"producer", nonce_c, challenge.nonce):
            return None, f"auth: the KV peer at {addr} does not hold our KV secret"
        sock.send(encode(Auth(proof(self._secret, b"consumer", nonce_c, challenge.nonce), self.fingerprint)))
        reply = self._recv(sock, deadline, lambda m: isinstance(m, HelloReply), monitor=monitor)
        if isinstance(reply, str):
            return None, f"{reply} (handshake with {addr})"
        if not reply.ok:
            return None, f"incompatible: {reply.message}"
        return Peer(sock, monitor, self._map_peer_kv(addr, reply),
                    SessionTag(self._secret, nonce_c, challenge.nonce)), None

    def _map_peer_kv(self, addr: str, reply: HelloReply) -> torch.Tensor | None:
        if not (addr.startswith("ipc://") and reply.shm_path and os.path.exists(reply.shm_path)):
            return None
        shape = list(reply.shm_shape)
        if len(shape) != self.kv.dim() or shape[:2] + shape[3:] != list(self.kv.shape[:2]) + self.layout.block_shape:
            return None
        numel = 1
        for dim in shape:
            numel *= dim
        try:
            return torch.from_file(reply.shm_path, shared=True, size=numel, dtype=self.kv.dtype).view(shape)
        except (RuntimeError, OSError) as exc:
            logger.warning("cannot map %s (%s); using the socket path", reply.shm_path, exc)
            return None

    def _recv(self, sock, deadline: float, accept, req_id: str | None = None, monitor=None):
        """The next accepted message (with its raw frames), or an error string. ``Refused`` ends
        it: the producer does not take us for authenticated (any more)."""
        while True:
            if req_id is not None and self.loads.is_cancelled(req_id):
                return "cancelled: the request ended"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout: no KV before the deadline"
            if self._stop.is_set():
                return "shutdown"
            if monitor is not None and monitor.poll(0):
                event = zmq.Event(recv_monitor_message(monitor)["event"]).name
                return (f"{TRANSPORT_FAILED} ({event}): the peers must agree on --kv-encrypt "
                        "and hold the same KV secret")
            if not sock.poll(min(50, int(remaining * 1000) + 1)):
                continue
            frames = sock.recv_multipart(copy=False)
            msg = decode(frames[0].buffer)
            if msg is None:
                with self._lock:
                    self.stats["dropped_messages"] += 1
                logger.warning("dropped an undecodable KV message")
                continue
            if isinstance(msg, Refused):
                return f"{REFUSED} ({msg.message})"
            if accept(msg):
                return (msg, frames) if req_id is not None else msg

    def _recv_pulled(self, peer: Peer, job: LoadSpec, accept):
        """``_recv`` for a pull: by its deadline, unless cancelled or the peer's reconnect fails."""
        return self._recv(peer.sock, job.deadline, accept, job.req_id, peer.monitor)

    def _load(self, job: LoadSpec, peers: PeerCache) -> tuple[str | None, int]:
        """Pull one request's KV into its blocks: (None on success, else "<reason>: <detail>";
        the attempts it took)."""
        addr = job.remote_addr
        reused = addr in peers
        error = self._load_from(job, peers)
        if reused and error is not None and (error.startswith((REFUSED, TRANSPORT_FAILED)) or error == UNSENDABLE):
            # Our session with this address ended on its side: the producer restarted there (zmq
            # reconnected our socket to the new process, or failed to: its transport handshake
            # failed) or forgot us. Handshake afresh, once: a refusal of the transport handshake
            # shows there at once, as auth.
            peers.drop(addr)
            return self._load_from(job, peers), 2
        return error, 1

    def _load_from(self, job: LoadSpec, peers: PeerCache) -> str | None:
        addr = job.remote_addr
        peer = peers.get(addr)
        if peer is None:
            peer, error = self._connect(addr, job.deadline)
            if peer is None:
                return error
            peers.put(addr, peer)
        transfer_id = uuid.uuid4().hex
        start = time.perf_counter()
        if not peer.send(Pull(transfer_id, job.remote_request_id, job.start_block, len(job.block_ids),
                              job.token_digest, shm=peer.kv is not None)):
            return UNSENDABLE
        got = self._recv_pulled(peer, job, lambda m: getattr(m, "transfer_id", None) == transfer_id)
        if isinstance(got, str):
            return got
        first, frames = got
        if isinstance(first, ShmGrant):
            error = self._copy_shm(peer, job, transfer_id, first)
        elif isinstance(first, Chunk):  # the producer chose the socket path
            error = self._receive_chunks(peer, job, transfer_id, first, frames)
        else:
            error = f"frame rejected: unexpected {type(first).__name__}"
        if error is None:
            with self._lock:
                self.stats["shm_loads"] += isinstance(first, ShmGrant)
                self.stats["bytes_received"] += len(job.block_ids) * self.layout.bytes_per_block
                self.stats["seconds"].append(time.perf_counter() - start)
        return error

    def _count_pull(self, job: LoadSpec, seconds: float, timed_out: bool) -> None:
        """Per producer, totals since start (``/status`` kv_transfer.pulls; engine proxy routes
        by them): a pull that timed out counts with the time it took and the tokens it was for.
        At most MAX_PEERS_COUNTED, the least recently pulled from forgotten first. Under self._lock."""
        pulls = self.stats["pulls"]
        peer = job.peer or job.remote_addr
        counted = pulls.pop(peer, None) or {"pulls": 0, "timeouts": 0, "tokens": 0, "bytes": 0, "seconds": 0.0}
        counted["pulls"] += 1
        counted["timeouts"] += timed_out
        counted["tokens"] += len(job.block_ids) * self.layout.block_shape[0]
        counted["bytes"] += 0 if timed_out else len(job.block_ids) * self.layout.bytes_per_block
        counted["seconds"] += seconds
        pulls[peer] = counted  # dicts keep insertion order: the most recent last
        while len(pulls) > MAX_PEERS_COUNTED:
            del pulls[next(iter(pulls))]

    def _copy_shm(self, peer: Peer, job: LoadSpec, transfer_id: str, grant: ShmGrant) -> str | None:
        if len(grant.block_ids) != len(job.block_ids) or max(grant.block_ids, default=0) >= peer.kv.shape[2]:
            return "frame rejected: bad shared-memory grant"
        self._copy_blocks(peer.kv, grant.block_ids, job.block_ids)
        if not peer.send(ShmDone(transfer_id, job.remote_request_id)):
            return "unreachable: our connection to the KV peer went during the copy"
        got = self._recv_pulled(peer, job, lambda m: isinstance(m, ShmAck) and m.transfer_id == transfer_id)
        if isinstance(got, str):
            return got
        return None if got[0].ok else "timeout: the producer's lease ended during the copy"

    def _copy_blocks(self, peer_kv: torch.Tensor, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """One copy per run of consecutive blocks, straight from the peer's tensor into ours."""
        for src, dst, n in contiguous_runs(src_blocks, dst_blocks):
            with off_step_stream(self.kv.device):
                self.kv[:, :, dst:dst + n].copy_(peer_kv[:, :, src:src + n])

    def _receive_chunks(self, peer: Peer, job: LoadSpec, transfer_id: str, chunk: Chunk, frames) -> str | None:
        dst = torch.tensor(job.block_ids, dtype=torch.int64, device=self.kv.device)
        expected_seq, done_blocks = 0, 0
        dtype = str(self.kv.dtype).removeprefix("torch.")
        while True:
            if chunk.status != "ok":
                return f"{chunk.status}: {chunk.message}"
            expected_shape = [self.kv.shape[0], 2, chunk.num_blocks, *self.layout.block_shape]
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
            with off_step_stream(self.kv.device):
                data = raw.view(self.kv.dtype).view(expected_shape).to(self.kv.device)
                self.kv.index_copy_(2, dst[done_blocks:done_blocks + chunk.num_blocks], data)
            done_blocks += chunk.num_blocks
            expected_seq += 1
            if expected_seq == chunk.num_chunks:
                return None if done_blocks == len(job.block_ids) else (
                    f"frame rejected: got {done_blocks} of {len(job.block_ids)} blocks")
            got = self._recv_pulled(peer, job, lambda m: isinstance(m, Chunk) and m.transfer_id == transfer_id)
            if isinstance(got, str):
                return got
            chunk, frames = got


def _mark_unreachable(unreachable: dict[str, float], addr: str) -> None:
    """Skips ``addr`` for UNREACHABLE_SKIP_S; forgets the addresses whose skip is over."""
    now = time.monotonic()
    for gone in [a for a, until in unreachable.items() if until <= now]:
        del unreachable[gone]
    unreachable[addr] = now + UNREACHABLE_SKIP_S
