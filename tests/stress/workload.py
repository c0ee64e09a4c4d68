"""The pressure workload shared by tests/stress and benchmarks/stress.py: many streaming
clients with Poisson arrivals far above capacity, some of which disconnect mid-stream, and
the invariants every instance must satisfy afterwards."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Job:
    index: int
    prompt: list[int]
    max_tokens: int
    disconnect_after: int | None  # chunks to read before hanging up; None = read to the end


@dataclass
class Result:
    job: Job
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # "http <status>: <message>" or the exception
    seconds: float = 0.0  # from sending the request to its end
    longest_gap_s: float = 0.0  # between two events of its stream (the first counted from sending)


@dataclass
class Summary:
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def completed(self) -> list[Result]:
        return [r for r in self.results if r.job.disconnect_after is None and r.error is None]

    @property
    def errors(self) -> Counter:
        return Counter(r.error.split(":")[0] for r in self.results if r.error is not None)


def make_jobs(n: int, seed: int = 0, min_prompt: int = 10, max_prompt: int = 1500, max_output: int = 128,
              disconnect_fraction: float = 0.1, vocab: int = 40000) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(min_prompt, max_prompt))]
        disconnect = rng.random() < disconnect_fraction
        max_tokens = rng.randint(16, max_output) if disconnect else rng.randint(1, max_output)
        jobs.append(Job(i, prompt, max_tokens, rng.randint(1, 4) if disconnect else None))
    return jobs


async def _client(http: httpx.AsyncClient, url: str, job: Job, result: Result) -> None:
    body = {"prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"http {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                result.longest_gap_s, last = max(result.longest_gap_s, now - last), now
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = f"stream error: {event['error'].get('message')}"
                    return
                choice = event["choices"][0]
                result.text += choice.get("text", "")
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
                chunks += 1
                if job.disconnect_after is not None and chunks >= job.disconnect_after:
                    return  # leaving the block closes the connection: the server must abort
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.seconds = time.perf_counter() - start


async def run_load(url: str, jobs: list[Job], rate: float, seed: int = 0, deadline_s: float = 300) -> Summary:
    """Send every job at Poisson arrival times (``rate`` per second) and wait for all of them,
    never longer than ``deadline_s`` (a hang is a failure, not a wait)."""
    rng = random.Random(seed)
    summary = Summary([Result(job) for job in jobs])
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(deadline_s, connect=10),
                                 limits=httpx.Limits(max_connections=len(jobs) + 10)) as http:
        tasks = []
        for result in summary.results:
            tasks.append(asyncio.create_task(_client(http, url, result.job, result)))
            await asyncio.sleep(rng.expovariate(rate))
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        if pending:
            raise AssertionError(f"{len(pending)} of {len(jobs)} requests still open after {deadline_s}s: a hang")
    summary.seconds = time.perf_counter() - start
    return summary


def reference_outputs(model: str, jobs: list[Job]) -> dict[int, str]:
    """Greedy texts of the jobs no client abandons, from an unpressured offline run (a pool big
    enough for everything at once): what the pressured server must reproduce."""
    from engine import LLM, SamplingParams
    llm = LLM(model, num_blocks=4096, max_model_len=2048)
    kept = [j for j in jobs if j.disconnect_after is None]
    outs = llm.generate([j.prompt for j in kept],
                        [SamplingParams(temperature=0, max_tokens=j.max_tokens, ignore_eos=True) for j in kept],
                        use_tqdm=False)
    llm.shutdown()
    return {j.index: out.outputs[0].text for j, out in zip(kept, outs)}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def assert_invariants(server, timeout: float = 30.0) -> dict:
    """After a scenario: nothing running, waiting, parked for KV or held for a transfer; every
    block free (cached ones count as free: free + in use = total); no transfer in flight."""
    status = server.wait_idle(timeout=timeout)
    req, blocks = status["requests"], status["kv_blocks"]
    assert req["running"] == req["waiting"] == req["waiting_for_remote_kv"] == req["held_for_transfer"] == 0, status
    assert req["tracked_by_engine"] == 0, f"per-request state leaked: {status}"
    assert blocks["free"] + blocks["in_use"] == blocks["total"] and blocks["in_use"] == 0, status
    assert blocks["held"] == 0 and status["kv_transfer"]["blocks_held"] == 0, status
    return status
