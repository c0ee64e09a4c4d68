"""Prompt logprobs and echo (issue 27, item 7): what evaluation harnesses send (lm-eval's
loglikelihood: a completion with echo, max_tokens 0 and logprobs) and vLLM's prompt_logprobs.

Oracle: transformers on the same weights, teacher-forced over the prompt (log_softmax of its
logits at each position, in float64); echo against the same request without it. The P->D proxy
and streaming are covered by tests/test_differential.py, which draws echo and prompt_logprobs.
"""
from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import HFReference, assert_engine_idle
from tests.server_utils import ServerProcess

TOL = 1e-4  # float32 engine against float64 of transformers' float32 logits (measured: ~2e-6)
K = 3


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLM:
    # Chunks of 16 tokens: a prompt's logprobs come from several steps.
    return LLM(str(tiny_llama), num_blocks=64, dtype="float32", max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> HFReference:
    return HFReference(tiny_llama)


def _expected(hf: HFReference, prompt: list[int]) -> torch.Tensor:
    """Row i: the log-probabilities of what follows prompt[:i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf.model(torch.tensor([prompt])).logits[0].double(), dim=-1)


def _assert_prompt_logprobs(hf: HFReference, prompt: list[int], got: list, k: int) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    ref = _expected(hf, prompt)
    for i in range(1, len(prompt)):
        row, entry, token = ref[i - 1], got[i], prompt[i]
        assert token in entry and abs(entry[token].logprob - row[token]) <= TOL, (i, entry, float(row[token]))
        # Its rank among the reference's (ties within the tolerance either way).
        assert (row > row[token] + TOL).sum() + 1 <= entry[token].rank <= (row > row[token] - TOL).sum() + 1
        # The top k: each is among the reference's best k (within the tolerance), with its value.
        kth = row.topk(k).values[-1] if k else None
        others = [t for t in entry if t != token or entry[t].rank <= k]
        assert len(others) == k, (i, entry)
        for t in others:
            assert row[t] >= kth - TOL and abs(entry[t].logprob - row[t]) <= TOL, (i, t, entry)


def test_prompt_logprobs_equal_transformers_teacher_forced(engine, reference):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 49152, size=n).tolist() for n in (2, 15, 16, 17, 50)]
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        _assert_prompt_logprobs(reference, prompt, out.prompt_logprobs, K)
    # Without the option, none; k = 0: the prompt token alone.
    plain, only = engine.generate([{"prompt_token_ids": prompts[3]}] * 2, [
        SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)],
        use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert [None if e is None else list(e) for e in only.prompt_logprobs] == [None] + [[t] for t in prompts[3][1:]]
    assert_engine_idle(engine)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(engine, reference):
    """Every prompt position's logits are needed: a prefix-cache hit would skip them. The
    request computes its prompt whole (no cached tokens) and n samples each get the same."""
    prompt = np.random.default_rng(1).integers(3, 49152, size=40).tolist()
    warm = engine.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    again = engine.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert again[0].num_cached_tokens >= 32, "the prompt was not cached: this test proves nothing"
    out = engine.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=3,
                                                                         prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and len(out.outputs) == 2
    _assert_prompt_logprobs(reference, prompt, out.prompt_logprobs, 2)
    assert warm[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    assert_engine_idle(engine)


def test_prompt_logprobs_are_validated(engine):
    for bad in (-1, 21, 1.5, "2", True):
        with pytest.raises((ValueError, TypeError), match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


# ---- the OpenAI-compatible server ------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(str(tiny_llama), "--served-model-name", "tiny", "--num-blocks", "64",
                        "--dtype", "float32", "--max-num-batched-tokens", "16")
    yield srv
    assert srv.stop() in (0, -15)


def _post(server, path: str, body: dict) -> dict:
    resp = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_lm_eval_loglikelihood_request(server, reference, tiny_llama):
    """echo + max_tokens 0 + logprobs through the official client: the prompt back as text and
    tokens, each token's logprob (the first null) as transformers computes it, nothing generated."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(model="tiny", prompt=text, echo=True, max_tokens=0, logprobs=1, temperature=0)
    choice = answer.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(ids)
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    ref = _expected(reference, ids)
    for i in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[i] - ref[i - 1, ids[i]]) <= TOL
        (best, value), = logprobs.top_logprobs[i].items()
        assert abs(value - ref[i - 1].max()) <= TOL
    assert logprobs.text_offset == list(np.cumsum([0] + [len(t) for t in logprobs.tokens[:-1]]))
    client.close()


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_answer(server, tiny_llama, stream):
    """Each choice: the prompt's text (ids given: decoded) and then the answer the same request
    gives without echo; its logprobs: the prompt tokens' (the first null), then the answer's,
    whose text offsets move past the prompt tokens' strings."""
    from transformers import AutoTokenizer
    prompt = [5, 900, 77, 1234, 42, 8]
    prompt_text = AutoTokenizer.from_pretrained(str(tiny_llama)).decode(prompt)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.8, "logprobs": 2, "n": 2, "seed": 3}
    plain = _post(server, "/v1/completions", body)["choices"]
    if stream:
        resp = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", **body, "echo": True, "stream": True},
                          timeout=60)
        chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        echoed: dict[int, dict] = {}
        for chunk in chunks:
            for c in chunk["choices"]:
                e = echoed.setdefault(c["index"], {"text": "", "logprobs": {"tokens": [], "token_logprobs": [],
                                                                            "text_offset": []}})
                e["text"] += c["text"]
                for key in e["logprobs"]:
                    e["logprobs"][key] += c["logprobs"][key]
        choices = [echoed[i] for i in sorted(echoed)]
    else:
        choices = _post(server, "/v1/completions", {**body, "echo": True})["choices"]
    assert len(choices) == 2 and plain[0]["text"] != plain[1]["text"]
    for echo, alone in zip(choices, plain):
        got, want = echo["logprobs"], alone["logprobs"]
        prompt_chars = len("".join(got["tokens"][:len(prompt)]))
        assert echo["text"] == prompt_text + alone["text"]
        assert got["tokens"][len(prompt):] == want["tokens"] and got["token_logprobs"][0] is None
        assert np.allclose(got["token_logprobs"][len(prompt):], want["token_logprobs"], atol=1e-5)
        assert got["text_offset"][len(prompt):] == [o + prompt_chars for o in want["text_offset"]]
        assert got["text_offset"][:len(prompt)] == list(np.cumsum([0] + [len(t) for t in got["tokens"][:len(prompt) - 1]]))


def test_prompt_logprobs_field_in_vllms_shape(server, reference):
    prompt = [11, 4000, 2, 999, 31]
    ref = _expected(reference, prompt)
    completion = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1})
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                  "prompt_logprobs": 0})
    entries = completion["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for i in range(1, len(prompt)):
        entry = entries[i][str(prompt[i])]
        assert abs(entry["logprob"] - ref[i - 1, prompt[i]]) <= TOL and entry["rank"] >= 1
        assert isinstance(entry["decoded_token"], str)
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})["choices"][0]


def test_echo_and_prompt_logprobs_refusals(server):
    def error(path: str, body: dict) -> tuple[int, str]:
        resp = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=60)
        return resp.status_code, resp.json()["error"]["param"]

    assert error("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}) == (400, "echo")
    assert error("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}) == (400, "prompt_logprobs")
    assert error("/v1/completions", {"prompt": "x", "max_tokens": 0}) == (400, "max_tokens")  # only with echo
    # KV computed elsewhere has no prompt logits here.
    forged = {"do_remote_prefill": True, "remote_kv_addr": "tcp://127.0.0.1:9", "remote_request_id": "r",
              "num_tokens": 1, "token_digest": "0" * 64}
    assert error("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "kv_transfer_params": forged}) == (
        400, "prompt_logprobs")
