"""Disaggregated prefill over pyzmq: what travels between the producer's ROUTER and a
consumer's DEALER.

Frame 0 of every message is one msgspec-encoded message below; a chunk's data follows as one
raw frame. Both sides cut KV into chunks the same way (``ChunkLayout``), from a layout that
the fingerprint handshake already proved equal.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import msgspec
import torch

PROTOCOL_VERSION = 2  # 2: pulls and releases name the tokens (token_digest)
# Bytes of KV per chunk frame. The producer stages each in-flight chunk in a slot this big, so
# this bounds staging memory; a consumer refuses (zmq drops) larger frames.
DEFAULT_CHUNK_BYTES = 4 * 2**20
# Headroom over the data in a chunk message (its header), and over any control message.
FRAME_SLACK_BYTES = 64 * 2**10


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


WireMessage = Hello | HelloReply | Pull | Release | Chunk | ShmGrant | ShmDone | ShmAck

_decoder = msgspec.msgpack.Decoder(WireMessage)
encode = msgspec.msgpack.encode


def decode(buf) -> WireMessage | None:
    """The message in ``buf``, or None when it is not one (the caller drops and counts it)."""
    try:
        return _decoder.decode(buf)
    except msgspec.DecodeError:
        return None


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
