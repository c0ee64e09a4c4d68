"""vLLM's prefix-cache block hashes, for the KV events (``--prefix-caching-hash-algo``).

Routers that index instances by vLLM's block hashes (llm-d's precise prefix-cache scorer and
others) compute, for a prompt's full blocks of ``block_size`` tokens, as vLLM 0.32 does
(vllm/v1/core/kv_cache_utils.py: init_none_hash, hash_block_tokens,
generate_block_hash_extra_keys),

    h[i] = H((h[i-1], tuple(tokens of block i), extra_keys[i])),   h[-1] = NONE_HASH

where ``H`` is SHA-256 of the tuple's pickle (protocol 5; ``sha256``) or of its canonical CBOR
(``sha256_cbor``, the one meant for routers not written in Python); ``NONE_HASH`` is
``H(PYTHONHASHSEED)`` when that is set and ``H("vllm-none-hash")`` when it is not (vLLM's fixed
default seed for these two, cryptographic, algorithms), so every instance and router agrees by
default, and a deployment that sets PYTHONHASHSEED must set it alike everywhere; and
``extra_keys[i]`` is ``(("cache_salt", cache_salt),)`` for the first block of a salted request,
else None (the engine has no LoRA, multimodal or prompt-embeds keys). The events carry the low 64
bits of each hash as an unsigned integer (vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1),
and the extra keys untagged: ``(cache_salt,)`` (kv_events.event_extra_keys, vLLM's
to_event_extra_keys). Pinned to hashes real vLLM computed: tests/fixtures/vllm_block_hash/.

These are computed beside the engine's own keys (engine/block_pool.py), never instead of them:
the engine's keys descend from the model fingerprint and so bind KV to the model, which vLLM's do
not; the prefix cache, the KV tiers and P->D keep using the engine's.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Callable

ALGORITHMS = ("sha256", "sha256_cbor")
# vLLM's NONE_HASH seed when PYTHONHASHSEED is unset (kv_cache_utils.DEFAULT_NONE_HASH_SEED).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    if algorithm == "sha256":
        return _sha256_pickle
    if algorithm == "sha256_cbor":
        return _sha256_cbor
    raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(ALGORITHMS)} (or null: the engine's own "
                     f"hashes), got {algorithm!r}")


def none_hash(algorithm: str, seed: str | None) -> bytes:
    """The parent of every first block: H(seed), H("vllm-none-hash") without one (PYTHONHASHSEED
    unset), as vLLM's init_none_hash for these algorithms."""
    return hash_function(algorithm)(DEFAULT_NONE_HASH_SEED if seed is None else seed)


def external(block_hash: bytes) -> int:
    """What an event carries for a hash: its low 64 bits, unsigned."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


def extra_keys(block_index: int, cache_salt: str | None) -> tuple | None:
    """What vLLM's hash covers besides the tokens (tagged; the events carry ``(cache_salt,)``)."""
    return (("cache_salt", cache_salt),) if block_index == 0 and cache_salt else None


def both_hashes(engine_hasher: Callable, event_hasher: "VllmBlockHasher") -> Callable:
    """A request's block hasher that keeps its event hashes in step with its engine hashes."""
    def hash_blocks(request) -> None:
        engine_hasher(request)
        event_hasher(request)
    return hash_blocks


class VllmBlockHasher:
    """Appends the vLLM hash (64-bit, as events carry it) of every newly full block of a
    request to ``request.event_block_hashes``, in step with its engine hashes."""

    def __init__(self, algorithm: str, block_size: int, root: bytes | None = None) -> None:
        """``root``: NONE_HASH, as an instance reports it; None: vLLM's, from PYTHONHASHSEED or its default."""
        self.algorithm, self.block_size = algorithm, block_size
        self._hash = hash_function(algorithm)
        self.none_hash = root if root is not None else none_hash(algorithm, os.environ.get("PYTHONHASHSEED"))

    def prompt_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[int]:
        """The 64-bit hashes of a token sequence's full blocks (what a router computes)."""
        return [external(h) for h in self._chain(token_ids, cache_salt, 0, self.none_hash)]

    def __call__(self, request) -> None:
        hashes: list[int] = request.event_block_hashes
        # A parent is hashed whole: the request keeps its last full hash beside the 64-bit forms.
        for full in self._chain(request.all_token_ids, request.cache_salt, len(hashes),
                                request.event_parent_hash or self.none_hash):
            request.event_parent_hash = full
            hashes.append(external(full))

    def _chain(self, token_ids: list[int], cache_salt: str | None, index: int, parent: bytes):
        size = self.block_size
        while (index + 1) * size <= len(token_ids):
            parent = self._hash((parent, tuple(token_ids[index * size:(index + 1) * size]),
                                 extra_keys(index, cache_salt)))
            yield parent
            index += 1
