"""The only types that cross between scheduler, worker, engine core, front end and user. No
Request objects and no device tensors cross the scheduler/worker boundary: one dataclass each way."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from engine.kv_transfer.params import KVTransferParams
from engine.request_trace import KVLoadTrace, SequenceTrace
from engine.sampling_params import SamplingParams

# (token_id, logprob, rank) with the sampled token first, then the top-k.
TokenLogprobs = list[tuple[int, float, int]]


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has no state for: first schedule, or resumed after preemption."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """Requests the worker already knows: only what changed (column lists)."""
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step, starting at the request's num_computed_tokens.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose worker state must be dropped before this step (finished or preempted).
    finished_req_ids: set[str]
    kv_connector_metadata: Any = None
    # Structured output: the requests that sample this step under a grammar, and one int32
    # bitmask row each (bit i of a row = token i allowed), in the same order.
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None


@dataclass(slots=True)
class KVConnectorStats:
    """A connector worker's counters, read after every step's transfers: totals since start,
    except the durations (transfer_seconds, each store's load_seconds), which are since the
    previous reading."""
    transfer_bytes: int = 0
    transfer_failures: dict[str, int] = field(default_factory=dict)  # load failures by reason
    transfer_seconds: list[float] = field(default_factory=list)
    auth_failures: dict[str, int] = field(default_factory=dict)  # messages the KV server refused, by reason
    # Per KV store tier: hits, misses, bytes_stored, bytes_loaded, used_bytes, load_seconds, rejected.
    stores: dict[str, dict] = field(default_factory=dict)
    # Per producer (its KV address), totals since start: pulls (those that timed out included, also
    # counted in timeouts), tokens, bytes (of the pulls that completed), seconds.
    pulls: dict[str, dict] = field(default_factory=dict)


@dataclass(slots=True)
class KVConnectorOutput:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    failure_reasons: dict[str, str] = field(default_factory=dict)
    # Store lookups answered since the last step: request id -> (how many consecutive chunks,
    # from the first one asked, some tier holds; blocks of the longest trailing chunk found
    # after them, 0 if none). The worker pinned them for the request.
    lookups: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Where each chunk a lookup found is (the fastest tier holding it), in the order of the
    # chunks: the full ones, then the trailing one. Read by the load-or-recompute decision.
    lookup_sources: dict[str, list[str]] = field(default_factory=dict)
    # Transfers timed since the last step: (source, bytes, seconds), source a tier's name or
    # "peer:<address>"; loads, and writes to a tier (the same link), feed its rate estimate.
    transfer_samples: list[tuple[str, int, float]] = field(default_factory=list)
    # What entered and left the CPU and disk tiers (KV events; kv_transfer/tier_events.py).
    kv_events: list = field(default_factory=list)
    # What each load that ended took (bytes, seconds, peer or tiers, outcome): for request traces.
    load_traces: dict[str, KVLoadTrace] = field(default_factory=dict)
    stats: KVConnectorStats | None = None  # filled by the model runner, after the above


@dataclass(slots=True)
class ModelRunnerOutput:
    # One token per request that reached the end of its known tokens this step; requests in
    # the middle of a chunked prefill are absent.
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Requests that asked for prompt_logprobs and computed prompt positions this step: (the
    # index of the first prompt token these entries are for, one entry per token).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput = field(default_factory=KVConnectorOutput)
    # Requests that sampled nothing this step and end with this error (their logits were not
    # finite: engine/worker/sampler.py); the others in the step go on.
    failed: dict[str, str] = field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """What one step produced for one sequence: the engine core's whole answer (text is the
    front end's), sent as is from the engine-core process to the API server's."""
    req_id: str  # the sequence (engine/request_ids.py)
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    queue_time: float | None = None  # seconds from the core's admission to the first schedule
    scheduled_at: float | None = None  # when that first schedule was (the core's time.monotonic())
    from_prefill: bool = False  # a first token a prefill instance sampled (engine/kv_transfer/first_token.py)
    # With the first sampled token, where asked: per prompt token (None for the first) its entries.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A traced request's way through the scheduler (engine/request_trace.py): with its first
    # token sampled here and with its end.
    trace: SequenceTrace | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # For logprobs' text_offset: the characters of the sampled token strings before this
    # output's first token (0 for a final output). On a decode instance whose client was shown a
    # prefill's first tokens, its deltas start past them, as on a single instance.
    text_offset: int = 0
    # Of a delta's token_ids, how many lead ones the client was shown already (that first token).
    token_ids_shown: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    queue_time: float | None = None
    # SamplingParams.prompt_logprobs: per prompt token (None for the first) its logprob and the
    # top k at its position; in a stream, only in the first output that has them.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # A traced request's sequences' latest traces, by sequence index (engine/request_trace.py).
    traces: dict[int, SequenceTrace] | None = None
