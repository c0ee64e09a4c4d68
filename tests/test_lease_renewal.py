"""Issue 27 item 6: a decode instance's queueing never turns a hand-off into a recompute, and a
hand-off's held KV counts in its prefill instance's load. While a request waits in D's queue, D
renews P's lease on its KV (kv_transfer/p2p.py, RenewSpec): here P holds KV for 1 s leases and D
queues the request for several of them behind long requests, yet D pulls the whole prompt and
answers as a colocated engine does. Meanwhile the proxy counts that hand-off against P (P's own
count of held hand-offs, which the proxy polls; its --max-prefill-queue is 1), so the next long
prompt is prefilled on D instead."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.kv_transfer.p2p import MAX_LEASES_HELD
from tests.disagg_utils import Disagg
from tests.server_utils import wait_for

ENGINE_ARGS = ("--num-blocks", "256", "--max-model-len", "1024", "--served-model-name", "tiny")
LEASE_S = 1.0
BLOCKERS = 3


@pytest.fixture(scope="module")
def pd(tiny_llama):
    cluster = Disagg(str(tiny_llama), *ENGINE_ARGS, prefill_args=("--kv-lease-s", str(LEASE_S)),
                     decode_args=("--max-num-seqs", "1"),
                     proxy_args=("--max-local-prefill-tokens", "16", "--max-prefill-queue", "1"))
    yield cluster
    cluster.stop()


def _decisions(url: str) -> dict[tuple[str, str], int]:
    status = httpx.get(f"{url}/status", timeout=5).json()
    return {(d["path"], d["reason"]): d["count"] for d in status["disagg"]["decisions"]}


def test_a_hand_off_queued_on_the_decode_for_many_leases_is_still_pulled(pd, tiny_llama):
    prompt, other = ([(k * i) % 40000 + 3 for i in range(200)] for k in (7, 11))
    want, want_other = (o.outputs[0].text for o in LLM(str(tiny_llama), num_blocks=256, max_model_len=1024).generate(
        [prompt, other], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False))
    # D runs one request at a time: long ones ahead keep the hand-off queued.
    blocker_done: list[float] = []

    def blocker() -> None:
        httpx.post(f"{pd.decode.url}/v1/completions", timeout=120, json={
            "prompt": [5] * 8, "max_tokens": 1000, "temperature": 0, "ignore_eos": True})
        blocker_done.append(time.monotonic())

    threads = [threading.Thread(target=blocker) for _ in range(BLOCKERS)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while pd.decode.status()["requests"]["waiting"] < BLOCKERS - 1:
        assert time.monotonic() < deadline, "the long requests never queued"
        time.sleep(0.02)
    sent = time.monotonic()
    before = _decisions(pd.url)
    answers: dict[str, httpx.Response] = {}

    def complete(name: str, tokens: list[int]) -> None:
        answers[name] = httpx.post(f"{pd.url}/v1/completions", timeout=120, json={
            "prompt": tokens, "max_tokens": 8, "temperature": 0, "ignore_eos": True})

    first = threading.Thread(target=complete, args=("first", prompt))
    first.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{pd.url}/status", timeout=5).json()["prefill"][0] != {
            "url": pd.prefill.url, "in_flight": 0, "held": 1}:
        assert time.monotonic() < deadline, "the hand-off was not counted as held on P"
        time.sleep(0.02)
    # P's only slot is taken by KV waiting for D: the next long prompt is prefilled on D.
    complete("other", other)
    first.join()
    for thread in threads:
        thread.join()
    resp = answers["first"]
    assert resp.status_code == 200, resp.text
    assert answers["other"].json()["choices"][0]["text"] == want_other
    after = _decisions(pd.url)
    assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {
        ("remote", "long_prompt"): 1, ("local", "prefill_busy"): 1}
    wait_for(lambda: httpx.get(f"{pd.url}/status", timeout=5).json()["prefill"][0]["held"] == 0, timeout=10)
    queued_s = max(blocker_done) - sent
    assert queued_s > 3 * LEASE_S, f"queued only {queued_s:.1f} s: lengthen the long requests"
    # (Renewals hold an offer MAX_LEASES_HELD leases at most: a queue longer than that recomputes.)
    assert queued_s < MAX_LEASES_HELD * LEASE_S - 1, f"queued {queued_s:.1f} s: shorten the long requests"
    body = resp.json()
    assert body["choices"][0]["text"] == want
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)  # pulled, not recomputed
    assert not pd.decode.status()["kv_transfer"]["failures"]
    pd.wait_idle()
