"""Self-describing, checked KV payloads for the disk and Redis tiers.

    b"EKV2" | u32 header length | msgpack header | raw KV bytes | [32-byte tag]

The header names the format version, the model fingerprint, dtype, shape, token count and how
the payload is checked:

- ``"hmac-sha256"`` (the engine has a deployment secret): a tag follows the KV bytes, the
  HMAC-SHA256 (secret purpose ``"store"``) of the entry's key, the prefix + header and the KV
  bytes. Only a holder of the secret can make an entry a reader accepts, and an entry is valid
  under its own key only (copied under another key it is refused).
- ``"crc32"`` (no secret): ``crc32`` is the CRC32 of the KV bytes; it catches accidents, not
  attackers.

A reader with a secret accepts only tagged entries; a reader without one accepts only CRC
entries (it cannot check a tag), so engines that share a tier must share the secret.
``decode`` refuses anything that does not match exactly what the reader expects, with a
``reason`` for the per-tier counters: ``wrong_format`` (another model, layout or format
version, such as a version 1 entry, or a tagged entry read without a secret), ``corrupt``
(truncated, padded, flipped bits under a CRC, not a payload at all) or ``bad_tag`` (no tag
under a secret, or a wrong one). The caller treats every refusal as a miss, deletes the
entry and recomputes.
"""
from __future__ import annotations

import struct
import warnings
import zlib

import msgspec
import torch

from engine.kv_transfer.secret import KVSecret

MAGIC = b"EKV2"
OLD_MAGICS = (b"EKV1",)  # earlier formats: a clean wrong_format miss, not "corrupt"
VERSION = 2
_PREFIX = struct.Struct("<4sI")
TAG_BYTES = 32
MAX_HEADER_BYTES = 4096  # a real header is ~150 bytes; bounds what a reader accepts
CRC32, HMAC_SHA256 = "crc32", "hmac-sha256"
PURPOSE = "store"

# Payloads read from disk or Redis arrive as immutable bytes; the tensors made from them are only
# ever read (stores never write a chunk in place), so torch's non-writable warning is noise.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class PayloadHeader(msgspec.Struct):
    version: int
    fingerprint: str
    dtype: str
    shape: list[int]
    num_tokens: int
    check: str  # CRC32 or HMAC_SHA256
    crc32: int = 0  # with CRC32 only


class CorruptPayload(ValueError):
    """The bytes are not a KV payload this engine can use; ``reason`` names the kind of refusal."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def max_size(nbytes: int) -> int:
    """The largest payload a reader accepts for chunks of ``nbytes`` KV bytes."""
    return _PREFIX.size + MAX_HEADER_BYTES + nbytes + TAG_BYTES


def _raw(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _tag(secret: KVSecret, key: str, head: memoryview | bytes, raw: memoryview) -> bytes:
    return secret.mac(PURPOSE, key.encode(), head, raw)


def encode(kv: torch.Tensor, fingerprint: str, num_tokens: int, key: str,
           secret: KVSecret | None = None) -> list[memoryview | bytes]:
    """The payload for ``key`` as buffers to write one after another (the KV bytes are not
    copied); tagged when there is a secret, else CRC-checked."""
    raw = _raw(kv)
    check, crc = (HMAC_SHA256, 0) if secret is not None else (CRC32, zlib.crc32(raw))
    header = msgspec.msgpack.encode(PayloadHeader(
        VERSION, fingerprint, str(kv.dtype).removeprefix("torch."), list(kv.shape), num_tokens, check, crc))
    head = _PREFIX.pack(MAGIC, len(header)) + header
    if secret is None:
        return [head, raw]
    return [head, raw, _tag(secret, key, head, raw)]


def decode(data: bytes | bytearray | memoryview, fingerprint: str, dtype: torch.dtype, shape: list[int],
           key: str, secret: KVSecret | None = None) -> torch.Tensor:
    """The KV tensor stored under ``key`` (a view of ``data``), or CorruptPayload saying why not."""
    view = memoryview(data)
    if view.nbytes < _PREFIX.size:
        raise CorruptPayload("corrupt", "truncated before the header")
    magic, header_len = _PREFIX.unpack(view[:_PREFIX.size])
    if magic in OLD_MAGICS:
        raise CorruptPayload("wrong_format", f"an entry in an older format ({magic.decode()})")
    if magic != MAGIC:
        raise CorruptPayload("corrupt", "not a KV payload (bad magic)")
    if header_len > MAX_HEADER_BYTES:
        raise CorruptPayload("corrupt", f"bad header: {header_len} bytes")
    head_end = _PREFIX.size + header_len
    try:
        header = msgspec.msgpack.decode(view[_PREFIX.size:head_end], type=PayloadHeader)
    except msgspec.DecodeError as exc:
        raise CorruptPayload("corrupt", f"bad header: {exc}") from None
    # A chunk holds up to shape[2] blocks (a prompt's trailing chunk holds fewer).
    expected = (VERSION, fingerprint, str(dtype).removeprefix("torch."), list(shape))
    blocks = header.shape[2] if len(header.shape) == len(shape) and isinstance(header.shape[2], int) else 0
    if 1 <= blocks <= shape[2]:
        shape = [*shape[:2], blocks, *shape[3:]]
    if (header.version, header.fingerprint, header.dtype, header.shape) != expected[:3] + (list(shape),):
        raise CorruptPayload("wrong_format", f"written by another model or layout: {header.fingerprint} "
                                             f"{header.dtype}{header.shape} v{header.version}")
    # Untagged under a secret is what an attacker without the secret writes: bad_tag. Tagged
    # without a secret is a misconfiguration (engines sharing a tier, one lacking the secret).
    if secret is not None and header.check != HMAC_SHA256:
        raise CorruptPayload("bad_tag", f"no tag ({header.check}): written without the deployment secret")
    if secret is None and header.check != CRC32:
        raise CorruptPayload("wrong_format", f"tagged ({header.check}) by an engine with a deployment secret; "
                                             "this one has none")
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    tag_len = TAG_BYTES if secret is not None else 0
    if view.nbytes != head_end + nbytes + tag_len:
        raise CorruptPayload("corrupt", f"truncated or padded: {view.nbytes - head_end - tag_len} "
                                        f"of {nbytes} KV bytes")
    raw = view[head_end:head_end + nbytes]
    if secret is not None:
        # Checked before the KV bytes are used; covers the key, so a copy under another key fails.
        if not secret.verify(PURPOSE, bytes(view[head_end + nbytes:]), key.encode(), view[:head_end], raw):
            raise CorruptPayload("bad_tag", "tag mismatch (altered, written under another key, or with "
                                            "another secret)")
    elif zlib.crc32(raw) != header.crc32:
        raise CorruptPayload("corrupt", "checksum mismatch")
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)
