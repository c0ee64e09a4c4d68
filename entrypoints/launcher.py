"""`engine disagg`: one prefill instance, one decode instance and the proxy on this host, as
three processes, with Ctrl-C/SIGTERM forwarded to all of them."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from engine.cpu_placement import (
    available_cores,
    check_placement,
    split_cores,
)
from engine.kv_transfer.secret import ENV_VAR, new_secret


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Until GET url/health answers 200; raises when ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    # One client for all the polls: httpx.get would build one (and an SSL context) every time,
    # ~40 ms of CPU taken from the processes starting up.
    with httpx.Client(timeout=1) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with code {proc.returncode}")
            try:
                if http.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s")


def core_split(prefill_cores: str | None, decode_cores: str | None) -> tuple[str, str]:
    """Each instance's cores: as given; a side not given gets the cores the other leaves (all
    of them if it leaves none); neither given: this host's physical cores in two halves (on
    one core both share it). ValueError names a bad or unavailable list."""
    ours = available_cores()
    prefill = check_placement(prefill_cores, None)
    decode = check_placement(decode_cores, None)
    if prefill is None and decode is None:
        prefill, decode = split_cores(ours, 2)
    elif prefill is None:
        prefill = [c for c in ours if c not in decode] or ours
    elif decode is None:
        decode = [c for c in ours if c not in prefill] or ours
    if set(prefill) & set(decode):
        print(f"warning: prefill and decode share cores {sorted(set(prefill) & set(decode))}", flush=True)
    return ",".join(map(str, prefill)), ",".join(map(str, decode))


def run_disagg(model: str | None, host: str, port: int, engine_args: list[str], prefill_cores: str | None = None,
               decode_cores: str | None = None, proxy_args: list[str] = (), core_lending: bool = True,
               decode_args: list[str] = (), gpus: tuple[str | None, str | None] = (None, None)) -> int:
    """``gpus``: the CUDA_VISIBLE_DEVICES of the prefill and the decode instance (None: inherited)."""
    engine = [sys.executable, "-m", "entrypoints.cli"]
    p_cores, d_cores = core_split(prefill_cores, decode_cores)
    lending_dir = tempfile.mkdtemp(prefix="engine-cores-")  # private (0700): only our processes steer placement
    lend, borrow = [], []
    if core_lending and p_cores != d_cores:
        board = os.path.join(lending_dir, "prefill")
        lend, borrow = ["--lend-cores", board], ["--borrow-cores", board]
    print(f"cores: prefill {p_cores}, decode {d_cores} (each engine's compute pinned there, one torch thread "
          f"per physical core; the API front ends and the proxy are not pinned)"
          + ("; the decode also runs on the prefill's cores while the prefill is idle" if lend else ""), flush=True)
    env = dict(os.environ)
    if "--kv-secret-file" not in engine_args and not env.get(ENV_VAR):
        # Protected without configuration: a fresh secret for these processes only (the
        # environment of a process is readable by its owner alone).
        env[ENV_VAR] = new_secret()
    model_args = [model] if model else []
    p_port, d_port, kv_port = _free_port(), _free_port(), _free_port()
    procs: list[subprocess.Popen] = []
    try:
        p_env, d_env = ({**env, "CUDA_VISIBLE_DEVICES": g} if g is not None else env for g in gpus)
        procs.append(subprocess.Popen([*engine, "serve", *model_args, "--port", str(p_port), "--role", "prefill",
                                       "--kv-port", str(kv_port), "--cpu-cores", p_cores, *lend, *engine_args],
                                      env=p_env))
        procs.append(subprocess.Popen([*engine, "serve", *model_args, "--port", str(d_port), "--role", "decode",
                                       "--cpu-cores", d_cores, *borrow, *engine_args, *decode_args], env=d_env))
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        wait_healthy(p_url, procs[0])
        wait_healthy(d_url, procs[1])
        procs.append(subprocess.Popen([*engine, "proxy", "--host", host, "--port", str(port),
                                       "--prefill", p_url, "--decode", d_url, *proxy_args], env=env))
        wait_healthy(f"http://{host}:{port}", procs[2], timeout=60)
        print(f"""
prefill {p_url} (KV on port {kv_port}) -> decode {d_url}, proxy on http://{host}:{port}
try:
  curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}}'
Ctrl-C stops all three.""", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 1  # one of them died
    except KeyboardInterrupt:
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(lending_dir, ignore_errors=True)
