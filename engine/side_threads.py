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
(issue 49). On one thread a side thread's ops never start a team; its copies (a pull's scatter,
a tier chunk's load) then run at one core's copy rate, not measured against two here. MKL's own
threads are not covered (no side thread calls a BLAS routine).

omp_set_num_threads sets the calling thread's own OpenMP thread count, which is what ATen reads
(torch.get_num_threads()); torch.set_num_threads would also change the count every thread
started later begins with (a user's thread that calls LLM.generate, say)."""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from typing import Callable

import torch

logger = logging.getLogger("engine")

_warned = False


@functools.cache
def _openmp_set_num_threads() -> Callable[[int], None] | None:
    """omp_set_num_threads of the OpenMP runtime ATen uses, or None with the reason logged (once;
    twice at most if two threads race to the first call). Looked up through libtorch_cpu's own
    handle: dlsym then searches that library and its dependencies, the runtime ATen is bound to,
    never another copy some other package mapped (a wheel's bundled libgomp, the system's)."""
    libtorch = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.CDLL(libtorch).omp_set_num_threads
    except (OSError, AttributeError) as exc:
        logger.warning("the KV connector threads run torch ops on torch's thread count, which can slow the "
                       "forward pass: no omp_set_num_threads through %s (%s)", libtorch, exc)
        return None


def one_thread_for_ops() -> None:
    """From now on, torch ops called on this thread run on it alone (no OpenMP team)."""
    global _warned
    torch.get_num_threads()  # ATen sets a thread's OpenMP count from the process's once, first
    setter = _openmp_set_num_threads()
    if setter is not None:
        setter(1)
    if setter is not None and torch.get_num_threads() != 1 and not _warned:
        _warned = True
        logger.warning("the KV connector threads run torch ops on %d threads, which can slow the forward pass: "
                       "omp_set_num_threads(1) did not reach ATen's runtime", torch.get_num_threads())


def side_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread (not started) that runs ``target`` with one thread for its torch ops."""
    def run() -> None:
        one_thread_for_ops()
        target()
    return threading.Thread(target=run, name=name, daemon=True)
