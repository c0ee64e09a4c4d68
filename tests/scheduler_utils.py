"""Factories for driving the real Scheduler + KVCacheManager with fabricated runner outputs
(in the style of vLLM's tests/v1/kv_connector/unit/utils.py).

Conventions: token ids below 100 are reserved for the tests. ``EOS`` is the end-of-sequence id
of every request built here, ``SAMPLED`` the default token the fake runner emits, and prompt
tokens are >= 100 so that they never look like either.
"""
from __future__ import annotations

import zlib
from collections import Counter
from typing import Callable, Iterable

from engine.block_pool import BlockHasher, root_block_hash
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

EOS = 2
SAMPLED = 7
FINGERPRINT = "test-model:float32:bs{block_size}:torch"

TokenPolicy = int | Callable[[Request], int]


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64, max_model_len: int = 1024,
                   enable_caching: bool = True, long_prefill_token_threshold: int = 0) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     long_prefill_token_threshold=long_prefill_token_threshold),
                     kv, max_model_len)


def make_block_hasher(block_size: int = 4, fingerprint: str | None = None) -> BlockHasher:
    fingerprint = FINGERPRINT.format(block_size=block_size) if fingerprint is None else fingerprint
    return BlockHasher(block_size, root_block_hash(fingerprint))


def prompt_for(req_id: str, length: int) -> list[int]:
    """Deterministic prompt tokens that differ between request ids (no accidental prefix hits)."""
    base = 100 + zlib.crc32(req_id.encode()) % 10_000_000
    return [base + i for i in range(length)]


def make_request(req_id: str, prompt_len: int | None = None, max_tokens: int = 8, *,
                 prompt_token_ids: list[int] | None = None, min_tokens: int = 0,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                 block_size: int = 4, eos_token_ids: Iterable[int] = (EOS,),
                 arrival_time: float | None = None) -> Request:
    if prompt_token_ids is None:
        assert prompt_len is not None, "give prompt_len or prompt_token_ids"
        prompt_token_ids = prompt_for(req_id, prompt_len)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop_token_ids,
                            ignore_eos=ignore_eos, temperature=0.0)
    return Request(req_id, prompt_token_ids, params, frozenset(eos_token_ids), max_tokens,
                   make_block_hasher(block_size), arrival_time)


def _pick(token: TokenPolicy, request: Request) -> int:
    return token(request) if callable(token) else token


def fake_runner_output(scheduler_output: SchedulerOutput, scheduler: Scheduler, token: TokenPolicy = SAMPLED,
                       eos_for: Iterable[str] = frozenset()) -> ModelRunnerOutput:
    """Sample one token for every scheduled request whose known tokens are now all computed
    (schedule() has already advanced num_computed_tokens); mid-prefill requests get nothing.
    ``token`` is an id or a function of the request; requests in ``eos_for`` emit EOS."""
    eos_for = set(eos_for)
    sampled: dict[str, int] = {}
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        assert n > 0, f"{req_id} scheduled for {n} tokens"
        request = scheduler.requests.get(req_id)
        if request is None:
            continue  # aborted after schedule(): a real runner would still have sampled it
        assert request.num_computed_tokens <= request.num_tokens
        if request.num_computed_tokens == request.num_tokens:
            sampled[req_id] = EOS if req_id in eos_for else _pick(token, request)
    return ModelRunnerOutput(sampled_token_ids=sampled)


class FakeWorker:
    """A model runner without a model: keeps its own per-request state from SchedulerOutputs
    exactly as ModelRunner._update_states does, "writes" token ids into a paged KV store through
    the block tables, and checks that every token a request attends to is really there. A stale
    prefix hit, a block reused while still referenced or a wrong block table fails here."""

    def __init__(self, block_size: int, token: TokenPolicy = SAMPLED, eos_for: Iterable[str] = frozenset()) -> None:
        self.block_size = block_size
        self.token = token
        self.eos_for = set(eos_for)
        self.kv: dict[int, list[int | None]] = {}  # block id -> token id in each slot
        self.states: dict[str, dict] = {}

    def execute(self, so: SchedulerOutput, scheduler: Scheduler, fail: bool = False) -> ModelRunnerOutput:
        """``fail``: the step raises part way: its requests' slots get garbage (-1), nothing is
        sampled (engine_core then quarantines them)."""
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice without being dropped"
            self.states[new.req_id] = dict(tokens=list(new.prompt_token_ids) + list(new.output_token_ids),
                                           blocks=list(new.block_ids), computed=new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.states[req_id]
            state["blocks"].extend(block_ids)
            state["computed"] = computed
        assert set(so.num_scheduled_tokens) == {n.req_id for n in so.scheduled_new_reqs} | set(cached.req_ids)

        bs = self.block_size
        for req_id, n in so.num_scheduled_tokens.items():  # write the new tokens' KV
            state = self.states[req_id]
            start = state["computed"]
            assert start + n <= len(state["tokens"]), f"{req_id} scheduled past its known tokens"
            assert len(state["blocks"]) * bs >= start + n, f"{req_id} has too few blocks"
            for pos in range(start, start + n):
                slots = self.kv.setdefault(state["blocks"][pos // bs], [None] * bs)
                slots[pos % bs] = -1 if fail else state["tokens"][pos]
        out = ModelRunnerOutput()
        if fail:
            return out
        for req_id, n in so.num_scheduled_tokens.items():  # "attend" and sample
            state = self.states[req_id]
            end = state["computed"] + n
            seen = [self.kv.get(state["blocks"][p // bs], [None] * bs)[p % bs] for p in range(end)]
            assert seen == state["tokens"][:end], f"{req_id} reads wrong KV: {seen} != {state['tokens'][:end]}"
            state["computed"] = end
            if end == len(state["tokens"]):
                request = scheduler.requests.get(req_id)
                if request is None:
                    token = SAMPLED
                elif req_id in self.eos_for:
                    token = EOS
                else:
                    token = _pick(self.token, request)
                state["tokens"].append(token)
                out.sampled_token_ids[req_id] = token
        return out


def step(scheduler: Scheduler, token: TokenPolicy = SAMPLED, eos_for: Iterable[str] = frozenset(),
         worker: FakeWorker | None = None) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = scheduler.schedule()
    check_invariants(scheduler, so)
    runner_output = (worker.execute(so, scheduler) if worker is not None
                     else fake_runner_output(so, scheduler, token, eos_for))
    return so, scheduler.update_from_output(so, runner_output)


def run_until_done(scheduler: Scheduler, max_steps: int = 1000, token: TokenPolicy = SAMPLED,
                   eos_for: Iterable[str] = frozenset(), worker: FakeWorker | None = None,
                   ) -> dict[str, list[EngineCoreOutput]]:
    """Step until nothing is left; returns every EngineCoreOutput by request id."""
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        _, outs = step(scheduler, token, eos_for, worker)
        for out in outs:
            outputs.setdefault(out.req_id, []).append(out)
    raise AssertionError(f"not done after {max_steps} steps: running={[r.request_id for r in scheduler.running]} "
                         f"waiting={[r.request_id for r in scheduler.waiting]}")


def tokens_of(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def finish_reason_of(outputs: list[EngineCoreOutput]) -> str | None:
    reasons = [out.finish_reason for out in outputs if out.finish_reason is not None]
    assert len(reasons) <= 1, f"finished more than once: {reasons}"
    assert not reasons or outputs[-1].finish_reason is not None, "output after the finishing one"
    return reasons[0] if reasons else None


def check_invariants(scheduler: Scheduler, so: SchedulerOutput | None = None) -> None:
    """Block accounting and step limits that must hold after every schedule()."""
    kv = scheduler.kv
    pool = kv.pool
    holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {holders[block.block_id]} requests")
    free_ids = set(pool.free_queue)
    assert len(free_ids) == len(pool.free_queue)
    assert free_ids == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    assert pool.num_free_blocks + in_use == pool.num_blocks
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    # No block appears twice in one request's table, and cached blocks hold the request's own hash.
    for req_id, blocks in kv.req_to_blocks.items():
        assert len({b.block_id for b in blocks}) == len(blocks), f"{req_id} holds a block twice"
        request = scheduler.requests.get(req_id) or scheduler.held.get(req_id)
        assert request is not None, f"blocks of unknown request {req_id}"
        for i, block in enumerate(blocks):
            if block.block_hash is not None:
                assert i < len(request.block_hashes) and block.block_hash == request.block_hashes[i], (
                    f"{req_id} block {i} is cached under another request's content")
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert len({id(r) for r in scheduler.running}) == len(scheduler.running)
    assert not {r.request_id for r in scheduler.running} & {r.request_id for r in scheduler.waiting}
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED,
                                  RequestStatus.WAITING_FOR_REMOTE_KV)
    if so is not None:
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        for req_id in so.num_scheduled_tokens:
            request = scheduler.requests[req_id]
            assert request.status == RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens
            assert len(kv.req_to_blocks[req_id]) * kv.block_size >= request.num_computed_tokens


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    kv = scheduler.kv
    pool = kv.pool
    assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
    assert not scheduler.waiting and not scheduler.running and not scheduler.held
    assert not scheduler.has_unfinished_requests()
    assert all(b.ref_cnt == 0 for b in pool.blocks), [b for b in pool.blocks if b.ref_cnt]
    assert pool.num_free_blocks == pool.num_blocks
    assert sorted(pool.free_queue) == list(range(pool.num_blocks))
    assert not kv.req_to_blocks, f"blocks still assigned: {dict(kv.req_to_blocks)}"
    assert not kv.num_cached_block
