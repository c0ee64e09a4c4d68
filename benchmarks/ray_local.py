"""A local multi-node Ray cluster with `engine ray-serve`'s application on it, for benchmarks:
a head node that runs nothing but Serve's HTTP proxy and the ingress (resource ``head``), and
``nodes`` nodes of ``cpus_per_node`` CPUs each, where Serve places the replicas
(ray.cluster_utils.Cluster: several raylets on this one machine)."""
from __future__ import annotations

import contextlib
import socket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ray_serve_app(options_kwargs: dict, nodes: int, cpus_per_node: float = 1.0):
    """Yields (the application's URL, the Cluster, its replica nodes); ``options_kwargs`` are
    RayServeOptions' (model included)."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from entrypoints.ray_serve.app import RayServeOptions, build_app

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "resources": {"head": 1}})
    try:
        added = [cluster.add_node(num_cpus=cpus_per_node) for _ in range(nodes)]
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        port = _free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        options = RayServeOptions(**{"ingress_actor_options": {"num_cpus": 0, "resources": {"head": 0.01}},
                                     **options_kwargs})
        serve.run(build_app(options), name="engine", route_prefix="/")
        yield f"http://127.0.0.1:{port}", cluster, added
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
