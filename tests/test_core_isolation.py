"""One request's failure is its own (issue 27, item 3): an exception raised while the engine core
admits a request — at any stage, for any of its n sequences — answers that request with a 500
and leaves nothing behind; the core and every other request go on."""
from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core import EngineCoreProc
from engine.engine_core import EngineCore
from engine.ipc import AddRequest
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams

GREEDY = dict(temperature=0, ignore_eos=True, max_tokens=4)
EXAMPLE = itertools.count()


@pytest.fixture(scope="module")
def core(tiny_llama) -> EngineCoreProc:
    return EngineCoreProc(EngineCore(EngineConfig(model=str(tiny_llama), num_blocks=64, max_model_len=256,
                                                  dtype="float32")), None)


def _add(core: EngineCoreProc, request_id: str, params: SamplingParams):
    return core.handle_add(AddRequest(request_id, [5, 6, 7, 8, 9], params, time.monotonic()))


def _run_to_end(core: EngineCoreProc) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(200):
        if not core.engine.has_unfinished_requests():
            return tokens
        for out in core.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    raise AssertionError("the engine did not finish")


STAGES = {  # where admission can fail: (object, attribute)
    "validate": lambda e: (e, "validate"),
    "grammar": lambda e: (e.grammar_compiler, "request_grammar"),
    "scheduler.add_request": lambda e: (e.scheduler, "add_request"),
}


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(stage=st.sampled_from(sorted(STAGES)), n=st.integers(1, 3), fail_at=st.integers(0, 2))
def test_an_exception_admitting_one_request_fails_only_that_request(core, monkeypatch, stage, n, fail_at):
    engine = core.engine
    before, victim, after = (f"{name}-{next(EXAMPLE)}" for name in ("before", "victim", "after"))
    fail_at = min(fail_at, n - 1) if stage != "validate" else 0
    free_before = engine.kv_cache_manager.pool.num_free_blocks
    # A neighbour admitted before the failure, and one after: both must finish as if alone.
    assert _add(core, before, SamplingParams(**GREEDY)).status == 200
    owner, name = STAGES[stage](engine)
    real = getattr(owner, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_at + 1:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    structured = StructuredOutputsParams(choice=["yes", "no"]) if stage == "grammar" else None
    ack = _add(core, victim, SamplingParams(n=n, seed=1, structured_outputs=structured, **GREEDY))
    monkeypatch.setattr(owner, name, real)
    assert ack.status == 500 and "RuntimeError: injected" in ack.message
    assert _add(core, after, SamplingParams(**GREEDY)).status == 200
    tokens = _run_to_end(core)
    assert sorted(tokens) == sorted([after, before]) and tokens[after] == tokens[before]
    assert len(tokens[before]) == 4
    assert engine.num_tracked_requests() == 0
    assert engine.kv_cache_manager.pool.num_free_blocks == free_before
    # The victim's id is free again.
    assert _add(core, victim, SamplingParams(**GREEDY)).status == 200
    assert _run_to_end(core)[victim] == tokens[before]


def test_a_failed_admission_never_touches_a_request_named_like_its_sequences(core, monkeypatch):
    """Sequence 0 of "v" (n=2) is "0_v", which is also a legal request id: undoing the failed "v"
    must leave a live request called "0_v" alone (it aborted it, and its client waited forever)."""
    engine = core.engine
    assert _add(core, "0_v", SamplingParams(n=2, seed=1, **GREEDY)).status == 200
    real = engine.validate

    def failing(*args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(engine, "validate", failing)
    assert _add(core, "v", SamplingParams(n=2, seed=1, **GREEDY)).status == 500
    monkeypatch.setattr(engine, "validate", real)
    tokens = _run_to_end(core)
    assert sorted(tokens) == ["0_0_v", "1_0_v"] and all(len(t) == 4 for t in tokens.values())
    assert engine.num_tracked_requests() == 0
