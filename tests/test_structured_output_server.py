"""Structured output through `engine serve` with SmolLM2 and the official openai client:
`response_format` (json_schema with `chat.completions.parse` and a pydantic model, json_object),
vLLM's `structured_outputs` and `guided_*` fields on both endpoints, streaming and not, and a
400 naming the field for every bad form."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pydantic
import pytest

from tests.server_utils import ServerProcess

API_KEY = "so-key"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=50)


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = ServerProcess("--served-model-name", "smol", "--num-blocks", "1024", api_key=API_KEY)
    yield srv
    assert srv.stop() in (0, -15)


@pytest.fixture(autouse=True)
def _idle_after(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_helper_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model="smol", messages=_ask("Describe Paris as JSON: its name, country and population in millions."),
        response_format=City, temperature=0, max_tokens=120)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City), message.content
    assert message.parsed == City.model_validate_json(message.content)


def test_json_object_streamed_and_not(client):
    # A prompt the model answers with a closed object well inside max_tokens in bf16 and float32
    # alike ("Give a JSON object with a key 'greeting'." sits at a near-tie: in bf16 its greedy
    # path can nest objects until max_tokens cuts the JSON off).
    kwargs = dict(model="smol", messages=_ask("Reply with a JSON object whose only key is 'greeting'."), temperature=0,
                  max_tokens=100, response_format={"type": "json_object"})
    whole = client.chat.completions.create(**kwargs)
    text = whole.choices[0].message.content
    assert isinstance(json.loads(text), dict) and whole.choices[0].finish_reason == "stop"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**kwargs, stream=True) if chunk.choices)
    assert streamed == text


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_choice": ["cat", "dog"]}, lambda t: t in ("cat", "dog")),
    ({"structured_outputs": {"grammar": 'start: "A" | "B" "!"'}}, lambda t: t in ("A", "B!")),
    ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 3}}},
     lambda t: isinstance(json.loads(t), list)),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
])
def test_vllm_fields_on_completions_streamed_and_not(client, extra, check):
    kwargs = dict(model="smol", prompt="My phone number is", temperature=0, max_tokens=40, extra_body=extra)
    text = client.completions.create(**kwargs).choices[0].text
    assert check(text), text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{broken"}, "guided_json"),
    ({"guided_json": "[" * 100_000}, "guided_json"),
    ({"guided_regex": "a" * 300_000}, "guided_regex"),
    ({"guided_grammar": "start: <[99999999]>"}, "guided_grammar"),  # a token the vocabulary lacks
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}}, "structured_outputs"),
])
def test_bad_structured_output_is_a_400_naming_the_field(server, body, param):
    for path, base in (("/v1/chat/completions", {"messages": _ask("hi")}), ("/v1/completions", {"prompt": "hi"})):
        resp = httpx.post(f"{server.url}{path}", json={"model": "smol", "max_tokens": 4, **base, **body},
                          headers=server.headers, timeout=30)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param, error
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_null_options_are_defaults_and_the_server_lives_on(client, server):
    """A client's explicit nulls (here an option the engine core decodes as a bool) are the
    defaults, never a message the core cannot read."""
    text = client.completions.create(model="smol", prompt="Pick:", max_tokens=8, temperature=0, extra_body={
        "structured_outputs": {"choice": ["red", "blue"], "disable_any_whitespace": None,
                               "whitespace_pattern": None}}).choices[0].text
    assert text in ("red", "blue")
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
