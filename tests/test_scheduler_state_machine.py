"""Generated scheduler histories: hypothesis drives the real Scheduler + KVCacheManager with a
fake connector whose loads arrive late, fail or never come (until their deadline), whose
lookups are answered a few steps late, with aborts, preemption, prefix hits and random pool
sizes; and, on the producer side, hand-offs (a prefill's requests that end after their first
token with their KV held on offer) that a decode pulls, a router releases (at any moment, also
twice or for requests that hold nothing), or everyone abandons until the lease ends. A FakeWorker "computes" KV into the paged blocks and checks that every token a request
attends to is really there, so a request that runs over KV that never arrived fails at once.

After every step: block ownership and ref counts agree, free + used = total, every holder of
blocks counts against max_num_seqs. Liveness: once arrivals stop, every admitted request ends
within a bounded number of steps, and the scheduler is empty afterwards.

CI runs a pinned number of examples; ENGINE_FUZZ_EXAMPLES=N runs more.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_transfer.base import KVConnectorScheduler
from engine.outputs import KVConnectorOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from tests.scheduler_utils import EOS, FakeWorker, assert_scheduler_empty, check_invariants, make_block_hasher

EXAMPLES = int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "400"))
LOAD_DEADLINE_STEPS = 12  # a load that "never comes" fails after this many steps
LEASE_STEPS = 15  # an offer nobody pulls or releases is freed after this many steps
PREFIXES = [[1000 + i for i in range(64)], [2000 + i for i in range(64)]]


@dataclass
class Plan:
    """What the outside world will do for one request's external KV."""
    remote_tokens: int    # tokens the "peer" holds (0: none)
    outcome: str          # "ok" | "fail" | "never"
    delay: int            # steps until the load resolves
    lookup_delay: int     # steps the lookup stays unanswered (get_num_new_matched_tokens -> None)


@dataclass
class Load:
    req_id: str
    block_ids: list[int]
    start: int            # first token position to fill
    end: int              # one past the last
    steps_left: int
    outcome: str


class FakeConnector(KVConnectorScheduler):
    """Scheduler half with a plan per request; the test's worker side resolves its loads."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.plans: dict[str, Plan] = {}
        self.consumed: set[str] = set()
        self.loading: set[str] = set()
        self.lookups_pending: dict[str, int] = {}
        self.new_loads: list[Load] = []
        self.cancels: list[str] = []
        self.requests: dict[str, Request] = {}
        self.offering: dict[str, tuple[str, int]] = {}  # hand-offs: request -> (fate, steps until it)
        # Offers held: request -> [fate, steps left]; "pulled", "released" (the test's router
        # releases it when due), "abandoned" (the lease), "withdrawn" (let go of next step).
        self.offers: dict[str, list] = {}
        self.offers_kv = True

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        plan = self.plans.get(request.request_id)
        if plan is None or request.request_id in self.consumed or plan.remote_tokens == 0:
            return 0, False
        left = self.lookups_pending.setdefault(request.request_id, plan.lookup_delay)
        if left > 0:
            return None
        external = min(plan.remote_tokens, request.num_prompt_tokens - 1) - num_computed_tokens
        return (external, True) if external > 0 else (0, False)

    def update_state_after_alloc(self, request, block_ids, num_local_tokens, num_external_tokens):
        plan = self.plans.get(request.request_id)
        if plan is None or request.request_id in self.consumed or num_external_tokens == 0:
            return
        self.consumed.add(request.request_id)
        self.loading.add(request.request_id)
        self.requests[request.request_id] = request
        self.new_loads.append(Load(request.request_id, list(block_ids), num_local_tokens,
                                   num_local_tokens + num_external_tokens, plan.delay, plan.outcome))

    def build_connector_meta(self, scheduler_output):
        meta = (self.new_loads, self.cancels)
        self.new_loads, self.cancels = [], []
        return meta

    def request_finished(self, request, block_ids):
        req_id = request.request_id
        offering = self.offering.pop(req_id, None)
        if offering is not None:
            fate, steps = offering
            if request.status not in (RequestStatus.FINISHED_HANDED_OFF, RequestStatus.FINISHED_LENGTH,
                                      RequestStatus.FINISHED_STOPPED):
                if request.num_computed_tokens < request.num_prompt_tokens:
                    return False, None  # ended before its KV went on offer: nothing held
                fate, steps = "withdrawn", 1  # aborted or failed: nobody is told where the KV is
            self.offers[req_id] = [fate, steps if fate != "abandoned" else LEASE_STEPS]
            return True, None
        self.plans.pop(req_id, None)
        self.consumed.discard(req_id)
        self.lookups_pending.pop(req_id, None)
        self.requests.pop(req_id, None)
        if req_id in self.loading:
            self.cancels.append(req_id)
            return True, None
        return False, None

    def transfer_done(self, req_id, failed=False):
        self.loading.discard(req_id)

    def withdraw(self, req_id):
        """A router's release: the worker lets go at the next step (it may be sending: True)."""
        offer = self.offers.get(req_id)
        if offer is None:
            return False
        offer[:] = ["withdrawn", 1]
        return True

    def send_done(self, req_id):
        self.offers.pop(req_id, None)

    def update_connector_output(self, output):
        for req_id in list(self.lookups_pending):
            self.lookups_pending[req_id] = max(0, self.lookups_pending[req_id] - 1)

    def num_tracked_requests(self):
        return (len(self.plans) + len(self.consumed) + len(self.loading) + len(self.lookups_pending)
                + len(self.offering) + len(self.offers))


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 2, 4, 8]),
                max_num_seqs=st.integers(1, 6), budget=st.integers(4, 64), caching=st.booleans(),
                chunk=st.sampled_from([0, 0, 1, 3, 16]))
    def setup(self, num_blocks, block_size, max_num_seqs, budget, caching, chunk=0):
        self.block_size = block_size
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.connector = FakeConnector(block_size)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                   long_prefill_token_threshold=chunk),
                                   self.kv, max_model_len=512, connector=self.connector)
        self.worker = FakeWorker(block_size)
        self.hasher = make_block_hasher(block_size)
        self.loads: list[Load] = []
        self.cancelled: set[str] = set()
        self.next_id = 0
        self.live: set[str] = set()       # added and not yet finished (from our point of view)
        self.finished: dict[str, str] = {}

    # ---- rules ---------------------------------------------------------------------------
    @rule(prefix=st.sampled_from([0, 1, None]), prefix_len=st.integers(0, 40), tail=st.integers(1, 24),
          max_tokens=st.integers(1, 12), remote=st.integers(0, 64),
          outcome=st.sampled_from(["ok", "ok", "fail", "never"]), delay=st.integers(0, 4),
          lookup_delay=st.sampled_from([0, 0, 1, 3]), n=st.integers(1, 3),
          hand_off=st.sampled_from([None, None, "pulled", "released", "abandoned"]))
    def add(self, prefix, prefix_len, tail, max_tokens, remote, outcome, delay, lookup_delay, n, hand_off=None):
        base = [] if prefix is None else PREFIXES[prefix][:prefix_len]
        hand_off = hand_off if not remote else None  # a prefill's requests load nothing themselves
        leader = None
        prompt = base + [5000 + 100 * (self.next_id + 1) + j for j in range(tail)]  # the n samples share it
        for _ in range(n):
            req_id = f"r{self.next_id}"
            self.next_id += 1
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            request = Request(req_id, prompt, params, frozenset({EOS}), max_tokens, self.hasher,
                              kv_leader=leader, hands_off=hand_off is not None)
            if hand_off is not None:
                self.connector.offering[req_id] = (hand_off, delay)
            self.scheduler.add_request(request)
            if hand_off is not None and req_id not in self.scheduler.requests:  # rejected at once
                self.connector.offering.pop(req_id, None)
            self.live.add(req_id)
            if leader is None and remote and req_id in self.scheduler.requests:  # not rejected at once
                self.connector.plans[req_id] = Plan(remote, outcome, delay if outcome != "never" else
                                                    LOAD_DEADLINE_STEPS, lookup_delay)
            leader = leader or req_id

    @rule(pick=st.integers(0, 63))
    def abort(self, pick):
        if not self.live:
            return
        req_id = sorted(self.live)[pick % len(self.live)]
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.live.discard(req_id)
        self.finished[req_id] = "abort"

    @rule(pick=st.integers(0, 63))
    def router_release(self, pick):
        """A router's release of any request's offer, whatever state it is in (held, running,
        finished, released before): harmless unless it holds an offer, which it frees."""
        if self.next_id:
            self.scheduler.withdraw_kv(f"r{pick % self.next_id}")

    @rule()
    def step(self):
        self._step()

    @rule()
    def failing_step(self):
        """The model step raises (engine_core._contain_step_failure): garbage in the step's
        slots, its requests quarantined. Nobody may read that garbage later: not a request of
        the step, nor one that took a prefix hit on its blocks (a running or loading one)."""
        so = self.scheduler.schedule()
        check_invariants(self.scheduler, so)
        new_loads, cancels = so.kv_connector_metadata
        self.loads += new_loads
        self.cancelled.update(cancels)
        self.worker.execute(so, self.scheduler, fail=True)
        if so.num_scheduled_tokens:
            self.scheduler.quarantine(so.num_scheduled_tokens, "injected step failure")
        for out in self.scheduler.take_pending_outputs():
            if out.finish_reason is not None:
                self.live.discard(out.req_id)
                self.finished[out.req_id] = out.finish_reason

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def holders_count_against_max_num_seqs(self):
        s = self.scheduler
        holding = sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KV or r.request_id in s.kv.req_to_blocks
                      for r in s.waiting)
        assert len(s.running) + holding <= s.max_num_seqs
        pool = self.kv.pool
        assert pool.num_free_blocks + sum(b.ref_cnt > 0 for b in pool.blocks) == pool.num_blocks

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        # Liveness: no more arrivals; every request ends within a bounded number of steps.
        bound = 200 + 60 * self.next_id
        for _ in range(bound):
            if not self.scheduler.has_unfinished_requests() and not self.loads:
                break
            self._step()
        else:
            s = self.scheduler
            raise AssertionError(
                f"no progress after {bound} steps: running={[r.request_id for r in s.running]} "
                f"waiting={[(r.request_id, r.status.name, r.num_computed_tokens, r.num_tokens) for r in s.waiting]} "
                f"free={self.kv.pool.num_free_blocks}/{self.kv.num_blocks} loads={[l.req_id for l in self.loads]}")
        assert not self.live, f"never finished: {sorted(self.live)}"
        assert not self.connector.offers, f"offers never freed: {self.connector.offers}"
        assert_scheduler_empty(self.scheduler)
        assert self.connector.num_tracked_requests() == 0

    # ---- the world -------------------------------------------------------------------------
    def _step(self):
        so = self.scheduler.schedule()
        check_invariants(self.scheduler, so)
        new_loads, cancels = so.kv_connector_metadata
        self.loads += new_loads
        self.cancelled.update(cancels)
        runner_output = self.worker.execute(so, self.scheduler)
        runner_output.kv_connector_output = self._resolve_loads()
        for out in self.scheduler.update_from_output(so, runner_output):
            if out.finish_reason is not None:
                self.live.discard(out.req_id)
                self.finished[out.req_id] = out.finish_reason
        # Requests rejected at admission come back as outputs too; anything else still live
        # must still be known to the scheduler.
        for req_id in self.live:
            assert req_id in self.scheduler.requests, f"{req_id} vanished without an output"

    def _resolve_loads(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for req_id, offer in list(self.connector.offers.items()):  # the world's side of hand-offs
            assert req_id in self.scheduler.held and req_id in self.kv.req_to_blocks, \
                f"{req_id}'s offer is held, its blocks are not"
            if offer[1] > 0:
                offer[1] -= 1
            elif offer[0] == "released":
                self.scheduler.withdraw_kv(req_id)  # the router's release: let go of next step
            else:  # pulled, abandoned at the lease's end, or let go of after a release
                out.finished_sending.add(req_id)
        still = []
        for load in self.loads:
            if load.req_id in self.cancelled:
                out.failed_recving.add(load.req_id)
                out.failure_reasons[load.req_id] = "cancelled"
                self.cancelled.discard(load.req_id)
                continue
            if load.steps_left > 0:
                load.steps_left -= 1
                still.append(load)
                continue
            if load.outcome == "ok":
                self._write(load)
                out.finished_recving.add(load.req_id)
            else:
                out.failed_recving.add(load.req_id)
                out.failure_reasons[load.req_id] = load.outcome
        self.loads = still
        return out

    def _write(self, load: Load) -> None:
        """The remote KV lands: the right tokens in the planned blocks."""
        request = self.connector.requests[load.req_id]
        bs = self.block_size
        for pos in range(load.start, load.end):
            slots = self.worker.kv.setdefault(load.block_ids[pos // bs], [None] * bs)
            slots[pos % bs] = request.all_token_ids[pos]


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None, derandomize=True,
                                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_arrived_kv_filling_the_pool_still_runs():
    """FAULTS 29, the case from the issue: ten 17-token requests whose KV arrives fill a
    10-block pool (16-token blocks) with parked blocks, and nothing is running. The scheduler
    must preempt parked requests to let others run, not schedule 0 tokens forever."""
    machine = SchedulerMachine()
    machine.setup(num_blocks=10, block_size=16, max_num_seqs=16, budget=64, caching=True)
    for _ in range(10):
        machine.add(prefix=None, prefix_len=0, tail=17, max_tokens=4, remote=17, outcome="ok", delay=0,
                    lookup_delay=0, n=1)
    machine._step()  # all ten admitted to load, one block each: the pool is full and nothing runs
    assert machine.kv.pool.num_free_blocks == 0 and not machine.scheduler.running
    machine.teardown()  # every request must finish, leaving nothing behind
    assert machine.finished == {f"r{i}": "length" for i in range(10)}
