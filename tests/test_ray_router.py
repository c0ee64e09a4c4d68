"""The KV-aware Serve request router's own load count (entrypoints/ray_serve/router.py), driven
the way Serve's router calls it, without a cluster: calls open per replica, ties in turn.

Skipped with the reason when Ray is not installed (pip install 'engine[ray]'); CI installs it."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="needs Ray: pip install 'engine[ray]'")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

from entrypoints.ray_serve.router import KVAwareRequestRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="decode", app_name="app")


def _replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(name, DEPLOYMENT), routing_stats={"url": f"http://{name}"})


def _call(request_id: str) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(internal_request_id=request_id), kwargs={})


def test_open_calls_count_whatever_order_serve_reports_them_in():
    """Serve reports a short call's completion (on its event loop) possibly before it reports
    the call routed (after the replica's acceptance came back); the call is open from its send
    to its completion either way. Idle replicas take turns; a replica with a call open is
    passed over while another has none."""
    async def run() -> None:
        router = KVAwareRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        a, b = _replica("a"), _replica("b")

        async def first_choice() -> str:
            ranks = await router.choose_replicas([a, b], _call("next"))
            return ranks[0][0].replica_id.unique_id

        # A /tokenize call on a: sent, completed, then reported routed.
        router.on_send_request(a.replica_id)
        router.on_request_completed(a.replica_id, "tokenize")
        router.on_request_routed(_call("tokenize"), a.replica_id, None)
        assert {await first_choice() for _ in range(4)} == {"a", "b"}  # both idle: turns
        # A stream open on a: every choice is b until it completes.
        router.on_send_request(a.replica_id)
        router.on_request_routed(_call("stream"), a.replica_id, None)
        assert [await first_choice() for _ in range(3)] == ["b"] * 3
        router.on_request_completed(a.replica_id, "stream")
        assert {await first_choice() for _ in range(4)} == {"a", "b"}
        # A call that failed before it was sent is reported completed too: never below zero.
        router.on_request_completed(b.replica_id, "failed")
        router.on_send_request(b.replica_id)
        assert [await first_choice() for _ in range(3)] == ["a"] * 3

    asyncio.run(run())
