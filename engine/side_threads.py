"""Threads that run torch ops beside the model's forward pass (the KV connectors' pull, serve and
tier threads): ``side_thread`` starts one whose ops each run on that thread alone.

Why: torch's CPU ops run on OpenMP teams (libgomp in the Linux wheels), one team per thread
that calls an op big enough to split. Once libgomp manages more threads than the process may
run on (the forward pass's team alone fills its cores), it stops spinning at the barriers of
every team, the forward pass's included: those threads then sleep and are woken at each of the
hundreds of barriers of a step. A side thread's first KV copy used to set that off for the
process's life. On a 2-vCPU VM a decode instance that had pulled a prompt decoded at 11.6 ms a
token where the same engine without a connector took 6.7 ms, its compute threads slept ~2,000
times per 16-token request (against ~0), and a prefill instance's prefill was 5-15% slower
(issue 49). A side thread's copies are memory-bound and small; on one thread they never start a
team.

omp_set_num_threads sets the calling thread's own OpenMP thread count, which is what ATen reads
(torch.get_num_threads()); torch.set_num_threads would also change the count every thread
started later begins with (a user's thread that calls LLM.generate, say)."""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Callable

import torch

logger = logging.getLogger("engine")

_OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")
_setter_lock = threading.Lock()
_setter: Callable[[int], None] | None = None
_looked = False


def _openmp_set_num_threads() -> Callable[[int], None] | None:
    """omp_set_num_threads of the OpenMP runtime torch loaded (found among this process's mapped
    files: a runtime of the same name elsewhere on the system would be another copy), or None
    with the reason logged once."""
    global _setter, _looked
    with _setter_lock:
        if _looked:
            return _setter
        _looked = True
        try:
            with open("/proc/self/maps") as maps:
                paths = {fields[5] for fields in (line.split(maxsplit=5) for line in maps) if len(fields) == 6}
        except OSError as exc:
            logger.info("side threads run torch ops with torch's thread count: no /proc/self/maps (%s)", exc)
            return None
        for path in sorted(paths):
            path = path.strip()
            if os.path.basename(path).startswith(_OPENMP_LIBRARIES) and os.path.exists(path):
                try:
                    _setter = ctypes.CDLL(path).omp_set_num_threads
                    return _setter
                except (OSError, AttributeError) as exc:
                    logger.info("side threads run torch ops with torch's thread count: %s: %s", path, exc)
                    return None
        logger.info("side threads run torch ops with torch's thread count: torch loaded no OpenMP runtime")
        return None


def one_thread_for_ops() -> None:
    """From now on, torch ops called on this thread run on it alone (no OpenMP team)."""
    torch.get_num_threads()  # ATen sets a thread's OpenMP count from the process's once, first
    setter = _openmp_set_num_threads()
    if setter is not None:
        setter(1)


def side_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread (not started) that runs ``target`` with one thread for its torch ops."""
    def run() -> None:
        one_thread_for_ops()
        target()
    return threading.Thread(target=run, name=name, daemon=True)
