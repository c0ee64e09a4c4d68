"""Self-describing, checksummed KV payloads for the disk and Redis tiers.

    b"EKV1" | u32 header length | msgpack header | raw KV bytes

The header names the format version, the model fingerprint, dtype, shape, token count and a
CRC32 of the raw bytes. ``decode`` refuses anything that does not match exactly what the
reader expects (another model, a truncated value, flipped bits): the caller treats that as a
miss, deletes the entry and recomputes.
"""
from __future__ import annotations

import struct
import warnings
import zlib

import msgspec
import torch

MAGIC = b"EKV1"
VERSION = 1
_PREFIX = struct.Struct("<4sI")


# Payloads read from disk or Redis arrive as immutable bytes; the tensors made from them are only
# ever read (stores never write a chunk in place), so torch's non-writable warning is noise.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class PayloadHeader(msgspec.Struct):
    version: int
    fingerprint: str
    dtype: str
    shape: list[int]
    num_tokens: int
    crc32: int


class CorruptPayload(ValueError):
    """The bytes are not a KV payload this engine can use."""


def _raw(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def encode(kv: torch.Tensor, fingerprint: str, num_tokens: int) -> list[memoryview | bytes]:
    """The payload as buffers to write one after another (the KV bytes are not copied)."""
    raw = _raw(kv)
    header = msgspec.msgpack.encode(PayloadHeader(
        VERSION, fingerprint, str(kv.dtype).removeprefix("torch."), list(kv.shape), num_tokens, zlib.crc32(raw)))
    return [_PREFIX.pack(MAGIC, len(header)), header, raw]


def decode(data: bytes | bytearray | memoryview, fingerprint: str, dtype: torch.dtype,
           shape: list[int]) -> torch.Tensor:
    """The KV tensor (a view of ``data``), or CorruptPayload saying what was wrong."""
    view = memoryview(data)
    if view.nbytes < _PREFIX.size:
        raise CorruptPayload("truncated before the header")
    magic, header_len = _PREFIX.unpack(view[:_PREFIX.size])
    if magic != MAGIC:
        raise CorruptPayload("not a KV payload (bad magic)")
    try:
        header = msgspec.msgpack.decode(view[_PREFIX.size:_PREFIX.size + header_len], type=PayloadHeader)
    except msgspec.DecodeError as exc:
        raise CorruptPayload(f"bad header: {exc}") from None
    expected = (VERSION, fingerprint, str(dtype).removeprefix("torch."), list(shape))
    if (header.version, header.fingerprint, header.dtype, header.shape) != expected:
        raise CorruptPayload(f"written by another model or layout: {header.fingerprint} {header.dtype}"
                             f"{header.shape} v{header.version}")
    raw = view[_PREFIX.size + header_len:]
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    if raw.nbytes != nbytes:
        raise CorruptPayload(f"truncated: {raw.nbytes} of {nbytes} bytes")
    if zlib.crc32(raw) != header.crc32:
        raise CorruptPayload("checksum mismatch")
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)
