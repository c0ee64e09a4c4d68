"""What tracing costs a request: two `engine serve` instances of one model, one with
--otlp-traces-endpoint (every request sampled, its spans exported to a receiver in this process),
one without, driven in interleaved rounds (the order within each round shuffled; one request in
flight at a time, so the two never compete for the cores). Prints the median end-to-end latency
of each and the median of the per-round differences (on - off) with its spread.

    PYTHONPATH=. python benchmarks/tracing_overhead.py [--model PATH] [--rounds 20] [--per-round 5]

Tracing off runs strictly less than tracing on (no span, no record in the core: a None check
per request and per scheduled request), so on ~ off bounds the cost of off from above.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.otlp_receiver import OTLPReceiver  # noqa: E402
from tests.server_utils import ServerProcess  # noqa: E402


def _latency(url: str, prompt: list[int], max_tokens: int) -> float:
    start = time.perf_counter()
    resp = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    resp.raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the engine's default model")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=5, help="requests per instance per round")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.model is None:
        from engine.worker.loader import resolve_model
        args.model = str(resolve_model(None))
    receiver = OTLPReceiver()
    common = ("--num-threads", "1", "--max-model-len", "2048", "--served-model-name", "m")
    on = ServerProcess(args.model, *common, "--otlp-traces-endpoint", receiver.url, wait=False,
                       env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
    off = ServerProcess(args.model, *common, wait=False)
    rng = random.Random(0)
    latencies: dict[str, list[float]] = {"on": [], "off": []}
    diffs: list[float] = []
    try:
        on.wait_ready()
        off.wait_ready()
        servers = {"on": on, "off": off}
        for name in servers:  # warm-up, not counted
            _latency(servers[name].url, [5] * args.prompt_tokens, args.max_tokens)
        for r in range(args.rounds):
            order = ["on", "off"]
            rng.shuffle(order)
            medians = {}
            for name in order:
                got = []
                for i in range(args.per_round):
                    # A fresh prompt per request (no prefix hit), the same for both instances.
                    prompt = [(r * 7919 + i * 104729 + j * 31) % 20000 + 3 for j in range(args.prompt_tokens)]
                    got.append(_latency(servers[name].url, prompt, args.max_tokens))
                latencies[name] += got
                medians[name] = statistics.median(got)
            diffs.append(medians["on"] - medians["off"])
        time.sleep(1)  # the last batch of spans
    finally:
        on.stop()
        off.stop()
        receiver.close()
    traced = sum(s.name == "llm_request" for s in receiver.spans)
    print(f"{args.rounds} rounds x {args.per_round} requests per instance, {args.prompt_tokens} prompt tokens, "
          f"{args.max_tokens} output tokens; {traced} llm_request spans received from the traced instance")
    for name in ("off", "on"):
        print(f"tracing {name:3s}: median e2e {statistics.median(latencies[name]) * 1e3:8.2f} ms")
    q = statistics.quantiles(diffs, n=4)
    print(f"per-round median difference on - off: {statistics.median(diffs) * 1e3:+.2f} ms "
          f"(quartiles {q[0] * 1e3:+.2f} / {q[2] * 1e3:+.2f} ms)")


if __name__ == "__main__":
    main()
