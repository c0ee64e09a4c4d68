"""``cache_salt`` (vLLM's request field for tenant isolation): requests with different salts, or a
salt and none, never share KV: not in the prefix cache, not in a KV tier, not in the hashes the
KV events announce and a router matches. The same salt shares as an unsalted request does, and a
salt never changes an answer. Through the server, the offline API and the proxy's router."""
from __future__ import annotations

import random

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.block_pool import BlockHasher, salted_root
from engine.request import Request
from entrypoints.kv_router import KVRouter
from tests.conftest import assert_engine_idle
from tests.disagg_utils import Disagg
from tests.server_utils import ServerProcess

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _hashes(tokens: list[int], salt: str | None, root: bytes = b"r" * 32) -> list[bytes]:
    return Request("x", tokens, SamplingParams(), frozenset(), 1, BlockHasher(16, root), cache_salt=salt).block_hashes


def test_salted_hashes_share_nothing_across_salts():
    tokens = _prompt(0, 80)
    plain, a, a_again, b = _hashes(tokens, None), _hashes(tokens, "a"), _hashes(tokens, "a"), _hashes(tokens, "b")
    assert len(plain) == 5 and a == a_again
    assert not (set(plain) & set(a)) and not (set(a) & set(b)) and not (set(plain) & set(b))
    assert salted_root(b"r" * 32, None) == b"r" * 32  # unsalted requests keep the instance's hashes
    assert _hashes(tokens, "a", root=b"s" * 32) != a  # and a salt never crosses models


def test_the_offline_api_shares_kv_only_within_a_salt(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=64)
    prompt = _prompt(1)

    def run(salt: str | None):
        form = {"prompt_token_ids": prompt, **({"cache_salt": salt} if salt is not None else {})}
        out = llm.generate([form], GREEDY, use_tqdm=False)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    first, cached = run("tenant-a")
    assert cached == 0
    assert run("tenant-a") == (first, 96)  # the same salt: the prefix cache as usual
    assert run("tenant-b") == (first, 0)   # another tenant learns nothing from timing
    assert run(None) == (first, 0)
    assert run(None) == (first, 96)
    assert run("tenant-b") == (first, 96)
    for bad in ("", 5, "x" * 1025, "\ud800"):
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate([{"prompt": "Hi", "cache_salt": bad}], GREEDY, use_tqdm=False)
    assert run(None) == (first, 96)  # a null salt is no salt
    assert llm.generate([{"prompt_token_ids": prompt, "cache_salt": None}], GREEDY,
                        use_tqdm=False)[0].num_cached_tokens == 96
    assert_engine_idle(llm)


def test_a_kv_tier_keeps_salts_apart(tiny_llama):
    """The device pool (20 blocks) cannot keep the prefix: only the CPU tier could hand it over,
    and it does for the same salt only."""
    llm = LLM(str(tiny_llama), num_blocks=20, kv_store="cpu:64MiB", kv_chunk_tokens=32)
    prompt = _prompt(2, 200)
    salted = [{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}]
    first = llm.generate(salted, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for seed in range(10, 13):  # push the prefix out of the device cache
        llm.generate([_prompt(seed, 250)], GREEDY, use_tqdm=False)
    other = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)[0]
    assert other.outputs[0].token_ids == first and other.num_cached_tokens == 0
    for seed in range(20, 23):
        llm.generate([_prompt(seed, 250)], GREEDY, use_tqdm=False)
    again = llm.generate(salted, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first and again.num_cached_tokens == 192
    assert llm.engine.kv_connector_stats.stores["cpu"]["hits"] == 6
    assert_engine_idle(llm)
    llm.shutdown()


def test_the_router_hashes_a_prompt_as_its_salt_does():
    router = KVRouter()
    key = ("engine", 16, (b"r" * 32).hex())
    router.hashers[key] = BlockHasher(16, b"r" * 32)
    tokens = _prompt(3, 64)
    assert router.prompt_blocks(tokens, "tenant-a").by_hasher[key] == _hashes(tokens, "tenant-a")
    assert router.prompt_blocks(tokens).by_hasher[key] == _hashes(tokens, None)


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(str(tiny_llama), "--num-blocks", "64")
    yield srv
    assert srv.stop() in (0, -15)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_server_shares_kv_only_within_a_salt(server, path):
    text = " ".join(str(i) for i in range(60)) + f" {path}"
    body = ({"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]})

    def cached(salt):
        resp = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2, "temperature": 0,
                                                       **({"cache_salt": salt} if salt is not None else {})},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    for bad in ("", 7, "x" * 1025):
        resp = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2, "cache_salt": bad}, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text
    server.wait_idle()


def _prefix_hits(server: ServerProcess) -> float:
    line = next(x for x in server.metrics().splitlines() if x.startswith("engine:prefix_cache_hits_total"))
    return float(line.split()[-1])


def test_prefill_and_decode_keep_salts_apart(tiny_llama):
    """Through engine proxy: the prefill instance's prefix cache (where a repeated prompt would
    skip its compute) serves a prompt again only under its salt, with n > 1; the answers do not
    depend on the salt."""
    cluster = Disagg(str(tiny_llama), "--num-blocks", "64")
    try:
        body = {"prompt": _prompt(4, 100), "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2}

        def send(salt: str) -> tuple[list[str], float]:
            before = _prefix_hits(cluster.prefill)
            resp = httpx.post(f"{cluster.url}/v1/completions", json={**body, "cache_salt": salt}, timeout=60)
            assert resp.status_code == 200, resp.text
            cluster.wait_idle()
            return [c["text"] for c in resp.json()["choices"]], _prefix_hits(cluster.prefill) - before

        # The n samples share their prompt: the second hits what the first computed, in any tenant.
        first, siblings = send("tenant-a")
        assert send("tenant-b") == (first, siblings)
        texts, hits = send("tenant-a")
        assert texts == first and hits >= siblings + 96
    finally:
        cluster.stop()
