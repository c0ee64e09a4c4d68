"""`engine generate | serve | proxy | bench`."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that builds an engine (names follow vllm serve)."""
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-memory", default=None,
                      help="bytes of KV cache, e.g. 2GiB (default: 2GiB on CPU)")
    size.add_argument("--num-blocks", type=int, default=None, help="size the KV cache by a block count")
    parser.add_argument("--revision", default=None,
                        help="of a Hugging Face model id: the branch, tag or commit (default: main)")
    parser.add_argument("--download-dir", default=None, metavar="DIR",
                        help="Hugging Face cache directory for model ids (default: $HF_HOME/hub)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="max requests per step (default 256)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget per step; longer prompts are prefilled in chunks (default 2048)")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                        help="a prompt is prefilled at most N tokens per step, so the requests decoding beside it "
                             "keep a short inter-token latency (default 0: up to the step's budget; engine disagg "
                             "gives it to the decode instance only, default 32 there, applied while that instance "
                             "borrows no cores)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's max_position_embeddings)")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="disable automatic prefix caching")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "float", "half"],
                        help="weights and KV dtype (auto: bfloat16 on CUDA and on CPUs with native bfloat16 "
                             "(AVX512-BF16 or AMX), float32 on other CPUs)")
    parser.add_argument("--quantization", default=None, choices=["int4", "int8", "gguf"],
                        help="keep weights quantized: int4 (group-wise, 32 per group, scale and minimum) or int8 "
                             "(group-wise symmetric) quantize a float checkpoint at load; a .gguf's Q4_0, Q4_1 "
                             "and Q8_0 tensors run as stored on CPUs with the native kernels, dequantized "
                             "elsewhere (gguf: insist on a .gguf)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "triton", "cpu", "torch", "flash_attn", "xformers"],
                        help="paged attention kernels (auto: the first that passes a start-time probe against "
                             "the torch reference on this device and dtype: triton, flash_attn, xformers, torch "
                             "on CUDA; cpu, torch on the CPU. cpu: the native CPU kernels built by pip install "
                             "-e .; torch: the pure-torch reference path; triton: paged attention in place on "
                             "CUDA; flash_attn and xformers need pip install -e .[cuda]). A backend named here "
                             "that fails its probe is refused at start, with the reason")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="the share of the GPU's memory this instance may hold in all (weights, "
                             "activations, CUDA graphs, KV); the KV cache gets what the rest leave (CUDA, when "
                             "--kv-cache-memory is not given; default 0.9). Two instances at 0.45 share one GPU")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: decode steps run eagerly too (CUDA; graphs need --attention-backend "
                             "triton, auto's first choice there)")
    parser.add_argument("--max-capture-size", type=int, default=256, metavar="N",
                        help="the largest decode batch captured as a CUDA graph (default 256, at most "
                             "--max-num-seqs); larger decode batches run eagerly")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--kv-store", default=None, metavar="SPEC",
                        help="KV cache tiers in lookup order, comma-separated: cpu:SIZE, disk:PATH:SIZE, "
                             "redis://[user:pass@]host:port/db (also rediss://...?ssl_ca_certs=CA, unix://; "
                             "percent-encode / ? # %% @ in passwords), e.g. "
                             "cpu:2GiB,disk:./kvcache:10GiB,redis://127.0.0.1:6379/0")
    parser.add_argument("--kv-chunk-tokens", type=int, default=256,
                        help="tokens per stored KV chunk, a multiple of --block-size (default 256)")
    parser.add_argument("--kv-store-ttl-s", type=int, default=24 * 3600,
                        help="expiry of Redis KV entries in seconds (default 86400)")
    parser.add_argument("--small-rows-linear", action=argparse.BooleanOptionalAction, default=False,
                        help="bfloat16 on CPUs with AVX512-BF16: steps of up to 4 rows read a plain copy of the linear "
                             "weights with a native kernel (single-stream decode ~1.4x), at the cost of the copy's "
                             "memory and of rows that differ in their last bits between small and large steps "
                             "(docs/performance.md); off by default")
    parser.add_argument("--kv-always-load", action=argparse.BooleanOptionalAction, default=True,
                        help="load every KV store hit (the default); --no-kv-always-load loads a hit only as far "
                             "as this instance's measured tier rates and prefill rate say loading beats "
                             "recomputing it (docs/kv-tiers.md)")
    parser.add_argument("--kv-secret-file", default=None, metavar="PATH",
                        help="the deployment secret shared by its prefill, decode and store users (a file of "
                             "mode 0600; create one with `engine secret PATH`; or set ENGINE_KV_SECRET): "
                             "signs kv_transfer_params, authenticates KV sockets, authenticates store entries")
    parser.add_argument("--cpu-cores", default=None, metavar="LIST",
                        help="pin the engine's compute to these cores, e.g. 0-3,6 (default: all it may use)")
    parser.add_argument("--num-threads", type=int, default=None, metavar="N",
                        help="torch threads for the model (default with --cpu-cores: one per physical core "
                             "among them; else torch's default)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(revision=args.revision, download_dir=args.download_dir, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, num_blocks=args.num_blocks,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                long_prefill_token_threshold=args.long_prefill_token_threshold or 0,
                max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                dtype=args.dtype, quantization=args.quantization, device=args.device, seed=args.seed, kv_store=args.kv_store,
                attention_backend=args.attention_backend, gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager, max_capture_size=args.max_capture_size,
                kv_chunk_tokens=args.kv_chunk_tokens, kv_store_ttl_s=args.kv_store_ttl_s,
                kv_always_load=args.kv_always_load, small_rows_linear=args.small_rows_linear,
                kv_secret_file=args.kv_secret_file, cpu_cores=args.cpu_cores, num_threads=args.num_threads)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


def kv_transfer_config(args: argparse.Namespace):
    import json

    from engine.config import KVTransferConfig

    if args.kv_transfer_config:
        try:
            raw = json.loads(args.kv_transfer_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not valid JSON: {exc}")
        if not isinstance(raw, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        return KVTransferConfig.from_dict(raw)
    if args.role == "both":
        return None
    return KVTransferConfig(
        kv_connector="p2p", kv_role="kv_producer" if args.role == "prefill" else "kv_consumer",
        kv_ip=args.kv_ip or args.host, kv_port=(args.kv_port or 14579) if args.role == "prefill" else None,
        kv_load_failure_policy=args.kv_load_failure_policy,
        extra={"lease_s": args.kv_lease_s, "load_timeout_s": args.kv_load_timeout_s, "encrypt": args.kv_encrypt})


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def _redis_hosts(kv_store: str | None) -> list[str]:
    from urllib.parse import urlsplit

    from engine.kv_transfer.stores.base import REDIS_SCHEMES, split_store_spec

    hosts = []
    for part in split_store_spec(kv_store or ""):
        if part.startswith(REDIS_SCHEMES) and not part.startswith("unix:"):
            try:
                hosts.append(urlsplit(part).hostname or "")
            except ValueError:
                hosts.append("")  # unparsable: the store reports it; here it counts as remote
    return hosts


def kv_events_config(args: argparse.Namespace) -> str | dict | None:
    """--kv-events-config as given, or for --kv-events one on the API's host, with ports the
    instance chooses (its /status shows them; engine proxy reads them there)."""
    if args.kv_events and args.kv_events_config:
        raise ValueError("--kv-events and --kv-events-config: give one (the first chooses its own ports)")
    if not args.kv_events:
        return args.kv_events_config
    host = "127.0.0.1" if args.host == "localhost" else f"[{args.host}]" if ":" in args.host else args.host
    return {"enable_kv_cache_events": True, "endpoint": f"tcp://{host}:0", "replay_endpoint": f"tcp://{host}:0"}


def check_kv_exposure(args: argparse.Namespace, config) -> None:
    """Safe by default: the KV plane is only reachable beyond this host with a deployment
    secret. That is a prefill's KV port, a decode's readiness to act on the kv_transfer_params
    its clients send, and KV store entries in a Redis that others can write to."""
    from engine.kv_events import endpoint_host

    transfer = config.kv_transfer_config
    if transfer is None and not config.kv_store and config.kv_events_config is None:
        return
    exposed = set() if _is_loopback(args.host) else {args.host}
    if transfer is not None:
        if transfer.extra.get("encrypt") and config.kv_secret is None:
            raise ValueError("--kv-encrypt needs the deployment secret: --kv-secret-file PATH or ENGINE_KV_SECRET")
        if not _is_loopback(transfer.kv_ip):
            exposed.add(transfer.kv_ip)
    exposed.update(f"Redis at {h or '?'}" for h in _redis_hosts(config.kv_store) if not _is_loopback(h))
    events = config.kv_events_config
    for endpoint in (events.endpoint, events.replay_endpoint) if events is not None else ():
        host = endpoint_host(endpoint or "")
        if host and not _is_loopback(host):
            exposed.add(f"KV events on {endpoint}")
    if exposed and config.kv_secret is None and not args.insecure_kv:
        raise ValueError(f"the KV plane on {', '.join(sorted(exposed))} without a deployment secret would let anyone "
                         "who reaches it read KV, point this instance at their own or plant store entries: create "
                         "one with `engine secret PATH`, pass --kv-secret-file PATH to every instance of the "
                         "deployment (or set ENGINE_KV_SECRET), or pass --insecure-kv to accept the risk")


def cmd_secret(args: argparse.Namespace) -> int:
    from engine.kv_transfer.secret import write_secret_file

    if os.path.exists(args.path) and not args.force:
        raise ValueError(f"{args.path} exists; pass --force to replace it")
    print(f"wrote a new deployment secret to {write_secret_file(args.path)} (mode 0600): pass "
          f"--kv-secret-file {args.path} to each instance of the deployment")
    return 0


def _load_server_side(model_dir: str):
    """What only the API process needs: the web stack and the tokenizer (which imports
    transformers and, through it, torch). Seconds, spent while the engine core starts."""
    import uvicorn  # noqa: F401

    import entrypoints.api_server  # noqa: F401
    from engine.tokenizer_loading import load_tokenizer
    return load_tokenizer(model_dir)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from engine.config import EngineConfig
    from engine.core_client import AsyncEngineClient
    from engine.worker.loader import resolve_model

    model_dir = resolve_model(args.model_path or args.model, args.revision, args.download_dir)
    served = args.served_model_name or [args.model_path or args.model or "SmolLM2-135M-Instruct"]
    config = EngineConfig(model=str(model_dir), kv_transfer_config=kv_transfer_config(args),
                          lend_cores_file=args.lend_cores, borrow_cores_file=args.borrow_cores,
                          kv_events_config=kv_events_config(args),
                          prefix_caching_hash_algo=args.prefix_caching_hash_algo, **engine_kwargs(args))
    check_kv_exposure(args, config)
    api_key = args.api_key or os.environ.get("ENGINE_API_KEY")
    if args.otlp_traces_endpoint:
        from entrypoints import tracing
        tracing.check_available()  # refused before the model loads

    async def serve() -> None:
        client = AsyncEngineClient(config, args.max_queue_len)
        loading = asyncio.get_running_loop().run_in_executor(None, _load_server_side, str(model_dir))
        try:
            await client.start()
        except BaseException:
            loading.cancel()  # the core's error is the one to report
            raise
        tokenizer = await loading

        import uvicorn

        from entrypoints.api_server import OpenAIServer, build_app

        if args.otlp_traces_endpoint:
            from entrypoints import tracing
            tracing.init_tracer(args.otlp_traces_endpoint, f"engine-{args.role}")
        app = build_app(OpenAIServer(client, tokenizer, served, api_key,
                                     trust_request_chat_template=args.trust_request_chat_template))
        # asyncio and h11 whatever else is installed (engine[ray] brings uvloop and httptools).
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                               timeout_graceful_shutdown=10, loop="asyncio", http="h11"))

        def on_dead(_: str) -> None:
            # Let the error responses of requests in flight go out, then exit.
            asyncio.get_running_loop().call_later(1.0, setattr, server, "should_exit", True)
        client.on_dead = on_dead
        logging.getLogger("engine").info("serving %s on http://%s:%d", served[0], args.host, args.port)
        try:
            await server.serve()
        finally:
            await client.shutdown()  # idempotent; the app's lifespan normally did it already
            from entrypoints import tracing
            tracing.shutdown()  # exports the spans still batched

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:  # Ctrl-C after the graceful shutdown already ran
        pass
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from entrypoints.proxy import DisaggPolicy, Proxy, build_proxy_app

    from engine.kv_transfer.secret import load_kv_secret
    from entrypoints.kv_router import KVRouter

    if args.instance and (args.prefill or args.decode):
        raise ValueError("engine proxy takes --instance URLs (replicas) or --prefill and --decode URLs, not both")
    if not args.instance and not (args.prefill and args.decode):
        raise ValueError("engine proxy needs --instance URLs, or at least one --prefill and one --decode URL")
    if args.otlp_traces_endpoint:
        from entrypoints import tracing
        tracing.init_tracer(args.otlp_traces_endpoint, "engine-proxy")
    disagg = DisaggPolicy(args.max_local_prefill_tokens, args.max_prefill_queue)
    router = (KVRouter(args.kv_load_weight, load_kv_secret(args.kv_secret_file), args.kv_max_skew)
              if args.routing == "kv-aware" else None)
    if args.instance:
        proxy = Proxy([], args.instance, args.routing, args.timeout, router=router)
        logging.getLogger("engine").info("proxy on http://%s:%d: replicas %s, %s routing", args.host, args.port,
                                         args.instance, args.routing)
    else:
        proxy = Proxy(args.prefill, args.decode, args.routing, args.timeout, disagg=disagg, router=router,
                      transfer_weight=args.transfer_weight)
        logging.getLogger("engine").info(
            "proxy on http://%s:%d: prefill %s -> decode %s, %s routing; %s", args.host, args.port, args.prefill,
            args.decode, args.routing,
            f"decode prefills prompts with up to {disagg.max_local_prefill_tokens} uncached tokens itself, and any "
            f"prompt while a prefill instance has {disagg.max_prefill_queue} in flight" if disagg.conditional
            else "every prompt through a prefill instance")
    try:
        uvicorn.run(build_proxy_app(proxy), host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=10, loop="asyncio", http="h11")
    finally:
        from entrypoints import tracing
        tracing.shutdown()  # exports the spans still batched
    return 0


def format_status(url: str, status: dict) -> str:
    """One engine instance's live state, as `engine status` prints it."""
    req, blocks, kv = status["requests"], status["kv_blocks"], status["kv_transfer"]
    lines = [f"{url}  model {status['model']}  engine pid {status['engine_pid']}"
             + ("  ENGINE DEAD" if status["dead"] else ""),
             f"  requests   running {req['running']}  waiting {req['waiting']} "
             f"(for remote KV {req.get('waiting_for_remote_kv', 0)})  held for transfer "
             f"{req.get('held_for_transfer', 0)}  open HTTP {req['in_flight_http']}",
             f"  kv blocks  total {blocks['total']}  free {blocks['free']} (cached {blocks['cached']})  "
             f"in use {blocks['in_use']} (held {blocks.get('held', kv['blocks_held'])})  "
             f"preemptions {status['num_preemptions']}",
             f"  transfers  in flight {req.get('waiting_for_remote_kv', 0) + req.get('held_for_transfer', 0)}  "
             f"bytes {kv['bytes']}  failures {kv['failures'] or 'none'}"]
    for tier, t in status.get("kv_store", {}).items():
        lines.append(f"  store {tier:5s} hits {t['hits']}  misses {t['misses']}  used {t['used_bytes'] / 2**20:.1f} MiB  "
                     f"stored {t['bytes_stored'] / 2**20:.1f} MiB  loaded {t['bytes_loaded'] / 2**20:.1f} MiB")
    decision = status.get("kv_load_decision")
    if decision:
        d = decision["decisions"]
        rates = "  ".join(f"{name} {r['bytes_per_s'] / 1e6:.0f} MB/s{'' if r['measured'] else ' (seed)'}"
                          for name, r in decision["sources"].items())
        lines.append(f"  load/compute {'on' if decision['enabled'] else 'off (--no-kv-always-load turns it on)'}  load {d['load']}  "
                     f"partial {d['partial']}  recompute {d['recompute']}  tokens loaded "
                     f"{decision['tokens_loaded']} recomputed {decision['tokens_recomputed']}  {rates}")
    return "\n".join(lines)


def format_proxy_status(url: str, status: dict) -> str:
    disagg = status["disagg"]
    lines = [f"{url}  proxy ({status['policy']} routing)"]
    if status["prefill"]:
        counts = "  ".join(f"{d['path']}/{d['reason']} {d['count']}" for d in disagg["decisions"])
        lines[0] += (f"  local prefill up to {disagg['max_local_prefill_tokens']} uncached tokens, prefill queue "
                     f"{disagg['max_prefill_queue']}")
        lines.append(f"  decisions  {counts}")
    for index in status.get("kv_routing") or ():
        rate = index["predicted_hit_rate"]
        tiers = "".join(f" + {n} {medium}" for medium, n in index.get("tier_blocks", {}).items())
        lines.append(f"  kv index   {index['url']}  {index['index_blocks']} blocks{tiers}  routed {index['routed']}  "
                     f"predicted hit rate {'-' if rate is None else f'{rate:.0%}'}  resyncs {index['resyncs']}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    failed = 0
    urls = list(args.urls)
    while urls:
        url = urls.pop(0).rstrip("/")
        try:
            resp = httpx.get(f"{url}/status", timeout=args.timeout, headers=headers)
            resp.raise_for_status()
            status = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            print(f"{url}  UNREACHABLE: {exc}")
            failed += 1
            continue
        if status.get("proxy"):  # a proxy: show it, then every instance behind it
            print(format_proxy_status(url, status))
            for role in ("prefill", "decode"):
                for up in status[role]:
                    label = role if status["prefill"] else "replica"
                    print(f"  {label:7s} {up['url']}  in flight {up['in_flight']}")
                    urls.append(up["url"])
            continue
        print(format_status(url, status))
    return 1 if failed else 0


DISAGG_DECODE_PREFILL_CHUNK = 32


def gpus_overlap(prefill: str | None, decode: str | None, inherited: str | None) -> bool:
    """Whether the prefill and decode instances may land on one GPU: their device lists (None:
    what this process sees, all of them when CUDA_VISIBLE_DEVICES is unset) share a device."""
    def devices(spec: str | None) -> set[str] | None:
        spec = spec if spec is not None else inherited
        return None if spec is None else {d.strip() for d in spec.split(",") if d.strip()}
    p, d = devices(prefill), devices(decode)
    return p is None or d is None or bool(p & d)


def cmd_disagg(args: argparse.Namespace) -> int:
    from entrypoints.launcher import run_disagg

    # Hand the engine flags on to both instances exactly as given.
    engine_args = []
    for key, value in engine_kwargs(args).items():
        flag = "--" + key.replace("_", "-")
        if key == "long_prefill_token_threshold":
            continue  # the decode instance's alone (below)
        if key in ("cpu_cores", "num_threads"):
            if value is not None:
                raise ValueError(f"engine disagg places each instance itself: use --prefill-cores / "
                                 f"--decode-cores instead of --{key.replace('_', '-')}")
            continue
        if key == "enable_prefix_caching":
            engine_args += [] if value else ["--no-enable-prefix-caching"]
        elif key == "enforce_eager":
            engine_args += ["--enforce-eager"] if value else []
        elif isinstance(value, bool):  # a --flag / --no-flag pair (argparse.BooleanOptionalAction)
            engine_args += [flag if value else "--no-" + flag[2:]]
        elif key == "gpu_memory_utilization":
            # The share of a GPU both instances hold: halved when they share one (vLLM's meaning:
            # each instance's own share, so two at 0.45 fit one GPU at 0.9).
            shared = gpus_overlap(args.prefill_gpus, args.decode_gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
            engine_args += [flag, str(value / 2 if shared else value)]
        elif value is not None:
            engine_args += [flag, str(value)]
    proxy_args = ["--max-local-prefill-tokens", str(args.max_local_prefill_tokens),
                  "--max-prefill-queue", str(args.max_prefill_queue)]
    if args.otlp_traces_endpoint:  # every process of the deployment traces to it
        from entrypoints import tracing
        tracing.check_available()
        engine_args += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
        proxy_args += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    # A prompt the decode instance prefills itself (conditional disaggregation) runs in chunks
    # beside its decodes, so their inter-token latency stays short.
    threshold = DISAGG_DECODE_PREFILL_CHUNK if args.long_prefill_token_threshold is None \
        else args.long_prefill_token_threshold
    model = args.model_path
    if model is not None and not os.path.exists(model):
        # A Hugging Face id: found (or downloaded) once, here; both instances load that snapshot
        # and answer to the id.
        from engine.worker.loader import resolve_model
        engine_args += ["--served-model-name", model]
        model = str(resolve_model(model, args.revision, args.download_dir))
    return run_disagg(model, args.host, args.port, engine_args, args.prefill_cores, args.decode_cores,
                      proxy_args, core_lending=args.core_lending,
                      decode_args=["--long-prefill-token-threshold", str(threshold)],
                      gpus=(args.prefill_gpus, args.decode_gpus))


def cmd_ray_serve(args: argparse.Namespace) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("engine ray-serve needs Ray: pip install 'engine[ray]'") from None
    from engine.worker.loader import resolve_model
    from entrypoints.ray_serve.app import RayServeOptions, build_app, parse_replicas

    engine_args = args.engine_args
    for flag in ("--role", "--host", "--port", "--kv-ip", "--kv-port", "--num-threads", "--cpu-cores",
                 "--otlp-traces-endpoint"):
        if flag in engine_args:
            raise ValueError(f"engine ray-serve sets {flag} of each replica itself")
    if args.otlp_traces_endpoint:
        from entrypoints import tracing
        tracing.check_available()
    # Every node needs the model at this path (a shared or identical file system).
    model = args.model_path if args.model_path and os.path.exists(args.model_path) else str(
        resolve_model(args.model_path))
    options = RayServeOptions(
        model, prefill_replicas=parse_replicas(args.prefill_replicas, none_allowed=True),
        decode_replicas=parse_replicas(args.decode_replicas), engine_args=engine_args,
        replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus,
        max_local_prefill_tokens=args.max_local_prefill_tokens,
        target_ongoing_requests=args.target_ongoing_requests, routing=args.routing,
        otlp_traces_endpoint=args.otlp_traces_endpoint)
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    logging.getLogger("engine").info("engine on Ray Serve at http://%s:%d: prefill replicas %s, decode replicas %s",
                                     args.host, args.port, args.prefill_replicas, args.decode_replicas)
    serve.run(build_app(options), name="engine", route_prefix="/", blocking=True)
    return 0


def add_disagg_policy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-local-prefill-tokens", type=int, default=512, metavar="N",
                        help="conditional disaggregation: a decode instance prefills a prompt itself when at most N "
                             "of its tokens are missing from its prefix cache; longer ones go through a prefill "
                             "instance (default 512; 0: every prompt through a prefill instance)")
    parser.add_argument("--max-prefill-queue", type=int, default=4, metavar="N",
                        help="while the least-loaded prefill instance has N of this proxy's requests in flight, "
                             "decode instances prefill long prompts too (default 4)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine", description="LLM inference engine")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="debug logs every request's state changes with its id (default info)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="print a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None,
                     help="HF model directory, .gguf file or Hugging Face id ORG/NAME (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible server (engine core in its own process)")
    srv.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                     help="HF model directory, .gguf file or Hugging Face id ORG/NAME (default: SmolLM2-135M-Instruct)")
    srv.add_argument("--model", default=None, help=argparse.SUPPRESS)
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="model name(s) the API answers to (default: the MODEL argument)")
    srv.add_argument("--api-key", default=None, help="require this bearer key on /v1/* (or set ENGINE_API_KEY)")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept a chat_template in chat requests (a client's Jinja runs on this server; "
                          "refused with 400 by default)")
    srv.add_argument("--max-queue-len", type=int, default=None,
                     help="answer 503 when this many requests are already waiting (default: unbounded)")
    srv.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                     help="both: a whole engine; prefill: compute prompts' KV and serve it to decode "
                          "instances over --kv-port; decode: continue from KV pulled from a prefill instance")
    srv.add_argument("--kv-port", type=int, default=None,
                     help="port the prefill role serves KV on (default 14579)")
    srv.add_argument("--kv-ip", default=None,
                     help="address the prefill role binds and advertises for KV (default: --host)")
    srv.add_argument("--kv-transfer-config", default=None,
                     help='JSON alternative to --role, vLLM-style: {"kv_connector": "p2p", "kv_role": '
                          '"kv_producer", "kv_port": 14579, "kv_load_failure_policy": "recompute", '
                          '"kv_connector_extra_config": {"lease_s": 30, "load_timeout_s": 30}}')
    srv.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"],
                     help="decode role, when KV does not arrive in time: recompute the prefill locally "
                          "(default; output stays correct) or fail the request")
    srv.add_argument("--kv-lease-s", type=float, default=30.0,
                     help="prefill role: seconds a finished prompt's KV is held for a decode to pull (default 30)")
    srv.add_argument("--kv-load-timeout-s", type=float, default=30.0,
                     help="decode role: deadline for a KV pull (default 30)")
    srv.add_argument("--kv-encrypt", action="store_true",
                     help="encrypt KV sent over TCP (CURVE, keys derived from the deployment secret; needs "
                          "--kv-secret-file). Same-host shared-memory copies are unaffected")
    srv.add_argument("--insecure-kv", action="store_true",
                     help="allow the KV plane (--role prefill/decode, --kv-store) on a non-loopback address, or with a remote "
                          "Redis, without a deployment secret "
                          "(anyone who reaches the ports can then read KV or steer the decode instance)")
    srv.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="send OpenTelemetry traces of every request over OTLP/HTTP to URL (a collector's "
                         "http://host:4318/v1/traces; OTEL_* variables configure the SDK: sampler, service name, "
                         "headers); needs pip install 'engine[otel]' (docs/serving.md#tracing)")
    srv.add_argument("--kv-events", action="store_true",
                     help="publish prefix-cache changes for routers (engine proxy --routing kv-aware, llm-d, Dynamo) on "
                          "two ports of --host this instance chooses; /status shows them (off loopback: needs the "
                          "deployment secret)")
    srv.add_argument("--prefix-caching-hash-algo", default=None, choices=["sha256", "sha256_cbor"],
                     help="name the KV events' blocks by vLLM 0.32's hashes (64-bit, rooted as vLLM roots them: at "
                          "PYTHONHASHSEED if set, which every instance and router must then share, else at vLLM's "
                          "fixed default) instead of the engine's own, for routers that compute vLLM's (llm-d's "
                          "precise prefix-cache scorer: sha256_cbor)")
    srv.add_argument("--kv-events-config", default=None, metavar="JSON",
                     help='publish prefix-cache changes for routers, vLLM-style: {"enable_kv_cache_events": true, '
                          '"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", '
                          '"topic": "kv-events", "buffer_steps": 10000} (off loopback: needs the deployment secret)')
    srv.add_argument("--lend-cores", default=None, metavar="FILE",
                     help="core lending on one host (with --cpu-cores): while this instance computes nothing, "
                          "the instance started with --borrow-cores FILE may run on its cores; this instance "
                          "says when through FILE (engine disagg sets this up for its prefill instance)")
    srv.add_argument("--borrow-cores", default=None, metavar="FILE",
                     help="with --cpu-cores: also run on the cores of the instance lending through FILE "
                          "while it is idle, one torch thread per physical core (engine disagg's decode instance)")
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    px = sub.add_parser("proxy", help="route each request through a prefill and then a decode instance")
    px.add_argument("--host", default="127.0.0.1")
    px.add_argument("--port", type=int, default=8000)
    px.add_argument("--prefill", action="append", default=[], metavar="URL",
                    help="a prefill instance (engine serve --role prefill); repeat for several")
    px.add_argument("--decode", action="append", default=[], metavar="URL",
                    help="a decode instance (engine serve --role decode); repeat for several")
    px.add_argument("--instance", action="append", default=[], metavar="URL",
                    help="instead of --prefill/--decode: a plain instance (engine serve) serving whole requests; "
                         "repeat for several replicas")
    px.add_argument("--routing", "--policy", dest="routing", default="least-loaded",
                    choices=["kv-aware", "least-loaded", "round-robin"],
                    help="how to pick a decode instance or replica: kv-aware (the one holding most of the "
                         "prompt's KV, from the instances' --kv-events-config events, traded against load), "
                         "least-loaded (default) or round-robin; prefill instances are always least-loaded")
    px.add_argument("--kv-load-weight", type=float, default=32.0, metavar="TOKENS",
                    help="kv-aware: cost of one open request on an instance, in uncached prompt tokens (default 32)")
    px.add_argument("--kv-max-skew", type=int, default=8, metavar="N",
                    help="kv-aware: never route to an instance with more than N open requests above the least "
                         "loaded one, whatever it holds (default 8)")
    px.add_argument("--kv-secret-file", default=None, metavar="PATH",
                    help="kv-aware: the deployment secret, to read the instances' KV events (or ENGINE_KV_SECRET)")
    px.add_argument("--transfer-weight", type=float, default=10.0, metavar="REQUESTS",
                    help="a hand-off goes to the decode instance with the least load plus this many open requests "
                         "per second its KV pull is expected to take beyond the fastest path's, as the decode "
                         "instances measured their recent pulls (default 10; 0: ignore link speed)")
    px.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="send OpenTelemetry traces of every request over OTLP/HTTP to URL (a collector's "
                         "http://host:4318/v1/traces; OTEL_* variables configure the SDK: sampler, service name, "
                         "headers); needs pip install 'engine[otel]' (docs/serving.md#tracing)")
    px.add_argument("--timeout", type=float, default=300.0,
                    help="deadline in seconds for each upstream call (between chunks when streaming)")
    add_disagg_policy_args(px)
    px.set_defaults(func=cmd_proxy)

    dg = sub.add_parser("disagg", help="start a prefill instance, a decode instance and the proxy on this host; "
                                       "other engine flags go to both engines (not --cpu-cores / --num-threads)")
    dg.add_argument("model_path", nargs="?", default=None, metavar="MODEL")
    dg.add_argument("--host", default="127.0.0.1")
    dg.add_argument("--port", type=int, default=8000, help="the proxy's port (default 8000)")
    dg.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="send OpenTelemetry traces of every request over OTLP/HTTP to URL (a collector's "
                         "http://host:4318/v1/traces; OTEL_* variables configure the SDK: sampler, service name, "
                         "headers); needs pip install 'engine[otel]' (docs/serving.md#tracing)")
    dg.add_argument("--prefill-cores", default=None, metavar="LIST",
                    help="cores of the prefill instance (default: the first half of this host's physical cores)")
    dg.add_argument("--decode-cores", default=None, metavar="LIST",
                    help="cores of the decode instance (default: the cores the prefill does not get)")
    dg.add_argument("--prefill-gpus", default=None, metavar="LIST",
                    help="CUDA devices of the prefill instance as the host numbers them, e.g. 0 or 0,1 (its "
                         "CUDA_VISIBLE_DEVICES; default: the devices this process sees)")
    dg.add_argument("--decode-gpus", default=None, metavar="LIST",
                    help="CUDA devices of the decode instance as the host numbers them (default: the devices "
                         "this process sees). When the two instances' devices overlap, each gets half of "
                         "--gpu-memory-utilization")
    add_disagg_policy_args(dg)
    dg.add_argument("--no-core-lending", dest="core_lending", action="store_false",
                    help="keep the decode instance on its own cores even while the prefill instance is idle "
                         "(by default it borrows them then)")
    add_engine_args(dg)
    dg.set_defaults(func=cmd_disagg)

    rs = sub.add_parser("ray-serve", usage="engine ray-serve [MODEL] [options] [-- ENGINE SERVE FLAGS]",
                        help="deploy prefill and decode replicas behind an OpenAI ingress on Ray Serve "
                             "(pip install 'engine[ray]'; docs/ray.md); engine serve flags after --")
    rs.add_argument("model_path", nargs="?", default=None, metavar="MODEL")
    rs.add_argument("--prefill-replicas", default="1", metavar="N|MIN:MAX",
                    help="prefill replicas: a number, or MIN:MAX for Serve's autoscaling (default 1); 0: none, "
                         "every request on a decode replica")
    rs.add_argument("--decode-replicas", default="1", metavar="N|MIN:MAX",
                    help="decode replicas: a number, or MIN:MAX for Serve's autoscaling (default 1)")
    rs.add_argument("--replica-cpus", type=float, default=1.0, metavar="N",
                    help="CPUs Ray reserves for each replica; its engine runs that many torch threads (default 1)")
    rs.add_argument("--replica-gpus", type=float, default=0.0, metavar="N",
                    help="GPUs Ray reserves for each replica (default 0); with one its engine runs on CUDA")
    rs.add_argument("--target-ongoing-requests", type=float, default=4.0, metavar="N",
                    help="autoscaling: Serve adds replicas while they average more open requests (default 4)")
    rs.add_argument("--routing", default="least-loaded", choices=["kv-aware", "least-loaded"],
                    help="how Serve picks a replica: kv-aware (the one holding most of the prompt's KV, from the "
                         "replicas' KV events, traded against load) or least-loaded (Serve's default, power of two "
                         "choices on queue lengths)")
    rs.add_argument("--address", default=None,
                    help="the Ray cluster (ray.init's address: auto, ray://host:10001; default: a local one)")
    rs.add_argument("--host", default="127.0.0.1", help="Serve's HTTP address (default 127.0.0.1)")
    rs.add_argument("--port", type=int, default=8000, help="Serve's HTTP port (default 8000)")
    rs.add_argument("--max-local-prefill-tokens", type=int, default=512, metavar="N",
                    help="conditional disaggregation: a decode replica prefills a prompt itself when at most N of "
                         "its tokens are missing from its prefix cache (default 512; 0: every prompt through a "
                         "prefill replica)")
    rs.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="send OpenTelemetry traces of every request over OTLP/HTTP to URL (a collector's "
                         "http://host:4318/v1/traces; OTEL_* variables configure the SDK: sampler, service name, "
                         "headers); needs pip install 'engine[otel]' (docs/serving.md#tracing)")
    rs.set_defaults(func=cmd_ray_serve)

    sc = sub.add_parser("secret", help="write a new random deployment secret (mode 0600) for --kv-secret-file")
    sc.add_argument("path")
    sc.add_argument("--force", action="store_true", help="replace an existing file")
    sc.set_defaults(func=cmd_secret)

    st = sub.add_parser("status", help="print the live state of engine instances (or of a proxy and everything "
                                       "behind it): requests by status, KV blocks, transfers, store tiers")
    st.add_argument("urls", nargs="+", metavar="URL")
    st.add_argument("--api-key", default=None)
    st.add_argument("--timeout", type=float, default=5.0)
    st.set_defaults(func=cmd_status)

    argv = sys.argv[1:] if argv is None else list(argv)
    # engine ray-serve hands everything after a bare -- to its replicas' engine serve.
    split = argv.index("--") if "ray-serve" in argv and "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    if getattr(args, "func", None) is cmd_ray_serve:
        args.engine_args = argv[split + 1:]
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
