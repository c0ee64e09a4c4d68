"""Disaggregated prefill over pyzmq: what travels between the producer's ROUTER and a
consumer's DEALER.

Frame 0 of every message is one msgspec-encoded message below; a chunk's data follows as one
raw frame. Both sides cut KV into chunks the same way (``ChunkLayout``), from a layout that
the fingerprint handshake already proved equal.

Opening a socket (mutual HMAC challenge-response, keyed by the deployment secret):

    consumer -> Hello(nonce_c)                       nothing about the consumer
    producer -> Challenge(nonce_p, proof "producer") the consumer checks it before saying more
    consumer -> Auth(proof "consumer", fingerprint)
    producer -> HelloReply(engine id, fingerprint, shm path): only now, and only to a valid proof

After that every consumer message travels as [body, tag]: ``SessionTag`` ties it to this
handshake and its place in the sequence. A ROUTER knows a peer only by its routing id, and a
new connection may claim any id once the old one has gone (ROUTER_HANDOVER off only stops it
while the old one is connected); the tag is what makes a claimed id, or a replayed message,
worthless. Messages from the producer are not tagged: a DEALER talks to the one endpoint it
connected to, so injecting there takes a party on the path, against which only ``--kv-encrypt``
(CURVE, ``curve_keys``) helps anyway.
"""
from __future__ import annotations

import hashlib
import hmac
import zlib
from dataclasses import dataclass

import msgspec
import torch
import zmq
import zmq.utils.z85

from engine.kv_transfer.secret import KVSecret

PROTOCOL_VERSION = 3  # 3: the socket opens with a challenge-response; consumer messages are tagged
NONCE_BYTES = 32
# Without a deployment secret the same handshake runs with this published key. It proves
# nothing (anyone can compute it): no authentication, so such a producer must listen on
# loopback only.
NO_AUTH_SECRET = KVSecret(b"engine-kv: no authentication, loopback only")
# Bytes of KV per chunk frame. The producer stages each in-flight chunk in a slot this big, so
# this bounds staging memory; a consumer refuses (zmq drops) larger frames.
DEFAULT_CHUNK_BYTES = 4 * 2**20
# Headroom over the data in a chunk message (its header), and over any control message.
FRAME_SLACK_BYTES = 64 * 2**10


class Hello(msgspec.Struct, tag="hello"):
    nonce: bytes  # NONCE_BYTES, fresh


class Challenge(msgspec.Struct, tag="challenge"):
    nonce: bytes  # NONCE_BYTES, fresh
    proof: bytes  # proof(secret, b"producer", their nonce, this nonce)


class Auth(msgspec.Struct, tag="auth"):
    proof: bytes  # proof(secret, b"consumer", our nonce, the challenge's nonce)
    fingerprint: str
    version: int = PROTOCOL_VERSION


class Refused(msgspec.Struct, tag="refused"):
    """The producer's only answer to a peer that has not authenticated: it says nothing else."""
    message: str = "not authenticated"


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
    token_digest: str = ""  # must equal the held entry's: KV only goes to the tokens it belongs to
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
    token_digest: str = ""


class Renew(msgspec.Struct, tag="renew"):
    """The consumer still wants this KV (its request is queued there): the lease restarts. A
    producer of an earlier release drops it as a malformed message (the lease still ends)."""
    request_id: str
    token_digest: str = ""


class Chunk(msgspec.Struct, tag="chunk"):
    transfer_id: str
    status: str  # "ok" | "not_found" | "mismatch" (held for other tokens) | "error"
    message: str = ""
    seq: int = 0
    num_chunks: int = 0
    first_block: int = 0
    num_blocks: int = 0
    dtype: str = ""
    shape: list[int] = []
    nbytes: int = 0
    crc32: int = 0


WireMessage = Hello | Challenge | Auth | Refused | HelloReply | Pull | Release | Renew | Chunk | ShmGrant | ShmDone | ShmAck

_decoder = msgspec.msgpack.Decoder(WireMessage)
encode = msgspec.msgpack.encode


def decode(buf) -> WireMessage | None:
    """The message in ``buf``, or None when it is not one (the caller drops and counts it)."""
    try:
        return _decoder.decode(buf)
    except msgspec.DecodeError:
        return None


def proof(secret: KVSecret, role: bytes, nonce_c: bytes, nonce_p: bytes) -> bytes:
    """What only a holder of ``secret`` can answer to this pair of nonces; ``role`` (b"producer",
    b"consumer") keeps one side's proof from ever passing for the other's."""
    return secret.mac("socket", role, nonce_c, nonce_p)


def proof_ok(secret: KVSecret, tag: bytes, role: bytes, nonce_c: bytes, nonce_p: bytes) -> bool:
    return secret.verify("socket", tag, role, nonce_c, nonce_p)  # constant time


class SessionTag:
    """Tags (consumer) and checks (producer) the consumer's messages of one handshake:
    HMAC(session key, sequence number, body). Both sides count from 0 and zmq delivers a
    connection's messages in order and without loss, so a message that is forged, replayed,
    reordered or from another session fails, and the producer then ends the session."""

    __slots__ = ("_key", "_seq")

    def __init__(self, secret: KVSecret, nonce_c: bytes, nonce_p: bytes) -> None:
        self._key = secret.mac("socket", b"session", nonce_c, nonce_p)
        self._seq = 0

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self._key, self._seq.to_bytes(8, "big") + body, hashlib.sha256).digest()

    def next(self, body: bytes) -> bytes:
        tag = self._tag(body)
        self._seq += 1
        return tag

    def check(self, body: bytes, tag: bytes) -> bool:
        ok = hmac.compare_digest(self._tag(body), tag)
        self._seq += ok
        return ok


def curve_keys(secret: KVSecret, role: str) -> tuple[bytes, bytes]:
    """The (public, secret) z85 CURVE keypair of ``role`` ("server" or "client"), derived from
    the deployment secret, so every instance of the deployment has the same ones. A client
    must know the server's public key before it connects, and it is never sent: without the
    deployment secret, a CURVE handshake with the producer fails before a message is read.
    The producer does not check client keys (no ZAP handler): the challenge-response inside
    authenticates the consumer."""
    secret_key = zmq.utils.z85.encode(secret.key(f"curve-{role}"))
    return zmq.curve_public(secret_key), secret_key


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """How a paged KV tensor [num_layers, 2, num_blocks, *block_shape] is cut into chunks."""
    block_shape: list[int]  # [block_size, num_kv_heads, head_dim]
    bytes_per_block: int  # of all layers, K and V
    blocks_per_chunk: int

    @classmethod
    def of(cls, kv: torch.Tensor, chunk_bytes: int) -> ChunkLayout:
        bytes_per_block = kv[:, :, 0].numel() * kv.element_size()
        # A block bigger than chunk_bytes still travels, alone, in a chunk of its own size.
        return cls(list(kv.shape[3:]), bytes_per_block, max(1, chunk_bytes // bytes_per_block))

    @property
    def slot_bytes(self) -> int:
        """The largest chunk's data."""
        return self.blocks_per_chunk * self.bytes_per_block


def fault_delay(fault: str | None) -> float:
    """Seconds a ``delay=<s>`` test fault holds the transfer back before its first chunk."""
    return float(fault.split("=", 1)[1]) if fault is not None and fault.startswith("delay=") else 0.0


def _inject_fault(fault: str | None, header: Chunk, payload: memoryview) -> list[tuple[Chunk, memoryview]]:
    """The chunk messages to put on the wire, damaged on purpose when a test asks for it:
    the consumer must reject every one of these without writing a byte. (``delay=`` is
    applied by the sender, which never sleeps: see ``fault_delay``.)"""
    if fault is None or fault.startswith("delay="):
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
