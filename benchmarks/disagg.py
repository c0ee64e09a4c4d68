"""Disaggregated prefill, measured side by side in one run:

1. KV transfer bandwidth of the real worker code path (producer -> consumer, same host over
   ipc and over TCP loopback, authenticated with a deployment secret; over TCP also encrypted,
   as with --kv-encrypt) next to torch memcpy and raw zmq TCP loopback bandwidth.
2. TTFT and ITL, colocated `engine serve` against prefill -> decode through `engine proxy`,
   at several prompt lengths (sequential requests, so this is the pure disaggregation overhead).

    python benchmarks/disagg.py [--model M] [--lengths 128 512 2048] [--requests 5] [--skip-serving]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

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


def stream_latency(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    start = time.perf_counter()
    ttft, last, itls = None, None, []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            else:
                itls.append(now - last)
            last = now
    return ttft, itls


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


def serving(model: str | None, lengths: list[int], requests: int) -> list[tuple]:
    from engine.worker.loader import resolve_model

    args = ["--kv-cache-memory", "1GiB"]
    model_dir = str(resolve_model(model))
    colocated = ServerProcess(model_dir, *args)
    cluster = Disagg(model_dir, *args)
    rows = []
    try:
        targets = (("colocated", colocated.url), ("P->D", cluster.url))
        for n in lengths:
            for _, url in targets:
                stream_latency(url, [100 + i for i in range(n)], 4)  # warm-up at this length
            ttfts: dict[str, list[float]] = {name: [] for name, _ in targets}
            itls: dict[str, list[float]] = {name: [] for name, _ in targets}
            second: dict[str, list[float]] = {name: [] for name, _ in targets}  # first -> second token
            for r in range(requests):
                # Interleaved, so drift in this machine's speed hits both setups alike.
                prompt = [1000 + (r * 7919 + i * 31) % 40000 for i in range(n)]  # distinct: no prefix hits
                for name, url in targets:
                    ttft, gaps = stream_latency(url, prompt, 16)
                    ttfts[name].append(ttft)
                    itls[name] += gaps[1:]
                    second[name].append(gaps[0])
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
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--mixed-seconds", type=float, default=MIXED_SECONDS,
                        help="duration of the mixed-load ITL run per setup (0 skips it)")
    args = parser.parse_args()
    globals()["MIXED_SECONDS"] = args.mixed_seconds

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

    if not args.skip_serving:
        rows = serving(args.model, args.lengths, args.requests)
        print("\n| prompt tokens | colocated TTFT ms | P->D TTFT ms | overhead | colocated ITL ms | P->D ITL ms "
              "| colocated 1st->2nd token ms | P->D 1st->2nd token ms |")
        print("|---|---|---|---|---|---|---|---|")
        mixed = rows.pop()[1] if rows and rows[-1][0] == "mixed" else {}
        for n, c_ttft, c_itl, c_second, d_ttft, d_itl, d_second in rows:
            print(f"| {n} | {c_ttft * 1e3:.0f} | {d_ttft * 1e3:.0f} | {(d_ttft - c_ttft) / c_ttft:+.1%} | "
                  f"{c_itl * 1e3:.1f} | {d_itl * 1e3:.1f} | {c_second * 1e3:.0f} | {d_second * 1e3:.0f} |")
        if mixed:
            print(f"\nMixed load ({MIXED_SECONDS:.0f} s: 4 short streams decoding while a 2048-token prompt "
                  "arrives every 4 s), ITL of the short streams:\n")
            print("| setup | median ITL ms | p99 ITL ms |")
            print("|---|---|---|")
        for name, (median, p99, _) in mixed.items():
            print(f"| {name} | {median * 1e3:.1f} | {p99 * 1e3:.1f} |")


if __name__ == "__main__":
    main()
