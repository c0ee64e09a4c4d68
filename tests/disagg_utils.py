"""A prefill instance, a decode instance and `engine proxy`, as real processes on loopback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from engine.kv_transfer.secret import ENV_VAR, new_secret
from tests.server_utils import HTTP, REPO, ServerProcess, free_port, log_dir


class ProxyProcess:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *args: str, host=None) -> None:
        self.port = free_port()
        if "--max-local-prefill-tokens" not in args:
            # Every request through the prefill instance, as the P->D tests need (the default,
            # conditional disaggregation, would prefill their short prompts on the decode side).
            args = ("--max-local-prefill-tokens", "0", *args)
        cmd = [sys.executable, "-m", "entrypoints.cli", "proxy", "--port", str(self.port), *args]
        for url in prefill_urls:
            cmd += ["--prefill", url]
        for url in decode_urls:
            cmd += ["--decode", url]
        if host is not None:  # a tests/multihost.py Host
            cmd = host.command([*cmd, "--host", host.address])
        self.log_path = log_dir() / f"engine-proxy-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = f"http://{host.address if host is not None else '127.0.0.1'}:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                HTTP.get(f"{self.url}/health", timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"proxy did not start:\n{self.log_path.read_text()[-3000:]}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Disagg:
    """One P, one D and a proxy in front of them, sharing a fresh deployment secret (as
    `engine disagg` starts them) unless ``secret`` says otherwise (None: no secret)."""

    def __init__(self, model: str, *engine_args: str, prefill_args: tuple = (), decode_args: tuple = (),
                 secret: str | None = "fresh", proxy_args: tuple = ()) -> None:
        self.kv_port = free_port()
        self.secret = new_secret() if secret == "fresh" else secret
        env = {ENV_VAR: self.secret} if self.secret else {}
        # Both start at once and load side by side.
        self.prefill = ServerProcess(model, *engine_args, "--role", "prefill", "--kv-port", str(self.kv_port),
                                     *prefill_args, env=env, wait=False)
        self.decode = ServerProcess(model, *engine_args, "--role", "decode", *decode_args, env=env, wait=False)
        try:
            self.prefill.wait_ready()
            self.decode.wait_ready()
        except Exception:
            for server in (self.prefill, self.decode):
                if server.proc.poll() is None:
                    server.proc.kill()  # its engine core exits with it (it watches its parent)
            raise
        self.proxy = ProxyProcess([self.prefill.url], [self.decode.url], *proxy_args)
        self.url = self.proxy.url

    def wait_idle(self) -> None:
        self.prefill.wait_idle()
        self.decode.wait_idle()

    def stop(self) -> None:
        for srv in (self.decode, self.prefill):  # all three shut down side by side
            srv.terminate()
        self.proxy.stop()
        for srv in (self.decode, self.prefill):
            assert srv.stop() in (0, -15)
