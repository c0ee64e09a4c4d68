"""The KVStore contract shared by the CPU, disk and Redis tiers.

A store maps a chunk key (the hex SHA-256 chained hash of the chunk's last block, namespaced
by the chunk format: ``ChunkFormat.namespace``) to the KV of one chunk: [num_layers, 2, blocks,
block_size, num_kv_heads, head_dim], with ``blocks_per_chunk`` blocks (a prompt's trailing
chunk: fewer). Every method is safe to call from several threads and never raises for a
missing, corrupt or unreachable entry: that is a miss.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import re
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from engine.kv_transfer.serde import VERSION, CorruptPayload

logger = logging.getLogger("engine.kv_store")


@dataclass(frozen=True, slots=True)
class ChunkFormat:
    """What every chunk of one engine looks like; stored payloads must match it exactly."""
    fingerprint: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # [num_layers, 2, blocks_per_chunk, block_size, num_kv_heads, head_dim]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for dim in self.shape:
            n *= dim
        return n

    @property
    def namespace(self) -> str:
        """A short prefix that keeps two chunk formats apart in a shared store: another model,
        dtype, layout, payload version or chunk size (``--kv-chunk-tokens``: the chained hash
        of a block is the same whatever the chunk size, so without it a chunk of 16 blocks and
        one of 32 ending at the same block would share a key, and each instance would delete
        the other's as ``wrong_format``)."""
        described = f"{self.fingerprint}|{str(self.dtype).removeprefix('torch.')}|{list(self.shape)}|v{VERSION}"
        return hashlib.sha256(described.encode()).hexdigest()[:16]


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    load_seconds: list[float] = field(default_factory=list)  # drained by the stats reporter
    # Entries refused on read (then deleted), by CorruptPayload.reason: bad_tag, corrupt, wrong_format.
    rejected: dict[str, int] = field(default_factory=dict)


class KVStore(ABC):
    name: str
    medium: str | None = None  # what its KV events call it (None: it publishes none; kv_events.py)

    def __init__(self, fmt: ChunkFormat) -> None:
        self.fmt = fmt
        self.stats = StoreStats()
        self._stats_lock = threading.Lock()

    @abstractmethod
    def contains(self, keys: list[str]) -> list[bool]:
        """Which of the keys are present (a cheap index or existence check)."""

    @abstractmethod
    def get(self, key: str) -> torch.Tensor | None:
        """The chunk's KV (CPU), or None. A corrupt or foreign entry is deleted and is a miss."""

    @abstractmethod
    def put(self, key: str, kv: torch.Tensor) -> None:
        """Store a chunk (best effort: a full disk or a dead server skips it with a log line)."""

    def pin(self, keys: list[str]) -> None:
        """Keep these entries from eviction until unpinned (between lookup and load)."""

    def unpin(self, keys: list[str]) -> None:
        pass

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes this tier holds now."""

    def close(self) -> None:
        pass

    def count(self, **deltas) -> None:
        with self._stats_lock:
            for name, value in deltas.items():
                if name == "load_seconds":
                    self.stats.load_seconds.append(value)
                else:
                    setattr(self.stats, name, getattr(self.stats, name) + value)

    def reject(self, key: str, exc: CorruptPayload) -> None:
        """Count and log an entry refused on read; the caller deletes it and reports a miss."""
        logger.warning("%s KV tier: dropping %s (%s): %s", self.name, key, exc.reason, exc)
        with self._stats_lock:
            self.stats.rejected[exc.reason] = self.stats.rejected.get(exc.reason, 0) + 1

    def drain_load_seconds(self) -> list[float]:
        with self._stats_lock:
            seconds, self.stats.load_seconds = self.stats.load_seconds, []
        return seconds


class EvictingStore(KVStore):
    """A store that evicts to stay under a cap (CPU, disk): pinned keys are never evicted.
    ``_lock`` guards the store's index and the pin counts together."""

    def __init__(self, fmt: ChunkFormat) -> None:
        super().__init__(fmt)
        self._lock = threading.Lock()
        self._pins: collections.Counter[str] = collections.Counter()
        # What this process put in and what left, in order (key, True for in), for the tier's KV
        # events (tier_events.py); None while nobody reads it, so nothing piles up. A lock of its
        # own: the reader (the engine's step thread) never waits for ``_lock``, which the disk
        # tier holds across file deletions.
        self.journal: list[tuple[str, bool]] | None = None
        self._journal_lock = threading.Lock()

    def _log(self, key: str, stored: bool) -> None:
        """Under ``_lock``, so the journal's order is the index's."""
        if self.journal is not None:
            with self._journal_lock:
                self.journal.append((key, stored))

    def take_journal(self) -> list[tuple[str, bool]]:
        with self._journal_lock:
            entries = self.journal or []
            if self.journal is not None:
                self.journal = []
        return entries

    def pin(self, keys: list[str]) -> None:
        with self._lock:
            self._pins.update(keys)

    def unpin(self, keys: list[str]) -> None:
        with self._lock:
            self._pins.subtract(keys)
            self._pins = +self._pins  # drop zero counts


DEFAULT_REDIS_TTL_S = 24 * 3600
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_TIER_STARTS = ("cpu:", "disk:", *REDIS_SCHEMES)
# scheme://userinfo@ - userinfo runs to the last "@" before the host's end ("/", "?" or "#").
# Up to the last @ of the URL: a password may hold an unencoded / ? # or @ (better to mask too
# much than a piece of a password).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>\S*)@")


def redact(text: str) -> str:
    """``text`` with the password of every URL in it masked (``redis://user:***@host``): use it on
    anything that shows a Redis URL or a --kv-store spec (logs, errors)."""
    def mask(m: re.Match) -> str:
        user, sep, _ = m["userinfo"].partition(":")
        return f"{m['scheme']}{user}:***@" if sep else f"{m['scheme']}***@"
    return _USERINFO.sub(mask, text)


def split_store_spec(spec: str) -> list[str]:
    """The tiers of a spec. Tiers are separated by commas; a comma that does not start a known
    tier and follows a Redis URL belongs to that URL (a password or a query argument may hold
    one), so a URL is never cut apart and no piece of its password turns up in an error."""
    parts: list[str] = []
    for piece in spec.split(","):
        if parts and parts[-1].startswith(REDIS_SCHEMES) and piece.strip() \
                and not piece.strip().startswith(_TIER_STARTS):
            parts[-1] += "," + piece
        else:
            parts.append(piece.strip())
    return [p for p in parts if p]
