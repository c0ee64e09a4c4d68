"""Continuous-batching scheduler: one token budget per step, running requests first.

There are no prefill and decode phases. Every request has one counter, num_computed_tokens,
that catches up with its token count; a step schedules ``num_tokens - num_computed_tokens``
tokens (or a chunk of them) per request, so prefill chunks and decode tokens share a batch.
"""
from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.errors import KV_LOAD_FAILED
from engine.grammar import build_bitmask
from engine.kv_cache_manager import KVCacheManager
from engine.kv_transfer.base import KVConnectorScheduler, NoOpConnectorScheduler
from engine.kv_transfer.params import KVTransferParams
from engine.outputs import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                            NewRequestData, SchedulerOutput)
from engine.request import Request, RequestStatus
from engine.request_trace import snapshot

# Times a request may be recomputed for sharing a step that raised before it fails itself.
MAX_QUARANTINES = 3

logger = logging.getLogger("engine.scheduler")


class Admission(enum.Enum):
    SCHEDULED = enum.auto()   # running from this step
    LOADING = enum.auto()     # blocks allocated; its KV is being loaded
    NO_MEMORY = enum.auto()   # nothing changed: the pool cannot hold it now
    ASK_AGAIN = enum.auto()   # the connector does not know yet how much it can supply
    FAILED = enum.auto()      # ended with an error (its own contents made it fail)


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_rejected: int = 0
    num_kv_load_failures: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 connector: KVConnectorScheduler | None = None, vocab_size: int = 0) -> None:
        self.vocab_size = vocab_size  # the width of structured-output bitmasks
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.max_model_len = max_model_len
        self.kv = kv_cache_manager
        self.connector = connector or NoOpConnectorScheduler()
        self.connector.block_ids_of = kv_cache_manager.get_block_ids
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished or preempted since the last schedule(): the worker drops their state.
        self._finished_req_ids: set[str] = set()
        # Finished requests whose blocks stay allocated while the connector still reads them.
        self.held: dict[str, Request] = {}
        # Outputs produced outside a model step (rejections), delivered with the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.stats = SchedulerStats()

    # ---- admission -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        # The KV of the last sampled token is never computed, hence the -1 (a request handing off
        # after its first token computes the prompt only).
        needed = self.kv.blocks_needed(request.num_prompt_tokens + (0 if request.hands_off else request.max_tokens - 1))
        if needed > self.kv.num_blocks:
            # It could never run, even alone: finish it now instead of preempting forever.
            request.status = RequestStatus.FINISHED_ERROR
            request.error = (f"request needs {needed} KV blocks ({request.num_prompt_tokens} prompt + "
                             f"{request.max_tokens} max tokens) but the whole KV pool has {self.kv.num_blocks}")
            self.stats.num_rejected += 1
            self._pending_outputs.append(EngineCoreOutput(
                request.request_id, [], finish_reason="error", error=request.error))
            if request.kv_transfer_params is not None:  # a peer's hand-off it will never pull
                self.connector.release_peer(request.kv_transfer_params)
            return
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.connector.request_queued(request)
        logger.debug("request %s: WAITING (%d prompt tokens, max_tokens %d)", request.request_id,
                     request.num_prompt_tokens, request.max_tokens)

    def num_uncached_prompt_tokens(self, request: Request) -> int:
        """Prompt tokens a prefill here would compute now: those not in the device prefix
        cache (KV tiers are not asked: a lookup there may cost a round trip)."""
        _, num_hit = self.kv.get_computed_blocks(request)
        return request.num_prompt_tokens - num_hit

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> None:
        """End requests from outside a step (abort, a stop string). Unknown ids are ignored."""
        assert status.is_finished
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is None or request.status.is_finished:
                continue
            self._leave_queues(request)
            request.status = status
            self._free_request(request)

    def _leave_queues(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    # ---- a model step that raised --------------------------------------------------------
    def quarantine(self, scheduled: dict[str, int], error: str) -> None:
        """The step that ran these requests (id -> tokens it computed) raised: the KV it was to
        write is not in their blocks, so those blocks leave the prefix cache (they were cached
        when allocated), and any other request already holding one (a prefix hit taken in the
        same plan) is recomputed too. Alone in the step, a request fails with the error; with
        others, each is recomputed from scratch (its blocks freed, as a preemption) and runs
        alone until it has passed the failed step's tokens, so a second failure names the
        request that causes it. One quarantined MAX_QUARANTINES times without failing alone (a
        fault that needs company) fails too: the quarantine always ends."""
        unwritten: set[int] = set()
        for req_id, num_tokens in scheduled.items():
            request = self.requests.get(req_id)
            if request is not None and not request.status.is_finished:
                first = (request.num_computed_tokens - num_tokens) // self.kv.block_size
                unwritten |= {b.block_id for b in self.kv.req_to_blocks.get(req_id, [])[first:]}
                self.kv.invalidate(request, first)
        for req_id, num_tokens in scheduled.items():
            request = self.requests.get(req_id)
            if request is None or request.status.is_finished:
                continue
            request.num_quarantines += 1
            self._leave_queues(request)
            if len(scheduled) == 1 or request.num_quarantines > MAX_QUARANTINES:
                self._finish_with_error(request, error)
                continue
            request.suspect = True
            request.suspect_until = max(request.suspect_until, request.num_computed_tokens)
            self._recompute(request)
        for request in list(self.requests.values()):  # holders outside the step
            if request.request_id not in scheduled and any(
                    b.block_id in unwritten for b in self.kv.req_to_blocks.get(request.request_id, [])):
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                    request.stale_prefix = True  # its load lands in its own blocks: recomputed on arrival
                else:
                    self._leave_queues(request)
                    self._recompute(request)

    def _recompute(self, request: Request) -> None:
        """Back to the front of the queue with nothing computed (a preemption, for a reason
        other than memory)."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._finished_req_ids.add(request.request_id)
        self.waiting.appendleft(request)

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step.

        Liveness invariant: every request that holds blocks is running, loading its KV
        (WAITING_FOR_REMOTE_KV, resolved by the worker before a deadline) or *parked* (its
        KV arrived; it waits to run). All three count against ``max_num_seqs``. Parked
        requests are scheduled before anything else in the queue and are the first victims
        of preemption, so blocks can never all sit with requests that will not run: as long
        as a request fits the pool alone, some request makes progress.
        """
        # A request in a step that raised runs alone until a step of its own succeeds (it needs
        # blocks: while it cannot get them, the others run without it).
        suspect = next((r for r in (*self.running, *self.waiting) if r.suspect), None)
        if suspect is None:
            num_scheduled, new_reqs, cached = self._plan(lambda r: True)
        else:
            num_scheduled, new_reqs, cached = self._plan(lambda r: r is suspect)
            if not num_scheduled:
                # The suspect waits (for blocks, or its turn): what already holds blocks goes
                # on, nothing new is admitted ahead of it.
                num_scheduled, new_reqs, cached = self._plan(
                    lambda r: not r.suspect and (r.status == RequestStatus.RUNNING or self._is_parked(r)))

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
        )
        output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self._finished_req_ids = set()
        # Advance the counters now so the next step can be planned before results return.
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            if request.trace is not None:
                _trace_scheduled(request, n)
            request.num_computed_tokens += n
        self._add_grammar_bitmask(output)
        return output

    def _plan(self, eligible) -> tuple[dict[str, int], list[NewRequestData], CachedRequestData]:
        """The step's requests among those ``eligible`` (the others keep their places and blocks,
        but may be preempted for room)."""
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted = False

        # 1. Running requests, oldest first; preempt (parked requests, then the newest
        # running one) when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not eligible(request):
                i += 1
                continue
            num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens, budget)
            new_block_ids = self.kv.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self._newest_parked() or self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_block_ids)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            i += 1

        # 2. Waiting requests: parked ones first (they already hold blocks), then the rest in
        # order while there is room. Not after a preemption: the preempted requests are at
        # the front of the queue and the pool is full anyway.
        if not preempted:
            num_holding = len(self.running) + sum(self._holds_blocks(r) for r in self.waiting)
            for request in sorted(self.waiting, key=lambda r: not self._is_parked(r)):  # stable
                if budget <= 0:
                    break
                if not eligible(request):
                    continue
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KV or self._follows_a_load(request):
                    continue
                if request.grammar is not None and not request.grammar.ready():
                    continue  # its grammar is still compiling: the requests behind it go first
                if request.grammar is not None and request.grammar.error is not None:
                    self._finish_with_error(request, request.grammar.error)
                    continue
                parked = self._is_parked(request)
                if not parked and num_holding >= self.max_num_seqs:
                    break
                outcome, num_new = self._admit(request, budget, parked)
                if outcome is Admission.NO_MEMORY:
                    if parked:
                        continue  # other parked requests may still fit; the queue head waits
                    break  # never jump the queue
                num_holding += not parked and outcome in (Admission.SCHEDULED, Admission.LOADING)
                if outcome is Admission.SCHEDULED:
                    self.running.append(request)
                    num_scheduled[request.request_id] = num_new
                    budget -= num_new
                    new_reqs.append(NewRequestData(
                        request.request_id, request.prompt_token_ids, list(request.output_token_ids),
                        request.sampling_params, self.kv.get_block_ids(request.request_id),
                        request.num_computed_tokens))
            # Admitted and ended requests leave the queue; everything else keeps its place.
            self.waiting = deque(r for r in self.waiting if r.status in (
                RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.PREEMPTED))

        return num_scheduled, new_reqs, cached

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """One bitmask row per request that samples this step under a grammar: its tokens
        are all computed once the step ran."""
        sampling = [self.requests[r] for r in output.num_scheduled_tokens]
        constrained = [r for r in sampling if r.grammar is not None and r.num_computed_tokens == r.num_tokens]
        if constrained:
            output.grammar_req_ids = [r.request_id for r in constrained]
            output.grammar_bitmask = build_bitmask([r.grammar for r in constrained], self.vocab_size)

    def _admit(self, request: Request, budget: int, parked: bool) -> tuple[Admission, int]:
        """Allocate a waiting request's blocks: for its prefix hit, for KV the connector can
        supply, and for up to ``budget`` tokens to compute now. One request's contents (its
        KV transfer parameters, say) can only fail that request, never the step."""
        if parked:
            # Its KV arrived: the blocks are allocated and the counter advanced.
            computed_blocks, num_local, num_external, load_async = [], request.num_computed_tokens, 0, False
        else:
            computed_blocks, num_local = self.kv.get_computed_blocks(request)
            try:
                # prompt_logprobs: every prompt position computed here, none loaded from a tier
                match = ((0, False) if request.sampling_params.prompt_logprobs is not None
                         else self.connector.get_num_new_matched_tokens(request, num_local))
            except Exception as exc:
                return self._fail_admission(request, exc), 0
            if match is None:
                return Admission.ASK_AGAIN, 0
            num_external, load_async = match
        num_computed = num_local + num_external
        num_new = 0 if load_async else self._chunk(request, request.num_tokens - num_computed, budget)
        new_block_ids = self.kv.allocate_slots(request, num_new, computed_blocks, num_external,
                                               delay_caching=load_async)
        if new_block_ids is None:
            if parked:
                # Parked requests may stand in each other's way (all blocks parked, nothing
                # running): make room from the newest other one.
                victim = self._newest_parked(besides=request)
                if victim is not None:
                    self._preempt(victim)
                    return self._admit(request, budget, parked)
            return Admission.NO_MEMORY, 0
        try:
            self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id),
                                                    num_local, num_external)
        except Exception as exc:
            return self._fail_admission(request, exc), 0
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_computed
            self.kv.record_prefix_stats(request, num_local)
            if request.trace is not None and request.trace.admitted is None:
                request.trace.admitted = time.monotonic()
                request.trace.cached_tokens, request.trace.external_tokens = num_local, num_external
        request.num_computed_tokens = num_computed
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
            logger.debug("request %s: WAITING_FOR_REMOTE_KV (%d tokens to load, %d local)", request.request_id,
                         num_external, num_local)
            return Admission.LOADING, 0
        request.status = RequestStatus.RUNNING
        logger.debug("request %s: RUNNING (%d of %d tokens computed)", request.request_id, num_computed,
                     request.num_tokens)
        if request.queue_time is None:
            request.scheduled_at = time.monotonic()
            request.queue_time = request.scheduled_at - request.arrival_time
        return Admission.SCHEDULED, num_new

    def _chunk(self, request: Request, num_uncomputed: int, budget: int) -> int:
        """Tokens to compute this step: all that fit the budget, but a prefill's chunk no more
        than long_prefill_token_threshold (not a preempted request's recompute: it held the
        pool once and should free it soon)."""
        limit = self.long_prefill_token_threshold
        if not limit or num_uncomputed <= 1 or request.num_preemptions:
            limit = num_uncomputed
        return min(num_uncomputed, budget, limit)

    def _fail_admission(self, request: Request, exc: Exception) -> Admission:
        logger.exception("request %s: the KV connector failed on it; ending it", request.request_id)
        self._finish_with_error(request, f"KV connector error: {type(exc).__name__}: {exc}")
        return Admission.FAILED

    def _finish_with_error(self, request: Request, error: str) -> None:
        request.status = RequestStatus.FINISHED_ERROR
        request.error = error
        self._free_request(request)
        trace = _trace_sampled(request, request.status) if request.trace is not None else None
        self._pending_outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="error",
                                                      error=error, trace=trace))

    def _is_parked(self, request: Request) -> bool:
        """Waiting to run with blocks already allocated: its KV arrived from outside."""
        return request.status == RequestStatus.WAITING and request.request_id in self.kv.req_to_blocks

    def _holds_blocks(self, request: Request) -> bool:
        return request.status == RequestStatus.WAITING_FOR_REMOTE_KV or self._is_parked(request)

    def _newest_parked(self, besides: Request | None = None) -> Request | None:
        return next((r for r in reversed(self.waiting) if r is not besides and self._is_parked(r)), None)

    def _follows_a_load(self, request: Request) -> bool:
        """One of n samples whose sibling pulls the shared prompt's KV: it waits until that KV
        arrived (then hits the prefix cache) instead of computing or pulling it again."""
        leader = self.requests.get(request.kv_leader) if request.kv_leader else None
        return leader is not None and (leader.status == RequestStatus.WAITING_FOR_REMOTE_KV or (
            leader.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and leader.num_cached_tokens is None))

    def _preempt(self, request: Request) -> None:
        """Recompute-based preemption: free everything; a running request goes back to the
        front of the queue, a parked one keeps its place (its KV stays in the prefix cache)."""
        self.kv.free(request)
        was_running = request.status == RequestStatus.RUNNING
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._finished_req_ids.add(request.request_id)
        if was_running:
            self.waiting.appendleft(request)
        logger.warning("preempted request %s (total preemptions: %d); KV pool too small for the running set",
                       request.request_id, self.stats.num_preemptions)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        finished_ids: set[str] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is not None and request.suspect and request.num_computed_tokens >= request.suspect_until:
                # Alone, it ran past the tokens of the step that failed: not the cause.
                request.suspect, request.num_quarantines = False, 0
            token = runner_output.sampled_token_ids.get(req_id)
            if request is not None and req_id in runner_output.prompt_logprobs:
                request.record_prompt_logprobs(*runner_output.prompt_logprobs[req_id])
            error = runner_output.failed.get(req_id)
            if error is not None and request is not None and request.status == RequestStatus.RUNNING:
                # It sampled nothing (its logits were not finite): it ends, the others go on.
                logger.warning("request %s: %s", req_id, error)
                request.status, request.error = RequestStatus.FINISHED_ERROR, error
                finished_ids.add(req_id)
                self._free_request(request)
                outputs.append(EngineCoreOutput(req_id, [], finish_reason="error", error=error))
                continue
            if request is None or request.status != RequestStatus.RUNNING or token is None:
                continue  # ended during the step, or still in the middle of its prefill
            request.append_output_token_id(token)
            status = request.check_stop(self.max_model_len)
            trace = None
            if request.trace is not None:
                trace = _trace_sampled(request, status)
            kv_transfer_params = None
            if status is not None:
                request.status = status
                finished_ids.add(req_id)
                kv_transfer_params = self._free_request(request)
            logprobs = runner_output.logprobs.get(req_id)
            outputs.append(EngineCoreOutput(
                req_id, [token], [logprobs] if logprobs is not None else None,
                finish_reason=status.finish_reason if status else None,
                stop_reason=request.stop_reason, num_cached_tokens=request.num_cached_tokens or 0,
                kv_transfer_params=kv_transfer_params, queue_time=request.queue_time,
                scheduled_at=request.scheduled_at,
                prompt_logprobs=request.take_prompt_logprobs(), trace=trace))
        if finished_ids:
            self.running = [r for r in self.running if r.request_id not in finished_ids]
        outputs += self._update_transfers(runner_output)
        return outputs

    def _update_transfers(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply what the connector's worker half finished: sends release held blocks; loads
        make their request runnable, or (on failure) recompute or fail it."""
        kv_out = runner_output.kv_connector_output
        self.connector.update_connector_output(kv_out)
        for req_id, load in kv_out.load_traces.items():
            request = self.requests.get(req_id)
            if request is not None and request.trace is not None:
                request.trace.loads.append(load)
        outputs = []
        for req_id in kv_out.finished_sending:
            self.connector.send_done(req_id)
            request = self.held.pop(req_id, None)
            if request is not None:
                logger.debug("request %s: KV transfer done, held blocks freed", req_id)
                self.kv.free(request)
        for req_id in kv_out.finished_recving | kv_out.failed_recving:
            failed = req_id in kv_out.failed_recving
            self.connector.transfer_done(req_id, failed)
            held = self.held.pop(req_id, None)
            if held is not None:
                # Ended while its load was in flight: the blocks are safe to reuse only now.
                self.kv.free(held)
                continue
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
                continue
            request.status = RequestStatus.WAITING
            if request.stale_prefix:  # a prefix hit on blocks a failed step never wrote
                request.stale_prefix = False
                self._leave_queues(request)
                self._recompute(request)
                continue
            if not failed:
                self.kv.cache_blocks(request, request.num_computed_tokens)
                logger.debug("request %s: KV arrived, WAITING to run", req_id)
                continue
            self.stats.num_kv_load_failures += 1
            # Never decode over blocks that were not filled: drop them all.
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.num_cached_tokens = None  # nothing came: counted again at its next admission
            reason = kv_out.failure_reasons.get(req_id, "KV load failed")
            if self.connector.load_failure_policy == "recompute":
                logger.warning("KV load for %s failed (%s); recomputing the prefill locally", req_id, reason)
                continue
            # Policy fail: the whole request fails, its n samples waiting on this load too
            # (they would otherwise recompute and answer as if nothing happened).
            followers = [r for r in self.waiting if r.kv_leader == req_id]
            for failing in [request, *followers]:
                self.waiting.remove(failing)
                failing.status = RequestStatus.FINISHED_ERROR
                failing.error = f"{KV_LOAD_FAILED}: {reason}"
                self._free_request(failing)
                outputs.append(EngineCoreOutput(failing.request_id, [], finish_reason="error", error=failing.error))
        return outputs

    def _free_request(self, request: Request) -> KVTransferParams | None:
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        try:
            hold, params = self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
        except Exception:  # one request's state must never stop the step: free it, hand back nothing
            logger.exception("request %s: the KV connector failed while ending it", request.request_id)
            hold, params = False, None
        logger.debug("request %s: %s%s", request.request_id, request.status.name,
                     ", blocks held for a KV transfer" if hold else "")
        if hold:
            self.held[request.request_id] = request
        else:
            self.kv.free(request)
        return params

    # ---- introspection -----------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        # Held requests count: steps must keep running until their transfers report back; so
        # does connector work that only the next step's metadata delivers.
        return (bool(self.requests) or bool(self._pending_outputs) or bool(self.held)
                or self.connector.has_pending_metadata())

    def withdraw_kv(self, req_id: str) -> None:
        """Nobody will pull the KV this request offers (a router released it, or it was aborted):
        it is freed as soon as the worker lets go."""
        request = self.held.get(req_id)
        if request is not None and not self.connector.withdraw(req_id):
            del self.held[req_id]
            self.kv.free(request)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def is_id_in_use(self, req_id: str) -> bool:
        return req_id in self.requests or req_id in self.held or req_id in self.kv.req_to_blocks

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KV for r in self.waiting)


# ---- a traced request's phases (engine/request_trace.py; only where request.trace is set) ----
def _trace_scheduled(request: Request, num_tokens: int) -> None:
    """It runs ``num_tokens`` tokens this step, from its current num_computed_tokens."""
    trace = request.trace
    if trace.scheduled is None:
        trace.scheduled = time.monotonic()
    computed = request.num_computed_tokens
    if computed < request.num_prompt_tokens:
        trace.prefill_chunks += 1
        trace.prefill_tokens += min(num_tokens, request.num_prompt_tokens - computed)


def _trace_sampled(request: Request, status: RequestStatus | None):
    """A token was sampled (or the request ended): the copy of its trace to send now, if this is
    its first token here or its end, else None."""
    trace = request.trace
    now = time.monotonic()
    first = trace.first_token is None and status != RequestStatus.FINISHED_ERROR
    if first:
        trace.first_token = now
    if status is not None:
        trace.finished, trace.finish_reason = now, status.finish_reason
    if not first and status is None:
        return None
    return snapshot(trace, request.num_output_tokens, request.num_preemptions)
