"""Conditional disaggregation: the proxy sends a prompt through the prefill instance only when
its uncached part is long and the prefill instance is not busy; otherwise the decode instance
prefills it itself. The decision follows the policy, is counted, and never changes an output."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.errors import PrefillElsewhere
from tests.disagg_utils import Disagg, ProxyProcess
from tests.server_utils import REPO, free_port, wait_for

ENGINE_ARGS = ("--num-blocks", "256", "--max-model-len", "1024", "--served-model-name", "tiny")
LIMIT = 48  # uncached prompt tokens a decode instance prefills itself
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    pd = Disagg(str(tiny_llama), *ENGINE_ARGS,
                proxy_args=("--max-local-prefill-tokens", str(LIMIT), "--max-prefill-queue", "1"))
    yield pd
    pd.stop()


@pytest.fixture(autouse=True)
def _idle_after(request):
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").wait_idle()


def _decisions(url: str) -> dict[tuple[str, str], int]:
    status = httpx.get(f"{url}/status", timeout=5).json()
    return {(d["path"], d["reason"]): d["count"] for d in status["disagg"]["decisions"]}


def _settled(url: str) -> None:
    """Through a proxy: until its view of the prefill instance shows no hand-off held there (it
    reads the instance's count every 0.5 s), so a decision is not taken on the previous one."""
    def held() -> int:
        status = httpx.get(f"{url}/status", timeout=5).json()
        return sum(p["held"] for p in status["prefill"]) if status.get("proxy") else 0
    wait_for(lambda: held() == 0, timeout=10)


def _complete(url: str, prompt, stream: bool = False, **extra) -> str:
    _settled(url)
    body = {"prompt": prompt, **GREEDY, **extra}
    if not stream:
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(c["text"] for c in chunk["choices"])
    return text


def _changed(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_decode_declines_long_uncached_prompts_and_takes_cached_ones(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=64, max_model_len=512)
    engine, params = llm.engine, SamplingParams(max_tokens=1)
    limit = {"max_local_prefill_tokens": LIMIT}
    long = _prompt(100, 1)
    with pytest.raises(PrefillElsewhere) as exc:
        engine.add_request("long", long, params, kv_transfer_params=limit)
    assert exc.value.num_uncached_tokens == 100
    assert not engine.has_unfinished_requests()  # nothing was queued
    engine.add_request("short", long[:LIMIT], params, kv_transfer_params=limit)
    while engine.has_unfinished_requests():
        engine.step()
    llm.generate([long], SamplingParams(max_tokens=1), use_tqdm=False)  # now its blocks are cached
    engine.add_request("cached", long + [7, 8], params, kv_transfer_params=limit)  # 6 tokens past 6 full blocks
    while engine.has_unfinished_requests():
        engine.step()


def test_short_prompts_stay_local_long_ones_go_remote_same_output(cluster):
    short, long = _prompt(20, 2), _prompt(200, 3)
    reference = {n: _complete(cluster.prefill.url, p) for n, p in (("short", short), ("long", long))}
    before = _decisions(cluster.url)
    assert _complete(cluster.url, short) == reference["short"]
    after_short = _decisions(cluster.url)
    assert _changed(before, after_short) == {("local", "short_prompt"): 1}
    assert _complete(cluster.url, long, stream=True) == reference["long"]
    after_long = _decisions(cluster.url)
    assert _changed(after_short, after_long) == {("remote", "long_prompt"): 1}
    # The decode instance pulled the long prompt's KV: now it is cached there, so the same
    # prompt plus a turn stays local, with the output a fresh engine gives.
    follow = long + _prompt(10, 4)
    assert _complete(cluster.url, follow) == _complete(cluster.prefill.url, follow)
    assert _changed(after_long, _decisions(cluster.url)) == {("local", "short_prompt"): 1}
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=5).text
    assert 'engine:disagg_decisions_total{path="remote",reason="long_prompt"} 1.0' in metrics
    assert 'engine:disagg_decisions_total{path="local",reason="short_prompt"} 2.0' in metrics
    status = subprocess.run([sys.executable, "-m", "entrypoints.cli", "status", cluster.url], cwd=REPO,
                            capture_output=True, text=True, timeout=30)
    assert "remote/long_prompt 1" in status.stdout and "local/short_prompt 2" in status.stdout, status.stdout


def test_chat_and_streams_agree_across_paths(cluster):
    long_text = " ".join(f"word{i}" for i in range(120))
    for content in ("Hi there", long_text):  # local, then remote
        body = {"messages": [{"role": "user", "content": content}], **GREEDY}
        whole = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=60).json()
        ref = httpx.post(f"{cluster.prefill.url}/v1/chat/completions", json=body, timeout=60).json()
        assert whole["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]


STRUCTURED = [  # bounded, so even a random model finishes them within max_tokens
    {"guided_regex": r"\((ab|cd|ef)(, (ab|cd|ef)){2,3}\)"},
    {"structured_outputs": {"disable_any_whitespace": True, "json": {
        "type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99},
                                         "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 3}},
        "required": ["ok", "n", "tags"]}}},
]


def test_structured_output_is_the_same_on_both_paths(cluster):
    """The prefill instance samples the first token under the grammar; the decode instance
    continues the same grammar state from it."""
    for i, extra in enumerate(STRUCTURED):
        for length, stream in ((10, False), (10, True), (100, False), (100, True)):  # local, then remote
            prompt = _prompt(length, 20 + 4 * i + stream + (length > LIMIT) * 2)
            before = _decisions(cluster.url)
            body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, **extra}
            expected = httpx.post(f"{cluster.prefill.url}/v1/completions", json=body, timeout=60).json()
            expected_text = expected["choices"][0]["text"]
            assert expected["choices"][0]["finish_reason"] == "stop", expected
            assert _complete(cluster.url, prompt, stream, max_tokens=40, ignore_eos=False, **extra) == expected_text
            decision = ("remote", "long_prompt") if length > LIMIT else ("local", "short_prompt")
            assert _changed(before, _decisions(cluster.url)) == {decision: 1}
            if "guided_regex" in extra:
                assert re.fullmatch(extra["guided_regex"], expected_text), expected_text
            else:
                assert set(json.loads(expected_text)) == {"ok", "n", "tags"}


def test_a_busy_prefill_instance_means_local_prefill(cluster):
    """With the prefill instance stopped mid-request, its queue is full (max-prefill-queue 1):
    the next long prompt is prefilled on the decode instance."""
    held, long = _prompt(200, 5), _prompt(200, 6)
    expected = _complete(cluster.prefill.url, long)
    before = _decisions(cluster.url)
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(_complete(cluster.url, held)))
    os.kill(cluster.prefill.proc.pid, signal.SIGSTOP)
    try:
        waiting.start()
        for _ in range(100):
            if httpx.get(f"{cluster.url}/status", timeout=5).json()["prefill"][0]["in_flight"]:
                break
            time.sleep(0.05)
        assert _complete(cluster.url, long) == expected
    finally:
        os.kill(cluster.prefill.proc.pid, signal.SIGCONT)
        waiting.join(60)
    assert answers == [_complete(cluster.prefill.url, held)]
    changed = _changed(before, _decisions(cluster.url))
    assert changed == {("local", "prefill_busy"): 1, ("remote", "long_prompt"): 1}, changed


def test_unreachable_prefill_instance_means_local_prefill(cluster):
    proxy = ProxyProcess([f"http://127.0.0.1:{free_port()}"], [cluster.decode.url],
                         "--max-local-prefill-tokens", str(LIMIT))
    try:
        long = _prompt(150, 7)
        assert _complete(proxy.url, long) == _complete(cluster.prefill.url, long)
        assert _decisions(proxy.url)[("local", "prefill_unreachable")] == 1
    finally:
        proxy.stop()


def test_clients_cannot_set_kv_transfer_params_through_the_proxy(cluster):
    """A client's kv_transfer_params are the proxy's to set: a client's max_local_prefill_tokens
    does not change the decision (nor anything else)."""
    before = _decisions(cluster.url)
    short = _prompt(10, 8)
    text = _complete(cluster.url, short, kv_transfer_params={"max_local_prefill_tokens": 0})
    assert text == _complete(cluster.prefill.url, short)
    assert _changed(before, _decisions(cluster.url)) == {("local", "short_prompt"): 1}


def test_in_flight_counts_return_to_zero_however_a_request_ends(cluster):
    """Leaving mid-stream (on the local and the remote path), a refused request, a declined one:
    the proxy's count of open requests per instance (what routing weighs) goes back to 0."""
    short, long = _prompt(20, 9), _prompt(200, 10)
    for prompt in (short, long):
        with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=60,
                          json={"prompt": prompt, "stream": True, "max_tokens": 200, "ignore_eos": True}) as resp:
            next(resp.iter_lines())  # one event, then hang up
    bad = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": short, "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400

    def open_counts():
        status = httpx.get(f"{cluster.url}/status", timeout=5).json()
        return [u["in_flight"] for u in status["prefill"] + status["decode"]]
    wait_for(lambda: open_counts() == [0, 0], timeout=30, state=open_counts)
