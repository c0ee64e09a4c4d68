"""The P2P worker halves in one process over real zmq sockets: the same-host shared-memory
loan (scattered blocks, two consumers at once, a copy that outlives the lease), the socket
path through the staging buffer (multi-chunk), and the fallback when shared memory is off."""
from __future__ import annotations

import os
import random
import threading
import time
import zlib

import msgspec
import pytest
import torch
import zmq

from engine.kv_transfer.base import allocate_kv_tensor
from engine.kv_transfer.p2p import LoadSpec, P2PMetadata, ReleaseSpec, SendSpec, ipc_path
from engine.kv_transfer.p2p_wire import (
    NO_AUTH_SECRET, NONCE_BYTES, Auth, Challenge, Hello, HelloReply, Pull, SessionTag, decode, encode, proof,
)
from engine.kv_transfer.p2p_worker import P2PConnectorWorker
from tests.server_utils import free_port

SHAPE = (2, 2, 64, 4, 2, 8)  # [layers, k/v, blocks, block_size, kv heads, head dim]
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4


def kv_tensor_for(worker: P2PConnectorWorker, shape) -> torch.Tensor:
    """The float32 CPU KV tensor the model runner would allocate for ``worker``."""
    cpu = torch.device("cpu")
    return allocate_kv_tensor(shape, torch.float32, cpu, worker.kv_cache_file(shape, torch.float32, cpu))


@pytest.fixture(autouse=True)
def shared_memory_kv(monkeypatch):
    """These tests drive the same-host shared-memory loan (opt-in, ENGINE_KV_SHM=1) unless they turn it off."""
    monkeypatch.setenv("ENGINE_KV_SHM", "1")


def _producer() -> P2PConnectorWorker:
    worker = P2PConnectorWorker("p", "fp", "127.0.0.1", free_port(), chunk_bytes=3 * BLOCK_BYTES)  # 3-block chunks
    kv = kv_tensor_for(worker, SHAPE)
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
    return _consumer_of(SHAPE)


class RawPeer:
    """A consumer socket driven by hand, message by message: a test's stand-in for a consumer,
    or an attacker's. ``replies`` keeps the raw bytes of everything it received."""

    def __init__(self, ctx: zmq.Context, addr: str, routing_id: bytes | None = None, **options) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        for name, value in options.items():
            self.sock.setsockopt(getattr(zmq, name), value)
        self.sock.connect(addr)
        self.session: SessionTag | None = None
        self.replies: list[bytes] = []

    def handshake(self, secret=None, fingerprint: str = "fp"):
        """Hello, then Auth; the reply to Auth."""
        self.hello()
        return self.auth(secret, fingerprint)

    def hello(self) -> Challenge:
        self.nonce = os.urandom(NONCE_BYTES)
        self.send_raw(encode(Hello(self.nonce)))
        self.challenge = self.recv()
        assert isinstance(self.challenge, Challenge), self.challenge
        return self.challenge

    def auth(self, secret=None, fingerprint: str = "fp"):
        """Auth with a proof under ``secret`` (the producer's proof is not checked, as an attacker
        would not), and from now on tag messages with the session this peer believes in."""
        secret = secret or NO_AUTH_SECRET
        self.send_raw(encode(Auth(proof(secret, b"consumer", self.nonce, self.challenge.nonce), fingerprint)))
        self.session = SessionTag(secret, self.nonce, self.challenge.nonce)
        return self.recv()

    def send(self, msg) -> list[bytes]:
        """``msg`` tagged by this peer's session (or by a made-up tag before it has one); the frames sent."""
        body = encode(msg)
        frames = [body, self.session.next(body) if self.session else os.urandom(32)]
        self.send_raw(*frames)
        return frames

    def send_raw(self, *frames: bytes) -> None:
        # A test fails rather than hangs when zmq has no connection to queue on (a failed CURVE handshake).
        assert self.sock.poll(5000, zmq.POLLOUT), "the socket takes nothing"
        self.sock.send_multipart(list(frames), flags=zmq.NOBLOCK)

    def recv(self, timeout: float = 5):
        assert self.sock.poll(int(timeout * 1000)), "no reply"
        frames = self.sock.recv_multipart()
        self.replies += frames
        return decode(frames[0])

    def close(self) -> None:
        self.sock.close(linger=0)


def hold_copies(consumer: P2PConnectorWorker, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Makes ``consumer``'s shared-memory copies wait: the first event is set when a copy has
    begun, and the copy goes on once the test sets the second."""
    copy = consumer.consumer._copy_blocks
    copying, go_on = threading.Event(), threading.Event()

    def held_copy(*args):
        copying.set()
        go_on.wait(30)
        copy(*args)
    monkeypatch.setattr(consumer.consumer, "_copy_blocks", held_copy)
    return copying, go_on


def _consumer_of(shape) -> P2PConnectorWorker:
    worker = P2PConnectorWorker("d", "fp", None, None)
    worker.register_kv_caches(torch.zeros(shape))
    return worker


def _transfer(producer, consumer, rid: str, src: list[int], dst: list[int], addr: str, lease_s: float = 30,
              pull_digest: str = "tokens", fault: str | None = None):
    producer.save_kv(P2PMetadata(sends=[SendSpec(rid, src, len(src) * 4, time.monotonic() + lease_s,
                                                       "tokens", fault)]))
    consumer.start_load_kv(P2PMetadata(loads=[LoadSpec(rid, addr, rid, 0, dst, time.monotonic() + 10,
                                                       pull_digest)]))
    return _load_result(consumer)


def _load_result(consumer, timeout: float = 15):
    """The consumer's output once a load has finished or failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = consumer.get_finished()
        if out.finished_recving or out.failed_recving:
            return out
        time.sleep(0.005)
    raise AssertionError("transfer never finished")


def _sent(producer, rid: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while rid not in producer.get_finished().finished_sending:
        assert time.monotonic() < deadline, "the producer never released its blocks"
        time.sleep(0.005)


def test_a_producer_restarted_on_the_same_address_is_pulled_from_afresh(monkeypatch):
    """zmq reconnects a consumer's socket to whatever listens on the address next: a producer
    restarted there refuses the old session, and the consumer handshakes again instead of
    failing the load (one puller, so the stale socket is certainly the one used)."""
    monkeypatch.setattr("engine.kv_transfer.p2p_consumer.NUM_PULLERS", 1)
    first = _producer()
    consumer = _consumer()
    addr = f"tcp://127.0.0.1:{first.port}"
    try:
        assert _transfer(first, consumer, "r1", [1, 2], [3, 4], addr).finished_recving == {"r1"}
        first.shutdown()
        second = P2PConnectorWorker("p", "fp", "127.0.0.1", first.port, chunk_bytes=3 * BLOCK_BYTES)
        second.register_kv_caches(kv_tensor_for(second, SHAPE))
        second.kv.copy_(torch.randn(SHAPE))
        try:
            out = _transfer(second, consumer, "r2", [5, 6, 7], [8, 9, 10], addr)
            assert out.finished_recving == {"r2"}, out.failure_reasons
            assert torch.equal(consumer.kv[:, :, [8, 9, 10]], second.kv[:, :, [5, 6, 7]])
            assert consumer.counters["failures"] == {}
        finally:
            second.shutdown()
    finally:
        consumer.shutdown()


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
        assert consumer.counters["shm_loads"] == (0 if tcp else 1)
        pulls = consumer.stats().pulls  # per producer, for /status and the proxy's path costs
        assert list(pulls) == [addr]
        assert {k: pulls[addr][k] for k in ("pulls", "tokens", "bytes")} == {
            "pulls": 1, "tokens": 11 * SHAPE[3], "bytes": 11 * BLOCK_BYTES}
        assert 0 < pulls[addr]["seconds"] < 10
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
        assert consumer.counters["shm_loads"] == 0
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


# ---- FAULTS.md 17: what the consumer checks before it writes a byte ----------------------------
TCP = "tcp://127.0.0.1:{port}"  # injected faults take the socket path (never a shared-memory loan)


@pytest.mark.parametrize("fault, problem", [  # 7 blocks in 3-block chunks: every chunk is damaged
    pytest.param("truncate", "truncated: 1536 of 3072 bytes", id="truncate"),
    pytest.param("reorder", "out of order: chunk 1 at block 0, expected 0", id="reorder"),
    pytest.param("bad_dtype", "bad header: float16[2, 2, 3, 4, 2, 8], expected float32[2, 2, 3, 4, 2, 8]",
                 id="bad-dtype"),
    pytest.param("bad_shape", "bad header: float32[2, 2, 4, 4, 2, 8], expected float32[2, 2, 3, 4, 2, 8]",
                 id="bad-shape"),
    pytest.param("corrupt", "corrupt: checksum mismatch", id="optional-crc32-mismatch"),
])
def test_a_damaged_frame_is_rejected_before_a_byte_is_written(producer, fault, problem):
    """Each damage the fault injector does to the chunk frames on the real send path fails the
    load, naming the check that caught it, and leaves the consumer's blocks untouched.

    ``corrupt`` flips bits under a CRC32 that only the injector sets: real frames carry no
    checksum (zmq over TCP protects bytes in transit, same-host transfers are memory copies), so
    it checks the consumer's verification of the optional ``crc32`` field, not detection of
    corruption on a real link."""
    consumer = _consumer()
    try:
        out = _transfer(producer, consumer, "r", list(range(7)), list(range(7)), TCP.format(port=producer.port),
                        fault=fault)
        assert out.failed_recving == {"r"} and not out.finished_recving, out
        assert out.failure_reasons["r"] == f"frame rejected: {problem}"
        assert not consumer.kv.any(), "bytes of a rejected transfer were written"
        assert consumer.counters["failures"] == {"frame rejected": 1} and consumer.counters["bytes_received"] == 0
        _sent(producer, "r")
    finally:
        consumer.shutdown()


def test_a_frame_whose_optional_crc32_matches_is_used(producer, monkeypatch):
    """The other half of the optional CRC check: a sender that fills in ``crc32`` (none does
    today) has its frames verified and, when they match, used."""
    from engine.kv_transfer import p2p_producer
    monkeypatch.setattr(p2p_producer, "_inject_fault", lambda fault, header, payload: [
        (msgspec.structs.replace(header, crc32=zlib.crc32(payload)), payload)])
    consumer = _consumer()
    try:
        out = _transfer(producer, consumer, "r", list(range(7)), list(range(7, 14)), TCP.format(port=producer.port))
        assert out.finished_recving == {"r"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, 7:14], producer.kv[:, :, :7])
    finally:
        consumer.shutdown()


def test_copy_that_outlives_the_lease_is_discarded(producer, monkeypatch):
    """The producer may reuse lent blocks once the lease ends; a consumer still copying must
    then fail the load (and recompute) rather than keep a copy that may be torn. The copy is
    held open until the producer has observably ended the loan (no sleep has to outlast the
    lease); the lease only has to outlast one loopback round trip for the grant."""
    consumer = _consumer()
    copying, lease_ended = hold_copies(consumer, monkeypatch)
    try:
        lease_s = 2.0
        producer.save_kv(P2PMetadata(sends=[SendSpec("slow", list(range(9)), 36, time.monotonic() + lease_s,
                                                           "tokens")]))
        consumer.start_load_kv(P2PMetadata(loads=[LoadSpec("slow", ipc_path(producer.port), "slow", 0,
                                                           list(range(9)), time.monotonic() + 60, "tokens")]))
        assert copying.wait(10), f"never lent the blocks: {consumer.get_finished().failure_reasons}"
        # Lent and not returned: only the lease can end the loan, and then the producer frees
        # the blocks (finished_sending) while the consumer is still copying.
        _sent(producer, "slow", timeout=lease_s + 10)
        lease_ended.set()
        out = _load_result(consumer)
        assert out.failed_recving == {"slow"}, out
        assert out.failure_reasons["slow"] == "timeout: the producer's lease ended during the copy"
        # The next transfer works (the held copy now goes straight on).
        out = _transfer(producer, consumer, "next", list(range(9)), list(range(9, 18)), ipc_path(producer.port))
        assert out.finished_recving == {"next"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, 9:18], producer.kv[:, :, :9])
        # Both count in the producer's path: the one that timed out with the time it took.
        pulls = consumer.stats().pulls[ipc_path(producer.port)]
        assert (pulls["pulls"], pulls["timeouts"], pulls["tokens"], pulls["bytes"]) == (2, 1, 18 * SHAPE[3],
                                                                                        9 * BLOCK_BYTES)
        assert pulls["seconds"] >= lease_s
    finally:
        lease_ended.set()
        consumer.shutdown()


# ---- FAULTS.md 30: one stalled consumer blocks nobody -----------------------------------------
BIG_SHAPE = (2, 2, 256, 16, 8, 64)  # 128 KiB blocks, 32 MiB in all: far more than socket buffers hold
MiB = 2**20


def _big_producer(monkeypatch) -> P2PConnectorWorker:
    monkeypatch.setenv("ENGINE_KV_SHM", "0")  # every transfer takes the socket path
    worker = P2PConnectorWorker("p", "fp", "127.0.0.1", free_port(), chunk_bytes=MiB)
    kv = kv_tensor_for(worker, BIG_SHAPE)
    kv.copy_(torch.randn(BIG_SHAPE))
    worker.register_kv_caches(kv)
    return worker


def _stalled_peer(ctx: zmq.Context, addr: str) -> RawPeer:
    """A consumer that handshakes, then never reads: its zmq queue holds one message and its
    kernel buffer a few KiB, so the producer's frames back up."""
    peer = RawPeer(ctx, addr, RCVHWM=1, RCVBUF=4096)
    reply = peer.handshake()
    assert isinstance(reply, HelloReply) and reply.ok
    return peer


class _Finished:
    """Accumulates the producer's finished_sending across get_finished calls."""

    def __init__(self, producer: P2PConnectorWorker) -> None:
        self.producer, self.sent = producer, set()

    def wait(self, rid: str, until: float) -> float:
        while rid not in self.sent:
            assert time.monotonic() < until, f"{rid} was not reported in finished_sending in time"
            self.sent |= self.producer.get_finished().finished_sending
            time.sleep(0.005)
        return time.monotonic()


def _wait_until_stalled(producer: P2PConnectorWorker, quiet_s: float = 0.5, timeout: float = 30) -> None:
    """Until the producer has started a transfer and then gathered nothing more for ``quiet_s``
    (it gathers a chunk only once zmq has taken the one before: a consumer that does not read
    stops it). Polled, so a slow machine only waits longer."""
    deadline = time.monotonic() + timeout
    last, since = producer.counters["bytes_sent"], time.monotonic()
    while last == 0 or time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the producer never started, or never stopped, sending"
        time.sleep(0.02)
        if producer.counters["bytes_sent"] != last:
            last, since = producer.counters["bytes_sent"], time.monotonic()


def test_stalled_consumer_blocks_nobody(monkeypatch):
    producer, consumer, ctx = _big_producer(monkeypatch), _consumer_of(BIG_SHAPE), zmq.Context()
    producer.producer.stall_s = 120  # here the stalled transfer ends only when its socket closes
    addr = f"tcp://127.0.0.1:{producer.port}"
    finished = _Finished(producer)
    try:
        stalled = _stalled_peer(ctx, addr)
        producer.save_kv(P2PMetadata(sends=[SendSpec("stuck", list(range(256)), 256 * 16,
                                                           time.monotonic() + 60, "tokens")]))
        stalled.send(Pull("t-stuck", "stuck", 0, 256, "tokens"))
        _wait_until_stalled(producer)  # every buffer between the producer and the stalled peer is full
        assert producer.counters["bytes_sent"] < 32 * MiB, "the peer did not stall: make BIG_SHAPE bigger"
        assert "stuck" not in producer.get_finished().finished_sending

        # While it stays stalled: another consumer's transfer, a release and a lease expiry
        # all happen on time (the old inline sender blocked up to 30 s per chunk).
        start = time.monotonic()
        producer.save_kv(P2PMetadata(sends=[
            SendSpec("released", [0, 1], 32, start + 60, "tokens"),
            SendSpec("expiring", [2, 3], 32, start + 1.0, "tokens")]))
        out = _transfer(producer, consumer, "other", list(range(100, 140)), list(range(40)), addr)
        assert out.finished_recving == {"other"}, out.failure_reasons
        assert time.monotonic() - start < 5, "a transfer waited behind the stalled consumer"
        assert torch.equal(consumer.kv[:, :, :40], producer.kv[:, :, 100:140])
        finished.wait("other", start + 5)
        released_at = time.monotonic()
        consumer.start_load_kv(P2PMetadata(releases=[ReleaseSpec(addr, "released", "tokens")]))
        finished.wait("released", released_at + 5)
        finished.wait("expiring", start + 1.0 + 5)
        assert "stuck" not in finished.sent  # still in flight: its consumer is alive

        # Its consumer leaves: the producer abandons the transfer and frees the blocks.
        closed_at = time.monotonic()
        stalled.close()
        finished.wait("stuck", closed_at + 5)
        out = _transfer(producer, consumer, "after", list(range(64)), list(range(64)), addr)
        assert out.finished_recving == {"after"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, :64], producer.kv[:, :, :64])
    finally:
        consumer.shutdown()
        producer.shutdown()
        ctx.destroy(linger=0)


def test_stall_limit_abandons_a_consumer_that_stays_connected(monkeypatch):
    """A consumer that stops reading but keeps its socket open: the transfer is abandoned after
    the stall limit, its blocks are freed, and staging still serves the next transfers even
    though zmq keeps the abandoned frames queued for the stalled peer."""
    producer, consumer, ctx = _big_producer(monkeypatch), _consumer_of(BIG_SHAPE), zmq.Context()
    producer.producer.stall_s = 1.0
    addr = f"tcp://127.0.0.1:{producer.port}"
    finished = _Finished(producer)
    try:
        stalled = [_stalled_peer(ctx, addr) for _ in range(4)]  # as many as there are transfer slots
        start = time.monotonic()
        for i, peer in enumerate(stalled):
            producer.save_kv(P2PMetadata(sends=[SendSpec(f"stuck{i}", list(range(256)), 256 * 16,
                                                               start + 60, "tokens")]))
            peer.send(Pull(f"t{i}", f"stuck{i}", 0, 256, "tokens"))
        for i in range(4):
            finished.wait(f"stuck{i}", start + 1.0 + 5)
        assert producer.counters["abandoned_sends"] == 4
        out = _transfer(producer, consumer, "next", list(range(64)), list(range(64)), addr)
        assert out.finished_recving == {"next"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, :64], producer.kv[:, :, :64])
    finally:
        consumer.shutdown()
        producer.shutdown()
        ctx.destroy(linger=0)


def test_an_undecodable_message_from_an_authenticated_peer_is_dropped(producer):
    """Dropped and counted, and the peer's session goes on (its tag counted it in sequence)."""
    ctx = zmq.Context()
    peer = RawPeer(ctx, f"tcp://127.0.0.1:{producer.port}")
    try:
        assert peer.handshake().ok
        peer.send_raw(b"\xc1 not msgpack", peer.session.next(b"\xc1 not msgpack"))
        deadline = time.monotonic() + 5
        while producer.counters["dropped_messages"] == 0:
            assert time.monotonic() < deadline, "the undecodable message was not counted"
            time.sleep(0.01)
        producer.save_kv(P2PMetadata(sends=[SendSpec("r", [0, 1, 2], 12, time.monotonic() + 30, "tokens")]))
        peer.send(Pull("t", "r", 0, 3, "tokens"))
        reply = peer.recv()
        assert reply.status == "ok" and reply.num_blocks == 3, reply
        assert producer.auth_failures() == {}
    finally:
        peer.close()
        ctx.destroy(linger=0)


def test_renewals_keep_kv_for_a_queued_consumer_up_to_the_hold_limit(producer, monkeypatch):
    """An offer's lease restarts with each renewal for its tokens (a decode instance's queue
    renews it): renewed offers outlive several leases and are pulled whole; an offer renewed
    for other tokens, or not at all, ends with its lease; and renewals stop counting at
    MAX_LEASES_HELD leases from the offer."""
    import engine.kv_transfer.p2p_producer as p2p_producer
    from engine.kv_transfer.p2p import RenewSpec

    monkeypatch.setattr(p2p_producer, "MAX_LEASES_HELD", 6)
    consumer = _consumer()
    addr = f"tcp://127.0.0.1:{producer.port}"
    finished = _Finished(producer)
    lease = 0.5
    try:
        start = time.monotonic()
        producer.save_kv(P2PMetadata(sends=[
            SendSpec(rid, blocks, 4 * len(blocks), 0.0, "tokens", None, lease)
            for rid, blocks in (("kept", [0, 1]), ("capped", [2, 3]), ("lapsed", [4, 5]), ("misnamed", [6, 7]))]))
        renewals = [RenewSpec(addr, "kept", "tokens"), RenewSpec(addr, "capped", "tokens"),
                    RenewSpec(addr, "misnamed", "other tokens")]
        while time.monotonic() - start < 2.0:  # four leases
            consumer.start_load_kv(P2PMetadata(renewals=renewals))
            time.sleep(0.1)
            finished.sent |= producer.get_finished().finished_sending
        assert {"lapsed", "misnamed"} <= finished.sent and not {"kept", "capped"} & finished.sent
        consumer.start_load_kv(P2PMetadata(loads=[LoadSpec("kept", addr, "kept", 0, [10, 11],
                                                            time.monotonic() + 10, "tokens")]))
        out = _load_result(consumer)
        assert out.finished_recving == {"kept"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, 10:12], producer.kv[:, :, 0:2])
        # Renewed on and on: it ends at six leases (3 s) from the offer all the same.
        while "capped" not in finished.sent:
            assert time.monotonic() - start < 3.0 + 2.0, "renewals held an offer past MAX_LEASES_HELD"
            consumer.start_load_kv(P2PMetadata(renewals=renewals[1:2]))
            time.sleep(0.1)
            finished.sent |= producer.get_finished().finished_sending
        assert time.monotonic() - start >= 3.0 - 0.1
        assert producer.counters["lease_renewals"] > 10
    finally:
        consumer.shutdown()


def test_a_pull_that_comes_before_its_offer_waits_for_it(producer):
    """A step's offers are made once its output (which carries their parameters) went out
    (ModelRunner.save_kv), announced when the step began (start_load_kv): a pull that comes in
    between waits for the offer and loads the KV, where it would have found nothing. One for an
    offer its step never made (the step raised: the next one begins without it) is refused as
    not found then, not at the end of the wait."""
    consumer = _consumer()
    addr = ipc_path(producer.port)
    waiting = lambda: producer.producer._early  # noqa: E731  (the serve thread's list of pulls held)

    def pull(rid: str, dst: list[int]) -> None:
        consumer.start_load_kv(P2PMetadata(loads=[LoadSpec(rid, addr, rid, 0, dst, time.monotonic() + 10, "tokens")]))
        deadline = time.monotonic() + 10
        while not waiting():  # the producer has it, and holds it
            assert time.monotonic() < deadline, "the pull never reached the producer"
            time.sleep(0.005)
        assert not consumer.get_finished().finished_recving

    try:
        offer = SendSpec("r1", [1, 2], 8, time.monotonic() + 30, "tokens")
        producer.start_load_kv(P2PMetadata(sends=[offer]))  # the step that computes r1's prompt begins
        pull("r1", [3, 4])
        producer.save_kv(P2PMetadata(sends=[offer]))  # its output went out
        out = _load_result(consumer)
        assert out.finished_recving == {"r1"}, out.failure_reasons
        assert torch.equal(consumer.kv[:, :, [3, 4]], producer.kv[:, :, [1, 2]])
        _sent(producer, "r1")

        producer.start_load_kv(P2PMetadata(sends=[SendSpec("r2", [5, 6], 8, time.monotonic() + 30, "tokens")]))
        pull("r2", [7, 8])
        start = time.monotonic()
        producer.start_load_kv(P2PMetadata())  # r2's step raised: the next begins, r2 never offered
        out = _load_result(consumer)
        assert out.failed_recving == {"r2"} and "not_found" in out.failure_reasons["r2"], out.failure_reasons
        assert time.monotonic() - start < 2  # (a pull gives up waiting after EARLY_PULL_WAIT_S = 5 s)
        assert not waiting()
    finally:
        consumer.shutdown()
