"""Disaggregated prefill, producer side: serves ``drop_select`` pulls of the lookup buffer.

One ROUTER socket (tcp, plus ipc for peers on the same host) on one serve thread. An entry
leaves the buffer when it is selected, released by its consumer or when its lease ends; either
way the scheduler is told (``finished_sending``) and frees the blocks only then.

The serve thread never waits on a peer (FAULTS.md 30): one consumer that stops reading must not
hold up other pulls, releases, shared-memory acks or lease expiry. Every send is non-blocking
(``ROUTER_MANDATORY``: a full peer queue raises ``zmq.Again`` and the message is retried later,
a vanished peer raises ``EHOSTUNREACH``), and every socket transfer is a small state machine
(``_SocketSend``) that the loop advances a step per round, so transfers interleave.

Authentication (the handshake is in ``p2p_wire``): a peer gets nothing but a ``Challenge`` or a
``Refused`` until it has proved it holds the deployment secret; until then it learns no
fingerprint, engine id or shared-memory path, and none of its messages touches the lookup
buffer. What a stranger can make the serve thread hold is bounded: ``MAX_CHALLENGES`` open
challenges and ``MAX_SESSIONS`` sessions (oldest first out), and replies to peers without a
session are sent once, never queued. With ``encrypt`` the socket is a CURVE server (tcp and
ipc alike), with keys derived from the secret.

Same host: when the worker placed the KV tensor in a /dev/shm file, a same-host consumer is
lent the blocks (``ShmGrant``) instead of sent them; the loan ends with its ``ShmDone`` or the
lease.

Socket path: each active transfer gathers chunk k of its scattered blocks into the second of
its two staging slots while chunk k-1 is on the wire, and writes a slot again only once zmq has
released the zero-copy frames pointing into it (trackers polled, never waited on). At most
``MAX_SOCKET_SENDS`` transfers are active, so staging is fixed (``STAGING_BYTES``, counted in
the KV budget); further pulls wait in FIFO order.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
import zmq

from engine.kv_transfer.device_copies import host_buffer, off_step_stream
from engine.kv_transfer.p2p import MAX_LEASES_HELD, SendSpec, ipc_path, remove_stale_kv_sockets
from engine.kv_transfer.p2p_wire import (
    DEFAULT_CHUNK_BYTES, FRAME_SLACK_BYTES, NO_AUTH_SECRET, NONCE_BYTES, PROTOCOL_VERSION, Auth, Challenge, Chunk,
    ChunkLayout, Hello, HelloReply, Pull, Refused, Release, Renew, SessionTag, ShmAck, ShmDone, ShmGrant, WireMessage,
    _inject_fault, curve_keys, decode, encode, fault_delay, proof, proof_ok,
)
from engine.kv_transfer.secret import KVSecret
from engine.side_threads import side_thread

logger = logging.getLogger("engine.kv_transfer")

MAX_SOCKET_SENDS = 4  # concurrent socket transfers, two staging slots each
STAGING_BYTES = 2 * MAX_SOCKET_SENDS * DEFAULT_CHUNK_BYTES
STALL_S = 10.0  # a socket transfer whose consumer takes nothing for this long is abandoned
REPLY_RETRY_S = 5.0  # how long a control reply waits for room in a slow peer's queue
MAX_MESSAGES_PER_ROUND = 64  # control messages taken per round, so transfers keep moving
MAX_CHALLENGES = 1024  # open handshakes; a stranger's flood pushes out the oldest, never grows memory
MAX_SESSIONS = 4096  # authenticated peers; the least recently heard from (long gone, mostly) drops out
EARLY_PULL_WAIT_S = 5.0  # how long a pull for an announced offer waits for it (see announce)
MAX_EARLY_PULLS = 256  # pulls waiting so at once; more are answered at once (not found)


@dataclass(slots=True)
class _Slot:
    """Staging memory for one chunk. Zero-copy frames point into it until zmq has written them
    out (their trackers are done), so it is written only when no tracker is pending."""
    data: torch.Tensor  # uint8 [slot_bytes]
    trackers: list[zmq.MessageTracker] = field(default_factory=list)

    def busy(self) -> bool:
        self.trackers = [t for t in self.trackers if not t.done]
        return bool(self.trackers)


@dataclass(slots=True)
class _SocketSend:
    """One pull served over the socket. Invariants: ``outgoing`` holds the messages of chunk
    ``seq - 1`` (in slot ``(seq - 1) % 2``) that zmq has not taken yet, and the next chunk is
    gathered only once ``outgoing`` is empty and slot ``seq % 2`` is no longer busy."""
    identity: bytes
    pull: Pull
    entry: SendSpec
    blocks: list[int]
    num_chunks: int
    not_before: float  # monotonic; in the future only under a ``delay=`` test fault
    slots: list[_Slot] = field(default_factory=list)  # two, while active
    seq: int = 0  # chunks gathered so far
    outgoing: list[tuple[bytes, memoryview]] = field(default_factory=list)
    progress_at: float = 0.0  # monotonic: when zmq last took one of its messages
    started: float = 0.0  # perf_counter when it became active
    kv_released: bool = False  # reported in finished_sending: its KV blocks are read no more

    @property
    def gathered(self) -> bool:
        return self.seq == self.num_chunks


class P2PProducer:
    """Holds the lookup buffer and serves it. ``stats`` and ``lock`` are shared with the
    consumer of the same worker; the transfer state belongs to the serve thread alone."""

    def __init__(self, ctx: zmq.Context, lock: threading.Lock, stats: dict, engine_id: str, fingerprint: str,
                 bind_ip: str | None, port: int, chunk_bytes: int, secret: KVSecret | None, encrypt: bool) -> None:
        self._ctx, self._lock, self.stats = ctx, lock, stats
        self.engine_id, self.fingerprint = engine_id, fingerprint
        self._secret, self._encrypt = secret or NO_AUTH_SECRET, encrypt
        self.bind_ip, self.port, self.chunk_bytes = bind_ip, port, chunk_bytes
        self.stall_s = STALL_S
        self.shm_path = ""
        self.kv: torch.Tensor | None = None
        # Shared with the engine thread, under the lock:
        self._buffer: dict[str, SendSpec] = {}  # the lookup buffer: request id -> KV on offer
        self._announced: set[str] = set()  # offers of the step in flight, made once its output is out
        self._lent: dict[str, tuple[SendSpec, str, int]] = {}  # request id -> (entry, transfer id, blocks)
        self._done_sending: set[str] = set()
        # The serve thread's own:
        self._challenges: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()  # identity -> (nonce_c, nonce_p)
        self._sessions: OrderedDict[bytes, SessionTag] = OrderedDict()  # identity -> its authenticated session
        self._waiting: deque[_SocketSend] = deque()  # pulls waiting for staging, first come first served
        self._active: list[_SocketSend] = []
        self._free: list[_Slot] = []  # slots of no active transfer (maybe still draining)
        self._detached: list[_Slot] = []  # set aside by abandoned transfers until zmq lets go
        self._outbox: deque[tuple[bytes, bytes, float]] = deque()  # (peer, reply, give up at)
        self._early: list[tuple[bytes, Pull, float]] = []  # pulls for announced offers: (peer, pull, give up at)
        self._next_expiry = 0.0
        self._sock: zmq.Socket | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._bind_error: Exception | None = None
        self._thread = side_thread(self._serve_loop, "kv-serve")

    # ---- engine thread -------------------------------------------------------------------
    def start(self, kv: torch.Tensor, shm_path: str) -> None:
        """Serve ``kv``; ``shm_path``: the shared-memory file it lives in, for same-host loans ("" if none)."""
        self.kv, self.shm_path = kv, shm_path
        self.layout = ChunkLayout.of(kv, self.chunk_bytes)
        slot_bytes = self.layout.slot_bytes
        staging = host_buffer(2 * MAX_SOCKET_SENDS * slot_bytes, self.kv.device)
        self._free = [_Slot(staging[i * slot_bytes:(i + 1) * slot_bytes]) for i in range(2 * MAX_SOCKET_SENDS)]
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"KV server did not bind port {self.port}")
        if self._bind_error is not None:
            raise RuntimeError(f"KV server cannot bind port {self.port}: {self._bind_error}")

    def announce(self, sends: list[SendSpec]) -> None:
        """Before the forward pass: these offers are made (``offer``) once the step's output,
        which carries their parameters, is on its way. A pull can only come after that, but it
        may come before the offer: it waits for it (EARLY_PULL_WAIT_S at most) rather than find
        nothing. What an earlier step announced and never offered ends here: that step raised,
        and it offered nothing."""
        with self._lock:
            self._announced = {spec.req_id for spec in sends}

    def offer(self, sends: list[SendSpec]) -> None:
        """``insert`` into the lookup buffer. The lease starts now (the step's answer has just
        gone out), not when the step was planned."""
        now = time.monotonic()
        with self._lock:
            for spec in sends:
                self._announced.discard(spec.req_id)
                if spec.lease_s > 0:
                    spec.lease_deadline = now + spec.lease_s
                    spec.hold_until = now + spec.lease_s * MAX_LEASES_HELD
                self._buffer[spec.req_id] = spec

    def withdraw(self, req_ids: list[str]) -> None:
        """Offers nobody was told about (their request ended with its first token): out of the
        lookup buffer now. One that is being sent regardless finishes as usual."""
        with self._lock:
            for rid in req_ids:
                self._announced.discard(rid)
                if self._buffer.pop(rid, None) is not None:
                    self._done_sending.add(rid)

    def take_finished(self) -> set[str]:
        """Entries whose blocks are no longer read (sent, lent and returned, released,
        expired or abandoned) since the last call."""
        with self._lock:
            done, self._done_sending = self._done_sending, set()
        return done

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)

    # ---- serve thread ----------------------------------------------------------------------
    def _serve_loop(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Raise instead of dropping silently (unknown peer) or blocking (full peer queue).
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Only small control messages come in; zmq drops the connection of a peer that sends
        # a bigger frame, before it is ever allocated here.
        sock.setsockopt(zmq.MAXMSGSIZE, FRAME_SLACK_BYTES)
        # The default, stated: a connection that claims the routing id of a connected peer is
        # not let in (handing over would give it that peer's replies).
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        if self._encrypt:  # on every endpoint of this socket
            sock.curve_secretkey = curve_keys(self._secret, "server")[1]
            sock.curve_server = True
        remove_stale_kv_sockets()
        try:
            sock.bind(f"tcp://{self.bind_ip}:{self.port}")
            sock.bind(ipc_path(self.port))
        except zmq.ZMQError as exc:
            self._bind_error = exc
            sock.close(linger=0)
            self._ready.set()
            return
        self._sock = sock
        self._ready.set()
        wait_ms, moved_at = 0, 0.0
        try:
            while not self._stop.is_set():
                moved = sock.poll(wait_ms, zmq.POLLIN) != 0 and self._receive()
                now = time.monotonic()
                if self._early:
                    moved |= self._retry_early()
                moved |= self._advance(now)
                self._flush_outbox(now)
                if now >= self._next_expiry:
                    self._expire_leases(now)
                    self._next_expiry = now + 0.02
                # Sleep in poll unless something moved: 1 ms while transfers are flowing (zmq
                # frees a slot within a few), 10 ms once they have all waited on their peers for
                # a while, so stalled consumers cost next to no CPU.
                if moved:
                    wait_ms, moved_at = 0, now
                elif self._active or self._waiting or self._outbox or self._early:
                    wait_ms = 1 if now - moved_at < 0.05 else 10
                else:
                    wait_ms = 100
        finally:
            # Unlinked before the close: once our TCP port is free, a new server on it binds the
            # same path, and that file must stay. (libzmq never removes an ipc file itself.)
            with contextlib.suppress(OSError):
                os.unlink(ipc_path(self.port).removeprefix("ipc://"))
            sock.close(linger=0)

    def _receive(self) -> bool:
        for _ in range(MAX_MESSAGES_PER_ROUND):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = self._admit(frames)
                if isinstance(msg, (Hello, Auth)):
                    self._handshake(frames[0], msg)
                elif msg is not None:
                    self._handle(frames[0], msg)
            except Exception:  # one bad message never stops the server
                logger.exception("KV control message failed")
        return True

    # ---- authentication (serve thread) ---------------------------------------------------------
    def _admit(self, frames: list[bytes]) -> WireMessage | None:
        """The message in ``frames`` if its peer may send it: a handshake message (untagged), or
        a request tagged by the peer's session. Anything else is refused; None then."""
        identity = frames[0]
        if len(frames) == 2:
            msg = decode(frames[1])
            if isinstance(msg, (Hello, Auth)):
                return msg
        elif len(frames) == 3:
            session = self._sessions.get(identity)
            if session is not None and session.check(frames[1], frames[2]):
                self._sessions.move_to_end(identity)
                msg = decode(frames[1])
                if isinstance(msg, (Pull, Release, Renew, ShmDone)):
                    return msg
                with self._lock:  # an authenticated peer's bug, not an attack: dropped as before
                    self.stats["dropped_messages"] += 1
                logger.warning("dropped a malformed KV control message")
                return None
        self._refuse(identity, "unauthenticated")
        return None

    def _handshake(self, identity: bytes, msg: Hello | Auth) -> None:
        if isinstance(msg, Hello):
            if len(msg.nonce) != NONCE_BYTES:
                self._refuse(identity, "unauthenticated")
                return
            self._sessions.pop(identity, None)  # a new handshake ends the old session
            nonce_p = os.urandom(NONCE_BYTES)
            self._challenges.pop(identity, None)
            self._challenges[identity] = (msg.nonce, nonce_p)
            if len(self._challenges) > MAX_CHALLENGES:
                self._challenges.popitem(last=False)
            self._send_once(identity, Challenge(nonce_p, proof(self._secret, b"producer", msg.nonce, nonce_p)))
            return
        nonces = self._challenges.pop(identity, None)
        if nonces is None or not proof_ok(self._secret, msg.proof, b"consumer", *nonces):
            self._refuse(identity, "proof")
            return
        # Authenticated: from here on the peer may learn who we are, and be told it does not fit.
        ok = msg.fingerprint == self.fingerprint and msg.version == PROTOCOL_VERSION
        message = "" if ok else (f"incompatible KV peer: theirs {msg.fingerprint} (v{msg.version}), "
                                 f"ours {self.fingerprint} (v{PROTOCOL_VERSION})")
        shm = self.shm_path if ok else ""  # where our KV lives is for compatible peers only
        if ok:
            self._sessions[identity] = SessionTag(self._secret, *nonces)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        self._reply(identity, HelloReply(ok, self.engine_id, self.fingerprint, message, shm,
                                         list(self.kv.shape) if shm else []))

    def _refuse(self, identity: bytes, reason: str) -> None:
        """Ends whatever the peer had begun and tells it no more than ``Refused``; counted by reason."""
        self._challenges.pop(identity, None)
        self._sessions.pop(identity, None)
        with self._lock:
            failures = self.stats["auth_failures"]
            failures[reason] = failures.get(reason, 0) + 1
        logger.debug("refused a KV message from a peer that has not authenticated (%s)", reason)
        self._send_once(identity, Refused())

    def _send_once(self, identity: bytes, msg: WireMessage) -> None:
        """A reply to a peer without a session: tried once, dropped if it cannot go now."""
        try:
            self._sock.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # Again (a full queue: the peer does not read) or EHOSTUNREACH (gone)
            pass

    # ---- requests of authenticated peers (serve thread) ----------------------------------------
    def _handle(self, identity: bytes, msg: Pull | Release | Renew | ShmDone) -> None:
        if isinstance(msg, Pull):
            self._serve_pull(identity, msg)
        elif isinstance(msg, ShmDone):
            with self._lock:
                lent = self._lent.get(msg.request_id)
                ok = lent is not None and lent[1] == msg.transfer_id
                if ok:
                    del self._lent[msg.request_id]
                    self._done_sending.add(msg.request_id)
                    self.stats["bytes_sent"] += lent[2] * self.layout.bytes_per_block
            self._reply(identity, ShmAck(msg.transfer_id, ok))
        elif isinstance(msg, Release):
            with self._lock:  # only for the tokens it holds, like a pull
                entry = self._buffer.get(msg.request_id)
                if entry is not None and entry.token_digest == msg.token_digest:
                    del self._buffer[msg.request_id]
                    self._done_sending.add(msg.request_id)
        elif isinstance(msg, Renew):
            with self._lock:  # only for the tokens it holds, and never past hold_until
                entry = self._buffer.get(msg.request_id)
                if entry is not None and entry.token_digest == msg.token_digest and entry.lease_s > 0:
                    entry.lease_deadline = max(entry.lease_deadline,
                                               min(time.monotonic() + entry.lease_s, entry.hold_until))
                    self.stats["lease_renewals"] += 1

    def _select(self, pull: Pull, wait: bool = True) -> SendSpec | str | None:
        """drop_select: the entry leaves the buffer as it is selected, but only by a pull for
        the very tokens it was computed for (anything else leaves it for its real consumer).
        Returns the entry, or why there is none; None (with ``wait``): it is announced, not
        offered yet."""
        with self._lock:
            entry = self._buffer.get(pull.request_id)
            if entry is None and wait and pull.request_id in self._announced:
                return None
            if entry is None:
                return f"not_found: no KV held for {pull.request_id} (expired, sent or unknown)"
            if entry.token_digest != pull.token_digest:
                return f"mismatch: the KV held for {pull.request_id} belongs to other tokens"
            return self._buffer.pop(pull.request_id)

    def _serve_pull(self, identity: bytes, pull: Pull, give_up_at: float | None = None) -> None:
        """``give_up_at``: a pull that waited for its announced offer, until then (see announce)."""
        now = time.monotonic()
        waits = give_up_at is not None or len(self._early) < MAX_EARLY_PULLS
        entry = self._select(pull, wait=waits and (give_up_at is None or now < give_up_at))
        if entry is None:
            self._early.append((identity, pull, give_up_at or now + EARLY_PULL_WAIT_S))
            return
        if isinstance(entry, str):
            status, message = entry.split(": ", 1)
            self._reply(identity, Chunk(pull.transfer_id, status, message))
            return
        blocks = entry.block_ids[pull.start_block:pull.start_block + pull.num_blocks]
        if pull.start_block < 0 or len(blocks) != pull.num_blocks:
            self._reply(identity, Chunk(pull.transfer_id, "error", f"asked for {pull.num_blocks} blocks from "
                                        f"{pull.start_block}, held {len(entry.block_ids)}"))
            with self._lock:
                self._done_sending.add(entry.req_id)
        elif pull.shm and self.shm_path and entry.fault is None:  # faults are for the socket path
            with self._lock:
                self._lent[entry.req_id] = (entry, pull.transfer_id, len(blocks))
            self._reply(identity, ShmGrant(pull.transfer_id, blocks))
        else:
            num_chunks = -(-len(blocks) // self.layout.blocks_per_chunk)
            self._waiting.append(_SocketSend(identity, pull, entry, blocks, num_chunks,
                                             time.monotonic() + fault_delay(entry.fault)))

    def _retry_early(self) -> bool:
        """Pulls that came before their announced offer: served once it is made, refused as not
        found once it will not be (or EARLY_PULL_WAIT_S on). True if any of them moved on."""
        early, self._early = self._early, []
        for identity, pull, give_up_at in early:
            self._serve_pull(identity, pull, give_up_at)
        return len(self._early) < len(early)

    def _reply(self, identity: bytes, msg: WireMessage) -> None:
        self._outbox.append((identity, encode(msg), time.monotonic() + REPLY_RETRY_S))
        self._flush_outbox(time.monotonic())

    def _flush_outbox(self, now: float) -> None:
        """Control replies, each tried until its peer's queue has room; a peer that stays full
        for REPLY_RETRY_S (its pull then times out on its side) or has gone loses the reply."""
        kept: deque[tuple[bytes, bytes, float]] = deque()
        for identity, payload, give_up_at in self._outbox:
            try:
                self._sock.send_multipart([identity, payload], flags=zmq.NOBLOCK)
            except zmq.Again:
                if now < give_up_at:
                    kept.append((identity, payload, give_up_at))
                else:
                    with self._lock:
                        self.stats["dropped_replies"] += 1
                    logger.warning("dropped a KV reply: the peer has not read for %.0f s", REPLY_RETRY_S)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone, nobody left to tell
                logger.debug("KV reply to a departed peer dropped: %s", exc)
        self._outbox = kept

    def _advance(self, now: float) -> bool:
        """One round over the socket transfers; True if any of them moved."""
        moved = False
        for t in [t for t in self._waiting if now > t.entry.lease_deadline]:
            self._finish(t, "the lease ended while it waited for staging memory")
        while self._waiting and len(self._active) < MAX_SOCKET_SENDS and len(self._free) >= 2:
            t = self._waiting.popleft()
            self._free.sort(key=_Slot.busy)  # drained slots first
            t.slots = [self._free.pop(0), self._free.pop(0)]
            t.progress_at, t.started = max(now, t.not_before), time.perf_counter()
            self._active.append(t)
        for t in list(self._active):
            try:
                step_moved = self._step(t, now)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the consumer closed its socket
                self._finish(t, f"the consumer is gone ({exc.strerror})")
                moved = True
                continue
            except Exception as exc:  # never let one transfer take the server down
                logger.exception("KV send of %s failed", t.entry.req_id)
                self._finish(t, f"error: {exc}")
                continue
            moved |= step_moved
            if t.gathered and not t.outgoing and not any(slot.busy() for slot in t.slots):
                self._finish(t, None)
            elif not t.gathered and now > t.entry.lease_deadline:
                self._finish(t, "the lease ended before the consumer took the KV")
            elif now - t.progress_at > self.stall_s:
                self._finish(t, f"the consumer took nothing for {self.stall_s:.0f} s")
        if self._detached:
            self._detached = [slot for slot in self._detached if slot.busy()]
        return moved

    def _step(self, t: _SocketSend, now: float) -> bool:
        """Moves ``t`` on as far as it goes without waiting: hands zmq what it will take, and
        gathers at most one chunk (so concurrent transfers take turns). True if anything moved."""
        moved = gathered = False
        while True:
            while t.outgoing:
                header, frame = t.outgoing[0]
                try:
                    tracker = self._sock.send_multipart([t.identity, header, frame], flags=zmq.NOBLOCK,
                                                        copy=False, track=True)
                except zmq.Again:  # the consumer's queue is full: keep the message, retry next round
                    return moved
                t.outgoing.pop(0)
                t.slots[(t.seq - 1) % 2].trackers.append(tracker)
                t.progress_at, moved = now, True
            if gathered or t.gathered or now < t.not_before or t.slots[t.seq % 2].busy():
                return moved
            self._gather_chunk(t)
            moved = gathered = True

    def _gather_chunk(self, t: _SocketSend) -> None:
        per_chunk, bytes_per_block = self.layout.blocks_per_chunk, self.layout.bytes_per_block
        ids = t.blocks[t.seq * per_chunk:(t.seq + 1) * per_chunk]
        raw = t.slots[t.seq % 2].data[:len(ids) * bytes_per_block]
        data = self._gather(ids, raw)  # raw as [num_layers, 2, len(ids), block_size, heads, head_dim]
        payload = memoryview(raw.numpy())  # the frame keeps the slot's memory alive while zmq holds it
        header = Chunk(t.pull.transfer_id, "ok", seq=t.seq, num_chunks=t.num_chunks, first_block=t.seq * per_chunk,
                       num_blocks=len(ids), dtype=str(data.dtype).removeprefix("torch."), shape=list(data.shape),
                       nbytes=payload.nbytes)
        t.outgoing = [(encode(h), frame) for h, frame in _inject_fault(t.entry.fault, header, payload)]
        t.seq += 1
        with self._lock:
            self.stats["bytes_sent"] += payload.nbytes
        if t.gathered:
            self._release_kv(t)

    def _gather(self, ids: list[int], raw: torch.Tensor) -> torch.Tensor:
        """Copy blocks ``ids`` into the staging bytes ``raw``; returns them viewed as KV."""
        out = raw.view(self.kv.dtype).view(self.kv.shape[0], 2, len(ids), *self.layout.block_shape)
        index = torch.tensor(ids, dtype=torch.int64, device=self.kv.device)
        if self.kv.device.type == "cpu":
            torch.index_select(self.kv, 2, index, out=out)
        else:
            with off_step_stream(self.kv.device):  # into pinned staging, beside the running step
                out.copy_(self.kv.index_select(2, index), non_blocking=True)
        return out

    def _release_kv(self, t: _SocketSend) -> None:
        """Frames point into staging, never into KV blocks, so the blocks can go back to the
        scheduler as soon as the last chunk is gathered, or the transfer is given up on."""
        if not t.kv_released:
            t.kv_released = True
            with self._lock:
                self._done_sending.add(t.entry.req_id)

    def _finish(self, t: _SocketSend, abandoned: str | None) -> None:
        """Ends ``t`` (done, or ``abandoned`` for the given reason): its KV is released and its
        slots return to the pool."""
        if t in self._active:
            self._active.remove(t)
        else:
            self._waiting.remove(t)
        self._release_kv(t)
        for slot in t.slots:
            self._retire(slot, detach=abandoned is not None)
        if abandoned is None:
            with self._lock:
                self.stats["seconds"].append(time.perf_counter() - t.started)
            return
        with self._lock:
            self.stats["abandoned_sends"] += 1
        logger.warning("KV send of %s abandoned: %s", t.entry.req_id, abandoned)
        self._reply(t.identity, Chunk(t.pull.transfer_id, "error", f"the producer gave up: {abandoned}"))

    def _retire(self, slot: _Slot, detach: bool) -> None:
        """Frames of an abandoned transfer may sit in a stalled peer's queue for as long as it
        stays connected. Rather than wait for them, set the slot aside (zmq's frames keep its
        memory alive until zmq drops them, and nothing writes to it again) and stage in fresh
        memory: up to one pool's worth, after which slots are reused once they drain."""
        if detach and slot.busy() and len(self._detached) < 2 * MAX_SOCKET_SENDS:
            self._detached.append(slot)
            slot = _Slot(torch.empty(self.layout.slot_bytes, dtype=torch.uint8))
        self._free.append(slot)

    def _expire_leases(self, now: float) -> None:
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
