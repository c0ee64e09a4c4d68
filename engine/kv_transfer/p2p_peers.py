"""The KV consumer's authenticated producers (engine/kv_transfer/p2p_consumer.py), per thread.

A peer keeps its socket's monitor of failed transport handshakes for life: zmq reconnects a
socket by itself, and a reconnect to a producer restarted on the address with other
--kv-encrypt settings or another secret fails there and nowhere else (what was queued meanwhile
is lost; with another secret zmq retries for ever and the socket keeps taking messages).
libzmq's I/O thread blocks on a full monitor queue, for every socket of the context (with
zmq's default bound, some 2000 failed reconnects of an idle peer, 100 ms apart); so a monitor
here has no bound, and its peer is closed by the next tidy after an event (between jobs, and
every 0.1 s while the thread is idle): what queues is one pull's duration of events at most.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import zmq

from engine.kv_transfer.p2p_wire import SessionTag, WireMessage, encode

SEND_PATIENCE_S = 1.0
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
MAX_PEERS = 32  # per thread (each is three zmq sockets); the least recently used is closed first
PEER_IDLE_S = 300.0  # a peer unused this long is closed (a producer gone for good keeps none)


@dataclass(slots=True)
class Peer:
    """An authenticated producer: our socket to it, the monitor of that socket's failed
    transport handshakes, its shared KV tensor when it lends blocks on this host, and the
    session that tags everything we send it."""
    sock: zmq.Socket
    monitor: zmq.Socket
    kv: torch.Tensor | None
    session: SessionTag
    used: float = field(default_factory=time.monotonic)

    def send(self, msg: WireMessage, patience_s: float = SEND_PATIENCE_S) -> bool:
        """Queue ``msg``; False when the socket takes nothing within ``patience_s``: zmq has no
        connection to queue on (a blocking send would wait for ever), e.g. after a reconnect
        whose transport handshake failed. A live connection takes a message at once."""
        if not self.sock.poll(int(patience_s * 1000), zmq.POLLOUT):
            return False
        body = encode(msg)
        try:
            self.sock.send_multipart([body, self.session.next(body)], flags=zmq.NOBLOCK)
        except zmq.Again:  # the connection went between the poll and the send
            return False
        return True

    def broken(self) -> bool:
        """A reconnect of its socket failed its transport handshake: its session is gone."""
        return bool(self.monitor.poll(0))

    def close(self) -> None:
        close_monitored(self.sock, self.monitor)


_monitor_ids = itertools.count()


def monitored_socket(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER for a producer, and the monitor of its failed transport handshakes (unbounded:
    see the module's docstring)."""
    sock = ctx.socket(zmq.DEALER)
    monitor = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        endpoint = f"inproc://kv-peer-monitor-{next(_monitor_ids)}"
        sock.monitor(endpoint, HANDSHAKE_FAILED)
        monitor = ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.connect(endpoint)
        return sock, monitor
    except zmq.ZMQError:
        if monitor is not None:
            monitor.close(linger=0)
        sock.close(linger=0)
        raise


def close_monitored(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass  # (the context is terminating) closing is what matters
    finally:
        monitor.close(linger=0)
        sock.close(linger=0)


class PeerCache:
    """One thread's peers by address: at most MAX_PEERS, a broken or idle one closed by ``tidy``."""

    def __init__(self) -> None:
        self._peers: OrderedDict[str, Peer] = OrderedDict()

    def __contains__(self, addr: str) -> bool:
        return addr in self._peers

    def get(self, addr: str) -> Peer | None:
        peer = self._peers.get(addr)
        if peer is not None:
            peer.used = time.monotonic()
            self._peers.move_to_end(addr)
        return peer

    def put(self, addr: str, peer: Peer) -> None:
        self.drop(addr)
        self._peers[addr] = peer
        while len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)[1].close()

    def drop(self, addr: str) -> None:
        """Closes the peer at ``addr`` (anything queued or in flight on it is dropped)."""
        peer = self._peers.pop(addr, None)
        if peer is not None:
            peer.close()

    def tidy(self) -> None:
        """Closes the peers whose reconnect failed its handshake, and those unused for PEER_IDLE_S."""
        idle = time.monotonic() - PEER_IDLE_S
        for addr in [a for a, p in self._peers.items() if p.used < idle or p.broken()]:
            self.drop(addr)

    def close(self) -> None:
        for addr in list(self._peers):
            self.drop(addr)
