"""LLMEngine: tokenizer + scheduler + model runner. A step is three calls:
schedule() -> execute_model() -> update_from_output(), then detokenization and stop strings."""
from __future__ import annotations

import enum
import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from transformers import AutoTokenizer

from engine.block_pool import BlockHasher, root_block_hash
from engine.config import EngineConfig
from engine.cpu_placement import apply_placement
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError, PrefillElsewhere
from engine.grammar import GrammarCompiler
from engine.kv_cache_manager import KVCacheManager
from engine.kv_transfer.base import NoOpConnectorWorker
from engine.kv_transfer.multi import MultiConnectorScheduler, MultiConnectorWorker
from engine.kv_transfer.p2p import P2PConnectorScheduler
from engine.kv_transfer.p2p_worker import STAGING_BYTES, P2PConnectorWorker
from engine.kv_transfer.params import (
    KVTransferParams,
    KVTransferParamsError,
    check_kv_transfer_params_signature,
    parse_kv_transfer_params,
    sign_kv_transfer_params,
    token_digest,
)
from engine.kv_transfer.stores import ChunkFormat, parse_store_spec
from engine.kv_transfer.tiered import TieredConnectorScheduler
from engine.kv_transfer.tiered_worker import TieredConnectorWorker, TieredStore
from engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    KVConnectorStats,
    Logprob,
    RequestOutput,
)
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.worker import loader
from engine.worker.backends import KV_LAYOUT
from engine.worker.model_runner import ModelRunner, resolve_device, resolve_dtype
from engine.worker.models import ModelConfig, model_config_from_hf

logger = logging.getLogger("engine")

MAX_REQUEST_ID_LEN = 256
MAX_KEPT_DURATIONS = 4096  # transfer and load durations kept for a reader that never drains (offline use)


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output carries the whole text so far
    DELTA = "delta"            # only what is new since the last output (streaming)
    FINAL_ONLY = "final"       # one output when the request is done


@dataclass
class _Child:
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
    first_entries: list | None = None  # the first token's raw logprob entries (for a hand-off)
    reported_finish: bool = False  # its finish went out in a delta: later deltas leave it out

    @property
    def shown_finish_reason(self) -> str | None:
        """What a client is told: a sequence handed to another instance has not finished for it."""
        return None if self.finish_reason == HANDED_OFF else self.finish_reason


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: OutputKind
    children: dict[str, _Child]
    arrival_time: float
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    queue_time: float | None = None
    hands_off: bool = False  # a prefill instance's request: its first tokens go to a decode instance

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


HANDED_OFF = RequestStatus.FINISHED_HANDED_OFF.finish_reason


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        apply_placement(config.cpu_cores, config.num_threads)
        model_dir = loader.resolve_model(config.model, config.revision, config.download_dir)
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(str(config.tokenizer or model_dir))
        hf_config = loader.load_hf_config(model_dir)
        self.eos_token_ids = self._eos_token_ids(hf_config, loader.load_generation_config(model_dir))
        model_config = model_config_from_hf(hf_config)
        model_max = model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len={config.max_model_len} is larger than the model's context of "
                             f"{model_max} tokens (max_position_embeddings; for a LongRoPE model, the original "
                             "context it is served up to)")
        self.max_model_len = config.max_model_len or model_max
        self.vocab_size = model_config.vocab_size

        transfer = config.kv_transfer_config
        uses_p2p = transfer is not None and transfer.kv_connector == "p2p"
        if transfer is not None and transfer.kv_connector not in (None, "p2p"):
            raise ValueError(f"unknown kv_connector {transfer.kv_connector!r}; available: p2p")
        dtype = resolve_dtype(config.dtype, resolve_device(config.device))
        # The KV layout is part of the fingerprint: peers and stores must agree on it byte for byte.
        # (Every attention backend shares it, so a CPU prefill and a flash-attn decode of the same
        # dtype are compatible.)
        self.fingerprint = f"{loader.model_fingerprint(model_dir)}:{dtype}:bs{config.block_size}:{KV_LAYOUT}"
        self.engine_id = uuid.uuid4().hex[:12]
        connector, connector_worker = None, NoOpConnectorWorker()
        if uses_p2p:
            port = transfer.kv_port if transfer.kv_role in ("kv_producer", "kv_both") else None
            if transfer.kv_role == "kv_producer" and port is None:
                raise ValueError("a KV producer (--role prefill) needs --kv-port")
            connector = P2PConnectorScheduler(transfer, self.engine_id, port and f"tcp://{transfer.kv_ip}:{port}",
                                              config.block_size)
            connector_worker = P2PConnectorWorker(self.engine_id, self.fingerprint, transfer.kv_ip, port,
                                                  secret=config.kv_secret,
                                                  encrypt=bool(transfer.extra.get("encrypt", False)))
        if config.kv_store:
            tiered, tiered_worker = self._tiered_connector(config, model_config, dtype)
            if connector is None:
                connector, connector_worker = tiered, tiered_worker
            else:  # P2P first; the tiers behind it (a decode falls back to them when a pull fails)
                connector = MultiConnectorScheduler([connector, tiered])
                connector_worker = MultiConnectorWorker([connector_worker, tiered_worker])
        self.runner = ModelRunner(config, model_dir, model_config, self.eos_token_ids, self.max_model_len,
                                  connector_worker, reserved_bytes=STAGING_BYTES if uses_p2p else 0)
        # The connector's latest counters, as the runner reported them with the last step (an
        # offline reader sees them as of its last generate; a server's idle core steps each second).
        self.kv_connector_stats = KVConnectorStats()
        if config.kv_store:  # every tier in the stats from the start, not only after the first step
            self.kv_connector_stats = tiered_worker.stats(read_used_bytes=False)
        self.block_hasher = BlockHasher(config.block_size, root_block_hash(self.fingerprint))
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.block_size,
                                               config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len, connector,
                                   vocab_size=self.vocab_size)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        pool_tokens = self.runner.num_blocks * config.block_size
        if pool_tokens < self.max_model_len:
            logger.warning("the KV pool holds %d tokens, less than max_model_len=%d: longer requests are "
                           "rejected", pool_tokens, self.max_model_len)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.runner.num_blocks, config.block_size,
                    self.runner.num_blocks * self.runner.bytes_per_block / 2**30)
        self.last_num_scheduled_tokens = 0
        self._states: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, str] = {}
        # Requests that finished as they were added (every first token from the prefill ended
        # its sequence): their output goes out with the next step.
        self._finished_on_arrival: list[_RequestState] = []

    def _tiered_connector(self, config: EngineConfig, cfg: ModelConfig,
                          dtype) -> tuple[TieredConnectorScheduler, TieredConnectorWorker]:
        blocks_per_chunk = config.kv_chunk_tokens // config.block_size
        fmt = ChunkFormat(self.fingerprint, dtype,
                          (cfg.num_layers, 2, blocks_per_chunk, config.block_size, cfg.num_kv_heads, cfg.head_dim))
        tiers = TieredStore(parse_store_spec(config.kv_store, fmt, config.kv_store_ttl_s, config.kv_secret))
        logger.info("KV store tiers: %s (%d-token chunks of %.1f MiB)", ", ".join(s.name for s in tiers.stores),
                    config.kv_chunk_tokens, fmt.nbytes / 2**20)
        return TieredConnectorScheduler(config.block_size, config.kv_chunk_tokens), TieredConnectorWorker(tiers)

    def _eos_token_ids(self, hf_config: dict, gen_config: dict) -> frozenset[int]:
        ids: set[int] = set()
        for value in (gen_config.get("eos_token_id"), hf_config.get("eos_token_id"), self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(value)
        return frozenset(ids)

    # ---- requests ----------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, hands_off: bool = False) -> int:
        """Checks a prompt against the model and the pool; returns the resolved max_tokens. A
        request that hands off after its first token needs blocks for the prompt only."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        self._check_vocabulary("prompt", prompt_token_ids)
        self._check_vocabulary("stop_token_ids", params.stop_token_ids)
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"contains {num_prompt} input tokens, leaving no room for output.", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains {num_prompt} input tokens, for a total of "
                f"{num_prompt + max_tokens} tokens.", "max_tokens")
        kv = self.kv_cache_manager
        needed = kv.blocks_needed(num_prompt + (0 if hands_off else max_tokens - 1))
        if needed > kv.num_blocks:
            raise InvalidRequestError(
                f"request needs {needed} KV blocks ({num_prompt} prompt + {max_tokens} max tokens) but the whole "
                f"KV pool has {kv.num_blocks} blocks of {kv.block_size} tokens", "max_tokens")
        return max_tokens

    def _check_vocabulary(self, name: str, ids: list[int]) -> None:
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} in {name} is out of vocabulary (size {self.vocab_size})",
                                      name)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    kind: OutputKind = OutputKind.FINAL_ONLY, arrival_time: float | None = None,
                    kv_transfer_params: KVTransferParams | dict | None = None,
                    first_tokens_shown: bool = False) -> None:
        """Queue a request. Raises InvalidRequestError (a ValueError) for a bad one; then
        nothing was queued. With ``kv_transfer_params.first_token_ids`` (from a prefill
        instance) each sequence continues from its first token; ``first_tokens_shown``: the
        client was already shown them (as far as the stop strings allowed), so the deltas go on
        after them."""
        try:
            kv_transfer_params = parse_kv_transfer_params(kv_transfer_params)
            check_kv_transfer_params_signature(kv_transfer_params, self.config.kv_secret)
        except KVTransferParamsError as exc:
            raise InvalidRequestError(str(exc), exc.param) from None
        if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidRequestError(f"request id must be a non-empty string of at most {MAX_REQUEST_ID_LEN} "
                                      "characters", "request_id")
        if request_id in self._states:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        if any(self.scheduler.is_id_in_use(c) for c in child_ids):
            # A finished request whose blocks a KV transfer still reads: reusing its id now
            # would hand the new request the old blocks.
            raise InvalidRequestError(f"request id {request_id!r} is still in use (its KV transfer has not "
                                      "finished); use a new id", "request_id")
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        first_tokens = self._first_tokens(kv_transfer_params, params, prompt_token_ids)
        # A prefill instance's request ends after its first token and hands off to a decode
        # instance (only where a connector can hand its KV on: elsewhere the flag is ignored).
        hands_off = (kv_transfer_params is not None and kv_transfer_params.do_remote_decode and first_tokens is None
                     and self.scheduler.connector.offers_kv)
        max_tokens = self.validate(prompt_token_ids, params, hands_off)
        limit = kv_transfer_params.max_local_prefill_tokens if kv_transfer_params is not None else None
        if limit is not None and not kv_transfer_params.acts_on_remote_kv:
            probe = Request(request_id, prompt_token_ids, params, self.eos_token_ids, max_tokens, self.block_hasher)
            uncached = self.scheduler.num_uncached_prompt_tokens(probe)
            if uncached > limit:
                raise PrefillElsewhere(uncached, limit)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        state = _RequestState(request_id, prompt_text, prompt_token_ids, kind, {}, arrival_time, hands_off=hands_off)
        requests: list[Request] = []
        tokenizer = self.tokenizer._tokenizer
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            # The n samples differ through their seeds; a seeded request stays reproducible.
            # (seed + index, wrapped into the 64-bit signed range every seed must stay in)
            child_params = params if params.n == 1 or params.seed is None else params.replace(
                seed=(params.seed + index + 2**63) % 2**64 - 2**63)
            child = state.children[child_id] = _Child(
                index, IncrementalDetokenizer(tokenizer, prompt_token_ids, child_params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            grammar = (self.grammar_compiler.request_grammar(params.structured_outputs)
                       if params.structured_outputs is not None else None)
            request = Request(child_id, prompt_token_ids, child_params, self.eos_token_ids, max_tokens,
                              self.block_hasher, arrival_time, hands_off=hands_off, grammar=grammar)
            if first_tokens is not None and self._start_from_first_token(child, request, *first_tokens[index],
                                                                         shown=first_tokens_shown):
                continue  # its first token ended it
            requests.append(request)
        # The n samples share one prompt, so one KV transfer: the first running sample pulls it
        # (or offers it), the others wait for it to land and then hit the prefix cache.
        for request in requests:
            leads = request is requests[0] or kv_transfer_params is None
            request.kv_transfer_params = kv_transfer_params if leads else None
            request.kv_leader = None if leads else requests[0].request_id
        for child_id in state.children:
            self._child_to_parent[child_id] = request_id
        for request in requests:
            self.scheduler.add_request(request)
        self._states[request_id] = state
        if not requests:
            self._finished_on_arrival.append(state)

    def _first_tokens(self, kv_transfer_params: KVTransferParams | None, params: SamplingParams,
                      prompt_token_ids: list[int]) -> list[tuple[int, list | None]] | None:
        """(token, logprob entries) per sequence, when a prefill instance sampled the first tokens
        for this very prompt (parameters replayed with another prompt bring none: it samples its own)."""
        if kv_transfer_params is None or kv_transfer_params.first_token_ids is None:
            return None
        ids, entries = kv_transfer_params.first_token_ids, kv_transfer_params.first_logprobs
        field = "kv_transfer_params.first_token_ids"
        if len(ids) != params.n:
            raise InvalidRequestError(f"{field} has {len(ids)} tokens for n={params.n} sequences", field)
        self._check_vocabulary(field, ids)
        if entries is not None and any(not e or e[0][0] != t or any(i >= self.vocab_size for i, _, _ in e)
                                       for t, e in zip(ids, entries)):
            raise InvalidRequestError("kv_transfer_params.first_logprobs must hold, per first token, that token's "
                                      "entry first and in-vocabulary tokens only", "kv_transfer_params.first_logprobs")
        if params.logprobs is None:
            entries = None
        elif entries is None:
            raise InvalidRequestError("this request asks for logprobs but kv_transfer_params.first_logprobs is "
                                      "missing", "kv_transfer_params.first_logprobs")
        if kv_transfer_params.first_tokens_digest != token_digest(prompt_token_ids):
            return None
        return [(t, entries[i] if entries is not None else None) for i, t in enumerate(ids)]

    def _start_from_first_token(self, child: _Child, request: Request, token: int, entries: list | None,
                                shown: bool) -> bool:
        """Continue a sequence whose first token the prefill instance sampled, exactly as if it
        had been sampled here. Returns whether that token ended the sequence."""
        request.append_output_token_id(token)
        self._apply_tokens(child, [token], [entries] if entries is not None else None)
        matched = child.detok.update([token])
        status = request.check_stop(self.max_model_len)
        if matched is not None or status is not None:
            child.finish_reason = "stop" if matched is not None else status.finish_reason
            child.stop_reason = matched if matched is not None else request.stop_reason
            return True
        if shown:  # what the prefill's answer showed (the same text: same detokenizer, same tokens)
            child.detok.next_delta(False)
            child.new_logprobs.clear()  # (the token still counts in the usage)
        return False

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests (by the id given to add_request); their blocks are freed now."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self._states.pop(request_id, None)
            if state is None:
                continue
            if state in self._finished_on_arrival:
                self._finished_on_arrival.remove(state)
            for child_id in state.children:
                self._child_to_parent.pop(child_id, None)
            self.scheduler.finish_requests(list(state.children), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states) or self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    # ---- the step ----------------------------------------------------------------------
    def num_tracked_requests(self) -> int:
        """Per-request state held anywhere above the runner: 0 when idle, or something leaks."""
        scheduler = self.scheduler
        return (len(self._states) + len(self._child_to_parent) + len(scheduler.requests) + len(scheduler.held)
                + len(self.kv_cache_manager.req_to_blocks) + scheduler.connector.num_tracked_requests())

    def shutdown(self) -> None:
        self.grammar_compiler.shutdown()
        self.runner.shutdown()

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        self.last_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        runner_output = self.runner.execute_model(scheduler_output)
        self._keep_connector_stats(runner_output.kv_connector_output.stats)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return self._process_outputs(core_outputs)

    def _keep_connector_stats(self, new: KVConnectorStats | None) -> None:
        """The latest totals; durations pile up (the newest MAX_KEPT_DURATIONS) until drained."""
        if new is None:
            return
        old = self.kv_connector_stats
        new.transfer_seconds = (old.transfer_seconds + new.transfer_seconds)[-MAX_KEPT_DURATIONS:]
        for tier, s in new.stores.items():
            s["load_seconds"] = (old.stores.get(tier, {}).get("load_seconds", []) + s["load_seconds"])[-MAX_KEPT_DURATIONS:]
        self.kv_connector_stats = new

    def drain_kv_events(self) -> list:
        """Prefix-cache changes since the last call (engine/kv_events.py; empty when off)."""
        pool = self.kv_cache_manager.pool
        if not pool.kv_events:
            return []
        events, pool.kv_events = pool.kv_events, []
        return events

    def drain_kv_connector_stats(self) -> KVConnectorStats:
        """The latest counters with the durations since the previous drain (the core's stats messages)."""
        stats = self.kv_connector_stats
        self.kv_connector_stats = KVConnectorStats(
            stats.transfer_bytes, stats.transfer_failures, [], stats.auth_failures,
            {tier: {**s, "load_seconds": []} for tier, s in stats.stores.items()})
        return stats

    def _process_outputs(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        touched: dict[str, _RequestState] = {s.request_id: s for s in self._finished_on_arrival}
        self._finished_on_arrival = []
        for out in core_outputs:
            parent_id = self._child_to_parent.get(out.req_id)
            state = self._states.get(parent_id) if parent_id is not None else None
            if state is None:
                continue  # aborted meanwhile
            child = state.children[out.req_id]
            try:
                self._apply(state, child, out)
            except Exception as exc:  # one request's output (detokenizing, say) never stops the step
                logger.exception("request %s: processing its output failed; ending it", out.req_id)
                self.scheduler.finish_requests(out.req_id, RequestStatus.FINISHED_ERROR)
                child.finish_reason, state.error = "error", f"output processing failed: {type(exc).__name__}: {exc}"
            touched[state.request_id] = state
        results = []
        for state in touched.values():
            finished = state.finished
            if finished and state.hands_off:
                self._hand_off(state)
            if state.kind is not OutputKind.FINAL_ONLY or finished:
                results.append(self._make_output(state, finished))
            if finished:
                del self._states[state.request_id]
                for child_id in state.children:
                    self._child_to_parent.pop(child_id, None)
        return results

    def _apply(self, state: _RequestState, child: _Child, out: EngineCoreOutput) -> None:
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if out.kv_transfer_params is not None:
            state.kv_transfer_params = out.kv_transfer_params
        if out.error is not None:
            state.error = out.error
        if state.queue_time is None:
            state.queue_time = out.queue_time
        if state.hands_off and out.new_logprobs and child.first_entries is None:
            child.first_entries = out.new_logprobs[0]
        self._apply_tokens(child, out.new_token_ids, out.new_logprobs)
        matched = child.detok.update(out.new_token_ids)
        if matched is not None and out.finish_reason not in ("abort", "error"):
            # A stop string ends the request here (also when the same token reached max_tokens
            # or was EOS: the stop string is why the text ends); the scheduler frees it now.
            self.scheduler.finish_requests(out.req_id, RequestStatus.FINISHED_STOPPED)
            child.finish_reason, child.stop_reason = "stop", matched
        elif out.finish_reason is not None:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason

    def _apply_tokens(self, child: _Child, token_ids: list[int], logprobs: list | None) -> None:
        child.token_ids.extend(token_ids)
        child.new_token_ids.extend(token_ids)
        if logprobs is not None and child.logprobs is not None:
            for entries in logprobs:
                decoded = {tid: Logprob(lp, rank, self.tokenizer.decode([tid])) for tid, lp, rank in entries}
                child.logprobs.append(decoded)
                child.new_logprobs.append(decoded)
                child.cumulative_logprob += entries[0][1]

    def _hand_off(self, state: _RequestState) -> None:
        """A prefill instance's request has its first tokens: the parameters a decode instance
        continues it from. If every sequence ended with its first token, the answer is final
        here and the KV offered is withdrawn; the first tokens still go along (a list of
        prompts may continue in part)."""
        leader = next(iter(state.children))
        continuing = any(c.finish_reason == HANDED_OFF for c in state.children.values())
        kv = state.kv_transfer_params
        if not continuing or state.error is not None or kv is None:
            self.scheduler.withdraw_kv(leader)
            kv = KVTransferParams()
        children = sorted(state.children.values(), key=lambda c: c.index)
        if state.error is not None or not all(c.token_ids for c in children):
            state.kv_transfer_params = None
            return
        entries = [c.first_entries for c in children]
        params = msgspec.structs.replace(
            kv, first_token_ids=[c.token_ids[0] for c in children],
            first_tokens_digest=token_digest(state.prompt_token_ids),
            first_logprobs=entries if all(e is not None for e in entries) else None)
        state.kv_transfer_params = sign_kv_transfer_params(params, self.config.kv_secret,
                                                           self.scheduler.connector.params_ttl_s)

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        outputs = []
        for child in state.children.values():
            delta = state.kind is OutputKind.DELTA
            reason = child.shown_finish_reason
            if delta and child.reported_finish:
                continue
            delta_text = child.detok.next_delta(reason is not None)
            text = delta_text if delta else child.detok.sent_text
            if delta and not child.new_token_ids and not text and reason is None:
                continue
            child.reported_finish = reason is not None
            outputs.append(CompletionOutput(
                child.index, text, list(child.new_token_ids if delta else child.token_ids),
                reason, child.stop_reason,
                list(child.new_logprobs) if delta and child.logprobs is not None else child.logprobs,
                child.cumulative_logprob))
            child.new_token_ids.clear()
            child.new_logprobs.clear()
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, finished,
                             state.num_cached_tokens, state.kv_transfer_params, state.error, state.queue_time)
