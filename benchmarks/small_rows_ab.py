"""bf16 decode steps of up to 4 rows: the native small_rows_linear kernel against oneDNN's packed
GEMM (what runs without --small-rows-linear), on a CPU with AVX512-BF16, interleaved in one run.

1. Kernels: every linear of a SmolLM2-shaped model (30 layers of qkv, o, gate_up, down, then the
   49,152-row output layer; distinct weights, so each is read from memory as in a real step) at
   1, 2 and 4 rows; ms per pass and the GB/s of weights read. Best of --rounds.
2. End to end (skipped with --kernels-only): benchmarks/workloads.py's offline workloads on the
   float checkpoint in bf16, each setting in its own process, alternating which goes first;
   output tok/s, best of --rounds.

    python benchmarks/small_rows_ab.py [--rounds 2] [--workload single varied uniform] [--kernels-only]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down
HEAD_SHAPE = (49152, 576)


def kernels(rounds: int) -> None:
    import torch
    from engine.worker import native
    ops = native.load("avx512")
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(30) for n, k in LAYER_SHAPES]
    weights.append(torch.randn(*HEAD_SHAPE, dtype=torch.bfloat16))
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    total = sum(w.numel() * w.element_size() for w in weights)
    print(f"kernels: {len(weights)} linears, {total / 2**20:.0f} MiB of bf16 weights per pass")
    for m in (1, 2, 4):
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (576, 1536)}

        def small_rows() -> None:
            for w in weights:
                ops.small_rows_linear(torch.empty(m, w.shape[0], dtype=torch.bfloat16), xs[w.shape[1]], w)

        def onednn() -> None:
            for w, p in zip(weights, packed):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
        best = {}
        for _ in range(rounds):
            for name, run in (("small_rows", small_rows), ("oneDNN", onednn)):
                run()
                start = time.perf_counter()
                run()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
        print(f"  {m} row(s): " + "  ".join(f"{name} {t * 1e3:.2f} ms ({total / t / 1e9:.1f} GB/s)"
                                           for name, t in best.items())
              + f"  oneDNN / small_rows {best['oneDNN'] / best['small_rows']:.2f}x", flush=True)


def engine_worker(choice: str, names: list[str]) -> None:
    from benchmarks.float_model import default_float_checkpoint
    from engine import LLM, SamplingParams
    from workloads import make_workload
    llm = LLM(str(default_float_checkpoint()), dtype="bfloat16", small_rows_linear=choice == "on", max_model_len=8192,
              enable_prefix_caching=False)
    rates = {}
    for name in names:
        work = make_workload(name, llm.engine.vocab_size, seed=0)
        prompts = [{"prompt_token_ids": p} for p, _ in work]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        rates[name] = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
    llm.shutdown()
    print(json.dumps(rates))


def end_to_end(rounds: int, names: list[str]) -> None:
    results: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(rounds):
        for choice in (("on", "off") if r % 2 == 0 else ("off", "on")):
            out = subprocess.run([sys.executable, __file__, "--worker", choice, "--workload", *names],
                                 capture_output=True, text=True, check=True).stdout
            results[choice].append(json.loads(out.strip().splitlines()[-1]))
            print(f"  round {r} {choice:3s} " + "  ".join(f"{n} {v:.1f}" for n, v in results[choice][-1].items()),
                  flush=True)
    print("\n| workload | oneDNN tok/s | small_rows tok/s | ratio |\n|---|---|---|---|")
    for name in names:
        on, off = (max(x[name] for x in results[c]) for c in ("on", "off"))
        print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workload", nargs="+", default=["single", "varied", "uniform"])
    parser.add_argument("--kernels-only", action="store_true")
    parser.add_argument("--worker", default=None, choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return engine_worker(args.worker, args.workload)
    from engine.worker import native
    if not native.small_rows_linear_supported():
        sys.exit("small_rows_linear needs the avx512 build on a CPU with AVX512-BF16")
    kernels(max(args.rounds, 3))
    if not args.kernels_only:
        end_to_end(args.rounds, args.workload)


if __name__ == "__main__":
    main()
