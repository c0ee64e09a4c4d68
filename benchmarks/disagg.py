"""Disaggregated prefill, measured side by side in one run:

1. KV transfer bandwidth of the real worker code path (producer -> consumer, same host over
   ipc and over TCP loopback, authenticated with a deployment secret; over TCP also encrypted,
   as with --kv-encrypt) next to torch memcpy and raw zmq TCP loopback bandwidth.
2. TTFT and ITL, colocated `engine serve` against prefill -> decode through `engine proxy`,
   at several prompt lengths (sequential requests, so this is the pure disaggregation overhead;
   interleaved, each setup first every other request),
   and where each setup's time to first token goes, phase by phase (every process marks its
   phases, engine/timeline.py; medians over the requests): the next regression shows where it is.

    python benchmarks/disagg.py [--model M] [--lengths 128 512 2048] [--requests 5] [--skip-serving]
                                [--max-local-prefill-tokens N] [--prefill-args "--kv-store cpu:2GiB"]
                                [--skip-bandwidth] [--settle SECONDS]
"""
from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

from engine import timeline  # noqa: E402
from engine.kv_transfer.base import allocate_kv_tensor  # noqa: E402
from engine.kv_transfer.p2p import LoadSpec, P2PMetadata, SendSpec, ipc_path  # noqa: E402
from engine.kv_transfer.p2p_worker import P2PConnectorWorker  # noqa: E402
from engine.kv_transfer.secret import KVSecret, new_secret  # noqa: E402
from tests.disagg_utils import Disagg  # noqa: E402
from tests.server_utils import ServerProcess, free_port  # noqa: E402

# SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32 -> 737 KB per 16-token block.
LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
MIXED_SECONDS = 40.0


def memcpy_gbps(nbytes: int) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 5 * nbytes / (time.perf_counter() - start) / 1e9


def raw_tcp_gbps(nbytes: int) -> float:
    """zmq PUSH/PULL of one big frame over TCP loopback: what the network path can carry."""
    ctx = zmq.Context()
    port = free_port()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(f"tcp://127.0.0.1:{port}")
    push.connect(f"tcp://127.0.0.1:{port}")
    payload = bytearray(nbytes)
    received = []
    t = threading.Thread(target=lambda: [received.append(pull.recv(copy=False)) for _ in range(4)])
    t.start()
    start = time.perf_counter()
    for _ in range(4):
        push.send(payload, copy=False)
    t.join()
    elapsed = time.perf_counter() - start
    for s in (pull, push):
        s.close(linger=0)
    ctx.term()
    return 4 * nbytes / elapsed / 1e9


def connector_gbps(num_blocks: int, use_tcp: bool, scattered: bool = False, encrypt: bool = False) -> float:
    """Producer and consumer workers in one process, real sockets between them, sharing a
    deployment secret (so every socket is authenticated; ``encrypt``: and CURVE-encrypted).
    `scattered` puts the destination blocks in random order, as a long-running pool hands them out."""
    shape = (LAYERS, 2, num_blocks + 8, BLOCK, HEADS, HEAD_DIM)
    # Allocated as the engine does: the producer's KV lives in shared memory only with ENGINE_KV_SHM=1.
    port = free_port()
    secret = KVSecret(new_secret())
    producer = P2PConnectorWorker("p", "fp", "127.0.0.1", port, secret=secret, encrypt=encrypt)
    consumer = P2PConnectorWorker("d", "fp", None, None, secret=secret, encrypt=encrypt)
    cpu = torch.device("cpu")
    producer_kv = allocate_kv_tensor(shape, torch.float32, cpu, producer.kv_cache_file(shape, torch.float32, cpu))
    producer_kv.copy_(torch.randn(shape))
    producer.register_kv_caches(producer_kv)
    consumer.register_kv_caches(allocate_kv_tensor(shape, torch.float32, cpu))
    addr = f"tcp://127.0.0.1:{port}" if use_tcp else ipc_path(port)
    best = 0.0
    for trial in range(3):
        rid = f"r{trial}"
        producer.save_kv(P2PMetadata(sends=[SendSpec(rid, list(range(num_blocks)), num_blocks * BLOCK,
                                                           time.monotonic() + 60, "bench")]))
        dst = list(range(8, 8 + num_blocks))
        if scattered:
            random.Random(trial).shuffle(dst)
        start = time.perf_counter()
        consumer.start_load_kv(P2PMetadata(loads=[LoadSpec(rid, addr, rid, 0, dst, time.monotonic() + 60, "bench")]))
        while True:
            out = consumer.get_finished()
            if out.finished_recving or out.failed_recving:
                break
            time.sleep(0.0005)
        elapsed = time.perf_counter() - start
        assert out.finished_recving == {rid}, out.failure_reasons
        bytes_per_block = producer.kv[:, :, 0].numel() * producer.kv.element_size()
        best = max(best, num_blocks * bytes_per_block / elapsed / 1e9)
    assert torch.equal(consumer.kv[:, :, dst], producer.kv[:, :, :num_blocks])
    producer.shutdown()
    consumer.shutdown()
    return best


# One client for the measured requests: a client per request spends ~20-40 ms building an SSL
# context before it sends anything, which TTFT would count.
CLIENT = httpx.Client(timeout=300)


def stream_latency(url: str, prompt: list[int], max_tokens: int, request_id: str | None = None,
                   sent: list[float] | None = None) -> tuple[float, list[float]]:
    """(TTFT, gaps between the later tokens) of one streamed completion; ``sent`` gets the
    time.monotonic() at which the request went out (the client's phase mark)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    if request_id is not None:
        body["request_id"] = request_id
    start = time.monotonic()
    if sent is not None:
        sent.append(start)
    ttft, last, itls = None, None, []
    with CLIENT.stream("POST", f"{url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            if ttft is None:
                ttft = now - start
            else:
                itls.append(now - last)
            last = now
    return ttft, itls


# Where time to first token goes: the marks a request passes, in order, as (process, phase), each
# phase named by the step that ends there. "P|D" is the instance that served the prompt: P on the
# remote path, D on the local one (the proxy's decision asks D first: those marks of D are not
# this path's). A mark a request did not pass (a path without it) merges its step into the next.
COLOCATED_MARKS = [("client", "sent"), ("server", "api.received"), ("server", "api.tokenized"),
                   ("server", "core.scheduled"), ("server", "runner.sampled"), ("server", "core.outputs"),
                   ("server", "api.first_output"), ("server", "api.answer"), ("client", "first token")]
DISAGG_MARKS = [("client", "sent"), ("proxy", "proxy.received"), ("proxy", "proxy.read"), ("proxy", "proxy.decided"),
                ("P|D", "api.received"), ("P|D", "api.tokenized"), ("P|D", "core.scheduled"),
                ("P|D", "runner.sampled"), ("P|D", "core.outputs"), ("P|D", "api.first_output"),
                ("P|D", "api.answer"), ("proxy", "proxy.prefill_answered"), ("proxy", "proxy.first_chunk"),
                ("client", "first token")]
PHASE_NAMES = {
    "proxy.received": "client -> proxy", "proxy.read": "proxy reads the body",
    "proxy.decided": "proxy asks D: prefill here or on P? (409)", "api.received": "-> instance (HTTP)",
    "api.tokenized": "instance parses, validates, tokenizes", "core.scheduled": "admission, queue",
    "runner.sampled": "prefill: forward + sample", "core.outputs": "step's end (P: hand-off params, signing)",
    "api.first_output": "core -> API server (output processed)", "api.answer": "first chunk / answer built",
    "proxy.prefill_answered": "P's answer -> proxy", "proxy.first_chunk": "proxy makes the first chunk",
    "first token": "-> client"}


def phase_breakdown(marks: list[tuple], pids: dict[int, str], request_id: str, order: list[tuple[str, str]],
                    sent: float, first_token: float) -> dict[str, float]:
    """Seconds per phase of one request: from each mark it passed to the next one it passed."""
    seen: dict[tuple[str, str], float] = {("client", "sent"): sent, ("client", "first token"): first_token}
    for t, pid, phase, rid in marks:
        if rid.startswith(request_id) and pids.get(pid) is not None:
            seen.setdefault((pids[pid], phase), t)  # the first (the proxy's probe of D comes first)
    served_by = "P" if ("P", "api.received") in seen else "D"
    points = [(phase, seen[(served_by if who == "P|D" else who, phase)]) for who, phase in order
              if (served_by if who == "P|D" else who, phase) in seen]
    return {phase: t - t_prev for (_, t_prev), (phase, t) in zip(points, points[1:])}


def mixed_load(url: str, seconds: float, long_len: int = 2048, every: float = 4.0) -> tuple[float, float, list[float]]:
    """Short streams decode continuously while a long prompt arrives every `every` seconds.
    Returns (median, p99) inter-token latency of the short streams and the long prompts' TTFTs
    (of those answered within `seconds` + 120 s)."""
    stop = time.monotonic() + seconds
    itls: list[float] = []
    long_ttfts: list[float] = []
    lock = threading.Lock()

    def short_streams(worker: int) -> None:
        i = 0
        while time.monotonic() < stop:
            prompt = [2000 + (worker * 1000 + i * 37 + j) % 40000 for j in range(96)]
            _, gaps = stream_latency(url, prompt, 48)
            with lock:
                itls.extend(gaps)
            i += 1

    def long_prompt(prompt: list[int]) -> None:
        ttft, _ = stream_latency(url, prompt, 1)
        with lock:
            long_ttfts.append(ttft)

    def long_prompts() -> None:
        i, sent = 0, []
        while time.monotonic() < stop:
            prompt = [5000 + (i * 7919 + j * 13) % 40000 for j in range(long_len)]
            sent.append(threading.Thread(target=long_prompt, args=(prompt,), daemon=True))
            sent[-1].start()
            i += 1
            time.sleep(every)
        for t in sent:
            t.join(120)

    threads = [threading.Thread(target=short_streams, args=(w,)) for w in range(4)]
    threads.append(threading.Thread(target=long_prompts))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    itls.sort()
    return statistics.median(itls), itls[int(0.99 * (len(itls) - 1))], sorted(long_ttfts)


def serving(model: str | None, lengths: list[int], requests: int, max_local_prefill_tokens: int = 0,
            prefill_args: tuple[str, ...] = (), settle: float = 0.0) -> tuple[list[tuple], dict]:
    """Rows of TTFT/ITL per prompt length (and the mixed-load row), and per length the median
    seconds of each phase of TTFT per setup."""
    from engine.worker.loader import resolve_model

    args = ["--kv-cache-memory", "1GiB"]
    model_dir = str(resolve_model(model))
    log = Path(tempfile.mkdtemp(prefix="engine-phases-")) / "marks.jsonl"
    os.environ[timeline.ENV_VAR] = str(log)  # every process started below marks its phases there
    colocated = ServerProcess(model_dir, *args)
    cluster = Disagg(model_dir, *args, prefill_args=prefill_args,
                     proxy_args=("--max-local-prefill-tokens", str(max_local_prefill_tokens)))
    del os.environ[timeline.ENV_VAR]
    pids = {colocated.proc.pid: "server", colocated.engine_pid: "server", cluster.proxy.proc.pid: "proxy",
            cluster.prefill.proc.pid: "P", cluster.prefill.engine_pid: "P",
            cluster.decode.proc.pid: "D", cluster.decode.engine_pid: "D"}
    rows, phases = [], {}
    try:
        targets = (("colocated", colocated.url), ("P->D", cluster.url))
        for n in lengths:
            for _, url in targets:
                stream_latency(url, [100 + i for i in range(n)], 4)  # warm-up at this length
            ttfts: dict[str, list[float]] = {name: [] for name, _ in targets}
            itls: dict[str, list[float]] = {name: [] for name, _ in targets}
            second: dict[str, list[float]] = {name: [] for name, _ in targets}  # first -> second token
            sent_at: dict[str, list[tuple[str, float, float]]] = {name: [] for name, _ in targets}
            for r in range(requests):
                # Interleaved, so drift in this machine's speed hits both setups alike, and each
                # goes first every other time (ABBA), so neither always follows the other's
                # lingering work; `settle` seconds between requests let that work end.
                prompt = [1000 + (r * 7919 + i * 31) % 40000 for i in range(n)]  # distinct: no prefix hits
                for name, url in (targets if r % 2 == 0 else targets[::-1]):
                    time.sleep(settle)
                    request_id, sent = f"bench-{uuid.uuid4().hex[:12]}", []
                    ttft, gaps = stream_latency(url, prompt, 16, request_id, sent)
                    ttfts[name].append(ttft)
                    itls[name] += gaps[1:]
                    second[name].append(gaps[0])
                    sent_at[name].append((request_id, sent[0], sent[0] + ttft))
            time.sleep(0.2)  # the last marks written
            marks = timeline.read(str(log))
            phases[n] = {}
            for name, order in (("colocated", COLOCATED_MARKS), ("P->D", DISAGG_MARKS)):
                each = [phase_breakdown(marks, pids, rid, order, sent, first) for rid, sent, first in sent_at[name]]
                phases[n][name] = {phase: statistics.median(b.get(phase, 0.0) for b in each)
                                   for phase in dict.fromkeys(p for b in each for p in b)}
            stats = {name: (statistics.median(ttfts[name]), statistics.median(itls[name]),
                            statistics.median(second[name])) for name, _ in targets}
            rows.append((n, *stats["colocated"], *stats["P->D"]))
            print(f"prompt {n}: colocated TTFT {stats['colocated'][0] * 1e3:.0f} ms, "
                  f"P->D {stats['P->D'][0] * 1e3:.0f} ms", flush=True)
        if MIXED_SECONDS > 0:
            rows.append(("mixed", {name: mixed_load(url, MIXED_SECONDS) for name, url in targets}))
    finally:
        cluster.stop()
        colocated.stop()
    return rows, phases


def print_phases(phases: dict) -> None:
    """Per prompt length, the median ms of each phase of TTFT, the setups side by side."""
    for n, setups in phases.items():
        colocated, disagg = setups["colocated"], setups["P->D"]
        print(f"\nTTFT by phase, {n}-token prompts (median ms; a row sums the steps since the previous row's):\n")
        print("| phase | colocated | P->D |")
        print("|---|---|---|")
        for phase in dict.fromkeys([p for _, p in DISAGG_MARKS[1:] if p in disagg or p in colocated]):
            cells = [f"{s[phase] * 1e3:.1f}" if phase in s else "" for s in (colocated, disagg)]
            print(f"| {PHASE_NAMES[phase]} | {cells[0]} | {cells[1]} |")
        print(f"| sum of medians | {sum(colocated.values()) * 1e3:.1f} | {sum(disagg.values()) * 1e3:.1f} |")


def bandwidth() -> None:
    num_blocks = 2048 // BLOCK  # the KV of a 2048-token SmolLM2 prompt: 94 MB
    nbytes = num_blocks * 2 * LAYERS * BLOCK * HEADS * HEAD_DIM * 4
    mem, tcp = memcpy_gbps(nbytes), raw_tcp_gbps(nbytes)
    ipc_socket, tcp_conn = connector_gbps(num_blocks, use_tcp=False), connector_gbps(num_blocks, use_tcp=True)
    tcp_encrypted = connector_gbps(num_blocks, use_tcp=True, encrypt=True)
    os.environ["ENGINE_KV_SHM"] = "1"
    ipc_conn = connector_gbps(num_blocks, use_tcp=False)
    ipc_scattered = connector_gbps(num_blocks, use_tcp=False, scattered=True)
    del os.environ["ENGINE_KV_SHM"]
    print(f"\nKV of a 2048-token prompt ({nbytes / 1e6:.0f} MB), best of 3:\n")
    print("| path | GB/s | ratio |")
    print("|---|---|---|")
    print(f"| torch memcpy | {mem:.2f} | |")
    print(f"| raw zmq TCP loopback | {tcp:.2f} | |")
    print(f"| connector, same host, ipc socket (default) | {ipc_socket:.2f} | {ipc_socket / mem:.0%} of memcpy |")
    print(f"| same host, shared-memory KV (ENGINE_KV_SHM=1) | {ipc_conn:.2f} | {ipc_conn / mem:.0%} of memcpy |")
    print(f"| same, fully scattered destination blocks | {ipc_scattered:.2f} | {ipc_scattered / mem:.0%} of memcpy |")
    print(f"| connector, TCP loopback (authenticated, default) | {tcp_conn:.2f} | {tcp_conn / tcp:.0%} of raw TCP |")
    print(f"| same, encrypted (--kv-encrypt, CURVE) | {tcp_encrypted:.2f} | "
          f"{tcp_encrypted / tcp_conn:.0%} of unencrypted TCP |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--skip-bandwidth", action="store_true", help="only the serving comparison")
    parser.add_argument("--max-local-prefill-tokens", type=int, default=0,
                        help="the proxy's (engine proxy's default is 512: shorter prompts are prefilled on D, "
                             "longer ones ask D first); 0, the default here: every prompt through P")
    parser.add_argument("--prefill-args", default="", help="more flags for the prefill instance alone")
    parser.add_argument("--mixed-seconds", type=float, default=MIXED_SECONDS,
                        help="duration of the mixed-load ITL run per setup (0 skips it)")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds of quiet before each measured request (default 0: back to back)")
    args = parser.parse_args()
    globals()["MIXED_SECONDS"] = args.mixed_seconds

    if not args.skip_bandwidth:
        bandwidth()
    if not args.skip_serving:
        rows, phases = serving(args.model, args.lengths, args.requests, args.max_local_prefill_tokens,
                               tuple(shlex.split(args.prefill_args)), args.settle)
        print("\n| prompt tokens | colocated TTFT ms | P->D TTFT ms | overhead | colocated ITL ms | P->D ITL ms "
              "| colocated 1st->2nd token ms | P->D 1st->2nd token ms |")
        print("|---|---|---|---|---|---|---|---|")
        mixed = rows.pop()[1] if rows and rows[-1][0] == "mixed" else {}
        for n, c_ttft, c_itl, c_second, d_ttft, d_itl, d_second in rows:
            print(f"| {n} | {c_ttft * 1e3:.0f} | {d_ttft * 1e3:.0f} | {(d_ttft - c_ttft) / c_ttft:+.1%} | "
                  f"{c_itl * 1e3:.1f} | {d_itl * 1e3:.1f} | {c_second * 1e3:.0f} | {d_second * 1e3:.0f} |")
        print_phases(phases)
        if mixed:
            print(f"\nMixed load ({MIXED_SECONDS:.0f} s: 4 short streams decoding while a 2048-token prompt "
                  "arrives every 4 s), ITL of the short streams:\n")
            print("| setup | median ITL ms | p99 ITL ms |")
            print("|---|---|---|")
        for name, (median, p99, _) in mixed.items():
            print(f"| {name} | {median * 1e3:.1f} | {p99 * 1e3:.1f} |")


if __name__ == "__main__":
    main()
