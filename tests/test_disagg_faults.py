"""FAULTS.md 16-18 on real P and D processes. The prefill instance runs with
ENGINE_ALLOW_KV_FAULTS=1, so a request can ask it to damage its own transfer through the real
send path: delayed past the deadline, dropped, truncated, duplicated, reordered, with a wrong
dtype or shape in the header, or with an optional CRC32 field that does not match its bytes
(only the injector sets one: real frames carry no checksum, as zmq over TCP and same-host
memory copies protect the bytes; what is tested is the consumer's check of that field). The
decode instance must reject every damaged frame without writing it, then recompute (correct
output, failure counted under its reason) or fail the request. Each damaged request is
identified by its X-Request-Id, so the decode log shows which check rejected it."""
from __future__ import annotations

import json
import random
import re
import time
import uuid

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.conftest import AUTO_DTYPE
from tests.server_utils import ServerProcess, free_port, leave_when, wait_for

ARGS = ("--num-blocks", "128", "--max-model-len", "1024")
PROMPT = [random.Random(5).randrange(3, 49152) for _ in range(70)]  # 5 blocks of 16: one chunk


@pytest.fixture(scope="module")
def prefill(tiny_llama):
    # Configured the vLLM way, with --kv-transfer-config instead of --role/--kv-port.
    config = {"kv_connector": "p2p", "kv_role": "kv_producer", "kv_port": free_port(),
              "kv_connector_extra_config": {"lease_s": 5}}
    srv = ServerProcess(str(tiny_llama), *ARGS, "--kv-transfer-config", json.dumps(config),
                        env={"ENGINE_ALLOW_KV_FAULTS": "1"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def decode(tiny_llama):
    srv = ServerProcess(str(tiny_llama), *ARGS, "--role", "decode", "--kv-load-timeout-s", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def colocated(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), num_blocks=128)


@pytest.fixture(scope="module")
def expected(colocated) -> str:
    return colocated.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text


# What the proxy would send both: P samples the first token, D continues from it.
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _prefill(prefill, fault: str | None, **body) -> dict:
    params = {"do_remote_decode": True, **({"inject_fault": fault} if fault else {})}
    resp = httpx.post(f"{prefill.url}/v1/completions", timeout=30,
                      json={**BODY, **body, "kv_transfer_params": params})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] is None  # handed off, not finished
    return resp.json()["kv_transfer_params"]


def _decode(decode, params: dict, request_id: str | None = None, **body) -> httpx.Response:
    return httpx.post(f"{decode.url}/v1/completions", timeout=60, headers=_request_id(request_id),
                      json={**BODY, **body, "kv_transfer_params": params})


def _request_id(request_id: str | None) -> dict:
    return {"X-Request-Id": request_id} if request_id else {}


def _failures(decode) -> dict:
    return decode.status()["kv_transfer"]["failures"]


def _load_failures(server, request_id: str) -> list[str]:
    """What the consumer logged for each failed KV load of the client's ``request_id`` (the
    engine's id is it with a unique suffix): "<reason>: <the check that failed>"."""
    return re.findall(rf"KV load of {re.escape(request_id)}-[0-9a-f]+\S* from \S+ failed: (.*)",
                      server.log_path.read_text())


def test_clean_transfer_is_used(prefill, decode, expected):
    before = decode.status()["kv_transfer"]["bytes"]
    resp = _decode(decode, _prefill(prefill, None))
    assert resp.json()["choices"][0]["text"] == expected
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
    assert decode.status()["kv_transfer"]["bytes"] > before
    prefill.wait_idle()
    decode.wait_idle()


@pytest.mark.parametrize("fault, failure", [
    pytest.param("truncate", "frame rejected: truncated", id="truncate"),
    pytest.param("reorder", "frame rejected: out of order", id="reorder"),
    # Bits flipped under a CRC32 only the injector sets: the consumer's check of the optional field.
    pytest.param("corrupt", "frame rejected: corrupt: checksum mismatch", id="optional-crc32-mismatch"),
    pytest.param("bad_dtype", "frame rejected: bad header: float16", id="bad-dtype"),
    pytest.param("bad_shape", f"frame rejected: bad header: {AUTO_DTYPE}", id="bad-shape"),  # the dtype is right
    pytest.param("drop", "timeout: no KV before the deadline", id="drop"),
    pytest.param("delay=4", "timeout: no KV before the deadline", id="delay-past-deadline"),
])
def test_damaged_transfer_is_rejected_and_recomputed(prefill, decode, expected, fault, failure):
    """Each fault fails the load with its own reason and check (a rejected frame never passes
    as a timeout, nor a timeout as a rejection), no KV bytes are taken, and the request is
    recomputed to exactly the colocated output."""
    before, bytes_before = _failures(decode), decode.status()["kv_transfer"]["bytes"]
    request_id = f"damaged-{uuid.uuid4().hex[:8]}"
    resp = _decode(decode, _prefill(prefill, fault), request_id)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected
    reason = failure.split(":")[0]
    assert _failures(decode) == {**before, reason: before.get(reason, 0) + 1}
    details = _load_failures(decode, request_id)
    assert len(details) == 1 and details[0].startswith(failure), details
    assert decode.status()["kv_transfer"]["bytes"] == bytes_before
    decode.wait_idle()
    prefill.wait_idle(timeout=15)  # sent, dropped or expired: P frees its blocks either way
    # The next clean transfer still lands correctly (no stale state on either side).
    assert _decode(decode, _prefill(prefill, None)).json()["choices"][0]["text"] == expected
    prefill.wait_idle()
    decode.wait_idle()


def test_duplicate_frames_are_dropped(prefill, decode, expected):
    """A duplicate of a chunk that already completed the transfer is dropped (its transfer id
    is no longer current); the transfer itself is used."""
    before = _failures(decode)
    resp = _decode(decode, _prefill(prefill, "duplicate"))
    assert resp.json()["choices"][0]["text"] == expected
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
    assert _failures(decode) == before
    # The stray copy reaches D while the next transfer is in flight: it must not be taken.
    assert _decode(decode, _prefill(prefill, None)).json()["choices"][0]["text"] == expected
    assert _failures(decode) == before
    prefill.wait_idle()
    decode.wait_idle()


def test_late_frames_after_an_abort_are_never_written(prefill, decode, expected, colocated):
    """The decode client leaves while its KV load is in flight; P holds the frames back past
    D's load deadline, so they can only come late. D cancels the load (counted as cancelled,
    not as a timeout), frees the blocks only then and reuses them; P's frames never land in
    them: the request that reuses them and the next transfer are both exact."""
    params = _prefill(prefill, "delay=4")  # D waits 2 s at most (--kv-load-timeout-s)
    before = _failures(decode)
    leave_when(f"{decode.url}/v1/completions",
                {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "kv_transfer_params": params},
                lambda: decode.status()["requests"]["waiting_for_remote_kv"] == 1)
    decode.wait_idle()
    assert _failures(decode) == {**before, "cancelled": before.get("cancelled", 0) + 1}
    # Reuse D's freed blocks for other work while P's frames are still due.
    other = [random.Random(9).randrange(3, 49152) for _ in range(300)]
    resp = httpx.post(f"{decode.url}/v1/completions", timeout=60, json={
        "prompt": other, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    want = colocated.generate(other, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want
    prefill.wait_idle(timeout=15)
    assert _decode(decode, _prefill(prefill, None)).json()["choices"][0]["text"] == expected
    decode.wait_idle()


def test_fail_policy_returns_an_error(tiny_llama, prefill):
    srv = ServerProcess(str(tiny_llama), *ARGS, "--role", "decode", "--kv-load-timeout-s", "1",
                        "--kv-load-failure-policy", "fail")
    try:
        # A peer's fault: 502, which clients retry (not 500).
        resp = _decode(srv, _prefill(prefill, "drop"))
        assert resp.status_code == 502 and "KV cache load failed" in resp.json()["error"]["message"]
        assert _failures(srv) == {"timeout": 1}
        # n=2: only the leader pulls; under policy fail the whole request fails, never a 200
        # with one choice failed and the other recomputed (issue 27, item 5).
        sampled = dict(n=2, temperature=0.8, seed=3)
        resp = _decode(srv, _prefill(prefill, "drop", **sampled), **sampled)
        assert resp.status_code == 502 and "KV cache load failed" in resp.json()["error"]["message"]
        assert _failures(srv) == {"timeout": 2}
        srv.wait_idle()
        prefill.wait_idle(timeout=15)
    finally:
        srv.stop()


def test_prefill_killed_then_restarted_on_the_same_address(tiny_llama, expected):
    """FAULTS 15 and 18: P dies after answering; D's pull times out and it recomputes, keeps
    serving, and when a new P comes up on the same address D handshakes afresh and pulls again."""
    kv_port = free_port()
    decode = ServerProcess(str(tiny_llama), *ARGS, "--role", "decode", "--kv-load-timeout-s", "2")
    prefill = ServerProcess(str(tiny_llama), *ARGS, "--role", "prefill", "--kv-port", str(kv_port))
    try:
        assert _decode(decode, _prefill(prefill, None)).json()["choices"][0]["text"] == expected
        orphaned = _prefill(prefill, None)
        prefill.kill()
        resp = _decode(decode, orphaned)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected
        assert _failures(decode) == {"timeout": 1}
        decode.wait_idle()
        prefill = ServerProcess(str(tiny_llama), *ARGS, "--role", "prefill", "--kv-port", str(kv_port))
        resp = _decode(decode, _prefill(prefill, None))
        assert resp.json()["choices"][0]["text"] == expected
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
        assert _failures(decode) == {"timeout": 1}
        decode.wait_idle()
        prefill.wait_idle()
    finally:
        prefill.stop()
        decode.stop()


def test_decode_killed_after_prefill(tiny_llama):
    """FAULTS 14: the proxy answers an error within its deadline, and (issue 27, item 6) tells P
    at once that no decode took the hand-off: P frees the KV in about a second, not after its
    30 s lease, streamed or not. A release P did not sign is refused and frees nothing."""
    from tests.disagg_utils import Disagg
    cluster = Disagg(str(tiny_llama), *ARGS)  # the default lease: 30 s
    try:
        cluster.decode.kill()
        resp = httpx.post(f"{cluster.url}/v1/completions", timeout=30,
                          json={"prompt": PROMPT, "max_tokens": 4})
        assert resp.status_code == 502 and resp.json()["error"]["message"]
        cluster.prefill.wait_idle(timeout=5)
        resp = httpx.post(f"{cluster.url}/v1/completions", timeout=30,
                          json={"prompt": PROMPT[:-1], "max_tokens": 4, "stream": True})
        assert resp.status_code == 200 and '"code":502' in resp.text  # the first tokens, then the error
        cluster.prefill.wait_idle(timeout=5)
        # A hand-off P holds, and a release for it with a changed field: refused, still held.
        params = _prefill(cluster.prefill, None)
        forged = {**params, "num_tokens": params["num_tokens"] - 1}
        resp = httpx.post(f"{cluster.prefill.url}/v1/kv/release", json={"kv_transfer_params": forged}, timeout=10)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params.signature"
        time.sleep(0.5)
        assert cluster.prefill.status()["kv_transfer"]["blocks_held"] > 0
        resp = httpx.post(f"{cluster.prefill.url}/v1/kv/release", json={"kv_transfer_params": params}, timeout=10)
        assert resp.status_code == 202
        cluster.prefill.wait_idle(timeout=5)
    finally:
        cluster.proxy.stop()
        cluster.prefill.stop()


def test_same_host_shared_memory(tiny_llama, expected):
    """With ENGINE_KV_SHM=1 the producer's KV lives in /dev/shm (mode 0600) and a same-host decode
    copies the lent blocks straight out of it; the file is removed when the producer stops."""
    import glob
    import os
    prefill = ServerProcess(str(tiny_llama), *ARGS, "--role", "prefill", "--kv-port", str(free_port()),
                            env={"ENGINE_KV_SHM": "1"})
    decode = ServerProcess(str(tiny_llama), *ARGS, "--role", "decode")
    try:
        files = glob.glob(f"/dev/shm/engine-kv-{prefill.engine_pid}-*")
        assert len(files) == 1 and os.stat(files[0]).st_mode & 0o777 == 0o600
        resp = _decode(decode, _prefill(prefill, None))
        assert resp.json()["choices"][0]["text"] == expected
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
        assert prefill.status()["kv_transfer"]["bytes"] > 0 and not _failures(decode)
        prefill.wait_idle()
        decode.wait_idle()
    finally:
        decode.stop()
        prefill.stop()
    assert not glob.glob(files[0])


def test_prefill_killed_decode_loads_from_the_shared_tier(tiny_llama, colocated, redis_server):
    """Issue 13: P and D also share a Redis tier (`--role` with `--kv-store`). P dies right after
    its answer, with its prompt's chunks in Redis: D's pull fails, and D loads the prompt from
    Redis instead of recomputing it (a store hit: every whole block, 7 of 16 tokens)."""
    import redis
    prompt = [random.Random(6).randrange(3, 49152) for _ in range(120)]  # 3 chunks of 32 + a 1-block tail
    body = {**BODY, "prompt": prompt}
    want = colocated.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    store = ("--kv-store", redis_server.url, "--kv-chunk-tokens", "32")
    decode = ServerProcess(str(tiny_llama), *ARGS, *store, "--role", "decode", "--kv-load-timeout-s", "2")
    prefill = ServerProcess(str(tiny_llama), *ARGS, *store, "--role", "prefill", "--kv-port", str(free_port()))
    try:
        resp = httpx.post(f"{prefill.url}/v1/completions", timeout=30,
                          json={**body, "kv_transfer_params": {"do_remote_decode": True}})
        params = resp.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] and resp.json()["choices"][0]["finish_reason"] is None
        r = redis.Redis.from_url(redis_server.url)
        wait_for(lambda: len(r.keys("*")) == 4)  # P's writes land off its step thread
        prefill.kill()
        resp = httpx.post(f"{decode.url}/v1/completions", timeout=60, json={**body, "kv_transfer_params": params})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 112
        status = decode.status()
        assert status["kv_transfer"]["failures"] == {"timeout": 1}
        assert status["kv_store"]["redis"]["hits"] == 4
        decode.wait_idle()
    finally:
        prefill.stop()
        decode.stop()
