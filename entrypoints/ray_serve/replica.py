"""One engine instance as a Ray Serve replica (the prefill and decode deployments of
``engine ray-serve``; docs/ray.md).

The replica starts a real ``engine serve`` on its node: its own engine-core process, as many
torch threads as the CPUs Ray gave the replica, its OpenAI API and (prefill) its KV port on the
node's address, which the other replicas reach. Requests come through Ray (a deployment handle,
routed by Serve over its replica set) and go to that server over the node's own network.

The deployment secret arrives as a ``SealedSecret`` init argument: it is passed to the engine in
its environment, never on a command line, and nothing prints it. Serve's health check asks the
engine; a replica being removed drains first (Serve waits for its open requests, then the
prefill keeps its held offers until their consumers pulled them or their lease ended).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from engine.kv_transfer.secret import ENV_VAR

logger = logging.getLogger("engine.ray_serve")
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


class SealedSecret:
    """The deployment secret, shown as ``<sealed>`` by repr and str (Serve and Ray log and
    display deployment arguments)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "SealedSecret(<sealed>)"

    __str__ = __repr__


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the forked child only calls it
PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """In the engine's process before exec: SIGTERM when the replica's process ends, however it
    ends (a node lost kills the replica with SIGKILL; its engine must not outlive it). A parent
    gone before this ran is seen at once."""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineReplica:
    def __init__(self, model: str, role: str, engine_args: list[str], secret: SealedSecret,
                 lease_s: float = 30.0) -> None:
        import ray

        if role not in ("prefill", "decode", "both"):  # both: no prefill deployment
            raise ValueError(f"role must be prefill, decode or both, got {role!r}")
        self.role, self.lease_s = role, lease_s
        host = ray.util.get_node_ip_address()
        assigned = ray.get_runtime_context().get_assigned_resources()
        cpus = max(1, int(assigned.get("CPU", 1)))
        port = _free_port(host)
        self.url = f"http://{host}:{port}"
        cmd = [sys.executable, "-m", "entrypoints.cli", "serve", model, "--host", host, "--port", str(port),
               "--num-threads", str(cpus), "--role", role, "--kv-lease-s", str(lease_s), *engine_args]
        if role == "prefill":
            cmd += ["--kv-ip", host, "--kv-port", str(_free_port(host))]
        cmd += ["--kv-events"]  # for KV-aware routing (on the node's address, under the secret)
        self.log_path = tempfile.NamedTemporaryFile(prefix=f"engine-{role}-{port}-", suffix=".log",
                                                    delete=False).name
        env = {**os.environ, ENV_VAR: secret.reveal(), "PYTHONUNBUFFERED": "1"}
        if not assigned.get("GPU"):
            # Ray sets CUDA_VISIBLE_DEVICES only for actors given GPUs: without one, the engine
            # would take a GPU of the node that Ray may have given another replica.
            env["CUDA_VISIBLE_DEVICES"] = ""
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=functools.partial(_die_with_parent, os.getpid()), env=env)
        # Idle connections dropped before the engine's uvicorn closes them (5 s): reusing one it
        # is closing fails the request with nothing done (as engine proxy does).
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), limits=httpx.Limits(
            max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0))
        self._wait_ready()
        logger.info("%s replica: engine pid %d on %s (%d CPUs), log %s", role, self.proc.pid, self.url, cpus,
                    self.log_path)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine exited ({self.proc.returncode}):\n{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self._stop()
                raise RuntimeError(f"the engine did not start within {START_TIMEOUT_S:.0f}s:\n{self._log_tail()}")
            time.sleep(0.2)

    def _log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]

    # ---- requests (through deployment handles) --------------------------------------------
    # ``prompt_blocks`` is the request router's (entrypoints/ray_serve/router.py), not ours.
    async def call(self, path: str, body: dict, headers: dict, prompt_blocks=None) -> tuple[int, bytes]:
        """A whole answer: (HTTP status, body)."""
        resp = await self.http.post(f"{self.url}{path}", json=body, headers=headers)
        return resp.status_code, resp.content

    async def get(self, path: str, headers: dict) -> tuple[int, bytes]:
        resp = await self.http.get(f"{self.url}{path}", headers=headers)
        return resp.status_code, resp.content

    async def stream(self, path: str, body: dict, headers: dict, prompt_blocks=None):
        """The HTTP status first, then the body as it comes (a client that goes away cancels
        this generator, which closes the connection: the engine aborts the request)."""
        async with self.http.stream("POST", f"{self.url}{path}", json=body, headers=headers) as resp:
            yield resp.status_code
            async for data in resp.aiter_raw():
                yield data

    async def release(self, params: dict, headers: dict) -> int:
        """Passes a hand-off nobody will use to its prefill (any instance forwards it there)."""
        resp = await self.http.post(f"{self.url}/v1/kv/release", json={"kv_transfer_params": params},
                                    headers=headers, timeout=10)
        return resp.status_code

    async def status(self) -> dict:
        return (await self.http.get(f"{self.url}/status", timeout=10)).json()

    # ---- Serve's hooks --------------------------------------------------------------------
    def record_routing_stats(self) -> dict:
        """What the request routers read per replica (engine/ray_serve/router.py): where its
        engine is and publishes KV events."""
        stats = {"url": self.url, "role": self.role}
        try:
            status = httpx.get(f"{self.url}/status", timeout=2).json()
            stats["kv_events"] = status.get("kv_events")
            stats["held_for_transfer"] = status["requests"]["held_for_transfer"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass  # no kv_events key: the routers keep following what they followed
        return stats

    async def check_health(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the engine exited ({self.proc.returncode})")
        resp = await self.http.get(f"{self.url}/health", timeout=5)
        if resp.status_code != 200:
            raise RuntimeError(f"the engine's /health answered {resp.status_code}")

    def __del__(self) -> None:
        """Serve's graceful shutdown, after the replica's open requests finished: a prefill
        keeps the KV it holds for decode instances until they pulled it or its lease ended."""
        proc = getattr(self, "proc", None)
        if proc is None or proc.poll() is not None:
            return
        if self.role == "prefill":
            deadline = time.monotonic() + self.lease_s + 5
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(f"{self.url}/status", timeout=2).json()["requests"]["held_for_transfer"] == 0:
                        break
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    break
                time.sleep(0.2)
        self._stop()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the engine drains what is left, then exits
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
