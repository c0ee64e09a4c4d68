"""The stress scenarios at a larger scale, by hand:

    python benchmarks/stress.py --minutes 10 [--model PATH] [--mode colocated|disagg|both]

Rounds of the pressure workload of tests/stress (Poisson arrivals far above capacity, a KV pool
sized for about two long requests, 10% of clients hanging up mid-stream) run back to back until
the time is up, against `engine serve` and/or P -> D behind `engine proxy`. Every completed
request is checked against an unpressured offline run of the same model. Prints a summary:
requests, completions, errors by reason, preemptions, KV load recomputes, wrong outputs and
leaked blocks (both must be 0).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.disagg_utils import Disagg  # noqa: E402
from tests.server_utils import ServerProcess  # noqa: E402
from tests.stress.workload import make_jobs, reference_outputs, rss_bytes, run_load  # noqa: E402

ARGS = ("--num-blocks", "220", "--max-model-len", "2048", "--max-num-seqs", "64")


def run_mode(mode: str, model: str, minutes: float, requests: int, rate: float) -> dict:
    if mode == "colocated":
        server = ServerProcess(model, *ARGS)
        url, engines, stop = server.url, [server], server.stop
    else:
        cluster = Disagg(model, *ARGS, prefill_args=("--kv-lease-s", "5"))
        url, engines, stop = cluster.url, [cluster.prefill, cluster.decode], cluster.stop
    totals = {"rounds": 0, "requests": 0, "completed": 0, "abandoned": 0, "wrong": 0, "errors": {},
              "rss_growth_mib": 0.0}
    rss_start = {e: rss_bytes(e.engine_pid) for e in engines}
    deadline = time.monotonic() + minutes * 60
    try:
        seed = 0
        while time.monotonic() < deadline:
            jobs = make_jobs(requests, seed=seed)
            expected = reference_outputs(model, jobs)
            summary = asyncio.run(run_load(url, jobs, rate, seed=seed, deadline_s=900))
            totals["rounds"] += 1
            totals["requests"] += len(jobs)
            totals["completed"] += len(summary.completed)
            totals["abandoned"] += sum(j.disconnect_after is not None for j in jobs)
            totals["wrong"] += sum(r.text != expected[r.job.index] for r in summary.completed)
            for reason, n in summary.errors.items():
                totals["errors"][reason] = totals["errors"].get(reason, 0) + n
            print(f"[{mode}] round {totals['rounds']}: {len(summary.completed)} completed in "
                  f"{summary.seconds:.0f}s, errors {dict(summary.errors) or 0}", flush=True)
            seed += 1
        leaked = 0
        for e in engines:
            status = e.wait_idle(timeout=30)
            leaked += status["kv_blocks"]["in_use"]
            totals["preemptions"] = totals.get("preemptions", 0) + status["num_preemptions"]
            totals["recomputes"] = totals.get("recomputes", 0) + sum(status["kv_transfer"]["failures"].values())
            totals["rss_growth_mib"] = max(totals["rss_growth_mib"],
                                           (rss_bytes(e.engine_pid) - rss_start[e]) / 2**20)
        totals["leaked_blocks"] = leaked
    finally:
        stop()
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="per mode")
    parser.add_argument("--model", default=None, help="default: a tiny random Llama with a 2k context")
    parser.add_argument("--mode", choices=["colocated", "disagg", "both"], default="both")
    parser.add_argument("--requests", type=int, default=200, help="requests per round")
    parser.add_argument("--rate", type=float, default=40.0, help="arrivals per second")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from tests.conftest import make_tiny_model
        model = str(make_tiny_model(tempfile.mkdtemp(prefix="stress-llama-"), "llama", tie_word_embeddings=True,
                                    max_position_embeddings=2048))
    modes = ["colocated", "disagg"] if args.mode == "both" else [args.mode]
    results = {m: run_mode(m, model, args.minutes, args.requests, args.rate) for m in modes}
    print("\n| mode | rounds | requests | completed | abandoned by client | errors | preemptions | "
          "KV recomputes | wrong outputs | leaked blocks | max RSS growth MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m, t in results.items():
        print(f"| {m} | {t['rounds']} | {t['requests']} | {t['completed']} | {t['abandoned']} | "
              f"{t['errors'] or 0} | {t['preemptions']} | {t['recomputes']} | {t['wrong']} | {t['leaked_blocks']} | "
              f"{t['rss_growth_mib']:.0f} |")
    bad = any(t["wrong"] or t["leaked_blocks"] or t["errors"] for t in results.values())
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
