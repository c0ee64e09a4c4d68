"""The KV-aware Serve request router's own load count (entrypoints/ray_serve/router.py), driven
through Serve's own routing path (RequestRouter._choose_replica_for_request: choose_replicas,
queue probes, ranks, retries), as handle.remote() drives it, with replicas that answer the
probes here instead of actors: calls open per replica, ties in turn.

Skipped with the reason when Ray is not installed (pip install 'engine[ray]'); CI installs it."""
from __future__ import annotations

import asyncio
import inspect
import re
import time

import pytest

pytest.importorskip("ray.serve", reason="needs Ray: pip install 'engine[ray]'")

from ray.serve._private.common import (DeploymentHandleSource, DeploymentID, ReplicaID,  # noqa: E402
                                       RequestMetadata)
from ray.serve._private.request_router.common import PendingRequest  # noqa: E402
from ray.serve._private.router import AsyncioRouter  # noqa: E402

from entrypoints.ray_serve.router import KVAwareRequestRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="decode", app_name="app")


class _Replica:
    """What Serve's RequestRouter reads of a replica: its id, its limit, its queue probe."""

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.routing_stats = {"url": f"http://{name}"}
        self.max_ongoing_requests = 8
        self.probe_delay_s = 0.0  # past Serve's deadline (0.1 s): the probe is missed

    async def get_queue_len(self, *, deadline_s: float) -> int:
        await asyncio.sleep(self.probe_delay_s)
        return 0


def _pending(request_id: str, generation: bool = True) -> PendingRequest:
    """A generation call carries the prompt's blocks (None: not known); a /tokenize call none."""
    return PendingRequest(args=[], kwargs={"prompt_blocks": None} if generation else {},
                          metadata=RequestMetadata(request_id=request_id, internal_request_id=request_id))


def test_generation_calls_count_from_send_to_completion_whatever_serve_does(monkeypatch):
    """Each request's /tokenize call, then its generation call (one internal request id for
    both): a generation call counts from its choice to its completion, on the replica Serve
    sent it to; /tokenize calls do not count. Idle replicas take turns; a replica with a
    generation call open is passed over while another has none."""
    async def run() -> None:
        router = KVAwareRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        a, b = _Replica("a"), _Replica("b")
        replicas = {"a": a, "b": b}
        router.update_replicas([a, b])
        ids = iter(range(1000))

        async def sent(call: PendingRequest, is_retry: bool = False) -> str:
            """As handle.remote()'s path sends a call (see the test below)."""
            replica = await router._choose_replica_for_request(call, is_retry=is_retry)
            router.on_send_request(replica.replica_id)
            return replica.replica_id.unique_id

        async def chosen(request_id: str) -> str:
            """A choice Serve has not sent yet (its queue probe still out)."""
            ranks = await router.choose_replicas([a, b], _pending(request_id))
            return ranks[0][0].replica_id.unique_id

        def completed(request_id: str, name: str) -> None:
            router.on_request_completed(replicas[name].replica_id, request_id)

        async def short_request() -> str:
            request_id = f"short-{next(ids)}"
            completed(request_id, await sent(_pending(request_id, generation=False)))
            name = await sent(_pending(request_id))
            completed(request_id, name)
            return name

        def loads() -> tuple[int, int]:
            load = router._calls.loads()
            return load[a.replica_id], load[b.replica_id]

        assert sorted([await short_request() for _ in range(4)]) == ["a", "a", "b", "b"]  # both idle: turns
        assert loads() == (0, 0)
        # A stream open on one replica: every choice is the other until it completes.
        streamed_on = await sent(_pending("stream"))
        other = "b" if streamed_on == "a" else "a"
        assert [await short_request() for _ in range(3)] == [other] * 3
        completed("stream", streamed_on)
        assert sorted([await short_request() for _ in range(4)]) == ["a", "a", "b", "b"]
        # The CI failure: b is chosen but misses its queue probe, so Serve sends the call to a
        # (the next rank). a holds it, and the next stream goes to b.
        b.probe_delay_s = 1.0
        assert [await sent(_pending(f"probe-missed-{n}")) for n in range(2)] == ["a", "a"]
        b.probe_delay_s = 0.0
        assert loads() == (2, 0)
        assert await sent(_pending("next")) == "b"
        for request_id, name in (("probe-missed-0", "a"), ("probe-missed-1", "a"), ("next", "b")):
            completed(request_id, name)
        # A request's /tokenize call whose completion comes after its generation call was sent
        # elsewhere: the /tokenize call's replica stays idle for the next request.
        b.probe_delay_s = 1.0
        assert await sent(_pending("late", generation=False)) == "a"
        a.probe_delay_s, b.probe_delay_s = 1.0, 0.0
        assert await sent(_pending("late")) == "b"
        a.probe_delay_s = 0.0
        assert await sent(_pending("after")) == "a"
        completed("after", "a")
        completed("late", "a")
        assert loads() == (0, 1)
        completed("late", "b")
        # A replica rejects a call (it was full), and accepts Serve's retry of it: the retry
        # counts until its completion, whenever the rejection's completion is reported.
        call = _pending("rejected")
        first = await sent(call)
        replicas["b" if first == "a" else "a"].probe_delay_s = 1.0  # (the other is not free either)
        assert await sent(call, is_retry=True) == first
        a.probe_delay_s = b.probe_delay_s = 0.0
        completed("rejected", first)  # the rejection's, reported late
        assert loads() == ((1, 0) if first == "a" else (0, 1))
        completed("rejected", first)
        assert loads() == (0, 0)
        # Choices Serve has not sent yet count: concurrent requests chosen before any send
        # spread over the replicas; a request's own choice does not count against it when it
        # is chosen again; a choice never sent (the request was cancelled) expires.
        assert sorted([await chosen(f"burst-{n}") for n in range(4)]) == ["a", "a", "b", "b"]
        assert loads() == (2, 2)
        assert router._calls.loads(excluding="burst-0") in ({a.replica_id: 1, b.replica_id: 2},
                                                            {a.replica_id: 2, b.replica_id: 1})
        burst_0_on = await sent(_pending("burst-0"))
        # A replica returned but never sent to (Serve's reservation API) counts as its choice
        # only, also when another task (a broadcast) next reports a send to that replica.
        reserved = await router._choose_replica_for_request(_pending("reserved"))
        assert sum(loads()) == 5

        async def broadcast_send() -> None:
            router.on_send_request(reserved.replica_id)
        await asyncio.create_task(broadcast_send())
        assert sum(loads()) == 5
        monkeypatch.setattr(router._calls, "_clock", lambda: time.monotonic() + 10)
        assert loads() == ((1, 0) if burst_0_on == "a" else (0, 1))
        completed("burst-0", burst_0_on)
        # Replicas Serve removed are forgotten.
        on = await sent(_pending("removed"))
        router.update_replicas([replicas["b" if on == "a" else "a"]])
        assert loads() == (0, 0)

    asyncio.run(run())


def test_serve_sends_to_the_replica_it_was_given_before_anything_else_runs():
    """The router takes a call as sent to the replica _choose_replica_for_request returned when
    Serve next reports a send (on_send_request): true only while handle.remote()'s path sends
    in between with no await. Serve's source (pinned in setup.py) is read for that, so a Serve
    that changes it fails here rather than miscounting."""
    source = inspect.getsource(AsyncioRouter._route_and_send_request_once)
    between = re.search(r"_choose_replica_for_request\((.*?)on_send_request\(", source, re.S)
    assert between and "await" not in between.group(1).split(")", 1)[1], between
    assert "try_send_request" in between.group(1)
