"""A/B in one run: P->D TTFT with the prefill's KV in private memory (the default) against
/dev/shm (ENGINE_KV_SHM=1), next to a colocated server; requests interleaved, medians of 8.

    python benchmarks/disagg_shm_ab.py [PROMPT_TOKENS]   (default 512)
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.disagg import stream_latency  # noqa: E402
from engine.worker.loader import resolve_model  # noqa: E402
from tests.disagg_utils import ProxyProcess  # noqa: E402
from tests.server_utils import ServerProcess, free_port  # noqa: E402


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    args = ["--kv-cache-memory", "1GiB"]
    model = str(resolve_model(None))
    servers = [ServerProcess(model, *args), ServerProcess(model, *args, "--role", "decode")]
    colocated, decode = servers
    servers.append(ServerProcess(model, *args, "--role", "prefill", "--kv-port", str(free_port()),
                                 env={"ENGINE_KV_SHM": "1"}))
    servers.append(ServerProcess(model, *args, "--role", "prefill", "--kv-port", str(free_port()),
                                 env={"ENGINE_KV_SHM": "0"}))  # the default, stated
    proxies = [ProxyProcess([p.url], [decode.url]) for p in servers[2:]]
    targets = {"colocated": colocated.url, "shared-memory KV": proxies[0].url, "private KV": proxies[1].url}
    try:
        for url in targets.values():
            stream_latency(url, [100 + i for i in range(n)], 4)  # warm-up at this length
        ttfts: dict[str, list[float]] = {name: [] for name in targets}
        for r in range(8):
            prompt = [1000 + (r * 7919 + i * 31) % 40000 for i in range(n)]  # distinct: no prefix hits
            for name, url in targets.items():
                ttfts[name].append(stream_latency(url, prompt, 4)[0])
        base = statistics.median(ttfts["colocated"])
        for name, values in ttfts.items():
            median = statistics.median(values)
            print(f"{n} tokens, {name}: median TTFT {median * 1e3:.0f} ms ({median / base - 1:+.1%})")
    finally:
        for proc in [*proxies, *servers]:
            proc.stop()


if __name__ == "__main__":
    main()
