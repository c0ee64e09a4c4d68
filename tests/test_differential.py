"""Differential test of disaggregated prefill (FAULTS.md case 28): hypothesis generates valid
OpenAI requests and each goes to a colocated `engine serve` and through `engine proxy` to a
prefill and a decode instance (same tiny model, same flags). The answers must be equal: texts,
finish and stop reasons, token counts, logprobs (token strings exactly, values within
LOGPROB_TOL) and usage (cached-token counts may differ). With ``return_token_ids`` the token ids
too, and every answer's text against an oracle that is not the engine: ``tokenizer.decode`` of
prompt and output ids, after the prompt's own text (cut at the stop string that ended it).

Requests cover both endpoints, prompts as a string, a list of strings, token ids and a list of
token-id lists, `n` 1-3, greedy and seeded sampling, stop strings, `min_tokens`, `logprobs`,
`ignore_eos`, and streaming with and without `stream_options.include_usage`. Some go through the
official `openai` client, the others through httpx. A streamed request is also streamed from
the colocated server, so streamed and whole reconstructions are compared with each other too.

CI runs EXAMPLES (25) derandomized examples; set ENGINE_FUZZ_EXAMPLES for a longer run.
"""
from __future__ import annotations

import json
import math
import os
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.disagg_utils import Disagg
from tests.server_utils import ServerProcess

MODEL = "tiny"
TOKENIZER = None  # the tiny model's, set by the colocated fixture: the text oracle
VOCAB = 49152  # tests/conftest.py TINY_COMMON
ENGINE_ARGS = ("--served-model-name", MODEL, "--num-blocks", "128", "--max-model-len", "512")
EXAMPLES = int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "25"))
LOGPROB_TOL = 1e-3
TIMEOUT_S = 60.0
# Short stop strings: the tiny random model's output contains them often enough to matter.
STOPS = [" ", "e", "a", "s", "t", "in", "er", ".", ",", "\n", "the", "on"]


# ---- servers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def colocated(tiny_llama):
    global TOKENIZER
    from transformers import AutoTokenizer
    TOKENIZER = AutoTokenizer.from_pretrained(str(tiny_llama))
    srv = ServerProcess(str(tiny_llama), *ENGINE_ARGS)
    yield srv
    assert srv.stop() in (0, -15)


@pytest.fixture(scope="module")
def pd(tiny_llama):
    cluster = Disagg(str(tiny_llama), *ENGINE_ARGS)
    yield cluster
    cluster.stop()


# ---- requests -----------------------------------------------------------------------------
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=30)
TOKEN_IDS = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=40)
PROMPTS = st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3), TOKEN_IDS,
                    st.lists(TOKEN_IDS, min_size=1, max_size=3))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": TEXT}),
                    min_size=1, max_size=3)


@st.composite
def requests(draw) -> tuple[str, dict, str]:
    """(path, body, client): a valid request and which client sends it."""
    chat = draw(st.booleans())
    body: dict = {"model": MODEL}
    if chat:
        body["messages"] = draw(MESSAGES)
    else:
        body["prompt"] = draw(PROMPTS)
    body["max_tokens"] = draw(st.integers(1, 12))
    if draw(st.booleans()):
        body["min_tokens"] = draw(st.integers(0, body["max_tokens"]))
    n = draw(st.integers(1, 3))
    if n > 1 or draw(st.booleans()):
        body["n"] = n
    if draw(st.booleans()):
        body["temperature"] = 0.0
        if draw(st.booleans()):
            body["seed"] = draw(st.integers(0, 2**31 - 1))
    else:
        body["temperature"] = draw(st.sampled_from([0.3, 0.8, 1.0, 1.7]))
        body["seed"] = draw(st.integers(0, 2**63 - 1))
    if draw(st.booleans()):
        stop = draw(st.lists(st.sampled_from(STOPS), min_size=1, max_size=3, unique=True))
        body["stop"] = stop[0] if len(stop) == 1 and draw(st.booleans()) else stop
    if draw(st.booleans()):
        if chat:
            body["logprobs"] = True
            if draw(st.booleans()):
                body["top_logprobs"] = draw(st.integers(0, 3))
        else:
            body["logprobs"] = draw(st.integers(0, 3))
    if not chat and draw(st.integers(0, 3)) == 0:  # the prompt before each choice (lm-eval: max_tokens 0)
        body["echo"] = True
        if draw(st.booleans()):
            body["max_tokens"] = 0
            body.pop("min_tokens", None)
    if draw(st.integers(0, 3)) == 0:
        body["prompt_logprobs"] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        body["ignore_eos"] = draw(st.booleans())
    if draw(st.booleans()):
        body["return_token_ids"] = True
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, body, draw(st.sampled_from(["httpx", "openai"]))


# ---- sending and reconstructing -----------------------------------------------------------
OPENAI_FIELDS = {"model", "prompt", "messages", "max_tokens", "n", "temperature", "seed", "stop", "logprobs", "echo",
                 "top_logprobs", "stream", "stream_options"}


def _openai_call(url: str, path: str, body: dict) -> tuple[int, list[dict] | dict]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    kwargs = {k: v for k, v in body.items() if k in OPENAI_FIELDS}
    extra = {k: v for k, v in body.items() if k not in OPENAI_FIELDS}
    api = client.chat.completions if path.endswith("chat/completions") else client.completions
    try:
        result = api.create(**kwargs, extra_body=extra or None)
        if body.get("stream"):
            return 200, [chunk.model_dump() for chunk in result]
        return 200, result.model_dump()
    except openai.APIStatusError as exc:
        return exc.status_code, exc.response.text
    finally:
        client.close()


def _httpx_call(url: str, path: str, body: dict) -> tuple[int, list[dict] | dict]:
    resp = httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT_S)
    if resp.status_code != 200:
        return resp.status_code, resp.text
    if not body.get("stream"):
        return 200, resp.json()
    assert resp.headers["content-type"].startswith("text/event-stream"), resp.headers
    events = [line[len("data: "):] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, resp.text[-500:]
    return 200, [json.loads(e) for e in events[:-1]]


def call(url: str, path: str, body: dict, client: str) -> tuple[int, list[dict] | dict]:
    return (_openai_call if client == "openai" else _httpx_call)(url, path, body)


def _logprob_entries(logprobs, chat: bool) -> list[tuple]:
    """One (token, logprob, top-k as ((token, logprob), ...), text_offset) per generated token."""
    if logprobs is None:
        return []
    if chat:
        return [(e["token"], e["logprob"], tuple((t["token"], t["logprob"]) for t in e.get("top_logprobs") or []),
                 None) for e in logprobs.get("content") or []]
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    return [(tok, lp, tuple((top or {}).items()), offset) for tok, lp, top, offset in
            zip(logprobs["tokens"], logprobs["token_logprobs"], tops, logprobs["text_offset"])]


def reconstruct(result, chat: bool, stream: bool) -> dict:
    """A streamed or whole answer as one comparable structure."""
    choices: dict[int, dict] = {}

    def choice(index: int) -> dict:
        return choices.setdefault(index, {"text": "", "finish_reason": None, "stop_reason": None,
                                          "logprobs": [], "has_logprobs": False, "finishes": 0,
                                          "token_ids": None, "prompt_token_ids": None, "prompt_logprobs": None})

    def add_prompt_logprobs(out: dict, entries) -> None:
        if entries is not None:
            assert out["prompt_logprobs"] is None, "prompt_logprobs twice for one choice"
            out["prompt_logprobs"] = entries

    def add_ids(out: dict, c: dict, prompt_ids) -> None:
        if c.get("token_ids") is not None:
            out["token_ids"] = (out["token_ids"] or []) + c["token_ids"]
        if prompt_ids is not None:
            assert out["prompt_token_ids"] is None, f"prompt_token_ids twice for one choice: {c}"
            out["prompt_token_ids"] = prompt_ids

    usage = None
    chat_prompt_ids = chat_prompt_logprobs = None
    if stream:
        for chunk in result:
            if chunk.get("prompt_logprobs") is not None:
                assert chat and chat_prompt_logprobs is None, f"prompt_logprobs twice, or on a completion chunk"
                chat_prompt_logprobs = chunk["prompt_logprobs"]
            if chunk.get("prompt_token_ids") is not None:
                assert chat and chat_prompt_ids is None, f"prompt_token_ids twice, or on a completion chunk: {chunk}"
                chat_prompt_ids = chunk["prompt_token_ids"]
            if chunk.get("usage"):
                assert not chunk["choices"], f"usage chunk with choices: {chunk}"
                assert usage is None, "two usage chunks"
                usage = chunk["usage"]
            for c in chunk["choices"]:
                out = choice(c["index"])
                assert out["finish_reason"] is None, f"a chunk after choice {c['index']} finished: {chunk}"
                out["text"] += (c.get("delta") or {}).get("content") or "" if chat else c.get("text") or ""
                add_ids(out, c, c.get("prompt_token_ids"))
                add_prompt_logprobs(out, c.get("prompt_logprobs"))
                if c.get("logprobs") is not None:
                    out["has_logprobs"] = True
                    out["logprobs"] += _logprob_entries(c["logprobs"], chat)
                if c.get("finish_reason") is not None:
                    out["finish_reason"] = c["finish_reason"]
                    out["stop_reason"] = c.get("stop_reason")
                    out["finishes"] += 1
    else:
        for c in result["choices"]:
            out = choice(c["index"])
            out["text"] = c["message"]["content"] if chat else c["text"]
            out["finish_reason"], out["stop_reason"], out["finishes"] = c["finish_reason"], c.get("stop_reason"), 1
            add_ids(out, c, c.get("prompt_token_ids"))
            add_prompt_logprobs(out, c.get("prompt_logprobs"))
            if c.get("logprobs") is not None:
                out["has_logprobs"] = True
                out["logprobs"] = _logprob_entries(c["logprobs"], chat)
        usage = result["usage"]
        chat_prompt_ids = result.get("prompt_token_ids")
        chat_prompt_logprobs = result.get("prompt_logprobs")
    for out in choices.values():
        if chat_prompt_ids is not None:
            out["prompt_token_ids"] = chat_prompt_ids
        if chat_prompt_logprobs is not None:
            out["prompt_logprobs"] = chat_prompt_logprobs
    return {"choices": [choices[i] for i in sorted(choices)], "indices": sorted(choices),
            "usage": None if usage is None else {k: usage[k] for k in ("prompt_tokens", "completion_tokens",
                                                                        "total_tokens")}}


def assert_consistent(answer: dict, what: str, echoed: list[str] | None = None) -> None:
    """One answer on its own: a choice cut by max_tokens names no stop string or token; with
    echo (``echoed``: each choice's prompt text, as given or decoded) its text starts with its
    prompt's; with token ids, its text (after that) is what tokenizer.decode makes of them
    after the prompt's text, up to the stop string that ended it."""
    for i, c in enumerate(answer["choices"]):
        if c["finish_reason"] == "length":
            assert c["stop_reason"] is None, f"{what}, choice {i}: finish_reason length with stop_reason {c['stop_reason']!r}"
        text = c["text"]
        if echoed is not None:
            assert text.startswith(echoed[i]), f"{what}, choice {i}: echo {text!r} does not start with {echoed[i]!r}"
            text = text[len(echoed[i]):]
        if c["token_ids"] is None:
            continue
        assert c["prompt_token_ids"] is not None, f"{what}, choice {i}: token_ids without prompt_token_ids"
        prompt = TOKENIZER.decode(c["prompt_token_ids"], skip_special_tokens=True)
        whole = TOKENIZER.decode(c["prompt_token_ids"] + c["token_ids"], skip_special_tokens=True)
        if not whole.startswith(prompt):  # the prompt ends inside a character its first output token completes
            continue
        expected = whole[len(prompt):]
        if isinstance(c["stop_reason"], str):
            assert expected.startswith(text) and expected[len(text):].startswith(c["stop_reason"]), (
                f"{what}, choice {i}: text {text!r} is not {expected!r} cut at {c['stop_reason']!r}")
        else:
            assert text == expected, f"{what}, choice {i}: text {text!r} != decoded {expected!r}"


def _same_prompt_logprobs(want, got, where: str) -> None:
    assert (got is None) == (want is None), f"{where}: prompt_logprobs {got} != {want}"
    if want is None:
        return
    assert len(got) == len(want) and got[0] is None and want[0] is None, f"{where}: prompt_logprobs {got} != {want}"
    for k, (g, w) in enumerate(zip(got[1:], want[1:]), start=1):
        assert g.keys() == w.keys(), f"{where}, prompt token {k}: {g} != {w}"
        for token, entry in w.items():
            assert g[token]["decoded_token"] == entry["decoded_token"], f"{where}, prompt token {k}: {g} != {w}"
            assert math.isclose(g[token]["logprob"], entry["logprob"], abs_tol=LOGPROB_TOL), f"{where}: {g} != {w}"


def assert_same(want: dict, got: dict, what: str, echoed: list[str] | None = None) -> None:
    assert_consistent(want, f"{what} (reference)", echoed)
    assert_consistent(got, what, echoed)
    assert got["indices"] == want["indices"], f"{what}: choice indices {got['indices']} != {want['indices']}"
    for i, (w, g) in enumerate(zip(want["choices"], got["choices"])):
        where = f"{what}, choice {i}"
        assert g["finishes"] == 1, f"{where}: {g['finishes']} finish_reasons"
        assert g["text"] == w["text"], f"{where}: text {g['text']!r} != {w['text']!r}"
        assert g["token_ids"] == w["token_ids"], f"{where}: token_ids {g['token_ids']} != {w['token_ids']}"
        assert g["prompt_token_ids"] == w["prompt_token_ids"], (
            f"{where}: prompt_token_ids {g['prompt_token_ids']} != {w['prompt_token_ids']}")
        assert g["finish_reason"] == w["finish_reason"], f"{where}: finish_reason {g['finish_reason']} != {w['finish_reason']}"
        assert g["stop_reason"] == w["stop_reason"], f"{where}: stop_reason {g['stop_reason']!r} != {w['stop_reason']!r}"
        assert g["has_logprobs"] == w["has_logprobs"], f"{where}: logprobs present {g['has_logprobs']} != {w['has_logprobs']}"
        _same_prompt_logprobs(w["prompt_logprobs"], g["prompt_logprobs"], where)
        assert len(g["logprobs"]) == len(w["logprobs"]), (
            f"{where}: {len(g['logprobs'])} logprob entries != {len(w['logprobs'])}")
        for k, (ge, we) in enumerate(zip(g["logprobs"], w["logprobs"])):
            assert ge[0] == we[0], f"{where}, token {k}: {ge[0]!r} != {we[0]!r}"
            assert ge[3] == we[3], f"{where}, token {k}: text_offset {ge[3]} != {we[3]}"
            assert (ge[1] is None) == (we[1] is None), f"{where}, token {k}: logprob {ge[1]} != {we[1]}"  # echo's first
            assert we[1] is None or math.isclose(ge[1], we[1], abs_tol=LOGPROB_TOL), (
                f"{where}, token {k}: logprob {ge[1]} != {we[1]}")
            assert [t for t, _ in ge[2]] == [t for t, _ in we[2]], f"{where}, token {k}: top {ge[2]} != {we[2]}"
            for (_, gv), (_, wv) in zip(ge[2], we[2]):
                assert math.isclose(gv, wv, abs_tol=LOGPROB_TOL), f"{where}, token {k}: top {ge[2]} != {we[2]}"
    if want["usage"] is not None or got["usage"] is not None:
        assert got["usage"] == want["usage"], f"{what}: usage {got['usage']} != {want['usage']}"


def _echoed_texts(body: dict) -> list[str]:
    """Per choice, the prompt text echo puts before it: the prompt as given, or its ids decoded."""
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    texts = [p if isinstance(p, str) else TOKENIZER.decode(p) for p in prompts]
    n = body.get("n", 1)
    return [texts[i // n] for i in range(len(texts) * n)]


def _log_tail(srv: ServerProcess, lines: int = 15) -> str:
    return "\n".join(srv.log_path.read_text(errors="replace").splitlines()[-lines:])


# ---- the test -----------------------------------------------------------------------------
def test_pd_equals_colocated(colocated, pd):
    cases = {"examples": 0, "stream": 0, "openai": 0, "chat": 0, "n>1": 0, "sampled": 0, "logprobs": 0, "stop": 0,
             "token_ids": 0, "echo": 0, "prompt_logprobs": 0}
    started = time.monotonic()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(request=requests())
    def run(request):
        path, body, client = request
        try:
            check(path, body, client)
        except AssertionError as exc:
            message = str(exc)
            if not message.startswith("request ("):
                message = f"request ({client}) {path} {json.dumps(body)}\n{message}"
            raise AssertionError(message) from None

    def check(path: str, body: dict, client: str) -> None:
        chat = path.endswith("chat/completions")
        stream = bool(body.get("stream"))
        cases["examples"] += 1
        cases["stream"] += stream
        cases["openai"] += client == "openai"
        cases["chat"] += chat
        cases["n>1"] += body.get("n", 1) > 1
        cases["sampled"] += body["temperature"] > 0
        cases["logprobs"] += "logprobs" in body
        cases["stop"] += "stop" in body
        cases["token_ids"] += "return_token_ids" in body
        cases["echo"] += bool(body.get("echo"))
        cases["prompt_logprobs"] += "prompt_logprobs" in body
        context = f"request ({client}) {path} {json.dumps(body)}"
        echoed = _echoed_texts(body) if body.get("echo") else None

        # The reference: colocated, whole, over httpx.
        status, whole = _httpx_call(colocated.url, path, {**body, "stream": False, "stream_options": None}
                                    if stream else body)
        assert status == 200, f"{context}\ncolocated answered {status}: {whole}"
        want = reconstruct(whole, chat, stream=False)
        if stream:  # colocated, streamed as asked: the same answer
            status, chunks = call(colocated.url, path, body, client)
            assert status == 200, f"{context}\ncolocated (stream) answered {status}: {chunks}"
            got = reconstruct(chunks, chat, stream=True)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            assert (got["usage"] is not None) == include_usage, f"{context}\nusage chunk: {got['usage']}"
            assert_same({**want, "usage": want["usage"] if include_usage else None}, got,
                        f"{context}\ncolocated streamed vs whole", echoed)
        status, answer = call(pd.url, path, body, client)
        assert status == 200, (f"{context}\nproxy answered {status}: {answer}\ncolocated: {want}\n"
                               f"prefill log:\n{_log_tail(pd.prefill)}\ndecode log:\n{_log_tail(pd.decode)}")
        got = reconstruct(answer, chat, stream)
        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            assert (got["usage"] is not None) == include_usage, f"{context}\nproxy usage chunk: {got['usage']}"
            want = {**want, "usage": want["usage"] if include_usage else None}
        try:
            assert_same(want, got, "P->D vs colocated", echoed)
        except AssertionError as exc:
            raise AssertionError(f"{context}\n{exc}\ncolocated: {json.dumps(want)}\nproxy:     {json.dumps(got)}\n"
                                 f"prefill log:\n{_log_tail(pd.prefill)}\ndecode log:\n{_log_tail(pd.decode)}") from None

    try:
        run()
    finally:
        print(f"\ndifferential: {cases} in {time.monotonic() - started:.0f}s")
    for srv in (colocated, pd.prefill, pd.decode):
        status = srv.wait_idle()
        assert status["kv_blocks"]["free"] == status["kv_blocks"]["total"], status
