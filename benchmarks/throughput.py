"""Offline throughput: engine.LLM.generate against HF transformers generate, same workload, one run.

    python benchmarks/throughput.py [--model PATH] [--workload uniform varied single] [--skip-hf]

HF runs batched (max_batch 32, left-padded, greedy, no EOS stop); each of its batches generates
the longest max_tokens of the batch, and only the requested tokens are counted for either side.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.workloads import make_workload  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from benchmarks.float_model import default_float_checkpoint  # noqa: E402
from engine.worker.loader import resolve_model  # noqa: E402


def run_engine(llm: LLM, work) -> float:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [m for _, m in work]
    return elapsed


def run_hf(model, work, max_batch: int = 32) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), max_batch):
            batch = work[i:i + max_batch]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(batch):  # left padding
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            model.generate(ids, attention_mask=mask, max_new_tokens=max(m for _, m in batch), do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--workload", nargs="+", default=["uniform", "varied", "single"])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    # transformers reads float checkpoints only: the default is the .gguf dequantized to float32.
    model_dir = resolve_model(args.model) if args.model else default_float_checkpoint()
    llm = LLM(str(model_dir), kv_cache_memory="2GiB")
    vocab = llm.engine.vocab_size
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    # Warm both up once so neither pays first-call costs inside the timing.
    warm = make_workload("uniform", vocab, seed=99)[:4]
    run_engine(llm, [(p, 8) for p, _ in warm])
    if hf is not None:
        run_hf(hf, [(p, 8) for p, _ in warm])

    rows = []
    for name in args.workload:
        work = make_workload(name, vocab)
        out_tokens = sum(m for _, m in work)
        ours = run_engine(llm, work)
        theirs = run_hf(hf, work) if hf is not None else float("nan")
        rows.append((name, len(work), out_tokens, out_tokens / ours, out_tokens / theirs, theirs / ours))
        print(f"{name}: engine {ours:.1f}s, HF {theirs:.1f}s", flush=True)

    print(f"\nmodel {model_dir.name}, {torch.get_num_threads()} threads, fp32, greedy\n")
    print("| workload | requests | output tokens | engine tok/s | HF tok/s | engine / HF |")
    print("|---|---|---|---|---|---|")
    for name, n, toks, ours, theirs, ratio in rows:
        print(f"| {name} | {n} | {toks} | {ours:.1f} | {theirs:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
