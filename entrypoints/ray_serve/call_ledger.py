"""The calls each replica holds, for the KV-aware Serve router's load
(entrypoints/ray_serve/router.py): generation calls chosen and not yet sent, and calls sent and
not yet completed, by request id.

The router reports a call's life from Serve's path for ``handle.remote()``
(serve/_private/router.py, _route_and_send_request_once): choose_replicas (again while no
replica answers the queue probe, and after a rejection), the send (to the replica Serve's
_choose_replica_for_request returned: the choice, or another rank when the choice missed its
probe) and on_request_completed (exactly once per send: an answer, a failure, a cancel, a
rejection; posted onto the router's loop from another thread, so possibly long after the
request's next send). The ingress's
calls for one HTTP request share its internal id: its /tokenize call, then its generation call,
to the same deployment. So a call is known by (id, replica), and a completion closes a
/tokenize call open there before a generation call (the ingress awaited it first).

Only generation calls count: a /tokenize call holds no engine capacity. A call counts from its
send to its completion, a rejected one too (its replica is full) until Serve reports it.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Hashable

GENERATION, OTHER = "generation", "other"
CHOICE_EXPIRY_S = 2.0  # a choice not sent by then was cancelled, or its replica went to another request


class CallLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._chosen: dict[str, tuple[Hashable, float]] = {}  # id -> (replica, when): generation calls
        self._open: dict[tuple[str, Hashable], list[str]] = {}  # (id, replica) -> kinds of calls sent, not completed

    def chosen(self, request_id: str, replica: Hashable) -> None:
        """The router chose ``replica`` for the request's generation call (replacing any earlier
        choice of the request)."""
        self._chosen[request_id] = (replica, self._clock())

    def sent(self, request_id: str, replica: Hashable, kind: str) -> None:
        """Serve sent a call of the request to ``replica``: open there until its completion."""
        if kind == GENERATION:
            self._chosen.pop(request_id, None)
        self._open.setdefault((request_id, replica), []).append(kind)

    def completed(self, request_id: str, replica: Hashable) -> None:
        """A call of the request to ``replica`` ended (answered, failed, cancelled or rejected)."""
        key = (request_id, replica)
        kinds = self._open.get(key)
        if not kinds:
            return  # sent to a replica forgotten since (keep_only)
        kinds.remove(OTHER if OTHER in kinds else GENERATION)
        if not kinds:
            del self._open[key]

    def loads(self, excluding: str | None = None) -> Counter:
        """Generation calls each replica holds: sent and open, or chosen within CHOICE_EXPIRY_S
        and not sent yet, but for ``excluding``'s own choice (the request choosing again)."""
        fresh = self._clock() - CHOICE_EXPIRY_S
        for request_id in [i for i, (_, t) in self._chosen.items() if t < fresh]:
            del self._chosen[request_id]
        load = Counter(r for i, (r, _) in self._chosen.items() if i != excluding)
        for (_, replica), kinds in self._open.items():
            load[replica] += kinds.count(GENERATION)
        return load

    def keep_only(self, replicas: set) -> None:
        """Forgets the calls of replicas Serve removed (scaled down, dead)."""
        self._chosen = {i: c for i, c in self._chosen.items() if c[0] in replicas}
        self._open = {k: v for k, v in self._open.items() if k[1] in replicas}
