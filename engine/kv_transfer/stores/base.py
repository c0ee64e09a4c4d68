"""The KVStore contract shared by the CPU, disk and Redis tiers.

A store maps a chunk key (the hex SHA-256 chained hash of the chunk's last block, namespaced
by the model fingerprint) to the KV of one full chunk: [num_layers, 2, blocks_per_chunk,
block_size, num_kv_heads, head_dim]. Every method is safe to call from several threads and
never raises for a missing, corrupt or unreachable entry: that is a miss.
"""
from __future__ import annotations

import collections
import hashlib
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from engine.config import parse_size


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
        """A short prefix that keeps two models (or layouts) apart in a shared store."""
        return hashlib.sha256(self.fingerprint.encode()).hexdigest()[:16]


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    load_seconds: list[float] = field(default_factory=list)  # drained by the stats reporter


class KVStore(ABC):
    name: str

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

    def pin(self, keys: list[str]) -> None:
        with self._lock:
            self._pins.update(keys)

    def unpin(self, keys: list[str]) -> None:
        with self._lock:
            self._pins.subtract(keys)
            self._pins = +self._pins  # drop zero counts


DEFAULT_REDIS_TTL_S = 24 * 3600


def parse_store_spec(spec: str, fmt: ChunkFormat, redis_ttl_s: int = DEFAULT_REDIS_TTL_S) -> list[KVStore]:
    """``cpu:4GiB,disk:/path:20GiB,redis://host:6379/0`` -> stores in lookup order."""
    from engine.kv_transfer.stores.cpu import CPUStore
    from engine.kv_transfer.stores.disk import DiskStore
    from engine.kv_transfer.stores.redis import RedisStore

    stores: list[KVStore] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part.startswith(("redis://", "rediss://", "unix://")):
            stores.append(RedisStore(part, fmt, ttl_s=redis_ttl_s))
        elif part.startswith("cpu:"):
            stores.append(CPUStore(parse_size(part[4:]), fmt))
        elif part.startswith("disk:"):
            path, sep, size = part[5:].rpartition(":")
            if not sep or not path:
                raise ValueError(f"disk tier needs a path and a size, e.g. disk:/var/cache/kv:20GiB; got {part!r}")
            stores.append(DiskStore(path, parse_size(size), fmt))
        else:
            raise ValueError(f"unknown KV store tier {part!r}; expected cpu:SIZE, disk:PATH:SIZE or redis://...")
    names = [s.name for s in stores]
    if len(set(names)) != len(names):
        raise ValueError(f"each tier may appear once in --kv-store, got {spec!r}")
    if not stores:
        raise ValueError("--kv-store names no tier")
    return stores
