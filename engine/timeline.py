"""Phase marks of a request across the processes that serve it (engine proxy, the API servers,
the engine cores), for the benchmarks' breakdown of time to first token (benchmarks/disagg.py
prints it). Off unless ENGINE_PHASE_LOG names a file when the process starts: then each ``mark``
appends one JSON line per request id, ``[time.monotonic(), pid, phase, request id]``, to it.
time.monotonic() is CLOCK_MONOTONIC, one clock for every process of a host, so the marks of a
proxy, a prefill and a decode instance on one host line up. A request is named by its engine
request id (the proxy's X-Engine-Request-Id, which P and D share; a sequence id where n > 1)."""
from __future__ import annotations

import json
import os
import time

ENV_VAR = "ENGINE_PHASE_LOG"
_PATH = os.environ.get(ENV_VAR) or None
_fd: int | None = None

enabled = _PATH is not None


def mark(phase: str, *request_ids: str, at: float | None = None) -> None:
    """Records that ``request_ids`` reached ``phase`` now, or ``at`` (a time.monotonic() taken
    earlier); nothing when off."""
    global _fd
    if _PATH is None or not request_ids:
        return
    now = time.monotonic() if at is None else at
    if _fd is None:
        _fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    pid = os.getpid()
    # One write per call, in append mode: lines of concurrent processes never interleave.
    os.write(_fd, "".join(json.dumps([now, pid, phase, rid]) + "\n" for rid in request_ids).encode())


def read(path: str) -> list[tuple[float, int, str, str]]:
    """The marks in ``path``, as (time, pid, phase, request id)."""
    with open(path) as f:
        return [tuple(json.loads(line)) for line in f]
