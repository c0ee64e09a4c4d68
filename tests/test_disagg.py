"""Disaggregated prefill end to end: P computes the prompt's KV, D pulls it over pyzmq and
continues, the proxy routes. Output must equal the colocated engine token for token, and no
blocks may stay held on P or D afterwards."""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import time

import httpx
import msgspec
import openai
import pytest

from engine import LLM, SamplingParams
from engine.kv_transfer.p2p import ipc_path
from engine.kv_transfer.params import KVTransferParams, sign_kv_transfer_params, token_digest
from engine.kv_transfer.secret import KVSecret
from tests.disagg_utils import Disagg, ProxyProcess
from tests.server_utils import ServerProcess, free_port, leave_when, wait_for

ENGINE_ARGS = ("--num-blocks", "256", "--max-model-len", "1024", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def pd(tiny_llama):
    cluster = Disagg(str(tiny_llama), *ENGINE_ARGS)
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def _idle_after(request):
    yield
    if "pd" in request.fixturenames:
        request.getfixturevalue("pd").wait_idle()


@pytest.fixture(scope="module")
def colocated(tiny_llama):
    return LLM(str(tiny_llama), num_blocks=256, max_model_len=1024)


def _token_prompts() -> list[list[int]]:
    rng = random.Random(3)
    # Shorter than a block, exactly one and two blocks, in between, and long.
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 16, 32, 45, 300)]


def test_p_to_d_equals_colocated(pd, colocated):
    client = openai.OpenAI(base_url=f"{pd.url}/v1", api_key="x", max_retries=0)
    prompts = _token_prompts()
    expected = colocated.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                  use_tqdm=False)
    for prompt, exp in zip(prompts, expected):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == exp.outputs[0].text, f"prompt of {len(prompt)} tokens"
        # D served every prompt token from P's KV (it continues from P's first token).
        assert resp.usage.prompt_tokens_details.cached_tokens == len(prompt)
    d_status = pd.decode.status()
    assert d_status["kv_transfer"]["bytes"] > 0 and not d_status["kv_transfer"]["failures"]
    assert pd.prefill.status()["kv_transfer"]["bytes"] > 0


def test_streaming_and_chat_through_proxy(pd, colocated):
    client = openai.OpenAI(base_url=f"{pd.url}/v1", api_key="x", max_retries=0)
    expected = colocated.generate("Streaming through P and D", SamplingParams(temperature=0, max_tokens=12,
                                                                              ignore_eos=True), use_tqdm=False)
    stream = client.completions.create(model="tiny", prompt="Streaming through P and D", max_tokens=12,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected[0].outputs[0].text
    messages = [{"role": "user", "content": "Hello from the proxy"}]
    want = colocated.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want


def test_prefix_hit_on_decode(pd, colocated):
    """FAULTS 20, full prefix hit on D: the second time, D's own prefix cache holds the whole
    prompt (288 tokens, 18 whole blocks; D computes only from P's first token on), so D pulls
    nothing and tells P to release its copy at once, long before P's 30 s lease."""
    client = openai.OpenAI(base_url=f"{pd.url}/v1", api_key="x", max_retries=0)
    prompt = _token_prompts()[4][:288]
    want = colocated.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert first.choices[0].text == want and first.usage.prompt_tokens_details.cached_tokens == 288
    pd.wait_idle()
    p_bytes, d_bytes = pd.prefill.status()["kv_transfer"]["bytes"], pd.decode.status()["kv_transfer"]["bytes"]
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert second.choices[0].text == want and second.usage.prompt_tokens_details.cached_tokens == 288
    pd.prefill.wait_idle(timeout=5)  # released by D, not by the lease
    assert pd.prefill.status()["kv_transfer"]["bytes"] == p_bytes
    assert pd.decode.status()["kv_transfer"]["bytes"] == d_bytes


def test_a_decode_that_refuses_a_hand_off_releases_it(pd):
    """Issue 28: a vLLM-style router sends D the client's request with P's parameters and never
    releases them itself. When D refuses the request (here prompt_logprobs, which needs the prompt
    computed on D; a full queue or a request bigger than D's pool alike), D tells P to free the
    KV at once: P is idle long before its 30 s lease."""
    prompt = [23] * 40
    signed = httpx.post(f"{pd.prefill.url}/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
    ).json()["kv_transfer_params"]
    assert pd.prefill.status()["kv_blocks"]["in_use"] > 0  # on offer, under the lease
    resp = httpx.post(f"{pd.decode.url}/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 1, "kv_transfer_params": signed})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs", resp.text
    pd.prefill.wait_idle(timeout=5)  # released by D's refusal, not by the lease


def test_32_concurrent_requests(pd, colocated):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 120))] for _ in range(32)]
    expected = [o.outputs[0].text for o in colocated.generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)]

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{pd.url}/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(client.completions.create(
            model="tiny", prompt=p, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}) for p in prompts))

    results = asyncio.run(run())
    assert [r.choices[0].text for r in results] == expected


def test_concurrent_requests_sharing_a_request_id_through_the_proxy(pd, colocated):
    """Concurrent requests with one X-Request-Id (or body request_id) all go P -> D and are
    answered, each echoing the client's id: the proxy gives each its own engine request id, the
    same on P and D (X-Engine-Request-Id)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(40)] for _ in range(4)]
    expected = [o.outputs[0].text for o in colocated.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            def one(i: int):
                body = {"prompt": prompts[i], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                        "stream": i == 3}
                if i % 2:
                    return http.post(f"{pd.url}/v1/completions", json={**body, "request_id": "trace-7"})
                return http.post(f"{pd.url}/v1/completions", json=body, headers={"X-Request-Id": "trace-7"})
            return await asyncio.gather(*(one(i) for i in range(4)))

    for i, (resp, want) in enumerate(zip(asyncio.run(run()), expected)):
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-request-id"] == "trace-7"
        if i == 3:
            events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
            assert all(e["id"] == "trace-7" for e in events)
            assert "".join(c["text"] for e in events for c in e["choices"]) == want
        else:
            answer = resp.json()
            assert answer["id"] == "trace-7" and answer["choices"][0]["text"] == want
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 40  # D pulled P's KV


def test_prompt_lists_and_n_through_the_proxy(pd, colocated):
    """FAULTS 28: each prompt of a list, and each of n samples, gets its own prompt's KV. (Once,
    every sub-request pulled the first prompt's KV and cached it under its own hashes.)"""
    prompts = ["The capital of France is", "def fibonacci(n):", "The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].text for o in colocated.generate(prompts, params, use_tqdm=False)]
    resp = httpx.post(f"{pd.url}/v1/completions", timeout=60, json={
        "prompt": prompts, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])] == want
    # n seeded samples of one prompt: the same n texts as colocated, and one transfer for all.
    sampled = colocated.generate("Tell me a story", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6),
                                 use_tqdm=False)[0].outputs
    before = pd.decode.status()["kv_transfer"]
    resp = httpx.post(f"{pd.url}/v1/completions", timeout=60, json={
        "prompt": "Tell me a story", "n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 6})
    assert resp.status_code == 200, resp.text
    assert [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])] == [o.text for o in sampled]
    after = pd.decode.status()["kv_transfer"]
    assert after["failures"] == before["failures"], "a sample pulled KV that was already taken"


def test_min_tokens_and_stop_through_the_proxy(pd, colocated):
    """FAULTS 28: min_tokens and stop strings hold across the first token, which P samples with the
    client's own parameters (EOS banned while min_tokens is not reached)."""
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop=["e"])
    want = colocated.generate("Hello there, my name", params, use_tqdm=False)[0].outputs[0]
    resp = httpx.post(f"{pd.url}/v1/completions", timeout=60, json={
        "prompt": "Hello there, my name", "max_tokens": 12, "min_tokens": 6, "stop": ["e"], "temperature": 0})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (want.text, want.finish_reason)


def _signed(params: dict, secret: str, ttl_s: float = 60) -> dict:
    """``params`` as a prefill instance of the deployment with ``secret`` would sign them."""
    struct = msgspec.convert({k: v for k, v in params.items() if k not in ("signature", "expires_at")},
                             KVTransferParams)
    return msgspec.to_builtins(sign_kv_transfer_params(struct, KVSecret(secret), ttl_s))


def test_kv_only_goes_to_its_own_tokens(pd, colocated):
    """FAULTS 27: a client that names another request's KV (its id and address, with a digest of
    its own prompt) is refused: at the edge, as the change breaks P's signature; and, should it
    come signed (an insider, or a deployment without a secret), by the prefill instance, which
    compares the digest. D recomputes its own prompt, the victim's KV stays on offer for its
    real consumer, and nothing foreign enters D's prefix cache."""
    victim_prompt, own_prompt = [11] * 40, [12] * 40
    p_resp = httpx.post(f"{pd.prefill.url}/v1/completions", timeout=30, json={
        "prompt": victim_prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": {"do_remote_decode": True}})
    victim = p_resp.json()["kv_transfer_params"]
    forged = {**{k: v for k, v in victim.items() if not k.startswith("first_")}, "token_digest": token_digest(own_prompt)}
    resp = httpx.post(f"{pd.decode.url}/v1/completions", timeout=30, json={
        "prompt": own_prompt, "max_tokens": 6, "kv_transfer_params": forged})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params.signature"
    forged = _signed(forged, pd.secret)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want_own, want_victim = (colocated.generate(p, params, use_tqdm=False)[0].outputs[0].text
                             for p in (own_prompt, victim_prompt))
    failures = pd.decode.status()["kv_transfer"]["failures"].get("mismatch", 0)
    resp = httpx.post(f"{pd.decode.url}/v1/completions", timeout=30, json={
        "prompt": own_prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "kv_transfer_params": forged})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want_own
    assert pd.decode.status()["kv_transfer"]["failures"].get("mismatch", 0) == failures + 1
    # The forged pull did not take the victim's KV: its real consumer still gets it.
    resp = httpx.post(f"{pd.decode.url}/v1/completions", timeout=30, json={
        "prompt": victim_prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "kv_transfer_params": victim})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want_victim
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 40


def test_decode_acts_only_on_signed_params(pd, colocated):
    """Issue 12: with a deployment secret, D acts only on kv_transfer_params its prefill
    instances signed. Unsigned, altered, foreign-signed or expired ones are a 400 naming the
    field, and D never connects to an address a client made up (a listener the test owns sees
    no connection). Replaying a used signed value is harmless: the KV is gone, D recomputes."""
    prompt = [21] * 40
    want = colocated.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text

    def decode(kv_params) -> httpx.Response:
        return httpx.post(f"{pd.decode.url}/v1/completions", timeout=30, json={
            "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "kv_transfer_params": kv_params})

    signed = httpx.post(f"{pd.prefill.url}/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    assert len(signed["signature"]) == 64 and signed["expires_at"] > time.time()
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.setblocking(False)
        elsewhere = f"tcp://127.0.0.1:{trap.getsockname()[1]}"
        unsigned = {k: v for k, v in signed.items() if k != "signature"}
        for bad, param in [
                (unsigned, "kv_transfer_params.signature"),
                ({**signed, "remote_kv_addr": elsewhere}, "kv_transfer_params.signature"),
                ({**signed, "signature": "ab" * 32}, "kv_transfer_params.signature"),
                ({**signed, "signature": "not hex"}, "kv_transfer_params.signature"),
                (_signed({**signed, "remote_kv_addr": elsewhere}, "another deployment's secret"),
                 "kv_transfer_params.signature"),
                (_signed({**signed, "remote_kv_addr": elsewhere}, pd.secret, ttl_s=-3600),
                 "kv_transfer_params.expires_at"),
                ({"kv_store_tokens": 32}, "kv_transfer_params.signature"),
                # First tokens are someone else's output too: signed or refused.
                ({"first_token_ids": [5], "first_tokens_digest": token_digest(prompt)},
                 "kv_transfer_params.signature")]:
            resp = decode(bad)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (bad, resp.text)
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody came
    failures = pd.decode.status()["kv_transfer"]["failures"]
    resp = decode(signed)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 40  # the pulled KV
    pd.decode.wait_idle()
    resp = decode(signed)  # replayed: P gave that KV away already
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want
    assert pd.decode.status()["kv_transfer"]["failures"] == {**failures, "not_found": failures.get("not_found", 0) + 1}


def test_prefill_errors_reach_the_client(pd):
    resp = httpx.post(f"{pd.url}/v1/completions", json={"prompt": "x", "temperature": -1}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"
    resp = httpx.post(f"{pd.url}/v1/completions", content=b"{nope", timeout=30)
    assert resp.status_code == 400


def test_lease_expiry_frees_prefill_blocks(tiny_llama):
    """Nobody pulls: the blocks stay held until the lease ends, then come back. (The lease has
    to outlast only one /status call after the response; the release is polled for.) Then a
    SIGTERM to the server and its engine core at once, as `make serve` stopped by SIGTERM
    delivers it to the process group: both exit cleanly and the KV server's ipc socket file is
    gone (the core used to die of the signal, leaving /tmp/engine-kv-PORT.sock behind)."""
    port = free_port()
    srv = ServerProcess(str(tiny_llama), "--num-blocks", "64", "--role", "prefill", "--kv-port", str(port),
                        "--kv-lease-s", "3")
    socket_file = ipc_path(port).removeprefix("ipc://")
    try:
        assert os.path.exists(socket_file)
        resp = httpx.post(f"{srv.url}/v1/completions", timeout=30, json={
            "prompt": [5] * 40, "max_tokens": 2, "ignore_eos": True, "kv_transfer_params": {"do_remote_decode": True}})
        params = resp.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["num_tokens"] == 40
        assert srv.status()["kv_transfer"]["blocks_held"] == 3  # 40 tokens in blocks of 16
        srv.wait_idle(timeout=20)
        assert srv.status()["kv_transfer"]["blocks_held"] == 0
    finally:
        code = srv.stop(group=True)
    assert code in (0, -15) and not os.path.exists(socket_file)
    assert "engine core shutting down" in srv.log_path.read_text()  # told by the server, not killed


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_kv_that_never_arrives(tiny_llama, colocated, policy):
    """D points at a prefill that is not there: it recomputes (correct output, counter +1) or
    fails the request, depending on the policy, within its deadline."""
    dead_port = free_port()
    srv = ServerProcess(str(tiny_llama), *ENGINE_ARGS, "--role", "decode", "--kv-load-timeout-s", "1",
                        "--kv-load-failure-policy", policy)
    try:
        prompt = _token_prompts()[3]
        params = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": "r1",
                  "remote_kv_addr": f"tcp://127.0.0.1:{dead_port}", "num_tokens": len(prompt),
                  "token_digest": token_digest(prompt)}
        resp = httpx.post(f"{srv.url}/v1/completions", timeout=30, json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "kv_transfer_params": params})
        if policy == "recompute":
            want = colocated.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                      use_tqdm=False)[0].outputs[0].text
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want
        else:
            assert resp.status_code == 502 and "KV cache load failed" in resp.json()["error"]["message"]
        assert srv.status()["kv_transfer"]["failures"] == {"timeout": 1}
        srv.wait_idle()
    finally:
        srv.stop()


def test_incompatible_peer_is_refused(tiny_llama, colocated):
    """P and D with different block sizes: refused at first contact with a clear reason."""
    cluster = Disagg(str(tiny_llama), "--num-blocks", "256", "--served-model-name", "tiny",
                     prefill_args=("--block-size", "16", "--kv-lease-s", "2"), decode_args=("--block-size", "8"))
    try:
        resp = httpx.post(f"{cluster.url}/v1/completions", timeout=60, json={
            "prompt": "mismatched peers", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        want = colocated.generate("mismatched peers", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].text
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want  # recomputed
        assert cluster.decode.status()["kv_transfer"]["failures"] == {"incompatible": 1}
        log = cluster.decode.log_path.read_text()
        assert "incompatible KV peer" in log and "bs16" in log and "bs8" in log
        cluster.wait_idle()  # P never got pulled: its lease (2 s) frees the blocks
    finally:
        cluster.stop()


def test_proxy_reports_a_dead_prefill(tiny_llama):
    from tests.disagg_utils import ProxyProcess
    decode = ServerProcess(str(tiny_llama), "--num-blocks", "64", "--role", "decode")
    proxy = ProxyProcess([f"http://127.0.0.1:{free_port()}"], [decode.url], "--timeout", "10")
    try:
        resp = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert resp.status_code == 502 and "unreachable" in resp.json()["error"]["message"]
        health = httpx.get(f"{proxy.url}/health", timeout=10)
        assert health.status_code == 503 and json.loads(health.text)["decode"] == {decode.url: True}
    finally:
        proxy.stop()
        decode.stop()


def _abort_count(server) -> float:
    for line in server.metrics().splitlines():
        if line.startswith("engine:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_disconnect_through_the_proxy(pd):
    """FAULTS 9 via the proxy: leaving mid-stream or mid non-stream aborts the request on D
    (counted once each), and neither P nor D keeps any block (the autouse check waits for both
    to be idle). The client leaves once D is observably decoding the request, which asks for
    about 1000 tokens: no client timeout has to be shorter than the generation."""
    before = _abort_count(pd.decode)
    body = {"prompt": "a long answer please", "max_tokens": 1000, "ignore_eos": True}
    decoding = lambda: pd.decode.status()["requests"]["running"] == 1  # noqa: E731
    with httpx.stream("POST", f"{pd.url}/v1/completions", timeout=30, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # kept: a line iterator that is dropped closes the connection
        assert next(line for line in lines if line.startswith("data: "))
        wait_for(decoding, state=lambda: pd.decode.status()["requests"])
    pd.wait_idle()
    assert _abort_count(pd.decode) == before + 1
    leave_when(f"{pd.url}/v1/completions", body, decoding)
    pd.wait_idle()
    assert _abort_count(pd.decode) == before + 2


def test_smollm2_p_to_d_equals_colocated(smollm2_dir):
    """The real default model: a 2k-token prompt, a short one, and chat through the proxy equal
    the colocated engine's greedy output; nothing stays held on P or D."""
    from tests.conftest import assert_engine_idle
    llm = LLM(num_blocks=400)
    rng = random.Random(2)
    long_prompt = [rng.randrange(100, 49152) for _ in range(2048)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want_long = llm.generate(long_prompt, params, use_tqdm=False)[0].outputs[0].text
    want_short = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    want_chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    assert_engine_idle(llm)
    del llm
    cluster = Disagg(str(smollm2_dir), "--num-blocks", "400", "--served-model-name", "smol")
    try:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0)
        resp = client.completions.create(model="smol", prompt=long_prompt, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == want_long
        assert resp.usage.prompt_tokens_details.cached_tokens == 2048
        resp = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert resp.choices[0].text == want_short
        chat = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
        assert chat.choices[0].message.content == want_chat
        cluster.wait_idle()
    finally:
        cluster.stop()


def test_proxy_skips_a_dead_prefill_and_spreads_load(pd, colocated):
    """Several upstreams: a dead prefill URL is skipped for a live one; the answer is still right."""
    from tests.disagg_utils import ProxyProcess
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = ProxyProcess([dead, pd.prefill.url], [pd.decode.url], "--policy", "round-robin")
    try:
        want = colocated.generate("two prefills", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].text
        for _ in range(3):  # round robin starts at each prefill in turn; the dead one is skipped
            resp = httpx.post(f"{proxy.url}/v1/completions", timeout=60, json={
                "prompt": "two prefills", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want
    finally:
        proxy.stop()


def test_small_decode_pool_under_arriving_kv(tiny_llama, colocated):
    """FAULTS 29 with real processes, the stall from the issue: a decode pool of 24 blocks behind
    the proxy, 20 concurrent ~100-token prompts with max_tokens 48 (each needs 10 of the 24
    blocks). KV keeps arriving while the pool is full; every request must finish, exactly."""
    cluster = Disagg(str(tiny_llama), "--max-model-len", "1024", "--served-model-name", "tiny",
                     prefill_args=("--num-blocks", "256"), decode_args=("--num-blocks", "24"))
    try:
        rng = random.Random(29)
        prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(90, 110))] for _ in range(20)]
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        expected = [o.outputs[0].text for o in colocated.generate(prompts, params, use_tqdm=False)]

        async def run():
            client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=180)
            return await asyncio.gather(*(client.completions.create(
                model="tiny", prompt=p, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
                for p in prompts))

        results = asyncio.run(run())
        assert [r.choices[0].text for r in results] == expected
        assert cluster.decode.status()["num_preemptions"] > 0  # the pool really was too small
        cluster.wait_idle()
        assert cluster.decode.status()["requests"]["tracked_by_engine"] == 0
    finally:
        cluster.stop()


def _prompt_tokens_accepted(srv: ServerProcess) -> float:
    match = re.search(r"^engine:prompt_tokens_total(?:\{[^}]*\})? (\S+)$", srv.metrics(), re.MULTILINE)
    return float(match.group(1))


def _stream_text(resp: httpx.Response) -> tuple[list[dict], str]:
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return events, "".join(c.get("text", "") for e in events for c in e.get("choices", []))


def test_a_first_token_that_ends_the_answer_never_reaches_decode(pd, colocated):
    """Issue 13: P samples the first token with the client's parameters; when it ends the answer
    (max_tokens 1, a stop string in it, EOS), P's answer is the answer: D is never called and P
    frees the KV at once when the proxy releases it (not after its 30 s lease)."""
    prompt = "The first token decides"
    greedy = colocated.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].outputs[0]
    stop = greedy.text.strip()[:2] or greedy.text
    d_tokens = _prompt_tokens_accepted(pd.decode)
    for extra in ({"max_tokens": 1}, {"max_tokens": 8, "stop": [stop]}):
        want = colocated.generate(prompt, SamplingParams(temperature=0, **extra), use_tqdm=False)[0].outputs[0]
        for stream in (False, True):
            resp = httpx.post(f"{pd.url}/v1/completions", timeout=30, json={
                "prompt": prompt, "temperature": 0, "stream": stream, **extra,
                **({"stream_options": {"include_usage": True}} if stream else {})})
            assert resp.status_code == 200, resp.text
            if stream:
                events, text = _stream_text(resp)
                reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
                usage = events[-1]["usage"]
            else:
                body = resp.json()
                text, reasons, usage = body["choices"][0]["text"], [body["choices"][0]["finish_reason"]], body["usage"]
                assert "kv_transfer_params" not in body
            assert (text, reasons) == (want.text, [want.finish_reason]), extra
            assert usage["completion_tokens"] == 1
            pd.prefill.wait_idle(timeout=5)  # released by the proxy, not expired: no KV held
    assert _prompt_tokens_accepted(pd.decode) == d_tokens  # D never saw a request


def test_the_first_token_streams_before_decode_is_asked(tiny_llama, colocated):
    """The client has P's first token before any KV moves: with the decode instance down, the
    stream still opens with it, then reports the unreachable decode instance."""
    prefill = ServerProcess(str(tiny_llama), *ENGINE_ARGS, "--role", "prefill", "--kv-port", str(free_port()),
                            "--kv-lease-s", "2")
    proxy = ProxyProcess([prefill.url], [f"http://127.0.0.1:{free_port()}"])
    try:
        prompt = "Streaming starts on the prefill instance"
        want = colocated.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0]
        first_text = colocated.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        for path, body in (("/v1/completions", {"prompt": prompt}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})):
            resp = httpx.post(f"{proxy.url}{path}", timeout=30, json={
                **body, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True})
            events = [json.loads(line[6:]) for line in resp.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert "unreachable" in events[-1]["error"]["message"]
            content = [e for e in events[:-1] if "choices" in e]
            if "messages" in body:
                assert content[0]["choices"][0]["delta"]["role"] == "assistant"
                assert content[1]["choices"][0]["delta"]["content"] and content[1]["choices"][0]["finish_reason"] is None
            else:
                assert content[0]["choices"][0]["text"] == first_text.outputs[0].text and want.text.startswith(
                    content[0]["choices"][0]["text"])
        prefill.wait_idle(timeout=15)  # nobody pulled: the 2 s lease freed the KV
    finally:
        proxy.stop()
        prefill.stop()


def test_a_decode_stream_leaves_out_the_first_tokens_only_when_told(pd, colocated):
    """D continues from P's first token. `engine proxy` has shown it and says so with a header,
    so D's stream goes on after it; any other streaming client of D gets the whole text."""
    body = {"prompt": "Who showed the first token", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = colocated.generate(body["prompt"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    for told in (False, True):
        p = httpx.post(f"{pd.prefill.url}/v1/completions", timeout=30,
                       json={**body, "kv_transfer_params": {"do_remote_decode": True}}).json()
        headers = {"X-Engine-First-Tokens-Shown": "1"} if told else {}
        resp = httpx.post(f"{pd.decode.url}/v1/completions", timeout=30, headers=headers, json={
            **body, "stream": True, "stream_options": {"include_usage": True},
            "kv_transfer_params": p["kv_transfer_params"]})
        events, text = _stream_text(resp)
        first = p["choices"][0]["text"]
        assert (first + text if told else text) == want, told
        assert events[-1]["usage"]["completion_tokens"] == 6


def _chunks(resp: httpx.Response) -> list[list[tuple[str | None, str | None]]]:
    """A stream's chunks as (text, finish_reason) per choice (chat: the delta's content)."""
    assert resp.status_code == 200, resp.text
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    return [[(c["text"] if "text" in c else c["delta"].get("content"), c["finish_reason"]) for c in e["choices"]]
            for e in events if e.get("choices")]


def test_a_p_to_d_stream_has_the_chunks_of_a_single_instance(pd, colocated):
    """Through P and D, a stream is chunked as a single instance streams it: P's first token
    in one chunk (shown by the proxy), then D's, one per token. (D's stream once began with a
    chunk of its own for the first token it was told the client had seen: text "", no
    finish_reason.) D, asked without kv_transfer_params, is the single instance."""
    prompt = "Chunk by chunk through the proxy"
    greedy = colocated.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].text
    stop = greedy[len(greedy) // 2:][:3]  # found on D, maybe across tokens
    messages = [{"role": "user", "content": prompt}]
    cases = [("/v1/completions", {"prompt": prompt, "max_tokens": 10, "ignore_eos": True}),
             ("/v1/completions", {"prompt": _token_prompts()[2], "max_tokens": 6, "ignore_eos": True}),
             ("/v1/completions", {"prompt": prompt, "max_tokens": 1}),  # P's first token is the answer
             ("/v1/completions", {"prompt": prompt, "max_tokens": 10, "ignore_eos": True, "stop": ["zzz", stop]}),
             ("/v1/chat/completions", {"messages": messages, "max_tokens": 6, "ignore_eos": True})]
    for path, body in cases:
        body = {**body, "temperature": 0, "stream": True}
        want = _chunks(httpx.post(f"{pd.decode.url}{path}", timeout=60, json=body))
        got = _chunks(httpx.post(f"{pd.url}{path}", timeout=60, json=body))
        assert want[-1][0][1] in ("length", "stop"), want
        assert got == want, (path, body)


# ---- behind vLLM's routers (issue 28) -------------------------------------------------------

def _vllm_router(pd, path: str, body: dict, stream: bool) -> httpx.Response:
    """What vLLM's toy P/D proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py)
    and llm-d's routing sidecar do with a client's request: P gets it with vLLM's own
    kv_transfer_params (nulls included), stream false, one token and min_tokens null; D gets the
    client's request with the kv_transfer_params of P's answer, streamed as the client asked.
    Both get the router's request id. (Written from their behaviour, not their code.)"""
    request_id = f"router-{random.randrange(2**63)}"
    p_body = {**body, "stream": False, "max_tokens": 1, "min_tokens": None,
              "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                     "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    if "max_completion_tokens" in body:
        p_body["max_completion_tokens"] = 1
    p_body.pop("stream_options", None)
    headers = {"X-Request-Id": request_id, "Authorization": "Bearer x"}
    p_answer = httpx.post(f"{pd.prefill.url}{path}", json=p_body, headers=headers, timeout=60)
    assert p_answer.status_code == 200, p_answer.text
    params = p_answer.json()["kv_transfer_params"]
    for one in params if isinstance(params, list) else [params]:  # answered in vLLM's words too
        assert one["do_remote_prefill"] and one["remote_host"] and one["remote_port"] and one["remote_block_ids"]
    return httpx.post(f"{pd.decode.url}{path}", json={**body, "stream": stream, "kv_transfer_params": params},
                      headers=headers, timeout=60)


def _answer_of(resp: httpx.Response, stream: bool) -> tuple[list[str], int, int]:
    """(text per choice, prompt tokens, cached prompt tokens) of a completion or chat answer."""
    assert resp.status_code == 200, resp.text
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")] if stream else [resp.json()]
    texts: dict[int, str] = {}
    for event in events:
        for c in event["choices"]:
            piece = c.get("text") if "text" in c else (c.get("delta") or c.get("message") or {}).get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    usage = events[-1]["usage"]
    return [texts[i] for i in sorted(texts)], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_routers_drive_prefill_and_decode(pd, colocated, path, stream):
    """With vLLM's P/D protocol (one token from P, the client's request to D with P's params),
    D loads the prompt's KV (>= 90% of each long prompt cached: every case has prompts D never
    saw) and answers exactly as a colocated engine does, for n > 1 and (completions) a prompt
    list too; nothing stays held."""
    rng = random.Random(f"{path}{stream}")
    chat = path.endswith("chat/completions")

    def fresh_prompt() -> str:
        return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "sigma"]) for _ in range(260))

    cases = [{"n": 1}, {"n": 2}] + ([] if chat else [{"prompt": [fresh_prompt(), fresh_prompt()]}])
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for extra in cases:
        words = fresh_prompt()
        body = ({"messages": [{"role": "user", "content": words}]} if chat else {"prompt": words})
        body = {**body, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra,
                **({"stream_options": {"include_usage": True}} if stream else {})}
        if chat:
            body["max_completion_tokens"] = 12
        texts, prompt_tokens, cached = _answer_of(_vllm_router(pd, path, body, stream), stream)
        # The oracle: the colocated engine (n greedy samples are n equal texts).
        if chat:
            want = [colocated.chat(body["messages"], greedy, use_tqdm=False)[0].outputs[0].text] * extra["n"]
        else:
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]] * extra.get("n", 1)
            want = [o.outputs[0].text for o in colocated.generate(prompts, greedy, use_tqdm=False)]
        assert texts == want and all(texts), extra
        assert cached >= 0.9 * prompt_tokens, (cached, prompt_tokens, extra)
        pd.wait_idle()
