"""The real Scheduler and KVCacheManager, driven step by step with fabricated runner outputs.
Every test ends by checking that no request or block is left behind."""
from __future__ import annotations

import random

import pytest

from engine.request import RequestStatus
from scheduler_utils import (EOS, SAMPLED, FakeWorker, assert_scheduler_empty, check_invariants,
                             fake_runner_output, finish_reason_of, make_request, make_scheduler,
                             run_until_done, step, tokens_of)


def counting(request) -> int:
    """A token that tells which output it is: 1000, 1001, ..."""
    return 1000 + request.num_output_tokens


# ---- one request -----------------------------------------------------------------------
def test_single_request_prefill_then_decode_to_max_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", 6, max_tokens=5))
    so, outs = step(sched, token=counting)
    assert so.num_scheduled_tokens == {"a": 6}
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "a" and new.num_computed_tokens == 0 and len(new.block_ids) == 2
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [1000], None)]
    all_outs = list(outs)
    for i in range(1, 5):
        so, outs = step(sched, token=counting)
        assert so.num_scheduled_tokens == {"a": 1} and not so.scheduled_new_reqs
        assert so.scheduled_cached_reqs.req_ids == ["a"]
        assert so.scheduled_cached_reqs.num_computed_tokens == [6 + i - 1]
        all_outs += outs
    assert tokens_of(all_outs) == [1000, 1001, 1002, 1003, 1004]
    assert finish_reason_of(all_outs) == "length"
    assert sched.schedule().finished_req_ids == {"a"}
    assert_scheduler_empty(sched)


def test_new_blocks_are_sent_only_when_a_block_fills():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", 3, max_tokens=6))
    so, _ = step(sched)
    assert len(so.scheduled_new_reqs[0].block_ids) == 1
    new_blocks = []
    for _ in range(5):
        so, _ = step(sched)
        new_blocks += so.scheduled_cached_reqs.new_block_ids
    # Tokens 3..7 are computed in decode steps: token 4 opens block 1, token 8 would open block 2.
    assert [len(b) for b in new_blocks] == [0, 1, 0, 0, 0]
    assert not sched.has_unfinished_requests()
    sched.schedule()
    assert_scheduler_empty(sched)


# ---- stop conditions ---------------------------------------------------------------------
def test_eos_stops_the_request():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10))
    outs = run_until_done(sched, eos_for={"a"})["a"]
    assert tokens_of(outs) == [EOS] and finish_reason_of(outs) == "stop"
    assert outs[-1].stop_reason is None
    assert_scheduler_empty(sched)


def test_eos_before_min_tokens_does_not_stop():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10, min_tokens=3))
    outs = run_until_done(sched, eos_for={"a"})["a"]
    assert tokens_of(outs) == [EOS, EOS, EOS] and finish_reason_of(outs) == "stop"
    assert_scheduler_empty(sched)


def test_ignore_eos_runs_to_max_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=4, ignore_eos=True))
    outs = run_until_done(sched, eos_for={"a"})["a"]
    assert tokens_of(outs) == [EOS] * 4 and finish_reason_of(outs) == "length"
    assert_scheduler_empty(sched)


def test_stop_token_ids_stop_with_their_reason():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10, stop_token_ids=[1002, 55]))
    sched.add_request(make_request("b", 5, max_tokens=10, stop_token_ids=[1000], min_tokens=2))
    outs = run_until_done(sched, token=counting)
    assert tokens_of(outs["a"]) == [1000, 1001, 1002]
    assert finish_reason_of(outs["a"]) == "stop" and outs["a"][-1].stop_reason == 1002
    # 1000 comes first, before min_tokens: ignored; it never comes again.
    assert tokens_of(outs["b"]) == list(range(1000, 1010)) and finish_reason_of(outs["b"]) == "length"
    assert outs["b"][-1].stop_reason is None
    assert_scheduler_empty(sched)


def test_max_model_len_ends_the_request():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("a", 5, max_tokens=10))
    outs = run_until_done(sched)["a"]
    assert len(tokens_of(outs)) == 3 and finish_reason_of(outs) == "length"
    assert_scheduler_empty(sched)


# ---- budgets -----------------------------------------------------------------------------
def test_chunked_prefill_samples_only_after_the_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", 10, max_tokens=3))
    chunks = []
    for _ in range(3):
        so, outs = step(sched)
        chunks.append(so.num_scheduled_tokens["a"])
        if len(chunks) < 3:
            assert outs == [] and sched.requests["a"].num_output_tokens == 0
    assert chunks == [4, 4, 2]
    assert [o.new_token_ids for o in outs] == [[SAMPLED]]
    outs = run_until_done(sched)["a"]
    assert len(tokens_of(outs)) == 2 and finish_reason_of(outs) == "length"
    assert_scheduler_empty(sched)


def test_long_prefill_token_threshold_chunks_prefills_beside_running_decodes():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    sched.add_request(make_request("d", 3, max_tokens=20))
    step(sched)  # d's short prompt is one chunk (under the threshold)
    sched.add_request(make_request("p", 12, max_tokens=2))
    chunks = []
    for _ in range(3):
        so, _ = step(sched)
        assert so.num_scheduled_tokens["d"] == 1  # the decode runs every step
        chunks.append(so.num_scheduled_tokens["p"])
    assert chunks == [5, 5, 2] and sched.requests["p"].num_output_tokens == 1
    run_until_done(sched)
    assert_scheduler_empty(sched)


def test_token_budget_is_respected_every_step():
    sched = make_scheduler(max_num_batched_tokens=8)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 7, max_tokens=4))
    totals = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)  # step() checks total <= budget
        totals.append(so.total_num_scheduled_tokens)
        assert len(totals) < 100
    assert max(totals) == 8  # the budget is used, not just respected
    assert_scheduler_empty(sched)


def test_prefill_and_decode_share_a_step():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=3))
    step(sched)
    sched.add_request(make_request("b", 9, max_tokens=2))
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    assert so.scheduled_cached_reqs.req_ids == ["a"] and [n.req_id for n in so.scheduled_new_reqs] == ["b"]
    assert sorted(o.req_id for o in outs) == ["a", "b"]
    run_until_done(sched)
    assert_scheduler_empty(sched)


def test_running_requests_are_served_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=6)
    sched.add_request(make_request("a", 4, max_tokens=5))
    step(sched)
    sched.add_request(make_request("b", 20, max_tokens=1))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 5}  # b gets what a leaves of the budget
    run_until_done(sched)
    assert_scheduler_empty(sched)


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=3))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"} and sched.num_waiting == 1
    step(sched)
    so, _ = step(sched)  # r0 and r1 finish here
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"r2"}
    run_until_done(sched)
    assert_scheduler_empty(sched)


def test_waiting_requests_are_served_in_fifo_order():
    sched = make_scheduler(max_num_seqs=1)
    ids = ["d", "a", "c", "b"]
    for req_id in ids:
        sched.add_request(make_request(req_id, 3, max_tokens=2))
    order = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        order += [n.req_id for n in so.scheduled_new_reqs]
    assert order == ids
    assert_scheduler_empty(sched)


def test_a_request_that_does_not_fit_yet_is_not_overtaken():
    sched = make_scheduler(num_blocks=6, max_num_seqs=8)
    sched.add_request(make_request("big0", 16, max_tokens=4))   # 4 blocks, then grows to 5
    step(sched)
    sched.add_request(make_request("big1", 12, max_tokens=2))  # needs 3 blocks: only 2 free
    sched.add_request(make_request("small", 2, max_tokens=2))  # would fit now
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"big0"}
    assert [r.request_id for r in sched.waiting] == ["big1", "small"]
    outs = run_until_done(sched)
    assert all(finish_reason_of(o) == "length" for o in outs.values()) and len(outs) == 3
    assert_scheduler_empty(sched)


# ---- prefix caching ----------------------------------------------------------------------
def test_prefix_cache_hit_after_the_first_request_finished():
    sched = make_scheduler()
    prompt = list(range(100, 110))
    sched.add_request(make_request("a", prompt_token_ids=prompt, max_tokens=2))
    outs_a = run_until_done(sched)["a"]
    assert outs_a[-1].num_cached_tokens == 0
    sched.add_request(make_request("b", prompt_token_ids=prompt, max_tokens=2))
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"b": 2}  # 8 of 10 from cache, the last token recomputed
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert sched.requests["b"].num_cached_tokens == 8
    assert outs[0].num_cached_tokens == 8
    outs_b = outs + run_until_done(sched)["b"]
    assert len(tokens_of(outs_b)) == 2 and all(o.num_cached_tokens == 8 for o in outs_b)
    assert sched.kv.stats.hits == 8
    assert_scheduler_empty(sched)


def test_prefix_cache_shared_between_running_requests():
    sched = make_scheduler()
    worker = FakeWorker(4)  # checks that the shared blocks really hold the shared tokens
    prompt = list(range(100, 113))
    sched.add_request(make_request("a", prompt_token_ids=prompt, max_tokens=4))
    step(sched, worker=worker)
    sched.add_request(make_request("b", prompt_token_ids=prompt[:12] + [5, 6], max_tokens=4))
    so, _ = step(sched, worker=worker)
    assert so.num_scheduled_tokens == {"a": 1, "b": 2}
    a_blocks, b_blocks = sched.kv.req_to_blocks["a"], sched.kv.req_to_blocks["b"]
    assert a_blocks[:3] == b_blocks[:3] and all(blk.ref_cnt == 2 for blk in b_blocks[:3])
    assert a_blocks[3] is not b_blocks[3]
    run_until_done(sched, worker=worker)
    assert_scheduler_empty(sched)
    # Two identical prompts admitted in the same step both hit the cached prefix.
    sched.add_request(make_request("c", prompt_token_ids=prompt, max_tokens=3))
    sched.add_request(make_request("d", prompt_token_ids=prompt, max_tokens=3))
    outs = run_until_done(sched, worker=worker)
    assert [o[0].num_cached_tokens for o in outs.values()] == [12, 12]
    assert_scheduler_empty(sched)


def test_prefix_cache_stats_count_a_waiting_request_once():
    # b's prefix lookup happens every step while it waits for memory; the hit-rate counters
    # must count each scheduled request once (vLLM issue #43736), not once per retry.
    sched = make_scheduler(num_blocks=4, block_size=4)
    a_prompt = list(range(100, 112))
    sched.add_request(make_request("a", prompt_token_ids=a_prompt, max_tokens=5))  # grows to 4 blocks
    sched.add_request(make_request("b", prompt_token_ids=a_prompt[:4] + list(range(300, 308)), max_tokens=1))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"a"}  # b needs 2 new blocks, 1 is free
    outs = run_until_done(sched)
    assert outs["b"][0].num_cached_tokens == 4
    assert sched.kv.stats.queries == 12 + 12
    assert sched.kv.stats.hits == 4
    assert_scheduler_empty(sched)


def test_no_prefix_hits_with_caching_disabled():
    sched = make_scheduler(enable_caching=False)
    prompt = list(range(100, 110))
    sched.add_request(make_request("a", prompt_token_ids=prompt, max_tokens=2))
    run_until_done(sched)
    sched.add_request(make_request("b", prompt_token_ids=prompt, max_tokens=2))
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"b": 10} and outs[0].num_cached_tokens == 0
    run_until_done(sched)
    assert_scheduler_empty(sched)


# ---- memory pressure ---------------------------------------------------------------------
def test_preemption_of_the_newest_request_and_recompute():
    # 4 blocks of 4 tokens. a and b (6-token prompts) take 2 blocks each; both must grow at
    # token 8, which fits only one of them at a time.
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add_request(make_request("a", 6, max_tokens=8))
    sched.add_request(make_request("b", 6, max_tokens=8))
    outs: dict[str, list] = {}

    def record(new):
        for o in new:
            outs.setdefault(o.req_id, []).append(o)

    record(step(sched, token=counting)[1])
    sched.add_request(make_request("c", 2, max_tokens=1))  # queued behind: no free block
    record(step(sched, token=counting)[1])
    so, new = step(sched, token=counting)
    record(new)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and sched.num_waiting == 1
    b = sched.requests["b"]
    assert b.output_token_ids == [1000, 1001, 1002]

    so = sched.schedule()  # a needs a third block: b, the newest, is preempted
    check_invariants(sched, so)
    assert so.num_scheduled_tokens == {"a": 1}
    assert "b" in so.finished_req_ids  # the worker must drop b's state
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # back at the front
    assert sched.stats.num_preemptions == 1
    assert sched.kv.get_block_ids("b") == []
    record(sched.update_from_output(so, fake_runner_output(so, sched, token=counting)))

    resumed = None
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        so, new = step(sched, token=counting)
        record(new)
        for data in so.scheduled_new_reqs:
            if data.req_id == "b":
                assert resumed is None, "b resumed twice"
                resumed = data
                assert so.num_scheduled_tokens["b"] == 9 - data.num_computed_tokens
            assert data.req_id != "a"
    assert resumed is not None, "b was never rescheduled"
    assert resumed.output_token_ids == [1000, 1001, 1002] and resumed.prompt_token_ids == b.prompt_token_ids
    assert tokens_of(outs["a"]) == list(range(1000, 1008)) and finish_reason_of(outs["a"]) == "length"
    assert tokens_of(outs["b"]) == list(range(1000, 1008)) and finish_reason_of(outs["b"]) == "length"
    assert len(tokens_of(outs["c"])) == 1 and finish_reason_of(outs["c"]) == "length"
    assert b.num_cached_tokens == 0  # set at first schedule, not overwritten on resume
    assert_scheduler_empty(sched)


def test_preempted_request_resumes_from_its_own_cached_prefix():
    sched = make_scheduler(num_blocks=4, block_size=4)
    worker = FakeWorker(4, token=counting)
    sched.add_request(make_request("a", 6, max_tokens=4))
    sched.add_request(make_request("b", 6, max_tokens=8))
    for _ in range(3):
        step(sched, worker=worker)
    so, outs = step(sched, worker=worker)  # b is preempted; a takes b's tail block and finishes
    assert sched.stats.num_preemptions == 1 and "b" in so.finished_req_ids
    assert [o.finish_reason for o in outs if o.req_id == "a"] == ["length"]
    so, outs = step(sched, worker=worker)
    (resumed,) = so.scheduled_new_reqs
    assert resumed.req_id == "b" and resumed.num_computed_tokens == 4  # b's first block survived
    assert so.num_scheduled_tokens == {"b": 5}
    # num_cached_tokens reports what the cache saved at the first schedule, not on resume.
    assert sched.requests["b"].num_cached_tokens == 0 and outs[0].num_cached_tokens == 0
    assert outs[0].new_token_ids == [1003]
    outs = run_until_done(sched, worker=worker)
    assert tokens_of(outs["b"]) == list(range(1004, 1008)) and finish_reason_of(outs["b"]) == "length"
    assert_scheduler_empty(sched)


def test_preempted_request_resumes_with_the_right_kv():
    # Same squeeze, checked by a worker that verifies every token a request attends to.
    sched = make_scheduler(num_blocks=5, block_size=4)
    worker = FakeWorker(4, token=counting)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 5, max_tokens=9))
    outs = run_until_done(sched, worker=worker)
    assert sched.stats.num_preemptions > 0
    for req_id in ("r0", "r1", "r2"):
        assert tokens_of(outs[req_id]) == list(range(1000, 1009)), req_id
    assert_scheduler_empty(sched)


def test_request_that_can_never_fit_fails_at_once_without_blocking_the_queue():
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add_request(make_request("huge", 10, max_tokens=10))  # needs 5 of 4 blocks
    sched.add_request(make_request("ok", 3, max_tokens=2))
    assert sched.stats.num_rejected == 1
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"ok": 3}
    huge = [o for o in outs if o.req_id == "huge"]
    assert len(huge) == 1 and huge[0].finish_reason == "error" and "KV" in huge[0].error
    assert huge[0].new_token_ids == []
    run_until_done(sched)
    assert_scheduler_empty(sched)


def test_request_that_exactly_fits_the_pool_runs():
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add_request(make_request("a", 10, max_tokens=7))  # 16 tokens of KV, 4 blocks
    outs = run_until_done(sched)["a"]
    assert len(tokens_of(outs)) == 7 and finish_reason_of(outs) == "length"
    assert sched.stats.num_preemptions == 0
    assert_scheduler_empty(sched)


# ---- aborts and ids ----------------------------------------------------------------------
def test_abort_waiting_and_running_requests_frees_their_blocks():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    sched.add_request(make_request("run", 9, max_tokens=10))
    sched.add_request(make_request("wait", 3, max_tokens=2))
    step(sched)
    assert sched.kv.pool.num_free_blocks == 5
    sched.finish_requests("wait", RequestStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 0 and "wait" not in sched.requests
    sched.finish_requests(["run", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sched.num_running == 0 and sched.kv.pool.num_free_blocks == 8
    so = sched.schedule()
    assert so.finished_req_ids == {"run", "wait"} and so.total_num_scheduled_tokens == 0
    assert sched.update_from_output(so, fake_runner_output(so, sched)) == []
    assert_scheduler_empty(sched)


def test_abort_between_schedule_and_update_drops_the_token():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=5))
    sched.add_request(make_request("b", 4, max_tokens=2))
    so = sched.schedule()
    runner_output = fake_runner_output(so, sched)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outs = sched.update_from_output(so, runner_output)
    assert [o.req_id for o in outs] == ["b"]
    run_until_done(sched)
    assert_scheduler_empty(sched)


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add_request(make_request("a", 6, max_tokens=8))
    sched.add_request(make_request("b", 6, max_tokens=8))
    for _ in range(4):
        step(sched)
    assert sched.requests["b"].status == RequestStatus.PREEMPTED
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 0
    run_until_done(sched)
    assert_scheduler_empty(sched)


def test_duplicate_request_id_raises_and_an_id_can_be_reused_after_it_finished():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 5, max_tokens=1))
    assert sched.num_waiting == 1
    run_until_done(sched)
    sched.add_request(make_request("a", 5, max_tokens=1))
    run_until_done(sched)
    assert_scheduler_empty(sched)


# ---- everything at once ------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_random_stress(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(24, 64) // block_size  # 24..64 tokens: pressure, some rejections
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=rng.randint(1, 6),
                           max_num_batched_tokens=rng.randint(3, 24), enable_caching=rng.random() < 0.8)
    eos_ids = {f"r{i}" for i in range(60) if rng.random() < 0.2}
    worker = FakeWorker(block_size, token=lambda r: 1000 + rng.randrange(5), eos_for=eos_ids)
    prefixes = [[rng.randrange(100, 200) for _ in range(12)] for _ in range(3)]
    expected_max: dict[str, int] = {}
    results: dict[str, list] = {}
    aborted: set[str] = set()
    next_id = 0
    for step_no in range(3000):
        if next_id < 60 and rng.random() < 0.3:
            prompt = rng.choice(prefixes)[:rng.randint(0, 12)] + [rng.randrange(200, 300)
                                                                 for _ in range(rng.randint(1, 10))]
            req_id = f"r{next_id}"
            next_id += 1
            max_tokens = rng.randint(1, 12)
            request = make_request(req_id, prompt_token_ids=prompt, max_tokens=max_tokens, block_size=block_size)
            sched.add_request(request)
            expected_max[req_id] = max_tokens
        if sched.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        if next_id >= 60 and not sched.has_unfinished_requests():
            break
        so, outs = step(sched, worker=worker)  # checks the invariants after schedule()
        check_invariants(sched)  # and again after update_from_output()
        for out in outs:
            results.setdefault(out.req_id, []).append(out)
    else:
        raise AssertionError("stress run did not finish")
    sched.schedule()
    assert_scheduler_empty(sched)
    for req_id, max_tokens in expected_max.items():
        outs = results.get(req_id, [])
        reason = finish_reason_of(outs)
        if req_id in aborted:
            assert reason is None
            continue
        tokens = tokens_of(outs)
        if reason == "error":
            assert tokens == []
        elif reason == "stop":
            assert req_id in eos_ids and tokens[-1] == EOS and len(tokens) <= max_tokens
        else:
            assert reason == "length" and len(tokens) == max_tokens, (req_id, reason, tokens)
