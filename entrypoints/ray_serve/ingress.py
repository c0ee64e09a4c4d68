"""The OpenAI ingress of ``engine ray-serve``: engine proxy's request flow (entrypoints/proxy.py)
over Ray Serve deployment handles instead of URLs. Serve chooses the replica of each call (its
replica set, health and queue lengths; the request router configured on the deployment).

Per request, as the proxy does it: conditional disaggregation (a decode replica serves a prompt
with at most ``max_local_prefill_tokens`` uncached tokens itself, else answers 409 and the prompt
goes through a prefill replica); the client's first tokens come from the prefill; a decode
replica continues from its KV; a hand-off nobody will use is released at once.
"""

import asyncio
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import BackPressureError

from engine.kv_transfer.secret import KVSecret
from entrypoints import tracing
from entrypoints.kv_router import KVRouter, PromptBlocks
from entrypoints.protocol import FIRST_TOKENS_SHOWN
from entrypoints.proxy import (
    DisaggPolicy,
    FirstTokens,
    _after_first_event,
    _declined,
    _error_event,
    _passthrough_error,
    error_response,
    read_client_request,
)

logger = logging.getLogger("engine.ray_serve")
# Serve serializes the ingress class as it is at decoration: what its methods call is defined
# above it.
app = FastAPI(title="engine on Ray Serve", docs_url=None, redoc_url=None)


async def _on_a_live_replica(role: str, call):
    """``call()`` (a handle call's result, or a stream's first item); a replica that died or
    became unreachable before it answered (its node gone) costs one retry, which Serve routes to
    another replica or to the replacement it starts. Nothing reached the client yet; a decode
    retried with the same hand-off pulls the KV again (the prefill holds it under its lease) or,
    if the dead one had taken it already, computes the prompt itself."""
    try:
        return await call()
    except RayActorError as exc:
        logger.warning("%s replica lost before it answered, once more: %s", role, exc)
    return await call()


def _as_response(status: int, content: bytes) -> httpx.Response:
    return httpx.Response(status, content=content)


def _replica_error(role: str, exc: Exception) -> JSONResponse:
    if isinstance(exc, BackPressureError):
        return error_response(503, f"every {role} replica is at its max_ongoing_requests: retry later")
    return error_response(502, f"{role} replica failed: {type(exc).__name__}: {str(exc)[:300]}")


async def _relay(stream):
    """A replica's streamed body; a replica that dies mid-stream ends it with an error event."""
    try:
        async for data in stream:
            yield data
    except (RayError, BackPressureError) as exc:
        yield b"\n\n" + _error_event(_replica_error("decode", exc))


@serve.ingress(app)
class PDIngress:
    def __init__(self, prefill, decode, disagg: DisaggPolicy = DisaggPolicy(), routing: str = "least-loaded",
                 secret=None, otlp_traces_endpoint: str | None = None) -> None:
        """``prefill`` None: no prefill deployment (every request on a decode replica).
        ``routing`` kv-aware: the deployments route by the replicas' KV events
        (entrypoints/ray_serve/router.py), which this process follows with ``secret``."""
        self.prefill, self.decode, self.disagg = prefill, decode, disagg
        self.routing = routing
        if otlp_traces_endpoint:
            tracing.init_tracer(otlp_traces_endpoint, "engine-ingress")
        self.kv: KVRouter | None = None
        if routing == "kv-aware":  # one index per replica URL, prefill and decode replicas alike
            from entrypoints.ray_serve.router import register
            self.kv = KVRouter(secret=KVSecret(secret.reveal()) if secret else None)
            register("prefill", self.kv)
            register("decode", self.kv)

    @app.post("/v1/completions")
    async def completions(self, raw: Request) -> Response:
        return await self.handle(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(self, raw: Request) -> Response:
        return await self.handle(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(self, raw: Request) -> Response:
        headers = {"Authorization": raw.headers["authorization"]} if "authorization" in raw.headers else {}
        try:
            status, content = await self.decode.get.remote("/v1/models", headers)
        except (RayError, BackPressureError) as exc:
            return _replica_error("decode", exc)
        return Response(content, status_code=status, media_type="application/json")

    @app.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"ok": True})

    @app.get("/status")
    async def status(self) -> Response:
        """This ingress replica's view of KV-aware routing: per engine URL, the blocks its index
        holds and the requests it routed there with their predicted hits (as engine proxy's)."""
        return JSONResponse({"kv_routing": self.kv.status() if self.kv is not None else None})

    async def handle(self, raw: Request, path: str) -> Response:
        """A client's request, in the ingress's span when tracing is on (entrypoints/tracing.py)."""
        return await tracing.traced_request(raw.headers, f"ray-serve:{self.routing}", lambda: self._handle(raw, path))

    async def _handle(self, raw: Request, path: str) -> Response:
        read = await read_client_request(raw, "rs")
        if isinstance(read, Response):
            return read
        body, headers = read
        request_id = body["request_id"]
        prompt = await self.prompt_of(body, headers)
        if self.prefill is None or body.get("echo") or body.get("prompt_logprobs") is not None:
            # No prefill deployment; or every prompt position's logits asked for: one instance.
            return await self.on_decode(path, body, headers, prompt)
        if self.disagg.conditional:
            limit = {"max_local_prefill_tokens": self.disagg.max_local_prefill_tokens}
            answer = await self.on_decode(path, {**body, "kv_transfer_params": limit}, headers, prompt,
                                          may_decline=True)
            if answer is not None:
                return answer
        prefilled = await self.prefill_remotely(path, body, headers, prompt)
        if not isinstance(prefilled, dict):
            if self.disagg.conditional and prefilled is None:
                return await self.on_decode(path, body, headers, prompt)  # no prefill replica: prefill locally
            return prefilled or error_response(502, "no prefill replica answered")
        params = prefilled.pop("kv_transfer_params")
        first = FirstTokens(prefilled, chat=path.endswith("chat/completions"))
        if first.final:  # every sequence ended with its first token
            self.release(params, headers)
            return first.final_response(body, request_id)
        d_body = {**body, "kv_transfer_params": params}
        if body.get("stream"):
            return StreamingResponse(self.continue_stream(path, d_body, {**headers, FIRST_TOKENS_SHOWN: "1"},
                                                          first, params, prompt),
                                     media_type="text/event-stream", headers={"X-Request-Id": request_id})
        answer = await self.on_decode(path, d_body, headers, prompt)
        if answer.status_code != 200:
            self.release(params, headers)
        return answer

    async def prompt_of(self, body: dict, headers: dict) -> PromptBlocks | None:
        """The prompt's block hashes for KV-aware routing, from a decode replica's tokenizer
        (only the engine knows its chat template). None without KV-aware routing, or when the
        prompt cannot be tokenized there: routed by load then."""
        if self.kv is None:
            return None
        probe = {k: body[k] for k in ("model", "prompt", "messages", "chat_template", "add_generation_prompt")
                 if k in body}
        try:
            status, content = await self.decode.call.remote("/tokenize", probe, headers)
            answer = json.loads(content)
            tokens, max_len = answer["tokens"], int(answer["max_model_len"])
        except (RayError, BackPressureError, ValueError, KeyError, TypeError):
            return None
        if status != 200 or not isinstance(tokens, list) or len(tokens) > max_len:
            return None
        salt = body.get("cache_salt")
        return await asyncio.to_thread(self.kv.prompt_blocks, tokens, salt if isinstance(salt, str) else None)

    async def prefill_remotely(self, path: str, body: dict, headers: dict,
                               prompt: PromptBlocks | None) -> dict | Response | None:
        """The prefill replica's answer (first tokens and kv_transfer_params), its error, or
        None when no prefill replica could take it."""
        p_body = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        p_body.pop("stream_options", None)
        try:
            status, content = await _on_a_live_replica(
                "prefill", lambda: self.prefill.call.remote(path, p_body, headers, prompt_blocks=prompt))
        except (RayError, BackPressureError) as exc:
            logger.warning("prefill failed: %s", exc)
            return None
        if status != 200:
            return _passthrough_error(_as_response(status, content))
        answer = _as_response(status, content).json()
        if not answer.get("kv_transfer_params"):
            return error_response(502, "the prefill replica returned no kv_transfer_params")
        return answer

    async def on_decode(self, path: str, body: dict, headers: dict, prompt: PromptBlocks | None,
                        may_decline: bool = False) -> Response | None:
        """The whole request on a decode replica (streamed through when asked). None: it
        declined to prefill the prompt itself (only with ``may_decline``)."""
        if body.get("stream"):
            try:
                stream, status = await _on_a_live_replica(
                    "decode", lambda: self.open_stream(path, body, headers, prompt))
            except (RayError, BackPressureError) as exc:
                return _replica_error("decode", exc)
            if status != 200:
                content = b"".join([chunk async for chunk in stream])
                error = _as_response(status, content)
                return None if may_decline and _declined(error) else _passthrough_error(error)
            return StreamingResponse(_relay(stream), media_type="text/event-stream",
                                     headers={"X-Request-Id": headers["X-Request-Id"]})
        try:
            status, content = await _on_a_live_replica(
                "decode", lambda: self.decode.call.remote(path, body, headers, prompt_blocks=prompt))
        except (RayError, BackPressureError) as exc:
            return _replica_error("decode", exc)
        if status != 200:
            error = _as_response(status, content)
            return None if may_decline and _declined(error) else _passthrough_error(error)
        return Response(content, media_type="application/json", headers={"X-Request-Id": headers["X-Request-Id"]})

    async def continue_stream(self, path: str, body: dict, headers: dict, first: FirstTokens, params,
                              prompt: PromptBlocks | None):
        """The first tokens at once, then the decode replica's stream after them."""
        taken = False  # by a decode replica; else released below (also when the client left first)
        stream = None
        try:
            if first.chat:
                yield first.role_chunk()
            yield first.continuing_chunk()
            try:
                stream, status = await _on_a_live_replica(
                    "decode", lambda: self.open_stream(path, body, headers, prompt))
            except (RayError, BackPressureError) as exc:
                yield _error_event(_replica_error("decode", exc))
                return
            if status != 200:
                content = b"".join([chunk async for chunk in stream])
                yield _error_event(_passthrough_error(_as_response(status, content)))
                return
            taken = True
            chunks = _relay(stream)
            async for data in (_after_first_event(chunks) if first.chat else chunks):
                yield data
        finally:
            if not taken:
                self.release(params, headers)
            if stream is not None:
                stream.cancel()  # the client left mid-stream: the replica closes its engine request

    async def open_stream(self, path: str, body: dict, headers: dict, prompt: PromptBlocks | None):
        """A decode replica's stream and its HTTP status, its first item."""
        stream = self.decode.options(stream=True).stream.remote(path, body, headers, prompt_blocks=prompt)
        return stream, await stream.__anext__()

    def release(self, params, headers: dict) -> None:
        """Tells the prefill holding a hand-off's KV that nobody will pull it (through any
        prefill replica, which passes it on; not awaited)."""
        for one in params if isinstance(params, list) else [params]:
            if isinstance(one, dict) and one.get("do_remote_prefill"):
                self.prefill.release.remote(one, headers)

