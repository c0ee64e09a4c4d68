"""KV cache tiers: payload format, the CPU / disk / Redis stores (real files, a real
redis-server), and the engine loading prefixes from them, in-process and across processes.
FAULTS.md 21-23 and 31."""
from __future__ import annotations

import json
import logging
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_transfer import serde
from engine.kv_transfer.params import token_digest
from engine.kv_transfer.stores import ChunkFormat, parse_store_spec
from engine.kv_transfer.stores.cpu import CPUStore
from engine.kv_transfer.stores.disk import DiskStore
from engine.kv_transfer.stores.redis import RETRY_S, RedisStore
from tests.conftest import AUTO_DTYPE_BYTES, assert_engine_idle
from tests.server_utils import wait_for

FMT = ChunkFormat("model-a:float32:bs4", torch.float32, (2, 2, 4, 4, 2, 8))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _chunk(seed: int) -> torch.Tensor:
    return torch.randn(FMT.shape, generator=torch.Generator().manual_seed(seed))


# ---- payloads ------------------------------------------------------------------------------
def test_payload_roundtrip_and_rejections():
    kv = _chunk(0)
    data = b"".join(serde.encode(kv, FMT.fingerprint, 16, "k0"))
    assert torch.equal(serde.decode(data, FMT.fingerprint, FMT.dtype, list(FMT.shape), "k0"), kv)
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    for bad, why in [(data[:-10], "truncated"), (bytes(flipped), "checksum"), (b"junk" * 20, "magic")]:
        with pytest.raises(serde.CorruptPayload, match=why):
            serde.decode(bad, FMT.fingerprint, FMT.dtype, list(FMT.shape), "k0")
    with pytest.raises(serde.CorruptPayload, match="another model"):
        serde.decode(data, "model-b:float32:bs4", FMT.dtype, list(FMT.shape), "k0")


def test_store_spec_parsing(tmp_path):
    stores = parse_store_spec(f"cpu:1MiB,disk:{tmp_path}/kv:2MiB", FMT)
    assert [s.name for s in stores] == ["cpu", "disk"] and stores[1].capacity == 2 * 2**20
    for bad in ["gpu:1GiB", "cpu:lots", "disk:1GiB", "cpu:1MiB,cpu:2MiB", ""]:
        with pytest.raises(ValueError):
            parse_store_spec(bad, FMT)


# ---- CPU -----------------------------------------------------------------------------------
def test_cpu_store_lru_cap_and_pins():
    store = CPUStore(3 * FMT.nbytes, FMT)
    for i in range(3):
        store.put(f"k{i}", _chunk(i))
    store.get("k0")  # k0 is now the most recent: k1 goes first
    store.pin(["k2"])
    store.put("k3", _chunk(3))
    store.put("k4", _chunk(4))  # k1, then (k2 pinned) k0 are evicted
    assert store.contains(["k0", "k1", "k2", "k3", "k4"]) == [False, False, True, True, True]
    assert store.used_bytes() == 3 * FMT.nbytes
    store.unpin(["k2"])
    store.put("k5", _chunk(5))
    assert store.contains(["k2"]) == [False]


# ---- disk ----------------------------------------------------------------------------------
def test_disk_store_survives_restart_and_evicts(tmp_path):
    size = len(b"".join(serde.encode(_chunk(0), FMT.fingerprint, 16, "k0")))
    store = DiskStore(str(tmp_path), 3 * size, FMT)
    for i in range(4):
        store.put(f"k{i}", _chunk(i))
        time.sleep(0.01)  # distinct mtimes: the restart rebuilds the LRU order from them
    assert store.contains(["k0", "k1", "k2", "k3"]) == [False, True, True, True]
    assert len(os.listdir(tmp_path)) == 3  # k0's file is gone, no temp files are left
    reopened = DiskStore(str(tmp_path), 3 * size, FMT)
    assert reopened.contains(["k1", "k2", "k3"]) == [True] * 3 and reopened.used_bytes() == 3 * size
    assert torch.equal(reopened.get("k3"), _chunk(3))


def test_disk_store_corrupt_foreign_and_deleted_entries_are_misses(tmp_path):
    store = DiskStore(str(tmp_path), 2**30, FMT)
    for i in range(3):
        store.put(f"k{i}", _chunk(i))
    path = Path(store.path("k0"))
    path.write_bytes(path.read_bytes()[:-7])  # truncated
    other = DiskStore(str(tmp_path / "other"), 2**30, ChunkFormat("model-b", torch.float32, FMT.shape))
    other.put("k1", _chunk(1))
    os.replace(other.path("k1"), store.path("k1"))  # another model's entry moved under our file name
    os.unlink(store.path("k2"))  # deleted behind the store's back (e.g. during a read)
    for key in ("k0", "k1", "k2"):
        assert store.get(key) is None
    assert not path.exists() and not os.path.exists(store.path("k1"))  # bad entries are removed
    assert store.contains(["k0", "k1", "k2"]) == [False] * 3 and store.used_bytes() == 0


def test_disk_full_skips_the_write(tmp_path, caplog):
    """FAULTS 23: the kernel refuses the write (a file-size limit stands in for a full disk)."""
    store = DiskStore(str(tmp_path), 2**30, FMT)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FMT.nbytes // 2, old_limit[1]))
    try:
        with caplog.at_level(logging.WARNING):
            store.put("k0", _chunk(0))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert "write skipped" in caplog.text
    assert store.contains(["k0"]) == [False] and os.listdir(tmp_path) == []  # nothing indexed, no debris
    store.put("k0", _chunk(0))  # room again: the next write lands
    assert torch.equal(store.get("k0"), _chunk(0))


# Another --kv-chunk-tokens: 8 blocks a chunk instead of 4 (all else equal). A chain key names
# a chunk by its last block, so both formats write chunks under the same keys.
FMT_WIDE = ChunkFormat(FMT.fingerprint, FMT.dtype, (2, 2, 8, 4, 2, 8))


def _wide_chunk(seed: int) -> torch.Tensor:
    return torch.randn(FMT_WIDE.shape, generator=torch.Generator().manual_seed(seed))


def _two_formats_share_keys(narrow, wide) -> None:
    """Both write the same keys and read back their own, in any order; nothing is refused."""
    for i in range(3):
        narrow.put(f"k{i}", _chunk(i))
        wide.put(f"k{i}", _wide_chunk(i))
    for i in range(3):
        assert torch.equal(wide.get(f"k{i}"), _wide_chunk(i))
        assert torch.equal(narrow.get(f"k{i}"), _chunk(i))
    assert narrow.contains(["k0", "k1", "k2"]) == wide.contains(["k0", "k1", "k2"]) == [True] * 3
    assert narrow.stats.rejected == wide.stats.rejected == {}
    assert narrow.fmt.namespace != wide.fmt.namespace
    for dtype in (torch.bfloat16, torch.float16):  # the dtype names a format too
        assert ChunkFormat(FMT.fingerprint, dtype, FMT.shape).namespace != narrow.fmt.namespace


def test_disk_stores_of_two_chunk_sizes_share_a_directory(tmp_path):
    """Two instances with different --kv-chunk-tokens on one disk directory: each keeps its own
    entries under the same keys, neither deletes nor evicts the other's, and a restart indexes
    (and caps) only its own format's files."""
    size = len(b"".join(serde.encode(_chunk(0), FMT.fingerprint, 16, "k0")))
    narrow, wide = DiskStore(str(tmp_path), 3 * size, FMT), DiskStore(str(tmp_path), 2**30, FMT_WIDE)
    _two_formats_share_keys(narrow, wide)
    assert len(os.listdir(tmp_path)) == 6
    reopened = DiskStore(str(tmp_path), 3 * size, FMT)
    assert reopened.used_bytes() == 3 * size == narrow.used_bytes()
    reopened.put("k3", _chunk(3))  # over its cap: its own oldest goes, never the other's
    assert reopened.contains(["k0", "k3"]) == [False, True]
    assert wide.contains(["k0", "k1", "k2"]) == [True] * 3 and torch.equal(wide.get("k0"), _wide_chunk(0))


# ---- Redis ---------------------------------------------------------------------------------
def test_redis_stores_of_two_chunk_sizes_share_a_server(redis_server):
    narrow, wide = RedisStore(redis_server.url, FMT), RedisStore(redis_server.url, FMT_WIDE)
    _two_formats_share_keys(narrow, wide)
    narrow.close()
    wide.close()


def test_redis_store_roundtrip_ttl_and_corruption(redis_server):
    import redis
    store = RedisStore(redis_server.url, FMT, ttl_s=100)
    store.put("k0", _chunk(0))
    assert store.contains(["k0", "nope"]) == [True, False]
    assert torch.equal(store.get("k0"), _chunk(0))
    client = redis.Redis.from_url(redis_server.url)
    key = store.prefix + "k0"
    assert 0 < client.ttl(key) <= 100
    client.setrange(key, 200, b"garbage")  # corrupted in place
    assert store.get("k0") is None and not client.exists(key)  # a miss, and the entry is gone
    other = RedisStore(redis_server.url, ChunkFormat("model-b", torch.float32, FMT.shape))
    other.put("k0", _chunk(0))
    assert store.contains(["k0"]) == [False]  # two models never share an entry


def _wait_available(store, timeout: float = 3 * RETRY_S + 2) -> None:
    deadline = time.monotonic() + timeout
    while not store.available:
        assert time.monotonic() < deadline, "the Redis tier never came back"
        time.sleep(0.05)


def test_redis_down_at_start_then_back(redis_server, caplog):
    """FAULTS 21: the tier is off with one warning, never blocks beyond its timeout, and comes
    back by itself."""
    redis_server.kill()
    with caplog.at_level(logging.WARNING):
        start = time.monotonic()
        store = RedisStore(redis_server.url, FMT)
        store.put("k0", _chunk(0))
        assert store.get("k0") is None and store.contains(["k0"]) == [False]
        assert time.monotonic() - start < 3
    assert caplog.text.count("unavailable") == 1
    redis_server.start()
    _wait_available(store)
    store.put("k0", _chunk(0))
    assert torch.equal(store.get("k0"), _chunk(0))


# ---- the engine ----------------------------------------------------------------------------
def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=128)
    return lambda prompt: llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_cpu_tier_serves_prefixes_the_device_cache_evicted(tiny_llama, reference):
    """The device pool (20 blocks) cannot keep the prefix; the CPU tier must supply it."""
    llm = LLM(str(tiny_llama), num_blocks=20, kv_store="cpu:64MiB", kv_chunk_tokens=32)
    prompt = _prompt(1, 200)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference(prompt)
    for seed in range(10, 13):  # push the prefix out of the device cache
        llm.generate([_prompt(seed, 250)], GREEDY, use_tqdm=False)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(prompt)
    assert out.num_cached_tokens == 192  # 6 full chunks; the 7th would include the last prompt token
    stats = llm.engine.kv_connector_stats.stores["cpu"]
    chunk_bytes = 2 * 2 * 2 * 16 * 2 * 16 * AUTO_DTYPE_BYTES  # [layers, k/v, 2 blocks, 16 tokens, 2 kv heads, 16 dims]
    assert stats["hits"] == 6 and stats["bytes_loaded"] == 6 * chunk_bytes
    # A prompt that shares only part of the prefix loads just the shared chunks.
    branch = prompt[:100] + _prompt(2, 60)
    out = llm.generate([branch], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(branch) and out.num_cached_tokens == 96
    assert_engine_idle(llm)
    llm.shutdown()


def test_preempted_requests_and_batches_stay_correct(tiny_llama, reference):
    """Loads, saves and preemption together in a pool too small for the running set."""
    llm = LLM(str(tiny_llama), num_blocks=24, kv_store="cpu:64MiB", kv_chunk_tokens=16)
    prompts = [_prompt(20 + i % 3, 90 + 10 * (i % 3)) for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    solo = LLM(str(tiny_llama), num_blocks=128)
    for prompt, out in zip(prompts, outs):
        expected = solo.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].token_ids
        assert out.outputs[0].token_ids == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert_engine_idle(llm)
    llm.shutdown()


CHILD = """
import json, sys
from engine import LLM, SamplingParams
model, spec, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model, num_blocks=64, kv_store=spec, kv_chunk_tokens=32)
if isinstance(prompt, str):
    prompt = llm.get_tokenizer()(prompt)["input_ids"]
out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
stats = llm.engine.kv_connector_stats.stores
llm.shutdown()  # flushes the writes to disk and Redis
print(json.dumps({"tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens,
                  "hits": {t: s["hits"] for t, s in stats.items()}}))
"""


def _fresh_process(model, spec: str, prompt: list[int] | str) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, str(model), spec, json.dumps(prompt)],
                            capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_new_process_finds_the_prefix(tiny_llama, reference, tmp_path, tier, request):
    spec = f"cpu:64MiB,disk:{tmp_path}/kv:1GiB" if tier == "disk" else \
        f"cpu:64MiB,{request.getfixturevalue('redis_server').url}"
    prompt = _prompt(3, 150)
    first = _fresh_process(tiny_llama, spec, prompt)
    second = _fresh_process(tiny_llama, spec, prompt)
    assert first["tokens"] == second["tokens"] == reference(prompt)
    # Four 32-token chunks and the trailing chunk of one block: every whole block before the
    # last token, as a device prefix hit would be.
    assert first["cached"] == 0 and second["cached"] == 144
    assert second["hits"][tier] == 5 and second["hits"]["cpu"] == 0


def test_redis_killed_mid_run_and_back(tiny_llama, reference, redis_server):
    """FAULTS 21 in the engine: misses recompute, outputs never change, the tier returns."""
    llm = LLM(str(tiny_llama), num_blocks=64, kv_store=redis_server.url, kv_chunk_tokens=32)
    connector = llm.engine.runner.connector
    a, b, c = _prompt(4, 100), _prompt(5, 100), _prompt(6, 100)
    assert llm.generate([a], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference(a)
    assert connector.wait_for_saves()
    redis_server.kill()
    start = time.monotonic()
    out = llm.generate([b], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(b) and time.monotonic() - start < 10
    redis_server.start()  # an empty server: a's chunks are gone, nothing stale can be served
    _wait_available(connector.tiers.stores[0])
    assert llm.generate([c], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference(c)
    assert connector.wait_for_saves()
    # The tier is back without a restart: another instance now loads c's prefix from Redis.
    other = LLM(str(tiny_llama), num_blocks=64, kv_store=redis_server.url, kv_chunk_tokens=32)
    out = other.generate([c], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(c) and out.num_cached_tokens == 96
    assert other.engine.kv_connector_stats.stores["redis"]["hits"] == 3
    for engine in (llm, other):
        assert_engine_idle(engine)
        engine.shutdown()


def test_server_reports_tier_hits(tiny_llama, tmp_path):
    """`engine serve --kv-store`: usage.prompt_tokens_details.cached_tokens counts tier hits, and
    /metrics and /status show each tier. Two servers share the disk tier, one after the other."""
    import openai
    from tests.server_utils import ServerProcess
    args = ("--num-blocks", "64", "--max-model-len", "1024", "--kv-chunk-tokens", "32", "--served-model-name", "tiny",
            "--kv-store", f"cpu:64MiB,disk:{tmp_path}/kv:1GiB")
    prompt = _prompt(7, 150)
    results = []
    for _ in range(2):
        server = ServerProcess(str(tiny_llama), *args)
        try:
            assert set(server.status()["kv_store"]) == {"cpu", "disk"}  # from the first status read
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
            resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
            results.append((resp.choices[0].text, resp.usage.prompt_tokens_details.cached_tokens))
            server.wait_idle()
            metrics, status = server.metrics(), server.status()
        finally:
            server.stop()  # SIGTERM: pending disk writes are flushed on the way out
    (text_a, cached_a), (text_b, cached_b) = results
    assert text_a == text_b and cached_a == 0 and cached_b == 144  # 4 chunks and a 1-block trailing chunk
    assert 'engine:kv_store_hits_total{model_name="' in metrics and 'tier="disk"} 5.0' in metrics
    assert status["kv_store"]["disk"]["hits"] == 5 and status["kv_store"]["cpu"]["used_bytes"] > 0


def test_store_mode_disaggregation_through_the_proxy(tiny_llama, redis_server):
    """The second disaggregation mode: P and D share a Redis tier. P stores the prompt's chunks
    and promises them in kv_transfer_params; D loads them (waiting for writes still on their
    way) instead of recomputing. The output equals a colocated run."""
    import httpx
    from tests.disagg_utils import ProxyProcess
    from tests.server_utils import ServerProcess
    args = ("--num-blocks", "64", "--max-model-len", "1024", "--kv-chunk-tokens", "32",
            "--kv-store", redis_server.url)
    prefill, decode = ServerProcess(str(tiny_llama), *args), ServerProcess(str(tiny_llama), *args)
    proxy = ProxyProcess([prefill.url], [decode.url])
    colocated = LLM(str(tiny_llama), num_blocks=64)
    try:
        for seed in (8, 9):
            prompt = _prompt(seed, 170)
            resp = httpx.post(f"{proxy.url}/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            expected = colocated.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].text
            assert resp.json()["choices"][0]["text"] == expected
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
        assert decode.status()["kv_store"]["redis"]["hits"] == 10
        prefill.wait_idle()
        decode.wait_idle()
    finally:
        proxy.stop()
        prefill.stop()
        decode.stop()


def test_disk_entry_deleted_between_lookup_and_load(tiny_llama, reference, tmp_path):
    """FAULTS 23: the index says yes, the file is gone at read time: the load falls short and
    the prefill is recomputed, output unchanged."""
    spec = f"disk:{tmp_path}/kv:1GiB"
    prompt = _prompt(11, 150)
    writer = LLM(str(tiny_llama), num_blocks=64, kv_store=spec, kv_chunk_tokens=32)
    writer.generate([prompt], GREEDY, use_tqdm=False)
    writer.shutdown()
    reader = LLM(str(tiny_llama), num_blocks=64, kv_store=spec, kv_chunk_tokens=32)  # indexes the files
    for name in os.listdir(tmp_path / "kv"):
        os.unlink(tmp_path / "kv" / name)
    assert reader.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference(prompt)
    assert reader.engine.scheduler.stats.num_kv_load_failures == 1
    assert_engine_idle(reader)
    reader.shutdown()


def test_tiny_cpu_tier_evicting_under_concurrent_lookups(tiny_llama, reference):
    """A CPU tier that holds 3 chunks, with shared and distinct prefixes in one batch: entries
    are evicted while others are looked up and loaded; every output stays exact."""
    chunk_bytes = 2 * 2 * 2 * 16 * 2 * 16 * AUTO_DTYPE_BYTES  # [layers, k/v, 2 blocks, 16 tokens, 2 kv heads, 16 dims]
    llm = LLM(str(tiny_llama), num_blocks=48, kv_store=f"cpu:{3 * chunk_bytes}", kv_chunk_tokens=32)
    shared = _prompt(12, 96)  # exactly the tier's 3 chunks
    llm.generate([shared], GREEDY, use_tqdm=False)  # whole chunks only: no trailing chunk
    llm.engine.kv_cache_manager.pool.reset_prefix_cache()  # lookups must go to the tier
    # Shared-prefix requests load pinned chunks while the distinct ones' saves evict around them.
    prompts = [shared + _prompt(30 + i, 20 + 7 * i) if i % 2 else _prompt(40 + i, 120) for i in range(8)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(prompt)
    # Whether a save in that batch found an unpinned entry to evict depends on timing; one more
    # prompt, saved with nothing pinned, surely evicts.
    last = _prompt(50, 120)
    assert llm.generate([last], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference(last)
    stats = llm.engine.kv_connector_stats.stores["cpu"]
    assert stats["hits"] > 0 and stats["bytes_stored"] > 3 * chunk_bytes >= stats["used_bytes"]  # it evicted
    assert_engine_idle(llm)
    llm.shutdown()


@pytest.mark.slow
def test_smollm2_tier_hits_across_processes(smollm2_dir, tmp_path, redis_server):
    """SmolLM2, greedy: a fresh process gets the prefix from disk, another from Redis, and both
    outputs equal the first (computed) run token for token."""
    question = "Explain, step by step, how a paged KV cache lets an inference server reuse a prefix. " * 6
    disk = f"disk:{tmp_path}/kv:1GiB"
    first = _fresh_process(smollm2_dir, f"cpu:256MiB,{disk},{redis_server.url}", question)
    from_disk = _fresh_process(smollm2_dir, f"cpu:256MiB,{disk}", question)
    from_redis = _fresh_process(smollm2_dir, f"cpu:256MiB,{redis_server.url}", question)
    assert first["cached"] == 0 and from_disk["cached"] >= 64 and from_redis["cached"] == from_disk["cached"]
    assert from_disk["hits"]["disk"] > 0 and from_redis["hits"]["redis"] > 0
    assert first["tokens"] == from_disk["tokens"] == from_redis["tokens"]


def test_a_broken_promise_recomputes_once(tiny_llama, reference):
    """kv_store_tokens promised by a prefill instance whose writes never land: the load waits,
    fails, and the request recomputes — once, not in a loop — with the exact output."""
    llm = LLM(str(tiny_llama), num_blocks=64, kv_store="cpu:64MiB", kv_chunk_tokens=32)
    llm.engine.scheduler.connector.wait_s = 0.5
    prompt = _prompt(14, 150)
    llm.engine.add_request("promised", prompt, GREEDY, kv_transfer_params={
        "kv_store_tokens": 128, "token_digest": token_digest(prompt[:128])})
    start, outputs = time.monotonic(), []
    while llm.engine.has_unfinished_requests():
        outputs += [o for o in llm.engine.step() if o.finished]
        assert time.monotonic() - start < 30
    assert outputs[0].outputs[0].token_ids == reference(prompt)
    assert llm.engine.scheduler.stats.num_kv_load_failures == 1
    assert_engine_idle(llm)
    llm.shutdown()


def _abort_during_a_held_load(llm: LLM, prompt: list[int], monkeypatch) -> None:
    """Request "busy" loads ``prompt``'s chunks from the CPU tier, whose read the test holds
    open, and is aborted meanwhile: the real path to blocks held for a transfer. Checks what
    must hold while the load is in flight, lets the read go and steps until the engine is idle."""
    from engine.errors import InvalidRequestError
    engine = llm.engine
    llm.generate([prompt], GREEDY, use_tqdm=False)  # its whole chunks are now in the CPU tier
    engine.kv_cache_manager.pool.reset_prefix_cache()  # so the next request loads them
    store = engine.runner.connector.tiers.stores[0]
    reading, release = threading.Event(), threading.Event()
    get = store.get

    def held_get(key: str):
        reading.set()
        release.wait(30)
        return get(key)
    monkeypatch.setattr(store, "get", held_get)
    deadline = time.monotonic() + 30
    try:
        engine.add_request("busy", prompt, GREEDY)
        while not reading.is_set():  # admitted, its chunks found and pinned, the load started
            engine.step()
            assert time.monotonic() < deadline, "the load never started"
        engine.abort_request("busy")
        # Its blocks stay held until the loader lets go (late bytes must not land in reused
        # blocks), and its id with them: reusing it now would hand the new request the old blocks.
        with pytest.raises(InvalidRequestError, match="still in use"):
            engine.add_request("busy", [5, 6, 7], GREEDY)
        assert engine.has_unfinished_requests() and engine.scheduler.num_waiting == 0
    finally:
        release.set()
    while engine.has_unfinished_requests():
        engine.step()
        assert time.monotonic() < deadline, "the cancelled load never ended"
    monkeypatch.undo()
    assert_engine_idle(llm)


def _run(llm: LLM, req_id: str, prompt: list[int]):
    llm.engine.add_request(req_id, prompt, GREEDY)
    outputs, deadline = [], time.monotonic() + 30
    while llm.engine.has_unfinished_requests():
        outputs += [o for o in llm.engine.step() if o.finished]
        assert time.monotonic() < deadline
    assert [o.request_id for o in outputs] == [req_id]
    return outputs[0]


def test_an_id_held_for_a_transfer_cannot_be_reused(tiny_llama, reference, monkeypatch):
    """A request aborted while its KV loads from a tier: its id is refused until the loader has
    let go of the blocks, and serves a new request (exactly) afterwards."""
    llm = LLM(str(tiny_llama), num_blocks=64, kv_store="cpu:64MiB", kv_chunk_tokens=32)
    prompt = _prompt(15, 100)
    _abort_during_a_held_load(llm, prompt, monkeypatch)
    assert _run(llm, "busy", prompt).outputs[0].token_ids == reference(prompt)
    assert_engine_idle(llm)
    llm.shutdown()


def test_a_load_cancelled_by_an_abort_leaves_nothing_behind(tiny_llama, reference, monkeypatch):
    """The cancelled load of an ended request leaves no state behind in the connector: the id,
    once free, is a new request that looks up the tiers like any other."""
    llm = LLM(str(tiny_llama), num_blocks=64, kv_store="cpu:64MiB", kv_chunk_tokens=32)
    prompt = _prompt(16, 100)
    _abort_during_a_held_load(llm, prompt, monkeypatch)
    try:
        assert llm.engine.num_tracked_requests() == 0
        out = _run(llm, "busy", prompt)  # the id is new again: it loads from the tier like any other
        assert out.outputs[0].token_ids == reference(prompt) and out.num_cached_tokens == 96
    finally:
        llm.shutdown()


# ---- lookups never run on the step thread (FAULTS 31) --------------------------------------
class _SlowCPUStore(CPUStore):
    """A CPU tier whose existence checks take ``delay`` seconds (a slow backend); finished
    checks and pinned / unpinned keys are counted."""

    def __init__(self, delay: float) -> None:
        super().__init__(2**30, FMT)
        self.delay = delay
        self.gate: threading.Event | None = None  # when set: checks wait for it (a hanging backend)
        self.num_contains = self.num_pinned = self.num_unpinned = 0

    def contains(self, keys: list[str]) -> list[bool]:
        if self.gate is not None:
            assert self.gate.wait(30), "the test never let the store answer"
        time.sleep(self.delay)
        found = super().contains(keys)
        self.num_contains += 1
        return found

    def pin(self, keys: list[str]) -> None:
        super().pin(keys)
        self.num_pinned += len(keys)

    def unpin(self, keys: list[str]) -> None:
        super().unpin(keys)
        self.num_unpinned += len(keys)


def _connector_halves(delay: float, lookup_timeout_s: float = 0.2):
    """Both halves of the tiered connector on one slow store, with fabricated block tables
    (FMT: 4-token blocks, 16-token chunks). ``step()`` carries one step's metadata to the
    worker and its output back, as the engine does."""
    from engine.kv_transfer.tiered import TieredConnectorScheduler
    from engine.kv_transfer.tiered_worker import TieredConnectorWorker, TieredStore
    store = _SlowCPUStore(delay)
    tiers = TieredStore([store])
    sched = TieredConnectorScheduler(block_size=4, chunk_tokens=16, lookup_timeout_s=lookup_timeout_s)
    worker = TieredConnectorWorker(tiers)
    worker.register_kv_caches(torch.zeros(2, 2, 64, 4, 2, 8))  # [layers, k/v, blocks, block_size, heads, dim]

    def step():
        from engine.outputs import CachedRequestData, SchedulerOutput
        meta = sched.build_connector_meta(SchedulerOutput([], CachedRequestData(), {}, 0, set()))
        worker.start_load_kv(meta)
        out = worker.get_finished()
        sched.update_connector_output(out)
        return meta, out
    return sched, worker, store, step


def _store_chunks(store: CPUStore, request, num_chunks: int) -> list[str]:
    keys = [request.block_hashes[(c + 1) * 4 - 1].hex() for c in range(num_chunks)]
    for c, key in enumerate(keys):
        store.put(key, _chunk(c))
    return keys


def test_a_late_lookup_is_a_miss_asked_once_and_its_answer_ignored():
    from engine.outputs import KVConnectorOutput
    from tests.scheduler_utils import make_request
    sched, worker, store, step = _connector_halves(delay=0.0, lookup_timeout_s=0.2)
    store.gate = threading.Event()  # the store answers only when the test says so
    try:
        a = make_request("a", 65)  # chunks 0-3 can come from outside (the last token is in chunk 4, alone)
        _store_chunks(store, a, 4)
        start = time.monotonic()
        # The scheduler half never waits on the store: "not known yet", and the worker is asked.
        assert sched.get_num_new_matched_tokens(a, 0) is None
        assert time.monotonic() - start < 0.1 and store.num_contains == 0
        meta, _ = step()
        assert [(lk.req_id, len(lk.keys)) for lk in meta.lookups] == [("a", 4)]
        while (match := sched.get_num_new_matched_tokens(a, 0)) is None:
            meta, _ = step()
            assert not meta.lookups  # asked once per admission, not once per step
            assert time.monotonic() - start < 10, "the scheduler waits on the store"
            time.sleep(0.01)
        # The deadline passed and the store has not answered: a miss for this admission.
        assert match == (0, False) and time.monotonic() - start >= 0.2 and store.num_contains == 0
        assert sched.lookup_timeouts == 1
        assert step()[0].releases == ["a"]  # the worker drops it: what it finds is unpinned
        # The worker's lookup ends late: it posts nothing and unpins what it found; any late
        # answer would be ignored.
        store.gate.set()
        wait_for(lambda: store.num_contains == 1 and store.num_unpinned == 4)
        assert store.num_pinned == 4 and not store._pins
        assert step()[1].lookups == {}
        sched.update_connector_output(KVConnectorOutput(lookups={"a": 4}))
        for _ in range(3):
            assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
            assert not step()[0].lookups
        assert store.num_contains == 1 and store.stats.misses == 0
        # Misses count once per lookup: b's 4 chunks are nowhere, however many steps it waits.
        sched.lookup_timeout_s = 5.0
        b = make_request("b", 70)
        assert sched.get_num_new_matched_tokens(b, 0) is None
        step()
        while (match := sched.get_num_new_matched_tokens(b, 0)) is None:
            assert not step()[0].lookups
            time.sleep(0.01)
        for _ in range(3):
            assert sched.get_num_new_matched_tokens(b, 0) == match == (0, False)
            assert not step()[0].lookups
        # (b's lookup: one check of its full chunks, one of the shorter chunks in chunk 0's place.)
        assert store.num_contains == 3 and store.stats.misses == 4 and sched.lookup_timeouts == 1
        # Admitted (b) or ended (a): nothing is kept, nothing stays pinned.
        sched.update_state_after_alloc(b, list(range(18)), 0, 0)
        for request in (a, b):
            sched.request_finished(request, [])
        step()
        assert sched.num_tracked_requests() == 0
        wait_for(lambda: not store._pins)
    finally:
        store.gate.set()
        worker.shutdown()


def test_lookup_answers_follow_the_local_prefix_and_pins_end_with_the_load():
    from engine.kv_transfer.params import KVTransferParams
    from tests.scheduler_utils import make_request
    sched, worker, store, step = _connector_halves(delay=0.0, lookup_timeout_s=5.0)
    try:
        d = make_request("d", 65)
        keys = _store_chunks(store, d, 4)
        # Asked with chunks 0-1 local: the answer counts from chunk 2.
        assert sched.get_num_new_matched_tokens(d, 32) is None
        assert [lk.keys for lk in step()[0].lookups] == [keys[2:]]
        wait_for(lambda: step()[1].lookups)
        assert sched.get_num_new_matched_tokens(d, 32) == (32, True)
        assert sched.get_num_new_matched_tokens(d, 48) == (16, True)  # the local prefix grew: fine
        assert dict(store._pins) == {keys[2]: 1, keys[3]: 1}  # found chunks are leased to d
        # The local prefix shrank (evicted from the device): ask again from chunk 0.
        assert sched.get_num_new_matched_tokens(d, 0) is None
        assert [lk.keys for lk in step()[0].lookups] == [keys]
        wait_for(lambda: step()[1].lookups == {"d": (4, 0)})
        assert sched.get_num_new_matched_tokens(d, 0) == (64, True)
        wait_for(lambda: dict(store._pins) == dict.fromkeys(keys, 1))  # the first lease ended
        # Admitted with a load: the loader takes the lease over and unpins once it has read.
        sched.update_state_after_alloc(d, list(range(18)), 0, 64)
        meta, _ = step()
        assert not meta.releases and [load.req_id for load in meta.loads] == ["d"]
        wait_for(lambda: "d" in step()[1].finished_recving)
        sched.transfer_done("d")
        assert torch.equal(worker.kv[:, :, 12:16], _chunk(3))  # chunk 3's blocks landed
        wait_for(lambda: not store._pins)
        # A promise (store-mode disaggregation) decides without a lookup.
        p = make_request("p", 65)
        p.kv_transfer_params = KVTransferParams(kv_store_tokens=48, token_digest=token_digest(p.prompt_token_ids[:48]))
        assert sched.get_num_new_matched_tokens(p, 0) == (48, True) and not step()[0].lookups
        # A promise made for other tokens (one replayed with another prompt) is no promise: a lookup.
        q = make_request("q", 65)
        q.kv_transfer_params = KVTransferParams(kv_store_tokens=48, token_digest=p.kv_transfer_params.token_digest)
        assert sched.get_num_new_matched_tokens(q, 0) is None and step()[0].lookups[0].req_id == "q"
        for request in (d, p, q):
            sched.request_finished(request, [])
        assert sched.num_tracked_requests() == 0
        # q asked too (its full chunks, then shorter chunks in chunk 0's place); p, with its promise, did not.
        wait_for(lambda: store.num_contains == 4)
    finally:
        worker.shutdown()


def test_a_trailing_chunk_is_found_and_loaded_like_a_prefix_hit():
    """Issue 13: a prompt's last, partial chunk (whole blocks) is stored too, so a tier hit covers
    every whole block before the last token, as a device prefix hit would: here 4 chunks and a
    trailing chunk of 1 block (70 tokens in 4-token blocks: 17 whole blocks before the last)."""
    from tests.scheduler_utils import make_request
    sched, worker, store, step = _connector_halves(delay=0.0, lookup_timeout_s=5.0)
    try:
        r = make_request("r", 70)
        keys = _store_chunks(store, r, 4)
        tail = r.block_hashes[16].hex()  # named by its own last block
        store.put(tail, _chunk(7)[:, :, :1].clone())
        assert sched.get_num_new_matched_tokens(r, 0) is None
        lookup = step()[0].lookups[0]
        assert lookup.keys == keys and lookup.tail_keys == [tail]
        wait_for(lambda: step()[1].lookups == {"r": (4, 1)})
        assert sched.get_num_new_matched_tokens(r, 0) == (68, True)
        sched.update_state_after_alloc(r, list(range(40, 58)), 0, 68)
        load = step()[0].loads[0]
        assert [c.key for c in load.chunks] == [*keys, tail] and load.chunks[-1].block_ids == [56]
        wait_for(lambda: "r" in step()[1].finished_recving)
        sched.transfer_done("r")
        assert torch.equal(worker.kv[:, :, 56:57], _chunk(7)[:, :, :1])
        sched.request_finished(r, [])
        assert sched.num_tracked_requests() == 0
    finally:
        worker.shutdown()


def test_a_shorter_prompts_trailing_chunk_serves_a_longer_one():
    """The next turn of a chat: a 30-token prompt stored chunk 0 and a 3-block trailing chunk
    (blocks 4-6, named by block 6); a 70-token prompt that starts with it misses its full
    chunk 1 and finds that trailing chunk in its place: 28 tokens from the tier, as the tier's
    KV events announced those blocks (tests/test_tier_events.py)."""
    from tests.scheduler_utils import make_request, prompt_for
    sched, worker, store, step = _connector_halves(delay=0.0, lookup_timeout_s=5.0)
    try:
        longer = make_request("long", prompt_token_ids=prompt_for("turn", 70))
        keys = _store_chunks(store, longer, 1)
        tail = longer.block_hashes[6].hex()
        store.put(tail, _chunk(9)[:, :, :3].clone())
        assert sched.get_num_new_matched_tokens(longer, 0) is None
        wait_for(lambda: step()[1].lookups == {"long": (1, 3)})
        assert sched.get_num_new_matched_tokens(longer, 0) == (28, True)
        sched.update_state_after_alloc(longer, list(range(40, 58)), 0, 28)
        load = step()[0].loads[0]
        assert [c.key for c in load.chunks] == [*keys, tail] and load.chunks[-1].block_ids == [44, 45, 46]
        wait_for(lambda: "long" in step()[1].finished_recving)
        sched.transfer_done("long")
        assert torch.equal(worker.kv[:, :, 44:47], _chunk(9)[:, :, :3])
        sched.request_finished(longer, [])
        assert sched.num_tracked_requests() == 0
    finally:
        worker.shutdown()


def test_a_hanging_redis_never_stalls_a_step(tiny_llama, reference, redis_server):
    """FAULTS 31: Redis stops answering mid-run (SIGSTOP: connections are accepted and nothing
    comes back, so every call waits out the tier's 1 s timeout). Lookups run on the worker's
    threads and become misses at the lookup deadline: no step waits on the server, and every
    output equals a run without a store."""
    from engine.kv_transfer.stores.redis import TIMEOUT_S
    llm = LLM(str(tiny_llama), num_blocks=64, kv_store=f"cpu:64MiB,{redis_server.url}", kv_chunk_tokens=32)
    engine = llm.engine
    engine.scheduler.connector.lookup_timeout_s = 0.3
    prompts = {f"r{i}": _prompt(50 + i, 100) for i in range(3)}
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        for req_id, prompt in prompts.items():
            engine.add_request(req_id, prompt, GREEDY)
        outputs, step_seconds, start = {}, [], time.monotonic()
        while engine.has_unfinished_requests():
            step_start = time.monotonic()
            outputs |= {o.request_id: o for o in engine.step() if o.finished}
            step_seconds.append(time.monotonic() - step_start)
            assert time.monotonic() - start < 30
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert max(step_seconds) < TIMEOUT_S / 2, f"a step waited on Redis: {max(step_seconds):.2f} s"
    for req_id, prompt in prompts.items():
        assert outputs[req_id].outputs[0].token_ids == reference(prompt)
        assert outputs[req_id].num_cached_tokens == 0
    # Each request's one lookup timed out to a miss; nothing was loaded.
    assert engine.scheduler.connector.lookup_timeouts == len(prompts)
    assert all(s["hits"] == 0 for s in engine.kv_connector_stats.stores.values())
    assert_engine_idle(llm)
    assert engine.num_tracked_requests() == 0
    llm.shutdown()


def test_a_finetune_differing_in_one_middle_tensor_never_hits_the_other_models_kv(tiny_llama, tmp_path):
    """Issue 27, item 4: two copies of a model, one changed in a middle tensor in place (same
    header, same size), share a disk tier: neither reads the other's KV; an identical copy does."""
    from tests.test_loader import _flip_a_middle_byte

    spec = f"disk:{tmp_path}/kv:1GiB"
    finetune, twin = tmp_path / "finetune", tmp_path / "twin"
    shutil.copytree(tiny_llama, finetune)
    shutil.copytree(tiny_llama, twin)
    _flip_a_middle_byte(finetune / "model.safetensors")
    prompt = _prompt(13, 96)
    writer = LLM(str(tiny_llama), num_blocks=64, kv_store=spec, kv_chunk_tokens=32)
    writer.generate([prompt], GREEDY, use_tqdm=False)
    writer.shutdown()
    for model, hits in ((finetune, False), (twin, True)):
        reader = LLM(str(model), num_blocks=64, kv_store=spec, kv_chunk_tokens=32)
        out = reader.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert (out.num_cached_tokens > 0) == hits, (model.name, out.num_cached_tokens)
        reader.shutdown()


def test_a_fresh_reader_loads_every_whole_block_before_the_last_token(tiny_llama, reference, tmp_path):
    """Issue 27, item 10: a prompt's last chunk is stored named by its own last block, which for
    a block-aligned prompt holds the last token; a reader in a fresh process must still load its
    whole blocks up to the last token, as a device prefix hit would — at every length across
    block (16) and chunk (32) edges."""
    spec = f"disk:{tmp_path}/kv:1GiB"
    lengths = [17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 80, 95, 96, 97, 130]
    prompts = [_prompt(1000 + n, n) for n in lengths]
    writer = LLM(str(tiny_llama), num_blocks=160, kv_store=spec, kv_chunk_tokens=32)
    writer.generate(prompts, GREEDY, use_tqdm=False)
    writer.shutdown()
    reader = LLM(str(tiny_llama), num_blocks=160, kv_store=spec, kv_chunk_tokens=32)
    outs = reader.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [(n - 1) // 16 * 16 for n in lengths]
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(prompt)
    assert_engine_idle(reader)
    reader.shutdown()


def test_the_configured_tiers_are_in_the_stats_when_the_engine_is_ready(tiny_llama, tmp_path):
    """Issue 27, item 8: a server is ready when its client's start() returns; the stats it shows
    from then on must already name every configured tier (they used to arrive with the core's
    first stats message, after /status could answer without them). Read before the client's
    reader task has run once, so no later message can make this pass."""
    import asyncio

    from engine.config import EngineConfig
    from engine.core_client import AsyncEngineClient

    async def ready_stats():
        client = AsyncEngineClient(EngineConfig(model=str(tiny_llama), num_blocks=32, kv_chunk_tokens=32,
                                                kv_store=f"cpu:64MiB,disk:{tmp_path}/kv:1GiB"))
        await client.start(timeout=120)
        tiers = set(client.stats.kv_store)  # no await between: only the ready message was read
        await client.shutdown()
        return tiers

    assert asyncio.run(ready_stats()) == {"cpu", "disk"}
