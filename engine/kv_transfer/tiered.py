"""Prefix reuse and offload through KV stores (CPU memory, local disk, Redis).

Scheduler half: at admission, after the device prefix match, count how many further full
chunks (``chunk_tokens`` tokens, a multiple of the block size) the tiers hold; the scheduler
allocates blocks for them and parks the request in WAITING_FOR_REMOTE_KV while the worker
loads them. The last token of the prompt is never loaded (its logits are needed). After a
step computes a chunk in full, the chunk is saved.

Worker half: a save gathers the chunk's blocks into one CPU tensor right after the forward
pass (a memcpy, while the blocks are certainly still the request's), puts it in the CPU tier
and queues it for the slower tiers, which a background thread writes: the step loop never
waits on disk or the network. Loads run on a loader thread: each chunk comes from the fastest
tier that has it (a disk or Redis hit is promoted to the CPU tier) and is copied into the
allocated blocks. Hits are pinned from allocation to load; anything missing at load time
fails the load, and the scheduler recomputes.

Keys are the SHA-256 chained hash of a chunk's last block (it covers every token before it
and, through the root hash, the model fingerprint, dtype, block size and layout).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker, contiguous_runs
from engine.kv_transfer.stores.base import KVStore
from engine.outputs import KVConnectorOutput, SchedulerOutput
from engine.request import Request, RequestStatus

logger = logging.getLogger("engine.kv_store")

DEFAULT_CHUNK_TOKENS = 256
MAX_PENDING_SAVE_BYTES = 512 * 2**20  # writes to slow tiers beyond this backlog are skipped
NUM_LOADERS = 4
DEFAULT_PROMISED_WAIT_S = 10.0  # how long a decode waits for chunks a prefill instance promised


@dataclass(slots=True)
class ChunkLoad:
    key: str
    first_block: int       # the chunk's first block to write (earlier ones were a device hit)
    block_ids: list[int]   # destinations of the chunk's blocks [first_block:]


@dataclass(slots=True)
class TierLoad:
    req_id: str
    chunks: list[ChunkLoad]
    wait_until: float = 0.0  # time.monotonic() until which a missing chunk is retried


@dataclass(slots=True)
class TierSave:
    key: str
    block_ids: list[int]  # the chunk's blocks, in order


@dataclass(slots=True)
class TieredMetadata:
    loads: list[TierLoad] = field(default_factory=list)
    saves: list[TierSave] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


class TieredStore:
    """The tiers in lookup order (fastest first), seen as one store."""

    def __init__(self, stores: list[KVStore]) -> None:
        self.stores = stores

    def lookup(self, keys: list[str]) -> int:
        """How many leading keys some tier holds."""
        found = [False] * len(keys)
        for store in self.stores:
            todo = [i for i, f in enumerate(found) if not f]
            if not todo:
                break
            present = store.contains([keys[i] for i in todo])
            for i, p in zip(todo, present):
                found[i] = p
            store.count(misses=present.count(False))
        return found.index(False) if False in found else len(found)

    def load(self, key: str) -> torch.Tensor | None:
        for depth, store in enumerate(self.stores):
            start = time.perf_counter()
            kv = store.get(key)
            if kv is None:
                continue
            store.count(hits=1, bytes_loaded=kv.numel() * kv.element_size(),
                        load_seconds=time.perf_counter() - start)
            for faster in self.stores[:depth]:
                if faster.name == "cpu":  # promotion: the next hit is a memory hit
                    faster.put(key, kv)
            return kv
        return None

    def pin(self, keys: list[str]) -> None:
        for store in self.stores:
            store.pin(keys)

    def unpin(self, keys: list[str]) -> None:
        for store in self.stores:
            store.unpin(keys)

    def close(self) -> None:
        for store in self.stores:
            store.close()


class TieredConnectorScheduler(KVConnectorScheduler):
    def __init__(self, tiers: TieredStore, block_size: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 wait_s: float = DEFAULT_PROMISED_WAIT_S) -> None:
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError(f"kv_chunk_tokens={chunk_tokens} must be a positive multiple of the block "
                             f"size ({block_size})")
        self.tiers = tiers
        self.wait_s = wait_s
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // block_size
        self._meta = TieredMetadata()
        self._requests: dict[str, Request] = {}
        self._blocks: dict[str, list[int]] = {}   # mirrors the runner's block tables
        self._saved: dict[str, int] = {}          # leading chunks known to be in the tiers
        # request -> (pinned keys, first chunk) of its load in flight
        self._loading: dict[str, tuple[list[str], int]] = {}
        self._no_lookup: set[str] = set()  # a load of theirs failed: they recompute from here on

    def _key(self, request: Request, chunk: int) -> str:
        return request.block_hashes[(chunk + 1) * self.blocks_per_chunk - 1].hex()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        first = num_computed_tokens // self.chunk_tokens
        last = (request.num_tokens - 1) // self.chunk_tokens  # chunks that end before the last token
        if first >= last or request.request_id in self._no_lookup:
            return 0, False
        found = first + self.tiers.lookup([self._key(request, c) for c in range(first, last)])
        # Store-mode disaggregation: a prefill instance said it stored this many tokens; its
        # writes may still be on their way, so the loader waits for them (up to a deadline).
        promised = int((request.kv_transfer_params or {}).get("kv_store_tokens", 0)) // self.chunk_tokens
        external = max(found, min(promised, last)) * self.chunk_tokens - num_computed_tokens
        return (external, True) if external > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        end_chunk = (num_local_tokens + num_external_tokens) // self.chunk_tokens
        self._saved[req_id] = max(self._saved.get(req_id, 0), end_chunk)
        if num_external_tokens == 0:
            return
        first_local_block = num_local_tokens // self.block_size
        chunks = []
        for c in range(num_local_tokens // self.chunk_tokens, end_chunk):
            first = max(0, first_local_block - c * self.blocks_per_chunk)
            start = c * self.blocks_per_chunk
            chunks.append(ChunkLoad(self._key(request, c), first,
                                    block_ids[start + first:start + self.blocks_per_chunk]))
        keys = [c.key for c in chunks]
        self.tiers.pin(keys)  # from here to the load, eviction cannot take them
        self._loading[req_id] = (keys, num_local_tokens // self.chunk_tokens)
        promised = "kv_store_tokens" in (request.kv_transfer_params or {})
        self._meta.loads.append(TierLoad(req_id, chunks, time.monotonic() + self.wait_s if promised else 0.0))

    def build_connector_meta(self, scheduler_output: SchedulerOutput | None) -> TieredMetadata:
        if scheduler_output is not None:
            self._plan_saves(scheduler_output)
        meta, self._meta = self._meta, TieredMetadata()
        return meta

    def _plan_saves(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:  # finished or preempted: the runner drops its table too
            self._blocks.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids)
        for req_id, block_ids in zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.new_block_ids):
            self._blocks[req_id].extend(block_ids)
        for req_id, n in so.num_scheduled_tokens.items():
            request = self._requests[req_id]
            # num_computed_tokens is advanced after this call: +n is what this step computes.
            full = (request.num_computed_tokens + n) // self.chunk_tokens
            blocks = self._blocks[req_id]
            for c in range(self._saved.get(req_id, 0), full):
                self._meta.saves.append(TierSave(
                    self._key(request, c), blocks[c * self.blocks_per_chunk:(c + 1) * self.blocks_per_chunk]))
            self._saved[req_id] = max(self._saved.get(req_id, 0), full)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._blocks.pop(req_id, None)
        saved = self._saved.pop(req_id, 0)
        self._no_lookup.discard(req_id)
        if req_id in self._loading:
            # Ended while its chunks are loading: keep the blocks until the loader lets go.
            self._meta.cancels.append(req_id)
            return True, None
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode") and request.status in (RequestStatus.FINISHED_LENGTH,
                                                                  RequestStatus.FINISHED_STOPPED):
            # Store-mode disaggregation: the prompt's chunks are (being) stored; a decode
            # instance on the same store loads them instead of recomputing.
            tokens = min(saved, (request.num_prompt_tokens - 1) // self.chunk_tokens) * self.chunk_tokens
            return False, {"kv_store_tokens": tokens}
        return False, None

    def num_tracked_requests(self) -> int:
        return (len(self._requests) + len(self._blocks) + len(self._saved) + len(self._loading)
                + len(self._no_lookup))

    def transfer_done(self, req_id: str, failed: bool = False) -> None:
        loading = self._loading.pop(req_id, None)
        if loading is None:
            return
        keys, first_chunk = loading
        self.tiers.unpin(keys)
        if failed:
            # It recomputes: asking the tiers again could fail the same way, forever; and the
            # chunks it recomputes are saved again (a corrupt entry that was read is gone by now).
            self._no_lookup.add(req_id)
            if req_id in self._saved:
                self._saved[req_id] = first_chunk


class TieredConnectorWorker(KVConnectorWorker):
    def __init__(self, tiers: TieredStore) -> None:
        self.tiers = tiers
        self.kv: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: dict[str, str] = {}
        self._cancelled: set[str] = set()
        self._loads: queue.Queue[TierLoad] = queue.Queue()
        self._saves: queue.Queue[tuple[str, torch.Tensor]] = queue.Queue()
        self._pending_save_bytes = 0
        self.skipped_saves = 0
        self._stop = threading.Event()
        self._outstanding: set[str] = set()  # loads queued or running
        # Several loaders: one load waiting for promised chunks must not hold up the others.
        self._threads = [threading.Thread(target=self._load_loop, name=f"kv-store-load-{i}", daemon=True)
                         for i in range(NUM_LOADERS)]
        self._threads.append(threading.Thread(target=self._save_loop, name="kv-store-save", daemon=True))
        self._slow_tiers = [s for s in tiers.stores if s.name != "cpu"]
        self._cpu_tier = next((s for s in tiers.stores if s.name == "cpu"), None)

    def register_kv_caches(self, kv_caches: torch.Tensor) -> None:
        self.kv = kv_caches  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        for t in self._threads:
            t.start()

    def start_load_kv(self, metadata: TieredMetadata | None) -> None:
        if metadata is None:
            return
        with self._lock:
            # A cancel for a load that already finished is moot (and would linger).
            self._cancelled.update(r for r in metadata.cancels if r in self._outstanding)
            self._outstanding.update(load.req_id for load in metadata.loads)
        for load in metadata.loads:
            self._loads.put(load)

    def save_kv(self, metadata: TieredMetadata | None) -> None:
        if metadata is None:
            return
        for save in metadata.saves:
            # A copy now, while the blocks surely hold this chunk; everything slower happens later.
            index = torch.tensor(save.block_ids, dtype=torch.int64, device=self.kv.device)
            chunk = self.kv.index_select(2, index).cpu()
            if self._cpu_tier is not None:
                self._cpu_tier.put(save.key, chunk)
            if not self._slow_tiers:
                continue
            nbytes = chunk.numel() * chunk.element_size()
            with self._lock:
                if self._pending_save_bytes + nbytes > MAX_PENDING_SAVE_BYTES:
                    self.skipped_saves += 1  # the slow tiers cannot keep up: skip, never block
                    continue
                self._pending_save_bytes += nbytes
            self._saves.put((save.key, chunk))

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            out = KVConnectorOutput(finished_recving=self._done, failed_recving=set(self._failed),
                                    failure_reasons=dict(self._failed))
            self._done, self._failed = set(), {}
        return out

    def store_stats(self) -> dict[str, dict]:
        stats = {}
        for store in self.tiers.stores:
            s = store.stats
            stats[store.name] = {"hits": s.hits, "misses": s.misses, "bytes_stored": s.bytes_stored,
                                 "bytes_loaded": s.bytes_loaded, "used_bytes": store.used_bytes(),
                                 "load_seconds": store.drain_load_seconds()}
        return stats

    def wait_for_saves(self, timeout: float = 30.0) -> bool:
        """Block until queued writes to the slow tiers are done (tests, shutdown, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self._pending_save_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._pending_save_bytes

    def shutdown(self) -> None:
        self.wait_for_saves(timeout=10)
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(2)
        self.tiers.close()

    def _load_loop(self) -> None:
        while not self._stop.is_set():
            try:
                load = self._loads.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                error = self._load(load)
            except Exception as exc:  # a store bug fails this load (it recomputes), never the loader
                logger.exception("KV store load for %s raised", load.req_id)
                error = f"error: {type(exc).__name__}: {exc}"
            with self._lock:
                self._cancelled.discard(load.req_id)
                self._outstanding.discard(load.req_id)
                if error is None:
                    self._done.add(load.req_id)
                else:
                    self._failed[load.req_id] = error
            if error is not None and not error.startswith("cancelled"):
                logger.info("KV store load for %s fell short (%s); recomputing", load.req_id, error)

    def _load(self, load: TierLoad) -> str | None:
        for chunk in load.chunks:
            if load.req_id in self._cancelled:
                return "cancelled: the request ended"
            kv = self.tiers.load(chunk.key)
            while kv is None and time.monotonic() < load.wait_until and load.req_id not in self._cancelled:
                time.sleep(0.005)  # promised by a prefill instance whose write is still on its way
                kv = self.tiers.load(chunk.key)
            if kv is None:
                return f"miss: chunk {chunk.key[:12]} is in no tier (evicted, or never written)"
            src = list(range(chunk.first_block, chunk.first_block + len(chunk.block_ids)))
            for s, d, n in contiguous_runs(src, chunk.block_ids):
                self.kv[:, :, d:d + n].copy_(kv[:, :, s:s + n])
        return None

    def _save_loop(self) -> None:
        while not self._stop.is_set():
            try:
                key, chunk = self._saves.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                for store in self._slow_tiers:
                    store.put(key, chunk)
            except Exception:  # a store bug must not kill the saver: log and go on
                logger.exception("KV store write of %s failed", key)
            finally:
                with self._lock:
                    self._pending_save_bytes -= chunk.numel() * chunk.element_size()
