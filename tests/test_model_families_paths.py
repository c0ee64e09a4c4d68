"""The newer families (Qwen3, Gemma 2 and 3, Phi-3) keep their output through every path KV takes:
pulled from a prefill instance over the wire (P→D), and loaded back from the CPU tier after the
device cache evicted it. Each tiny model has layers with a sliding window shorter than the
prompts, so a KV transfer or tier load that mixed up windows or rope tables would show."""
from __future__ import annotations

import random

import openai
import pytest

from engine import LLM, SamplingParams
from tests.conftest import assert_engine_idle, make_tiny_model
from tests.disagg_utils import Disagg
from tests.test_models import FAMILIES

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NEW_FAMILIES = ["qwen3-sliding-upper-layers", "gemma2-softcap-alternating", "gemma3-local-rope-qk-norm",
                "phi3-partial-rotary-window"]


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (40, 96, 7, 130)[:count]]


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def family_model(request, tmp_path_factory, smollm2_dir):
    arch, overrides = FAMILIES[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)


def test_p_to_d_equals_colocated(family_model):
    prompts = _prompts(4, seed=1)
    expected = [o.outputs[0].text for o in LLM(str(family_model), num_blocks=128).generate(
        prompts, GREEDY, use_tqdm=False)]
    cluster = Disagg(str(family_model), "--num-blocks", "128", "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0)
        got = [client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for prompt in prompts]
        pulled = cluster.decode.status()["kv_transfer"]["bytes"]
        cluster.wait_idle()
    finally:
        cluster.stop()
    assert got == expected
    assert pulled > 0  # the decode instance received the prompts' KV


def test_cpu_tier_hits_equal_fresh_prefill(family_model):
    """A 12-block pool: each new prompt evicts the previous ones, which come back from the tier."""
    prompts = _prompts(3, seed=2)
    fresh = LLM(str(family_model), num_blocks=128, enable_prefix_caching=False)
    expected = [fresh.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(str(family_model), num_blocks=12, kv_store="cpu:64MiB", kv_chunk_tokens=16)
    first = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    again = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert first == expected
    assert [o.outputs[0].token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) >= 32  # the second round hit the tier
    assert_engine_idle(llm)
