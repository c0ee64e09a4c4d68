"""The KV-aware Serve request router's own load count (entrypoints/ray_serve/router.py), driven
the way Serve's router calls it, without a cluster: calls open per replica, ties in turn.

Skipped with the reason when Ray is not installed (pip install 'engine[ray]'); CI installs it."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="needs Ray: pip install 'engine[ray]'")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

from entrypoints.ray_serve.router import KVAwareRequestRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="decode", app_name="app")


def _replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(name, DEPLOYMENT), routing_stats={"url": f"http://{name}"})


def _call(request_id: str, generation: bool = True) -> SimpleNamespace:
    """A generation call carries the prompt's blocks (None: not known); a /tokenize call none."""
    return SimpleNamespace(metadata=SimpleNamespace(internal_request_id=request_id),
                           kwargs={"prompt_blocks": None} if generation else {})


def test_generation_calls_count_whatever_order_serve_reports_them_in(monkeypatch):
    """Each request's /tokenize call, then its generation call, as Serve reports them (one
    internal request id for both): a generation call counts from its choice to its
    completion, on the replica that accepted it; /tokenize calls do not count. Idle replicas
    take turns; a replica with a generation call open is passed over while another has none."""
    async def run() -> None:
        router = KVAwareRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        a, b = _replica("a"), _replica("b")
        replicas = {"a": a, "b": b}
        ids = iter(range(1000))

        async def chosen(request_id: str, generation: bool = True) -> str:
            ranks = await router.choose_replicas([a, b], _call(request_id, generation))
            return ranks[0][0].replica_id.unique_id

        def routed(request_id: str, name: str, generation: bool = True) -> None:
            router.on_request_routed(_call(request_id, generation), replicas[name].replica_id, None)

        def completed(request_id: str, name: str) -> None:
            router.on_request_completed(replicas[name].replica_id, request_id)

        async def short_request() -> str:
            """A /tokenize call, then a short generation call whose completion Serve reports
            before its routing (the replica's answer came before its acceptance)."""
            request_id = f"short-{next(ids)}"
            tokenized_on = await chosen(request_id, generation=False)
            routed(request_id, tokenized_on, generation=False)
            completed(request_id, tokenized_on)
            name = await chosen(request_id)
            completed(request_id, name)
            routed(request_id, name)
            return name

        def loads() -> tuple[int, int]:
            load = router._calls.loads()
            return load[a.replica_id], load[b.replica_id]

        assert sorted([await short_request() for _ in range(4)]) == ["a", "a", "b", "b"]  # both idle: turns
        assert loads() == (0, 0)
        # A stream open on a: every choice is b until it completes.
        await chosen("stream")
        routed("stream", "a")  # (wherever chosen: Serve sent it to a)
        assert [await short_request() for _ in range(3)] == ["b"] * 3
        completed("stream", "a")
        assert sorted([await short_request() for _ in range(4)]) == ["a", "a", "b", "b"]
        # The CI failure: a stream chosen for b, whose queue probe b missed, is sent to a (the
        # next rank): a holds it once Serve reports it routed, and the next stream goes to b.
        while await chosen("probe-missed") != "b":
            pass
        routed("probe-missed", "a")
        assert loads() == (1, 0)
        assert await chosen("next") == "b"
        routed("next", "b")
        completed("probe-missed", "a")
        completed("next", "b")
        # A request's /tokenize call to b whose completion comes after its generation call was
        # routed to a: b stays idle for the next request.
        tokenized_on = await chosen("late", generation=False)
        routed("late", tokenized_on, generation=False)
        generated_on = "b" if tokenized_on == "a" else "a"
        routed("late", generated_on)
        assert loads() == ((1, 0) if generated_on == "a" else (0, 1))
        assert await chosen("after") == tokenized_on
        routed("after", tokenized_on)
        completed("after", tokenized_on)
        completed("late", tokenized_on)
        assert loads() == ((1, 0) if generated_on == "a" else (0, 1))
        completed("late", generated_on)
        # A rejection: the request's call is chosen again and accepted by the other replica; the
        # rejection's completion, reported late, leaves that call open.
        first = await chosen("rejected")
        other = "b" if first == "a" else "a"
        routed("rejected", other)
        completed("rejected", first)
        assert loads() == ((1, 0) if other == "a" else (0, 1))
        completed("rejected", other)
        assert loads() == (0, 0)
        # Choices Serve has not sent yet count: concurrent requests chosen before any send
        # spread over the replicas; a choice never routed (the request was cancelled) expires.
        assert sorted([await chosen(f"burst-{n}") for n in range(4)]) == ["a", "a", "b", "b"]
        assert loads() == (2, 2)
        routed("burst-0", "a")
        monkeypatch.setattr(router._calls, "_clock", lambda: time.monotonic() + 10)
        assert loads() == (1, 0)
        completed("burst-0", "a")
        # Replicas Serve removed are forgotten.
        routed("on-b", "b")
        router.update_replicas([a])
        assert loads() == (0, 0)

    asyncio.run(run())
