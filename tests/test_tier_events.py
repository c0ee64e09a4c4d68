"""KV events of the CPU and disk tiers (engine/kv_transfer/tier_events.py): with real stores,
a subscriber that applies the events holds, per medium, exactly the blocks of the chunks the
tier holds, however chunks overlap and evict one another; nothing undescribed is announced, and
no description outlives its chunk. Then a real `engine serve` with tiers and --kv-events: the
tiers announce the pool's names for a prompt, and engine proxy's router still finds the prefix
after the pool evicted it."""
from __future__ import annotations

import types

import time

import httpx
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_events import BlockRemoved, BlockStored
from engine.kv_transfer.stores.base import ChunkFormat
from engine.kv_transfer.stores.cpu import CPUStore
from engine.kv_transfer.stores.disk import DiskStore
from engine.kv_transfer.tier_events import ChunkNames, TierEvents
from tests.conftest import AUTO_DTYPE_BYTES
from tests.server_utils import ServerProcess
from tests.test_kv_events import vllm_subscriber

FMT = ChunkFormat("fp", torch.float32, (1, 2, 4, 2, 1, 2))  # 4 blocks per chunk, 128 bytes
CHUNK_BYTES = FMT.nbytes


def _chunk(blocks: int = 4) -> torch.Tensor:
    return torch.zeros(1, 2, blocks, 2, 1, 2)


def _names(prefix: str, start: int, end: int) -> ChunkNames:
    """Blocks start..end-1 of the prompt ``prefix``: the names a pool would give them."""
    names = tuple(f"{prefix}{i}".encode() for i in range(start, end))
    return ChunkNames(names, f"{prefix}{start - 1}".encode() if start else None)


class _Index:
    """What a subscriber knows of each medium: stored adds, removed drops (a router's index)."""

    def __init__(self) -> None:
        self.held: dict[str, set] = {}

    def apply(self, events) -> None:
        for event in events:
            held = self.held.setdefault(event.medium, set())
            if isinstance(event, BlockStored):
                assert not held & set(event.block_hashes), "a block stored twice in one medium"
                assert event.token_ids == [] and event.block_size == 2
                held.update(event.block_hashes)
            else:
                assert isinstance(event, BlockRemoved) and set(event.block_hashes) <= held
                held.difference_update(event.block_hashes)


def test_overlapping_chunks_announce_each_block_once_and_remove_it_with_the_last(tmp_path):
    cpu = CPUStore(2 * CHUNK_BYTES, FMT)
    disk = DiskStore(str(tmp_path), 100 * CHUNK_BYTES, FMT)
    events = TierEvents([cpu, disk], block_size=2)
    index = _Index()
    tail, full = _names("p", 0, 2), _names("p", 0, 4)  # a 2-block trailing chunk, then the full chunk
    for key, names, blocks in (("tail", tail, 2), ("full", full, 4)):
        events.expect(key, names, 2)
        cpu.put(key, _chunk(blocks))
        disk.put(key, _chunk(blocks))
        events.put_done(key, 2)
    batch = events.drain()
    index.apply(batch)
    cpu_stored = [e for e in batch if e.medium == "CPU"]
    assert [(e.block_hashes, e.parent_block_hash) for e in cpu_stored] == [([b"p0", b"p1"], None),
                                                                           ([b"p2", b"p3"], b"p1")]
    assert index.held == {"CPU": set(full.names), "STORAGE": set(full.names)}
    # Two more chunks evict both from the 2-chunk CPU tier: the shared blocks go with the last.
    for key in ("x", "y"):
        events.expect(key, _names(key, 0, 4), 1)
        cpu.put(key, _chunk())
        events.put_done(key)
    index.apply(events.drain())
    assert index.held["CPU"] == set(_names("x", 0, 4).names) | set(_names("y", 0, 4).names)
    assert index.held["STORAGE"] == set(full.names)


def test_undescribed_entries_are_never_announced_and_descriptions_do_not_outlive_chunks(tmp_path):
    cpu = CPUStore(CHUNK_BYTES, FMT)
    events = TierEvents([cpu], block_size=2)
    cpu.put("foreign", _chunk())  # no description (a promotion of another engine's disk entry)
    assert events.drain() == []
    for key in ("a", "b", "c"):
        events.expect(key, _names(key, 0, 4), 1)
        cpu.put(key, _chunk())
        events.put_done(key)
    index = _Index()
    index.apply(events.drain())
    assert index.held["CPU"] == set(_names("c", 0, 4).names)
    assert set(events._chunks) == {"c"}  # a and b left the tier: their names are gone too
    # A put the tier refuses (bigger than it) leaves nothing behind once it is done.
    events.expect("huge", _names("h", 0, 8), 1)
    cpu.put("huge", torch.zeros(1, 2, 8, 2, 1, 2))
    events.put_done("huge")
    assert events.drain() == [] and set(events._chunks) == {"c"}


def test_a_put_pending_across_a_drain_is_still_announced():
    cpu = CPUStore(4 * CHUNK_BYTES, FMT)
    events = TierEvents([cpu], block_size=2)
    events.expect("a", _names("a", 0, 4), 1)
    assert events.drain() == []  # the saver has not written it yet: its names stay
    cpu.put("a", _chunk())
    events.put_done("a")
    index = _Index()
    index.apply(events.drain())
    assert index.held["CPU"] == set(_names("a", 0, 4).names)


class _PutDuringDrain(CPUStore):
    """A put (by the saver thread) that lands right after a drain took this tier's journal."""
    then = None

    def take_journal(self):
        entries = super().take_journal()
        if self.then is not None:
            self.then, then = None, self.then
            then()
        return entries


def test_a_put_landing_while_a_drain_runs_is_announced_by_the_next():
    cpu = _PutDuringDrain(4 * CHUNK_BYTES, FMT)
    events = TierEvents([cpu], block_size=2)
    events.expect("a", _names("a", 0, 4), 1)
    cpu.then = lambda: (cpu.put("a", _chunk()), events.put_done("a"))
    assert events.drain() == []
    index = _Index()
    index.apply(events.drain())
    assert index.held["CPU"] == set(_names("a", 0, 4).names)


# Chunks of 3 prompts, each with a trailing 1-, 2- or 3-block chunk and full chunks of 4 blocks;
# the engine describes every chunk it saves. Prompt z's are another engine's (a shared disk
# directory's files promoted to the CPU tier): never described.
CHUNKS = {f"{p}{start}-{end}": (p, start, end) for p in "abcz"
          for start, end in [(0, 1), (0, 2), (0, 3), (0, 4), (4, 6), (4, 8)]}


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(sorted(CHUNKS)), st.booleans()), max_size=40), st.integers(1, 4))
def test_generated_puts_and_evictions_keep_every_subscriber_exact(ops, capacity):
    """Any sequence of puts (drained or not in between) into a CPU tier that holds ``capacity``
    chunks: after each drain, the subscriber's CPU blocks are the blocks of the engine's chunks
    the tier holds, and no description outlives its chunk."""
    cpu = CPUStore(capacity * CHUNK_BYTES, FMT)
    events = TierEvents([cpu], block_size=2)
    index = _Index()
    for key, drain in ops:
        prompt, start, end = CHUNKS[key]
        ours = prompt != "z"
        if ours:
            events.expect(key, _names(prompt, start, end), 1)
        cpu.put(key, _chunk(end - start))
        if ours:
            events.put_done(key)
        if drain:
            index.apply(events.drain())
            held = {n for k in cpu._chunks if not k.startswith("z") for n in _names(*CHUNKS[k]).names}
            assert index.held.get("CPU", set()) == held
            assert set(events._chunks) <= set(cpu._chunks)


def test_a_server_announces_its_tiers_and_the_router_finds_an_offloaded_prefix(tiny_llama, tmp_path, monkeypatch):
    """--kv-store cpu,disk with --kv-events: the tiers announce a prompt's chunks under the pool's
    names (medium CPU and STORAGE, vLLM's hashes with the option); after the pool evicts the prompt,
    a router still predicts the prefix; a CPU tier too small for everything removes what it drops."""
    from entrypoints.kv_router import KVRouter

    # The tiny model's 2-block chunk: 2 layers x K,V x 2 blocks x 16 tokens x 2 heads x 16 dims.
    chunk_bytes = 2 * 2 * 2 * 16 * 2 * 16 * AUTO_DTYPE_BYTES
    server = ServerProcess(str(tiny_llama), "--num-blocks", "24", "--max-model-len", "256", "--kv-events",
                           "--kv-store", f"cpu:{3 * chunk_bytes},disk:{tmp_path}:1GiB", "--kv-chunk-tokens", "32",
                           "--prefix-caching-hash-algo", "sha256_cbor", env={"PYTHONHASHSEED": "0"})
    info = server.status()["kv_events"]
    sub = vllm_subscriber(server)
    router = KVRouter()
    try:
        monkeypatch.setenv("PYTHONHASHSEED", "0")  # the router shares the instances' seed
        router.watch(server.url, info)
        assert sub.replayed(0)
        prompt = list(range(400, 480))  # 80 tokens: 5 whole blocks, chunks of 2 blocks (32 tokens)
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        # The disk tier is written after the step: its events come with a later one (an idle
        # instance steps once a second).
        by_medium: dict[str, list] = {}
        deadline = time.monotonic() + 10
        while len(by_medium.get("STORAGE", ())) < 5 and time.monotonic() < deadline:
            for e in (e for _, b in sub.live(timeout_ms=1000) for e in b.events):
                if type(e).__name__ == "_BlockStored032":
                    by_medium.setdefault(e.medium, []).extend(e.block_hashes)
        gpu = by_medium["GPU"]
        assert len(gpu) == 5 and by_medium["STORAGE"] == gpu
        assert by_medium.get("CPU") and set(by_medium["CPU"]) <= set(gpu)  # what the small CPU tier kept
        # Other prompts push this one out of the 24-block pool (and of the small CPU tier).
        for seed in (1, 2, 3, 4):
            other = {**body, "prompt": [1000 * seed + i for i in range(150)]}
            assert httpx.post(f"{server.url}/v1/completions", json=other, timeout=60).status_code == 200
        later = [e for _, b in sub.live(timeout_ms=2000) for e in b.events]
        removed = {m: {h for e in later if type(e).__name__ == "_BlockRemoved032" and e.medium == m
                       for h in e.block_hashes} for m in ("GPU", "CPU")}
        assert set(gpu) <= removed["GPU"] and removed["CPU"], removed
        deadline = time.monotonic() + 10
        index = router.indexes[server.url]
        while not set(gpu) <= index.tiers.get("STORAGE", set()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not set(gpu) & index.hashes and set(gpu) <= index.tiers["STORAGE"]
        _, hit = router.choose([types.SimpleNamespace(url=server.url, in_flight=0)], router.prompt_blocks(prompt))
        assert hit == 80
        # And the instance does load it from the disk tier.
        usage = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 64
    finally:
        router.stop()
        sub.close()
        server.stop()
