"""Physical KV blocks: ref counts, an LRU free queue and the prefix-cache hash map.

Keys are SHA-256 chains: hash(parent_hash, token_ids, extra) from a root derived from the
model fingerprint. They are identical in every process and on every machine, so the device
prefix cache, the KV stores and the transfer protocol can share them. Never Python's hash().
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

from engine.errors import InvalidRequestError
from engine.kv_events import MEDIUM, BlockRemoved, KVCacheEvent, event_extra_keys, stored_events
from engine.request import Request

KV_HASH_VERSION = b"engine-kv-hash/v1"


def root_block_hash(fingerprint: str) -> bytes:
    """The parent hash of every first block. Changes with the model, dtype and block size."""
    return hashlib.sha256(KV_HASH_VERSION + b"|" + fingerprint.encode()).digest()


def hash_block_tokens(parent_hash: bytes, token_ids: list[int] | tuple[int, ...], extra: bytes = b"") -> bytes:
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(parent_hash + payload + extra).digest()


MAX_CACHE_SALT_LEN = 1024


def check_cache_salt(cache_salt: object) -> None:
    """None (shares KV with every unsalted request) or a non-empty str that is UTF-8 (no lone
    surrogate), as vLLM takes it; else an InvalidRequestError naming the field."""
    if cache_salt is None or (isinstance(cache_salt, str) and 0 < len(cache_salt) <= MAX_CACHE_SALT_LEN
                              and _is_utf8(cache_salt)):
        return
    raise InvalidRequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_LEN} "
                              "characters (or null)", "cache_salt")


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def salted_root(root_hash: bytes, cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block: the instance's root, or with a ``cache_salt``
    (vLLM's request field for tenant isolation) a root of that salt's own, so requests with
    different salts (or none) never share a block hash: not in the prefix cache, the KV tiers, the
    KV events or a router's index."""
    if cache_salt is None:
        return root_hash
    return hashlib.sha256(root_hash + b"|cache_salt|" + cache_salt.encode()).digest()


class BlockHasher:
    """Appends the hash of every newly full block of a request (computed once each)."""

    def __init__(self, block_size: int, root_hash: bytes) -> None:
        self.block_size = block_size
        self.root_hash = root_hash

    def prompt_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[bytes]:
        """The hashes of a token sequence's full blocks (what a router computes)."""
        hashes, parent, bs = [], salted_root(self.root_hash, cache_salt), self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = hash_block_tokens(parent, token_ids[start:start + bs])
            hashes.append(parent)
        return hashes

    def __call__(self, request: Request) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else salted_root(self.root_hash, request.cache_salt)
            hashes.append(hash_block_tokens(parent, tokens[start:start + bs]))


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block holds a full, cached block of tokens; cleared when it is reused.
    block_hash: bytes | None = None


class BlockPool:
    """All blocks of the device KV cache.

    A block is in exactly one of three states: in use (ref_cnt > 0), free and cached
    (ref_cnt == 0, hash set: a prefix hit can revive it), or free and empty. Free blocks sit
    in ``free_queue`` in eviction order: empty ones at the front, cached ones behind them in
    least-recently-freed order. Eviction is lazy: a cached block loses its hash only when it
    is handed out again.
    """

    def __init__(self, num_blocks: int, enable_caching: bool,
                 on_evict: Callable[[bytes, int], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        # Called with (hash, block_id) just before a cached block is overwritten.
        self.on_evict = on_evict
        # Prefix-cache changes since the engine last drained them (engine/kv_events.py), or
        # None when nobody publishes them.
        self.kv_events: list[KVCacheEvent] | None = None
        # What the events named each cached block, where that is not its hash (vLLM's hashes,
        # engine/vllm_block_hash.py): its BlockRemoved must name it the same way.
        self._event_names: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving free cached ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"asked for {num_blocks} blocks with {len(self.free_queue)} free")
        out, evicted = [], []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block, evicted)
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.kv_events is not None:
            self.kv_events.append(BlockRemoved(evicted, MEDIUM, 0))
        return out

    def _evict(self, block: KVCacheBlock, evicted: list[bytes]) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        if self.cached.get(block_hash) is block:
            del self.cached[block_hash]
            evicted.append(self._event_names.pop(block_hash, block_hash))
            if self.on_evict is not None:
                self.on_evict(block_hash, block.block_id)
        block.block_hash = None

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each. ``blocks`` is in eviction order (evict first, first)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes],
                          start: int, end: int, token_ids: list[int] = (), block_size: int = 0,
                          event_hashes: list[int] | None = None, cache_salt: str | None = None) -> None:
        """Register blocks[start:end] under their hashes. A hash already cached elsewhere
        (the same prefix computed twice concurrently) keeps its first block. ``token_ids``
        (the request's), ``block_size``, ``event_hashes`` (the names the events give the
        request's blocks, when not their hashes) and ``cache_salt`` only go into KV events."""
        if not self.enable_caching:
            return
        stored: list[int] = []
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            block_hash = block_hashes[i]
            if block_hash in self.cached:
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            stored.append(i)
        if stored and self.kv_events is not None:
            names = block_hashes
            if event_hashes is not None:
                names = event_hashes
                self._event_names.update((block_hashes[i], event_hashes[i]) for i in stored)
            self.kv_events += stored_events(names, None, token_ids, block_size, MEDIUM, stored,
                                            event_extra_keys(0, len(names), cache_salt) if event_hashes is not None
                                            else None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix held by free blocks (blocks in use keep theirs).
        Returns how many were dropped."""
        dropped = [b for b in self.free_queue.values() if b.block_hash is not None]
        self.uncache(dropped)
        return len(dropped)

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget the hashes of blocks whose content is not valid (a failed KV load)."""
        removed = []
        for block in blocks:
            if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                removed.append(self._event_names.pop(block.block_hash, block.block_hash))
            block.block_hash = None
        if removed and self.kv_events is not None:
            self.kv_events.append(BlockRemoved(removed, MEDIUM, 0))
