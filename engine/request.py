"""A request as the scheduler sees it: token ids, one computed-token counter, block hashes."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Callable

from engine.kv_transfer.params import KVTransferParams
from engine.request_trace import SequenceTrace
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    """Ordered: everything after PREEMPTED is finished."""
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    # Its first token is sampled and the prompt's KV is offered: another instance continues it.
    FINISHED_HANDED_OFF = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_HANDED_OFF: "handed_off",  # never shown to a client: not finished for it
}


class Request:
    """Scheduler-side state of one sequence. Never crosses to the worker.

    Invariant: ``num_computed_tokens <= num_tokens``; the request is done computing its
    prompt once the counter reaches ``num_prompt_tokens``. Chunked prefill, prefix hits,
    loaded KV and preemption are all edits of that one counter.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        max_tokens: int,
        block_hasher: Callable[["Request"], None] | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        kv_leader: str | None = None,
        hands_off: bool = False,
        grammar: RequestGrammar | None = None,
        cache_salt: str | None = None,
        traced: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens  # resolved: never None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.kv_transfer_params = kv_transfer_params
        # Another of the same n samples that loads the shared prompt's KV: wait for it.
        self.kv_leader = kv_leader
        # A prefill instance's request (do_remote_decode): it ends after its first token unless
        # that token ends it anyway, and a decode instance continues it.
        self.hands_off = hands_off
        # Structured output: every appended token advances it; the scheduler fills its bitmask row.
        self.grammar = grammar
        # Tenant isolation: its block hashes descend from a root of this salt's own (block_pool.py).
        self.cache_salt = cache_salt

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens served from a cache (device prefix cache or a connector) at first schedule.
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        # In a model step that raised with other requests: until a step runs it alone and
        # succeeds, it only runs alone (scheduler.quarantine), so a second failure names it.
        self.suspect = False
        self.suspect_until = 0  # ... through this many computed tokens (the failed step's end)
        self.num_quarantines = 0
        # Took a prefix hit on blocks a failed step never wrote while its KV load was in
        # flight: recomputed when the load lands.
        self.stale_prefix = False
        # Seconds from arrival (admission by the core) to the first schedule, and when that was
        # (time.monotonic()); a preemption's reschedule changes neither (vLLM's scheduled_ts).
        self.queue_time: float | None = None
        self.scheduled_at: float | None = None
        self.status = RequestStatus.WAITING
        # Only for a request the front end traces (engine/request_trace.py): the scheduler
        # records its phases here.
        self.trace: SequenceTrace | None = (
            SequenceTrace(self.arrival_time, prompt_tokens=self.num_prompt_tokens) if traced else None)
        self.stop_reason: int | str | None = None
        self.error: str | None = None

        # prompt_logprobs: per prompt token its entries (None for the first: nothing predicts it),
        # filled by position as the prompt is computed (again, identically, after a preemption)
        # and sent once, with the first sampled token (take_prompt_logprobs).
        self.prompt_logprobs: list | None = (
            [None] * self.num_prompt_tokens if sampling_params.prompt_logprobs is not None else None)

        self.block_hashes: list[bytes] = []
        # What the KV events name its full blocks by, when that is not block_hashes (vLLM's
        # hashes: engine/vllm_block_hash.py), and the last of them whole (the next one's parent).
        self.event_block_hashes: list[int] = []
        self.event_parent_hash: bytes | None = None
        self._block_hasher = block_hasher
        if block_hasher is not None:
            block_hasher(self)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def record_prompt_logprobs(self, first_token: int, entries: list) -> None:
        """Entries for prompt tokens first_token, first_token + 1, ..."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs[first_token:first_token + len(entries)] = entries

    def take_prompt_logprobs(self) -> list | None:
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self._block_hasher is not None:
            self._block_hasher(self)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last sampled token implies, or None to keep going."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.grammar is not None and last in self.eos_token_ids and self.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete: min_tokens and ignore_eos yield
        if self.num_output_tokens >= params.min_tokens:
            if last in self.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return RequestStatus.FINISHED_HANDED_OFF if self.hands_off else None
