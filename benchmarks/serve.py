"""Online serving benchmark for any OpenAI-compatible endpoint (in the style of `vllm bench serve`).

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --request-rate 8 --max-concurrency 32 --random-input-len 512 --random-output-len 128

Every request streams (`stream: true`, `stream_options.include_usage`). Per request it records
the time to first token (first non-empty content chunk), the gaps between content chunks (ITL),
the end-to-end latency, and the prompt/output token counts (from the usage chunk, else the
number of content chunks). A chunk may carry several tokens, so ITL is per chunk, as in vLLM.

Arrivals: `--request-rate inf` sends everything at t0; otherwise inter-arrival gaps are drawn
from a gamma distribution with shape `--burstiness` and mean 1/rate (shape 1 = Poisson).
`--sweep-rates 1,2,4,8 --plot out.png` runs once per rate and plots latency against rate.

Python use: `summary = asyncio.run(main_async(build_parser().parse_args([...])))`.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import numpy as np

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")

# Short common words: roughly one token each for most BPE tokenizers.
VOCABULARY = (
    "the of and to in is it you that he was for on are as with his they at be this have from or "
    "one had by word but not what all were we when your can said there use an each which she do "
    "how their if will up other about out many then them these so some her would make like him "
    "into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part over new sound take "
    "only little work know place year live me back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any "
    "same tell boy follow came want show also around form three small set put end does another "
    "well large must big even such because turn here why ask went men read need land different "
    "home us move try kind hand picture again change off play spell air away animal house point "
    "page letter mother answer found study still learn should world high every near add food "
    "between own below country plant last school father keep tree never start city earth eye "
    "light thought head under story saw left few while along might close something seem next "
    "hard open example begin life always those both paper together got group often run"
).split()


# ----------------------------------------------------------------------------------------------
# Data


@dataclass
class RequestInput:
    prompt: str
    max_tokens: Optional[int]
    prompt_len: int  # estimated (words) or exact (with --tokenizer); usage overrides it


@dataclass
class RequestResult:
    index: int
    success: bool = False
    error: str = ""
    start_time: float = 0.0  # seconds after the benchmark started
    ttft: Optional[float] = None  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    e2e_latency: Optional[float] = None  # seconds
    output_tokens: int = 0  # usage.completion_tokens if reported, else content chunks
    prompt_tokens: int = 0  # usage.prompt_tokens; 0 when the server sends no usage
    usage_reported: bool = False
    content_chunks: int = 0
    generated_text: str = ""

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token excluding the first one (seconds)."""
        if not self.success or self.output_tokens <= 1 or self.ttft is None:
            return None
        return (self.e2e_latency - self.ttft) / (self.output_tokens - 1)


# ----------------------------------------------------------------------------------------------
# Datasets


def sample_lengths(rng: random.Random, base: int, range_ratio: float, n: int) -> list[int]:
    """n lengths uniform in [base*(1-r), base*(1+r)], at least 1."""
    low = max(1, math.floor(base * (1 - range_ratio)))
    high = max(low, math.ceil(base * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(n))


class TokenizerPrompter:
    """Prompts of an exact token length: random token ids, decoded, re-encoded and trimmed."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        special = set(self.tok.all_special_ids)
        self.ids = [i for i in range(len(self.tok)) if i not in special]

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def make(self, rng: random.Random, n: int) -> tuple[str, int]:
        ids = [rng.choice(self.ids) for _ in range(n)]
        for _ in range(4):  # decode/encode is not an identity; converge on the length
            text = self.tok.decode(ids)
            ids = self.tok.encode(text, add_special_tokens=False)[:n]
            if len(ids) < n:
                ids += [rng.choice(self.ids) for _ in range(n - len(ids))]
        text = self.tok.decode(ids)
        return text, self.count(text)


def make_synthetic(args, fixed: bool) -> list[RequestInput]:
    rng = random.Random(args.seed)
    n = args.num_prompts
    ratio = 0.0 if fixed else args.random_range_ratio
    in_lens = sample_lengths(rng, args.random_input_len, ratio, n)
    out_lens = sample_lengths(rng, args.random_output_len, ratio, n)
    prompter = TokenizerPrompter(args.tokenizer) if args.tokenizer else None

    def one(length: int) -> tuple[str, int]:
        if prompter:
            return prompter.make(rng, length)
        return random_words(rng, length), length

    if fixed:
        text, plen = one(in_lens[0])
        return [RequestInput(text, out_lens[0], plen) for _ in range(n)]
    inputs = []
    for in_len, out_len in zip(in_lens, out_lens):
        text, plen = one(in_len)
        inputs.append(RequestInput(text, out_len, plen))
    return inputs


def load_prompts_file(args) -> list[RequestInput]:
    """JSONL of {"prompt": str, "max_tokens": int?} or plain text lines; cycled to --num-prompts."""
    if not args.prompts_file:
        raise SystemExit("--dataset file needs --prompts-file")
    prompter = TokenizerPrompter(args.tokenizer) if args.tokenizer else None
    entries = []
    for line in Path(args.prompts_file).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line) if line.lstrip().startswith("{") else {"prompt": line}
        prompt = record["prompt"]
        plen = prompter.count(prompt) if prompter else len(prompt.split())
        entries.append(RequestInput(prompt, record.get("max_tokens", args.random_output_len), plen))
    if not entries:
        raise SystemExit(f"no prompts in {args.prompts_file}")
    return [entries[i % len(entries)] for i in range(args.num_prompts)]


def build_inputs(args) -> list[RequestInput]:
    if args.dataset == "random":
        return make_synthetic(args, fixed=False)
    if args.dataset == "fixed":
        return make_synthetic(args, fixed=True)
    return load_prompts_file(args)


# ----------------------------------------------------------------------------------------------
# Arrivals


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send offsets (seconds after t0) for n requests; all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at t0
    return np.cumsum(gaps).tolist()


# ----------------------------------------------------------------------------------------------
# One request


def build_payload(args, inp: RequestInput) -> dict:
    payload = {
        "model": args.model,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if inp.max_tokens is not None:
        payload["max_tokens"] = inp.max_tokens
    if args.ignore_eos:
        payload["ignore_eos"] = True  # vLLM extension; strict OpenAI servers reject it
    if args.endpoint == "/v1/chat/completions":
        payload["messages"] = [{"role": "user", "content": inp.prompt}]
    else:
        payload["prompt"] = inp.prompt
    return payload


def chunk_text(obj: dict) -> str:
    """The generated text in one streamed chunk (completions or chat, content or reasoning)."""
    choices = obj.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def error_text(error) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


async def consume_stream(response: httpx.Response, result: RequestResult, t_start: float) -> None:
    """Read SSE events into `result`; raises RuntimeError on an `error` event."""
    last_chunk = None
    async for line in response.aiter_lines():
        now = time.perf_counter()  # arrival time, before parsing
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        obj = json.loads(data)
        if obj.get("error"):
            raise RuntimeError(error_text(obj["error"]))
        text = chunk_text(obj)
        if text:
            if last_chunk is None:
                result.ttft = now - t_start
            else:
                result.itl.append(now - last_chunk)
            last_chunk = now
            result.content_chunks += 1
            result.generated_text += text
        usage = obj.get("usage")
        if usage:
            result.usage_reported = True
            result.prompt_tokens = usage.get("prompt_tokens") or 0
            result.output_tokens = usage.get("completion_tokens") or 0
    if not result.usage_reported:
        result.output_tokens = result.content_chunks


async def send_request(client: httpx.AsyncClient, url: str, payload: dict,
                       result: RequestResult, timeout: float) -> None:
    t_start = time.perf_counter()

    async def run() -> None:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code >= 400:
                body = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {extract_message(body)}")
            await consume_stream(response, result, t_start)

    try:
        await asyncio.wait_for(run(), timeout)
        if result.ttft is None:
            raise RuntimeError("no content received")
        result.success = True
    except asyncio.TimeoutError:
        result.error = f"timeout after {timeout:g}s"
    except RuntimeError as e:  # HTTP status, SSE error event, empty stream
        result.error = str(e)
    except Exception as e:  # noqa: BLE001 - connection errors, bad JSON: recorded, not raised
        result.error = f"{type(e).__name__}: {e}".rstrip(": ")
    result.e2e_latency = time.perf_counter() - t_start


def extract_message(body: str) -> str:
    """The `error.message` (or `detail`) of a JSON error body, else the body, shortened."""
    try:
        obj = json.loads(body)
        if isinstance(obj, dict):
            if "error" in obj:
                return error_text(obj["error"])[:300]
            if "detail" in obj:
                return str(obj["detail"])[:300]
    except ValueError:
        pass
    return body.strip()[:300]


# ----------------------------------------------------------------------------------------------
# Metrics


def stats_ms(values_s: list[float]) -> dict:
    """Mean, median and p99 in milliseconds (linear interpolation, as numpy); None when empty."""
    if not values_s:
        return {"mean": None, "median": None, "p99": None}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    return {"mean": float(arr.mean()), "median": float(np.median(arr)),
            "p99": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], inputs: list[RequestInput], duration: float,
              peak_concurrency: int) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens if r.usage_reported else inputs[r.index].prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "peak_concurrency": peak_concurrency,
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2e_latency for r in ok],
    }
    for name, values in series.items():
        for stat, value in stats_ms(values).items():
            summary[f"{stat}_{name}_ms"] = value
    summary["errors"] = dict(Counter(r.error for r in results if not r.success).most_common())
    return summary


def print_summary(summary: dict) -> None:
    def row(label: str, value) -> None:
        if value is None:
            text = "n/a"
        elif isinstance(value, float):
            text = f"{value:.2f}"
        else:
            text = str(value)
        print(f"{label:<40} {text:<10}")

    print("{:=^50}".format(" Serving Benchmark Result "))
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    row("Peak concurrency:", summary["peak_concurrency"])
    sections = [("ttft", "Time to First Token", "TTFT"),
                ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                ("itl", "Inter-token Latency", "ITL"),
                ("e2el", "End-to-end Latency", "E2EL")]
    for key, title, short in sections:
        print("{:-^50}".format(f" {title} "))
        row(f"Mean {short} (ms):", summary[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", summary[f"median_{key}_ms"])
        row(f"P99 {short} (ms):", summary[f"p99_{key}_ms"])
    print("=" * 50)
    if summary["errors"]:
        print("Failed request errors (count: message), most common first:")
        for message, count in list(summary["errors"].items())[:5]:
            print(f"  {count:>5}: {message}")
        if len(summary["errors"]) > 5:
            print(f"  ... and {len(summary['errors']) - 5} more distinct messages")


# ----------------------------------------------------------------------------------------------
# Benchmark run


def headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def resolve_model(args) -> str:
    """--model, else the first id from GET /v1/models."""
    if args.model:
        return args.model
    async with httpx.AsyncClient(timeout=30.0, headers=headers(args)) as client:
        response = await client.get(args.base_url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise SystemExit(f"{args.base_url}/v1/models lists no models; pass --model")
    return models[0]["id"]


async def run_benchmark(args, inputs: list[RequestInput]) -> tuple[dict, list[RequestResult]]:
    """Send every input on the arrival schedule; return (summary, per-request results)."""
    n = len(inputs)
    concurrency = args.max_concurrency or n
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(args.timeout, pool=None)
    semaphore = asyncio.Semaphore(concurrency)
    url = args.base_url.rstrip("/") + args.endpoint
    delays = arrival_delays(n, args.request_rate, args.burstiness, args.seed)
    results = [RequestResult(index=i) for i in range(n)]
    in_flight = peak = 0
    pbar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        pbar = tqdm(total=n, desc=f"rate={args.request_rate:g}", file=sys.stderr)

    async def one(i: int) -> None:
        nonlocal in_flight, peak
        await asyncio.sleep(max(0.0, t0 + delays[i] - time.perf_counter()))
        async with semaphore:
            in_flight += 1
            peak = max(peak, in_flight)
            results[i].start_time = time.perf_counter() - t0
            try:
                await send_request(client, url, build_payload(args, inputs[i]), results[i],
                                   args.timeout)
            finally:
                in_flight -= 1
                if pbar:
                    pbar.update(1)

    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers(args)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        duration = time.perf_counter() - t0
    if pbar:
        pbar.close()
    return summarize(results, inputs, duration, peak), results


def config_of(args) -> dict:
    keys = ["base_url", "endpoint", "model", "num_prompts", "request_rate", "burstiness",
            "max_concurrency", "seed", "dataset", "random_input_len", "random_output_len",
            "random_range_ratio", "prompts_file", "ignore_eos", "temperature", "timeout",
            "tokenizer"]
    config = {k: getattr(args, k) for k in keys}
    if math.isinf(config["request_rate"]):
        config["request_rate"] = "inf"  # keep the JSON standard
    return config


def run_record(args, summary: dict, results: list[RequestResult]) -> dict:
    requests = []
    for r in results:
        record = asdict(r)
        record["tpot"] = r.tpot
        requests.append(record)
    return {"config": config_of(args), "summary": summary, "requests": requests}


def save_json(path: str, record: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2))


async def main_async(args) -> dict:
    """One benchmark run; prints the result block, saves it if asked, returns the summary."""
    finalize_args(args)
    args.model = await resolve_model(args)
    inputs = build_inputs(args)
    summary, results = await run_benchmark(args, inputs)
    print_summary(summary)
    if args.save_result:
        save_json(args.save_result, run_record(args, summary, results))
    return summary


async def sweep_async(args, rates: list[float]) -> list[dict]:
    """One run per request rate; saves all runs in one JSON and plots them if asked."""
    finalize_args(args)
    args.model = await resolve_model(args)
    inputs = build_inputs(args)
    records = []
    for rate in rates:
        run_args = copy.copy(args)
        run_args.request_rate = rate
        summary, results = await run_benchmark(run_args, inputs)
        print(f"\nrequest rate {rate:g} req/s")
        print_summary(summary)
        records.append(run_record(run_args, summary, results))
    if args.save_result:
        save_json(args.save_result, {"runs": records})
    if args.plot:
        plot_sweep(rates, [r["summary"] for r in records], args.plot)
        print(f"plot written to {args.plot}")
    return [r["summary"] for r in records]


def plot_sweep(rates: list[float], summaries: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    nan = float("nan")
    for ax, (key, title) in zip(axes, panels):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            values = [s[f"{stat}_{key}_ms"] for s in summaries]
            ax.plot(rates, [nan if v is None else v for v in values], style, label=stat)
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    p.add_argument("--model", default=None, help="default: the first id from GET /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second; inf (default) sends all at t0")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival gaps; 1.0 = Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: unbounded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", default="random", choices=["random", "fixed", "file"])
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128,
                   help="also the max_tokens of file prompts that give none")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--prompts-file", default=None,
                   help='JSONL of {"prompt": str, "max_tokens": int?} or plain text lines')
    p.add_argument("--tokenizer", default=None,
                   help="HF tokenizer path: exact prompt token lengths (needs transformers)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="send ignore_eos (vLLM extension); default on for random/fixed data")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit, seconds")
    p.add_argument("--save-result", default=None, metavar="PATH",
                   help="JSON with the config, the summary and every request's metrics")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--sweep-rates", default=None, metavar="R1,R2,...",
                   help="run once per request rate (overrides --request-rate)")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="with --sweep-rates: PNG of median/p99 latencies vs request rate")
    return p


def finalize_args(args) -> None:
    """Derived defaults and checks, shared by the CLI and main_async callers."""
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset in ("random", "fixed")
    if args.num_prompts < 1:
        raise SystemExit("--num-prompts must be at least 1")
    if not 0 <= args.random_range_ratio < 1:
        raise SystemExit("--random-range-ratio must be in [0, 1)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be at least 1")


def parse_rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.plot and not args.sweep_rates:
        raise SystemExit("--plot needs --sweep-rates")
    if args.sweep_rates:
        asyncio.run(sweep_async(args, parse_rates(args.sweep_rates)))
    else:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
