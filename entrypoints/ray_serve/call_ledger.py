"""The calls each replica holds, for the KV-aware Serve router's load
(entrypoints/ray_serve/router.py): generation calls chosen and not yet accepted, and calls
accepted and not yet completed, by request id.

Serve reports a call's life in these hooks, all with the request's internal id: choose_replicas
(again after a rejection or a backoff), on_request_routed (the replica accepted it) and
on_request_completed (once per call sent, a rejected one too, possibly before Serve reports the
same call routed). The ingress's calls for one HTTP request share its id: its /tokenize call,
then its generation call, to the same deployment. So a call is known by (id, replica), and a
completion closes the call it can only be: a /tokenize call open there before the generation
call (the ingress awaits it first).

Counting by id keeps the load right in the orders seen here: a choice Serve sent to another replica
(its first choice did not answer the queue probe in time) moves there when the call is routed;
a rejected call's completion does not close the request's later call elsewhere. Only
generation calls count: a /tokenize call holds no engine capacity, and its completion racing
its own request's generation choice made the replica it went to look busy.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Hashable

GENERATION, OTHER = "generation", "other"
CHOICE_EXPIRY_S = 2.0  # a choice neither routed nor completed by then was cancelled or lost
# A completion Serve never reports routed (a rejection's) is forgotten by then. Until then, the
# request's next call accepted by the same replica is taken for the completed one, and goes
# uncounted: a replica that rejected a call (it was full) takes the retry only once it has room.
# A shorter wait would leak a call that Serve reports routed later than that for ever.
EARLY_EXPIRY_S = 10.0


class CallLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._chosen: dict[str, tuple[Hashable, float]] = {}  # id -> (replica, when): generation calls
        self._open: dict[tuple[str, Hashable], list[str]] = {}  # (id, replica) -> kinds of calls open
        # Completions of calls not reported routed yet: (id, replica) -> when, oldest first.
        self._completed_early: dict[tuple[str, Hashable], list[float]] = {}

    def chosen(self, request_id: str, replica: Hashable) -> None:
        """The router chose ``replica`` for the request's generation call (replacing any earlier
        choice: Serve asks again after a rejection)."""
        self._chosen[request_id] = (replica, self._clock())

    def routed(self, request_id: str, replica: Hashable, kind: str) -> None:
        """``replica`` accepted the call: open there until its completion."""
        if kind == GENERATION:
            self._chosen.pop(request_id, None)
        self._forget_old_completions()
        early = self._completed_early.get((request_id, replica))
        if early:  # it completed already
            early.pop(0)
            if not early:
                del self._completed_early[(request_id, replica)]
            return
        self._open.setdefault((request_id, replica), []).append(kind)

    def completed(self, request_id: str, replica: Hashable) -> None:
        """A call of the request to ``replica`` ended (answered, failed, cancelled or rejected)."""
        key = (request_id, replica)
        kinds = self._open.get(key)
        if kinds:
            kinds.remove(OTHER if OTHER in kinds else kinds[0])
            if not kinds:
                del self._open[key]
            return
        # Not routed (yet): a rejection, or a short call whose completion came first. A
        # generation call, since /tokenize is reported routed before the ingress goes on.
        if self._chosen.get(request_id, (None,))[0] == replica:
            del self._chosen[request_id]
        self._forget_old_completions()
        self._completed_early.setdefault(key, []).append(self._clock())

    def _forget_old_completions(self) -> None:
        old = self._clock() - EARLY_EXPIRY_S
        self._completed_early = {k: kept for k, times in self._completed_early.items()
                                 if (kept := [t for t in times if t > old])}

    def loads(self) -> Counter:
        """Generation calls each replica holds: accepted and open, or chosen within CHOICE_EXPIRY_S."""
        fresh = self._clock() - CHOICE_EXPIRY_S
        for request_id in [i for i, (_, t) in self._chosen.items() if t < fresh]:
            del self._chosen[request_id]
        load = Counter(r for r, _ in self._chosen.values())
        for (_, replica), kinds in self._open.items():
            load[replica] += kinds.count(GENERATION)
        return load

    def keep_only(self, replicas: set) -> None:
        """Forgets the calls of replicas Serve removed (scaled down, dead)."""
        self._chosen = {i: c for i, c in self._chosen.items() if c[0] in replicas}
        self._open = {k: v for k, v in self._open.items() if k[1] in replicas}
        self._completed_early = {k: v for k, v in self._completed_early.items() if k[1] in replicas}
