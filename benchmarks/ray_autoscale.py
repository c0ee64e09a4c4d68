"""`engine ray-serve`'s autoscaling with its defaults, measured, through a scale-up, a scale-down
and a node loss in one run: is any request lost?

A local Ray cluster (benchmarks/ray_local.py: a head and 3 one-CPU nodes), the default model as
a decode deployment of 1:2 replicas (one CPU each, no prefill deployment, KV-aware routing),
Serve's autoscaling at the defaults of `engine ray-serve` (--target-ongoing-requests 4, up after
10 s above it, down after 120 s below). Clients send chat requests (not streamed) one after
another, each with its own conversation opening:

1. a load step: --clients clients at once, until the second replica serves and --hold seconds more;
2. the step ends: 2 clients, until Serve has removed a replica (it drains: its open requests finish);
3. the node of the replica left is removed (its engine dies with it) under the same 2 clients,
   until the replacement Serve starts elsewhere has answered.

Reported: when each replica count was reached, and every request's outcome: answered (200 with
its max_tokens), or not (an error status, a cut connection, past the client's timeout).

    python benchmarks/ray_autoscale.py [--clients 12] [--hold 20] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.ray_local import ray_serve_app  # noqa: E402


class Clients:
    """Client threads sending requests back to back; each request's outcome is kept."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.outcomes: list[tuple[float, str]] = []  # (when it ended, "ok" or what went wrong)
        self.served_by_phase: dict[str, int] = {}
        self.phase = "step"
        self._lock = threading.Lock()
        self._stops: list[threading.Event] = []
        self._threads: list[threading.Thread] = []
        self._next = 0

    def set_count(self, n: int) -> None:
        while len(self._stops) > n:
            self._stops.pop().set()
        while len(self._stops) < n:
            stop = threading.Event()
            thread = threading.Thread(target=self._loop, args=(stop,), daemon=True)
            self._stops.append(stop)
            self._threads.append(thread)
            thread.start()

    def _loop(self, stop: threading.Event) -> None:
        with httpx.Client(timeout=300) as http:
            while not stop.is_set():
                with self._lock:
                    k, self._next, phase = self._next, self._next + 1, self.phase
                body = {"messages": [{"role": "user", "content": f"Conversation {k}: tell me about the number {k}."}],
                        "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
                try:
                    resp = http.post(f"{self.url}/v1/chat/completions", json=body)
                    ok = resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == self.max_tokens
                    outcome = "ok" if ok else f"{resp.status_code}: {resp.text[:200]}"
                except httpx.HTTPError as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.outcomes.append((time.monotonic(), outcome))
                    self.served_by_phase[phase] = self.served_by_phase.get(phase, 0) + 1  # by when it was sent

    def stop(self) -> None:
        self.set_count(0)
        for thread in self._threads:
            thread.join(330)


def decode_replicas() -> dict[str, int]:
    from ray import serve
    return dict(serve.status().applications["engine"].deployments["decode"].replica_states)


def wait_for(condition, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what} after {timeout:.0f}s: {decode_replicas()}")
        time.sleep(0.25)
    return time.monotonic()


def replica_nodes() -> list[str]:
    from ray.util.state import list_actors
    return [a["node_id"] for a in list_actors(filters=[("class_name", "=", "ServeReplica:engine:decode"),
                                                       ("state", "=", "ALIVE")])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--clients", type=int, default=12, help="clients in the load step")
    parser.add_argument("--hold", type=float, default=20.0, help="seconds the step goes on once scaled up")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    from engine.worker.loader import resolve_model

    options = {"model": str(resolve_model(args.model)), "prefill_replicas": (0, 0), "decode_replicas": (1, 2),
               "routing": "kv-aware", "engine_args": ["--max-model-len", "2048", "--max-num-seqs", "16"]}
    marks: list[tuple[str, float]] = []
    with ray_serve_app(options, nodes=3) as (url, cluster, nodes):
        clients = Clients(url, args.max_tokens)
        try:
            start = run(clients, cluster, nodes, args, marks)
        finally:
            clients.stop()
    report(clients, args, marks, start)


def run(clients: Clients, cluster, nodes, args, marks: list[tuple[str, float]]) -> float:
    """The three phases; the time the load step started."""
    start = time.monotonic()
    clients.set_count(args.clients)
    marks.append(("load step starts", start))
    marks.append(("Serve starts a 2nd replica", wait_for(
        lambda: decode_replicas().get("STARTING", 0) + decode_replicas().get("RUNNING", 0) >= 2, 300,
        "no 2nd replica")))
    marks.append(("2nd replica running", wait_for(lambda: decode_replicas().get("RUNNING", 0) == 2, 600,
                                                  "the 2nd replica never ran")))
    time.sleep(args.hold)
    clients.phase = "tail"
    clients.set_count(2)
    marks.append(("load step ends (2 clients)", time.monotonic()))
    marks.append(("Serve removes a replica", wait_for(lambda: decode_replicas().get("RUNNING", 0) == 1, 600,
                                                      "never scaled down")))
    wait_for(lambda: len(replica_nodes()) == 1, 300, "the removed replica never ended")
    marks.append(("the removed replica ended (drained)", time.monotonic()))
    [node_id] = replica_nodes()
    clients.phase = "node lost"
    [node] = [n for n in nodes if n.node_id == node_id]
    cluster.remove_node(node, allow_graceful=False)
    lost_at = time.monotonic()
    marks.append(("its node removed", lost_at))
    marks.append(("a replacement running", wait_for(
        lambda: decode_replicas().get("RUNNING", 0) >= 1 and node_id not in replica_nodes(), 600, "no replacement")))
    marks.append(("first answer after the loss", wait_for(
        lambda: any(t > lost_at + 1 and o == "ok" for t, o in list(clients.outcomes)), 300,
        "nothing answered after the node loss")))
    time.sleep(5)
    return start


def report(clients: Clients, args, marks: list[tuple[str, float]], start: float) -> None:
    print(f"\n{args.clients} clients in the step, then 2; chat requests of {args.max_tokens} tokens, not streamed; "
          "decode 1:2 replicas, target 4 open requests per replica, up after 10 s, down after 120 s:\n")
    print("| event | seconds from the load step |\n|---|---|")
    for what, when in marks:
        print(f"| {what} | {when - start:.1f} |")
    failed = [o for _, o in clients.outcomes if o != "ok"]
    print(f"\nrequests: {len(clients.outcomes)} (by the phase they were sent in: {clients.served_by_phase}), "
          f"answered whole: {len(clients.outcomes) - len(failed)}, not: {len(failed)}")
    for outcome in failed[:10]:
        print("  ", outcome)


if __name__ == "__main__":
    main()
