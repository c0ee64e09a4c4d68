"""`engine serve` against `vllm serve` (vLLM's CPU build, its own venv) on this host, driven by
vLLM's own client (`vllm bench serve`) in one run, interleaved.

Both servers start once, as a user starts them (defaults, the same model directory, dtype and
served name; vLLM's OpenMP threads bound to this host's cores as its docs say). While one is
measured the other's processes are stopped (SIGSTOP, then SIGCONT), so an idle server's
polling never takes the measured one's cores. Both serve the same float checkpoint (the default
model's .gguf dequantized, benchmarks/float_model.py), at the same context length.

For each rate (alternating who goes first): random --input-len -> --output-len prompts,
--num-prompts of them, `--ignore-eos`; then the long-prompt set, random --long-input-len ->
--output-len at each --long-rates value, --long-num-prompts of them. Goodput counts the
requests with TTFT <= 1 s and TPOT <= 100 ms (`vllm bench serve --goodput`), per second.

    python benchmarks/serve_peers.py [--dtype bfloat16] [--rates 1 2 4 8] [--num-prompts 32]
        [--input-len 512] [--output-len 128] [--long-rates 0.25 0.5] [--long-input-len 3000]
        [--long-num-prompts 12] [--rounds 1] [--engine-args "..."]

Targets (issue 47): at every rate, output throughput and goodput >= vLLM's, TTFT and TPOT
medians no worse.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from serve_layouts import KEYS, VLLM_PYTHON, median_by_throughput, vllm_bench  # noqa: E402
from entrypoints.launcher import wait_healthy  # noqa: E402
from tests.server_utils import free_port  # noqa: E402

SERVED_NAME = "SmolLM2-135M-Instruct"
GOODPUT = ["--goodput", "ttft:1000", "tpot:100"]  # ms


def bench(url: str, model_dir: str, rate: float, num_prompts: int, seed: int, input_len: int,
          output_len: int) -> dict:
    return vllm_bench(url, model_dir, [
        "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--ignore-eos", "--seed", str(seed),
        *GOODPUT])


class Server:
    def __init__(self, name: str, argv: list[str], env: dict | None = None) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([*argv, "--port", str(self.port)], cwd=HERE.parent, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})})

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rates", type=float, nargs="*", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--long-rates", type=float, nargs="*", default=[0.25, 0.5])
    parser.add_argument("--long-input-len", type=int, default=3000)
    parser.add_argument("--long-num-prompts", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1, help="the median round per rate is shown")
    parser.add_argument("--engine-args", default="", help="extra flags for engine serve")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        subprocess.run(["bash", str(HERE / "peer_venv.sh")], check=True)

    from benchmarks.float_model import default_float_checkpoint
    model_dir = str(default_float_checkpoint())  # vLLM reads float checkpoints only
    cores = f"0-{len(os.sched_getaffinity(0)) - 1}"
    servers = [
        Server("engine", [sys.executable, "-m", "entrypoints.cli", "serve", model_dir, "--served-model-name",
                          SERVED_NAME, "--dtype", args.dtype, "--max-model-len", "4096",
                          *args.engine_args.split()]),
        Server("vllm", [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                        "--served-model-name", SERVED_NAME, "--dtype", args.dtype, "--max-model-len", "4096",
                        "--seed", "0"],
               env={"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
                    "VLLM_TARGET_DEVICE": "cpu"}),
    ]
    results: dict[tuple[str, float], list[dict]] = {}
    try:
        for server in servers:
            wait_healthy(server.url, server.proc, 900)
        for server in servers:  # warm-up, then asleep until its turn
            bench(server.url, model_dir, float("inf"), 4, 99, args.input_len, 16)
            server.signal(signal.SIGSTOP)
        print(f"vllm bench serve: {args.num_prompts} prompts per rate, random {args.input_len}->{args.output_len}; "
              f"{args.long_num_prompts} per long rate, {args.long_input_len}->{args.output_len}; {args.dtype}",
              flush=True)
        sets = [(rate, args.num_prompts, args.input_len) for rate in args.rates] + \
               [(rate, args.long_num_prompts, args.long_input_len) for rate in args.long_rates]
        for r in range(args.rounds):
            for i, (rate, num_prompts, input_len) in enumerate(sets):
                for server in (servers if (i + r) % 2 == 0 else servers[::-1]):
                    server.signal(signal.SIGCONT)
                    time.sleep(1.0)
                    try:
                        summary = bench(server.url, model_dir, rate, num_prompts, 1000 * r + i, input_len,
                                        args.output_len)
                    finally:
                        server.signal(signal.SIGSTOP)
                    results.setdefault((server.name, rate, input_len), []).append(summary)
                    print(f"  round {r} {input_len}->{args.output_len} rate {rate:g} {server.name:6s} "
                          + "  ".join(f"{k} {summary[k]:.1f}" for k in (*KEYS, "request_goodput")), flush=True)
    finally:
        for server in servers:
            server.stop()

    def median(name: str, rate: float, input_len: int) -> dict:
        return median_by_throughput(results[name, rate, input_len])

    print("\n| prompt | req/s | server | TTFT median / p99 ms | TPOT median ms | ITL p99 ms | output tok/s "
          "| goodput req/s |")
    print("|---|---|---|---|---|---|---|---|")
    verdicts = []
    for rate, _, input_len in sets:
        ours, theirs = median("engine", rate, input_len), median("vllm", rate, input_len)
        for name, s in (("vllm serve", theirs), ("engine serve", ours)):
            print(f"| {input_len} | {rate:g} | {name} | {s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | "
                  f"{s['median_tpot_ms']:.1f} | {s['p99_itl_ms']:.0f} | {s['output_throughput']:.1f} | "
                  f"{s['request_goodput']:.2f} |")
        tput = ours["output_throughput"] / theirs["output_throughput"]
        ttft = ours["median_ttft_ms"] / theirs["median_ttft_ms"]
        tpot = ours["median_tpot_ms"] / theirs["median_tpot_ms"]
        good = ours["request_goodput"] >= theirs["request_goodput"]
        met = tput >= 1.0 and ttft <= 1.0 and tpot <= 1.0 and good
        verdicts.append(f"{input_len} tokens at {rate:g} req/s: throughput {tput:.2f}x, TTFT median {ttft:.2f}x, "
                        f"TPOT median {tpot:.2f}x of vLLM's, goodput {ours['request_goodput']:.2f} vs "
                        f"{theirs['request_goodput']:.2f} req/s ({'met' if met else 'MISSED'})")
    print("\n".join(["", *verdicts]))


if __name__ == "__main__":
    main()
