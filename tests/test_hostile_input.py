"""FAULTS.md 26, 27 and 33 against a real `engine serve`: every field a client sends is checked
before the engine core sees it. Each request here once stopped an engine (or would have run a
client's code on the server); now each gets a 400 naming the field, and the same engine
then still answers a canonical request with its canonical output."""
from __future__ import annotations

import json
import select
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from engine.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS
from tests.server_utils import ServerProcess

MODEL = "tiny"
ARGS = ["--served-model-name", MODEL, "--num-blocks", "64", "--max-model-len", "512", "--max-num-seqs", "4",
        "--role", "decode", "--kv-load-timeout-s", "3"]
CANONICAL = {"prompt": "The canonical prompt", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
DIGEST = "0" * 64
PULL = {"do_remote_prefill": True, "remote_kv_addr": "tcp://127.0.0.1:9", "remote_request_id": "x",
        "num_tokens": 3, "token_digest": DIGEST}


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(str(tiny_llama), *ARGS)
    srv.canonical = _post(srv, "/v1/completions", CANONICAL).json()["choices"][0]["text"]
    yield srv
    assert srv.stop() in (0, -15)


@pytest.fixture(autouse=True)
def _still_serving(server):
    yield
    # Whatever the test sent, the engine is alive, idle, and answers as before.
    resp = _post(server, "/v1/completions", CANONICAL)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == server.canonical
    server.wait_idle()
    assert server.status()["requests"]["tracked_by_engine"] == 0


def _post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=60, headers={"Content-Type": "application/json"})


def _error(resp: httpx.Response, status: int, param: str | None) -> str:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("ids", [[10_000_000], [2**40], [-1]])
def test_stop_token_ids_outside_the_vocabulary(server, ids):
    # Once an IndexError inside the sampler's step (with min_tokens > 0): the core died.
    body = {"prompt": "hi", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": ids}
    _error(_post(server, "/v1/completions", body), 400, "stop_token_ids")


@pytest.mark.parametrize("params, field", [
    ({"do_remote_prefill": True, "num_tokens": "abc"}, "kv_transfer_params.num_tokens"),
    ({**PULL, "remote_kv_addr": None}, "kv_transfer_params.remote_kv_addr"),
    ({k: v for k, v in PULL.items() if k != "remote_kv_addr"}, "kv_transfer_params.remote_kv_addr"),
    ({**PULL, "token_digest": None}, "kv_transfer_params.token_digest"),
    ({**PULL, "remote_kv_addr": "http://evil.example/"}, "kv_transfer_params.remote_kv_addr"),
    ({**PULL, "remote_kv_addr": "tcp://127.0.0.1:0"}, "kv_transfer_params.remote_kv_addr"),
    ({**PULL, "num_tokens": -5}, "kv_transfer_params.num_tokens"),
    ({**PULL, "num_tokens": 2**70}, "kv_transfer_params.num_tokens"),
    ({"kv_store_tokens": "x"}, "kv_transfer_params.kv_store_tokens"),
    ({"do_remote_decode": True, "inject_fault": "delay=abc"}, "kv_transfer_params.inject_fault"),
    ({"unknown_key": 1}, "kv_transfer_params.unknown_key"),
    ({"first_token_ids": [1, 2]}, "kv_transfer_params.first_token_ids"),  # two first tokens for n=1
    ({"first_token_ids": [10_000_000]}, "kv_transfer_params.first_token_ids"),
    ({"first_token_ids": [-1]}, "kv_transfer_params.first_token_ids"),
    ({"first_token_ids": [1] * 2000}, "kv_transfer_params.first_token_ids"),
    ({"first_token_ids": [1], "first_logprobs": []}, "kv_transfer_params.first_logprobs"),
    ({"first_logprobs": [[[2, -0.5, 1]]]}, "kv_transfer_params.first_logprobs"),
    ({"first_token_ids": [1], "first_logprobs": [[[1, "x", 1]]]}, "kv_transfer_params.first_logprobs"),
    ("a string", "kv_transfer_params"),
    ([PULL, PULL], "kv_transfer_params"),  # two entries for one prompt
])
def test_malformed_kv_transfer_params(server, params, field):
    # Each once escaped schedule() on a decode instance and killed its core.
    body = {"prompt": "The capital of France is", "max_tokens": 4, "kv_transfer_params": params}
    _error(_post(server, "/v1/completions", body), 400, field)


def test_one_pull_object_cannot_serve_a_prompt_list(server):
    body = {"prompt": ["first prompt", "second prompt"], "max_tokens": 2, "kv_transfer_params": PULL}
    _error(_post(server, "/v1/completions", body), 400, "kv_transfer_params")


def test_pull_from_an_address_that_is_not_a_kv_server(server):
    # Well-formed but pointing at a closed port: the load fails, the prompt is recomputed, and the
    # answer is exactly the colocated one (the default load failure policy).
    body = {**CANONICAL, "kv_transfer_params": {**PULL, "num_tokens": 4}}
    resp = _post(server, "/v1/completions", body)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == server.canonical


def test_client_chat_templates_are_refused(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template": "{% for m in messages %}{{ m.content * 1000000 }}{% endfor %}"}
    assert "--trust-request-chat-template" in _error(_post(server, "/v1/chat/completions", body), 400,
                                                     "chat_template")


def test_chat_content_parts(server):
    text_parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                            {"type": "text", "text": "there"}]}],
                  "max_tokens": 3, "temperature": 0}
    joined = {"messages": [{"role": "user", "content": "Hello\nthere"}], "max_tokens": 3, "temperature": 0}
    a, b = _post(server, "/v1/chat/completions", text_parts), _post(server, "/v1/chat/completions", joined)
    assert a.status_code == b.status_code == 200
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    _error(_post(server, "/v1/chat/completions", image), 400, "messages.0.content.0")
    _error(_post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}), 400,
           "messages.0.role")


@pytest.mark.parametrize("path, extra, field", [
    ("/v1/chat/completions", {"echo": True}, "echo"), ("/v1/completions", {"suffix": " end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ("/v1/completions", {"add_special_tokens": False}, "add_special_tokens"),
    ("/v1/chat/completions", {"add_special_tokens": True}, "add_special_tokens"),
    ("/v1/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", {"best_of": True}, "best_of"),  # True is not 1
])
def test_fields_this_server_does_not_implement_are_refused_by_name(server, path, extra, field):
    """Issue 27, item 7: accepted and ignored before (a 200 with neither echo nor suffix applied);
    each is accepted at the value that asks for nothing. (Completions' echo and prompt_logprobs
    are implemented: tests/test_prompt_logprobs.py; chat's echo, vLLM's "prepend the last
    message", is not.)"""
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    _error(_post(server, path, {**body, "max_tokens": 2, **extra}), 400, field)
    inert = {"echo": False, "suffix": None, "best_of": 1.0, "use_beam_search": False,
             "tools": [], "tool_choice": "none", "chat_template_kwargs": {},
             "add_special_tokens": path == "/v1/completions",
             "stream_options.continuous_usage_stats": None}[field]
    if field == "stream_options.continuous_usage_stats":
        assert _post(server, path, {**body, "max_tokens": 2, "stream": True,
                                    "stream_options": {"continuous_usage_stats": False}}).status_code == 200
    else:
        assert _post(server, path, {**body, "max_tokens": 2, field: inert}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_null_means_the_default_for_every_optional_field(server, path, stream):
    """Issue 28: clients and routers send explicit nulls for unset fields (vLLM's toy proxy
    sends min_tokens: null); each means the field's default, and the answer is the one without it."""
    from entrypoints.protocol import ChatCompletionRequest, CompletionRequest
    model = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
    base = ({"prompt": CANONICAL["prompt"]} if model is CompletionRequest
            else {"messages": [{"role": "user", "content": CANONICAL["prompt"]}]})
    base = {**base, **{k: v for k, v in CANONICAL.items() if k != "prompt"}, "stream": stream}
    nulls = {name: None for name in model.model_fields if name not in base and name != "request_id"}
    assert {"min_tokens", "n", "presence_penalty", "skip_special_tokens", "stream_options"} <= set(nulls)
    answers = []
    for body in (base, {**base, **nulls}):
        resp = _post(server, path, body)
        assert resp.status_code == 200, resp.text
        answers.append(_text_of(resp, stream))
    assert answers[0] == answers[1] and answers[0]
    nested = {**base, "stream_options": {"include_usage": None, "continuous_usage_stats": None},
              "stream": None, "response_format": {"type": "text", "json_schema": None}}
    resp = _post(server, path, nested)
    assert resp.status_code == 200, resp.text
    assert _text_of(resp, False) == answers[0]  # stream: null is not streamed
    _error(_post(server, path, {**base, ("prompt" if model is CompletionRequest else "messages"): None}), 400,
           "prompt" if model is CompletionRequest else "messages")


def _text_of(resp: httpx.Response, stream: bool) -> str:
    if not stream:
        choice = resp.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    text = ""
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def test_top_logprobs_needs_logprobs(server):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for top in (0, 2):
        _error(_post(server, "/v1/chat/completions", {**chat, "top_logprobs": top}), 400, "top_logprobs")
    assert _post(server, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}).status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 5}, "n"),                       # more sequences than --max-num-seqs 4
    ({"prompt": ["a", "b", "c"], "n": 2}, "prompt"),
    ({"prompt": ["p"] * 1000}, "prompt"),
    ({"prompt": "x", "n": 10**12}, "n"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"prompt": "x", "request_id": "r" * 1000}, "request_id"),
    ({"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
    # Stop strings are matched on the API server's event loop: bounded in number and length.
    ({"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"prompt": "x", "stop": ["s%d" % i for i in range(20_000)]}, "stop"),
    ({"prompt": "x", "stop": "s" * (MAX_STOP_STRING_LEN + 1)}, "stop"),
    ({"prompt": "x", "stop": ["ok", "s" * (MAX_STOP_STRING_LEN + 1)]}, "stop"),
])
def test_limits(server, body, param):
    _error(_post(server, "/v1/completions", body), 400, param)


def test_stop_strings_at_their_bounds(server):
    stop = [chr(0x4e00 + i) + "s" * (MAX_STOP_STRING_LEN - 1) for i in range(MAX_STOP_STRINGS)]
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        assert _post(server, path, {**body, "max_tokens": 4, "stop": stop}).status_code == 200
        _error(_post(server, path, {**body, "max_tokens": 4, "stop": [*stop, "one more"]}), 400, "stop")


def test_body_too_large(server):
    resp = _post(server, "/v1/completions", json.dumps({"prompt": "x" * (33 * 2**20)}))
    assert resp.status_code == 413


def _post_chunked(url: str, path: str, total: int) -> tuple[bytes, int]:
    """POSTs up to ``total`` bytes with Transfer-Encoding: chunked (no Content-Length), stopping
    as soon as the server answers; returns the answer's head and how many bytes were sent."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        piece = b"%x\r\n%s\r\n" % (2**20, b" " * 2**20)
        sent = 0
        while sent < total and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 2**20
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        return answer, sent


def test_chunked_body_too_large(server):
    """A body without Content-Length is counted as it arrives: refused at 32 MiB, not buffered."""
    answer, sent = _post_chunked(server.url, "/v1/completions", 256 * 2**20)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 128 * 2**20, f"the server read {sent} bytes before it refused"
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("seed", [2**63 - 1, -2**63])
def test_extreme_seeds_with_several_samples(server, seed):
    """Sample i of n uses seed + i, wrapped into the 64-bit range: the largest seed with n=3 is
    served (found by tests/test_differential.py: it was a 400 naming no field), reproducibly."""
    body = {"prompt": "x", "max_tokens": 4, "n": 3, "seed": seed, "temperature": 1.0}
    first, again = _post(server, "/v1/completions", body), _post(server, "/v1/completions", body)
    assert first.status_code == again.status_code == 200, first.text
    texts = [c["text"] for c in first.json()["choices"]]
    assert texts == [c["text"] for c in again.json()["choices"]] and len(texts) == 3
