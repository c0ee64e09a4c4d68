"""EngineCore: token ids in, token ids out. Scheduler + model runner + KV connector wiring; a
step is three calls, schedule() -> execute_model() -> update_from_output().

Text is the front end's job (engine/output_processor.py: detokenization, stop strings, logprob
tokens, outputs), in the API server's process or beside the offline ``LLM``, as in vLLM. The
core validates what it is given, fans a request of ``n`` sequences out into ``n`` scheduler
requests (engine/request_ids.py), starts a decode instance's sequences from the first tokens a
prefill instance sampled, and signs a prefill instance's hand-off (engine/kv_transfer/first_token.py).
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from engine import timeline
from engine.block_pool import BlockHasher, check_cache_salt, root_block_hash
from engine.config import EngineConfig
from engine.cpu_placement import apply_placement
from engine.errors import InvalidRequestError, PrefillElsewhere
from engine.grammar import GrammarCompiler
from engine.kv_cache_manager import KVCacheManager
from engine.kv_transfer.base import NoOpConnectorWorker
from engine.kv_transfer.first_token import first_tokens_for, hand_off_params
from engine.kv_transfer.load_cost import LoadPlanner, step_features
from engine.kv_transfer.multi import MultiConnectorScheduler, MultiConnectorWorker
from engine.kv_transfer.p2p import P2PConnectorScheduler
from engine.kv_transfer.p2p_worker import STAGING_BYTES, P2PConnectorWorker
from engine.kv_transfer.params import (
    KVTransferParams,
    KVTransferParamsError,
    check_kv_transfer_params_signature,
    parse_kv_transfer_params,
    sign_kv_transfer_params,
)
from engine.kv_transfer.stores import ChunkFormat, parse_store_spec
from engine.kv_transfer.tiered import TieredConnectorScheduler
from engine.kv_transfer.tiered_worker import TieredConnectorWorker, TieredStore
from engine.outputs import EngineCoreOutput, KVConnectorStats
from engine.request import Request, RequestStatus
from engine.request_ids import sequence_id
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer_loading import load_tokenizer
from engine.vllm_block_hash import VllmBlockHasher, both_hashes
from engine.worker import loader
from engine.worker.quantized import METHODS, QUANTIZER_VERSION, kernel_numerics
from engine.worker.backends import KV_LAYOUT
from engine.worker.model_runner import ModelRunner, resolve_device, resolve_dtype
from engine.worker.models import ModelConfig, model_config_from_hf

logger = logging.getLogger("engine")

MAX_REQUEST_ID_LEN = 256
MAX_KEPT_DURATIONS = 4096  # transfer and load durations kept for a reader that never drains (offline use)
HANDED_OFF = RequestStatus.FINISHED_HANDED_OFF.finish_reason
# Failing model steps in a row (none succeeding between them) after which the engine is taken
# for broken, not a request: steps of several requests, whose failure names no one (a failing
# request is isolated in one or two of them), and steps of one request, each of which failed
# that request alone (as many as poisoned requests in flight, so the bound is wide).
MAX_FAILED_STEPS = 8
MAX_ISOLATED_FAILURES = 32


@dataclass(slots=True)
class _HandOff:
    """A prefill instance's request: the first token of each sequence, until all have one."""
    prompt_token_ids: list[int]
    first: dict[int, tuple[int, list | None]] = field(default_factory=dict)  # index -> (token, entries)
    continuing: bool = False  # some sequence did not end with its first token
    offer: KVTransferParams | None = None


@dataclass(slots=True)
class _EngineRequest:
    """What the core keeps per engine request: its sequences, and its hand-off if it has one."""
    sequence_ids: list[str]
    open: set[str]  # sequences not finished yet
    hand_off: _HandOff | None = None


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        apply_placement(config.cpu_cores, config.num_threads)
        model_dir = loader.resolve_model(config.model, config.revision, config.download_dir)
        self.model_dir = model_dir
        # For EOS ids and structured output's vocabulary only: text is the front end's.
        self.tokenizer = load_tokenizer(config.tokenizer or model_dir)
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
        # So is quantization made at load (a .gguf's blocks are in its converted files, hashed).
        quantized = f":{config.quantization}-v{QUANTIZER_VERSION}" if config.quantization in METHODS else ""
        # And how quantized weights are multiplied (kernel version and way: the same weights give
        # KV that differs in its last bits between them).
        quantized += kernel_numerics(loader.stored_block_types(model_dir), config.quantization, dtype,
                                     resolve_device(config.device))
        self.fingerprint = (f"{loader.model_fingerprint(model_dir)}{quantized}:{dtype}:bs{config.block_size}:"
                            f"{KV_LAYOUT}")
        self.engine_id = uuid.uuid4().hex[:12]
        connector, connector_worker = None, NoOpConnectorWorker()
        # Whether KV a tier holds is worth loading, by measured rates (engine/kv_transfer/load_cost.py).
        self.load_planner = LoadPlanner(always_load=config.kv_always_load)
        self._tiers = None  # (scheduler half, worker half) of the KV store tiers, if any
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
            tiered, tiered_worker = self._tiers = self._tiered_connector(config, model_config, dtype)
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
        # vLLM's hashes, beside the engine's, when the KV events are to name blocks by them.
        self.event_hasher = None
        if config.prefix_caching_hash_algo is not None and config.enable_prefix_caching:
            self.event_hasher = VllmBlockHasher(config.prefix_caching_hash_algo, config.block_size)
            self.block_hasher = both_hashes(self.block_hasher, self.event_hasher)
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.block_size,
                                               config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len, connector,
                                   vocab_size=self.vocab_size)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        pool_tokens = self.runner.num_blocks * config.block_size
        if pool_tokens < self.max_model_len:
            logger.warning("the KV pool holds %d tokens, less than max_model_len=%d: a request with a longer "
                           "max_tokens is refused, one without max_tokens ends (\"length\") when its sequence "
                           "fills the pool", pool_tokens, self.max_model_len)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.runner.num_blocks, config.block_size,
                    self.runner.num_blocks * self.runner.bytes_per_block / 2**30)
        self.last_num_scheduled_tokens = 0
        self._requests: dict[str, _EngineRequest] = {}
        self._request_of: dict[str, str] = {}  # sequence id -> engine request id
        # First tokens that ended their sequence as they arrived: they go out with the next step.
        self._pending: list[EngineCoreOutput] = []
        self._failed_steps = self._isolated_failures = 0  # failing steps in a row (_contain_step_failure)

    def _tiered_connector(self, config: EngineConfig, cfg: ModelConfig,
                          dtype) -> tuple[TieredConnectorScheduler, TieredConnectorWorker]:
        blocks_per_chunk = config.kv_chunk_tokens // config.block_size
        fmt = ChunkFormat(self.fingerprint, dtype,
                          (cfg.num_layers, 2, blocks_per_chunk, config.block_size, cfg.num_kv_heads, cfg.head_dim))
        tiers = TieredStore(parse_store_spec(config.kv_store, fmt, config.kv_store_ttl_s, config.kv_secret))
        self.load_planner.bytes_per_token = fmt.nbytes / config.kv_chunk_tokens
        logger.info("KV store tiers: %s (%d-token chunks of %.1f MiB)", ", ".join(s.name for s in tiers.stores),
                    config.kv_chunk_tokens, fmt.nbytes / 2**20)
        return (TieredConnectorScheduler(config.block_size, config.kv_chunk_tokens, planner=self.load_planner,
                                         chunk_bytes=fmt.nbytes), TieredConnectorWorker(tiers))

    def _eos_token_ids(self, hf_config: dict, gen_config: dict) -> frozenset[int]:
        ids: set[int] = set()
        for value in (gen_config.get("eos_token_id"), hf_config.get("eos_token_id"), self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(value)
        return frozenset(ids)

    # ---- requests ----------------------------------------------------------------------
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
        kv = self.kv_cache_manager
        if params.max_tokens is None:
            # Unset (vLLM's "up to the context"): the rest of the context, or as far as the whole
            # pool holds the sequence if that is less. Blocks are allocated as it grows, as for
            # any request (preempted when the pool runs short); one that fills the whole pool
            # ends there with finish reason "length", never refused for what it might generate.
            needed = kv.blocks_needed(num_prompt)
            if needed > kv.num_blocks:
                raise InvalidRequestError(
                    f"the prompt's {num_prompt} tokens need {needed} KV blocks but the whole KV pool has "
                    f"{kv.num_blocks} blocks of {kv.block_size} tokens", "prompt")
            return min(self.max_model_len, kv.num_blocks * kv.block_size + 1) - num_prompt
        max_tokens = params.max_tokens
        if num_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains {num_prompt} input tokens, for a total of "
                f"{num_prompt + max_tokens} tokens.", "max_tokens")
        needed = kv.blocks_needed(num_prompt + (0 if hands_off else max_tokens - 1))
        if needed > kv.num_blocks:
            raise InvalidRequestError(
                f"request needs {needed} KV blocks ({num_prompt} prompt + {max_tokens} max tokens) but the whole "
                f"KV pool has {kv.num_blocks} blocks of {kv.block_size} tokens: with this prompt at most "
                f"{max(0, kv.num_blocks * kv.block_size + 1 - num_prompt)} output tokens fit (leave max_tokens "
                "unset to generate until the pool is full)", "max_tokens")
        return max_tokens

    def _check_vocabulary(self, name: str, ids: list[int]) -> None:
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} in {name} is out of vocabulary (size {self.vocab_size})",
                                      name)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None,
                    kv_transfer_params: KVTransferParams | dict | None = None, cache_salt: str | None = None,
                    traced: bool = False) -> None:
        """Queue a request of ``params.n`` sequences. Raises InvalidRequestError (a ValueError)
        for a bad one, or PrefillElsewhere; then nothing was queued. With
        ``kv_transfer_params.first_token_ids`` (from a prefill instance) each sequence continues
        from its first token, which goes out with the next step marked ``from_prefill``.
        ``cache_salt``: its KV is shared only with requests of the same salt (block_pool.salted_root).
        ``traced``: its outputs carry the trace of its phases (engine/request_trace.py)."""
        try:
            kv_transfer_params = parse_kv_transfer_params(kv_transfer_params)
            check_kv_transfer_params_signature(kv_transfer_params, self.config.kv_secret)
        except KVTransferParamsError as exc:
            raise InvalidRequestError(str(exc), exc.param) from None
        if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidRequestError(f"request id must be a non-empty string of at most {MAX_REQUEST_ID_LEN} "
                                      "characters", "request_id")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        check_cache_salt(cache_salt)
        if params.prompt_logprobs is not None and kv_transfer_params is not None and kv_transfer_params.acts_on_remote_kv:
            raise InvalidRequestError("prompt_logprobs needs every prompt position's logits, computed here: not with "
                                      "KV or first tokens from another instance (send the request without "
                                      "kv_transfer_params)", "prompt_logprobs")
        seq_ids = [sequence_id(request_id, i, params.n) for i in range(params.n)]
        if any(self.scheduler.is_id_in_use(s) or s in self._request_of for s in seq_ids):
            # A finished request whose blocks a KV transfer still reads: reusing its id now
            # would hand the new request the old blocks.
            raise InvalidRequestError(f"request id {request_id!r} is still in use (its KV transfer has not "
                                      "finished); use a new id", "request_id")
        prompt_token_ids = list(prompt_token_ids)
        first_tokens = first_tokens_for(kv_transfer_params, params, prompt_token_ids, self.vocab_size)
        # A prefill instance's request ends after its first token and hands off to a decode
        # instance (only where a connector can hand its KV on: elsewhere the flag is ignored).
        hands_off = (kv_transfer_params is not None and kv_transfer_params.do_remote_decode and first_tokens is None
                     and self.scheduler.connector.offers_kv)
        max_tokens = self.validate(prompt_token_ids, params, hands_off)
        limit = kv_transfer_params.max_local_prefill_tokens if kv_transfer_params is not None else None
        if limit is not None and not kv_transfer_params.acts_on_remote_kv:
            probe = Request(request_id, prompt_token_ids, params, self.eos_token_ids, max_tokens, self.block_hasher,
                            cache_salt=cache_salt)
            uncached = self.scheduler.num_uncached_prompt_tokens(probe)
            if uncached > limit:
                raise PrefillElsewhere(uncached, limit)
        grammars = [self.grammar_compiler.request_grammar(params.structured_outputs)
                    if params.structured_outputs is not None else None for _ in range(params.n)]
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        requests: list[Request] = []
        for index, seq_id in enumerate(seq_ids):
            # The n samples differ through their seeds; a seeded request stays reproducible.
            # (seed + index, wrapped into the 64-bit signed range every seed must stay in)
            seq_params = params if params.n == 1 or params.seed is None else params.replace(
                seed=(params.seed + index + 2**63) % 2**64 - 2**63)
            request = Request(seq_id, prompt_token_ids, seq_params, self.eos_token_ids, max_tokens,
                              self.block_hasher, arrival_time, hands_off=hands_off, grammar=grammars[index],
                              cache_salt=cache_salt, traced=traced)
            if first_tokens is None or not self._start_from_first_token(request, *first_tokens[index]):
                requests.append(request)
        # The n samples share one prompt, so one KV transfer: the first running sample pulls it
        # (or offers it), the others wait for it to land and then hit the prefix cache.
        for request in requests:
            leads = request is requests[0] or kv_transfer_params is None
            request.kv_transfer_params = kv_transfer_params if leads else None
            request.kv_leader = None if leads else requests[0].request_id
        self._requests[request_id] = _EngineRequest(
            seq_ids, {r.request_id for r in requests}, _HandOff(prompt_token_ids) if hands_off else None)
        for seq_id in seq_ids:
            self._request_of[seq_id] = request_id
        for request in requests:
            self.scheduler.add_request(request)
        if not requests:
            self._requests.pop(request_id)
            for seq_id in seq_ids:
                self._request_of.pop(seq_id)

    def _start_from_first_token(self, request: Request, token: int, entries: list | None) -> bool:
        """Continue a sequence whose first token a prefill instance sampled, exactly as if it had
        been sampled here; the token goes out with the next step. Returns whether it ended the
        sequence (EOS, a stop token, the length)."""
        request.append_output_token_id(token)
        status = request.check_stop(self.max_model_len)
        self._pending.append(EngineCoreOutput(
            request.request_id, [token], [entries] if entries is not None else None,
            finish_reason=status.finish_reason if status is not None else None, stop_reason=request.stop_reason,
            from_prefill=True))
        return status is not None

    def abort_request(self, ids: str | list[str]) -> None:
        """Abort engine requests (the ids given to add_request) or single sequences of one; their
        blocks are freed now, and a KV offer they hold is withdrawn."""
        for some_id in [ids] if isinstance(ids, str) else ids:
            request = self._requests.get(some_id)
            seq_ids = request.sequence_ids if request is not None else [some_id]
            for seq_id in seq_ids:
                self._end_sequence(seq_id)
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)

    def discard_request(self, request_id: str, n: int) -> None:
        """Undo what an add_request that raised left behind: its sequences are aborted and
        nothing of it goes out (it was refused, so no one waits for it)."""
        # Only the sequences registered for this request, never through abort_request: a
        # sequence id can also be another request's ("0_x" of x, or a client's own "0_x"), and
        # the failure may have come before admission checked that they were free.
        candidates = [sequence_id(request_id, i, n) for i in range(n)]
        others = {s for s in candidates if self._request_of.get(s, request_id) != request_id}
        seq_ids = [s for s in candidates if self._request_of.get(s) == request_id]
        for seq_id in seq_ids:
            self._end_sequence(seq_id)  # (the last one drops the request's entry)
        self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
        self._pending = [o for o in self._pending if o.req_id not in candidates or o.req_id in others]

    def stop_sequences(self, seq_ids: list[str]) -> None:
        """The front end found a stop string: these sequences end (stopped, not aborted: a tier
        may keep their KV)."""
        for seq_id in seq_ids:
            self._end_sequence(seq_id)
        self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_STOPPED)

    def release_offer(self, params: KVTransferParams) -> bool:
        """Frees the KV a hand-off of this instance offers, on the word of whoever holds its
        signed parameters (a router that will not use them). Returns whether an offer was
        withdrawn; raises KVTransferParamsError for parameters this instance did not sign."""
        check_kv_transfer_params_signature(params, self.config.kv_secret)
        if not params.do_remote_prefill:
            return False
        if params.remote_engine_id != self.engine_id:  # a peer's offer: it frees it on our word
            return self.scheduler.connector.release_peer(params)
        seq_id = params.remote_request_id
        held = seq_id in self.scheduler.held
        self.scheduler.withdraw_kv(seq_id)
        return held

    def release_peer_offer(self, raw_params) -> bool:
        """A request carrying a peer's hand-off was refused here: the peer frees that KV now.
        Only for parameters that parse and carry this deployment's signature (nothing else
        makes this instance contact an address); returns whether a release goes out."""
        try:
            params = parse_kv_transfer_params(raw_params)
            if params is None or not params.do_remote_prefill or params.remote_engine_id == self.engine_id:
                return False
            check_kv_transfer_params_signature(params, self.config.kv_secret)
        except KVTransferParamsError:
            return False
        return self.scheduler.connector.release_peer(params)

    def _end_sequence(self, seq_id: str) -> None:
        request_id = self._request_of.pop(seq_id, None)
        request = self._requests.get(request_id) if request_id is not None else None
        if request is None:
            return
        request.open.discard(seq_id)
        if not request.open:
            del self._requests[request_id]
            for other in request.sequence_ids:
                self._request_of.pop(other, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending) or self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the step ----------------------------------------------------------------------
    def num_tracked_requests(self) -> int:
        """Per-request state held anywhere in the core: 0 when idle, or something leaks."""
        scheduler = self.scheduler
        return (len(self._requests) + len(self._request_of) + len(scheduler.requests) + len(scheduler.held)
                + len(self.kv_cache_manager.req_to_blocks) + scheduler.connector.num_tracked_requests())

    def shutdown(self) -> None:
        self.grammar_compiler.shutdown()
        self.runner.shutdown()

    def step(self) -> list[EngineCoreOutput]:
        """One scheduler step: what each sequence produced (token ids, raw logprob entries, its
        end), plus the first tokens that ended sequences as they arrived."""
        outputs, self._pending = self._pending, []
        scheduler_output = self.scheduler.schedule()
        self.last_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        if timeline.enabled:
            timeline.mark("core.scheduled", *(new.req_id for new in scheduler_output.scheduled_new_reqs))
        started = time.perf_counter()
        try:
            runner_output = self.runner.execute_model(scheduler_output)
        except Exception as exc:
            outputs += self._contain_step_failure(scheduler_output, exc)
        else:
            self._observe_step(scheduler_output, time.perf_counter() - started)
            if scheduler_output.total_num_scheduled_tokens:
                self._failed_steps = self._isolated_failures = 0
            self._keep_connector_stats(runner_output.kv_connector_output.stats)
            if self.kv_cache_manager.pool.kv_events is not None:
                self.kv_cache_manager.pool.kv_events += runner_output.kv_connector_output.kv_events
            outputs += self.scheduler.update_from_output(scheduler_output, runner_output)
        for out in outputs:
            request_id = self._request_of.get(out.req_id)
            request = self._requests.get(request_id) if request_id is not None else None
            if request is not None and request.hand_off is not None:
                self._track_hand_off(request, out)
                # A hand-off's parameters go out once, signed, with its last sequence's end.
                last = out.finish_reason is not None and request.open == {out.req_id}
                out.kv_transfer_params = self._hand_off(request) if last else None
            if out.finish_reason is not None and request is not None:
                self._end_sequence(out.req_id)
        if timeline.enabled:
            timeline.mark("core.outputs", *(out.req_id for out in outputs))
        return outputs

    def _observe_step(self, scheduler_output, seconds: float) -> None:
        """The step's cost, for the prefill fit of the load-or-recompute decision. (The scheduler
        advanced each request's computed tokens when it planned the step.)"""
        if self._tiers is None or not scheduler_output.total_num_scheduled_tokens:
            return
        requests = self.scheduler.requests
        tokens, pairs = step_features((n, requests[r].num_computed_tokens - n)
                                      for r, n in scheduler_output.num_scheduled_tokens.items() if r in requests)
        self.load_planner.observe_step(tokens, pairs, seconds)

    def save_kv(self) -> None:
        """The last step's KV offers and tier saves: call it once the step's outputs are on their
        way (engine/core.py sends them first), so a prefill instance's first token never waits
        for them. If nobody does, the next step makes them before anything else."""
        self.runner.save_kv()

    def _contain_step_failure(self, scheduler_output, exc: Exception) -> list[EngineCoreOutput]:
        """A model step raised: the requests in it are recomputed, each alone, and the one the
        failure follows ends with an error (scheduler.quarantine); the others, and everything
        not in the step, go on. A step with no request in it, one that failed before the
        connector's instructions reached the worker (other requests' transfers), or a run of
        failing steps past MAX_FAILED_STEPS / MAX_ISOLATED_FAILURES (the model, not a request)
        re-raises: the engine is broken."""
        alone = len(scheduler_output.num_scheduled_tokens) == 1
        self._isolated_failures += alone
        self._failed_steps += not alone
        if (not scheduler_output.num_scheduled_tokens or self._failed_steps > MAX_FAILED_STEPS
                or self._isolated_failures > MAX_ISOLATED_FAILURES
                or not getattr(self.runner, "connector_meta_delivered", True)):  # other requests' transfers lost
            raise exc
        logger.exception("a model step with %d request(s) failed; recomputing them one at a time",
                         len(scheduler_output.num_scheduled_tokens))
        self.scheduler.quarantine(scheduler_output.num_scheduled_tokens,
                                  f"the model step failed on this request: {type(exc).__name__}: {exc}")
        return self.scheduler.take_pending_outputs()

    def _track_hand_off(self, request: _EngineRequest, out: EngineCoreOutput) -> None:
        hand_off = request.hand_off
        index = request.sequence_ids.index(out.req_id)
        if out.new_token_ids and index not in hand_off.first:
            hand_off.first[index] = (out.new_token_ids[0], out.new_logprobs[0] if out.new_logprobs else None)
        if out.finish_reason == HANDED_OFF:
            hand_off.continuing = True
        if out.kv_transfer_params is not None:
            hand_off.offer = out.kv_transfer_params

    def _hand_off(self, request: _EngineRequest) -> KVTransferParams | None:
        """A prefill instance's request has its first tokens: the signed parameters a decode
        instance continues it from. If every sequence ended with its first token (max_tokens,
        EOS), the answer is final here, but the prompt's KV stays on offer under its lease: vLLM's
        routers ask a prefill instance for one token and then send the decode instance the
        client's own request. Those parameters carry no first tokens (they were sampled with the
        router's parameters, not the client's): the decode instance samples its own. Our proxy
        releases the offer of a final answer at once."""
        hand_off = request.hand_off
        if len(hand_off.first) < len(request.sequence_ids):
            return None  # some sequence ended without a token (an error, an abort)
        if not hand_off.continuing and hand_off.offer is not None:
            return sign_kv_transfer_params(hand_off.offer, self.config.kv_secret,
                                           self.scheduler.connector.params_ttl_s)
        offer = hand_off.offer if hand_off.continuing else None
        first = [hand_off.first[i] for i in range(len(request.sequence_ids))]
        return hand_off_params(offer, hand_off.prompt_token_ids, [t for t, _ in first], [e for _, e in first],
                               self.config.kv_secret, self.scheduler.connector.params_ttl_s)

    def _keep_connector_stats(self, new: KVConnectorStats | None) -> None:
        """The latest totals; durations pile up (the newest MAX_KEPT_DURATIONS) until drained."""
        if new is None:
            return
        old = self.kv_connector_stats
        new.transfer_seconds = (old.transfer_seconds + new.transfer_seconds)[-MAX_KEPT_DURATIONS:]
        for tier, s in new.stores.items():
            s["load_seconds"] = (old.stores.get(tier, {}).get("load_seconds", []) + s["load_seconds"])[-MAX_KEPT_DURATIONS:]
        self.kv_connector_stats = new

    def enable_kv_events(self) -> None:
        """Collect KV events from now on: the pool's (medium GPU) and the CPU and disk tiers'."""
        self.kv_cache_manager.pool.kv_events = []
        if self._tiers is not None:
            tiered, tiered_worker = self._tiers
            tiered.describe_saves = True
            tiered_worker.enable_events(self.config.block_size)

    def drain_kv_events(self) -> list:
        """Prefix-cache changes since the last call (engine/kv_events.py; empty when off)."""
        pool = self.kv_cache_manager.pool
        if not pool.kv_events:
            return []
        events, pool.kv_events = pool.kv_events, []
        return events

    def load_decision(self) -> dict:
        """The load-or-recompute decision's totals, rates and prefill fit (empty without tiers)."""
        return self.load_planner.snapshot() if self._tiers is not None else {}

    def drain_kv_connector_stats(self) -> KVConnectorStats:
        """The latest counters with the durations since the previous drain (the core's stats messages)."""
        stats = self.kv_connector_stats
        self.kv_connector_stats = KVConnectorStats(
            stats.transfer_bytes, stats.transfer_failures, [], stats.auth_failures,
            {tier: {**s, "load_seconds": []} for tier, s in stats.stores.items()}, stats.pulls)
        return stats
