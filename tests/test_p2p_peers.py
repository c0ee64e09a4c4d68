"""The KV consumer's peer cache (engine/kv_transfer/p2p_peers.py), on real zmq sockets: a peer
whose socket's handshake failed is closed at the next tidy, an unread monitor never stops the
context (libzmq blocks on a full one), idle and least recently used peers are closed, and
closing survives a terminating context."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from engine.kv_transfer import p2p_peers
from engine.kv_transfer.p2p_peers import Peer, PeerCache, monitored_socket
from engine.kv_transfer.p2p_wire import NO_AUTH_SECRET, SessionTag


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
    _servers.clear()


_servers: list[zmq.Socket] = []  # kept open (a collected socket closes); the context's end closes them


def _server(ctx: zmq.Context, curve: bool = False) -> str:
    sock = ctx.socket(zmq.ROUTER)
    _servers.append(sock)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _peer(ctx: zmq.Context, addr: str, wrong_key: bool = False, reconnect_ms: int = 100) -> Peer:
    sock, monitor = monitored_socket(ctx)
    sock.setsockopt(zmq.RECONNECT_IVL, reconnect_ms)
    if wrong_key:  # a producer restarted with another secret: zmq retries for ever
        sock.curve_serverkey = zmq.curve_keypair()[0]
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(addr)
    return Peer(sock, monitor, None, SessionTag(NO_AUTH_SECRET, b"c", b"p"))


def _wait(predicate, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_peer_whose_handshake_failed_is_closed_at_the_next_tidy_and_a_healthy_one_kept(ctx):
    peers = PeerCache()
    healthy, failing = _peer(ctx, _server(ctx)), _peer(ctx, _server(ctx, curve=True), wrong_key=True)
    peers.put("healthy", healthy)
    peers.put("failing", failing)
    assert _wait(failing.broken)
    peers.tidy()
    assert "failing" not in peers and failing.sock.closed and failing.monitor.closed
    assert "healthy" in peers and not healthy.sock.closed
    peers.close()
    assert healthy.sock.closed and healthy.monitor.closed


def test_thousands_of_failed_reconnects_of_an_unread_peer_leave_the_context_working(ctx):
    """libzmq's I/O thread blocks on a full monitor queue (2000 events by default), and with it
    every socket of the context: a peer's monitor has no bound. The peer retries every 1 ms
    here (zmq's default is 100 ms) to fail its handshake thousands of times within seconds."""
    peer = _peer(ctx, _server(ctx, curve=True), wrong_key=True, reconnect_ms=1)
    healthy_server = ctx.socket(zmq.ROUTER)
    client = ctx.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{healthy_server.bind_to_random_port('tcp://127.0.0.1')}")
    time.sleep(10)
    client.send(b"still there?")
    assert healthy_server.poll(3000), "the context's I/O thread is stuck"
    failures = 0
    while peer.monitor.poll(0):
        peer.monitor.recv_multipart()
        failures += 1
    assert failures > 2000, f"only {failures} failed reconnects: the test proved nothing"
    for sock in (client, healthy_server):
        sock.close(linger=0)
    peer.close()


def test_idle_and_least_recently_used_peers_are_closed(ctx, monkeypatch):
    monkeypatch.setattr(p2p_peers, "MAX_PEERS", 2)
    addr = _server(ctx)
    peers = PeerCache()
    first, second, third = (_peer(ctx, addr) for _ in range(3))
    peers.put("first", first)
    peers.put("second", second)
    assert peers.get("first") is first  # now the most recently used
    peers.put("third", third)
    assert second.sock.closed and "second" not in peers and "first" in peers and "third" in peers
    first.used -= p2p_peers.PEER_IDLE_S + 1
    peers.tidy()
    assert first.sock.closed and "first" not in peers and "third" in peers
    peers.close()


def test_closing_a_peer_closes_both_its_sockets_while_the_context_terminates(ctx):
    """A worker's shutdown terminates its context, which waits for every socket: a puller that
    closes its peers after that began must close each one's socket and monitor, or it hangs."""
    context = zmq.Context()
    peers, peer = PeerCache(), _peer(context, _server(ctx))
    peers.put("a", peer)
    terminating = threading.Thread(target=context.term)
    terminating.start()
    time.sleep(0.2)
    peers.close()
    terminating.join(5)
    assert not terminating.is_alive() and peer.sock.closed and peer.monitor.closed
