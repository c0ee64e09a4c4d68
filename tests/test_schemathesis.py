"""Schema-driven fuzzing of the real HTTP servers (FAULTS.md cases 1-6, 26, 27 and 33).

schemathesis reads each server's own `/openapi.json` (where `CompletionRequest` and
`ChatCompletionRequest` are declared as the request bodies) and generates schema-valid and
schema-violating bodies for `POST /v1/completions` and `POST /v1/chat/completions`. They go to
`engine serve` in each role (both, prefill, decode) and to `engine proxy` in front of a P and a D,
all real processes on loopback.

Every answer must be a 2xx or a 4xx with an OpenAI error body, within a deadline, with no
traceback in any server's log; after each run every server must be idle (nothing running,
waiting or held, every KV block free) and a canonical greedy request must still get the answer
it got before the fuzzing.

Generated requests are kept cheap by a `flatmap_body` hook: `max_tokens`, `n`, `min_tokens` and
prompt lists within the server's limits are scaled down (values far beyond the limits are left
alone: they must be refused at once). The same hook repairs some bodies into runnable ones (a
served model name, an in-vocabulary prompt) so that generated sampling fields reach the engine,
and injects one hostile value into others (huge or odd numbers, huge prompt lists, client chat
templates, forged `kv_transfer_params`): those must get a 4xx or a correct answer, never a 5xx or
a hang.

CI runs `EXAMPLES` (40) derandomized examples per operation and server; set ENGINE_FUZZ_EXAMPLES
for a longer run.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.disagg_utils import Disagg
from tests.server_utils import ServerProcess

MODEL = "tiny"
VOCAB = 49152  # tests/conftest.py TINY_COMMON
MAX_MODEL_LEN = 384
MAX_NUM_SEQS = 8
ENGINE_ARGS = ("--served-model-name", MODEL, "--num-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", str(MAX_NUM_SEQS))
LEASE_S = 4  # prefill role: direct do_remote_decode requests hold KV this long
EXAMPLES = int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "40"))
DEADLINE_S = 45.0  # one call, however hostile, answers within this
SMALL_MAX_TOKENS = 6
OPERATIONS = ("/v1/completions", "/v1/chat/completions")
CANONICAL = {"prompt": "The canonical request of the fuzz test", "max_tokens": 8, "temperature": 0,
             "ignore_eos": True}
CANONICAL_CHAT = {"messages": [{"role": "user", "content": "Canonical chat"}], "max_tokens": 6, "temperature": 0,
                  "ignore_eos": True}
ALLOWED_STATUS = {200, 400, 404, 413}
CASE_LOG = os.environ.get("ENGINE_FUZZ_LOG")  # a file to append every case and its answer to (JSON lines)
LOG_ALARMS = ("Traceback", " ERROR ", " CRITICAL ", "Exception in ASGI application")


# ---- servers ------------------------------------------------------------------------------
class Target:
    """One HTTP front under test, the engine servers behind it and their logs."""

    def __init__(self, name: str, url: str, engines: list[ServerProcess], logs: list[tuple[str, Path]],
                 kv_addr: str | None) -> None:
        self.name, self.url, self.engines, self.logs, self.kv_addr = name, url, engines, logs, kv_addr
        self.canonical = (_post(url, "/v1/completions", CANONICAL), _post(url, "/v1/chat/completions", CANONICAL_CHAT))
        for resp in self.canonical:
            assert resp.status_code == 200, resp.text
        self._offsets = {label: path.stat().st_size for label, path in logs}

    def new_log_lines(self) -> dict[str, str]:
        """What each server logged since the last call."""
        out = {}
        for label, path in self.logs:
            with open(path, "rb") as f:
                f.seek(self._offsets[label])
                data = f.read()
            self._offsets[label] += len(data)
            if data:
                out[label] = data.decode(errors="replace")
        return out


def _post_large(url: str, path: str, body: bytes) -> tuple[int, bytes]:
    """POST a body too big to be read, the way curl does: stop sending as soon as the server
    answers (it may refuse before reading it all, then close; httpx would only see the reset).
    Returns the status and the answer's body."""
    import select
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=DEADLINE_S)
    try:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        view, sent = memoryview(body), 0
        while sent < len(body):
            readable, writable, _ = select.select([sock], [sock], [], DEADLINE_S)
            if readable:
                break
            if writable:
                try:
                    sent += sock.send(view[sent:sent + 2**20])
                except (BrokenPipeError, ConnectionResetError):
                    break
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    finally:
        sock.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    if b"transfer-encoding: chunked" in head.lower():  # de-chunk
        out, rest = b"", payload
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        payload = out
    return status, payload


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=DEADLINE_S)


@pytest.fixture(scope="module")
def both(tiny_llama):
    srv = ServerProcess(str(tiny_llama), *ENGINE_ARGS)
    yield {"both": Target("both", srv.url, [srv], [("both", srv.log_path)], None)}
    assert srv.stop() in (0, -15)


@pytest.fixture(scope="module")
def pd(tiny_llama):
    cluster = Disagg(str(tiny_llama), *ENGINE_ARGS, prefill_args=("--kv-lease-s", str(LEASE_S)),
                           decode_args=("--kv-load-timeout-s", "3"))
    logs = [("prefill", cluster.prefill.log_path), ("decode", cluster.decode.log_path),
            ("proxy", cluster.proxy.log_path)]
    kv_addr = f"tcp://127.0.0.1:{cluster.kv_port}"
    # Canonical answers of all three fronts before any of them is fuzzed.
    yield {name: Target(name, url, [cluster.prefill, cluster.decode], logs, kv_addr)
           for name, url in (("prefill", cluster.prefill.url), ("decode", cluster.decode.url),
                             ("proxy", cluster.url))}
    cluster.stop()


@pytest.fixture(scope="module")
def target(request) -> Target:
    """The front named by the parameter; its servers start once per module."""
    return request.getfixturevalue("both" if request.param == "both" else "pd")[request.param]


# ---- generation ---------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _valid_token_prompt(v) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(_is_int(t) and 0 <= t < VOCAB for t in v)


def _valid_prompt(p) -> bool:
    if isinstance(p, str):
        return bool(p)
    if _valid_token_prompt(p):
        return True
    return (isinstance(p, list) and 0 < len(p) <= 3
            and (all(isinstance(s, str) and s for s in p) or all(_valid_token_prompt(s) for s in p)))


def _make_cheap(body: dict, chat: bool) -> dict:
    """Scale down what makes an accepted request slow. Values beyond the server's limits stay:
    those must be refused at once, and refusing them is cheap."""
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if _is_int(v) and SMALL_MAX_TOKENS < v <= 2 * MAX_MODEL_LEN:
            body[key] = v % SMALL_MAX_TOKENS + 1
        elif key in body and v is None:  # null means "the rest of the context"
            body[key] = SMALL_MAX_TOKENS
    if chat and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = SMALL_MAX_TOKENS  # chat's default is the rest of the context
    v = body.get("min_tokens")
    if _is_int(v) and SMALL_MAX_TOKENS < v <= 2 * MAX_MODEL_LEN:
        body["min_tokens"] = v % (SMALL_MAX_TOKENS + 1)
    v = body.get("n")
    if _is_int(v) and 2 < v <= MAX_NUM_SEQS:
        body["n"] = 2
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not _is_int(prompt[0]) and 3 < len(prompt) <= MAX_NUM_SEQS:
        body["prompt"] = prompt[:3]
    return body


VALID_PROMPTS = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20), min_size=1, max_size=3),
)
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": st.text(min_size=0, max_size=40)}),
                          min_size=1, max_size=3)


def _repair(body: dict, chat: bool, prompt, messages) -> dict:
    """Make the request runnable where the schema cannot say what is valid (the served model
    name, in-vocabulary prompts, chat roles), keeping every other generated field."""
    body = dict(body)
    if "model" in body:
        body["model"] = MODEL
    for key in ("logit_bias", "chat_template", "kv_transfer_params"):
        body.pop(key, None)
    if isinstance(body.get("stop"), list):
        body["stop"] = [s for s in body["stop"] if s != ""]
    elif body.get("stop") == "":
        del body["stop"]
    if isinstance(body.get("request_id"), str) and not body["request_id"].isascii():
        body.pop("request_id")  # keeps non-ASCII ids to the raw variant, where they are hostile
    if chat:
        msgs = body.get("messages")
        if not (isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str) for m in msgs)):
            body["messages"] = messages
    elif not _valid_prompt(body.get("prompt")):
        body["prompt"] = prompt
    return body


ANY = None  # a 4xx or a correct answer, both fine


def _hostile(kv_addr: str | None) -> list[tuple[dict, object]]:
    """Overrides a client may send, one at a time, with what must come back: ANY (a 4xx with an
    OpenAI error body, or a correct answer), a status, or (status, param)."""
    forged = {"do_remote_prefill": True, "remote_kv_addr": kv_addr or "tcp://127.0.0.1:9",
              "remote_request_id": "not-a-request", "num_tokens": 3, "token_digest": "0" * 64}
    kv = "kv_transfer_params"
    return [
        ({"max_tokens": 10**9}, 400), ({"max_tokens": 2**63}, 400), ({"max_tokens": 2**200}, 400),
        ({"max_tokens": -1}, (400, "max_tokens")), ({"max_tokens": 0}, (400, "max_tokens")),
        ({"max_tokens": MAX_MODEL_LEN}, 400), ({"max_tokens": 1.5}, (400, "max_tokens")), ({"max_tokens": True}, ANY),
        ({"max_completion_tokens": 10**12}, 400), ({"max_tokens": "3"}, ANY),
        ({"n": 10**6}, (400, "n")), ({"n": 2**64}, (400, "n")), ({"n": 0}, (400, "n")), ({"n": -3}, (400, "n")),
        ({"n": MAX_NUM_SEQS + 1}, (400, "n")), ({"n": 1e300}, (400, "n")),
        ({"min_tokens": 10**9}, (400, "min_tokens")), ({"min_tokens": -1}, (400, "min_tokens")),
        ({"logprobs": 10**6}, (400, "logprobs")), ({"logprobs": 2**64}, (400, "logprobs")),
        ({"logprobs": -1}, (400, "logprobs")), ({"top_logprobs": 10**4}, (400, "top_logprobs")),
        ({"logprobs": True, "top_logprobs": 21}, (400, "top_logprobs")), ({"logprobs": True, "top_logprobs": 20}, 200),
        ({"seed": 2**64}, (400, "seed")), ({"seed": -2**63 - 1}, (400, "seed")),
        ({"seed": 2**63 - 1, "temperature": 1.0}, 200), ({"seed": -2**63, "temperature": 0.7}, 200),
        ({"seed": -1, "temperature": 0.5}, 200), ({"seed": 2**63 - 1, "n": 2, "temperature": 1.0}, 200),
        ({"temperature": 1e308}, (400, "temperature")), ({"temperature": 5e-324}, 200), ({"temperature": 1e-300}, 200),
        ({"temperature": 1e-5}, 200), ({"temperature": -0.0}, 200),
        ({"top_k": 10**12, "temperature": 1.0}, ANY), ({"top_k": 2**70}, ANY), ({"top_k": VOCAB + 1, "temperature": 1.0}, ANY),
        ({"top_k": -1}, 200), ({"top_k": -2}, (400, "top_k")), ({"top_p": 5e-324, "temperature": 1.0}, 200),
        ({"top_p": 1e-300, "temperature": 1.0}, 200), ({"min_p": 1.0, "temperature": 1.0}, 200),
        ({"min_p": 5e-324, "temperature": 1.0}, 200),
        ({"repetition_penalty": 1e308}, (400, "repetition_penalty")),
        ({"repetition_penalty": 5e-324}, (400, "repetition_penalty")), ({"repetition_penalty": 1e-6}, 200),
        ({"presence_penalty": 2.0000001}, (400, "presence_penalty")),
        ({"frequency_penalty": -2.0, "presence_penalty": 2.0}, 200),
        ({"stop_token_ids": [10**12]}, ANY), ({"stop_token_ids": [2**70]}, ANY),
        ({"stop_token_ids": [VOCAB], "min_tokens": 2}, ANY), ({"stop_token_ids": [-1]}, (400, "stop_token_ids")),
        ({"stop_token_ids": list(range(5000)), "min_tokens": 2}, 200),
        ({"stop": ["a"] * 5000}, (400, "stop")), ({"stop": ["a"] * 64}, 200),  # at most 64 stop strings
        ({"stop": "x" * 100_000}, (400, "stop")), ({"stop": [""]}, (400, "stop")), ({"stop": "\x00"}, 200),
        ({"prompt": [10**12]}, (400, "prompt")), ({"prompt": [-1]}, (400, "prompt")), ({"prompt": [VOCAB]}, (400, "prompt")),
        ({"prompt": [2**70]}, (400, "prompt")), ({"prompt": [[]]}, (400, "prompt")), ({"prompt": [[1, 2], []]}, (400, "prompt")),
        ({"prompt": []}, (400, "prompt")), ({"prompt": ""}, (400, "prompt")), ({"prompt": [""]}, (400, "prompt")),
        ({"prompt": ["a"] * 10_000}, (400, "prompt")), ({"prompt": [[5]] * 10_000}, (400, "prompt")),
        ({"prompt": "word " * 5000}, 400), ({"prompt": list(range(3, 3 + MAX_MODEL_LEN))}, 400),
        ({"prompt": list(range(3, MAX_MODEL_LEN - 1)), "max_tokens": None}, 200),
        ({"prompt": [list(range(3 + i, 3 + i + MAX_MODEL_LEN - 10)) for i in range(MAX_NUM_SEQS)]}, 200),
        ({"prompt": ["a", [1, 2]]}, (400, "prompt")), ({"prompt": [[[1]]]}, (400, "prompt")),
        ({"prompt": list(range(3, 3 + MAX_MODEL_LEN - 10)), "n": MAX_NUM_SEQS}, 200),
        ({"prompt": [True, False]}, ANY), ({"prompt": [1.0, 2.0]}, ANY), ({"prompt": {"text": "hi"}}, (400, "prompt")),
        ({"messages": [{"role": "user", "content": "hi " * 3000}]}, 400),
        ({"messages": [{"role": "user", "content": "hi"}] * 5000}, 400),
        ({"messages": []}, (400, "messages")), ({"messages": [{"role": "wizard", "content": "hi"}]}, 400),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, 200),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, ANY),
        ({"messages": [{"role": "user", "content": "x", "name": "bob", "tool_calls": [{"id": 1}]}]}, ANY),
        ({"messages": [{"role": "user", "content": None}]}, ANY), ({"messages": [{"role": "user"}]}, ANY),
        ({"chat_template": "{{ 7 * 7 }}"}, (400, "chat_template")),
        ({"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}, (400, "chat_template")),
        ({"add_generation_prompt": False}, 200),
        ({"logit_bias": {"1": 100}}, (400, "logit_bias")), ({"logit_bias": {"99999999": -100}}, (400, "logit_bias")),
        ({"model": "not-served"}, (404, "model")), ({"model": ""}, (404, "model")), ({"model": None}, 200),
        ({"request_id": "x" * 257}, (400, "request_id")), ({"request_id": ""}, (400, "request_id")),
        ({"request_id": "ünïcødé-id"}, ANY), ({"request_id": "日本語-id"}, ANY), ({"request_id": "a\r\nb: c"}, ANY), ({"request_id": "same-id-every-time"}, 200),
        ({"stream": True, "stream_options": {"include_usage": True}}, 200), ({"stream": True, "n": 2}, 200),
        ({"stream": True, "n": 2, "logprobs": 5, "seed": 3, "temperature": 1.0}, 200),
        ({"stream": True, "n": 2, "logprobs": True, "top_logprobs": 3, "seed": 3, "temperature": 1.0}, 200),
        ({"max_tokens": 1, "min_tokens": 1}, 200), ({"temperature": 0, "seed": 5, "n": 3}, 200),
        ({"stream": False, "stream_options": {"include_usage": True}}, 200), ({"stream_options": {"include_usage": "yes"}}, ANY),
        ({"stream": "true"}, ANY), ({"echo": True}, ANY), ({"ignore_eos": "no"}, ANY), ({"skip_special_tokens": False}, 200),
        ({"include_stop_str_in_output": True, "stop": [" "]}, 200),
        ({"user": "x" * 100_000}, 200), ({"unknown_field": {"nested": [1, 2, 3]}}, 200),
        ({kv: {"do_remote_prefill": True}}, (400, "kv_transfer_params.remote_kv_addr")),
        ({kv: forged}, ANY), ({kv: {**forged, "remote_kv_addr": "tcp://127.0.0.1:1"}}, ANY),
        ({kv: {**forged, "num_tokens": 2**31 - 1}}, ANY), ({kv: {**forged, "num_tokens": 10_000}}, ANY),
        ({kv: {**forged, "remote_kv_addr": "tcp://[::1]:99999"}}, (400, "kv_transfer_params.remote_kv_addr")),
        ({kv: {**forged, "remote_kv_addr": "http://127.0.0.1:80"}}, (400, "kv_transfer_params.remote_kv_addr")),
        ({kv: {"do_remote_decode": True}}, ANY), ({kv: {"do_remote_decode": True, **forged}}, ANY),
        ({kv: {"kv_store_tokens": 2**31 - 1}}, ANY), ({kv: {"inject_fault": "drop"}}, ANY),
        ({kv: {"surprise": 1}}, (400, "kv_transfer_params.surprise")), ({kv: "yes"}, (400, "kv_transfer_params")),
        ({kv: [forged]}, ANY), ({kv: [forged, forged, forged]}, (400, "kv_transfer_params")),
    ]


def _body_hook(kv_addr: str | None):
    hostile = [override for override, _ in _hostile(kv_addr)]

    def flatmap_body(context, body):
        chat = context.operation.path.endswith("chat/completions")
        if not isinstance(body, dict):  # negative mode: not an object at all; must be a 400
            return st.just(body)

        def build(variant: str, override: dict, prompt, messages) -> dict:
            out = body
            if variant != "raw":
                out = _repair(out, chat, prompt, messages)
            out = _make_cheap(out, chat)
            if variant == "hostile":
                out = {**out, **override}
            return out

        return st.builds(build, st.sampled_from(["repaired", "hostile", "raw", "repaired", "hostile"]),
                         st.sampled_from(hostile), VALID_PROMPTS, VALID_MESSAGES)

    return flatmap_body


# ---- checks -------------------------------------------------------------------------------
def _check_error_body(resp, status: int) -> None:
    body = resp.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"not an OpenAI error body: {resp.text}"
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], resp.text
    assert isinstance(err.get("type"), str), resp.text
    assert "param" in err and (err["param"] is None or isinstance(err["param"], str)), resp.text
    assert err.get("code") == status, resp.text


def _check_sse(text: str, chat: bool) -> None:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"stream does not end with [DONE]: {text[-500:]}"
    assert events.count("[DONE]") == 1, text[-500:]
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, f"error event after a 200: {event}"
        assert isinstance(chunk.get("choices"), list), event


def _check_ok(resp, body, chat: bool) -> None:
    is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
    if isinstance(body, dict) and body.get("stream") is True:
        assert is_sse, f"stream: true answered without an event stream: {resp.headers}"
    if is_sse:
        _check_sse(resp.text, chat)
        return
    data = resp.json()
    assert isinstance(data.get("choices"), list) and data["choices"], resp.text[:500]
    handed_off = isinstance(body, dict) and isinstance(body.get("kv_transfer_params"), dict) and \
        body["kv_transfer_params"].get("do_remote_decode") is True
    for choice in data["choices"]:
        # A prefill instance's answer continues elsewhere: null, with the first tokens to continue from.
        allowed = ("stop", "length", None) if handed_off else ("stop", "length")
        assert choice.get("finish_reason") in allowed, choice
        if choice.get("finish_reason") is None:
            assert data["kv_transfer_params"]["first_token_ids"], data
        if chat:
            assert isinstance(choice["message"]["content"], str), choice
        else:
            assert isinstance(choice["text"], str), choice
    usage = data["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage


def _alarms(logged: dict[str, str]) -> dict[str, str]:
    """Per server, the logged lines that raise an alarm, each with the exception line that
    ends its traceback."""
    out = {}
    for label, text in logged.items():
        lines = text.splitlines()
        keep = []
        for i, line in enumerate(lines):
            if any(a.strip() in line for a in LOG_ALARMS):
                keep.append(line[:300])
                if line.startswith("Traceback"):  # the exception line closes the traceback
                    end = next((j for j in range(i + 1, len(lines)) if lines[j] and not lines[j][0].isspace()), None)
                    if end is not None:
                        keep.append(lines[end][:300])
        if keep:
            out[label] = "\n".join(dict.fromkeys(keep))
    return out


def _short(body, limit: int = 1500) -> str:
    text = json.dumps(body, default=repr)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _check_idle(t: Target) -> None:
    for srv in t.engines:
        srv.wait_idle(timeout=LEASE_S + 15)
        status = srv.status()
        req, blocks = status["requests"], status["kv_blocks"]
        assert not status["dead"], status
        assert all(v == 0 for v in req.values()), f"{srv.url} not clean: {status}"
        assert blocks["free"] == blocks["total"] and blocks["held"] == 0, f"{srv.url} not clean: {status}"
    if t.name == "proxy":
        proxy = httpx.get(f"{t.url}/status", timeout=5).json()
        assert all(u["in_flight"] == 0 for role in ("prefill", "decode") for u in proxy[role]), proxy


def _check_canonical(t: Target) -> None:
    before_c, before_chat = (r.json() for r in t.canonical)
    after_c = _post(t.url, "/v1/completions", CANONICAL)
    after_chat = _post(t.url, "/v1/chat/completions", CANONICAL_CHAT)
    assert after_c.status_code == 200 and after_chat.status_code == 200, (after_c.text, after_chat.text)
    assert after_c.json()["choices"][0]["text"] == before_c["choices"][0]["text"]
    assert after_chat.json()["choices"][0]["message"] == before_chat["choices"][0]["message"]


# ---- tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["both", "prefill", "decode", "proxy"], indirect=True)
@pytest.mark.parametrize("path", OPERATIONS)
def test_fuzz(target: Target, path: str, record_property):
    schema = schemathesis.openapi.from_url(f"{target.url}/openapi.json")
    schema.hook(_body_hook(target.kv_addr))
    operation = schema[path]["POST"]
    assert operation.body, "request body model missing from the OpenAPI schema"
    chat = path.endswith("chat/completions")
    strategy = st.one_of(operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
                         operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    statuses: Counter = Counter()
    target.new_log_lines()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        kwargs = case.as_transport_kwargs(base_url=target.url)
        content = json.dumps(kwargs["json"]).encode() if "json" in kwargs else kwargs.get("data")
        started = time.monotonic()
        try:
            # httpx rather than case.call(): the whole event stream is read, however long.
            resp = http.post(kwargs["url"], content=content, headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:  # a timeout is a hang; a reset is a crash
            time.sleep(0.3)
            raise AssertionError(f"{target.name} {path}: no answer within {DEADLINE_S}s ({type(exc).__name__}: "
                                 f"{exc})\nbody: {_short(case.body)}\nlogs: {_alarms(target.new_log_lines())}") from None
        elapsed = time.monotonic() - started
        statuses[resp.status_code] += 1
        if CASE_LOG:
            with open(CASE_LOG, "a") as f:
                f.write(json.dumps({"target": target.name, "path": path, "status": resp.status_code,
                                    "elapsed": round(elapsed, 3), "body": _short(case.body, 3000),
                                    "response": resp.text[:300]}) + "\n")
        context = f"{target.name} {path} -> {resp.status_code} in {elapsed:.2f}s\nbody: {_short(case.body)}\n" \
                  f"response: {resp.text[:1500]}"
        if resp.status_code >= 500:
            time.sleep(0.3)  # let the server log what happened
        logged = target.new_log_lines()
        alarms = _alarms(logged)
        assert resp.status_code < 500, f"server error\n{context}\nlogs: {_alarms(logged) or logged}"
        assert resp.status_code in ALLOWED_STATUS, f"unexpected status\n{context}"
        if resp.status_code == 200:
            _check_ok(resp, case.body, chat)
        else:
            _check_error_body(resp, resp.status_code)
        assert not alarms, f"a server logged an error\n{context}\nlogs: {alarms}"

    http = httpx.Client(timeout=DEADLINE_S)
    try:
        run()
    finally:
        http.close()
        record_property("statuses", dict(statuses))
        print(f"\n{target.name} {path}: {sum(statuses.values())} calls, statuses {dict(statuses)}")
    _check_idle(target)
    _check_canonical(target)
    assert statuses[200] > 0, f"no generated request was served: {dict(statuses)}"


@pytest.mark.parametrize("target", ["both", "proxy"], indirect=True)
def test_read_endpoints(target: Target):
    """The schema's GET operations (/v1/models, /health, /metrics, /status) answer 200."""
    schema = schemathesis.openapi.from_url(f"{target.url}/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.method.upper() != "GET":
            continue
        kwargs = operation.Case().as_transport_kwargs(base_url=target.url)
        resp = httpx.request(kwargs["method"], kwargs["url"], timeout=DEADLINE_S)
        assert resp.status_code == 200, (operation.path, resp.status_code, resp.text)


RAW_BODIES = [  # (bytes, expected status): bodies no JSON encoder writes
    (b"", 400), (b"[]", 400), (b"null", 400), (b'"prompt"', 400), (b"42", 400), (b"{", 400),
    (b'{"prompt": "a", "max_tokens": 2, "temperature": NaN}', 400),
    (b'{"prompt": "a", "max_tokens": 2, "temperature": Infinity}', 400),
    (b'{"prompt": "a", "max_tokens": 2, "top_p": -Infinity}', 400),
    (b'{"prompt": "a", "prompt": "b", "max_tokens": 2}', ANY),
    (b'{"prompt": "a", "max_tokens": 2, "user": "\\ud800"}', ANY),  # a lone surrogate
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),  # nested past the recursion limit
    (b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}', 413),  # over the 32 MiB body limit
    (b'{"prompt": "a", "max_tokens": 2}\x00\xff', 400),
]
COMPLETION_ONLY = {"prompt", "echo"}
CHAT_ONLY = {"messages", "chat_template", "top_logprobs", "add_generation_prompt", "max_completion_tokens"}
HOSTILE_BASE = {"/v1/completions": {"prompt": "A hostile value rides on this", "max_tokens": 4},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "A hostile value"}], "max_tokens": 4}}


def _paths_for(override: dict) -> list[str]:
    keys = set(override)
    if keys & COMPLETION_ONLY or _is_int(override.get("logprobs")):
        return ["/v1/completions"]
    if keys & CHAT_ONLY:
        return ["/v1/chat/completions"]
    return list(OPERATIONS)


@pytest.mark.parametrize("target", ["both", "prefill", "decode", "proxy"], indirect=True)
def test_hostile_values(target: Target):
    """Every entry of the hostile table, on a valid base request: the expected status (and
    `param`), or a 4xx with an OpenAI error body, or a correct answer; never a 5xx, a hang or a
    traceback. All failures are collected and reported together."""
    failures = []
    calls = 0
    target.new_log_lines()
    with httpx.Client(timeout=DEADLINE_S) as http:
        for override, expect in _hostile(target.kv_addr):
            if target.name == "proxy" and "kv_transfer_params" in override:
                expect = ANY  # the proxy owns this field: it replaces the client's value
            for path in _paths_for(override):
                body = {**HOSTILE_BASE[path], **override}
                calls += 1
                started = time.monotonic()
                try:
                    resp = http.post(f"{target.url}{path}", content=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
                except httpx.HTTPError as exc:
                    time.sleep(0.3)  # let the server log what happened
                    failures.append(f"{path} {_short(override, 300)}: no answer ({type(exc).__name__}) after "
                                    f"{time.monotonic() - started:.1f}s; logs: {_alarms(target.new_log_lines())}")
                    continue
                problem = None
                try:
                    assert resp.status_code < 500, "server error"
                    assert resp.status_code in ALLOWED_STATUS, "unexpected status"
                    if resp.status_code == 200:
                        _check_ok(resp, body, path.endswith("chat/completions"))
                    else:
                        _check_error_body(resp, resp.status_code)
                    if isinstance(expect, int):
                        assert resp.status_code == expect, f"expected {expect}"
                    elif isinstance(expect, tuple):
                        assert resp.status_code == expect[0], f"expected {expect[0]} naming {expect[1]}"
                        assert resp.json()["error"]["param"] == expect[1], f"expected param {expect[1]}"
                except (AssertionError, ValueError, KeyError) as exc:
                    problem = str(exc).split("\n")[0]
                    time.sleep(0.3)  # let the server log what happened
                logged = target.new_log_lines()
                alarms = _alarms(logged)
                if alarms and problem is None:
                    problem = "a server logged an error"
                if problem:
                    failures.append(f"{path} {_short(override, 300)}: {problem}; got {resp.status_code} "
                                    f"{resp.text[:600]!r}" + (f"; logs: {alarms}" if alarms else ""))
        for raw, expect in RAW_BODIES:
            for path in OPERATIONS:
                calls += 1
                try:
                    if len(raw) > 2**20:
                        status, payload = _post_large(target.url, path, raw)
                        resp = httpx.Response(status, content=payload)
                    else:
                        resp = http.post(f"{target.url}{path}", content=raw, headers={"Content-Type": "application/json"})
                except (httpx.HTTPError, OSError) as exc:
                    time.sleep(0.3)  # let the server log what happened
                    failures.append(f"{path} raw {raw[:80]!r} ({len(raw)} bytes): no answer ({type(exc).__name__}); "
                                    f"logs: {_alarms(target.new_log_lines())}")
                    continue
                problem = None
                if resp.status_code >= 500 or resp.status_code not in ALLOWED_STATUS:
                    problem = "server error" if resp.status_code >= 500 else "unexpected status"
                elif expect is not ANY and resp.status_code != expect:
                    problem = f"expected {expect}"
                elif resp.status_code != 200:
                    try:
                        _check_error_body(resp, resp.status_code)
                    except (AssertionError, ValueError) as exc:
                        problem = str(exc).split("\n")[0]
                if problem:
                    time.sleep(0.3)
                alarms = _alarms(target.new_log_lines())
                if problem or alarms:
                    failures.append(f"{path} raw {raw[:80]!r} ({len(raw)} bytes): {problem or 'a server logged an error'}; "
                                    f"got {resp.status_code} {resp.text[:300]!r}" + (f"; logs: {alarms}" if alarms else ""))
    print(f"\n{target.name}: {calls} hostile calls, {len(failures)} failures")
    _check_idle(target)
    _check_canonical(target)
    assert not failures, f"{len(failures)} of {calls} hostile calls failed:\n" + "\n".join(failures)
