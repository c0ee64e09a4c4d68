"""Two connectors in one instance: P2P disaggregation with the KV store tiers behind it.

``--role prefill|decode`` with ``--kv-store``: a prefill instance offers its prompt's KV to the
decode instance over pyzmq *and* writes it to the tiers (as every tiered instance does); a
decode instance pulls from the prefill first, and when that fails (the prefill died, its lease
ended) it looks the prompt up in the tiers before it recomputes. Each request's load belongs
to the one connector that offered it; everything else (saves, releases, stats) goes to both.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from engine.kv_transfer.params import KVTransferParams
from engine.outputs import KVConnectorOutput, KVConnectorStats, SchedulerOutput
from engine.request import Request


@dataclass(slots=True)
class MultiMetadata:
    parts: list[Any]  # one per connector, in order


class MultiConnectorScheduler(KVConnectorScheduler):
    """Asks its connectors in order; the first that can supply KV for a request loads it."""

    def __init__(self, connectors: list[KVConnectorScheduler]) -> None:
        self.connectors = connectors
        self.load_failure_policy = connectors[0].load_failure_policy
        self.params_ttl_s = connectors[0].params_ttl_s
        self.offers_kv = any(c.offers_kv for c in connectors)
        self._loader: dict[str, KVConnectorScheduler] = {}  # request -> the connector of its admission's load

    @property
    def block_ids_of(self) -> Callable[[str], list[int]]:
        return self.connectors[0].block_ids_of

    @block_ids_of.setter
    def block_ids_of(self, table: Callable[[str], list[int]]) -> None:
        for connector in self.connectors:
            connector.block_ids_of = table

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool] | None:
        for connector in self.connectors:
            match = connector.get_num_new_matched_tokens(request, num_computed_tokens)
            if match is None or match[0] > 0:
                # Not known yet (ask again next step), or this one supplies it.
                if match is not None:
                    self._loader[request.request_id] = connector
                return match
        self._loader.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        loader = self._loader.get(request.request_id) if num_external_tokens else None
        if loader is None:
            self._loader.pop(request.request_id, None)
        for connector in self.connectors:
            if connector is loader:
                connector.update_state_after_alloc(request, block_ids, num_local_tokens, num_external_tokens)
            else:  # to the others the loaded tokens are as good as local (the tiers need not save them)
                connector.update_state_after_alloc(request, block_ids, num_local_tokens + num_external_tokens, 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiMetadata:
        return MultiMetadata([c.build_connector_meta(scheduler_output) for c in self.connectors])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        self._loader.pop(request.request_id, None)
        hold, params = False, None
        for connector in self.connectors:
            held, given = connector.request_finished(request, block_ids)
            hold |= held
            params = params or given  # the first connector's (P2P's): a decode looks the tiers up itself
        return hold, params

    def num_tracked_requests(self) -> int:
        return len(self._loader) + sum(c.num_tracked_requests() for c in self.connectors)

    def transfer_done(self, req_id: str, failed: bool = False) -> None:
        for connector in self.connectors:
            connector.transfer_done(req_id, failed)

    def send_done(self, req_id: str) -> None:
        for connector in self.connectors:
            connector.send_done(req_id)

    def withdraw(self, req_id: str) -> bool:
        return any([c.withdraw(req_id) for c in self.connectors])

    def request_queued(self, request: Request) -> None:
        for connector in self.connectors:
            connector.request_queued(request)

    def release_peer(self, params: KVTransferParams) -> bool:
        return any([c.release_peer(params) for c in self.connectors])

    def has_pending_metadata(self) -> bool:
        return any(c.has_pending_metadata() for c in self.connectors)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for connector in self.connectors:
            connector.update_connector_output(output)


class MultiConnectorWorker(KVConnectorWorker):
    """The worker halves, in the scheduler half's order. The first places the KV cache and
    reports transfers; the tiers report store stats."""

    def __init__(self, workers: list[KVConnectorWorker]) -> None:
        self.workers = workers

    def kv_cache_file(self, shape, dtype: torch.dtype, device: torch.device) -> str | None:
        return self.workers[0].kv_cache_file(shape, dtype, device)

    def register_kv_caches(self, kv_caches: Any) -> None:
        for worker in self.workers:
            worker.register_kv_caches(kv_caches)

    def _with_parts(self, metadata: MultiMetadata | None):
        return zip(self.workers, metadata.parts if metadata is not None else [None] * len(self.workers))

    def start_load_kv(self, metadata: MultiMetadata | None) -> None:
        for worker, part in self._with_parts(metadata):
            worker.start_load_kv(part)

    def save_kv(self, metadata: MultiMetadata | None) -> None:
        for worker, part in self._with_parts(metadata):
            worker.save_kv(part)

    def get_finished(self) -> KVConnectorOutput:
        merged = KVConnectorOutput()
        for out in (w.get_finished() for w in self.workers):
            merged.finished_sending |= out.finished_sending
            merged.finished_recving |= out.finished_recving
            merged.failed_recving |= out.failed_recving
            merged.failure_reasons.update(out.failure_reasons)
            merged.lookups.update(out.lookups)
            merged.lookup_sources.update(out.lookup_sources)
            merged.transfer_samples += out.transfer_samples
            merged.kv_events += out.kv_events
            merged.load_traces.update(out.load_traces)
        return merged

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()

    def stats(self) -> KVConnectorStats:
        merged = self.workers[0].stats()
        for worker in self.workers[1:]:
            merged.stores.update(worker.stats().stores)
        return merged
