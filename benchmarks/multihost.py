"""P->D across hosts: TTFT overhead and the first->second token gap over a veth link at full
rate, 1 Gbit/s and 100 Mbit/s (tc tbf), for 512- and 2048-token prompts, with and without
--kv-encrypt, next to a single instance on the same machine (issue 29).

Each host is a network namespace with its own hostname and address (tests/multihost.py); the
rate applies to the prefill host's link, which the KV crosses. Rates and the single instance
are interleaved request by request. Prints, per row, the median of --requests streamed
requests, the KV bytes per token, and the pull time bytes / rate predicts. Needs root.

    sudo python benchmarks/multihost.py [--model M] [--requests 3] [--lengths 512 2048]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from tests import multihost  # noqa: E402
from tests.disagg_utils import ProxyProcess  # noqa: E402
from tests.server_utils import REPO, ServerProcess  # noqa: E402

RATES = {"full": None, "1 Gbit/s": "1gbit", "100 Mbit/s": "100mbit"}
RATE_BITS = {"1 Gbit/s": 1e9, "100 Mbit/s": 1e8}


def streamed(url: str, prompt: list[int]) -> tuple[float, float]:
    """(time to the first token, gap between the first and the second token) of one request."""
    start = time.perf_counter()
    times = []
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                times.append(time.perf_counter() - start)
    return times[0], times[1] - times[0]


def fresh_prompt(n: int, *seeds: int) -> list[int]:
    """A prompt no instance has cached (every request gets its own)."""
    seed = hash(seeds) % 100_003
    return [(seed * 7919 + k * 104729 + n) % 40000 + 3 for k in range(n)]


def run(model: str, encrypt: bool, lengths: list[int], requests: int, tmp: Path) -> list[dict]:
    network = multihost.Network()
    servers = []
    try:
        p_host, d_host, x_host, s_host = (network.add(n) for n in ("prefill", "decode", "proxy", "single"))
        secret = tmp / "secret"
        if not secret.exists():
            subprocess.run([sys.executable, "-m", "entrypoints.cli", "secret", str(secret)], cwd=REPO, check=True,
                           capture_output=True)
        extra = ("--kv-secret-file", str(secret), *(("--kv-encrypt",) if encrypt else ()))
        args = (model, "--max-model-len", "4096", "--num-blocks", "1024", "--served-model-name", "m")
        prefill = ServerProcess(*args, "--role", "prefill", "--kv-port", "14579", "--kv-ip", p_host.address,
                                *extra, host=p_host, wait=False, startup_timeout=600)
        decode = ServerProcess(*args, "--role", "decode", *extra, host=d_host, wait=False, startup_timeout=600)
        single = ServerProcess(*args, host=s_host, wait=False, startup_timeout=600)
        servers += [prefill, decode, single]
        for server in servers:
            server.wait_ready()
        proxy = ProxyProcess([prefill.url], [decode.url], host=x_host)
        servers.append(proxy)
        rows = []
        for n in lengths:
            samples = {name: [] for name in RATES}
            samples["single"] = []
            for i in range(requests + 1):  # the first round warms up
                for j, (name, rate) in enumerate(RATES.items()):
                    if rate is None:
                        p_host.unlimit()
                    else:
                        p_host.limit(rate)
                    before = decode.status()["kv_transfer"]["bytes"]
                    ttft, gap = streamed(proxy.url, fresh_prompt(n, encrypt, i, j))
                    moved = decode.status()["kv_transfer"]["bytes"] - before
                    if i:
                        samples[name].append((ttft, gap, moved))
                p_host.unlimit()
                ttft, gap = streamed(single.url, fresh_prompt(n, encrypt, i, -1))
                if i:
                    samples["single"].append((ttft, gap, 0))
            single_ttft = statistics.median(s[0] for s in samples["single"])
            for name in RATES:
                ttft = statistics.median(s[0] for s in samples[name])
                gap = statistics.median(s[1] for s in samples[name])
                moved = statistics.median(s[2] for s in samples[name])
                predicted = moved * 8 / RATE_BITS[name] if name in RATE_BITS else None
                rows.append({"encrypt": encrypt, "tokens": n, "link": name, "ttft_s": ttft,
                             "ttft_overhead_s": ttft - single_ttft, "gap_s": gap, "kv_bytes": moved,
                             "kv_bytes_per_token": moved / n, "predicted_pull_s": predicted,
                             "single_ttft_s": single_ttft})
        return rows
    finally:
        for server in reversed(servers):
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait(10)
        network.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the engine's default model")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    args = parser.parse_args()
    why = multihost.unavailable()
    if why:
        sys.exit(f"cannot make hosts here: {why}")
    model = args.model
    if model is None:
        from engine.worker.loader import default_model_path
        model = str(default_model_path())
    tmp = Path(f"/tmp/engine-multihost-bench-{time.time_ns()}")
    tmp.mkdir()
    try:
        rows = [row for encrypt in (False, True) for row in run(model, encrypt, args.lengths, args.requests, tmp)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("| KV | prompt | link | TTFT | TTFT overhead vs single | 1st->2nd token | KV bytes/token | "
          "bytes / rate |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        predicted = f"{r['predicted_pull_s']:.3f} s" if r["predicted_pull_s"] is not None else "-"
        print(f"| {'CURVE' if r['encrypt'] else 'plain'} | {r['tokens']} | {r['link']} | {r['ttft_s']:.3f} s | "
              f"{r['ttft_overhead_s']:+.3f} s | {r['gap_s']:.3f} s | {r['kv_bytes_per_token']:.0f} | {predicted} |")


if __name__ == "__main__":
    main()
