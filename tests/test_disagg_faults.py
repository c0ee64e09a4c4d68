"""FAULTS.md 16-18 on real P and D processes. The prefill instance runs with
ENGINE_ALLOW_KV_FAULTS=1, so a request can ask it to damage its own transfer through the real
send path: delayed past the deadline, dropped, truncated, duplicated, reordered, or with a
wrong dtype or shape in the header. The decode instance must reject every damaged frame
without writing it, then recompute (correct output, failure counted) or fail the request."""
from __future__ import annotations

import json
import random

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.server_utils import ServerProcess, free_port

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
def expected(tiny_llama) -> str:
    llm = LLM(str(tiny_llama), num_blocks=128)
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text


def _prefill(prefill, fault: str | None) -> dict:
    params = {"do_remote_decode": True, **({"inject_fault": fault} if fault else {})}
    resp = httpx.post(f"{prefill.url}/v1/completions", timeout=30, json={
        "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": params})
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_transfer_params"]


def _decode(decode, params: dict) -> httpx.Response:
    return httpx.post(f"{decode.url}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "kv_transfer_params": params})


def _failures(decode) -> dict:
    return decode.status()["kv_transfer"]["failures"]


def test_clean_transfer_is_used(prefill, decode, expected):
    before = decode.status()["kv_transfer"]["bytes"]
    resp = _decode(decode, _prefill(prefill, None))
    assert resp.json()["choices"][0]["text"] == expected
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
    assert decode.status()["kv_transfer"]["bytes"] > before
    prefill.wait_idle()
    decode.wait_idle()


@pytest.mark.parametrize("fault, reason", [
    ("truncate", "frame rejected"), ("reorder", "frame rejected"), ("corrupt", "frame rejected"),
    ("bad_dtype", "frame rejected"), ("bad_shape", "frame rejected"),
    ("drop", "timeout"), ("delay=4", "timeout"),
])
def test_damaged_transfer_is_rejected_and_recomputed(prefill, decode, expected, fault, reason):
    before = _failures(decode).get(reason, 0)
    resp = _decode(decode, _prefill(prefill, fault))
    # Recomputed locally: the output is still exactly the colocated one.
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected
    assert _failures(decode).get(reason, 0) == before + 1
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
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
    assert _failures(decode) == before
    # The stray copy reaches D while the next transfer is in flight: it must not be taken.
    assert _decode(decode, _prefill(prefill, None)).json()["choices"][0]["text"] == expected
    assert _failures(decode) == before
    prefill.wait_idle()
    decode.wait_idle()


def test_late_frames_after_an_abort_are_never_written(prefill, decode, expected):
    """The decode client leaves while P is still stalling; P's frames arrive after D freed (and
    possibly reused) the blocks. They must be dropped, and the next request must be correct."""
    params = _prefill(prefill, "delay=1.5")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{decode.url}/v1/completions", timeout=0.5, json={
            "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "kv_transfer_params": params})
    decode.wait_idle()
    # Fill D's pool with other work while the late frames arrive.
    other = [random.Random(9).randrange(3, 49152) for _ in range(300)]
    httpx.post(f"{decode.url}/v1/completions", timeout=60, json={"prompt": other, "max_tokens": 4})
    prefill.wait_idle(timeout=15)
    assert _decode(decode, _prefill(prefill, None)).json()["choices"][0]["text"] == expected
    decode.wait_idle()


def test_fail_policy_returns_an_error(tiny_llama, prefill):
    srv = ServerProcess(str(tiny_llama), *ARGS, "--role", "decode", "--kv-load-timeout-s", "1",
                        "--kv-load-failure-policy", "fail")
    try:
        resp = _decode(srv, _prefill(prefill, "drop"))
        assert resp.status_code == 500 and "KV cache load failed" in resp.json()["error"]["message"]
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
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
        assert _failures(decode) == {"timeout": 1}
        decode.wait_idle()
        prefill.wait_idle()
    finally:
        prefill.stop()
        decode.stop()


def test_decode_killed_after_prefill(tiny_llama):
    """FAULTS 14: the proxy answers an error within its deadline, and P frees the KV it held
    for the dead decode when the lease ends."""
    from tests.disagg_utils import Disagg
    cluster = Disagg(str(tiny_llama), *ARGS, prefill_args=("--kv-lease-s", "2"))
    try:
        cluster.decode.kill()
        resp = httpx.post(f"{cluster.url}/v1/completions", timeout=30,
                          json={"prompt": PROMPT, "max_tokens": 4})
        assert resp.status_code == 502 and resp.json()["error"]["message"]
        cluster.prefill.wait_idle(timeout=10)
    finally:
        cluster.proxy.stop()
        cluster.prefill.stop()


def test_same_host_shared_memory(tiny_llama, expected):
    """By default the producer's KV lives in /dev/shm (mode 0600) and a same-host decode copies
    the lent blocks straight out of it; the file is removed when the producer stops."""
    import glob
    import os
    prefill = ServerProcess(str(tiny_llama), *ARGS, "--role", "prefill", "--kv-port", str(free_port()))
    decode = ServerProcess(str(tiny_llama), *ARGS, "--role", "decode")
    try:
        files = glob.glob(f"/dev/shm/engine-kv-{prefill.engine_pid}-*")
        assert len(files) == 1 and os.stat(files[0]).st_mode & 0o777 == 0o600
        resp = _decode(decode, _prefill(prefill, None))
        assert resp.json()["choices"][0]["text"] == expected
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
        assert prefill.status()["kv_transfer"]["bytes"] > 0 and not _failures(decode)
        prefill.wait_idle()
        decode.wait_idle()
    finally:
        decode.stop()
        prefill.stop()
    assert not glob.glob(files[0])
