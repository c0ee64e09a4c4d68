"""KV-aware routing as a Ray Serve request router (``engine ray-serve --routing kv-aware``):
engine proxy's policy (entrypoints/kv_router.py: the instance holding most of the prompt's KV,
from the replicas' KV events, traded against load) over Ray's replica set.

Serve builds this router in every process that calls the deployment through a handle; the
ingress registers its KVRouter (which follows the replicas' KV events with the deployment
secret) in its own process under the deployment's name, and passes each request's prompt
blocks as the ``prompt_blocks`` keyword. Each replica names its engine's URL and event
endpoints in its routing stats (EngineReplica.record_routing_stats). Load is this router's own
count of calls open on each replica, from its choice to its completion. Where no KVRouter is
registered (another caller of the deployment), or a request carries no prompt blocks, the least
loaded replica is chosen.
"""
from __future__ import annotations

import importlib
import itertools
import time
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from entrypoints.kv_router import KVRouter

CHOSEN_EXPIRY_S = 2.0  # a choice not sent by then went elsewhere
_REGISTERED: dict[str, KVRouter] = {}  # deployment name -> the KVRouter of this process


def register(deployment: str, router: KVRouter) -> None:
    _REGISTERED[deployment] = router


@dataclass
class _Candidate:  # what KVRouter.choose reads
    url: str
    in_flight: int
    replica: RunningReplica


class KVAwareRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        # Calls sent to each replica and not completed. Counted at the send, which Serve reports
        # before it registers the completion callback: a short call's completion can arrive
        # before Serve reports it routed (on_request_routed), which left it counted for ever.
        self._open: dict[ReplicaID, int] = {}
        # Choices not sent yet (monotonic times), counted as open too: Serve sends a call some
        # awaits after choose_replicas, and the calls chosen meanwhile must see it. The send
        # takes the oldest; one Serve sent elsewhere (the replica was full) expires.
        self._chosen: dict[ReplicaID, list[float]] = {}
        self._followed: dict[str, dict | None] = {}  # url -> the events it was followed with
        self._counted: set[str] = set()  # requests counted in the KVRouter's hit statistics, until routed
        # Ties in load go round robin, a turn counter per kind of call (engine proxy's
        # ``ordered``): a request's /tokenize call (no ``prompt_blocks``) comes before each of
        # its generation calls, and one shared counter would give those every other turn only.
        self._turns = {kind: itertools.count() for kind in ("generation", "other")}

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
        live = {r.replica_id for r in replicas}
        for gone in [r for r in self._open if r not in live]:  # removed by Serve (scaled down, dead)
            del self._open[gone]
        for gone in [r for r in self._chosen if r not in live]:
            del self._chosen[gone]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._follow(candidate_replicas)  # routing stats arrive after the replica set
        kwargs = pending_request.kwargs if pending_request is not None else {}
        candidates = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        start = next(self._turns["generation" if "prompt_blocks" in kwargs else "other"]) % max(len(candidates), 1)
        by_load = sorted((_Candidate((r.routing_stats or {}).get("url", ""), self._load(r.replica_id), r)
                          for r in candidates[start:] + candidates[:start]), key=lambda c: c.in_flight)
        kv = self._kv
        prompt = kwargs.get("prompt_blocks")
        if not by_load:
            return []
        if kv is None or prompt is None:
            best = by_load[0]
        else:
            best, hit = kv.choose(by_load, prompt)
            request_id = pending_request.metadata.internal_request_id
            if request_id not in self._counted:  # asked again after a backoff: counted once
                self._counted.add(request_id)
                kv.count(best.url, prompt, hit)
        self._chosen.setdefault(best.replica.replica_id, []).append(time.monotonic())
        return [[best.replica], [c.replica for c in by_load if c is not best]]

    def _load(self, replica_id: ReplicaID) -> int:
        chosen = self._chosen.get(replica_id)
        if chosen:
            fresh = time.monotonic() - CHOSEN_EXPIRY_S
            while chosen and chosen[0] < fresh:
                chosen.pop(0)
        return self._open.get(replica_id, 0) + len(chosen or ())

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._open[replica_id] = self._open.get(replica_id, 0) + 1
        chosen = self._chosen.get(replica_id)
        if chosen:
            chosen.pop(0)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._counted.discard(pending_request.metadata.internal_request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Every call sent through a handle's .remote() completes once (a replica's rejection,
        # a cancelled stream and a dead replica too). Serve also reports a call that failed
        # before it was sent: never below zero.
        self._open[replica_id] = max(0, self._open.get(replica_id, 0) - 1)
        self._counted.discard(internal_request_id)
