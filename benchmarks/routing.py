"""Routing across replicas on real work: multi-turn chats through `engine proxy --instance ...`.

Four `engine serve` instances (pinned round-robin to this host's cores, one torch thread each),
each with a KV pool too small to hold every conversation (--num-blocks, default 48 blocks = 768
tokens), behind `engine proxy --routing POLICY`, for
kv-aware, least-loaded and round-robin; then one instance with 4x the pool, no proxy, as the
reference. The workload: --conversations chats of --turns turns, interleaved (--concurrency
at a time); every turn resends the whole history (the user's new message plus the model's
answers so far), streamed, greedy. Fresh instances per policy.

Policies ray-kv-aware and ray-least-loaded run the same replicas as `engine ray-serve
--prefill-replicas 0 --decode-replicas 4 --routing kv-aware|least-loaded` on a local Ray
cluster of 4 one-CPU nodes (benchmarks/ray_local.py; needs `pip install 'engine[ray]'`): Serve
places one replica per node and routes through the engine's request router or its own; the
replicas are not pinned to a core (Ray gives each a CPU, not a core).

Reported per policy: prefix-cache hit rate (cached prompt tokens / prompt tokens, from each
answer's usage.prompt_tokens_details.cached_tokens), TTFT median and p99, and the spread of
load (prompt tokens per instance, max / mean). Targets (issue 17): kv-aware hit rate >= 90% of
the single big instance's; TTFT median >= 2x better than least-loaded; max load <= 1.5x mean.

    python benchmarks/routing.py [--conversations 16] [--turns 6] [--concurrency 4] [--num-blocks 48]
        [--policies kv-aware ray-kv-aware single ...]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from entrypoints.launcher import wait_healthy  # noqa: E402
from tests.server_utils import free_port  # noqa: E402

WORDS = ("river stone garden light window paper music winter orange market letter forest engine "
         "silver question answer morning travel island bridge story doctor planet village").split()


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="routing-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "entrypoints.cli", *args, "--port", str(port)],
                            cwd=HERE.parent, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def message(rng: random.Random, turn: int, words: int, first_words: int | None = None) -> str:
    if turn == 0 and first_words is not None:
        words = first_words
    return f"Turn {turn}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + ". Summarise the above."


async def chat_turn(http: httpx.AsyncClient, url: str, history: list[dict], max_tokens: int) -> dict:
    body = {"messages": history, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, text, usage = time.perf_counter(), None, "", None
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                text += piece
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft, "text": text, "prompt_tokens": (usage or {}).get("prompt_tokens", 0), "cached": cached}


async def run_workload(url: str, conversations: int, turns: int, concurrency: int, max_tokens: int,
                       words: int, first_words: int | None) -> list[dict]:
    rngs = [random.Random(1000 + c) for c in range(conversations)]
    histories: list[list[dict]] = [[] for _ in range(conversations)]
    results: list[dict] = []
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as http:
        for turn in range(turns):  # interleaved: every conversation takes its turn, then the next round
            async def one(c: int) -> None:
                async with limit:
                    histories[c].append({"role": "user", "content": message(rngs[c], turn, words, first_words)})
                    result = await chat_turn(http, url, histories[c], max_tokens)
                    histories[c].append({"role": "assistant", "content": result["text"]})
                    results.append(result)
            # Conversations come back in a different order every round, as users do (in a fixed
            # order, round-robin would send each one to the same replica by accident).
            order = list(range(conversations))
            random.Random(turn).shuffle(order)
            await asyncio.gather(*(one(c) for c in order))
    return results


def instance_load(urls: list[str]) -> list[int]:
    """Prompt tokens each instance served (its engine:prompt_tokens_total)."""
    loads = []
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        loads.append(int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                             if line.startswith("engine:prompt_tokens_total"))))
    return loads


def summarize(name: str, results: list[dict], loads: list[int] | None) -> dict:
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    prompt = sum(r["prompt_tokens"] for r in results)
    row = {"policy": name, "requests": len(results), "hit_rate": sum(r["cached"] for r in results) / max(prompt, 1),
           "ttft_median": statistics.median(ttfts), "ttft_p99": ttfts[int(0.99 * (len(ttfts) - 1))],
           "load_max_over_mean": (max(loads) / statistics.mean(loads)) if loads and sum(loads) else None,
           "loads": loads}
    print(f"  {name:14s} hit rate {row['hit_rate']:.1%}  TTFT median {row['ttft_median'] * 1e3:.0f} ms  "
          f"p99 {row['ttft_p99'] * 1e3:.0f} ms  load {loads}", flush=True)
    return row


def run_on_ray(policy: str, args, common: list[str]) -> dict:
    """The replicas as decode replicas of `engine ray-serve` (no prefill deployment), one per node."""
    from benchmarks.ray_local import ray_serve_app
    from engine.worker.loader import resolve_model

    options = {"model": str(resolve_model(args.model)), "prefill_replicas": (0, 0),
               "decode_replicas": (args.instances, args.instances), "routing": policy[len("ray-"):],
               "engine_args": [*common, "--num-blocks", str(args.num_blocks)]}
    with ray_serve_app(options, nodes=args.instances) as (url, _, _):  # every replica running
        if policy == "ray-kv-aware":  # until the ingress follows every replica's KV events
            httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=60)
            deadline = time.monotonic() + 60
            while len(httpx.get(f"{url}/status", timeout=10).json()["kv_routing"]) < args.instances:
                assert time.monotonic() < deadline, httpx.get(f"{url}/status", timeout=10).text
                time.sleep(1)
        results = asyncio.run(run_workload(url, args.conversations, args.turns, args.concurrency, args.max_tokens,
                                           args.words, args.first_words))
        engines = [i["url"] for i in (httpx.get(f"{url}/status", timeout=10).json()["kv_routing"] or [])]
        return summarize(policy, results, instance_load(engines) if engines else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=48, help="KV blocks per replica (the reference gets 4x)")
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--policies", nargs="+", default=["kv-aware", "least-loaded", "round-robin", "single"])
    parser.add_argument("--words", type=int, default=60, help="words per user message")
    parser.add_argument("--first-words", type=int, default=None,
                        help="words in each conversation's first message (default --words): e.g. a document "
                             "the later turns ask about")
    parser.add_argument("--kv-load-weight", type=float, default=None, help="the proxy's, if not its default")
    args = parser.parse_args()
    model = [args.model] if args.model else []
    common = ["--max-model-len", "2048", "--max-num-seqs", "16"]
    cores = sorted(os.sched_getaffinity(0))
    rows = []
    for policy in args.policies:
        procs = []
        try:
            if policy.startswith("ray-"):
                rows.append(run_on_ray(policy, args, common))
                continue
            if policy == "single":
                proc, url = start(["serve", *model, *common, "--num-blocks", str(args.num_blocks * args.instances)])
                procs.append(proc)
                wait_healthy(url, proc)
                results = asyncio.run(run_workload(url, args.conversations, args.turns, args.concurrency,
                                                   args.max_tokens, args.words, args.first_words))
                rows.append(summarize("single (4x pool)", results, None))
                continue
            urls = []
            for i in range(args.instances):
                events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}",
                          "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
                # Replicas share the host's cores: each is pinned to one, with one torch thread
                # (unpinned, N replicas' OpenMP teams oversubscribe the cores and all collapse).
                proc, url = start(["serve", *model, *common, "--num-blocks", str(args.num_blocks),
                                   "--kv-events-config", json.dumps(events),
                                   "--cpu-cores", str(cores[i % len(cores)]), "--num-threads", "1"])
                procs.append(proc)
                urls.append(url)
            for proc, url in zip(procs, urls):
                wait_healthy(url, proc)
            weight = ["--kv-load-weight", str(args.kv_load_weight)] if args.kv_load_weight is not None else []
            proxy, proxy_url = start(["proxy", *[a for u in urls for a in ("--instance", u)], "--routing", policy,
                                      *weight])
            procs.append(proxy)
            wait_healthy(proxy_url, proxy, timeout=60)
            time.sleep(2)  # the kv-aware proxy subscribes to every instance
            results = asyncio.run(run_workload(proxy_url, args.conversations, args.turns, args.concurrency,
                                               args.max_tokens, args.words, args.first_words))
            rows.append(summarize(policy, results, instance_load(urls)))
        finally:
            stop(procs)
    print(f"\n{args.conversations} conversations x {args.turns} turns ({args.first_words or args.words} words in the "
          f"first message, {args.words} in the others), {args.concurrency} at a time, "
          f"{args.instances} replicas of {args.num_blocks} blocks each:\n")
    print("| routing | prefix-cache hit rate | TTFT median ms | TTFT p99 ms | load max / mean |")
    print("|---|---|---|---|---|")
    for r in rows:
        spread = f"{r['load_max_over_mean']:.2f}" if r["load_max_over_mean"] else "-"
        print(f"| {r['policy']} | {r['hit_rate']:.1%} | {r['ttft_median'] * 1e3:.0f} | {r['ttft_p99'] * 1e3:.0f} "
              f"| {spread} |")
    by = {r["policy"]: r for r in rows}
    if {"kv-aware", "least-loaded"} <= by.keys():
        kv, ll = by["kv-aware"], by["least-loaded"]
        print(f"\nkv-aware TTFT median {ll['ttft_median'] / kv['ttft_median']:.2f}x better than least-loaded "
              f"(target >= 2x); load max/mean {kv['load_max_over_mean']:.2f} (target <= 1.5)")
    single = next((r for r in rows if r["policy"].startswith("single")), None)
    if single and "kv-aware" in by:
        print(f"kv-aware hit rate {by['kv-aware']['hit_rate'] / max(single['hit_rate'], 1e-9):.0%} of the single "
              "big instance's (target >= 90%)")
    if single and "ray-kv-aware" in by:
        ray_rate = by["ray-kv-aware"]["hit_rate"]
        print(f"ray-kv-aware hit rate {ray_rate / max(single['hit_rate'], 1e-9):.0%} of the single big instance's "
              "(target >= 90%)" + (f", {ray_rate / max(by['kv-aware']['hit_rate'], 1e-9):.0%} of engine proxy's "
                                   "kv-aware (target >= 90%)" if "kv-aware" in by else ""))


if __name__ == "__main__":
    main()
