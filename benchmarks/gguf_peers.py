"""The default GGUF (SmolLM2-135M-Instruct Q4_1) on this engine and on llama.cpp, side by side,
interleaved in one run, with our float paths beside them:

    python benchmarks/gguf_peers.py [--rounds 2] [--threads 2] [--quantized-float] [--workloads single,...]

Sides (each its own process, loaded once; benchmarks/gguf_peer_worker.py):
  llama_cpp   llama-cpp-python on the .gguf (its own venv: benchmarks/llama_cpp_venv.sh, built
              on first use, never a dependency)
  ours        this engine on the .gguf, weights as stored (Q4_1 layers, Q8_0 embedding), bf16 or
              fp32 activations as --dtype auto picks
  ours_fp32   this engine on the same weights dequantized to a float32 safetensors checkpoint
              (benchmarks/float_model.py), dense float32: "our fp32 path"
  with --quantized-float, also on that float checkpoint: ours_bf16 (dense bfloat16), ours_int8
  and ours_int4 (--quantization at load, bfloat16 activations)

Workloads (greedy, EOS ignored, random token prompts): single (one stream, 32-token prompt, 256
new tokens: decode tok/s), prefill (one 1,024-token prompt, 1 new token: prompt tok/s), streams8
(8 streams of 32 -> 128: total tok/s). Each round runs every workload on every side, in an order
that alternates between rounds; the best round per side counts. Also printed: load time, the
resident memory a side's process gained by loading the model (RSS after minus before), and how
far the greedy tokens of ours and llama.cpp agree.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.worker_process import WorkerProcess  # noqa: E402

WORKLOADS = {"single": (1, 32, 256), "prefill": (1, 1024, 1), "streams8": (8, 32, 128)}  # streams, prompt, new


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="auto", help="our activations on the .gguf (default auto)")
    parser.add_argument("--quantized-float", action="store_true",
                        help="also bf16, int8 and int4 on the float checkpoint")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="a comma-separated subset of "
                        + ", ".join(WORKLOADS))
    parser.add_argument("--llama-cpp-venv", default=str(HERE / ".llama-cpp-venv"))
    args = parser.parse_args()
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {', '.join(sorted(unknown))} (choose from {', '.join(WORKLOADS)})")
    workloads = {name: WORKLOADS[name] for name in args.workloads.split(",")}

    from benchmarks.float_model import default_float_checkpoint
    from engine.worker.loader import default_model_path
    gguf_path, float_dir = default_model_path(), default_float_checkpoint()
    venv = subprocess.run(["bash", str(HERE / "llama_cpp_venv.sh"), args.llama_cpp_venv], check=True,
                          stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
    common = ["--threads", str(args.threads)]
    specs = {"llama_cpp": (f"{venv}/bin/python", ["--side", "llama_cpp", "--model", str(gguf_path)]),
             "ours": (sys.executable, ["--side", "ours", "--model", str(gguf_path), "--dtype", args.dtype]),
             "ours_fp32": (sys.executable, ["--side", "ours", "--model", str(float_dir), "--dtype", "float32"])}
    if args.quantized_float:
        for name, extra in (("ours_bf16", []), ("ours_int8", ["--quantization", "int8"]),
                            ("ours_int4", ["--quantization", "int4"])):
            specs[name] = (sys.executable, ["--side", "ours", "--model", str(float_dir), "--dtype", "bfloat16", *extra])
    sides = {}
    try:
        for name, (python, worker_args) in specs.items():
            sides[name] = WorkerProcess(name, [python, str(HERE / "gguf_peer_worker.py"), *worker_args, *common],
                                        {**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            print(f"{name}: loaded in {sides[name].info['load_s']:.1f} s", flush=True)
        vocab = sides["ours"].info["vocab"]
        best: dict[tuple[str, str], float] = {}
        outputs: dict[str, list[list[int]]] = {}
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for workload, (streams, prompt_len, new) in workloads.items():
                rng = random.Random(round_ * 100 + len(workload))
                prompts = [[rng.randrange(100, vocab - 100) for _ in range(prompt_len)] for _ in range(streams)]
                for name in order:
                    answer = sides[name].request({"prompts": prompts, "max_tokens": new})
                    rate = streams * (prompt_len if workload == "prefill" else new) / answer["seconds"]
                    best[name, workload] = max(best.get((name, workload), 0.0), rate)
                    if workload == "single" and round_ == 0:
                        outputs[name] = answer["tokens"][0]
                    print(f"round {round_ + 1} {workload:9s} {name:10s} {rate:8.1f} tok/s", flush=True)
    finally:
        for side in sides.values():
            side.close()

    print(f"\n{'workload':10s}" + "".join(f"{name:>12s}" for name in sides) + "   ours/llama.cpp  ours/ours_fp32")
    for workload in workloads:
        row = "".join(f"{best[name, workload]:12.1f}" for name in sides)
        print(f"{workload:10s}{row}   {best['ours', workload] / best['llama_cpp', workload]:13.2f}x"
              f"  {best['ours', workload] / best['ours_fp32', workload]:13.2f}x")
    if args.quantized_float and "single" in workloads:
        for name in ("ours_int8", "ours_int4"):
            print(f"{name} / ours_bf16 single-stream: {best[name, 'single'] / best['ours_bf16', 'single']:.2f}x")
    print("load s: " + ", ".join(f"{n} {s.info['load_s']:.1f}" for n, s in sides.items()))
    print("resident MiB gained by loading (of which KV pool): " + ", ".join(
        f"{n} {s.info['rss_bytes'] / 2**20:.0f} ({s.info['kv_bytes'] / 2**20:.0f})" for n, s in sides.items()))
    print(f"GGUF file: {gguf_path.stat().st_size / 2**20:.0f} MiB")
    if "single" in workloads:
        print(f"greedy agreement on the single stream (leading tokens of 256): ours vs llama.cpp "
              f"{agreement(outputs['ours'], outputs['llama_cpp'])}, ours vs ours_fp32 "
              f"{agreement(outputs['ours'], outputs['ours_fp32'])}")


if __name__ == "__main__":
    main()
