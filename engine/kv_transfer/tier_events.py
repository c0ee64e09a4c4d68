"""KV events for the CPU and disk tiers: what this process put there and what left, named as the
instance's pool names blocks, so a router's prefix match sees offloaded prefixes too.

The scheduler half describes each chunk it saves (``ChunkNames``: its blocks' names, as the
pool's events give them); the stores journal, in order, what entered and left them
(stores/base.py); ``TierEvents.drain`` turns both into ``BlockStored`` / ``BlockRemoved`` with
the tier's medium (kv_events.py). Like vLLM's offloading events, a tier's ``BlockStored`` names
the blocks and their parent and carries no token ids.

Chunks overlap (a prompt's trailing chunk and a later full chunk of a longer prompt share their
first blocks), so a block is announced in a medium when the first chunk holding it enters it and
removed when the last one leaves: a subscriber sees each block stored once per medium until it
is removed.

Invariants: a chunk's names are kept while a tier holds it or a put of it is pending (about
3 KB per chunk, only with events on). Entries this process did not describe (a disk tier's
files from before a restart, or another engine's in a shared directory) are never announced: a
router counts them as missing, which costs at most a cache miss.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from engine.kv_events import BlockRemoved, KVCacheEvent, stored_events


@dataclass(frozen=True, slots=True)
class ChunkNames:
    """What the events call one chunk's blocks."""
    names: tuple            # the blocks' names, in order (the pool's event names)
    parent: object          # the name of the block before the first (None for a prompt's first)
    extra_keys: list | None = None  # vLLM's extra keys per block, with vLLM's hashes


@dataclass(slots=True)
class _Chunk:
    names: ChunkNames
    pending: int = 0  # puts of it queued or running
    media: set[str] = field(default_factory=set)  # the tiers' media holding it


class TierEvents:
    """Owned by the tiered worker: ``expect``/``put_done`` from the threads that put chunks,
    ``drain`` from the step thread."""

    def __init__(self, stores: list, block_size: int) -> None:
        self.block_size = block_size
        self._stores = [s for s in stores if s.medium is not None]
        for store in self._stores:
            store.journal = []
        self._lock = threading.Lock()
        self._chunks: dict[str, _Chunk] = {}
        # Per medium, how many chunks held there hold each block.
        self._held: dict[str, collections.Counter] = {s.medium: collections.Counter() for s in self._stores}

    def expect(self, key: str, names: ChunkNames, puts: int) -> None:
        """Before ``puts`` puts of the chunk ``key`` into tiers that publish."""
        with self._lock:
            chunk = self._chunks.setdefault(key, _Chunk(names))
            chunk.pending += puts

    def put_done(self, key: str, puts: int = 1) -> None:
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is not None:
                chunk.pending -= puts

    def drain(self) -> list[KVCacheEvent]:
        """The events since the last call, in each tier's order."""
        with self._lock:
            # Taken before the journals: a put done by now has journaled its entry already, so
            # a chunk that had no put pending and holds no medium after them is gone for good.
            settled = [key for key, chunk in self._chunks.items() if chunk.pending <= 0]
        events: list[KVCacheEvent] = []
        for store in self._stores:
            for key, stored in store.take_journal():
                with self._lock:
                    chunk = self._chunks.get(key)
                if chunk is not None:
                    events += self._entered(chunk, store.medium) if stored else self._left(chunk, store.medium)
        with self._lock:
            for key in settled:
                chunk = self._chunks.get(key)
                if chunk is not None and not chunk.media and chunk.pending <= 0:
                    del self._chunks[key]
        return events

    def _entered(self, chunk: _Chunk, medium: str) -> list[KVCacheEvent]:
        if medium in chunk.media:
            return []
        chunk.media.add(medium)
        held, names = self._held[medium], chunk.names
        new = [i for i, name in enumerate(names.names) if not held[name]]
        held.update(names.names)
        if not new:
            return []
        return stored_events(list(names.names), names.parent, [], self.block_size, medium, new, names.extra_keys)

    def _left(self, chunk: _Chunk, medium: str) -> list[KVCacheEvent]:
        if medium not in chunk.media:
            return []
        chunk.media.discard(medium)
        held, gone = self._held[medium], []
        for name in chunk.names.names:
            held[name] -= 1
            if held[name] <= 0:
                del held[name]
                gone.append(name)
        return [BlockRemoved(gone, medium, 0)] if gone else []
