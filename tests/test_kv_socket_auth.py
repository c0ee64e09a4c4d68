"""The KV socket's authentication and encryption, over real sockets on loopback: a real
producer and consumer, and attackers made of plain zmq DEALERs (``RawPeer``) that know the
protocol but not the deployment secret."""
from __future__ import annotations

import errno
import socket
import threading
import time

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.kv_transfer import p2p_consumer, p2p_peers, p2p_producer
from engine.kv_transfer.p2p import LoadSpec, P2PMetadata, SendSpec, ipc_path
from engine.kv_transfer.p2p_wire import (
    Challenge, Chunk, HelloReply, Pull, Refused, Release, SessionTag, ShmDone, decode, encode,
)
from engine.kv_transfer.p2p_worker import P2PConnectorWorker
from engine.kv_transfer.secret import KVSecret
from tests.server_utils import free_port
from tests.test_p2p_worker import BLOCK_BYTES, SHAPE, RawPeer, _load_result, hold_copies, kv_tensor_for

SECRET = KVSecret("the-deployment-secret-0123456789")
WRONG = KVSecret("somebody-elses-secret-0123456789")
ENGINE_ID, FINGERPRINT = "engine-id-7c41d0", "fingerprint-2b9e55"  # distinctive: searched for in replies
MiB = 2**20


@pytest.fixture(autouse=True)
def shared_memory_kv(monkeypatch):
    """These tests drive the same-host shared-memory loan (opt-in, ENGINE_KV_SHM=1) unless they turn it off."""
    monkeypatch.setenv("ENGINE_KV_SHM", "1")


def _producer(secret=SECRET, encrypt: bool = False) -> P2PConnectorWorker:
    worker = P2PConnectorWorker(ENGINE_ID, FINGERPRINT, "127.0.0.1", free_port(), chunk_bytes=3 * BLOCK_BYTES,
                                secret=secret, encrypt=encrypt)
    kv = kv_tensor_for(worker, SHAPE)
    kv.copy_(torch.randn(SHAPE))
    worker.register_kv_caches(kv)
    assert worker.shm_path  # so the tests below can check that it never leaks
    return worker


def _consumer(secret=SECRET, encrypt: bool = False) -> P2PConnectorWorker:
    worker = P2PConnectorWorker("d", FINGERPRINT, None, None, secret=secret, encrypt=encrypt)
    worker.register_kv_caches(torch.zeros(SHAPE))
    return worker


@pytest.fixture
def producer():
    worker = _producer()
    yield worker
    worker.shutdown()


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _tcp(producer) -> str:
    return f"tcp://127.0.0.1:{producer.port}"


def _offer(producer, rid: str, blocks: list[int]) -> None:
    producer.save_kv(P2PMetadata(sends=[SendSpec(rid, blocks, 4 * len(blocks), time.monotonic() + 60,
                                                       "tokens")]))


def _load(consumer, rid: str, addr: str, dst: list[int]):
    consumer.start_load_kv(P2PMetadata(loads=[LoadSpec(rid, addr, rid, 0, dst, time.monotonic() + 10, "tokens")]))
    return _load_result(consumer)


def _pulled(producer, rid: str, src: list[int], dst: list[int], addr: str | None = None, secret=SECRET) -> None:
    """A consumer holding ``secret`` pulls ``rid`` and gets exactly its KV."""
    consumer = _consumer(secret)
    try:
        out = _load(consumer, rid, addr or _tcp(producer), dst)
        assert out.finished_recving == {rid}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, dst], producer.kv[:, :, src])
    finally:
        consumer.shutdown()


def _assert_nothing_revealed(producer, *peers: RawPeer) -> None:
    """Whatever the peers were sent: only challenges and refusals, none of who the producer is."""
    for peer in peers:
        assert peer.replies, "the peer was never answered"
        for frame in peer.replies:
            assert isinstance(decode(frame), (Challenge, Refused)), decode(frame)
        blob = b"".join(peer.replies)
        for private in (FINGERPRINT, ENGINE_ID, producer.shm_path):
            assert private.encode() not in blob


@pytest.mark.parametrize("theirs", [None, WRONG], ids=["no-secret", "wrong-secret"])
def test_a_stranger_cannot_pull_and_learns_nothing(producer, ctx, theirs):
    """Whatever a peer without the secret sends (untagged, with made-up or wrongly keyed tags,
    garbage, handshakes with a wrong proof), it is refused, counted, and told nothing."""
    _offer(producer, "victim", list(range(7)))
    attacker = RawPeer(ctx, _tcp(producer))
    pull = Pull("t", "victim", 0, 7, "tokens")
    try:
        attacker.send_raw(encode(pull))  # untagged
        assert isinstance(attacker.recv(), Refused)
        attacker.send(pull)  # a made-up tag
        assert isinstance(attacker.recv(), Refused)
        attacker.send_raw(b"\xc1 not msgpack")
        assert isinstance(attacker.recv(), Refused)
        assert isinstance(attacker.handshake(theirs, FINGERPRINT), Refused)  # its proof does not verify
        attacker.send(pull)  # tagged with the session it would have had
        assert isinstance(attacker.recv(), Refused)
        attacker.hello()
        attacker.hello()  # a second Hello replaces the first challenge; the proof still fails
        assert isinstance(attacker.auth(theirs, FINGERPRINT), Refused)
        _assert_nothing_revealed(producer, attacker)
        assert producer.auth_failures() == {"unauthenticated": 4, "proof": 2}
        # The KV is still on offer, and its consumer gets it.
        _pulled(producer, "victim", list(range(7)), list(range(10, 17)))
        assert producer.auth_failures() == {"unauthenticated": 4, "proof": 2}  # the real one is not counted
    finally:
        attacker.close()


def test_a_strangers_release_and_shm_done_change_nothing(producer, ctx, monkeypatch):
    """While a consumer copies lent blocks, a stranger returns the loan (ShmDone with the real
    transfer id) and releases another entry: both refused, so the copy stays valid (the
    producer did not end the loan: ShmAck ok) and the other entry stays on offer."""
    consumer = _consumer()
    copying, go_on = hold_copies(consumer, monkeypatch)
    _offer(producer, "lent", list(range(9)))
    _offer(producer, "other", list(range(20, 25)))
    attackers = [RawPeer(ctx, _tcp(producer)), RawPeer(ctx, _tcp(producer))]
    try:
        consumer.start_load_kv(P2PMetadata(loads=[LoadSpec("lent", ipc_path(producer.port), "lent", 0,
                                                            list(range(30, 39)), time.monotonic() + 30, "tokens")]))
        assert copying.wait(10), f"never lent the blocks: {consumer.get_finished().failure_reasons}"
        transfer_id = producer.producer._lent["lent"][1]  # what only the real consumer knows
        assert isinstance(attackers[1].handshake(WRONG, FINGERPRINT), Refused)
        for attacker in attackers:
            for msg in (ShmDone(transfer_id, "lent"), Release("other", "tokens")):
                attacker.send_raw(encode(msg))  # untagged
                assert isinstance(attacker.recv(), Refused)
                attacker.send(msg)  # tagged: made up, or by the session the attacker believes in
                assert isinstance(attacker.recv(), Refused)
        assert producer.auth_failures() == {"unauthenticated": 8, "proof": 1}
        go_on.set()
        out = _load_result(consumer)
        assert out.finished_recving == {"lent"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, 30:39], producer.kv[:, :, :9])
        _pulled(producer, "other", list(range(20, 25)), list(range(5)))
        _assert_nothing_revealed(producer, *attackers)
    finally:
        go_on.set()
        consumer.shutdown()
        for attacker in attackers:
            attacker.close()


def test_a_claimed_routing_id_gets_nothing(producer, ctx, monkeypatch):
    """A ROUTER knows its peers only by routing id, and a connection may claim any id. The
    consumer's is random (zmq's own would be a guessable counter); here the claimant is given
    the real one. While the consumer is connected, zmq ignores the claimant (ROUTER_HANDOVER
    off); once it has gone, the claimant is let in under its id while the producer still holds
    its session, so only the session tags stop a replay of the consumer's own messages."""
    sent: list[tuple[bytes, bytes]] = []  # what the consumer sent: (body, tag)
    tag = SessionTag.next
    monkeypatch.setattr(SessionTag, "next", lambda self, body: sent.append((body, tag(self, body))) or sent[-1][1])
    monkeypatch.setattr(p2p_consumer, "NUM_PULLERS", 1)  # one socket: one session, one routing id
    consumer = _consumer()
    _offer(producer, "first", list(range(3)))
    out = _load(consumer, "first", _tcp(producer), list(range(3)))
    assert out.finished_recving == {"first"}, out.failure_reasons
    [victim_id] = producer.producer._sessions
    assert len(victim_id) == 16  # the consumer's own, not one the producer's ROUTER assigned

    # While it is connected: the claimant is never let in, and the consumer is undisturbed.
    claimant = RawPeer(ctx, _tcp(producer), routing_id=victim_id)
    try:
        _offer(producer, "second", list(range(3, 6)))
        claimant.send(Pull("t", "second", 0, 3, "tokens"))
        out = _load(consumer, "second", _tcp(producer), list(range(3, 6)))
        assert out.finished_recving == {"second"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, 3:6], producer.kv[:, :, 3:6])
        assert not claimant.sock.poll(500), "a second connection got the consumer's routing id"
    finally:
        claimant.close()
        consumer.shutdown()

    # Once it has gone: the same id, replaying the consumer's last message (a pull of KV that
    # is on offer again). zmq lets the claimant in only once it has dropped the old connection:
    # until then it is ignored, so each try waits for an answer and gives up on silence.
    _offer(producer, "second", list(range(3, 6)))
    replay = sent[-1]
    assert decode(replay[0]) == Pull(decode(replay[0]).transfer_id, "second", 0, 3, "tokens")
    assert victim_id in producer.producer._sessions  # the producer cannot know the consumer left
    deadline = time.monotonic() + 10
    while True:
        claimant = RawPeer(ctx, _tcp(producer), routing_id=victim_id)
        claimant.send_raw(*replay)
        if claimant.sock.poll(200):
            break
        claimant.close()
        assert time.monotonic() < deadline, "the claimant was never let in"
    try:
        assert isinstance(claimant.recv(), Refused)
        assert victim_id not in producer.producer._sessions  # the session it claimed is over
        claimant.send(Pull("t2", "second", 0, 3, "tokens"))
        assert isinstance(claimant.recv(), Refused)
        _assert_nothing_revealed(producer, claimant)
    finally:
        claimant.close()
    _pulled(producer, "second", list(range(3, 6)), list(range(3, 6)))


def test_an_oversized_frame_drops_the_connection(producer, ctx):
    attacker = RawPeer(ctx, _tcp(producer))
    monitor = attacker.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        attacker.send_raw(b"x" * MiB)  # zmq drops it (and the connection) before the producer reads it
        assert monitor.poll(5000), "the connection was not dropped"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert not attacker.replies and producer.auth_failures() == {}
        _offer(producer, "r", list(range(7)))
        _pulled(producer, "r", list(range(7)), list(range(7)))
    finally:
        attacker.sock.disable_monitor()
        monitor.close(linger=0)
        attacker.close()


@pytest.mark.parametrize("producer_secret, consumer_secret", [
    pytest.param(SECRET, WRONG, id="consumer-wrong"),
    pytest.param(WRONG, SECRET, id="producer-wrong"),
    pytest.param(SECRET, None, id="consumer-none"),
    pytest.param(None, SECRET, id="producer-none"),
])
def test_a_secret_mismatch_fails_the_load_as_auth(producer_secret, consumer_secret):
    """The consumer checks the producer's proof first: with different secrets it stops there,
    having told the producer nothing (no Auth arrives, so nothing is refused), and the load
    fails at once with reason ``auth``, to be recomputed like any failed load."""
    producer, consumer = _producer(producer_secret), _consumer(consumer_secret)
    try:
        _offer(producer, "r", list(range(7)))
        start = time.monotonic()
        out = _load(consumer, "r", _tcp(producer), list(range(7)))
        assert out.failed_recving == {"r"}, out
        assert out.failure_reasons["r"].startswith("auth: the KV peer at tcp://"), out.failure_reasons
        assert time.monotonic() - start < 5, "the load waited for its deadline"
        assert consumer.counters["failures"] == {"auth": 1} and not consumer.kv.any()
        assert producer.auth_failures() == {}
        _pulled(producer, "r", list(range(7)), list(range(7)), secret=producer_secret)  # still on offer
    finally:
        consumer.shutdown()
        producer.shutdown()


class _Tap:
    """A TCP relay in front of the producer that keeps every byte the producer sends."""

    def __init__(self, port: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._port, self.seen, self._socks = port, bytearray(), []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self._port))
            self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, bytearray()), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.seen), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        try:
            while data := src.recv(1 << 16):
                record += data
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in self._socks:
            sock.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_encrypted_transfer_over_tcp(encrypt):
    """The same bytes arrive either way; on the wire the KV is readable only without encryption."""
    producer, consumer = _producer(encrypt=encrypt), _consumer(encrypt=encrypt)
    tap = _Tap(producer.port)
    try:
        src, dst = [5, 9, 2, 40, 41, 42, 7], list(range(10, 17))
        _offer(producer, "r", src)
        out = _load(consumer, "r", tap.addr, dst)
        assert out.finished_recving == {"r"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, dst], producer.kv[:, :, src])
        block = producer.kv[0, 0, src[0]].numpy().tobytes()  # 256 contiguous bytes of one chunk
        assert (block in tap.seen) == (not encrypt)
    finally:
        tap.close()
        consumer.shutdown()
        producer.shutdown()


@pytest.mark.parametrize("producer_side, consumer_side, ipc", [
    pytest.param((SECRET, True), (SECRET, False), False, id="encrypted-producer-plain-consumer"),
    pytest.param((SECRET, True), (SECRET, False), True, id="encrypted-producer-plain-consumer-ipc"),
    pytest.param((SECRET, False), (SECRET, True), False, id="plain-producer-encrypted-consumer"),
    pytest.param((SECRET, True), (WRONG, True), False, id="encrypted-other-secret"),
])
def test_an_encryption_mismatch_fails_cleanly(producer_side, consumer_side, ipc):
    """The transport handshake fails, which the consumer sees at once: reason ``auth``, well
    before the load's deadline; the producer serves a matching consumer as before (over ipc:
    with a shared-memory loan, which encryption leaves as it is)."""
    producer, consumer = _producer(*producer_side), _consumer(*consumer_side)
    addr = ipc_path(producer.port) if ipc else _tcp(producer)
    try:
        _offer(producer, "r", list(range(7)))
        start = time.monotonic()
        out = _load(consumer, "r", addr, list(range(7)))
        assert out.failed_recving == {"r"}, out
        assert out.failure_reasons["r"].startswith("auth: the transport handshake failed"), out.failure_reasons
        assert time.monotonic() - start < 5, "the load waited for its deadline"
        assert consumer.counters["failures"] == {"auth": 1}
        matching = _consumer(*producer_side)
        try:
            out = _load(matching, "r", addr, list(range(7)))
            assert out.finished_recving == {"r"}, out.failure_reasons
            assert torch.equal(matching.kv[:, :, :7], producer.kv[:, :, :7])
            assert matching.counters["shm_loads"] == ipc
        finally:
            matching.shutdown()
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_encryption_needs_a_secret():
    with pytest.raises(ValueError, match="--kv-encrypt needs the deployment secret"):
        P2PConnectorWorker("p", "fp", "127.0.0.1", free_port(), encrypt=True)


def test_what_strangers_make_the_producer_hold_is_bounded(producer, ctx, monkeypatch):
    """Open challenges and sessions are capped, oldest out: a flood of handshakes costs the
    producer a fixed amount of memory (and the oldest open handshakes)."""
    monkeypatch.setattr(p2p_producer, "MAX_CHALLENGES", 3)
    monkeypatch.setattr(p2p_producer, "MAX_SESSIONS", 2)
    peers = [RawPeer(ctx, _tcp(producer)) for _ in range(5)]
    try:
        for peer in peers:
            peer.hello()
        assert len(producer.producer._challenges) == 3
        assert isinstance(peers[0].auth(SECRET, FINGERPRINT), Refused)  # its challenge was dropped
        for peer in peers[2:]:
            reply = peer.auth(SECRET, FINGERPRINT)
            assert isinstance(reply, HelloReply) and reply.ok
        assert len(producer.producer._sessions) == 2 and not producer.producer._challenges
        _offer(producer, "r", list(range(3)))
        peers[2].send(Pull("t", "r", 0, 3, "tokens"))  # the oldest session was dropped
        assert isinstance(peers[2].recv(), Refused)
        peers[4].send(Pull("t", "r", 0, 3, "tokens"))
        reply = peers[4].recv()
        assert isinstance(reply, Chunk) and reply.status == "ok"
    finally:
        for peer in peers:
            peer.close()


def test_a_flood_that_pushes_out_a_consumers_challenge_costs_it_one_more_round_trip(producer, ctx, monkeypatch):
    """A stranger's Hello arrives between the consumer's Hello and its Auth and pushes the
    consumer's open challenge out: the producer refuses the consumer's (valid) proof, and the
    consumer, which has already seen the producer prove the secret, tries once more and loads."""
    monkeypatch.setattr(p2p_producer, "MAX_CHALLENGES", 1)
    stranger = RawPeer(ctx, _tcp(producer))
    checked = p2p_consumer.proof_ok
    calls = []

    def proof_ok_during_a_flood(*args):
        if not calls:
            stranger.hello()  # answered: the producer has dropped the consumer's challenge
        calls.append(1)
        return checked(*args)
    monkeypatch.setattr(p2p_consumer, "proof_ok", proof_ok_during_a_flood)
    consumer = _consumer()
    try:
        _offer(producer, "r", list(range(3)))
        out = _load(consumer, "r", _tcp(producer), list(range(3)))
        assert out.finished_recving == {"r"}, out.failure_reasons
        assert len(calls) == 2 and producer.auth_failures() == {"proof": 1}
    finally:
        stranger.close()
        consumer.shutdown()


def test_a_consumer_whose_session_was_dropped_reconnects(producer, ctx, monkeypatch):
    """A session pushed out by newer ones (or a producer restarted on the same address): the
    consumer's next pull is refused, and it handshakes afresh and pulls at once, without waiting
    for its deadline and without failing the load."""
    monkeypatch.setattr(p2p_producer, "MAX_SESSIONS", 1)
    monkeypatch.setattr(p2p_consumer, "NUM_PULLERS", 1)  # one socket, so the second load reuses it
    consumer = _consumer()
    newer = RawPeer(ctx, _tcp(producer))
    try:
        for rid in ("a", "b"):
            _offer(producer, rid, list(range(3)))
        assert _load(consumer, "a", _tcp(producer), list(range(3))).finished_recving == {"a"}
        assert newer.handshake(SECRET, FINGERPRINT).ok  # pushes the consumer's session out
        start = time.monotonic()
        out = _load(consumer, "b", _tcp(producer), list(range(3)))
        assert out.finished_recving == {"b"}, out.failure_reasons
        assert time.monotonic() - start < 5, "the load waited for its deadline"
        assert consumer.counters["failures"] == {}
        assert producer.auth_failures() == {"unauthenticated": 1}  # the stale session's pull
    finally:
        newer.close()
        consumer.shutdown()


@pytest.mark.parametrize("pull_lost", [False, True], ids=["closed-when-idle", "pull-lost"])
def test_a_producer_restarted_with_other_encryption_fails_a_cached_connection_by_its_deadline(monkeypatch, pull_lost):
    """The consumer keeps its socket to an address; the producer there restarts with
    --kv-encrypt, so zmq's reconnects fail their transport handshake and leave it no connection
    to queue a pull on (a blocking send would hang the puller for ever). The idle puller closes
    that connection once it sees the failed reconnect, and the pull handshakes afresh, which shows
    the mismatch: it fails as auth, long before its deadline, and the puller goes on serving
    other producers. ``pull-lost``: the pull was queued all the same (zmq
    was in the middle of a reconnect when it was sent) and is lost with that connection; the
    failed handshake, seen while the pull waits, fails it as soon."""
    monkeypatch.setattr(p2p_consumer, "NUM_PULLERS", 1)  # one puller: the one that would hang
    send, broken, close = p2p_peers.Peer.send, p2p_peers.Peer.broken, p2p_peers.Peer.close
    closed = []
    monkeypatch.setattr(p2p_peers.Peer, "close", lambda peer: (closed.append(peer), close(peer))[1])
    port = free_port()
    first = P2PConnectorWorker(ENGINE_ID, FINGERPRINT, "127.0.0.1", port, secret=SECRET)
    first.register_kv_caches(torch.randn(SHAPE))
    consumer, restarted, other = _consumer(), None, _producer()
    try:
        _offer(first, "a", list(range(3)))
        assert _load(consumer, "a", _tcp(first), list(range(3))).finished_recving == {"a"}
        if pull_lost:  # the failed reconnect not seen before the pull either
            monkeypatch.setattr(p2p_peers.Peer, "broken", lambda peer: False)
        first.shutdown()
        restarted = P2PConnectorWorker(ENGINE_ID, FINGERPRINT, "127.0.0.1", port, secret=SECRET, encrypt=True)
        restarted.register_kv_caches(torch.randn(SHAPE))
        _offer(restarted, "b", list(range(3)))
        time.sleep(1.5)  # zmq reconnects (every 100 ms) and the handshake fails
        assert bool(closed) != pull_lost, closed  # the puller's connection, closed before any pull
        if pull_lost:
            monkeypatch.setattr(p2p_peers.Peer, "send", lambda peer, msg, patience_s=0.0: True)
        start = time.monotonic()
        consumer.start_load_kv(P2PMetadata(loads=[LoadSpec("b", _tcp(restarted), "b", 0, list(range(3)),
                                                           time.monotonic() + 20, "tokens")]))
        out = _load_result(consumer, timeout=30)
        assert out.failed_recving == {"b"}, out
        reason = out.failure_reasons["b"]
        # Seen on a fresh handshake (a failed reconnect may be history by the next one).
        assert reason.startswith("auth: the transport handshake failed") and "(handshake with" in reason, reason
        assert time.monotonic() - start < 5, "the load waited for its deadline"
        assert consumer.counters["failures"] == {"auth": 1}
        monkeypatch.setattr(p2p_peers.Peer, "send", send)
        monkeypatch.setattr(p2p_peers.Peer, "broken", broken)
        _offer(other, "c", list(range(3)))
        assert _load(consumer, "c", _tcp(other), list(range(3))).finished_recving == {"c"}
    finally:
        consumer.shutdown()
        other.shutdown()
        if restarted is not None:
            restarted.shutdown()


def test_a_load_that_raises_fails_alone_and_the_puller_goes_on(monkeypatch, producer):
    """An exception inside one load (zmq out of sockets, a bug) fails that load, reason
    ``internal``, and the only puller serves the next one."""
    monkeypatch.setattr(p2p_consumer, "NUM_PULLERS", 1)
    load_from = p2p_consumer.P2PConsumer._load_from

    def raising_once(self, job, peers):
        if job.req_id == "boom":
            raise zmq.ZMQError(errno.EMFILE)
        return load_from(self, job, peers)
    monkeypatch.setattr(p2p_consumer.P2PConsumer, "_load_from", raising_once)
    consumer = _consumer()
    try:
        out = _load(consumer, "boom", _tcp(producer), list(range(3)))
        assert out.failed_recving == {"boom"} and out.failure_reasons["boom"].startswith("internal: ZMQError")
        _offer(producer, "after", list(range(3)))
        assert _load(consumer, "after", _tcp(producer), list(range(3))).finished_recving == {"after"}
        assert consumer.counters["failures"] == {"internal": 1}
    finally:
        consumer.shutdown()
