"""Start a real `engine serve` subprocess on a free loopback port and check it stays clean."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# One client for the helpers' polling: httpx.get builds a client (and an SSL context) per call,
# ~40 ms of CPU, which readiness and idle polls would take from the servers they wait on. No
# keep-alive: each call connects afresh, as httpx.get does, so no connection outlives a server.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def log_dir() -> Path:
    """Where test servers write their logs: the session's directory (conftest) or the temp dir."""
    return Path(os.environ.get("ENGINE_TEST_LOG_DIR") or tempfile.gettempdir())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


class ServerProcess:
    def __init__(self, *args: str, api_key: str | None = None, startup_timeout: float = 120.0,
                 env: dict | None = None, port: int | None = None, wait: bool = True, host=None) -> None:
        """Starts the server; with ``wait`` (default) returns once it is healthy. Without,
        call ``wait_ready()`` (servers started together then load side by side). ``host``: a
        tests/multihost.py Host to run on (bound to its address), instead of loopback."""
        self.args = args
        self.port = port or free_port()
        self.api_key = api_key
        cmd = [sys.executable, "-m", "entrypoints.cli", "serve", *args, "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        if host is not None:
            cmd = host.command([*cmd, "--host", host.address])
        self.log_path = log_dir() / f"engine-serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.url = f"http://{host.address if host is not None else '127.0.0.1'}:{self.port}"
        self.startup_timeout = startup_timeout
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up:\n{self.log_path.read_text()[-3000:]}")
            try:
                if HTTP.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"server not healthy after {self.startup_timeout}s")
            time.sleep(0.05)
        self.engine_pid = self.status()["engine_pid"]

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def status(self) -> dict:
        return HTTP.get(f"{self.url}/status", timeout=5).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Until nothing runs or waits, every KV block is free (cached ones count as free) and the
        engine holds no per-request state anywhere (scheduler, connectors, front end)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            requests = status["requests"]
            busy = requests["running"] + requests["waiting"] + status["kv_blocks"]["in_use"]
            if busy == 0 and requests["in_flight_http"] == 0 and requests["tracked_by_engine"] == 0:
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {status}")
            time.sleep(0.1)

    def metrics(self) -> str:
        return HTTP.get(f"{self.url}/metrics", timeout=5).text

    def kill(self) -> None:
        """SIGKILL the server and its engine core: a crash, no cleanup."""
        for pid in (self.proc.pid, self.engine_pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self.log.close()

    def terminate(self, group: bool = False) -> None:
        """SIGTERM, once (a second one makes uvicorn skip its graceful shutdown); with ``group``
        to the engine core too, as a SIGTERM to the process group (`make serve` stopped) has it."""
        if self.proc.poll() is None and not getattr(self, "_terminated", False):
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True
            engine_pid = getattr(self, "engine_pid", None)
            if group and engine_pid is not None:
                os.kill(engine_pid, signal.SIGTERM)

    def stop(self, timeout: float = 20.0, group: bool = False) -> int:
        """SIGTERM (``terminate``), then check that the server and its engine core both exited in time."""
        self.terminate(group)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("server did not exit within {timeout}s of SIGTERM")
        finally:
            self.log.close()
        engine_pid = getattr(self, "engine_pid", None)
        deadline = time.monotonic() + 5
        while engine_pid is not None and pid_alive(engine_pid):
            if time.monotonic() > deadline:
                os.kill(engine_pid, signal.SIGKILL)
                raise AssertionError("engine core process outlived the server")
            time.sleep(0.05)
        return code


def leave_when(url: str, body: dict, ready, timeout: float = 30) -> None:
    """Send ``body``, and hang up as soon as ``ready()`` (polled) says the server is where the
    test wants the request to be. The request must still be open then: no client timeout has
    to be shorter than the work, only the hang-up has to beat it."""
    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            task = asyncio.ensure_future(http.post(url, json=body))
            deadline = time.monotonic() + timeout
            while not await asyncio.to_thread(ready):
                assert not task.done(), f"the request ended before the client left: {task.result().text[:300]}"
                assert time.monotonic() < deadline, "the request never reached the state to leave in"
                await asyncio.sleep(0.02)
            assert not task.done(), "the request ended before the client left"
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    asyncio.run(run())


def wait_for(condition, timeout: float = 30, state=lambda: None) -> None:
    """Polls ``condition()`` until it holds; fails after ``timeout`` seconds showing ``state()``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {state()}"
        time.sleep(0.01)
