"""benchmarks/goodput.py's reading of `vllm bench serve --save-result --save-detailed` JSON: SLO
attainment and goodput, on a hand-made result (every way a request can miss) and on real results
of vLLM's client against this engine (whose `request_goodput` they must reproduce). No servers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import goodput  # noqa: E402

FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "goodput" / "vllm_results.json").read_text())


def test_attainment_and_goodput_of_a_crafted_result():
    s = goodput.slo_summary(FIXTURE["crafted"], ttft_ms=1000, tpot_ms=100)
    # good: #0 (TTFT 0.5 s, TPOT 50 ms), #4 (one token: TPOT 0), #5 (TTFT 1 s, TPOT 100 ms: on the limits);
    # missed: #1 (TTFT), #2 (TPOT 150 ms), #3 (failed, its zeros must not count as fast)
    assert (s["sent"], s["failed"], s["good"]) == (6, 1, 3)
    assert s["attainment"] == pytest.approx(0.5)
    assert s["goodput"] == pytest.approx(3 / 4.0)
    assert s["agrees_with_vllm"]
    assert s["ttft_median_ms"] == pytest.approx(900)  # of the five that finished
    # Tighter objectives: only #4 meets TTFT <= 0.9 s with TPOT <= 0.
    tight = goodput.slo_summary(FIXTURE["crafted"], ttft_ms=900, tpot_ms=0)
    assert tight["good"] == 1 and not tight["agrees_with_vllm"]  # vLLM's number was for 1000/100


@pytest.mark.parametrize("point", FIXTURE["real"], ids=lambda p: p["layout"])
def test_real_vllm_results_reproduce_its_goodput(point):
    s = goodput.slo_summary(point, ttft_ms=1000, tpot_ms=100)
    assert s["goodput"] == pytest.approx(point["request_goodput"], abs=1e-9)
    assert s["attainment"] == pytest.approx(point["request_goodput"] * point["duration"] / len(point["ttfts"]))


def test_table_and_plot_from_saved_results(tmp_path):
    points = [dict(p, ttft_ms=1000, tpot_ms=100, decisions={}) for p in FIXTURE["real"]]
    points.append(dict(FIXTURE["crafted"], workload="mixed", rate=0.5, layout="serve", ttft_ms=1000, tpot_ms=100,
                       decisions={"local/short_prompt": 6}))
    record = {"date": "2026-12-04", "cpu": "2 x test CPU", "command": "python benchmarks/goodput.py",
              "ttft_ms": 1000, "long_ttft_ms": 15000, "tpot_ms": 100, "rates": {"chat": [4], "mixed": [0.5]},
              "layouts": list(goodput.LAYOUTS), "points": points}
    text = goodput.table(record)
    assert "| mixed | 0.5 | make serve (conditional) | 50% (1 failed) | 0.75 |" in text
    assert "| chat | 4 | P->D every prompt | 100% |" in text
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(record))
    png = tmp_path / "g.png"
    pytest.importorskip("matplotlib")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "goodput.py"), "--from-results", str(saved),
                          "--plot", str(png)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "goodput.py"), "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for flag in ("--ttft-ms", "--tpot-ms", "--vllm-venv", "--chat-rates", "--long-rates", "--from-results"):
        assert flag in out.stdout


def test_merging_saved_runs():
    def run(rates, layout):
        points = [dict(FIXTURE["crafted"], workload="512-128", rate=r, layout=layout, ttft_ms=1000, tpot_ms=100)
                  for r in rates]
        return {"command": f"run {rates}", "minutes": 1, "rates": {"512-128": rates}, "points": points}

    merged = goodput.merge([run([0.5, 1], "serve"), run([0.1, 0.25], "p-to-d")])
    assert merged["rates"] == {"512-128": [0.1, 0.25, 0.5, 1]}
    assert [(p["rate"], p["layout"]) for p in merged["points"]] == [
        (0.1, "p-to-d"), (0.25, "p-to-d"), (0.5, "serve"), (1, "serve")]
    assert "run [0.5, 1]" in merged["command"] and "run [0.1, 0.25]" in merged["command"]
