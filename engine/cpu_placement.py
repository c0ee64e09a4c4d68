"""Where an engine's compute runs on a CPU host: the cores its process may use and torch's
intra-op thread count (what vLLM's VLLM_CPU_OMP_THREADS_BIND sets). Instances that share a host
(a prefill and a decode started by `engine disagg`) each get their own cores, so their
compute threads never compete for one core."""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("engine")


def parse_cores(spec: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6]; ValueError naming the problem."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                cores.update(range(lo, hi + 1))
            else:
                cores.add(int(part))
        except ValueError:
            raise ValueError(f"cpu_cores: {spec!r} is not a core list like 0-3,6") from None
    if not cores or min(cores) < 0:
        raise ValueError(f"cpu_cores: {spec!r} is not a core list like 0-3,6")
    return sorted(cores)


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def split_cores(cores: list[int], parts: int) -> list[list[int]]:
    """``cores`` cut into ``parts`` contiguous groups, as even as possible; with fewer cores than
    parts, every part shares all of them."""
    if len(cores) < parts:
        return [list(cores) for _ in range(parts)]
    size, extra = divmod(len(cores), parts)
    groups, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        groups.append(cores[start:end])
        start = end
    return groups


def check_placement(cpu_cores: list[int] | None, num_threads: int | None) -> None:
    if cpu_cores is not None:
        missing = sorted(set(cpu_cores) - set(available_cores()))
        if not cpu_cores or missing:
            raise ValueError(f"cpu_cores: {missing or cpu_cores} not among this process's cores "
                             f"{available_cores()}")
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")


def apply_placement(cpu_cores: list[int] | None, num_threads: int | None) -> None:
    """Pin this process to ``cpu_cores`` and run ``num_threads`` torch threads (default: one per
    core it may use). Called once, in the process that runs the model, before it loads."""
    if cpu_cores is not None:
        os.sched_setaffinity(0, cpu_cores)
    threads = num_threads or (len(cpu_cores) if cpu_cores is not None else None)
    if threads is not None:
        torch.set_num_threads(threads)
    if cpu_cores is not None or num_threads is not None:
        logger.info("engine compute on cores %s with %d torch threads", available_cores(), torch.get_num_threads())
