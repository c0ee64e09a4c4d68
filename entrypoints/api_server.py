"""OpenAI-compatible HTTP server. The engine runs in its own process (engine/core.py); this
process parses, tokenizes, validates, streams, measures, and never blocks on the model."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import time
from typing import AsyncIterator

import msgspec
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine import timeline
from engine.block_pool import root_block_hash
from engine.core_client import AsyncEngineClient, ChoiceDelta, EngineRequestError, LogprobEntry, RequestStream
from engine.errors import error_status
from engine.request_ids import prompt_request_id
from engine.kv_transfer.params import (
    KVTransferParams,
    KVTransferParamsError,
    check_kv_transfer_params_signature,
    parse_kv_transfer_params,
)
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from entrypoints import tracing
from entrypoints.load_decision_metrics import LoadDecisionCollector
from entrypoints.metrics import ServerMetrics
from entrypoints.prompt_inputs import CHAT_ROLES, ContentPartError, message_text
from entrypoints.protocol import (
    ENGINE_REQUEST_ID,
    FIRST_TOKENS_SHOWN,
    BodyError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    document_request_bodies,
    read_json_object,
    request_ids_of,
    role_choice,
    sse,
    stream_choice,
)

logger = logging.getLogger("engine.api")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                409: "prefill_remotely", 413: "invalid_request_error", 500: "internal_server_error",
                502: "upstream_error", 503: "service_unavailable"}
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=_ERROR_TYPES.get(self.status, "error"),
                                             param=self.param, code=self.status)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _decodes_like_the_core(params: SamplingParams) -> None:
    msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)


def _chat_message(index: int, message) -> dict:
    """A message as the chat template sees it: content parts (OpenAI's list form) must be
    text, and are joined; anything else is a 400 naming the part."""
    if message.role not in CHAT_ROLES:
        raise APIError(400, f"messages[{index}].role must be one of {sorted(CHAT_ROLES)}, got {message.role!r}",
                       f"messages.{index}.role")
    out = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        try:
            out["content"] = message_text(message.content, f"messages[{index}].content")
        except ContentPartError as exc:
            raise APIError(400, str(exc), f"messages.{index}.content.{exc.index}") from None
    return out


class OpenAIServer:
    def __init__(self, client: AsyncEngineClient, tokenizer, served_model_names: list[str],
                 api_key: str | None = None, trust_request_chat_template: bool = False) -> None:
        self.client = client
        self.tokenizer = tokenizer
        client.set_tokenizer(tokenizer)  # the front end's text (engine/output_processor.py)
        self.model_names = served_model_names
        self.api_key = api_key
        self.trust_request_chat_template = trust_request_chat_template
        # Tokenizing and rendering chat templates run here, off the event loop, one at a time
        # (a fast tokenizer must not be entered from two threads at once).
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._ll_tokenizer = None  # see _grammar_tokenizer (only ever touched on that one thread)
        self.metrics = ServerMetrics(served_model_names[0], lambda: client.stats,
                                     client.info.max_model_len if client.info is not None else None)
        self.metrics.registry.register(LoadDecisionCollector(lambda: client.stats, served_model_names[0]))
        client.on_stats = self.metrics.observe_stats
        client.on_request_stats = self.metrics.observe_requests

    # ---- input -------------------------------------------------------------------------
    async def _parse(self, raw: Request, model_cls):
        return self._validate(await self._read(raw), model_cls)

    @staticmethod
    async def _read(raw: Request) -> dict:
        try:
            return await read_json_object(raw)
        except BodyError as exc:
            raise APIError(exc.status, exc.message, exc.param) from None

    def _validate(self, data: dict, model_cls):
        try:
            request = model_cls.model_validate(data)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            # Drop pydantic's union-member tags ("str", "list[int]", "function-after[...]").
            loc = [str(p) for p in err["loc"] if "[" not in str(p) and str(p) not in _TYPE_TAGS]
            param = ".".join(loc) or None
            raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param)
        if request.model is not None and request.model not in self.model_names:
            raise APIError(404, f"The model `{request.model}` does not exist. Served: {', '.join(self.model_names)}",
                           "model")
        refused = request.refused_field()
        if refused is not None:
            raise APIError(400, refused[1], refused[0])
        return request

    async def _sampling_params(self, request, max_tokens: int | None, logprobs: int | None):
        """The request's SamplingParams; a 400 naming the field for a bad one, including a schema,
        regex or grammar that does not compile (checked off the event loop)."""
        try:
            params = request.sampling_params(max_tokens, logprobs)
        except BodyError as exc:
            raise APIError(exc.status, exc.message, exc.param) from None
        except ValueError as exc:
            message = str(exc)
            raise APIError(400, message, message.split(" ", 1)[0]) from None
        if params.structured_outputs is not None:
            try:  # (a schema of up to 256 KiB: off the event loop)
                await self._off_loop(lambda: params.structured_outputs.check(self._grammar_tokenizer()))
            except ValueError as exc:
                _, field = request.structured_outputs_params()
                raise APIError(400, f"{field}: {exc}", field) from None
        try:  # exactly what the engine core will decode: nothing it would refuse leaves here
            if params.structured_outputs is not None:
                await self._off_loop(_decodes_like_the_core, params)
            else:
                _decodes_like_the_core(params)
        except (msgspec.ValidationError, ValueError) as exc:
            raise APIError(400, f"invalid sampling parameters: {exc}") from None
        return params

    def _grammar_tokenizer(self):
        """The model's vocabulary for llguidance (built once, ~0.5 s, on the first structured
        request, in the worker thread that checks it): tokens a grammar names must exist."""
        if self._ll_tokenizer is None:
            import llguidance.hf
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.client.info.vocab_size)
        return self._ll_tokenizer

    def _completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt must not be empty", "prompt")
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    def _prompt_texts(self, prompt, prompts: list[list[int]]) -> list[str]:
        """What echo shows of each prompt: its text as given, or the decode of its ids."""
        given = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        return [p if isinstance(p, str) else self.tokenizer.decode(ids) for p, ids in zip(given, prompts)]

    def _chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(400, "chat_template in a request is refused: this server only renders its own "
                                "(the operator can allow it with --trust-request-chat-template)", "chat_template")
        if not request.messages:
            raise APIError(400, "messages must not be empty", "messages")
        messages = [_chat_message(i, m) for i, m in enumerate(request.messages)]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=request.chat_template,
                                                      add_generation_prompt=request.add_generation_prompt)
        except Exception as exc:  # a template that cannot render these messages
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages")
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def _check_request(self, request, prompts: list[list[int]], params) -> list[KVTransferParams | None]:
        """Limits and the typed kv_transfer_params (one per prompt), before the engine sees them."""
        if request.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", "logit_bias")
        vocab = self.client.info.vocab_size
        for field, ids in (("prompt", [t for p in prompts for t in p]), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} in {field} is out of vocabulary (size {vocab})", field)
        num_prompts = len(prompts)
        max_seqs = self.client.info.max_num_seqs
        if num_prompts * params.n > max_seqs:
            raise APIError(400, f"this request asks for {num_prompts} prompt(s) x n={params.n} sequences; at most "
                                f"{max_seqs} (--max-num-seqs) are served per request", "n" if num_prompts == 1 else "prompt")
        value = request.kv_transfer_params
        if isinstance(value, list):
            if len(value) != num_prompts:
                raise APIError(400, f"kv_transfer_params has {len(value)} entries for {num_prompts} prompts",
                               "kv_transfer_params")
            items = value
        else:
            items = [value] * num_prompts
        try:
            parsed = [parse_kv_transfer_params(v) for v in items]
            for p in parsed:
                check_kv_transfer_params_signature(p, self.client.config.kv_secret)
        except KVTransferParamsError as exc:
            raise APIError(400, str(exc), exc.param)
        if not isinstance(value, list) and num_prompts > 1 and parsed[0] is not None and parsed[0].do_remote_prefill:
            raise APIError(400, "one do_remote_prefill object cannot serve several prompts: send a list with one "
                                "entry per prompt (as the prefill instance returned it)", "kv_transfer_params")
        return parsed

    # ---- endpoints ---------------------------------------------------------------------
    async def completions(self, raw: Request) -> Response:
        received = time.monotonic()
        request: CompletionRequest = await self._parse(raw, CompletionRequest)
        if request.logprobs is not None and request.logprobs > 5:
            raise APIError(400, f"logprobs must be at most 5 for completions, got {request.logprobs}", "logprobs")
        # echo with max_tokens 0: the prompt alone (one token is sampled and dropped, as vLLM does)
        params = await self._sampling_params(request, 1 if request.echo_only else request.max_tokens,
                                             request.logprobs)
        prompts = await self._off_loop(self._completion_prompts, request.prompt)
        return await self._serve(raw, request, "cmpl", prompts, params, chat=False, received=received)

    async def chat_completions(self, raw: Request) -> Response:
        received = time.monotonic()
        request: ChatCompletionRequest = await self._parse(raw, ChatCompletionRequest)
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        params = await self._sampling_params(request, max_tokens, logprobs)
        prompt = await self._off_loop(self._chat_prompt, request)
        return await self._serve(raw, request, "chatcmpl", [prompt], params, chat=True, received=received)

    async def _serve(self, raw: Request, request, prefix: str, prompts: list[list[int]], params,
                     chat: bool, received: float | None = None) -> Response:
        tokenized = time.monotonic()  # (and validated)
        kv_params = self._check_request(request, prompts, params)
        try:
            # The client's id is echoed; the engine's is unique to this request (clients share ids).
            request_id, engine_id = request_ids_of(request.request_id, raw.headers.get("x-request-id"),
                                                   raw.headers.get(ENGINE_REQUEST_ID), prefix)
        except BodyError as exc:
            raise APIError(exc.status, exc.message, exc.param) from None
        arrival = time.monotonic() if received is None else received  # vLLM's arrival_time: before tokenizing
        timeline.mark("api.received", engine_id, at=received)
        timeline.mark("api.tokenized", engine_id, at=tokenized)
        given = request.request_id is not None or raw.headers.get("x-request-id")  # else the id is ours
        spans = self._request_spans(raw, request, request_id if given else None, engine_id, params,
                                    received or arrival)
        traced = spans is not None and spans.traced
        streams: list[RequestStream] = []
        try:
            for i, prompt_ids in enumerate(prompts):
                sub_id = prompt_request_id(engine_id, i, len(prompts))
                # A streaming proxy that has shown the first tokens the prefill instance sampled
                # says so: the stream goes on after them. (Anyone else gets them in the stream.)
                shown = bool(request.stream) and raw.headers.get(FIRST_TOKENS_SHOWN) == "1"
                streams.append(await self.client.add_request(sub_id, prompt_ids, params, kv_params[i],
                                                             first_tokens_shown=shown, cache_salt=request.cache_salt,
                                                             traced=traced, arrival=arrival))
        except EngineRequestError as exc:
            for s in streams:
                s.close()
            if spans is not None:
                spans.end({"http.response.status_code": exc.status, "error.type": str(exc)[:200]}, {})
            raise APIError(exc.status, str(exc), exc.param)
        timeline.mark("api.queued", *(s.request_id for s in streams))
        response = _Response(self, request_id, request, prompts, params.n, chat, arrival, continues=shown,
                             spans=spans)
        if response.echo:
            response.prompt_texts = await self._off_loop(self._prompt_texts, request.prompt, prompts)
        if request.stream:
            return StreamingResponse(response.stream(streams), media_type="text/event-stream",
                                     headers={"X-Request-Id": request_id})
        return await _until_disconnect(raw, response.collect(streams), streams)

    def _request_spans(self, raw: Request, request, client_id: str | None, engine_id: str,
                       params: SamplingParams, received: float) -> tracing.RequestSpans | None:
        """The request's span (a child of its traceparent) when tracing is on; ``client_id``: the
        client's own id as validated (1-256 visible characters), never the raw header; None when
        it gave none."""
        if not tracing.enabled():
            return None
        transfer = self.client.config.kv_transfer_config
        role = "both" if transfer is None else {"kv_producer": "prefill", "kv_consumer": "decode"}.get(
            transfer.kv_role, "both")
        return tracing.start_request_spans(raw.headers, received, engine_id, role, {
            "gen_ai.response.model": request.model or self.model_names[0], "gen_ai.request.n": params.n,
            "gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p, "engine.client_request_id": client_id})

    async def release_kv(self, raw: Request) -> Response:
        """POST /v1/kv/release {"kv_transfer_params": ...}: a router will not use a hand-off this
        prefill instance answered (its client left, or no decode instance took it); the KV it
        holds is freed now instead of when the lease ends. Only parameters this deployment
        signed are acted on (no secret: this host only, as for the KV plane itself)."""
        data = await self._read(raw)
        try:
            params = parse_kv_transfer_params(data.get("kv_transfer_params"))
            if params is None or not params.do_remote_prefill:
                raise KVTransferParamsError("kv_transfer_params must be a prefill instance's hand-off "
                                            "(do_remote_prefill)", "kv_transfer_params")
            check_kv_transfer_params_signature(params, self.client.config.kv_secret)
        except KVTransferParamsError as exc:
            raise APIError(400, str(exc), exc.param) from None
        self.client.release_offer(params)
        return Response(status_code=202)

    async def tokenize(self, raw: Request) -> dict:
        """vLLM's /tokenize: the token ids this server would run for a completion's one prompt
        or a chat's messages (its chat template applied); a KV-aware router hashes them."""
        data = await self._read(raw)
        if "messages" in data:
            request = self._validate(data, ChatCompletionRequest)
            tokens = await self._off_loop(self._chat_prompt, request)
        else:
            request = self._validate(data, CompletionRequest)
            prompts = await self._off_loop(self._completion_prompts, request.prompt)
            if len(prompts) != 1:
                raise APIError(400, f"tokenize takes one prompt, got {len(prompts)}", "prompt")
            tokens = prompts[0]
        return {"count": len(tokens), "max_model_len": self.client.info.max_model_len, "tokens": tokens}

    def kv_events_info(self) -> dict | None:
        """Where this instance publishes KV events, and what a router needs to compute the block
        hashes they name: the hash algorithm ("engine": engine/block_pool.py's, or vLLM's:
        engine/vllm_block_hash.py), the block size and, for the engine's, the root hash (the
        parent of every first block). vLLM's root is H(PYTHONHASHSEED), or H("vllm-none-hash")
        when that is unset (as vLLM 0.32), which the router computes alike: never shown (with a
        seed set, the seed, a small number, is found from it by trying them all, and with it the
        process's string-hash randomization is gone)."""
        config, info = self.client.config, self.client.info
        events = config.kv_events_config
        if events is None or info is None:
            return None
        algo = config.prefix_caching_hash_algo
        root = None if algo else root_block_hash(info.fingerprint).hex()
        return {"endpoint": info.kv_events_endpoint or events.endpoint,
                "replay_endpoint": info.kv_events_replay_endpoint or events.replay_endpoint, "topic": events.topic,
                "block_size": config.block_size, "hash_algo": algo or "engine", "root_block_hash": root}

    def models(self) -> dict:
        max_len = self.client.info.max_model_len if self.client.info else None
        return ModelList(data=[ModelCard(id=name, root=name, max_model_len=max_len)
                               for name in self.model_names]).model_dump()


async def _until_disconnect(raw: Request, work, streams: list[RequestStream]) -> Response:
    """Run a non-streaming handler, but stop (and abort the engine requests) as soon as the
    client disconnects: nobody is left to read the answer."""
    async def wait_for_disconnect() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        logger.info("client disconnected; aborting %s", [s.request_id for s in streams])
        return Response(status_code=499)
    finally:
        watcher.cancel()
        for s in streams:
            s.close()


class _Response:
    """Turns engine deltas into OpenAI JSON, streamed or whole. (Its latencies and token counts
    are measured in the front end's output processor: entrypoints/metrics.py.)"""

    def __init__(self, server: OpenAIServer, request_id: str, request, prompts: list[list[int]], n: int, chat: bool,
                 arrival: float, continues: bool = False, spans: tracing.RequestSpans | None = None) -> None:
        """``continues``: a stream that goes on after first tokens a proxy showed (which also
        showed the prompt's token ids, where asked)."""
        self.server, self.request_id, self.request = server, request_id, request
        self.prompts, self.n, self.chat = prompts, n, chat
        self.token_ids, self.continues = request.return_token_ids, continues
        self.prompt_ids_to_show = set(range(len(prompts) * n)) if self.token_ids else set()
        self.created = int(time.time())
        self.model = request.model or server.model_names[0]
        self.object = "chat.completion" if chat else "text_completion"
        self.completion_tokens = 0
        self.cached_tokens: dict[int, int] = {}
        self.first_output_marked = False
        self.kv_transfer_params: dict[int, KVTransferParams] = {}  # by prompt index
        # echo (completions): a choice's text (and logprobs) start with its prompt's; with
        # max_tokens 0 they are only that (the one token sampled is dropped).
        self.echo = not chat and bool(request.echo)
        self.echo_only = self.echo and request.echo_only
        self.prompt_texts: list[str] = []  # set by the server when echo
        self.prompt_logprobs: dict[int, list] = {}  # by prompt index, as RequestDelta brings them
        self.started: set[int] = set()  # choices whose first chunk went out (streaming)
        self.completion_tokens_shown = False  # a chunk with a token went out (streaming)
        self._echoed_prompts: dict[int, tuple[str, dict, int]] = {}  # _echoed, per prompt
        # The request's spans, when traced (entrypoints/tracing.py), and what they report at the end.
        self.spans = spans
        self.arrival, self.first_token_at, self.queue_time = arrival, None, 0.0
        self.finish_reasons: list[str] = []

    def _record(self, prompt_index: int, delta) -> None:
        if not self.first_output_marked and any(c.token_ids for c in delta.choices):
            self.first_output_marked = True
            timeline.mark("api.first_output", delta.request_id)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs.setdefault(prompt_index, delta.prompt_logprobs)
        if not self.echo_only:
            self.completion_tokens += sum(len(c.token_ids) for c in delta.choices)
        self.cached_tokens[prompt_index] = delta.num_cached_tokens
        if delta.kv_transfer_params is not None:
            self.kv_transfer_params[prompt_index] = delta.kv_transfer_params
        if self.spans is not None:
            self._trace_delta(prompt_index, delta)

    def _trace_delta(self, prompt_index: int, delta) -> None:
        """What the request's span reports at its end (the metrics are measured elsewhere)."""
        if self.first_token_at is None and any(c.token_ids for c in delta.choices):
            self.first_token_at = time.monotonic()
        if delta.queue_time is not None:
            self.queue_time = max(self.queue_time, delta.queue_time)
        self.finish_reasons += [c.finish_reason for c in delta.choices if c.finish_reason is not None]
        self.spans.record(prompt_index, delta.traces)

    def _end_spans(self, aborted: bool = False, error: APIError | None = None) -> None:
        """Ends the request's span (once; when traced): at its end, its client's leaving, or an error."""
        spans, self.spans = self.spans, None
        if spans is None:
            return
        if aborted:
            self.finish_reasons += ["abort"] * (len(self.prompts) * self.n - len(self.finish_reasons))
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        attributes = {
            "gen_ai.usage.prompt_tokens": sum(len(p) for p in self.prompts),
            "gen_ai.usage.completion_tokens": self.completion_tokens,
            "gen_ai.usage.num_sequences": len(self.prompts) * self.n,
            "gen_ai.latency.time_to_first_token": ttft, "gen_ai.latency.time_in_queue": self.queue_time,
            "gen_ai.latency.e2e": time.monotonic() - self.arrival,
            "gen_ai.response.finish_reasons": list(self.finish_reasons)}
        if error is not None:
            attributes.update({"http.response.status_code": error.status, "error.type": error.message[:200]})
        spans.end(attributes, self.kv_transfer_params)

    def usage(self) -> dict:
        prompt_tokens = sum(len(p) for p in self.prompts)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=prompt_tokens + self.completion_tokens,
                         prompt_tokens_details={"cached_tokens": sum(self.cached_tokens.values())}).model_dump()

    def _logprobs(self, entries: list[list[LogprobEntry]] | None, text_offset: int):
        """Per token the engine sends the sampled entry first, then the top-k (which may hold
        the sampled token again, merged away); the top-k are the k best ranks."""
        if entries is None:
            return None
        k = (self.request.top_logprobs or 0) if self.chat else self.request.logprobs
        sampled = [e[0] for e in entries]
        tops = [sorted(e, key=lambda t: t[2])[:k] for e in entries]
        if self.chat:
            return {"content": [{"token": s[3], "logprob": s[1], "bytes": list(s[3].encode()),
                                 "top_logprobs": [{"token": t[3], "logprob": t[1], "bytes": list(t[3].encode())}
                                                  for t in top]} for s, top in zip(sampled, tops)]}
        offsets, offset = [], text_offset
        for s in sampled:
            offsets.append(offset)
            offset += len(s[3])
        return {"tokens": [s[3] for s in sampled], "token_logprobs": [s[1] for s in sampled],
                "top_logprobs": [{t[3]: t[1] for t in top} or None for top in tops], "text_offset": offsets}

    def _prompt_logprobs_field(self, prompt_index: int) -> list | None:
        """vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {logprob,
        rank, decoded_token}} for the token and the top k at its position."""
        entries = self.prompt_logprobs.get(prompt_index)
        if entries is None:
            return None
        return [None if e is None else {str(t[0]): {"logprob": t[1], "rank": t[2], "decoded_token": t[3]} for t in e}
                for e in entries]

    def _finish(self, reason: str | None, stop_reason):
        """With echo and max_tokens 0 nothing was generated: the token sampled and dropped ends
        the choice by its length, whatever stop it met."""
        if self.echo_only and reason in ("stop", "length"):
            return "length", None
        return reason, stop_reason

    def _echoed(self, index: int, text: str, entries, text_offset: int, first: bool) -> tuple[str, dict | None]:
        """A completion choice's text and logprobs with echo: the prompt's before its own (in
        its first chunk, or whole), its own offsets after the prompt tokens' strings."""
        prompt_index = index // self.n
        own_text, own = ("", []) if self.echo_only else (text, entries)
        if self.request.logprobs is None:
            return (self.prompt_texts[prompt_index] if first else "") + own_text, None
        if prompt_index not in self._echoed_prompts:  # once per prompt, not per streamed chunk
            first_token = self.server.tokenizer.decode(self.prompts[prompt_index][:1])
            echoed = self._logprobs((self.prompt_logprobs.get(prompt_index) or [])[1:], len(first_token))
            self._echoed_prompts[prompt_index] = (first_token, echoed,
                                                  len(first_token) + sum(len(t) for t in echoed["tokens"]))
        first_token, echoed, chars = self._echoed_prompts[prompt_index]
        logprobs = self._logprobs(own or [], text_offset + chars)
        if first:
            logprobs = {"tokens": [first_token] + echoed["tokens"] + logprobs["tokens"],
                        "token_logprobs": [None] + echoed["token_logprobs"] + logprobs["token_logprobs"],
                        "top_logprobs": [None] + echoed["top_logprobs"] + logprobs["top_logprobs"],
                        "text_offset": [0] + echoed["text_offset"] + logprobs["text_offset"]}
            return self.prompt_texts[prompt_index] + own_text, logprobs
        return own_text, logprobs

    async def _merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, object]]:
        """Deltas of all prompts of the request as they come, tagged with the prompt index."""
        if len(streams) == 1:
            async for delta in streams[0]:
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    await queue.put((i, delta))
            except Exception as exc:
                await queue.put((i, exc))
            await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    # ---- non-streaming -----------------------------------------------------------------
    async def collect(self, streams: list[RequestStream]) -> Response:
        texts: dict[int, str] = {}
        tokens: dict[int, list[int]] = {}
        finish: dict[int, tuple[str | None, object]] = {}
        logprobs: dict[int, list] = {}
        try:
            async for i, delta in self._merged(streams):
                self._record(i, delta)
                if delta.error is not None and delta.finished and all(c.finish_reason == "error" for c in delta.choices):
                    error = APIError(error_status(delta.error), delta.error)
                    self._end_spans(error=error)
                    raise error
                for c in delta.choices:
                    index = i * self.n + c.index
                    texts[index] = texts.get(index, "") + c.text
                    tokens.setdefault(index, []).extend(c.token_ids)
                    if c.logprobs is not None:
                        logprobs.setdefault(index, []).extend(c.logprobs)
                    if c.finish_reason is not None:
                        finish[index] = (c.finish_reason, c.stop_reason)
        except EngineRequestError as exc:
            error = APIError(exc.status, str(exc), exc.param)
            self._end_spans(error=error)
            raise error from None
        except asyncio.CancelledError:  # the client left (_until_disconnect)
            self._end_spans(aborted=True)
            raise
        self._end_spans()
        choices = []
        for index in sorted(texts.keys() | finish.keys()):
            reason, stop_reason = finish.get(index, (None, None))
            text, entries = texts.get(index, ""), logprobs.get(index)
            reason, stop_reason = self._finish(reason, stop_reason)
            choice = {"index": index, "finish_reason": reason, "stop_reason": stop_reason,
                      "logprobs": self._logprobs(entries, 0)}
            if self.echo:
                text, choice["logprobs"] = self._echoed(index, text, entries, 0, first=True)
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
                if self.token_ids:
                    choice["prompt_token_ids"] = self.prompts[index // self.n]
                if self.request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs_field(index // self.n)
            if self.token_ids:
                choice["token_ids"] = [] if self.echo_only else tokens.get(index, [])
            choices.append(choice)
        body = {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}
        if self.token_ids and self.chat:
            body["prompt_token_ids"] = self.prompts[0]
        if self.chat and self.request.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs_field(0)
        if self.kv_transfer_params:
            # One per prompt, in prompt order (a list only when the request had several).
            params = [msgspec.to_builtins(self.kv_transfer_params.get(i)) for i in range(len(self.prompts))]
            body["kv_transfer_params"] = params if len(params) > 1 else params[0]
        answer = JSONResponse(body, headers={"X-Request-Id": self.request_id})
        timeline.mark("api.answer", *(s.request_id for s in streams))
        return answer

    # ---- streaming ---------------------------------------------------------------------
    async def stream(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        include_usage = bool(self.request.stream_options and self.request.stream_options.include_usage)

        def chunk(choices: list[dict], **extra) -> str:
            return sse({"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                         "choices": choices, **extra})

        try:
            if self.chat:  # the role comes first, once per choice (and the prompt's ids, where asked)
                shown = {"prompt_token_ids": self.prompts[0]} if self.token_ids and not self.continues else {}
                yield chunk([role_choice(i) for i in range(len(self.prompts) * self.n)], **shown)
            async for i, delta in self._merged(streams):
                self._record(i, delta)
                if delta.error is not None and all(c.finish_reason == "error" for c in delta.choices):
                    error = APIError(error_status(delta.error), delta.error)
                    self._end_spans(error=error)
                    yield sse(error.body())
                    break
                out = []
                for c in delta.choices:
                    out.append(self._stream_choice(i * self.n + c.index, c))
                if out:
                    extra = ({"kv_transfer_params": msgspec.to_builtins(delta.kv_transfer_params)}
                             if delta.kv_transfer_params else {})
                    if self.chat and delta.prompt_logprobs is not None and self.request.prompt_logprobs is not None:
                        extra["prompt_logprobs"] = self._prompt_logprobs_field(0)
                    if not self.completion_tokens_shown:
                        self.completion_tokens_shown = True
                        timeline.mark("api.answer", delta.request_id)
                    yield chunk(out, **extra)
            else:
                if include_usage:
                    yield chunk([], usage=self.usage())
            self._end_spans()
        except EngineRequestError as exc:
            error = APIError(exc.status, str(exc), exc.param)
            self._end_spans(error=error)
            yield sse(error.body())
        finally:
            for s in streams:  # a client that went away cancels us here: abort in the engine
                s.close()
            self._end_spans(aborted=True)  # (nothing when it ended above)
        yield sse("[DONE]")

    def _stream_choice(self, index: int, c: ChoiceDelta) -> dict:
        # c.text_offset: past the text a prefill instance's first token showed, on a decode.
        token_ids = prompt_ids = None
        if self.token_ids:
            token_ids = c.token_ids[c.token_ids_shown:]
            if index in self.prompt_ids_to_show:  # a choice's first chunk
                self.prompt_ids_to_show.discard(index)
                # (unless a proxy showed this choice's start, prompt ids included; chat's go with the role)
                if not self.chat and not (self.continues and c.token_ids_shown):
                    prompt_ids = self.prompts[index // self.n]
        first = index not in self.started
        self.started.add(index)
        text, logprobs = c.text, self._logprobs(c.logprobs, c.text_offset)
        if self.echo:
            text, logprobs = self._echoed(index, c.text, c.logprobs, c.text_offset, first)
            token_ids = [] if self.echo_only and token_ids is not None else token_ids
        choice = stream_choice(index, text, logprobs, *self._finish(c.finish_reason, c.stop_reason), self.chat,
                               token_ids, prompt_ids)
        if first and not self.chat and self.request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs_field(index // self.n)
        return choice


def build_app(server: OpenAIServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # Runs on SIGTERM/Ctrl-C after in-flight responses drained (or timed out).
        await server.client.shutdown()

    app = FastAPI(title="engine", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.openai = server

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if server.api_key and request.url.path.startswith(("/v1", "/tokenize")):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {server.api_key}".encode()):  # constant time
                return APIError(401, "Unauthorized: missing or wrong API key").response()
        return await call_next(request)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception):
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await server.completions(raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await server.chat_completions(raw)

    @app.post("/v1/kv/release")
    async def release_kv(raw: Request):
        return await server.release_kv(raw)

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await server.tokenize(raw)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        if server.client.dead is not None:
            return APIError(503, f"engine is dead: {server.client.dead.splitlines()[0]}").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    document_request_bodies(app, {"/v1/completions": CompletionRequest,
                                  "/v1/chat/completions": ChatCompletionRequest})

    @app.get("/status")
    async def status():
        stats = server.client.stats
        return {"model": server.model_names[0], "dead": server.client.dead,
                "engine_pid": server.client.engine_pid,
                "requests": {"running": stats.num_running, "waiting": stats.num_waiting,
                             "waiting_for_remote_kv": stats.num_waiting_for_remote_kv,
                             "held_for_transfer": stats.num_held, "in_flight_http": server.client.num_in_flight,
                             "tracked_by_engine": stats.num_tracked_requests},
                "kv_blocks": {"total": stats.num_blocks, "free": stats.num_free_blocks,
                              "cached": stats.num_cached_blocks, "held": stats.kv_blocks_held,
                              "in_use": stats.num_blocks - stats.num_free_blocks},
                "num_preemptions": stats.num_preemptions,
                "kv_transfer": {"blocks_held": stats.kv_blocks_held, "bytes": stats.kv_transfer_bytes,
                                "failures": stats.kv_transfer_failures,
                                "auth_failures": stats.kv_auth_failures,
                                "pulls": {peer: msgspec.structs.asdict(p) for peer, p in stats.kv_pulls.items()}},
                "kv_store": {tier: {"hits": t.hits, "misses": t.misses, "bytes_stored": t.bytes_stored,
                                    "bytes_loaded": t.bytes_loaded, "used_bytes": t.used_bytes,
                                    "rejected": t.rejected}
                             for tier, t in stats.kv_store.items()},
                "kv_load_decision": stats.kv_load_decision,
                "kv_events": server.kv_events_info()}

    return app
