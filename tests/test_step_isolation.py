"""One request that makes a model step raise stops neither the engine nor the other requests
(issue 27, item 3): the step's requests are recomputed, each alone, the one the failure follows
ends with finish_reason "error", and every other request's tokens equal a run without the fault.

The fault: ENGINE_ALLOW_FAULTS=1 ENGINE_FAULT_REQUEST=PREFIX@N, a forward that computes position N
of a request whose id contains PREFIX raises (a kernel that cannot run one request's input).
Generated: the batch, the poisoned request and the position, so the failure lands in a prompt's
first or a later chunk, in its last prefill chunk or in any decode step, next to requests at
every stage of theirs.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.engine_core import MAX_FAILED_STEPS, MAX_ISOLATED_FAILURES
from tests.conftest import assert_engine_idle

CHUNK = 16  # max_num_batched_tokens: prompts run in chunks, many requests share steps


def _engine(model, monkeypatch, fault: str | None, prefix_caching: bool) -> LLM:
    if fault is not None:
        monkeypatch.setenv("ENGINE_ALLOW_FAULTS", "1")
        monkeypatch.setenv("ENGINE_FAULT_REQUEST", fault)
    llm = LLM(str(model), num_blocks=48, dtype="float32", max_num_batched_tokens=CHUNK, max_num_seqs=8,
              enable_prefix_caching=prefix_caching)
    monkeypatch.delenv("ENGINE_FAULT_REQUEST", raising=False)
    return llm


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-caching", "no-prefix-caching"])
def engines(tiny_llama, request):
    """Without prefix caching a suspect recomputes from 0 through the failed step's tokens."""
    with pytest.MonkeyPatch.context() as mp:
        yield (_engine(tiny_llama, mp, None, request.param), _engine(tiny_llama, mp, "poison@0", request.param))


def _run(llm: LLM, requests: list[tuple[str, list[int], SamplingParams]], salt: str) -> dict:
    """Each example's own cache_salt: no prefix hit on an earlier example's prompts, which
    would skip the poisoned position."""
    engine = llm.engine
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params, cache_salt=salt)
    done = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests(), "the engine never finished"
    return done


@st.composite
def batches(draw):
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    count = draw(st.integers(2, 6))
    requests = []
    for i in range(count):
        prompt = [rng.randrange(3, 49152) for _ in range(draw(st.integers(1, 40)))]
        params = (SamplingParams(temperature=0, max_tokens=draw(st.integers(1, 12)), ignore_eos=True)
                  if draw(st.booleans()) else
                  SamplingParams(temperature=0.9, seed=rng.randrange(2**31), n=draw(st.integers(1, 2)),
                                 max_tokens=draw(st.integers(1, 12)), ignore_eos=True))
        requests.append([f"r{i}", prompt, params])
    poisoned = draw(st.integers(0, count - 1))
    prompt_len, max_tokens = len(requests[poisoned][1]), requests[poisoned][2].max_tokens
    # Positions a forward computes: the prompt's and all but the last sampled token's.
    position = draw(st.integers(0, prompt_len + max_tokens - 2))
    requests[poisoned][0] = f"poison-{poisoned}"
    return [tuple(r) for r in requests], position


EXAMPLES = iter(range(10**9))


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=batches())
def test_a_request_that_breaks_a_step_fails_alone(engines, case):
    clean, faulty = engines
    requests, position = case
    salt = f"example-{next(EXAMPLES)}"
    faulty.engine.core.runner._fail_request = ("poison", position)  # the hook ENGINE_FAULT_REQUEST set
    renamed = [(r.replace("poison-", "r"), p, s) for r, p, s in requests]
    want = _run(clean, renamed, salt)
    got = _run(faulty, requests, salt)
    assert set(got) == {r for r, _, _ in requests}
    for request_id, out in got.items():
        if request_id.startswith("poison"):
            assert {o.finish_reason for o in out.outputs} == {"error"}, out
            assert "injected failure" in (out.error or ""), out.error
        else:
            assert out.error is None, out.error
            assert [o.token_ids for o in out.outputs] == [o.token_ids for o in want[request_id].outputs]
    # The blocks the failed steps were to fill left the prefix cache: the same prompts again
    # (hitting what the failed steps' requests cached) give the clean answers.
    again = _run(faulty, [(f"again-{r}", p, s) for r, p, s in renamed], salt)
    for request_id, out in again.items():
        want_tokens = [o.token_ids for o in want[request_id.removeprefix("again-")].outputs]
        assert [o.token_ids for o in out.outputs] == want_tokens
    assert_engine_idle(faulty)
    assert_engine_idle(clean)


def test_a_fault_in_a_later_chunk_fails_only_its_request(engines):
    """The poisoned prompt fails in its third 16-token chunk, next to two decoding requests: it
    stays a suspect (alone) through that chunk, so the decodes never share its failure."""
    clean, faulty = engines
    faulty.engine.core.runner._fail_request = ("poison", 35)
    salt = f"later-{next(EXAMPLES)}"
    innocents = [(f"r{i}", [200 + i] * 12, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
                 for i in range(2)]
    poisoned = [("poison-0", list(range(300, 340)), SamplingParams(max_tokens=2))]
    want = _run(clean, innocents, salt)
    got = _run(faulty, innocents + poisoned, salt)
    assert "injected failure" in (got["poison-0"].error or "")
    for r, _, _ in innocents:
        assert got[r].error is None and got[r].outputs[0].token_ids == want[r].outputs[0].token_ids
    assert_engine_idle(faulty)


def test_many_failing_requests_do_not_stop_the_engine(tiny_llama):
    """More poisoned requests in one step than MAX_FAILED_STEPS: each fails alone, which names
    it, so the engine never takes them for a broken model; the others finish as without them."""
    with pytest.MonkeyPatch.context() as mp:
        clean = LLM(str(tiny_llama), num_blocks=64, dtype="float32", max_num_seqs=16)
        mp.setenv("ENGINE_ALLOW_FAULTS", "1")
        mp.setenv("ENGINE_FAULT_REQUEST", "poison@0")
        faulty = LLM(str(tiny_llama), num_blocks=64, dtype="float32", max_num_seqs=16)
    innocents = [(f"r{i}", [100 + i] * 20, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
                 for i in range(2)]
    poisoned = [(f"poison-{i}", [7], SamplingParams(max_tokens=2)) for i in range(MAX_FAILED_STEPS + 4)]
    want = _run(clean, innocents, "many")
    got = _run(faulty, innocents + poisoned, "many")
    assert all("injected failure" in (got[r].error or "") for r, _, _ in poisoned)
    assert [got[r].outputs[0].token_ids for r, _, _ in innocents] == [want[r].outputs[0].token_ids
                                                                       for r, _, _ in innocents]
    assert_engine_idle(faulty)


def test_a_broken_model_still_stops_the_engine(engines):
    """Every step raising is the model's fault, not a request's: after MAX_ISOLATED_FAILURES
    requests failed alone in a row the step raises (the server reports the engine dead, FAULTS
    24) instead of failing requests forever."""
    _, faulty = engines
    runner = faulty.engine.core.runner
    runner._fail_request = ("", 0)  # every request, at its first position
    ids = [f"b{i}" for i in range(MAX_ISOLATED_FAILURES + 4)]
    try:
        for request_id in ids:
            faulty.engine.add_request(request_id, [5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="injected failure"):
            for _ in range(500):
                faulty.engine.step()
    finally:
        runner._fail_request = ("poison", 0)
        faulty.engine.abort_request(ids)
        for _ in range(5):
            faulty.engine.step()
