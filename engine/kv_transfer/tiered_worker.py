"""Prefix reuse and offload through KV stores: the worker half (the scheduler half and the
metadata are in ``tiered.py``). Everything here that touches a store runs on a thread of its
own, never on the engine's step thread.

Saves: a save gathers the chunk's blocks into one CPU tensor once the step's output is on its
way and before the next step loads or computes anything (the model runner's save_kv; a memcpy,
while the blocks certainly still hold what the step computed, even those a request that ended
in it freed), puts it in the CPU tier and queues it for the slower tiers, which a background
thread writes.

Lookups run on lookup threads; each store call is bounded by the store's own timeout. A lookup
pins the chunks it found (a lease, per request) and posts the count; the answer goes back in
``KVConnectorOutput.lookups``. The lease ends when a load of the request has read the chunks,
when the scheduler releases the lookup (admitted without a load, timed out, ended), or when a
newer lookup for the request supersedes it. A lookup that was released or superseded before
it finished posts nothing and unpins what it found.

Loads run on loader threads: each chunk comes from the fastest tier that has it (a disk or
Redis hit is promoted to the CPU tier) and is copied into the allocated blocks. Chunks are
pinned while they load; anything missing at load time fails the load, and the scheduler
recomputes.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from engine import timeline
from engine.kv_transfer.base import KVConnectorWorker, LoadBook, contiguous_runs, queued
from engine.kv_transfer.device_copies import off_step_stream
from engine.kv_transfer.stores.base import KVStore
from engine.kv_transfer.tier_events import TierEvents
from engine.kv_transfer.tiered import TieredMetadata, TierLoad, TierLookup
from engine.outputs import KVConnectorOutput, KVConnectorStats
from engine.side_threads import side_thread
from engine.request_trace import KVLoadTrace, TierLoadTrace

logger = logging.getLogger("engine.kv_store")

MAX_PENDING_SAVE_BYTES = 512 * 2**20  # writes to slow tiers beyond this backlog are skipped
NUM_LOADERS = 4
# A hanging store holds one lookup thread for its timeout; the others keep answering (and skip
# lookups the scheduler has given up on before doing any I/O for them).
NUM_LOOKUP_THREADS = 2
USED_BYTES_REFRESH_S = 1.0  # how often the saver refreshes the slow tiers' used_bytes for stats


class TieredStore:
    """The tiers in lookup order (fastest first), seen as one store."""

    def __init__(self, stores: list[KVStore]) -> None:
        self.stores = stores

    def lookup(self, keys: list[str]) -> list[str]:
        """The leading keys some tier holds: for each, the name of the fastest tier holding it
        (I/O: worker threads only)."""
        found: list[str | None] = [None] * len(keys)
        for store in self.stores:
            todo = [i for i, f in enumerate(found) if f is None]
            if not todo:
                break
            present = store.contains([keys[i] for i in todo])
            for i, p in zip(todo, present):
                if p:
                    found[i] = store.name
            store.count(misses=present.count(False))
        return found[:found.index(None)] if None in found else found

    def longest_tail(self, keys: list[str]) -> tuple[int, str] | None:
        """The index of the first of ``keys`` (candidate trailing chunks, longest first) that
        some tier holds, and the fastest tier holding it; or None (one existence check per tier)."""
        best = None
        for store in self.stores:
            present = store.contains(keys)
            if True in present:
                index = present.index(True)
                if best is None or index < best[0]:
                    best = (index, store.name)
        return best

    def load(self, key: str) -> torch.Tensor | None:
        found = self.load_from_tier(key)
        return None if found is None else found[0]

    def load_from_tier(self, key: str) -> tuple[torch.Tensor, str, float] | None:
        """The chunk, the tier it came from and the seconds that tier took; None if in none."""
        for depth, store in enumerate(self.stores):
            start = time.perf_counter()
            kv = store.get(key)
            if kv is None:
                continue
            seconds = time.perf_counter() - start
            store.count(hits=1, bytes_loaded=kv.numel() * kv.element_size(), load_seconds=seconds)
            for faster in self.stores[:depth]:
                if faster.name == "cpu":  # promotion: the next hit is a memory hit
                    faster.put(key, kv)
            return kv, store.name, seconds
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


@dataclass(slots=True)
class _LookupJob:
    lookup: TierLookup
    ticket: int  # tells this lookup from earlier and later ones for the same request


@dataclass(slots=True)
class _UnpinJob:
    keys: list[str]  # an ended lease: unpinned on a lookup thread (a pin can wait on a store lock)


class TieredConnectorWorker(KVConnectorWorker):
    def __init__(self, tiers: TieredStore) -> None:
        self.tiers = tiers
        self.kv: torch.Tensor | None = None
        # Guards the per-request state below; never held across a store call.
        self._lock = threading.Lock()
        self.loads = LoadBook()
        self._loads: queue.Queue[TierLoad] = queue.Queue()
        self._saves: queue.Queue[tuple[str, torch.Tensor, bool]] = queue.Queue()  # key, KV, described
        self._lookup_jobs: queue.Queue[_LookupJob | _UnpinJob] = queue.Queue()
        self._pending_save_bytes = 0
        self.skipped_saves = 0
        self._stop = threading.Event()
        # Lookup state. Invariant: a request is in at most one of _asked (a lookup queued or
        # running) and _answers (posted, not yet collected); _leases holds what the last
        # posted lookup of a request pinned, until a load or a release ends it.
        self._ticket = 0
        self._asked: dict[str, int] = {}
        self._answers: dict[str, tuple[int, int]] = {}
        self._answer_sources: dict[str, list[str]] = {}  # beside _answers: the tier of each chunk found
        # Timed transfers not yet reported (source, bytes, seconds): the load-or-recompute rates.
        self._samples: list[tuple[str, int, float]] = []
        self._leases: dict[str, list[str]] = {}
        # Several loaders: one load waiting for promised chunks must not hold up the others.
        self._threads = [side_thread(self._load_loop, f"kv-store-load-{i}")
                         for i in range(NUM_LOADERS)]
        self._threads += [side_thread(self._lookup_loop, f"kv-store-lookup-{i}")
                          for i in range(NUM_LOOKUP_THREADS)]
        self._threads.append(side_thread(self._save_loop, "kv-store-save"))
        self._slow_tiers = [s for s in tiers.stores if s.name != "cpu"]
        self._cpu_tier = next((s for s in tiers.stores if s.name == "cpu"), None)
        # A slow tier's used_bytes may be a network call (Redis INFO): the saver refreshes it.
        self._slow_used: dict[str, int] = {s.name: 0 for s in self._slow_tiers}
        self._slow_used_at = 0.0
        self.events: TierEvents | None = None  # the CPU and disk tiers' KV events, when on

    def enable_events(self, block_size: int) -> None:
        """Publish what enters and leaves the CPU and disk tiers (tier_events.py)."""
        self.events = TierEvents(self.tiers.stores, block_size)
        self._published_slow = sum(s.medium is not None for s in self._slow_tiers)

    def register_kv_caches(self, kv_caches: torch.Tensor) -> None:
        self.kv = kv_caches  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        for t in self._threads:
            t.start()

    def start_load_kv(self, metadata: TieredMetadata | None) -> None:
        if metadata is None:
            return
        unpins: list[list[str]] = []
        jobs: list[_LookupJob] = []
        self.loads.submit([load.req_id for load in metadata.loads], metadata.cancels)
        with self._lock:
            for req_id in metadata.releases:
                self._end_lookup(req_id, unpins)
            for lookup in metadata.lookups:
                self._end_lookup(lookup.req_id, unpins)  # superseded
                self._ticket += 1
                self._asked[lookup.req_id] = self._ticket
                jobs.append(_LookupJob(lookup, self._ticket))
        for keys in unpins:
            self._lookup_jobs.put(_UnpinJob(keys))
        for job in jobs:
            self._lookup_jobs.put(job)
        for load in metadata.loads:
            self._loads.put(load)

    def _end_lookup(self, req_id: str, unpins: list[list[str]]) -> None:
        """Forget a request's lookup (under the lock): a running one will post nothing, an
        uncollected answer is dropped, and its lease is handed to a lookup thread to unpin."""
        self._asked.pop(req_id, None)
        self._answers.pop(req_id, None)
        self._answer_sources.pop(req_id, None)
        lease = self._leases.pop(req_id, None)
        if lease:
            unpins.append(lease)

    def _copy_out(self, index: torch.Tensor) -> torch.Tensor:
        """Blocks ``index`` of every layer, copied to host memory off the step's stream. Pageable,
        not pinned: the CPU tier keeps the chunk, and a tier of pinned (unswappable, rounded up
        by the caching host allocator) memory would hold more than its cap says."""
        if self.kv.device.type == "cpu":
            return self.kv.index_select(2, index)
        with off_step_stream(self.kv.device):
            return self.kv.index_select(2, index).cpu()

    def save_kv(self, metadata: TieredMetadata | None) -> None:
        if metadata is None:
            return
        if metadata.saves and timeline.enabled:
            timeline.mark("kv.saved", *sorted({save.key for save in metadata.saves}))
        for save in metadata.saves:
            # A copy now, while the blocks surely hold this chunk; everything slower happens later.
            index = torch.tensor(save.block_ids, dtype=torch.int64, device=self.kv.device)
            chunk = self._copy_out(index)
            events = self.events if save.names is not None else None
            if self._cpu_tier is not None:
                if events is not None:
                    events.expect(save.key, save.names, 1)
                try:
                    self._cpu_tier.put(save.key, chunk)  # in memory; its lock is never held across I/O
                finally:
                    if events is not None:
                        events.put_done(save.key)
            if not self._slow_tiers:
                continue
            nbytes = chunk.numel() * chunk.element_size()
            with self._lock:
                if self._pending_save_bytes + nbytes > MAX_PENDING_SAVE_BYTES:
                    self.skipped_saves += 1  # the slow tiers cannot keep up: skip, never block
                    continue
                self._pending_save_bytes += nbytes
            if events is not None:
                events.expect(save.key, save.names, self._published_slow)
            self._saves.put((save.key, chunk, events is not None))

    def get_finished(self) -> KVConnectorOutput:
        done, failed, traces = self.loads.take_with_traces()
        with self._lock:
            answers, self._answers = self._answers, {}
            sources, self._answer_sources = self._answer_sources, {}
            samples, self._samples = self._samples, []
        return KVConnectorOutput(finished_recving=done, failed_recving=set(failed), failure_reasons=failed,
                                 lookups=answers, kv_events=self.events.drain() if self.events else [],
                                 load_traces=traces, lookup_sources=sources, transfer_samples=samples)

    def _sample(self, source: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._samples.append((source, nbytes, seconds))

    def stats(self, read_used_bytes: bool = True) -> KVConnectorStats:
        """Never waits on a store: a slow tier's used_bytes is the saver's last reading (0 for
        every tier without ``read_used_bytes``: the engine's first figures, before any step)."""
        stats = {}
        for store in self.tiers.stores:
            s = store.stats
            if store.name in self._slow_used:
                used = self._slow_used[store.name]
            else:
                used = store.used_bytes() if read_used_bytes else 0
            stats[store.name] = {"hits": s.hits, "misses": s.misses, "bytes_stored": s.bytes_stored,
                                 "bytes_loaded": s.bytes_loaded, "used_bytes": used,
                                 "load_seconds": store.drain_load_seconds(), "rejected": dict(s.rejected)}
        return KVConnectorStats(stores=stats)

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

    # ---- lookup threads ------------------------------------------------------------------
    def _lookup_loop(self) -> None:
        for job in queued(self._lookup_jobs, self._stop):
            try:
                if isinstance(job, _UnpinJob):
                    self.tiers.unpin(job.keys)
                else:
                    self._lookup(job)
            except Exception:  # a store bug must not kill the thread: that lookup times out to a miss
                logger.exception("KV store lookup job raised")

    def _lookup(self, job: _LookupJob) -> None:
        req_id = job.lookup.req_id
        with self._lock:
            if self._asked.get(req_id) != job.ticket:
                return  # released or superseded while queued: no I/O for an unwanted answer
        keys = job.lookup.keys
        sources = self.tiers.lookup(keys)
        found = keys[:len(sources)]
        # Where the full chunks stop, the longest trailing chunk stored there.
        tails = job.lookup.tail_keys if len(found) == len(keys) else job.lookup.tails_at(len(found))
        tail_blocks = 0
        if tails:
            tail = self.tiers.longest_tail(tails)
            if tail is not None:
                found.append(tails[tail[0]])
                sources.append(tail[1])
                tail_blocks = len(tails) - tail[0]
        if found:
            self.tiers.pin(found)  # before the answer is visible: a load never finds them unpinned
        with self._lock:
            current = self._asked.get(req_id) == job.ticket
            if current:
                del self._asked[req_id]
                self._answers[req_id] = (len(found) - (tail_blocks > 0), tail_blocks)
                self._answer_sources[req_id] = sources
                if found:
                    self._leases[req_id] = found
        if found and not current:
            self.tiers.unpin(found)

    # ---- loader threads ------------------------------------------------------------------
    def _load_loop(self) -> None:
        for load in queued(self._loads, self._stop):
            keys = [chunk.key for chunk in load.chunks]
            self.tiers.pin(keys)  # from here to the end of the load, eviction cannot take them
            with self._lock:
                lease = self._leases.pop(load.req_id, None)  # the load's pins replace the lookup's
            if lease:
                self.tiers.unpin(lease)
            trace = KVLoadTrace("tiers", time.monotonic(), 0.0)
            try:
                error = self._load(load, trace)
            except Exception as exc:  # a store bug fails this load (it recomputes), never the loader
                logger.exception("KV store load for %s raised", load.req_id)
                error = f"error: {type(exc).__name__}: {exc}"
            finally:
                self.tiers.unpin(keys)
            trace.end = time.monotonic()
            if error is not None:
                trace.outcome, trace.error = error.split(":")[0], error
            self.loads.finish(load.req_id, error, trace)
            if error is not None and not error.startswith("cancelled"):
                logger.info("KV store load for %s fell short (%s); recomputing", load.req_id, error)

    def _fetch(self, load: TierLoad, key: str) -> tuple[torch.Tensor, str, float, bool] | None:
        """The chunk, its tier, the seconds that tier took, and whether it came at the first try
        (no wait for a promise)."""
        if self.loads.is_cancelled(load.req_id):
            return None
        found = self.tiers.load_from_tier(key)
        first_try = found is not None
        while found is None and time.monotonic() < load.wait_until and not self.loads.is_cancelled(load.req_id):
            time.sleep(0.005)  # promised by a prefill instance whose write is still on its way
            found = self.tiers.load_from_tier(key)
        return None if found is None else (*found, first_try)

    def _load(self, load: TierLoad, trace: KVLoadTrace) -> str | None:
        """Copies the load's chunks into its blocks, counting each chunk in ``trace`` by its tier."""
        for chunk in load.chunks:
            if self.loads.is_cancelled(load.req_id):
                return "cancelled: the request ended"
            start = time.perf_counter()
            found = self._fetch(load, chunk.key)
            if found is None:
                return f"miss: chunk {chunk.key[:12]} is in no tier (evicted, or never written)"
            kv, tier, seconds, first_try = found
            nbytes = len(chunk.block_ids) * kv[:, :, :1].numel() * kv.element_size()
            counted = trace.tiers.setdefault(tier, TierLoadTrace())
            tokens = len(chunk.block_ids) * kv.shape[3]
            counted.chunks, counted.tokens, counted.bytes, counted.seconds = (
                counted.chunks + 1, counted.tokens + tokens, counted.bytes + nbytes, counted.seconds + seconds)
            trace.tokens += tokens
            trace.bytes += nbytes
            if kv.shape[2] < chunk.first_block + len(chunk.block_ids):
                return f"miss: chunk {chunk.key[:12]} holds {kv.shape[2]} blocks, fewer than asked"
            src = list(range(chunk.first_block, chunk.first_block + len(chunk.block_ids)))
            with off_step_stream(self.kv.device):
                for s, d, n in contiguous_runs(src, chunk.block_ids):
                    self.kv[:, :, d:d + n].copy_(kv[:, :, s:s + n])
            # (A wait for a promised write says nothing about the tier's rate, nor does a read
            # the request stopped waiting for: its time is not what a load costs a request.)
            if first_try and not self.loads.is_cancelled(load.req_id):
                self._sample(tier, kv.numel() * kv.element_size(), time.perf_counter() - start)
        return None

    # ---- saver thread --------------------------------------------------------------------
    def _save_loop(self) -> None:
        while not self._stop.is_set():
            self._refresh_slow_used()
            try:
                key, chunk, described = self._saves.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                for store in self._slow_tiers:
                    stored, start = store.stats.bytes_stored, time.perf_counter()
                    store.put(key, chunk)
                    written = store.stats.bytes_stored - stored
                    if written > 0:  # a write that crossed (not skipped: a tier off, an entry there)
                        self._sample(store.name, written, time.perf_counter() - start)
            except Exception:  # a store bug must not kill the saver: log and go on
                logger.exception("KV store write of %s failed", key)
            finally:
                if described:
                    self.events.put_done(key, self._published_slow)
                with self._lock:
                    self._pending_save_bytes -= chunk.numel() * chunk.element_size()

    def _refresh_slow_used(self) -> None:
        now = time.monotonic()
        if now - self._slow_used_at < USED_BYTES_REFRESH_S:
            return
        self._slow_used_at = now
        for store in self._slow_tiers:
            try:
                self._slow_used[store.name] = store.used_bytes()
            except Exception:
                logger.exception("KV store %s: used_bytes failed", store.name)
