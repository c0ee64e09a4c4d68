"""Attention backends against the torch backend on random paged inputs, and greedy SmolLM2 on
CUDA against the CPU. Run by benchmarks/gpu_check.sh on a GPU; `--device cpu` checks the script
itself (torch backend only).

    python benchmarks/gpu_kernels.py [--device cuda] [--smollm2]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.worker.attention import StepAttention  # noqa: E402
from engine.worker.backends import AUTO_ORDER, select_backend, unavailable_reason  # noqa: E402


def random_step(device, dtype, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, seed=0):
    """A step mixing decodes and chunked prefills with context, on shuffled block tables."""
    rng = random.Random(seed)
    shapes = [(rng.randint(1, 900), 1) for _ in range(12)] + [(rng.randint(0, 600), rng.randint(2, 300))
                                                             for _ in range(4)]
    rng.shuffle(shapes)  # decodes and prefills mixed, as the runner's rows come
    blocks_needed = [-(-(c + q) // block_size) for c, q in shapes]
    ids = list(range(sum(blocks_needed) + 8))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in blocks_needed:
        tables.append(ids[start:start + n])
        start += n
    g = torch.Generator(device="cpu").manual_seed(seed)
    num_tokens = sum(q for _, q in shapes)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(device, dtype)
    cache = torch.randn(2, len(ids), block_size, num_kv_heads, head_dim, generator=g).to(device, dtype)
    return shapes, tables, q, k, v, cache


def check_kernels(device: torch.device) -> bool:
    ok = True
    print("| backend | dtype | sliding window | max abs diff vs torch | ms per call |")
    print("|---|---|---|---|---|")
    for dtype in ([torch.bfloat16, torch.float16] if device.type == "cuda" else [torch.float32, torch.bfloat16]):
        for window in (None, 128):
            shapes, tables, q, k, v, cache = random_step(device, dtype)
            ref = None
            for name in AUTO_ORDER[::-1]:  # torch first: it is the reference
                reason = unavailable_reason(name, device, dtype, q.shape[-1])
                if reason is not None:
                    print(f"| {name} | {dtype} | {window} | unavailable: {reason} | |")
                    continue
                backend = select_backend(name, device, dtype, 16, q.shape[-1])
                step, _ = StepAttention.from_lists([s[1] for s in shapes], [s[0] for s in shapes], tables, 16, device)
                meta = backend.build_metadata(step, window)
                kv = cache.clone()
                out = backend.forward(q, k, v, kv, meta, q.shape[-1] ** -0.5)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(10):
                    backend.forward(q, k, v, kv, meta, q.shape[-1] ** -0.5)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                ms = (time.perf_counter() - start) * 100
                if ref is None:
                    ref = out.float()
                diff = (out.float() - ref).abs().max().item()
                good = diff < (2e-2 if dtype != torch.float32 else 1e-4)
                ok &= good
                print(f"| {name} | {dtype} | {window} | {diff:.2e}{'' if good else ' MISMATCH'} | {ms:.2f} |")
    return ok


def check_smollm2(device: torch.device, max_tokens: int = 16) -> bool:
    from engine import LLM, SamplingParams
    prompts = ["The capital of France is", "def fibonacci(n):", "Three facts about the moon:"]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(device="cpu", num_blocks=256).generate(prompts, params, use_tqdm=False)]
    ok = True
    for dtype in ("float32", "bfloat16"):
        llm = LLM(device=str(device), dtype=dtype, num_blocks=256)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for prompt, a, b in zip(prompts, cpu, outs):
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            print(f"SmolLM2 {device.type} {dtype} ({llm.engine.runner.backend.name}): {prompt!r} first {same} of "
                  f"{len(a)} tokens equal the CPU")
            ok &= same >= (8 if dtype == "float32" else 4)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smollm2", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    ok = check_smollm2(device) if args.smollm2 else check_kernels(device)
    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
