"""The local multi-node Ray cluster of the Ray Serve tests and benchmarks (ray.cluster_utils.Cluster:
several raylets on this machine): a head node with no CPUs (resource ``head``, for what must stay:
the ingress, Serve's HTTP proxy) and 1-CPU nodes where Serve places the replicas. ``cluster`` is
a module fixture (three nodes: a replica per node and one spare): import it into the test module."""
from __future__ import annotations

import contextlib

import pytest


@contextlib.contextmanager
def local_cluster(nodes: int, cpus_per_node: float = 1.0, **init_kwargs):
    """Yields (the Cluster, its added nodes), connected with ray.init; Serve, Ray and the
    cluster are shut down after."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "resources": {"head": 1}})
    try:
        added = [cluster.add_node(num_cpus=cpus_per_node) for _ in range(nodes)]
        ray.init(address=cluster.address, logging_level="warning", **init_kwargs)
        yield cluster, added
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(3) as (made, nodes):
        yield made, nodes
