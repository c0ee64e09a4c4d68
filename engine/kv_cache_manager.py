"""KVCacheManager: the scheduler's only view of KV memory. Blocks are ints to everyone else."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from engine.block_pool import BlockPool, KVCacheBlock
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0     # of which found in the device prefix cache


class KVCacheManager:
    """Allocates the blocks of each request and keeps the prefix cache up to date.

    Per request the block list only grows (until the request is freed or preempted), and
    ``blocks[i]`` holds tokens ``[i*block_size, (i+1)*block_size)``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 on_evict=None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, on_evict)
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks. Stops one token short of the whole request:
        the last token is always recomputed because its logits are needed. None for a request
        that wants its prompt's logprobs: every prompt position's logits are needed."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_stats(self, request: Request, num_hit_tokens: int) -> None:
        """Count one lookup per request (its first admission), not one per retry; a request that
        never looks up the cache (caching off, or it wants its prompt's logprobs) is no query,
        as in vLLM's record_prefix_cache_stats."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] = (),
        num_external_tokens: int = 0,
        delay_caching: bool = False,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Layout of the request's tokens after the call::

            | computed (owned) | new_computed (prefix hit) | external (loaded) | new |

        Returns the ids of newly allocated blocks, or None (and changes nothing) when the
        pool cannot hold them. ``delay_caching`` keeps external blocks out of the prefix
        cache until their KV has actually arrived (see ``cache_blocks``).
        """
        blocks = self.req_to_blocks[request.request_id]
        num_computed = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                        + num_external_tokens)
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        # Prefix-hit blocks that sit in the free queue leave it when touched.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_revived > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        if not delay_caching:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks among the first ``num_tokens`` tokens in the prefix cache."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_block.get(request.request_id, 0)
        if num_full > start:
            self.pool.cache_full_blocks(self.req_to_blocks[request.request_id], request.block_hashes,
                                        start, num_full, request.all_token_ids, self.block_size,
                                        request.event_block_hashes or None, request.cache_salt)
            self.num_cached_block[request.request_id] = num_full

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        """How many blocks the request has, without listing them (the engine core's stats count
        the blocks of every held request once per step)."""
        return len(self.req_to_blocks.get(request_id, ()))

    def free(self, request: Request) -> None:
        """Release a request's blocks; tail blocks are evicted before the shared prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def invalidate(self, request: Request, start_block: int) -> None:
        """Drop prefix-cache entries of blocks whose KV was never written (a failed load)."""
        self.pool.uncache(self.req_to_blocks.get(request.request_id, [])[start_block:])
        self.num_cached_block[request.request_id] = min(
            self.num_cached_block.get(request.request_id, 0), start_block)
