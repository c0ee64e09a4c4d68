"""`engine proxy`: an OpenAI-compatible front for prefill and decode instances.

Conditional disaggregation (as Dynamo does it): a prompt goes through a prefill instance only
when that pays. With ``max_local_prefill_tokens`` > 0 (the default) the proxy asks a decode
instance to serve the request itself, telling it that limit; the decode instance looks up the
prompt in its prefix cache and either serves it (its uncached part is short) or answers 409
``prefill_remotely`` before queueing anything. Then, while the least-loaded prefill instance has
fewer than ``max_prefill_queue`` of this proxy's requests in flight, the request takes the remote
path below; a busy or unreachable prefill tier means the decode instance prefills it anyway
(asked again, without the limit). Each decision is counted by path and reason (``/metrics``:
``engine:disagg_decisions_total``; ``/status``), and ``/metrics`` shows the load the proxy sees on
each instance (``engine:proxy_upstream_*``). ``max_local_prefill_tokens`` 0 sends every
request through a prefill instance.

The remote path:
1. P gets the client's request (stream=false) with kv_transfer_params {"do_remote_decode":
   true}: it computes the prompt's KV and samples the first token of every sequence with the
   client's own parameters, holds the KV under a lease, and returns those first tokens with
   kv_transfer_params saying where the KV is.
2. If every first token ended its sequence (EOS, a stop, max_tokens 1), P's answer is the answer
   and D is never called. Otherwise a streaming client gets the first tokens at once, and D
   gets the original request plus those params: it pulls the KV into its own cache, continues
   from the first tokens, and its answer (whole, or the rest of the stream) is passed through.

Either path runs the same model on the same tokens (greedy and seeded outputs agree up to the
float rounding that another engine's batch or thread count brings). Every upstream call has a deadline; upstream errors reach the client as OpenAI error
bodies (never an empty 200); a client that disconnects closes the upstream connection, which
aborts the request there. The client's request id travels to P and D (X-Request-Id, echoed back), and
with it one the proxy made unique to the request (X-Engine-Request-Id: clients share ids), which P
and D both know it by.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine import timeline
from entrypoints import tracing
from entrypoints.kv_paths import TransferPaths
from entrypoints.kv_router import KVRouter, PromptBlocks
from entrypoints.protocol import (
    ENGINE_REQUEST_ID,
    FIRST_TOKENS_SHOWN,
    BodyError,
    ChatCompletionRequest,
    CompletionRequest,
    document_request_bodies,
    read_json_object,
    request_ids_of,
    role_choice,
    sse,
    stream_choice,
)

logger = logging.getLogger("engine.proxy")
STATUS_POLL_S = 3.0  # how often kv-aware routing re-reads each instance's /status
PREFILL_POLL_S = 0.5  # how often the prefill instances' held hand-offs are read
TRANSFER_POLL_S = 1.0  # how often the decode instances' pull totals are read (entrypoints/kv_paths.py)
# An upstream that could not be connected to goes to the end of the order for this long: while a
# link is cut (no refusal, only a connect timeout), requests go to the others without each
# paying that timeout first. It stays a last resort, and is tried first again after.
DOWN_S = 10.0


@dataclass
class Upstream:
    url: str
    in_flight: int = 0  # this proxy's requests open there
    # A prefill instance's requests whose KV it holds for a decode instance that has not taken
    # it yet, anyone's (its /status at the last poll), and the hand-offs this proxy got from it
    # since. They fill its pool as the requests did, so they count in its load like them.
    held: int = 0
    handed: int = 0
    polls: int = 0  # how many times ``held`` was read
    sent: int = 0  # requests this proxy sent there (a retry elsewhere counts there too)
    down_until: float = 0.0  # time.monotonic() until which it counts as unreachable (DOWN_S)

    def unreachable(self) -> None:
        self.down_until = time.monotonic() + DOWN_S

    @property
    def down(self) -> bool:
        return self.down_until > time.monotonic()

    @property
    def load(self) -> int:
        return self.in_flight + self.held + self.handed

    def hand_off(self):
        """Counts one hand-off in ``handed``; the returned callable (call it once D has the KV,
        or it was released) takes it back unless a poll of the instance counted it since."""
        self.handed += 1
        polls = self.polls

        def taken() -> None:
            nonlocal polls
            if polls == self.polls:
                self.handed -= 1
            polls = -1  # once
        return taken


@dataclass(frozen=True)
class DisaggPolicy:
    """When a request goes through a prefill instance (remote) rather than being prefilled by
    the decode instance that serves it (local)."""
    max_local_prefill_tokens: int = 512  # 0: always remote
    max_prefill_queue: int = 4  # the least-loaded prefill instance's requests in flight, from this proxy

    def __post_init__(self) -> None:
        if self.max_local_prefill_tokens < 0 or self.max_prefill_queue < 1:
            raise ValueError("--max-local-prefill-tokens must be >= 0 and --max-prefill-queue >= 1")

    @property
    def conditional(self) -> bool:
        return self.max_local_prefill_tokens > 0


# (path, reason) of every decision the proxy can take; all are exported, zeros included.
DECISIONS = (("remote", "always"), ("remote", "long_prompt"), ("local", "short_prompt"),
             ("local", "prefill_busy"), ("local", "prefill_unreachable"), ("local", "prompt_logprobs"))


def _chose(role: str, url: str) -> None:
    """The instance a request goes to, for its route span (when traced)."""
    span = tracing.current_proxy_span()
    if span is not None:
        span.chose(role, url)


def error_response(status: int, message: str, kind: str = "upstream_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


async def read_client_request(raw: Request, id_prefix: str) -> tuple[dict, dict] | JSONResponse:
    """A client's request as a front (engine proxy, the Ray ingress) passes it on: (the body,
    with its request id and without kv_transfer_params, which are the front's to set; the
    headers for the instances: request id, content type, the client's Authorization), or the
    400 for a body that is not a JSON object."""
    try:
        body = await read_json_object(raw)
        # The client's id (echoed), and one unique to this request that P and D both know it by.
        request_id, engine_id = request_ids_of(body.get("request_id"), raw.headers.get("x-request-id"), None,
                                               id_prefix)
    except BodyError as exc:
        return error_response(exc.status, exc.message, "invalid_request_error", exc.param)
    body["request_id"] = request_id
    body.pop("kv_transfer_params", None)
    headers = {"X-Request-Id": request_id, ENGINE_REQUEST_ID: engine_id, "Content-Type": "application/json"}
    if "authorization" in raw.headers:
        headers["Authorization"] = raw.headers["authorization"]
    return body, tracing.inject(headers)  # (the front's span: the instances' spans are its children)


class Proxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], policy: str = "least-loaded",
                 timeout: float = 300.0, connect_timeout: float = 5.0,
                 disagg: DisaggPolicy = DisaggPolicy(), router: KVRouter | None = None,
                 transfer_weight: float = 10.0) -> None:
        """``prefill_urls`` empty: ``decode_urls`` are plain replicas (engine proxy --instance),
        each serving whole requests. ``policy``: least-loaded, round-robin or kv-aware (then
        ``router`` follows the KV events of the decode instances or replicas). A hand-off goes
        to the decode instance with the least load plus ``transfer_weight`` per second its pull
        is expected to take beyond the fastest path's (entrypoints/kv_paths.py; 0: ignored)."""
        if not decode_urls:
            raise ValueError("the proxy needs --instance URLs, or at least one --prefill and one --decode URL")
        if policy not in ("least-loaded", "round-robin", "kv-aware"):
            raise ValueError(f"--routing must be kv-aware, least-loaded or round-robin, got {policy!r}")
        self.prefills = [Upstream(u.rstrip("/")) for u in prefill_urls]
        self.decodes = [Upstream(u.rstrip("/")) for u in decode_urls]
        self.policy = policy
        self.disagg = disagg
        if not 0 <= transfer_weight < float("inf"):
            raise ValueError("--transfer-weight must be a number >= 0")
        self.transfer_weight = transfer_weight
        self.paths = TransferPaths()
        self.router = router if policy == "kv-aware" else None
        if policy == "kv-aware" and self.router is None:
            self.router = KVRouter()
        self.decisions: Counter[tuple[str, str]] = Counter({d: 0 for d in DECISIONS})
        self.timeout = timeout
        # Round robin (and least-loaded's ties) per kind of choice: a request makes several
        # (its prefill, a local attempt, its hand-off), and one shared turn would then send
        # every hand-off to the same instance whenever their number divides the pool's size.
        self._turns: dict[str, itertools.count] = {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=connect_timeout),
                                      # Idle connections are dropped well before the instances' uvicorn
                                      # closes them (5 s): reusing one it is closing fails the request
                                      # (RemoteProtocolError, answered 502) with nothing sent or done.
                                      limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100,
                                                          keepalive_expiry=2.0))
        self._background: set[asyncio.Task] = set()  # KV releases on their way (see release)

    def ordered(self, pool: list[Upstream], turn: str, extra: dict[str, float] | None = None) -> list[Upstream]:
        """Candidates in the order to try them: least loaded first (ties round robin among the
        choices of one ``turn``), those that could not be reached lately last. ``extra``: load to
        add per url (a slow path's)."""
        start = next(self._turns.setdefault(turn, itertools.count())) % len(pool)
        rotated = pool[start:] + pool[:start]
        if self.policy != "round-robin":
            rotated = sorted(rotated, key=lambda u: u.load + (extra or {}).get(u.url, 0.0))
        return sorted(rotated, key=lambda u: u.down)

    def pick(self, pool: list[Upstream], prompt: PromptBlocks | None, turn: str,
             extra: dict[str, float] | None = None) -> Upstream:
        """Where to serve: with kv-aware routing the instance holding most of the prompt,
        traded against load (entrypoints/kv_router.py); else the first of ``ordered``."""
        ordered = self.ordered(pool, turn, extra)
        if self.router is None:
            _chose("decode", ordered[0].url)
            return ordered[0]
        upstream, hit = self.router.choose([u for u in ordered if not u.down] or ordered, prompt, extra)
        self.router.count(upstream.url, prompt, hit)
        _chose("decode", upstream.url)
        return upstream

    async def prompt_of(self, path: str, body: dict, headers: dict) -> PromptBlocks | None:
        """The block hashes of a request's prompt (for kv-aware routing), from the engine's
        token ids: asked of an instance, since only the engine knows its chat template. None
        when that fails (several prompts, too long, an instance down): routed by load then."""
        if self.router is None:
            return None
        probe = {k: body[k] for k in ("model", "prompt", "messages", "chat_template", "add_generation_prompt")
                 if k in body}
        for upstream in self.ordered(self.decodes, "tokenize")[:2]:
            try:
                resp = await self.http.post(f"{upstream.url}/tokenize", json=probe, headers=headers, timeout=10)
            except httpx.HTTPError:
                continue
            if resp.status_code != 200:
                return None
            try:
                answer = resp.json()
                tokens, max_len = answer["tokens"], int(answer["max_model_len"])
            except (ValueError, KeyError, TypeError):
                return None
            if not isinstance(tokens, list) or len(tokens) > max_len:
                return None  # the engine refuses it anyway: do not hash it
            salt = body.get("cache_salt")
            return await asyncio.to_thread(self.router.prompt_blocks, tokens, salt if isinstance(salt, str) else None)
        return None

    async def watch_prefills(self) -> None:
        """Every PREFILL_POLL_S, each prefill instance's own count of requests whose KV it holds
        for a transfer (``held``: anyone's hand-offs, prompt lists counted per prompt), for the
        proxy's life; one that does not answer counts none. What this proxy handed off since is
        counted until the poll or until D has it (whichever first: a hand-off whose stream never
        started is counted until the next poll at most)."""
        while True:
            for upstream in self.prefills:
                try:
                    resp = await self.http.get(f"{upstream.url}/status", timeout=5)
                    held = int(resp.json()["requests"]["held_for_transfer"]) if resp.status_code == 200 else 0
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    held = 0
                upstream.held, upstream.handed = held, 0
                upstream.polls += 1
            await asyncio.sleep(PREFILL_POLL_S)

    async def watch_transfers(self) -> None:
        """Every TRANSFER_POLL_S, each decode instance's pull totals per prefill instance (its
        /status kv_transfer.pulls), for the proxy's life: what ``transfer_load`` weighs."""
        async def poll(upstream: Upstream) -> None:
            try:
                resp = await self.http.get(f"{upstream.url}/status", timeout=5)
                if resp.status_code == 200:
                    self.paths.observe(upstream.url, resp.json()["kv_transfer"].get("pulls"))
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                pass  # not up, or not an engine of this release: its paths stay unknown

        while True:  # all at once: one instance that does not answer delays nobody else's reading
            await asyncio.gather(*(poll(u) for u in self.decodes))
            await asyncio.sleep(TRANSFER_POLL_S)

    def transfer_load(self, params) -> dict[str, float]:
        """Per decode url, the load a hand-off's pull adds beyond the fastest path's: its
        expected extra seconds times ``transfer_weight``, in whole requests (less is noise)."""
        offers = [p for p in (params if isinstance(params, list) else [params])
                  if isinstance(p, dict) and p.get("do_remote_prefill")]
        if not offers or not self.transfer_weight:
            return {}
        peer = offers[0].get("remote_kv_addr")
        tokens = sum(p["num_tokens"] for p in offers if type(p.get("num_tokens")) is int and p["num_tokens"] > 0)
        if not isinstance(peer, str) or not tokens:
            return {}
        excess = self.paths.excess_seconds([u.url for u in self.decodes], peer, tokens)
        return {url: float(math.floor(seconds * self.transfer_weight)) for url, seconds in excess.items()}

    async def watch_instances(self) -> None:
        """Follow the KV events of every decode instance (or replica) that publishes them, as
        its /status says, asked every few seconds for the proxy's life: an instance not up yet
        is followed once it is, one restarted on new event ports (--kv-events) at its new ones."""
        while True:
            for url in sorted(u.url for u in self.decodes):
                try:
                    resp = await self.http.get(f"{url}/status", timeout=5)
                    if resp.status_code != 200:
                        continue
                    self.router.watch(url, resp.json().get("kv_events"))
                    self.router.observe_load_decision(url, resp.json().get("kv_load_decision"))
                except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
                    if url not in self.router.indexes:
                        logger.warning("cannot follow the KV events of %s yet: %s", url, exc)
            await asyncio.sleep(STATUS_POLL_S)

    def _upstream_error(self, role: str, upstream: Upstream, exc: httpx.HTTPError) -> JSONResponse:
        if isinstance(exc, httpx.ConnectError):
            return error_response(502, f"{role} {upstream.url} unreachable: {exc}")
        if isinstance(exc, httpx.TimeoutException):
            return error_response(504, f"{role} {upstream.url} did not answer within {self.timeout:.0f}s")
        return error_response(502, f"{role} {upstream.url} failed: {type(exc).__name__}: {exc}")

    async def prefill(self, path: str, body: dict, headers: dict) -> tuple[dict, Upstream] | JSONResponse | None:
        """Run the prompt on a prefill instance; returns its answer (with kv_transfer_params) and
        the instance, an error, or None when no prefill instance could be reached. One that is
        down is replaced by the next; one that drops the connection before it answers too, once
        per request (nothing reached the client; if it had computed the prompt after all, its
        lease frees that KV). A timeout is not retried (the next would likely take as long)."""
        p_body = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        p_body.pop("stream_options", None)
        dropped = 0  # instances that dropped the connection mid-request: resent once at most
        for upstream in self.ordered(self.prefills, "prefill"):
            upstream.in_flight += 1
            upstream.sent += 1
            timeline.mark("proxy.prefill_sent", headers[ENGINE_REQUEST_ID])
            try:
                resp = await self.http.post(f"{upstream.url}{path}", json=p_body, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # down: try the next prefill instance
                logger.warning("prefill %s unreachable: %s", upstream.url, exc)
                upstream.unreachable()
                continue
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                # It died under the request (or a reused connection was being closed): once, the
                # next one; a request that kills every instance it reaches must not go round all.
                if dropped:
                    return self._upstream_error("prefill", upstream, exc)
                dropped += 1
                logger.warning("prefill %s dropped the connection mid-request: %s", upstream.url, exc)
                continue
            except httpx.HTTPError as exc:
                return self._upstream_error("prefill", upstream, exc)
            finally:
                upstream.in_flight -= 1
            if resp.status_code != 200:
                return _passthrough_error(resp)
            answer = resp.json()
            timeline.mark("proxy.prefill_answered", headers[ENGINE_REQUEST_ID])
            _chose("prefill", upstream.url)
            if not answer.get("kv_transfer_params"):
                return error_response(502, f"prefill {upstream.url} returned no kv_transfer_params "
                                           "(is it running with --role prefill?)")
            return answer, upstream
        return None

    def release(self, prefill: Upstream, params: dict, headers: dict) -> None:
        """Tells a prefill instance that its hand-off will not be used, so it frees that KV now
        rather than holding it for the whole lease (not awaited: nothing waits for it)."""
        async def post() -> None:
            for one in params if isinstance(params, list) else [params]:  # one per prompt of a list
                if not isinstance(one, dict) or not one.get("do_remote_prefill"):
                    continue  # nothing on offer (e.g. only first tokens)
                try:
                    resp = await self.http.post(f"{prefill.url}/v1/kv/release", json={"kv_transfer_params": one},
                                                headers=headers, timeout=5)
                    if resp.status_code != 202:
                        logger.warning("prefill %s refused a KV release: %s", prefill.url, resp.text[:200])
                except httpx.HTTPError as exc:  # it frees the KV when the lease ends anyway
                    logger.warning("KV release to prefill %s failed: %s", prefill.url, exc)
        task = asyncio.ensure_future(post())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _decided(self, path: str, reason: str, request_id: str) -> None:
        self.decisions[path, reason] += 1
        logger.info("%s: %s prefill (%s)", request_id, path, reason)
        span = tracing.current_proxy_span()
        if span is not None:
            span.decided(path, reason)

    async def handle(self, raw: Request, path: str) -> Response:
        """A client's request, in the proxy's span when tracing is on (entrypoints/tracing.py)."""
        return await tracing.traced_request(raw.headers, self.policy, lambda: self._handle(raw, path))

    async def _handle(self, raw: Request, path: str) -> Response:
        received = time.monotonic()
        read = await read_client_request(raw, "px")
        if isinstance(read, Response):
            return read
        body, headers = read
        request_id = body["request_id"]
        timeline.mark("proxy.received", headers[ENGINE_REQUEST_ID], at=received)
        timeline.mark("proxy.read", headers[ENGINE_REQUEST_ID])
        prompt = await self.prompt_of(path, body, headers)
        if not self.prefills:  # plain replicas
            return await self._local_or_502(raw, path, body, headers, prompt)
        if body.get("echo") or body.get("prompt_logprobs") is not None:
            # The prompt's logprobs (or its echo) need every prompt position's logits, which only
            # the instance that computes the whole prompt has: a decode instance prefills it itself.
            self._decided("local", "prompt_logprobs", request_id)
            return await self._local_or_502(raw, path, body, headers, prompt)
        reason = "always"
        if self.disagg.conditional:
            limit = {"max_local_prefill_tokens": self.disagg.max_local_prefill_tokens}
            answer = await self._serve_locally(raw, path, {**body, "kv_transfer_params": limit}, headers, prompt)
            if answer is not None:
                if answer.status_code == 200:
                    self._decided("local", "short_prompt", request_id)
                return answer
            # Declined (nothing was queued there): a long prompt.
            if min(u.load for u in self.prefills) >= self.disagg.max_prefill_queue:
                self._decided("local", "prefill_busy", request_id)
                return await self._local_or_502(raw, path, body, headers, prompt)
            reason = "long_prompt"
        timeline.mark("proxy.decided", headers[ENGINE_REQUEST_ID])
        started = time.monotonic()
        answer = await _until_disconnect(raw, self.prefill(path, body, headers))
        if answer is None:
            if not self.disagg.conditional:
                return error_response(502, "prefill unreachable: " + ", ".join(u.url for u in self.prefills))
            self._decided("local", "prefill_unreachable", request_id)
            return await self._local_or_502(raw, path, body, headers, prompt)
        if isinstance(answer, Response):
            return answer
        answer, prefilled_on = answer
        self._decided("remote", reason, request_id)
        logger.info("%s prefilled in %.3fs", request_id, time.monotonic() - started)
        params = answer.pop("kv_transfer_params")
        first = FirstTokens(answer, chat=path.endswith("chat/completions"))
        if first.final:  # every sequence ended with its first token: P's answer is the answer
            self.release(prefilled_on, params, headers)  # P keeps it on offer for vLLM's routers
            return first.final_response(body, request_id)
        d_body = {**body, "kv_transfer_params": params}
        taken = prefilled_on.hand_off()  # held there until D pulls it
        extra = self.transfer_load(params)

        def unused() -> None:  # D never took the hand-off
            taken()
            self.release(prefilled_on, params, headers)
        if body.get("stream"):
            # The client has the first tokens: D's stream goes on after them.
            headers = {**headers, FIRST_TOKENS_SHOWN: "1"}
            return await self._stream_decode(prompt, path, d_body, headers, request_id, first, unused, taken, extra)
        try:
            answer = await self._on_a_decode(prompt, lambda upstream: _until_disconnect(
                raw, self._decode(upstream, path, d_body, headers)), "hand-off", extra)
        finally:
            taken()  # D answered (it pulled the KV first), or failed (released below)
        answer = answer.response if isinstance(answer, _Unreachable) else answer
        if answer is None or answer.status_code != 200:
            unused()
        return answer

    async def _local_or_502(self, raw: Request, path: str, body: dict, headers: dict,
                            prompt: PromptBlocks | None) -> Response:
        """Served locally without a limit: a decline here would be a broken instance."""
        answer = await self._serve_locally(raw, path, body, headers, prompt)
        return answer if answer is not None else error_response(502, "the decode instance declined the request")

    async def _serve_locally(self, raw: Request, path: str, body: dict, headers: dict,
                             prompt: PromptBlocks | None) -> Response | None:
        """The whole request on a decode instance (or replica), which prefills it itself. None:
        it declined (the body carried max_local_prefill_tokens and more of the prompt is
        uncached there). An instance that cannot be reached is replaced by the next best one
        (nothing was sent to the client yet)."""
        answer = await self._on_a_decode(prompt, lambda u: self._serve_on(u, raw, path, body, headers), "local")
        return answer.response if isinstance(answer, _Unreachable) else answer

    async def _serve_on(self, upstream: Upstream, raw: Request, path: str, body: dict,
                        headers: dict) -> Response | _Unreachable | None:
        if not body.get("stream"):
            return await _until_disconnect(raw, self._decode(upstream, path, body, headers))
        opened = await self._open_stream(upstream, path, body, headers)
        if not isinstance(opened, _OpenStream):
            return opened
        return _RelayResponse(opened, self._relay(opened), media_type="text/event-stream",
                              headers={"X-Request-Id": headers["X-Request-Id"]})

    async def _open_stream(self, upstream: Upstream, path: str, body: dict,
                           headers: dict) -> _OpenStream | JSONResponse | _Unreachable | None:
        """A decode instance's streaming answer, open and counted in ``in_flight`` until its
        ``close()``; else what went wrong, counted back: an error, _Unreachable when the
        connection was refused, None when it declined to prefill the prompt."""
        upstream.in_flight += 1
        upstream.sent += 1
        try:
            resp = await self.http.send(self.http.build_request(
                "POST", f"{upstream.url}{path}", json=body, headers=headers), stream=True)
        except httpx.HTTPError as exc:
            upstream.in_flight -= 1
            error = self._upstream_error("decode", upstream, exc)
            if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                upstream.unreachable()
                return _Unreachable(error)
            return error
        except BaseException:  # the client left while we waited (cancelled)
            upstream.in_flight -= 1
            raise
        opened = _OpenStream(upstream, resp)
        if resp.status_code != 200:
            try:
                await resp.aread()
            finally:
                await opened.close()
            return None if _declined(resp) else _passthrough_error(resp)
        return opened

    async def _decode(self, upstream: Upstream, path: str, body: dict, headers: dict) -> Response | None:
        upstream.in_flight += 1
        upstream.sent += 1
        try:
            resp = await self.http.post(f"{upstream.url}{path}", json=body, headers=headers)
        except httpx.HTTPError as exc:
            error = self._upstream_error("decode", upstream, exc)
            if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                upstream.unreachable()
                return _Unreachable(error)
            return error
        finally:
            upstream.in_flight -= 1
        if resp.status_code != 200:
            return None if _declined(resp) else _passthrough_error(resp)
        return Response(resp.content, status_code=200, media_type="application/json",
                        headers={"X-Request-Id": headers["X-Request-Id"]})

    async def _relay(self, opened: _OpenStream, skip_role: bool = False):
        """D's open stream, passed on as its bytes come (nothing in it needs rewriting, so
        nothing is parsed); with ``skip_role``, its first event (the role chunk the client
        already has) is cut off first. Closed at the end (also when the client leaves)."""
        upstream, resp = opened.upstream, opened.resp
        between_events = True  # what went out so far ends with an event's blank line
        try:
            chunks = _after_first_event(resp.aiter_raw()) if skip_role else resp.aiter_raw()
            async for data in chunks:
                between_events = data.endswith(b"\n\n")
                yield data
        except httpx.HTTPError as exc:  # D died or stalled mid-stream: tell the client, then end
            err = {"error": {"message": f"decode {upstream.url} failed mid-stream: {type(exc).__name__}",
                             "type": "upstream_error", "param": None, "code": 502}}
            # A cut-off event is closed first (an empty line more is harmless between events).
            yield ("" if between_events else "\n\n") + sse(err) + sse("[DONE]")
        finally:
            # Also runs when the client disconnects: closing aborts the request on D.
            await opened.close()

    async def _on_a_decode(self, prompt: PromptBlocks | None, call, turn: str,
                           extra: dict[str, float] | None = None):
        """``call(upstream)`` on the best decode instance; one that cannot be reached (nothing
        was sent to it) is replaced by the next best, until none is left."""
        candidates = self.decodes
        while True:
            upstream = self.pick(candidates, prompt, turn, extra)
            answer = await call(upstream)
            if not isinstance(answer, _Unreachable):
                return answer
            candidates = [u for u in candidates if u is not upstream]
            if not candidates:
                return answer

    async def _stream_decode(self, prompt: PromptBlocks | None, path: str, body: dict, headers: dict,
                             request_id: str, first: "FirstTokens", unused, taken,
                             extra: dict[str, float]) -> Response:
        async def relay():
            opened = None
            try:
                # The first tokens go out before D is even asked (once, whichever D takes it).
                if first.chat:
                    yield first.role_chunk()
                chunk = first.continuing_chunk()
                timeline.mark("proxy.first_chunk", headers[ENGINE_REQUEST_ID])
                yield chunk
                opened = await self._on_a_decode(prompt, lambda u: self._open_stream(u, path, body, headers),
                                                 "hand-off", extra)
            finally:
                if not isinstance(opened, _OpenStream):  # D never took the hand-off, or the client left first
                    unused()
            if not isinstance(opened, _OpenStream):
                error = opened.response if isinstance(opened, _Unreachable) else opened
                yield _error_event(error or error_response(502, "the decode instance declined the request"))
                return
            try:
                async for event in self._relay(opened, skip_role=first.chat):
                    taken()  # D computed a token: it has the KV
                    yield event
            finally:
                taken()
                await opened.close()

        return StreamingResponse(relay(), media_type="text/event-stream", headers={"X-Request-Id": request_id})

    async def health(self) -> Response:
        async def ok(u: Upstream) -> bool:
            try:
                return (await self.http.get(f"{u.url}/health", timeout=2)).status_code == 200
            except httpx.HTTPError:
                return False
        p = await asyncio.gather(*(ok(u) for u in self.prefills))
        d = await asyncio.gather(*(ok(u) for u in self.decodes))
        body = {"prefill": dict(zip((u.url for u in self.prefills), p)),
                "decode": dict(zip((u.url for u in self.decodes), d))}
        return JSONResponse(body, status_code=200 if (any(p) or not self.prefills) and any(d) else 503)


class FirstTokens:
    """P's answer (its first tokens) as the stream chunks a client expects, in the format the
    API server streams: for chat a role chunk, then content deltas."""

    def __init__(self, answer: dict, chat: bool) -> None:
        self.answer, self.chat = answer, chat
        self.choices = answer.get("choices") or []
        self.final = all(c.get("finish_reason") is not None for c in self.choices)

    def _chunk(self, choices: list[dict], **extra) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        a = self.answer
        return sse({"id": a.get("id"), "object": obj, "created": a.get("created"), "model": a.get("model"),
                    "choices": choices, **extra})

    def _delta(self, choice: dict, finish: bool) -> dict:
        # With return_token_ids, P's answer has each choice's token ids (and a completion's prompt ids).
        text = ((choice.get("message") or {}).get("content") or "") if self.chat else choice.get("text", "")
        return stream_choice(choice["index"], text, choice.get("logprobs"),
                             choice.get("finish_reason") if finish else None,
                             choice.get("stop_reason") if finish else None, self.chat,
                             choice.get("token_ids"), choice.get("prompt_token_ids"))

    def role_chunk(self) -> str:
        prompt_ids = self.answer.get("prompt_token_ids")  # chat with return_token_ids
        return self._chunk([role_choice(c["index"]) for c in self.choices],
                           **({"prompt_token_ids": prompt_ids} if prompt_ids is not None else {}))

    def continuing_chunk(self) -> str:
        """The sequences D continues; those that ended with their first token come from D whole."""
        return self._chunk([self._delta(c, finish=False) for c in self.choices if c.get("finish_reason") is None])

    def final_response(self, body: dict, request_id: str) -> Response:
        """P's answer as the answer (every sequence ended with its first token), streamed if
        the client's ``body`` asked for a stream."""
        if body.get("stream"):
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return StreamingResponse(_replay(self.final_stream(usage)), media_type="text/event-stream",
                                     headers={"X-Request-Id": request_id})
        return JSONResponse(self.answer, headers={"X-Request-Id": request_id})

    def final_stream(self, include_usage: bool) -> list[str]:
        events = [self.role_chunk()] if self.chat else []
        events.append(self._chunk([self._delta(c, finish=True) for c in self.choices]))
        if include_usage:
            events.append(self._chunk([], usage=self.answer.get("usage")))
        return events + [sse("[DONE]")]


def _error_event(resp: JSONResponse) -> bytes:
    return bytes(b"data: " + resp.body + b"\n\ndata: [DONE]\n\n")


async def _replay(events: list[str]):
    for event in events:
        yield event


async def _after_first_event(raw):
    """A byte stream of server-sent events without its first event (which ends in a blank line)."""
    buffer = b""
    async for data in raw:
        if buffer is None:
            yield data
            continue
        buffer += data
        if b"\n\n" in buffer:
            rest, buffer = buffer.split(b"\n\n", 1)[1], None
            if rest:
                yield rest


class _OpenStream:
    """An upstream streaming answer counted in its upstream's ``in_flight``: ``close()`` (any
    number of times, from whichever path ends it) closes it and counts it back once."""

    def __init__(self, upstream: Upstream, resp: httpx.Response) -> None:
        self.upstream, self.resp, self.closed = upstream, resp, False

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.upstream.in_flight -= 1
            await self.resp.aclose()


class _RelayResponse(StreamingResponse):
    """Closes its upstream stream even when the client left before the body started (then the
    body iterator, which would close it, never runs)."""

    def __init__(self, opened: _OpenStream, content, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.opened = opened

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.opened.close()


@dataclass
class _Unreachable:
    """An instance refused the connection: nothing was sent, another may serve the request."""
    response: JSONResponse


def _declined(resp: httpx.Response) -> bool:
    """A decode instance's 409: it will not prefill this prompt itself."""
    try:
        return resp.status_code == 409 and resp.json()["error"]["type"] == "prefill_remotely"
    except (ValueError, KeyError, TypeError):
        return False


def _passthrough_error(resp: httpx.Response) -> Response:
    try:
        body = resp.json()
        if isinstance(body, dict) and "error" in body:
            return JSONResponse(body, status_code=resp.status_code)
    except ValueError:
        pass
    return error_response(resp.status_code if resp.status_code >= 400 else 502,
                          f"upstream answered {resp.status_code}: {resp.text[:200]}")


async def _until_disconnect(raw: Request, work):
    """Await `work`, but give up (cancelling it, which closes its upstream connection) as soon
    as the client disconnects."""
    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        return Response(status_code=499)
    finally:
        watcher.cancel()


class _ProxyCollector:
    """The proxy's routing: its decisions, and per instance the load it ranks them by."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    def collect(self):
        proxy = self.proxy
        family = CounterMetricFamily("engine:disagg_decisions", "Requests by prefill path (remote: through a prefill "
                                     "instance; local: prefilled by the decode instance) and the reason.",
                                     labels=["path", "reason"])
        for (path, reason), count in sorted(proxy.decisions.items()):
            family.add_metric([path, reason], count)
        yield family
        # role: prefill or decode; instance for plain replicas (engine proxy --instance)
        upstreams = [("prefill", u) for u in proxy.prefills] + [
            ("decode" if proxy.prefills else "instance", u) for u in proxy.decodes]
        labels = ["role", "url"]
        sent = CounterMetricFamily("engine:proxy_upstream_requests", "Requests this proxy sent to an instance "
                                   "(a retry on another instance counts there too).", labels=labels)
        in_flight = GaugeMetricFamily("engine:proxy_upstream_in_flight", "This proxy's requests open on an "
                                      "instance.", labels=labels)
        load = GaugeMetricFamily("engine:proxy_upstream_load", "The load the proxy ranks an instance by: its requests "
                                 "in flight, plus on a prefill instance the hand-offs it holds.", labels=labels)
        down = GaugeMetricFamily("engine:proxy_upstream_down", f"1 while an instance that could not be connected to "
                                 f"is tried last ({DOWN_S:.0f} s after the failure).", labels=labels)
        for role, u in upstreams:
            sent.add_metric([role, u.url], u.sent)
            in_flight.add_metric([role, u.url], u.in_flight)
            load.add_metric([role, u.url], u.load)
            down.add_metric([role, u.url], 1 if u.down else 0)
        held = GaugeMetricFamily("engine:proxy_prefill_held", "Hand-offs a prefill instance holds for a decode "
                                 "instance (its /status at the last poll, plus this proxy's since).", labels=["url"])
        for u in proxy.prefills:
            held.add_metric([u.url], u.held + u.handed)
        yield from (sent, in_flight, load, down, held)
        if proxy.router is not None:  # kv-aware: what it routed where, and the prefix it expected there
            routed = CounterMetricFamily("engine:proxy_kv_routed", "Requests kv-aware routing sent to an instance.",
                                         labels=["url"])
            tokens = CounterMetricFamily("engine:proxy_kv_routed_prompt_tokens", "Prompt tokens of those requests.",
                                         labels=["url"])
            hits = CounterMetricFamily("engine:proxy_kv_predicted_hit_tokens", "Of those, the tokens its KV events "
                                       "said the instance held.", labels=["url"])
            for row in proxy.router.status():
                routed.add_metric([row["url"]], row["routed"])
                tokens.add_metric([row["url"]], row["prompt_tokens"])
                hits.add_metric([row["url"]], row["predicted_hits"])
            yield from (routed, tokens, hits)


def build_proxy_app(proxy: Proxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        watcher = asyncio.create_task(proxy.watch_instances()) if proxy.router is not None else None
        prefills = asyncio.create_task(proxy.watch_prefills()) if proxy.prefills else None
        transfers = asyncio.create_task(proxy.watch_transfers()) if proxy.prefills and proxy.transfer_weight else None
        yield
        if prefills is not None:
            prefills.cancel()
        if transfers is not None:
            transfers.cancel()
        if watcher is not None:
            watcher.cancel()
            proxy.router.stop()

    app = FastAPI(title="engine proxy", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await proxy.handle(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await proxy.handle(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(raw: Request):
        for upstream in proxy.decodes:
            try:
                resp = await proxy.http.get(f"{upstream.url}/v1/models", timeout=5, headers={
                    k: v for k, v in raw.headers.items() if k == "authorization"})
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return error_response(503, "no decode instance reachable")

    @app.get("/health")
    async def health():
        return await proxy.health()

    document_request_bodies(app, {"/v1/completions": CompletionRequest,
                                  "/v1/chat/completions": ChatCompletionRequest})

    @app.get("/status")
    async def status():
        """The proxy's view: its upstreams, the requests it has in flight on each, and its
        disaggregation decisions so far."""
        return {"proxy": True, "policy": proxy.policy,
                "disagg": {"max_local_prefill_tokens": proxy.disagg.max_local_prefill_tokens,
                           "max_prefill_queue": proxy.disagg.max_prefill_queue,
                           "decisions": [{"path": p, "reason": r, "count": n}
                                         for (p, r), n in sorted(proxy.decisions.items())]},
                "prefill": [{"url": u.url, "in_flight": u.in_flight, "held": u.held + u.handed}
                            for u in proxy.prefills],
                "decode": [{"url": u.url, "in_flight": u.in_flight} for u in proxy.decodes],
                "transfer_weight": proxy.transfer_weight, "transfer_paths": proxy.paths.status(),
                "kv_routing": proxy.router.status() if proxy.router is not None else None}

    registry = CollectorRegistry()
    registry.register(_ProxyCollector(proxy))

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode())

    return app
