"""The connector seam: how KV enters and leaves an instance.

A connector has two halves built by role. The scheduler half decides and never does I/O:
it is asked at admission (match, after allocation), builds the step's metadata once (it
travels in ``SchedulerOutput``), and learns what the worker half did only from
``KVConnectorOutput`` (in ``ModelRunnerOutput``). The worker half moves bytes and never
decides; it belongs to the model runner. Without a configured connector the engine holds the
no-op connector, so neither side has ``if connector`` branches.
"""
from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine.kv_transfer.params import KVTransferParams
from engine.outputs import KVConnectorOutput, KVConnectorStats, SchedulerOutput
from engine.request import Request
from engine.request_trace import KVLoadTrace


def queued(jobs: queue.Queue, stop: threading.Event, idle: Callable[[], None] | None = None) -> Iterator[Any]:
    """The jobs of a worker thread, as they come, until ``stop`` is set (seen within 0.1 s);
    ``idle`` is called every 0.1 s without a job."""
    while not stop.is_set():
        try:
            yield jobs.get(timeout=0.1)
        except queue.Empty:
            if idle is not None:
                idle()


class LoadBook:
    """A worker half's account of its loads (P2P pulls, tier loads): those queued or running,
    those cancelled meanwhile, and results not yet reported. The engine thread submits and
    takes; loader threads check for cancels and finish."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outstanding: set[str] = set()
        self._cancelled: set[str] = set()
        self._done: set[str] = set()
        self._failed: dict[str, str] = {}
        self._traces: dict[str, KVLoadTrace] = {}

    def submit(self, req_ids: list[str], cancels: list[str]) -> None:
        with self._lock:
            # A cancel for a load that already finished is moot (and would linger).
            self._cancelled.update(r for r in cancels if r in self._outstanding)
            self._outstanding.update(req_ids)

    def is_cancelled(self, req_id: str) -> bool:
        return req_id in self._cancelled

    def finish(self, req_id: str, error: str | None, trace: KVLoadTrace | None = None) -> None:
        """The load of ``req_id`` is over: done (``error`` None) or failed, "<reason>: <detail>";
        ``trace``: what it took (reported with the result, for the request's trace)."""
        with self._lock:
            if trace is not None:
                self._traces[req_id] = trace
            self._cancelled.discard(req_id)
            self._outstanding.discard(req_id)
            if error is None:
                self._done.add(req_id)
            else:
                self._failed[req_id] = error

    def take(self) -> tuple[set[str], dict[str, str]]:
        """(loads done, loads failed with their reason) since the last call."""
        done, failed, _ = self.take_with_traces()
        return done, failed

    def take_with_traces(self) -> tuple[set[str], dict[str, str], dict[str, KVLoadTrace]]:
        """``take`` and the loads' traces, taken at once."""
        with self._lock:
            done, failed, traces = self._done, self._failed, self._traces
            self._done, self._failed, self._traces = set(), {}, {}
        return done, failed, traces


def contiguous_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs where both block lists advance by one: one copy each."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class KVConnectorScheduler(ABC):
    """Scheduler half. Never touches tensors or sockets."""

    # What the scheduler does when a load fails: "recompute" the prefill locally (the output
    # stays correct) or "fail" the request with an error.
    load_failure_policy: str = "recompute"
    # How long the kv_transfer_params this half hands out may be acted on.
    params_ttl_s: float = 60.0
    # Whether this instance can hand a prompt's KV on (a prefill instance, a KV store): only
    # then does a do_remote_decode request end after its first token.
    offers_kv: bool = False
    # The scheduler's block table (request id -> block ids), bound by the scheduler: read-only.
    block_ids_of: Callable[[str], list[int]] = staticmethod(lambda req_id: [])

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool] | None:
        """How many tokens after ``num_computed_tokens`` can be supplied from outside, and
        whether loading them is asynchronous (the request then waits in
        WAITING_FOR_REMOTE_KV). None: not known yet (the worker half is finding out); the
        request stays queued and is asked again next step, without holding up the queue.
        Must not do I/O, and must have no side effects the scheduler relies on: the
        allocation may still fail."""

    def request_queued(self, request: Request) -> None:
        """A request joined the waiting queue (before any get_num_new_matched_tokens for it)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        """Blocks were allocated: ``block_ids`` hold the local prefix hit (``num_local_tokens``)
        followed by room for the ``num_external_tokens`` to fill."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """Once per step: what the worker half must load or save. Resets per-step state."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        """A request finished. Returns (hold the blocks until the worker reports the send
        done, kv_transfer_params to hand back to the client or proxy; unsigned: the engine
        adds the first tokens and signs them)."""

    def num_tracked_requests(self) -> int:
        """Requests this half keeps state for (0 when the engine is idle: anything else leaks)."""
        return 0

    def transfer_done(self, req_id: str, failed: bool = False) -> None:
        """The worker half finished (``failed``: gave up on) the load of ``req_id``."""

    def send_done(self, req_id: str) -> None:
        """The worker half no longer reads the held blocks of ``req_id``."""

    def withdraw(self, req_id: str) -> bool:
        """The KV a finished request offered is not wanted after all (its first token ended it).
        True if the worker half must let go first (the blocks stay held until ``send_done``)."""
        return False

    def release_peer(self, params: KVTransferParams) -> bool:
        """A peer's hand-off (signed parameters, checked by the caller) that this instance will
        not pull, because it refused the request: tell the peer to free that KV now rather than
        at its lease's end. True if a release goes out."""
        return False

    def has_pending_metadata(self) -> bool:
        """Work queued for the worker half outside a step's plan (a release, a cancel): the
        engine runs another step to deliver it."""
        return False

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Once per step, before the scheduler applies finished transfers: everything else
        the worker half learnt (lookup answers, say)."""


def allocate_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                       path: str | None = None) -> torch.Tensor:
    """The zero-filled paged KV tensor (zeroed, not empty: padded attention reads stale but
    finite values, never NaN), in private memory or mapped from the file at ``path``. A file
    maps host memory only: asking for one on another device is a bug of the connector."""
    if path is not None and device.type != "cpu":
        raise ValueError(f"a KV tensor mapped from a file lives in host memory, not on {device}")
    if path is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for dim in shape:
        numel *= dim
    kv = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    kv.zero_()  # commit the pages now, so no forward pass pays for page faults
    return kv


class KVConnectorWorker(ABC):
    """Worker half: moves bytes between the paged KV tensors and the outside."""

    def kv_cache_file(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> str | None:
        """Where the model runner should keep the paged KV tensor: a file of its size that
        peers can map, or None for private memory."""
        return None

    def register_kv_caches(self, kv_caches: Any) -> None:
        """Called once with the paged KV tensors after they are allocated."""

    def start_load_kv(self, metadata: Any) -> None:
        """Before the forward pass: start or finish loads the metadata asks for (and learn what
        the step will offer or save)."""

    def save_kv(self, metadata: Any) -> None:
        """After the step, once its outputs are sent (ModelRunner.save_kv): make the offers and
        start the saves the metadata asks for; the blocks still hold what the step computed.
        Never called for a step that raised."""

    def get_finished(self) -> KVConnectorOutput:
        """Transfers that completed (or failed) since the last call."""
        return KVConnectorOutput()

    def shutdown(self) -> None:
        pass

    def stats(self) -> KVConnectorStats:
        """The counters, read by the model runner after every get_finished (see KVConnectorStats).
        Never waits on a peer or a store."""
        return KVConnectorStats()


class NoOpConnectorScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        return False, None


class NoOpConnectorWorker(KVConnectorWorker):
    pass
