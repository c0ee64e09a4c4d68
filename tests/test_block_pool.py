"""BlockPool and KVCacheManager on their own: hash chains, ref counts, LRU eviction, prefix hits."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.block_pool import BlockHasher, BlockPool, hash_block_tokens, root_block_hash
from engine.kv_cache_manager import KVCacheManager
from scheduler_utils import make_request

REPO = Path(__file__).resolve().parents[1]
TOKENS = [101, 7, 65535, 2**40, 0, 3, 3, 9, 12, 13, 14, 15, 16]  # 3 full blocks of 4 + 1


def chain(tokens: list[int], block_size: int = 4, fingerprint: str = "fp") -> list[bytes]:
    hasher = BlockHasher(block_size, root_block_hash(fingerprint))
    request = make_request("r", prompt_token_ids=tokens, block_size=block_size)
    request.block_hashes = []
    hasher(request)
    return request.block_hashes


# ---- hashes ------------------------------------------------------------------------------
def test_hash_chain_is_identical_in_another_process():
    ours = [h.hex() for h in chain(TOKENS)]
    assert len(ours) == 3 and all(len(bytes.fromhex(h)) == 32 for h in ours)
    code = (
        "from engine.block_pool import BlockHasher, root_block_hash\n"
        "from engine.request import Request\n"
        "from engine.sampling_params import SamplingParams\n"
        f"r = Request('x', {TOKENS!r}, SamplingParams(), frozenset(), 4, BlockHasher(4, root_block_hash('fp')))\n"
        "print(' '.join(h.hex() for h in r.block_hashes))\n"
    )
    # A different PYTHONHASHSEED: any use of Python's hash() would change the result.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ours


def test_hashes_chain_on_the_parent():
    a = chain(TOKENS)
    b = chain([102] + TOKENS[1:])  # only the first token differs
    assert all(x != y for x, y in zip(a, b)), "a later block hash must depend on every earlier token"
    # Same tokens, same hashes; a prefix gives a prefix of the hashes.
    assert chain(TOKENS) == a
    assert chain(TOKENS[:8]) == a[:2]
    root = root_block_hash("fp")
    assert a[0] == hash_block_tokens(root, TOKENS[:4])
    assert a[1] == hash_block_tokens(a[0], TOKENS[4:8])


def test_different_fingerprint_or_extra_gives_different_hashes():
    assert root_block_hash("model-a:float32:bs4") != root_block_hash("model-b:float32:bs4")
    assert root_block_hash("fp") == root_block_hash("fp")
    a, b = chain(TOKENS, fingerprint="model-a"), chain(TOKENS, fingerprint="model-b")
    assert not set(a) & set(b)
    root = root_block_hash("fp")
    assert hash_block_tokens(root, [1, 2]) != hash_block_tokens(root, [1, 2], b"lora-1")
    assert hash_block_tokens(root, [1, 2]) != hash_block_tokens(root, [2, 1])
    assert hash_block_tokens(root, [1, 2]) != hash_block_tokens(root, [1, 2, 0])


def test_hashes_are_computed_once_as_blocks_fill():
    request = make_request("r", prompt_token_ids=TOKENS[:6])
    assert len(request.block_hashes) == 1  # the partial second block has no hash yet
    first = request.block_hashes[0]
    request.append_output_token_id(TOKENS[6])
    assert len(request.block_hashes) == 1
    request.append_output_token_id(TOKENS[7])
    assert len(request.block_hashes) == 2 and request.block_hashes[0] is first
    assert request.block_hashes == chain(TOKENS[:8], fingerprint="test-model:float32:bs4:torch")


# ---- ref counts, LRU and the prefix cache ------------------------------------------------
def fill_and_cache(pool: BlockPool, n: int, tag: str) -> tuple[list, list[bytes]]:
    blocks = pool.get_new_blocks(n)
    hashes = [hash_block_tokens(root_block_hash(tag), [i]) for i in range(n)]
    pool.cache_full_blocks(blocks, hashes, 0, n)
    return blocks, hashes


def test_ref_counting():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    assert [b.ref_cnt for b in blocks] == [1, 1] and pool.num_free_blocks == 2
    pool.touch(blocks)  # a second request shares them
    assert [b.ref_cnt for b in blocks] == [2, 2] and pool.num_free_blocks == 2
    pool.free_blocks(blocks)
    assert [b.ref_cnt for b in blocks] == [1, 1] and pool.num_free_blocks == 2
    pool.free_blocks(blocks)
    assert [b.ref_cnt for b in blocks] == [0, 0] and pool.num_free_blocks == 4
    assert pool.usage == 0.0


def test_double_free_asserts():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks)


def test_get_new_blocks_more_than_free_raises():
    pool = BlockPool(2, enable_caching=True)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_empty_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4, enable_caching=True)
    cached, _ = fill_and_cache(pool, 2, "a")
    empty = pool.get_new_blocks(2)
    pool.free_blocks(cached)
    pool.free_blocks(empty)  # freed last, but without content: reused first
    reused = pool.get_new_blocks(2)
    assert {b.block_id for b in reused} == {b.block_id for b in empty}
    assert pool.num_cached_blocks == 2


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(3, enable_caching=True)
    blocks, hashes = fill_and_cache(pool, 3, "a")
    order = [blocks[2], blocks[0], blocks[1]]
    for b in order:
        pool.free_blocks([b])
    for expected in order:
        (got,) = pool.get_new_blocks(1)
        assert got is expected
        assert got.block_hash is None
    assert pool.num_cached_blocks == 0


def test_prefix_hit_revives_a_free_cached_block():
    evicted = []
    pool = BlockPool(3, enable_caching=True, on_evict=lambda h, i: evicted.append((h, i)))
    blocks, hashes = fill_and_cache(pool, 1, "a")
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(hashes[0])
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.block_id not in pool.free_queue and pool.num_free_blocks == 2
    # The revived block is not handed out again while in use, and keeps its hash.
    others = pool.get_new_blocks(2)
    assert hit not in others and hit.block_hash == hashes[0] and not evicted
    # Freed again, it becomes the most recently freed cached block.
    pool.free_blocks([hit])
    pool.free_blocks(others)
    assert list(pool.free_queue)[-1] == hit.block_id


def test_on_evict_reports_the_hash_of_the_reused_block():
    evicted = []
    pool = BlockPool(2, enable_caching=True, on_evict=lambda h, i: evicted.append((h, i)))
    blocks, hashes = fill_and_cache(pool, 2, "a")
    pool.free_blocks([blocks[1]])
    pool.free_blocks([blocks[0]])
    assert not evicted  # freeing is not evicting
    pool.get_new_blocks(1)
    assert evicted == [(hashes[1], blocks[1].block_id)]
    assert pool.get_cached_block(hashes[1]) is None and pool.get_cached_block(hashes[0]) is blocks[0]
    pool.get_new_blocks(1)
    assert evicted[1:] == [(hashes[0], blocks[0].block_id)]
    assert pool.num_cached_blocks == 0


def test_cache_full_blocks_keeps_the_first_block_of_a_duplicate_hash():
    pool = BlockPool(4, enable_caching=True)
    first, hashes = fill_and_cache(pool, 2, "a")
    second = pool.get_new_blocks(2)
    pool.cache_full_blocks(second, hashes, 0, 2)
    assert pool.get_cached_block(hashes[0]) is first[0] and pool.get_cached_block(hashes[1]) is first[1]
    assert all(b.block_hash is None for b in second)
    # The duplicate holders are plain blocks: freeing and reusing them never evicts the original.
    pool.free_blocks(second)
    pool.get_new_blocks(2)
    assert pool.get_cached_block(hashes[0]) is first[0] and pool.num_cached_blocks == 2


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    blocks, hashes = fill_and_cache(pool, 2, "a")
    assert pool.num_cached_blocks == 0 and all(b.block_hash is None for b in blocks)


# ---- KVCacheManager ----------------------------------------------------------------------
def run_and_free(kv: KVCacheManager, request) -> list[int]:
    assert kv.allocate_slots(request, request.num_tokens) is not None
    ids = kv.get_block_ids(request.request_id)
    kv.free(request)
    return ids


@pytest.mark.parametrize("k", [1, 2, 3])
def test_prefix_hit_never_includes_the_last_token(k):
    kv = KVCacheManager(16, 4)
    tokens = list(range(100, 100 + 4 * k))
    run_and_free(kv, make_request("a", prompt_token_ids=tokens))
    hits, num = kv.get_computed_blocks(make_request("b", prompt_token_ids=tokens))
    assert num == 4 * (k - 1) and len(hits) == k - 1
    # One more token and the whole k blocks hit.
    hits, num = kv.get_computed_blocks(make_request("c", prompt_token_ids=tokens + [5]))
    assert num == 4 * k and len(hits) == k


def test_prefix_hit_stops_at_the_first_miss_and_is_shared():
    kv = KVCacheManager(16, 4)
    a = make_request("a", prompt_token_ids=list(range(100, 113)))
    assert kv.allocate_slots(a, a.num_tokens) is not None
    b = make_request("b", prompt_token_ids=list(range(100, 108)) + [1, 2, 3, 4, 5])
    hits, num = kv.get_computed_blocks(b)
    assert num == 8 and [h.block_id for h in hits] == kv.get_block_ids("a")[:2]
    assert kv.allocate_slots(b, b.num_tokens - num, hits) is not None
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert [blk.ref_cnt for blk in kv.req_to_blocks["b"]] == [2, 2, 1, 1]
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 16 and not kv.req_to_blocks


def test_free_evicts_tail_blocks_before_the_shared_prefix():
    kv = KVCacheManager(3, 4)
    a = make_request("a", prompt_token_ids=list(range(100, 112)))
    ids = run_and_free(kv, a)
    # The three blocks are cached; the next allocation takes the tail one first.
    evicted = kv.pool.get_new_blocks(1)
    assert evicted[0].block_id == ids[-1]
    assert kv.get_computed_blocks(make_request("b", prompt_token_ids=list(range(100, 112))))[1] == 8


def test_allocate_slots_returns_none_and_changes_nothing_when_the_pool_is_too_small():
    kv = KVCacheManager(4, 4)
    a = make_request("a", prompt_token_ids=list(range(100, 110)))
    assert kv.allocate_slots(a, 10) is not None  # 3 blocks
    free_before = kv.pool.num_free_blocks
    refs_before = [blk.ref_cnt for blk in kv.pool.blocks]
    b = make_request("b", prompt_len=5)
    assert kv.allocate_slots(b, 5) is None
    assert kv.pool.num_free_blocks == free_before == 1
    assert [blk.ref_cnt for blk in kv.pool.blocks] == refs_before
    assert "b" not in kv.req_to_blocks and kv.get_block_ids("b") == []
    # A running request that cannot grow keeps exactly what it had.
    a_ids = kv.get_block_ids("a")
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 7) is None
    assert kv.get_block_ids("a") == a_ids and kv.pool.num_free_blocks == 1
    assert kv.allocate_slots(a, 3) == [next(i for i in range(4) if i not in a_ids)]


def test_allocate_slots_failure_does_not_revive_prefix_hits():
    kv = KVCacheManager(4, 4)
    tokens = list(range(100, 109))
    run_and_free(kv, make_request("a", prompt_token_ids=tokens))  # blocks cached and free
    filler = make_request("filler", prompt_len=4)
    assert kv.allocate_slots(filler, 4) is not None  # 3 free (2 of them cached)
    b = make_request("b", prompt_token_ids=tokens + list(range(200, 210)))  # 19 tokens: 5 blocks
    hits, num = kv.get_computed_blocks(b)
    assert num == 8
    free_before = list(kv.pool.free_queue)
    assert kv.allocate_slots(b, b.num_tokens - num, hits) is None
    assert list(kv.pool.free_queue) == free_before
    assert all(h.ref_cnt == 0 and h.block_hash is not None for h in hits)
    assert "b" not in kv.req_to_blocks


def test_allocate_counts_revived_blocks_against_the_free_pool():
    # 2 free cached blocks are hit and 1 new block is needed: 3 from a free queue of 3 fits.
    kv = KVCacheManager(4, 4)
    tokens = list(range(100, 109))
    run_and_free(kv, make_request("a", prompt_token_ids=tokens))
    filler = make_request("filler", prompt_len=4)
    assert kv.allocate_slots(filler, 4) is not None
    b = make_request("b", prompt_token_ids=tokens + [1, 2, 3])  # 12 tokens: 3 blocks
    hits, num = kv.get_computed_blocks(b)
    assert num == 8
    assert kv.allocate_slots(b, b.num_tokens - num, hits) is not None
    assert kv.pool.num_free_blocks == 0
    assert kv.get_block_ids("b")[:2] == [h.block_id for h in hits]


def test_no_prefix_hits_when_caching_is_disabled():
    kv = KVCacheManager(8, 4, enable_caching=False)
    tokens = list(range(100, 113))
    run_and_free(kv, make_request("a", prompt_token_ids=tokens))
    assert kv.get_computed_blocks(make_request("b", prompt_token_ids=tokens)) == ([], 0)
    assert kv.pool.num_cached_blocks == 0
