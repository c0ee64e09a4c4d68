"""KV-aware routing as a Ray Serve request router (``engine ray-serve --routing kv-aware``):
engine proxy's policy (entrypoints/kv_router.py: the instance holding most of the prompt's KV,
from the replicas' KV events, traded against load) over Ray's replica set.

Serve builds this router in every process that calls the deployment through a handle; the
ingress registers its KVRouter (which follows the replicas' KV events with the deployment
secret) in its own process under the deployment's name, and passes each request's prompt
blocks as the ``prompt_blocks`` keyword. Each replica names its engine's URL and event
endpoints in its routing stats (EngineReplica.record_routing_stats). Load is this router's own
count of generation calls on each replica, from the choice to the completion
(entrypoints/ray_serve/call_ledger.py). A call's send is read where handle.remote()'s path
(Serve's Router._route_and_send_request_once) makes it: the replica Serve's private
RequestRouter._choose_replica_for_request returned (setup.py pins Serve), once Serve reports a
send to it (on_send_request, with no await in between; tests/test_ray_router.py checks Serve's
source for that). Sends through Serve's reservation API (choose_replica, dispatch) are not
counted, only their choices. Where no KVRouter is registered (another caller of the
deployment), or a request carries no prompt blocks, the least loaded replica is chosen.
"""
from __future__ import annotations

import asyncio
import importlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from entrypoints.kv_router import KVRouter
from entrypoints.ray_serve.call_ledger import GENERATION, OTHER, CallLedger

if not hasattr(RequestRouter, "_choose_replica_for_request"):  # where the sends are read
    raise ImportError("this Ray Serve has no RequestRouter._choose_replica_for_request: "
                      "install the version setup.py pins (pip install 'engine[ray]')")

_REGISTERED: dict[str, KVRouter] = {}  # deployment name -> the KVRouter of this process
# Requests whose hit is counted (once, whatever Serve's retries), until a replica accepts one of
# their generation calls; the oldest are dropped beyond this (a request cancelled while routed).
MAX_COUNTED = 4096


def register(deployment: str, router: KVRouter) -> None:
    _REGISTERED[deployment] = router


@dataclass
class _Candidate:  # what KVRouter.choose reads
    url: str
    in_flight: int
    replica: RunningReplica


class KVAwareRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._calls = CallLedger()
        self._followed: dict[str, dict | None] = {}  # url -> the events it was followed with
        self._counted: OrderedDict[str, None] = OrderedDict()  # see MAX_COUNTED
        # The call Serve is about to send, and the task that asked for its replica.
        self._returned: tuple[str, ReplicaID, str, asyncio.Task | None] | None = None
        # Ties in load go round robin, a turn counter per kind of call (engine proxy's
        # ``ordered``): a request's /tokenize call (no ``prompt_blocks``) comes before each of
        # its generation calls, and one shared counter would give those every other turn only.
        self._turns = {kind: itertools.count() for kind in (GENERATION, OTHER)}

    @property
    def _kv(self) -> KVRouter | None:
        # Serve ships this class to the calling process by value, with copies of this module's
        # globals: the registry that counts is the one of the module the ingress imported.
        return importlib.import_module(__name__)._REGISTERED.get(self._deployment_id.name)

    def _follow(self, replicas: list[RunningReplica]) -> None:
        kv = self._kv
        if kv is None:
            return
        live = set()
        for replica in replicas:
            stats = replica.routing_stats or {}
            url = stats.get("url")
            if not isinstance(url, str):
                continue  # its first stats are not in yet
            live.add(url)
            if "kv_events" not in stats:
                continue  # its engine did not answer this time: keep following what we followed
            if url not in self._followed or self._followed[url] != stats.get("kv_events"):
                kv.watch(url, stats.get("kv_events"))
                self._followed[url] = stats.get("kv_events")
        for url in [u for u in self._followed if u not in live and replicas]:
            kv.forget(url)
            del self._followed[url]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._follow(replicas)
        self._calls.keep_only({r.replica_id for r in replicas})

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._follow(candidate_replicas)  # routing stats arrive after the replica set
        kwargs = pending_request.kwargs if pending_request is not None else {}
        candidates = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        kind = _kind(kwargs)
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        start = next(self._turns[kind]) % max(len(candidates), 1)
        load = self._calls.loads(excluding=request_id)
        by_load = sorted((_Candidate((r.routing_stats or {}).get("url", ""), load[r.replica_id], r)
                          for r in candidates[start:] + candidates[:start]), key=lambda c: c.in_flight)
        kv = self._kv
        prompt = kwargs.get("prompt_blocks")
        if not by_load:
            return []
        if kv is None or prompt is None:
            best = by_load[0]
        else:
            best, hit = kv.choose(by_load, prompt)
            if request_id not in self._counted:  # chosen again (no probe answered, a rejection)
                self._counted[request_id] = None
                if len(self._counted) > MAX_COUNTED:
                    self._counted.popitem(last=False)
                kv.count(best.url, prompt, hit)
        if kind == GENERATION and request_id is not None:
            self._calls.chosen(request_id, best.replica.replica_id)
        return [[best.replica], [c.replica for c in by_load if c is not best]]

    async def _choose_replica_for_request(self, pending_request: PendingRequest, *,
                                          is_retry: bool = False) -> RunningReplica:
        replica = await super()._choose_replica_for_request(pending_request, is_retry=is_retry)
        self._returned = (pending_request.metadata.internal_request_id, replica.replica_id,
                          _kind(pending_request.kwargs), asyncio.current_task())
        return replica

    def on_send_request(self, replica_id: ReplicaID) -> None:
        # handle.remote()'s path: the call just returned for, sent by the same task; Serve reports
        # its completion exactly once. (A broadcast sends from another task, and a reservation's
        # choice is never reported sent.)
        super().on_send_request(replica_id)
        returned, self._returned = self._returned, None
        if returned is not None and returned[1] == replica_id and returned[3] is asyncio.current_task():
            self._calls.sent(*returned[:3])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._counted.pop(pending_request.metadata.internal_request_id, None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._returned is not None and self._returned[:2] == (internal_request_id, replica_id):
            self._returned = None  # its send failed (Serve reports that call completed instead)
        self._calls.completed(internal_request_id, replica_id)


def _kind(kwargs: dict) -> str:
    """Generation calls carry the prompt's blocks (None where unknown); /tokenize calls none."""
    return GENERATION if "prompt_blocks" in kwargs else OTHER
