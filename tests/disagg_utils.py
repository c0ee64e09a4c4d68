"""A prefill instance, a decode instance and `engine proxy`, as real processes on loopback."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from tests.server_utils import REPO, ServerProcess, free_port


class ProxyProcess:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *args: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "entrypoints.cli", "proxy", "--port", str(self.port), *args]
        for url in prefill_urls:
            cmd += ["--prefill", url]
        for url in decode_urls:
            cmd += ["--decode", url]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{self.url}/health", timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("proxy did not start")
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Disagg:
    """One P, one D and a proxy in front of them."""

    def __init__(self, model: str, *engine_args: str, prefill_args: tuple = (), decode_args: tuple = ()) -> None:
        self.kv_port = free_port()
        self.prefill = ServerProcess(model, *engine_args, "--role", "prefill", "--kv-port", str(self.kv_port),
                                     *prefill_args)
        self.decode = ServerProcess(model, *engine_args, "--role", "decode", *decode_args)
        self.proxy = ProxyProcess([self.prefill.url], [self.decode.url])
        self.url = self.proxy.url

    def wait_idle(self) -> None:
        self.prefill.wait_idle()
        self.decode.wait_idle()

    def stop(self) -> None:
        self.proxy.stop()
        for srv in (self.decode, self.prefill):
            assert srv.stop() in (0, -15)
