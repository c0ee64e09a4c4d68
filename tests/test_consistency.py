"""A request's greedy output does not depend on how it was scheduled: alone, batched with
requests of other lengths, with prefix-cache hits, prefilled in chunks, or preempted."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.conftest import assert_engine_idle

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 49152) for _ in range(40)]
    out = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 16, 33, 90, 150)]
    # Two prompts that share a 40-token prefix, for prefix-cache hits.
    out += [shared + [rng.randrange(3, 49152) for _ in range(5)], shared + [rng.randrange(3, 49152)]]
    return out


@pytest.fixture(scope="module")
def solo_outputs(tiny_llama, prompts) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=256, enable_prefix_caching=False)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert_engine_idle(llm)
    return outs


def _batched(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert_engine_idle(llm)
    return outs


def test_batch_of_mixed_lengths(tiny_llama, prompts, solo_outputs):
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=256, enable_prefix_caching=False)
    assert _batched(llm, prompts) == solo_outputs


def test_prefix_cache_hits(tiny_llama, prompts, solo_outputs):
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=256)
    assert _batched(llm, prompts) == solo_outputs
    hits_before = llm.engine.kv_cache_manager.stats.hits
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == solo_outputs
    assert llm.engine.kv_cache_manager.stats.hits > hits_before
    assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 16)
    assert_engine_idle(llm)


def test_chunked_prefill(tiny_llama, prompts, solo_outputs):
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=256, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert _batched(llm, prompts) == solo_outputs


def test_long_prefill_token_threshold(tiny_llama, prompts, solo_outputs):
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=256, long_prefill_token_threshold=7, enable_prefix_caching=False)
    assert _batched(llm, prompts) == solo_outputs


def test_preemption_in_tiny_pool(tiny_llama, prompts, solo_outputs):
    # 48 blocks of 4 tokens (192 slots): the longest request alone needs 170, all seven
    # together far more, so the scheduler must preempt and recompute.
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=48, block_size=4)
    assert _batched(llm, prompts) == solo_outputs
    assert llm.engine.scheduler.stats.num_preemptions > 0


def test_max_num_seqs_one(tiny_llama, prompts, solo_outputs):
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=256, max_num_seqs=1)
    assert _batched(llm, prompts) == solo_outputs
