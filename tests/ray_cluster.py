"""The local multi-node Ray cluster of the Ray Serve tests (ray.cluster_utils.Cluster: several
raylets on this machine): a head node with no CPUs (resource ``head``, for what must stay: the
ingress, Serve's HTTP proxy) and three 1-CPU nodes, a replica per node and one spare. A module
fixture: import it into the test module."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "resources": {"head": 1}})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    ray.init(address=cluster.address, logging_level="warning")
    yield cluster, nodes
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
