"""benchmarks/serve.py against a minimal in-process OpenAI-like streaming server.

The fake server is deterministic: a prompt containing "[http-error]" gets HTTP 500, one with
"[sse-error]" streams two chunks then an SSE error event, one with "[no-usage]" streams without
the usage chunk; every other prompt streams `max_tokens` one-token chunks plus a usage chunk.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi import Request  # noqa: E402 - module level, so FastAPI resolves the annotation
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "benchmarks" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def sse(obj) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n"


def make_app(stats: dict):
    app = fastapi.FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model"}, {"id": "other"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        stats["requests"].append(body)
        prompt, n = body["prompt"], body["max_tokens"]
        if "[http-error]" in prompt:
            return JSONResponse({"error": {"message": "boom", "code": 500}}, status_code=500)

        async def events():
            stats["in_flight"] += 1
            stats["peak"] = max(stats["peak"], stats["in_flight"])
            try:
                await asyncio.sleep(0.03)  # "prefill"
                for i in range(n):
                    if "[sse-error]" in prompt and i == 2:
                        yield sse({"error": {"message": "mid-stream failure"}})
                        return
                    yield sse({"choices": [{"index": 0, "text": f" t{i}"}]})
                    await asyncio.sleep(0.005)
                if "[no-usage]" not in prompt:
                    usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
                    yield sse({"choices": [], "usage": usage})
                yield sse("[DONE]")
            finally:
                stats["in_flight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    stats = {"requests": [], "in_flight": 0, "peak": 0}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(stats), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", stats
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


PROMPTS = [
    {"prompt": "one two three", "max_tokens": 4},
    {"prompt": "alpha beta", "max_tokens": 7},
    {"prompt": "[http-error] please", "max_tokens": 5},
    {"prompt": "a b c d e", "max_tokens": 1},
    {"prompt": "[sse-error] x y", "max_tokens": 6},
    {"prompt": "[no-usage] four words here", "max_tokens": 3},
    {"prompt": "hello", "max_tokens": 5},
    {"prompt": "the quick brown fox", "max_tokens": 2},
    {"prompt": "[http-error] again", "max_tokens": 2},
    {"prompt": "last one", "max_tokens": 8},
]


def test_benchmark_against_fake_server(fake_server, tmp_path, capsys):
    base_url, stats = fake_server
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    result_path = tmp_path / "result.json"
    args = bench.build_parser().parse_args([
        "--base-url", base_url, "--dataset", "file", "--prompts-file", str(prompts_file),
        "--num-prompts", str(len(PROMPTS)), "--request-rate", "50", "--max-concurrency", "3",
        "--seed", "1", "--disable-tqdm", "--timeout", "20", "--save-result", str(result_path),
    ])
    summary = asyncio.run(bench.main_async(args))

    failing = [p for p in PROMPTS if "error]" in p["prompt"]]
    passing = [p for p in PROMPTS if "error]" not in p["prompt"]]
    assert summary["completed"] == len(passing) == 7
    assert summary["failed"] == len(failing) == 3
    assert summary["errors"] == {"HTTP 500: boom": 2, "mid-stream failure": 1}
    assert summary["total_output_tokens"] == sum(p["max_tokens"] for p in passing)
    # usage prompt tokens, and the word count for the request that reported no usage
    assert summary["total_input_tokens"] == sum(len(p["prompt"].split()) for p in passing)
    assert 1 <= summary["peak_concurrency"] <= 3 and stats["peak"] <= 3

    sent = stats["requests"][-len(PROMPTS):]
    assert all(r["model"] == "fake-model" and r["stream"] is True for r in sent)
    assert all(r["stream_options"] == {"include_usage": True} for r in sent)
    assert all("ignore_eos" not in r and r["temperature"] == 0 for r in sent)

    saved = json.loads(result_path.read_text())
    for key in ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput",
                "peak_concurrency", "errors"]:
        assert key in saved["summary"]
    for metric in ["ttft", "tpot", "itl", "e2el"]:
        for stat in ["mean", "median", "p99"]:
            assert saved["summary"][f"{stat}_{metric}_ms"] is not None
    assert saved["summary"] == json.loads(json.dumps(summary))
    assert len(saved["requests"]) == len(PROMPTS)
    for record, prompt in zip(saved["requests"], PROMPTS):
        if "error]" in prompt["prompt"]:
            assert not record["success"] and record["error"]
            continue
        assert record["success"] and record["error"] == ""
        assert 0 < record["ttft"] <= record["e2e_latency"]
        assert record["output_tokens"] == prompt["max_tokens"]
        assert len(record["itl"]) == prompt["max_tokens"] - 1
        assert record["usage_reported"] == ("[no-usage]" not in prompt["prompt"])
        if prompt["max_tokens"] > 1:
            expected = (record["e2e_latency"] - record["ttft"]) / (prompt["max_tokens"] - 1)
            assert record["tpot"] == pytest.approx(expected)

    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Peak concurrency:" in out
    assert "HTTP 500: boom" in out


def test_random_dataset_all_at_once(fake_server):
    base_url, _ = fake_server
    args = bench.build_parser().parse_args([
        "--base-url", base_url, "--num-prompts", "6", "--random-input-len", "20",
        "--random-output-len", "4", "--random-range-ratio", "0.5", "--disable-tqdm",
    ])
    summary = asyncio.run(bench.main_async(args))
    assert args.ignore_eos is True and summary["completed"] == 6 and summary["failed"] == 0
    inputs = bench.build_inputs(args)
    assert summary["total_output_tokens"] == sum(i.max_tokens for i in inputs)


def test_percentiles_on_known_inputs():
    stats = bench.stats_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["median"] == pytest.approx(50.5)
    assert stats["p99"] == pytest.approx(99.01)  # linear interpolation: 1 + 0.99 * 99
    assert bench.stats_ms([]) == {"mean": None, "median": None, "p99": None}

    ok = bench.RequestResult(index=0, success=True, ttft=0.1, itl=[0.02, 0.04, 0.06],
                             e2e_latency=0.22, output_tokens=4, prompt_tokens=3,
                             usage_reported=True)
    one = bench.RequestResult(index=1, success=True, ttft=0.2, e2e_latency=0.2, output_tokens=1,
                              usage_reported=False)
    bad = bench.RequestResult(index=2, error="HTTP 503: busy", e2e_latency=0.01)
    inputs = [bench.RequestInput("p", 4, 3), bench.RequestInput("q r", 1, 2),
              bench.RequestInput("s", 1, 1)]
    summary = bench.summarize([ok, one, bad], inputs, duration=2.0, peak_concurrency=2)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["total_input_tokens"] == 3 + 2  # usage, then the estimate
    assert summary["total_output_tokens"] == 5
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["total_token_throughput"] == pytest.approx(5.0)
    assert summary["mean_tpot_ms"] == pytest.approx(40.0)  # (220 - 100) / 3; 1-token excluded
    assert summary["median_itl_ms"] == pytest.approx(40.0)
    assert summary["mean_ttft_ms"] == pytest.approx(150.0)
    assert summary["errors"] == {"HTTP 503: busy": 1}


def test_arrivals_and_lengths():
    assert bench.arrival_delays(4, float("inf"), 1.0, 0) == [0.0] * 4
    delays = np.array(bench.arrival_delays(20000, 4.0, 1.0, 0))
    assert delays[0] == 0 and np.all(np.diff(delays) >= 0)
    assert np.diff(delays).mean() == pytest.approx(0.25, rel=0.03)
    bursty = np.diff(bench.arrival_delays(20000, 4.0, 0.25, 0))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05) and bursty.std() > np.diff(delays).std()

    import random
    lens = bench.sample_lengths(random.Random(0), 100, 0.2, 500)
    assert min(lens) >= 80 and max(lens) <= 120 and len(set(lens)) > 10
    args = bench.build_parser().parse_args(["--num-prompts", "5", "--random-input-len", "30",
                                            "--seed", "7"])
    first, again = bench.build_inputs(args), bench.build_inputs(args)
    assert [i.prompt for i in first] == [i.prompt for i in again]
    assert all(len(i.prompt.split()) == i.prompt_len == 30 for i in first)
