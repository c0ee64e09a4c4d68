"""A local multi-node Ray cluster with `engine ray-serve`'s application on it, for benchmarks:
a head node that runs nothing but Serve's HTTP proxy and the ingress (resource ``head``), and
``nodes`` nodes of ``cpus_per_node`` CPUs each, where Serve places the replicas
(ray.cluster_utils.Cluster: several raylets on this one machine)."""
from __future__ import annotations

import contextlib

from tests.ray_cluster import local_cluster
from tests.server_utils import free_port


@contextlib.contextmanager
def ray_serve_app(options_kwargs: dict, nodes: int, cpus_per_node: float = 1.0):
    """Yields (the application's URL, the Cluster, its replica nodes); ``options_kwargs`` are
    RayServeOptions' (model included)."""
    from ray import serve

    from entrypoints.ray_serve.app import RayServeOptions, build_app

    with local_cluster(nodes, cpus_per_node, log_to_driver=False) as (cluster, added):
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        options = RayServeOptions(**{"ingress_actor_options": {"num_cpus": 0, "resources": {"head": 0.01}},
                                     **options_kwargs})
        serve.run(build_app(options), name="engine", route_prefix="/")
        yield f"http://127.0.0.1:{port}", cluster, added
