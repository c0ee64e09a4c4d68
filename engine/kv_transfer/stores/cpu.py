"""CPU-memory tier: an LRU of chunk tensors under a byte cap. Pinned chunks are not evicted."""
from __future__ import annotations

import collections

import torch

from engine.kv_events import MEDIUM_CPU
from engine.kv_transfer.stores.base import ChunkFormat, EvictingStore


class CPUStore(EvictingStore):
    name = "cpu"
    medium = MEDIUM_CPU

    def __init__(self, capacity_bytes: int, fmt: ChunkFormat) -> None:
        super().__init__(fmt)
        self.capacity = capacity_bytes
        self._chunks: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()  # LRU first
        self._used = 0

    def contains(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [k in self._chunks for k in keys]

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            kv = self._chunks.get(key)
            if kv is not None:
                self._chunks.move_to_end(key)
        return kv  # entries are never written in place, so a reader needs no lock

    def put(self, key: str, kv: torch.Tensor) -> None:
        nbytes = kv.numel() * kv.element_size()
        if nbytes > self.capacity:
            return
        with self._lock:
            if key in self._chunks:
                self._chunks.move_to_end(key)
                self._log(key, True)
                return
            for victim in [k for k in self._chunks if not self._pins[k]]:
                if self._used + nbytes <= self.capacity:
                    break
                self._used -= self._chunks.pop(victim).numel() * kv.element_size()
                self._log(victim, False)
            if self._used + nbytes > self.capacity:
                return  # everything left is pinned by loads in flight
            self._chunks[key] = kv
            self._used += nbytes
            self._log(key, True)
        self.count(bytes_stored=nbytes)

    def used_bytes(self) -> int:
        return self._used
