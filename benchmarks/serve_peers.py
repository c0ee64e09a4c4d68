"""`engine serve` against `vllm serve` (vLLM's CPU build, its own venv) on this host, driven by
vLLM's own client (`vllm bench serve`) in one run, interleaved.

Both servers start once, as a user starts them (defaults, the same model directory, dtype and
served name; vLLM's OpenMP threads bound to this host's cores as its docs say). While one is
measured the other's processes are stopped (SIGSTOP, then SIGCONT), so an idle server's
polling never takes the measured one's cores. For each rate (alternating who goes first):
random --input-len -> --output-len prompts, --num-prompts of them, `--ignore-eos`.

    python benchmarks/serve_peers.py [--dtype bfloat16] [--rates 1 2 4] [--num-prompts 32]
        [--input-len 512] [--output-len 128] [--rounds 1]

Targets (issue 26): at every rate, output throughput >= vLLM's, TTFT and TPOT medians no worse.
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

from serve_layouts import KEYS, VLLM_PYTHON, median_by_throughput, run_client  # noqa: E402
from entrypoints.launcher import wait_healthy  # noqa: E402
from tests.server_utils import free_port  # noqa: E402

SERVED_NAME = "SmolLM2-135M-Instruct"


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
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="the median round per rate is shown")
    parser.add_argument("--engine-args", default="", help="extra flags for engine serve")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        subprocess.run(["bash", str(HERE / "peer_venv.sh")], check=True)

    from benchmarks.float_model import default_float_checkpoint
    model_dir = str(default_float_checkpoint())  # vLLM reads float checkpoints only
    cores = f"0-{len(os.sched_getaffinity(0)) - 1}"
    servers = [
        Server("engine", [sys.executable, "-m", "entrypoints.cli", "serve", "--dtype", args.dtype,
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
            run_client("vllm", server.url, model_dir, float("inf"), 4, 99, args.input_len, 16)
            server.signal(signal.SIGSTOP)
        print(f"vllm bench serve: {args.num_prompts} prompts per rate, random {args.input_len}->{args.output_len}, "
              f"{args.dtype}", flush=True)
        for r in range(args.rounds):
            for i, rate in enumerate(args.rates):
                for server in (servers if (i + r) % 2 == 0 else servers[::-1]):
                    server.signal(signal.SIGCONT)
                    time.sleep(1.0)
                    try:
                        summary = run_client("vllm", server.url, model_dir, rate, args.num_prompts, 1000 * r + i,
                                             args.input_len, args.output_len)
                    finally:
                        server.signal(signal.SIGSTOP)
                    results.setdefault((server.name, rate), []).append(summary)
                    print(f"  round {r} rate {rate:g} {server.name:6s} "
                          + "  ".join(f"{k} {summary[k]:.1f}" for k in KEYS), flush=True)
    finally:
        for server in servers:
            server.stop()

    def median(name: str, rate: float) -> dict:
        return median_by_throughput(results[name, rate])

    print("\n| req/s | server | TTFT median / p99 ms | TPOT median ms | ITL p99 ms | output tok/s |")
    print("|---|---|---|---|---|---|")
    verdicts = []
    for rate in args.rates:
        ours, theirs = median("engine", rate), median("vllm", rate)
        for name, s in (("vllm serve", theirs), ("engine serve", ours)):
            print(f"| {rate:g} | {name} | {s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | "
                  f"{s['median_tpot_ms']:.1f} | {s['p99_itl_ms']:.0f} | {s['output_throughput']:.1f} |")
        tput = ours["output_throughput"] / theirs["output_throughput"]
        ttft = ours["median_ttft_ms"] / theirs["median_ttft_ms"]
        tpot = ours["median_tpot_ms"] / theirs["median_tpot_ms"]
        met = tput >= 1.0 and ttft <= 1.0 and tpot <= 1.0
        verdicts.append(f"{rate:g} req/s: throughput {tput:.2f}x, TTFT median {ttft:.2f}x, TPOT median {tpot:.2f}x "
                        f"of vLLM's ({'met' if met else 'MISSED'})")
    print("\n".join(["", *verdicts]))


if __name__ == "__main__":
    main()
