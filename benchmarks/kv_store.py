"""KV store tiers: TTFT for a 2k-token shared prefix followed by a short question, served by
recompute, the device prefix cache, and the CPU, disk and Redis tiers (one run, side by side);
the load bandwidth of each tier; and a multi-round chat workload (each turn re-sends the
history) with a PNG plot of TTFT per turn.

    python benchmarks/kv_store.py [--model PATH] [--prefix-tokens 2048] [--trials 3]

Everything runs in this process with SmolLM2 on the CPU; Redis is a redis-server of our own
on a free port. The device prefix cache is emptied before each tier measurement, so the tier
under test is the one that must supply the prefix.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import LLM, SamplingParams  # noqa: E402
from tests.server_utils import free_port  # noqa: E402

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def start_redis(tmp: str) -> tuple[subprocess.Popen, str]:
    import redis
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate([prompt], FIRST_TOKEN, use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def tier_table(model: str | None, prefix_tokens: int, trials: int, tmp: str, redis_url: str) -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 40000) for _ in range(prefix_tokens)]
    questions = [[rng.randrange(1000, 40000) for _ in range(24)] for _ in range(trials)]
    common = dict(kv_cache_memory="1GiB")
    setups = [
        ("recompute", dict(enable_prefix_caching=False), None),
        ("device prefix hit", {}, None),
        ("CPU tier", dict(kv_store="cpu:2GiB"), "cpu"),
        ("disk tier", dict(kv_store=f"disk:{tmp}/kv:10GiB"), "disk"),
        ("Redis tier (loopback)", dict(kv_store=redis_url), "redis"),
    ]
    rows = []
    for name, kwargs, tier in setups:
        llm = LLM(model, **common, **kwargs)
        ttft(llm, prefix + [7])  # warm-up, and the prefix is computed (and stored) once
        if tier is not None:
            llm.engine.runner.connector.wait_for_saves()
        times, cached = [], []
        for q in questions:
            if tier is not None:
                llm.engine.kv_cache_manager.pool.reset_prefix_cache()  # the tier must supply it
            t, c = ttft(llm, prefix + q)
            times.append(t)
            cached.append(c)
        bandwidth = None
        if tier is not None:
            # Load bandwidth of the tier alone: chunk bytes over the time its get()s took.
            stats = llm.engine.kv_connector_stats.stores[tier]
            bandwidth = stats["bytes_loaded"] / sum(stats["load_seconds"]) / 1e9
        rows.append((name, statistics.median(times), min(cached), bandwidth))
        llm.shutdown()
        del llm
        print(f"{name}: median TTFT {rows[-1][1] * 1e3:.0f} ms, cached tokens {rows[-1][2]}", flush=True)
    base = rows[0][1]
    print(f"\nTTFT, {prefix_tokens}-token shared prefix + a 24-token question (median of {trials}):\n")
    print("| served by | TTFT ms | speed-up vs recompute | cached tokens | tier load GB/s |")
    print("|---|---|---|---|---|")
    for name, t, c, gbps in rows:
        print(f"| {name} | {t * 1e3:.0f} | {base / t:.1f}x | {c} | {'' if gbps is None else f'{gbps:.2f}'} |")


def chat_workload(model: str | None, turns: int, conversations: int, tmp: str, plot: str | None) -> None:
    """Several conversations interleaved; each turn re-sends the whole history. The device pool
    is too small to keep every conversation, so without tiers most turns recompute."""
    rng = random.Random(1)
    setups = [("prefix cache only", {}), ("prefix cache + CPU tier", dict(kv_store="cpu:2GiB"))]
    reply = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    per_turn: dict[str, list[list[float]]] = {}
    for name, kwargs in setups:
        llm = LLM(model, kv_cache_memory="96MiB", **kwargs)  # ~2000 tokens of device KV
        tok = llm.get_tokenizer()
        histories = [[{"role": "system", "content": " ".join(f"fact{rng.randrange(10**6)}" for _ in range(80))}]
                     for _ in range(conversations)]
        times: list[list[float]] = [[] for _ in range(turns)]
        for turn in range(turns):
            for history in histories:
                history.append({"role": "user", "content": f"Question {turn}: " +
                                " ".join(f"w{rng.randrange(10**5)}" for _ in range(30))})
                prompt = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
                if hasattr(prompt, "input_ids"):
                    prompt = prompt["input_ids"]
                start = time.perf_counter()
                llm.generate([list(prompt)], FIRST_TOKEN, use_tqdm=False)
                times[turn].append(time.perf_counter() - start)
                out = llm.generate([list(prompt)], reply, use_tqdm=False)[0]
                history.append({"role": "assistant", "content": out.outputs[0].text})
        per_turn[name] = times
        llm.shutdown()
        rng = random.Random(1)  # the same conversations for the next setup
    print(f"\nMulti-round chat: {conversations} interleaved conversations, {turns} turns, device KV ~2k tokens; "
          "median TTFT per turn (ms):\n")
    names = [n for n, _ in setups]
    print("| turn | " + " | ".join(names) + " | speed-up |")
    print("|---|" + "---|" * (len(names) + 1))
    for turn in range(turns):
        meds = [statistics.median(per_turn[n][turn]) for n in names]
        print(f"| {turn + 1} | " + " | ".join(f"{m * 1e3:.0f}" for m in meds) + f" | {meds[0] / meds[-1]:.1f}x |")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for n in names:
            ax.plot(range(1, turns + 1), [statistics.median(t) * 1e3 for t in per_turn[n]], marker="o", label=n)
        ax.set_xlabel("turn")
        ax.set_ylabel("median TTFT (ms)")
        ax.set_title("Multi-round chat, SmolLM2 on CPU")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
        print(f"\nplot: {plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--plot", default="docs/kv_store_chat.png")
    parser.add_argument("--skip-chat", action="store_true")
    parser.add_argument("--skip-tiers", action="store_true")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="engine-kv-bench-")
    redis_proc, redis_url = start_redis(tmp)
    try:
        if not args.skip_tiers:
            tier_table(args.model, args.prefix_tokens, args.trials, tmp, redis_url)
        if not args.skip_chat:
            chat_workload(args.model, args.turns, args.conversations, tmp, args.plot)
    finally:
        redis_proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
