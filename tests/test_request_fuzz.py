"""Generated requests through the real engine (FAULTS.md 26): any valid SamplingParams — extreme
temperatures and penalties, huge top_k, 64-bit seeds, every special token as a prompt or stop
token, logprobs up to the maximum — run in one batch without raising inside the step, end
with a proper finish reason, and (greedy or seeded) give the same tokens alone as batched.

CI runs a pinned number of examples; ENGINE_FUZZ_EXAMPLES=N runs more.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_LOGPROBS
from tests.conftest import assert_engine_idle

EXAMPLES = int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "25"))
VOCAB = 49152
SPECIAL = [0, 1, 2, 3, VOCAB - 1]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), num_blocks=64, max_model_len=256, max_num_seqs=4)


token = st.one_of(st.sampled_from(SPECIAL), st.integers(0, VOCAB - 1))


@st.composite
def sampling_params(draw) -> SamplingParams:
    max_tokens = draw(st.integers(1, 8))
    greedy = draw(st.booleans())
    return SamplingParams(
        temperature=0.0 if greedy else draw(st.floats(1e-5, 1e6)),
        top_p=draw(st.floats(1e-9, 1.0, exclude_min=False)),
        top_k=draw(st.one_of(st.just(0), st.just(-1), st.integers(1, 10**12))),
        min_p=draw(st.floats(0.0, 1.0)),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(1e-6, 1e6))),
        seed=None if greedy else draw(st.integers(-2**63, 2**63 - 1)),
        stop=draw(st.lists(st.text(min_size=1, max_size=4), max_size=3)),
        stop_token_ids=draw(st.lists(token, max_size=4)),
        ignore_eos=draw(st.booleans()),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, MAX_LOGPROBS))),
        skip_special_tokens=draw(st.booleans()),
        include_stop_str_in_output=draw(st.booleans()),
    )


requests = st.lists(st.tuples(st.lists(token, min_size=1, max_size=40), sampling_params()), min_size=1, max_size=4)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(batch=requests)
def test_any_valid_request_runs_and_is_batch_invariant(llm, batch):
    prompts = [p for p, _ in batch]
    params = [sp for _, sp in batch]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_engine_idle(llm)
    for out, sp in zip(outputs, params):
        c = out.outputs[0]
        assert out.finished and c.finish_reason in ("stop", "length"), (c.finish_reason, out.error)
        assert len(c.token_ids) <= sp.max_tokens and all(0 <= t < VOCAB for t in c.token_ids)
        if sp.logprobs is not None:
            assert len(c.logprobs) == len(c.token_ids)
    # Greedy and seeded requests give the same tokens alone as in the batch.
    alone = llm.generate(prompts[0], params[0], use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == outputs[0].outputs[0].token_ids


@pytest.mark.parametrize("change, field", [
    (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(stop_token_ids=[2**62]), "stop_token_ids"),
])
def test_out_of_vocabulary_ids_are_refused_before_the_step(llm, change, field):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([5, 6, 7], SamplingParams(max_tokens=3, min_tokens=1, **change), use_tqdm=False)
    assert info.value.param == field
    assert_engine_idle(llm)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([[5, VOCAB]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert info.value.param == "prompt"
