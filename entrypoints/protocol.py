"""OpenAI-compatible request and response bodies (pydantic), with vLLM's extra fields."""
from __future__ import annotations

import functools
import json
import math
import re
import time
import typing
import uuid
from typing import Any, ClassVar, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.block_pool import MAX_CACHE_SALT_LEN
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams

MAX_BODY_BYTES = 32 * 2**20
# Visible ASCII only: a request id is echoed in a response header, written to logs and used as
# a key, so it can carry no line break, control character or byte a header cannot hold.
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")
# The engine's id of a request (request_ids_of): short enough that the ids it fans out into (a
# prompt list's "-i", n sequences' "i_") stay within what the engine and KV parameters hold (256).
MAX_ENGINE_REQUEST_ID_LEN = 200
_ENGINE_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_ENGINE_REQUEST_ID_LEN)
# Header from a front (engine proxy, the Ray ingress) to the instances it sends a request to: the
# engine request id it made unique for this request, the same on P and D (request_ids_of).
ENGINE_REQUEST_ID = "X-Engine-Request-Id"


# Header from `engine proxy` to a decode instance (engine/kv_transfer/first_token.py).
from engine.kv_transfer.first_token import FIRST_TOKENS_SHOWN  # noqa: E402,F401


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def stream_choice(index: int, text: str, logprobs, finish_reason: str | None, stop_reason, chat: bool,
                  token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """One choice of a streamed chunk, as the API server and the proxy stream it; with
    return_token_ids, the chunk's ``token_ids`` and (completions, a choice's first chunk) its
    ``prompt_token_ids``, as vLLM streams them."""
    if chat:
        delta = {"content": text} if text or finish_reason is None else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def role_choice(index: int) -> dict:
    """The first chunk of a streamed chat choice: its role."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


class BodyError(ValueError):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


async def read_json_object(raw) -> dict:
    """The request's body as a JSON object; BodyError (413, 400) for anything else."""
    too_large = BodyError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
    declared = raw.headers.get("content-length") or "0"
    if not declared.isdigit():
        raise BodyError(400, "Content-Length is not a number")
    if int(declared) > MAX_BODY_BYTES:
        raise too_large
    # Counted as it arrives: a chunked body has no Content-Length, and must never be buffered whole.
    parts, size = [], 0
    async for part in raw.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise too_large
        parts.append(part)
    body = b"".join(parts)
    try:
        # Strict JSON: no NaN/Infinity, no number that overflows a float, no lone surrogate
        # (nothing a proxy could not encode again for its upstream).
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _name_the_field(body) or BodyError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BodyError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise BodyError(400, "request body must be a JSON object")
    return data


def _name_the_field(body: bytes) -> BodyError | None:
    """For a body only lenient JSON accepts (NaN, Infinity, 1e400, a lone surrogate): the error
    naming the first field that holds such a value; None when it is not JSON at all."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return BodyError(400, f"{path or 'body'}: must be a finite number", path or None)
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return BodyError(400, f"{path or 'body'}: not valid Unicode (a lone surrogate)", path or None)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend((f"{path}.{key}" if path else str(key), item) for key, item in reversed(list(items)))
    return None


def request_id_of(body_value: object, header_value: str | None, prefix: str) -> str:
    """The client's request id (body field first, then X-Request-Id), or a new one."""
    value = body_value if body_value is not None else (header_value or None)
    if value is None:
        return random_id(prefix)
    if not isinstance(value, str) or not _REQUEST_ID.fullmatch(value):
        raise BodyError(400, "request_id (or X-Request-Id) must be 1-256 visible ASCII characters", "request_id")
    return value


def request_ids_of(body_value: object, header_value: str | None, engine_header: str | None,
                   prefix: str) -> tuple[str, str]:
    """(the id a client is shown, the id the engine knows its request by). The first is the
    client's own (body request_id, then X-Request-Id), echoed in the response's id and its
    X-Request-Id header. Clients share ids (gateways and SDKs reuse trace ids across concurrent
    requests), so the engine's is made unique, as vLLM does: the client's id with a random
    suffix; or, from a front that sends one request to several instances (engine proxy, the Ray
    ingress: P and D), the ENGINE_REQUEST_ID header it derived the same way. A new id when the
    client gave none serves as both."""
    shown = request_id_of(body_value, header_value, prefix)
    if engine_header is not None:
        # Only the id a front derives (the client's id, or it with unique_request_id's suffix):
        # a client that sends the header itself cannot name another client's request, nor undo
        # the suffix that keeps shared client ids apart.
        if not (_ENGINE_REQUEST_ID.fullmatch(engine_header) and _derived_from(engine_header, shown)):
            raise BodyError(400, f"{ENGINE_REQUEST_ID} must be the request's id, or it followed by '-' and 16 "
                                 "hex digits (engine proxy sends it; clients need not)", "request_id")
        return shown, engine_header
    given = body_value is not None or bool(header_value)
    return shown, (unique_request_id(shown) if given else shown)


def _derived_from(engine_id: str, shown: str) -> bool:
    base = shown[:MAX_ENGINE_REQUEST_ID_LEN - 17]
    return engine_id == shown or (engine_id.startswith(base + "-") and len(engine_id) == len(base) + 17
                                  and all(c in "0123456789abcdef" for c in engine_id[-16:]))


def unique_request_id(request_id: str) -> str:
    """An engine request id of its own for a client's ``request_id`` (which others may share)."""
    return f"{request_id[:MAX_ENGINE_REQUEST_ID_LEN - 17]}-{uuid.uuid4().hex[:16]}"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _RequestModel(BaseModel):
    """A request body (or part of one): an explicit null means the field's default, as in
    OpenAI's API and vLLM (clients and routers send nulls for unset fields: vLLM's own proxy
    sends ``min_tokens: null``). Fields that can hold None keep it (it is their default's
    meaning there); a required field's null stays an error. The JSON schema says so too, so
    schema-driven clients and fuzzers send those nulls."""

    model_config = ConfigDict(json_schema_extra=lambda schema, model: _nullable_in_schema(schema, model))

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _defaulted_when_null(cls)
        return {name: value for name, value in data.items() if value is not None or name not in defaulted}


def _nullable_in_schema(schema: dict, model: type[BaseModel]) -> None:
    properties = schema.get("properties", {})
    for name in _defaulted_when_null(model):
        if name in properties and "anyOf" not in properties[name]:
            prop = properties[name]
            kept = {key: prop.pop(key) for key in ("default", "title", "description") if key in prop}
            properties[name] = {"anyOf": [prop, {"type": "null"}], **kept}


@functools.cache
def _defaulted_when_null(model: type[BaseModel]) -> frozenset[str]:
    """Names (and aliases) of a model's optional fields whose type has no None."""
    names = set()
    for name, field in model.model_fields.items():
        nullable = field.annotation in (Any, type(None)) or type(None) in typing.get_args(field.annotation)
        if not field.is_required() and not nullable:
            names.update({name, field.alias} - {None})
    return frozenset(names)


class StreamOptions(_RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # not implemented: true is refused (UNIMPLEMENTED_FIELDS)


class JsonSchemaFormat(_RequestModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced exactly, strict or not


class ResponseFormat(_RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# vLLM's older request fields, each one kind of StructuredOutputsParams.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


# Fields of OpenAI's and vLLM's requests that this server does not implement, each with the
# values that ask for nothing: any other value is a 400 naming the field, never silently dropped.
UNIMPLEMENTED_FIELDS: dict[str, tuple] = {
    "suffix": (None, ""), "best_of": (None, 1),
    "use_beam_search": (None, False), "length_penalty": (None, 1.0, 1), "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,), "bad_words": (None, []), "prompt_embeds": (None,),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "continue_final_message": (None, False), "documents": (None,),
    "mm_processor_kwargs": (None,), "priority": (None, 0), "return_tokens_as_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True), "audio": (None,), "modalities": (None, ["text"]),
    "chat_template_kwargs": (None, {}), "logits_processors": (None, []),
    "reasoning_effort": (None,), "include_reasoning": (None, True),
    "web_search_options": (None,), "vllm_xargs": (None, {}), "media_io_kwargs": (None, {}),
}


def _is_inert(value: object, inert: tuple) -> bool:
    """Whether value asks for nothing: None, or equal to an inert value of the same kind (True
    is not 1, 1.0 is 1)."""
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                for v in inert if v is not None)


class _SamplingFields(_RequestModel):
    # Unknown fields are accepted (and ignored) like vLLM; wrong types of known ones are a 400;
    # known fields this server does not implement are a 400 unless inert (UNIMPLEMENTED_FIELDS).
    model_config = ConfigDict(extra="allow")

    # Per endpoint, what asks for nothing where it differs (vLLM's defaults: completions add the
    # tokenizer's special tokens, chat prompts are the template's alone).
    _INERT_HERE: ClassVar[dict[str, tuple]] = {}

    def refused_field(self) -> tuple[str, str] | None:
        """(field, why) for the first field that asks for something this server does not do."""
        given = {**(self.model_extra or {}), **{name: getattr(self, name) for name in self.model_fields_set}}
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            given["stream_options.continuous_usage_stats"] = True
        for name, inert in {**UNIMPLEMENTED_FIELDS, **self._INERT_HERE,
                            "stream_options.continuous_usage_stats": (None, False)}.items():
            if name in given and not _is_inert(given[name], inert):
                return name, f"{name}: not supported by this server (only its default is accepted)"
        return None

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # vLLM's: each prompt token's logprob (after the first) and the top k at its position.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # One object for every prompt, or (a prefill instance's answer to a prompt list) one per prompt.
    kv_transfer_params: dict[str, Any] | list[dict[str, Any]] | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's tenant isolation: KV (prefix cache, tiers, events) shared only among requests of one salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_LEN)
    # vLLM's: the prompt's and each choice's token ids in the answer (prompt_token_ids, token_ids).
    return_token_ids: bool = False
    logit_bias: dict[str, float] | None = None
    # Structured output, three ways to ask (at most one per request): OpenAI's, vLLM's, vLLM's older one.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """What the request asks its output to follow, and the field it asked in (for errors).
        Raises BodyError (400) naming the field."""
        asked = [name for name in ("response_format", "structured_outputs", *_GUIDED_FIELDS)
                 if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            asked.remove("response_format")
        if len(asked) > 1:
            raise BodyError(400, f"{asked[1]}: only one of {', '.join(asked)} may be set", asked[1])
        if not asked:
            return None, None
        field, extra = asked[0], {}
        if self.guided_whitespace_pattern is not None:
            extra["whitespace_pattern"] = self.guided_whitespace_pattern
        if field == "response_format":
            spec = self.response_format.json_schema
            if self.response_format.type == "json_object":
                kwargs = {"json_object": True}
            elif spec is None or spec.schema_ is None:
                raise BodyError(400, "response_format.json_schema.schema is required for type json_schema",
                                "response_format.json_schema.schema")
            else:
                field, kwargs = "response_format.json_schema.schema", {"json": spec.schema_}
        elif field == "structured_outputs":
            kwargs = self.structured_outputs
        else:
            kwargs = {_GUIDED_FIELDS[field]: getattr(self, field)}
        try:
            return StructuredOutputsParams(**{**extra, **kwargs}), field
        except TypeError as exc:  # an unknown key in structured_outputs
            raise BodyError(400, f"{field}: {exc}", field) from None
        except ValueError as exc:
            raise BodyError(400, f"{field}: {exc}", field) from None

    def prompt_logprobs_wanted(self, logprobs: int | None) -> int | None:
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field on a bad value (BodyError for structured output)."""
        structured_outputs, _ = self.structured_outputs_params()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=self.prompt_logprobs_wanted(logprobs),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, structured_outputs=structured_outputs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    # The prompt's text before each choice's (with logprobs, the prompt tokens' first: vLLM's
    # prompt_logprobs at the same k); with max_tokens 0, only the prompt (lm-eval's loglikelihood).
    echo: bool | None = None
    _INERT_HERE: ClassVar[dict[str, tuple]] = {"add_special_tokens": (None, True)}

    @property
    def echo_only(self) -> bool:
        return bool(self.echo) and self.max_tokens == 0

    def prompt_logprobs_wanted(self, logprobs: int | None) -> int | None:
        if self.prompt_logprobs is None and self.echo:
            return logprobs
        return self.prompt_logprobs


class ChatMessage(_RequestModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    # echo: vLLM's chat echo (prepend the last message) is not implemented: true is a 400.
    _INERT_HERE: ClassVar[dict[str, tuple]] = {"add_special_tokens": (None, False), "echo": (None, False)}

    def refused_field(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:  # as OpenAI and vLLM answer
            return "top_logprobs", "top_logprobs: needs logprobs set to true"
        return super().refused_field()


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "engine"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def document_request_bodies(app, routes: dict[str, type[BaseModel]]) -> None:
    """Declare the real request models in the app's OpenAPI schema. The handlers parse bodies
    themselves (so errors are OpenAI-shaped 400s naming the field), which FastAPI cannot see;
    schema-driven clients and fuzzers (schemathesis) read the models from here."""
    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in routes.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
