"""Builds the Serve application of ``engine ray-serve``: a prefill and a decode deployment of
EngineReplica (entrypoints/ray_serve/replica.py) and the PDIngress in front (ingress.py).

``serve run`` takes it from a config file through ``app_builder`` (docs/ray.md has the YAML).
The deployment secret is the driver's $ENGINE_KV_SECRET, or a fresh one per build: either way
it reaches the replicas as a sealed init argument, never in the config, a log or the dashboard.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.kv_transfer.secret import ENV_VAR, KVSecret, new_secret


def parse_replicas(text: str | int, none_allowed: bool = False) -> tuple[int, int]:
    """"N" (fixed) or "MIN:MAX" (autoscaled), as --prefill-replicas and --decode-replicas take
    them; with ``none_allowed`` (prefill) also "0": no such deployment."""
    lo, colon, hi = str(text).partition(":")
    try:
        bounds = int(lo), int(hi if colon else lo)
    except ValueError:
        raise ValueError(f"replicas must be N or MIN:MAX, got {text!r}") from None
    if none_allowed and bounds == (0, 0):
        return bounds
    if not 0 < bounds[0] <= bounds[1]:
        raise ValueError(f"replicas must be N or MIN:MAX with 0 < MIN <= MAX, got {text!r}")
    return bounds


@dataclass(frozen=True)
class RayServeOptions:
    model: str
    prefill_replicas: tuple[int, int] = (1, 1)
    decode_replicas: tuple[int, int] = (1, 1)
    engine_args: list[str] = field(default_factory=list)  # for every replica's `engine serve`
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0  # Ray sets the replica's CUDA_VISIBLE_DEVICES; its engine then runs on CUDA
    max_local_prefill_tokens: int = 512
    target_ongoing_requests: float = 4.0  # Serve's autoscaling target per replica
    upscale_delay_s: float = 10.0  # how long the load must stay above the target (Serve's default: 30)
    downscale_delay_s: float = 120.0  # and below it (Serve's default: 600)
    autoscaling_config: dict = field(default_factory=dict)  # more of Serve's autoscaling_config, as is
    prefill_max_ongoing: int = 16
    # Requests waiting for a prefill replica beyond its max_ongoing: past them the ingress has
    # the decode replica prefill a long prompt itself (engine proxy's --max-prefill-queue).
    prefill_max_queued: int = 4
    decode_max_ongoing: int = 64
    lease_s: float = 30.0
    routing: str = "least-loaded"  # or kv-aware (entrypoints/ray_serve/router.py)
    # The ingress replicas (routing only: no CPU reserved); more than one, or custom resources
    # placing them on nodes that stay, keep requests alive when a node goes.
    ingress_replicas: int = 1
    ingress_actor_options: dict = field(default_factory=lambda: {"num_cpus": 0})
    # OpenTelemetry traces of the ingress and every replica go there (OTLP/HTTP; entrypoints/tracing.py).
    otlp_traces_endpoint: str | None = None


def build_app(options: RayServeOptions, secret: str | None = None):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from entrypoints.proxy import DisaggPolicy
    from entrypoints.ray_serve.ingress import PDIngress
    from entrypoints.ray_serve.replica import EngineReplica, SealedSecret

    if secret is None:
        secret = os.environ.get(ENV_VAR) or new_secret()
    KVSecret(secret)  # a secret too short is refused here, not in every replica
    sealed = SealedSecret(secret)

    if options.replica_gpus != int(options.replica_gpus) or options.replica_gpus < 0:
        raise ValueError(f"replica_gpus must be a whole number (an engine takes its GPUs whole), "
                         f"got {options.replica_gpus}")
    colocated = options.prefill_replicas == (0, 0)
    if colocated and options.max_local_prefill_tokens == 0:
        raise ValueError("max_local_prefill_tokens 0 sends every prompt through a prefill replica, "
                         "but prefill_replicas is 0")
    if options.routing not in ("least-loaded", "kv-aware"):
        raise ValueError(f"routing must be least-loaded or kv-aware, got {options.routing!r}")
    router = {} if options.routing != "kv-aware" else {"request_router_config": RequestRouterConfig(
        request_router_class="entrypoints.ray_serve.router.KVAwareRequestRouter",
        request_routing_stats_period_s=2)}

    def deployment(role: str, replicas: tuple[int, int], max_ongoing: int, engine_role: str | None = None,
                   **more):
        lo, hi = replicas
        scaling = ({"num_replicas": lo} if lo == hi else {"autoscaling_config": {
            "min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": options.target_ongoing_requests,
            "upscale_delay_s": options.upscale_delay_s, "downscale_delay_s": options.downscale_delay_s,
            **options.autoscaling_config}})
        return serve.deployment(
            EngineReplica, name=role,
            ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
            max_ongoing_requests=max_ongoing, health_check_period_s=5, health_check_timeout_s=30,
            # Serve waits this long for a removed replica's open requests (and the prefill's held
            # offers, EngineReplica.__del__) before it kills the replica.
            graceful_shutdown_wait_loop_s=1, graceful_shutdown_timeout_s=options.lease_s + 120, **scaling, **router,
            **more,
        ).bind(options.model, engine_role or role, list(options.engine_args) + traces, sealed, options.lease_s)

    traces = ["--otlp-traces-endpoint", options.otlp_traces_endpoint] if options.otlp_traces_endpoint else []

    # No prefill replicas: every request whole on a decode replica, a colocated engine (role
    # both: no KV consumer), routed by Serve.
    prefill = None if colocated else deployment(
        "prefill", options.prefill_replicas, options.prefill_max_ongoing, max_queued_requests=options.prefill_max_queued)
    decode = deployment("decode", options.decode_replicas, options.decode_max_ongoing,
                        engine_role="both" if colocated else "decode")
    ingress = serve.deployment(PDIngress, name="ingress", num_replicas=options.ingress_replicas,
                               ray_actor_options=options.ingress_actor_options, max_ongoing_requests=1000)
    return ingress.bind(prefill, decode, DisaggPolicy(options.max_local_prefill_tokens), options.routing, sealed,
                        options.otlp_traces_endpoint)


def app_builder(args: dict):
    """``serve run`` / ``serve deploy`` config entry (``import_path:
    entrypoints.ray_serve.app:app_builder``); ``args`` as in docs/ray.md."""
    args = dict(args)
    model = args.pop("model")
    kwargs = {}
    for key in ("prefill_replicas", "decode_replicas"):
        if key in args:
            kwargs[key] = parse_replicas(args.pop(key), none_allowed=key == "prefill_replicas")
    if "engine_args" in args:
        kwargs["engine_args"] = [str(a) for a in args.pop("engine_args")]
    for key in ("replica_cpus", "replica_gpus", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s",
                "lease_s"):
        if key in args:
            kwargs[key] = float(args.pop(key))
    for key in ("routing", "otlp_traces_endpoint"):
        if key in args:
            kwargs[key] = str(args.pop(key))
    if "autoscaling_config" in args:
        kwargs["autoscaling_config"] = dict(args.pop("autoscaling_config"))
    if "ingress_actor_options" in args:
        kwargs["ingress_actor_options"] = dict(args.pop("ingress_actor_options"))
    for key in ("max_local_prefill_tokens", "prefill_max_ongoing", "prefill_max_queued", "decode_max_ongoing",
                "ingress_replicas"):
        if key in args:
            kwargs[key] = int(args.pop(key))
    if args:
        raise ValueError(f"unknown engine ray-serve arguments: {', '.join(sorted(args))}")
    return build_app(RayServeOptions(model, **kwargs))
