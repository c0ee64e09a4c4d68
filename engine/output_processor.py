"""The front end's half of the engine (vLLM's OutputProcessor): turns the core's token ids into
what a client reads. Detokenization, stop strings, logprob tokens, the ``n`` sequences of a
request gathered into one output, streamed deltas or whole texts. It runs where the client is
(the API server's process, or beside the offline ``LLM``), so none of it holds up a step.

A stop string found here ends its sequence at once: ``process`` lists the sequences the core
must stop, and the text never shows what was sampled past the stop. One request's failure here
(a tokenizer raising) ends that request with an error; the others go on.

It also measures each sequence as vLLM's front end does (vllm/v1/metrics/stats.py: IterationStats,
FinishedRequestStats): time to first token and end-to-end latency from the request's arrival at
the API server, on this process's clock; inter-token gaps and the queue, prefill and decode phases
on the core's timestamps; token counts of the sequences it still serves. entrypoints/metrics.py
exports them (one measurement, both the engine's and vLLM's metric names).
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.kv_transfer.first_token import without_first_tokens
from engine.kv_transfer.params import KVTransferParams
from engine.kv_transfer.secret import KVSecret
from engine.outputs import CompletionOutput, EngineCoreOutput, Logprob, RequestOutput
from engine.request import RequestStatus
from engine.request_ids import sequence_id
from engine.request_trace import SequenceTrace
from engine.sampling_params import SamplingParams
from engine.stop_strings import StopStrings

logger = logging.getLogger("engine")

HANDED_OFF = RequestStatus.FINISHED_HANDED_OFF.finish_reason


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output carries the whole text so far
    DELTA = "delta"            # only what is new since the last output (streaming)
    FINAL_ONLY = "final"       # one output when the request is done


@dataclass
class _Sequence:
    """One of the n sequences of a request."""
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # Characters of the sampled tokens' strings whose logprobs went out (or were shown by a
    # proxy): where the next delta's logprobs text_offset starts. A function of the tokens
    # alone, so a decode instance's offsets continue a prefill's as a single instance's do.
    logprob_chars: int = 0
    reported_finish: bool = False  # its finish went out in a delta: later deltas leave it out
    # Leading ids of the next delta's token_ids that a proxy already showed (a prefill's first
    # token): counted in the usage, not shown again.
    token_ids_shown: int = 0
    # Timing (IterationStats): the core's timestamps of the first and the last token sampled
    # here (a prefill instance's first token, which a decode instance only passes on, is none),
    # and of the first schedule, with the seconds queued before it.
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_sampled: int = 0  # tokens sampled here
    scheduled_at: float | None = None
    queue_time: float | None = None

    @property
    def shown_finish_reason(self) -> str | None:
        """What a client is told: a sequence handed to another instance has not finished for it."""
        return None if self.finish_reason == HANDED_OFF else self.finish_reason


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: OutputKind
    sequences: dict[str, _Sequence]
    first_tokens_shown: bool
    arrival: float = 0.0  # time.monotonic() when the API server received it
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    queue_time: float | None = None
    # SamplingParams.prompt_logprobs, decoded, from the first sequence that brings them (each
    # of the n computes the same prompt); a stream sends them once.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    # A traced request's sequences' latest traces (engine/request_trace.py), by sequence index:
    # sent with each output that has a new one.
    traces: dict[int, SequenceTrace] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())


@dataclass(slots=True)
class FinishedStats:
    """One sequence at its end, measured as vLLM's FinishedRequestStats is. Phases are None where
    they never began (a sequence ended before it was scheduled, or before it sampled a token)."""
    finish_reason: str  # stop, length, abort, error, or handed_off (a prefill instance's hand-off)
    e2e: float  # arrival at the API server to its end, on the API server's clock
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float | None = None  # the core's admission to the first schedule (vLLM's WAITING)
    prefill_time: float | None = None  # the first schedule to the first token sampled here
    decode_time: float | None = None  # the first to the last token sampled here
    inference_time: float | None = None  # the first schedule to the last token (vLLM's RUNNING)
    # decode_time per token after the first sampled here (vLLM's mean_time_per_output_token)
    time_per_output_token: float | None = None
    client_abort: bool = False  # the client left before it ended: vLLM counts no such request


@dataclass(slots=True)
class IterationStats:
    """What one batch of the core's outputs (or a client leaving) measured (vLLM's IterationStats)."""
    ttfts: list[float] = field(default_factory=list)  # sequences that got their first token here
    itls: list[float] = field(default_factory=list)  # one gap per output after a sequence's first
    prompt_tokens: int = 0  # prompts of the sequences that got their first output (vLLM: at prefill)
    generation_tokens: int = 0  # tokens of the sequences still served (none past a stop string)
    finished: list[FinishedStats] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.ttfts or self.itls or self.prompt_tokens or self.generation_tokens or self.finished)


@dataclass(slots=True)
class Processed:
    outputs: list[RequestOutput]
    stop: list[str]      # sequences a stop string ended: the core stops them
    abort: list[str]     # sequences whose output could not be processed: the core aborts them
    stats: IterationStats = field(default_factory=IterationStats)


class OutputProcessor:
    def __init__(self, tokenizer, kv_secret: KVSecret | None = None) -> None:
        # The fast tokenizer's backend, shared with the thread that encodes prompts: safe as
        # engine.tokenizer_loading loaded it (nothing mutates it after the load).
        self.tokenizer: Tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
        self.kv_secret = kv_secret
        self._requests: dict[str, _Request] = {}
        self._request_of: dict[str, str] = {}  # sequence id -> request id
        self._token_texts: dict[int, str] = {}  # _token_text

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    kind: OutputKind, first_tokens_shown: bool = False, arrival: float | None = None) -> None:
        """``first_tokens_shown``: the client was already shown the first tokens a prefill
        instance sampled (as far as the stop strings allowed), so the deltas go on after them.
        ``arrival``: time.monotonic() when the request arrived (default: now), where its time to
        first token and end-to-end latency start.
        Raises InvalidRequestError when the id, or one of its sequence ids, is in use (a client's
        id "0_x" is sequence 0 of "x" with n > 1): nothing is registered then."""
        seq_ids = [sequence_id(request_id, index, params.n) for index in range(params.n)]
        taken = [s for s in [request_id, *seq_ids] if s in self._requests or s in self._request_of]
        if taken:
            raise InvalidRequestError(f"request id {request_id!r} is in use (as {taken[0]!r}); use a new id",
                                      "request_id")
        sequences = {}  # built whole before anything is registered: a failure leaves nothing
        stops = StopStrings(params.stop) if params.stop else None  # one automaton for the n sequences
        for index in range(params.n):
            seq_id = sequence_id(request_id, index, params.n)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params, stops)
            sequences[seq_id] = _Sequence(index, detok,
                                          logprobs=[] if params.logprobs is not None else None,
                                          cumulative_logprob=0.0 if params.logprobs is not None else None)
        for seq_id in sequences:
            self._request_of[seq_id] = request_id
        self._requests[request_id] = _Request(request_id, prompt, list(prompt_token_ids), kind, sequences,
                                              first_tokens_shown, time.monotonic() if arrival is None else arrival)

    def abort(self, request_id: str, client_left: bool = False) -> IterationStats:
        """Forget a request. ``client_left``: its client went away before it ended; the sequences
        still open end as aborted by the client in the stats returned (empty otherwise)."""
        stats = IterationStats()
        request = self._requests.pop(request_id, None)
        if request is not None:
            for seq_id in request.sequences:
                self._request_of.pop(seq_id, None)
            if client_left:
                now = time.monotonic()
                stats.finished = [self._finished_stats(request, seq, now, "abort", client_abort=True)
                                  for seq in request.sequences.values() if seq.finish_reason is None]
        return stats

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def num_tracked_requests(self) -> int:
        return len(self._requests) + len(self._request_of)

    def process(self, core_outputs: list[EngineCoreOutput], timestamp: float | None = None) -> Processed:
        """``timestamp``: the core's time.monotonic() when it made these outputs (default: now)."""
        result = Processed([], [], [])
        touched: dict[str, _Request] = {}
        now = time.monotonic()
        timestamp = timestamp or now
        for out in core_outputs:
            request_id = self._request_of.get(out.req_id)
            request = self._requests.get(request_id) if request_id is not None else None
            if request is None:
                continue  # aborted meanwhile
            seq = request.sequences[out.req_id]
            if seq.finish_reason is not None:
                continue  # a stop string ended it; the core had sampled on
            self._measure(request, seq, out, timestamp, now, result.stats)
            try:
                if self._apply(request, seq, out):
                    result.stop.append(out.req_id)
            except Exception as exc:  # one request's output (detokenizing, say) never stops the others
                logger.exception("request %s: processing its output failed; ending it", out.req_id)
                seq.finish_reason, request.error = "error", f"output processing failed: {type(exc).__name__}: {exc}"
                result.abort.append(out.req_id)
            if seq.finish_reason is not None:
                result.stats.finished.append(self._finished_stats(request, seq, now))
            touched[request.request_id] = request
        for request in touched.values():
            finished = request.finished
            if finished:
                self._settle_hand_off(request)
            if request.kind is not OutputKind.FINAL_ONLY or finished:
                result.outputs.append(self._make_output(request, finished))
            if finished:
                self.abort(request.request_id)
        return result

    @staticmethod
    def _measure(request: _Request, seq: _Sequence, out: EngineCoreOutput, timestamp: float, now: float,
                 stats: IterationStats) -> None:
        """vLLM's IterationStats.update_from_output for one live sequence's output."""
        if seq.scheduled_at is None and out.scheduled_at is not None:
            seq.scheduled_at, seq.queue_time = out.scheduled_at, out.queue_time
        if not out.new_token_ids:
            return
        if not seq.token_ids:  # its first output: the prompt is done (computed, found, or pulled)
            stats.prompt_tokens += len(request.prompt_token_ids)
        stats.generation_tokens += len(out.new_token_ids)
        if out.from_prefill:
            return  # sampled by the prefill instance: its time is that instance's
        if seq.first_token_at is None:
            seq.first_token_at = timestamp
            stats.ttfts.append(now - request.arrival)
        else:
            stats.itls.append(timestamp - seq.last_token_at)
        seq.last_token_at = timestamp
        seq.num_sampled += len(out.new_token_ids)

    @staticmethod
    def _finished_stats(request: _Request, seq: _Sequence, now: float, reason: str | None = None,
                        client_abort: bool = False) -> FinishedStats:
        """vLLM's IterationStats.update_from_finished_request for one sequence."""
        first, last, scheduled = seq.first_token_at, seq.last_token_at, seq.scheduled_at
        decode = None if first is None else last - first
        return FinishedStats(
            reason or seq.finish_reason, now - request.arrival, len(request.prompt_token_ids), len(seq.token_ids),
            queue_time=seq.queue_time,
            prefill_time=None if first is None or scheduled is None else first - scheduled,
            decode_time=decode,
            inference_time=None if last is None or scheduled is None else last - scheduled,
            time_per_output_token=None if decode is None else decode / (seq.num_sampled - 1) if seq.num_sampled > 1
            else 0.0,
            client_abort=client_abort)

    def _apply(self, request: _Request, seq: _Sequence, out: EngineCoreOutput) -> bool:
        """Take one sequence's new tokens; returns whether a stop string ended it here."""
        request.num_cached_tokens = max(request.num_cached_tokens, out.num_cached_tokens)
        if out.kv_transfer_params is not None:
            request.kv_transfer_params = out.kv_transfer_params
        if out.error is not None:
            request.error = out.error
        if request.queue_time is None:
            request.queue_time = out.queue_time
        if out.trace is not None:
            request.traces = {**(request.traces or {}), seq.index: out.trace}
        if out.prompt_logprobs is not None and request.prompt_logprobs is None:
            request.prompt_logprobs = [None if e is None else self._decoded(e) for e in out.prompt_logprobs]
        seq.token_ids.extend(out.new_token_ids)
        seq.new_token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and seq.logprobs is not None:
            for entries in out.new_logprobs:
                decoded = self._decoded(entries)
                seq.logprobs.append(decoded)
                seq.new_logprobs.append(decoded)
                seq.cumulative_logprob += entries[0][1]
        matched = seq.detok.update(out.new_token_ids)
        stops = matched is not None and out.finish_reason not in ("abort", "error")
        if out.from_prefill and request.first_tokens_shown and not stops and out.finish_reason is None:
            # The client saw this token's text (the prefill instance's answer, shown by the proxy):
            # the deltas go on after it. It still counts in the usage. A sequence that ends with
            # its first token was not shown (the proxy shows only those that go on, as the
            # prefill's answer left them open): it goes out whole from here.
            seq.detok.next_delta(False)
            seq.logprob_chars += _sampled_chars(seq.new_logprobs)
            seq.new_logprobs.clear()
            seq.token_ids_shown = len(seq.new_token_ids)
        if stops:
            # A stop string ends the sequence here (also when the same token reached max_tokens
            # or was EOS: the stop string is why the text ends).
            seq.finish_reason, seq.stop_reason = "stop", matched
            return out.finish_reason is None or out.finish_reason == HANDED_OFF
        if out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _decoded(self, entries: list[tuple[int, float, int]]) -> dict[int, Logprob]:
        return {tid: Logprob(lp, rank, self._token_text(tid)) for tid, lp, rank in entries}

    def _token_text(self, token_id: int) -> str:
        """One token's string, decoded once (a prompt's logprobs name prompt × (k + 1) tokens,
        mostly the same few; at most the vocabulary is kept)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _settle_hand_off(self, request: _Request) -> None:
        """A prefill instance's request whose first tokens all ended their sequences here (stop
        strings the core cannot see): the answer is final; the KV stays on offer (as the core
        leaves it when max_tokens or EOS ends the answer) and the parameters lose the first
        tokens, which a decode instance given the client's own request samples itself."""
        params = request.kv_transfer_params
        offers = params is not None and (params.do_remote_prefill or params.kv_store_tokens > 0)
        if not offers or params.first_token_ids is None:
            return
        if any(s.finish_reason == HANDED_OFF for s in request.sequences.values()):
            return
        request.kv_transfer_params = without_first_tokens(params, self.kv_secret)

    def _make_output(self, request: _Request, finished: bool) -> RequestOutput:
        outputs = []
        delta = request.kind is OutputKind.DELTA
        for seq in request.sequences.values():
            reason = seq.shown_finish_reason
            if delta and seq.reported_finish:
                continue
            offset = seq.logprob_chars if delta else 0
            delta_text = seq.detok.next_delta(reason is not None)
            text = delta_text if delta else seq.detok.sent_text
            if delta and len(seq.new_token_ids) == seq.token_ids_shown and not text and reason is None:
                # Nothing the client has not seen: no new tokens, or only first tokens a proxy showed
                # (they go with the next delta, counted there; a single instance's stream has no
                # such chunk either).
                continue
            seq.reported_finish = reason is not None
            outputs.append(CompletionOutput(
                seq.index, text, list(seq.new_token_ids if delta else seq.token_ids), reason, seq.stop_reason,
                list(seq.new_logprobs) if delta and seq.logprobs is not None else seq.logprobs,
                seq.cumulative_logprob, offset, seq.token_ids_shown if delta else 0))
            seq.token_ids_shown = 0
            if delta:
                seq.logprob_chars += _sampled_chars(seq.new_logprobs)
            seq.new_token_ids.clear()
            seq.new_logprobs.clear()
        kv = request.kv_transfer_params if finished else None
        prompt_logprobs = None if delta and request.prompt_logprobs_sent else request.prompt_logprobs
        request.prompt_logprobs_sent = request.prompt_logprobs_sent or prompt_logprobs is not None
        traces, request.traces = request.traces, None
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, finished,
                             request.num_cached_tokens, kv, request.error, request.queue_time, prompt_logprobs,
                             traces)


def _sampled_chars(logprobs: list[dict[int, Logprob]]) -> int:
    """Characters of the sampled tokens' strings in these logprob entries (one per token; each
    entry's first item is its sampled token, as the engine sends them)."""
    return sum(len(next(iter(entries.values())).decoded_token) for entries in logprobs if entries)
