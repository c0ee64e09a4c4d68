"""Where a decode step's time goes: torch.profiler over decode steps of a batch of sequences.

    python benchmarks/profile_step.py [--dtype bfloat16|float32] [--seqs 32] [--prompt-len 128]
                                      [--steps 10] [--attention-backend auto|cpu|torch] [--model M]
                                      [--quantization int8|int4] [--compare-fused]

The model is the default one's float32 checkpoint (benchmarks/float_model.py: dense layers, as in
docs/performance.md's tables) unless --model says otherwise; `--model gguf` profiles the .gguf as
stored (its quantized kernel, docs/quantization.md).

Prints the profiler's table (self CPU time per op) and the wall time of a decode step measured
without the profiler. Host time (Python, metadata, dispatch) is the wall time minus the ops'.
With --compare-fused, instead: decode steps with the layers in one native call
(engine/worker/fused_decoder.py) and with the module loop, alternating in one process, best and
median of each and their ratio.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--model", default=None, help="a model path, or gguf (default: the float checkpoint)")
    parser.add_argument("--quantization", default=None, help="int8 or int4: quantize the float checkpoint at load")
    parser.add_argument("--compare-fused", action="store_true", help="fused layers against the module loop")
    args = parser.parse_args()

    from benchmarks.float_model import default_float_checkpoint
    model = None if args.model == "gguf" else args.model or str(default_float_checkpoint())
    llm = LLM(model, dtype=args.dtype, enable_prefix_caching=False, attention_backend=args.attention_backend,
              quantization=args.quantization)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=(13 if args.compare_fused else 3) * args.steps + 20,
                            ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(args.prompt_len)], params)
    warm = 0
    while engine.last_num_scheduled_tokens != args.seqs or warm < 10:  # past the prefills, warmed up
        engine.step()
        warm += 1
    if args.compare_fused:
        compare_fused(engine, args.steps)
        engine.abort_request([f"r{i}" for i in range(args.seqs)])
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    print(f"decode step ({args.seqs} sequences, ~{args.prompt_len + 10}-token contexts, {args.dtype}): "
          f"{(time.perf_counter() - start) / args.steps * 1e3:.1f} ms wall")
    engine.abort_request([f"r{i}" for i in range(args.seqs)])


def compare_fused(engine, steps: int, rounds: int = 6) -> None:
    model = engine.core.runner.model
    fused = model.fused
    if fused is None:
        raise SystemExit("this model's layers do not run as one native call (the log says why)")
    times = {"fused": [], "loop": []}
    try:
        for _ in range(rounds):
            for way, value in (("fused", fused), ("loop", None)):
                model.fused = value
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[way].append((time.perf_counter() - start) / steps * 1e3)
    finally:
        model.fused = fused
    for way, ms in times.items():
        print(f"{way:6s} best {min(ms):.2f} ms/step, median {sorted(ms)[len(ms) // 2]:.2f}")
    print(f"loop / fused: {min(times['loop']) / min(times['fused']):.2f}x (best)")


if __name__ == "__main__":
    main()
