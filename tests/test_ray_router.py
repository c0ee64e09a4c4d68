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


def test_open_calls_count_whatever_order_serve_reports_them_in(monkeypatch):
    """Serve reports a short call's completion (on its event loop) possibly before it reports
    the call routed (after the replica's acceptance came back); the call is open from its send
    to its completion either way, and from its choice to its send. Idle replicas take turns; a
    replica with a call open is passed over while another has none."""
    real_monotonic = time.monotonic

    async def run() -> None:
        router = KVAwareRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        a, b = _replica("a"), _replica("b")
        replicas = {"a": a, "b": b}

        async def chosen(generation: bool = True) -> str:
            ranks = await router.choose_replicas([a, b], _call("next", generation))
            return ranks[0][0].replica_id.unique_id

        async def short_call(generation: bool = True) -> str:
            """Chosen, sent and completed (before Serve reports it routed)."""
            name = await chosen(generation)
            router.on_send_request(replicas[name].replica_id)
            router.on_request_completed(replicas[name].replica_id, "short")
            router.on_request_routed(_call("short"), replicas[name].replica_id, None)
            return name

        assert sorted([await short_call() for _ in range(4)]) == ["a", "a", "b", "b"]  # both idle: turns
        # A stream open on a: every choice is b until it completes.
        router.on_send_request(a.replica_id)
        assert [await short_call() for _ in range(3)] == ["b"] * 3
        router.on_request_completed(a.replica_id, "stream")
        assert sorted([await short_call() for _ in range(4)]) == ["a", "a", "b", "b"]
        # Each request makes a /tokenize call before its generation call: generation calls
        # still take turns between idle replicas.
        generations = []
        for _ in range(4):
            await short_call(generation=False)
            generations.append(await short_call())
        assert sorted(generations) == ["a", "a", "b", "b"], generations
        # Choices Serve has not sent yet count: concurrent requests chosen before any send
        # spread over the replicas; a choice never sent there (Serve sent it elsewhere) expires.
        router.on_send_request(b.replica_id)  # b has a call open
        assert sorted([await chosen() for _ in range(3)]) == ["a", "a", "b"]
        assert router._load(a.replica_id) == router._load(b.replica_id) == 2
        router.on_send_request(a.replica_id)  # a choice of a, sent
        assert router._load(a.replica_id) == 2
        monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + 10)
        assert router._load(a.replica_id) == 1 and router._load(b.replica_id) == 1  # never sent: expired
        router.on_request_completed(a.replica_id, "sent")
        router.on_request_completed(b.replica_id, "open")
        # A call that failed before it was sent is reported completed too: never below zero.
        router.on_request_completed(b.replica_id, "failed")
        router.on_send_request(b.replica_id)
        assert [await short_call() for _ in range(3)] == ["a"] * 3
        # Replicas Serve removed are forgotten.
        router.update_replicas([a])
        assert b.replica_id not in router._open and b.replica_id not in router._chosen

    asyncio.run(run())
