"""Where an engine's compute runs on a CPU host: the cores its process may use and torch's
intra-op thread count. Instances that share a host (a prefill and a decode started by `engine
disagg`) each get their own physical cores, so their compute threads never compete for one.
Standard library only at import time: the proxy and the CLI import this without torch."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("engine")

MAX_CORE_ID = 65535  # a bound on "0-N", checked before any range is built


def parse_cores(spec: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6]; ValueError naming the problem."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part), int(part))
        except ValueError:
            raise ValueError(f"cpu_cores: {spec!r} is not a core list like 0-3,6") from None
        if not 0 <= lo <= hi <= MAX_CORE_ID:
            raise ValueError(f"cpu_cores: {spec!r} is not a core list like 0-3,6 (cores 0 to {MAX_CORE_ID})")
        cores.update(range(lo, hi + 1))
    return sorted(cores)


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def physical_cores(cpus: list[int]) -> list[list[int]]:
    """``cpus`` grouped by physical core (hyperthread siblings together), in order of their first
    logical CPU; a CPU whose topology is unreadable is its own core."""
    groups: dict[tuple, list[int]] = {}
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f, open(f"{base}/core_id") as g:
                key: tuple = (int(f.read()), int(g.read()))
        except (OSError, ValueError):
            key = ("cpu", cpu)
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values(), key=lambda g: g[0])


def split_cores(cpus: list[int], parts: int) -> list[list[int]]:
    """``cpus`` cut into ``parts`` groups of whole physical cores, as even as possible; with fewer
    physical cores than parts, every part shares all of them."""
    cores = physical_cores(cpus)
    if len(cores) < parts:
        return [list(cpus) for _ in range(parts)]
    size, extra = divmod(len(cores), parts)
    groups, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        groups.append(sorted(cpu for core in cores[start:end] for cpu in core))
        start = end
    return groups


def check_placement(cpu_cores: list[int] | str | None, num_threads: int | None) -> list[int] | None:
    """The normalised core list (from a list or a spec like "0-3,6"); ValueError naming the field."""
    if isinstance(cpu_cores, str):
        cpu_cores = parse_cores(cpu_cores)
    if cpu_cores is not None:
        if not isinstance(cpu_cores, (list, tuple)) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in cpu_cores):
            raise ValueError(f"cpu_cores must be a list of core numbers or a spec like 0-3,6, got {cpu_cores!r}")
        cpu_cores = sorted(set(cpu_cores))
        missing = sorted(set(cpu_cores) - set(available_cores()))
        if not cpu_cores or missing:
            raise ValueError(f"cpu_cores: {missing or cpu_cores} not among this process's cores "
                             f"{available_cores()}")
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or not 1 <= num_threads <= 4 * (os.cpu_count() or 1)):
        raise ValueError(f"num_threads must be an integer from 1 to {4 * (os.cpu_count() or 1)}, got {num_threads!r}")
    return cpu_cores


def apply_placement(cpu_cores: list[int] | None, num_threads: int | None, quiet: bool = False) -> None:
    """Pin every thread of this process to ``cpu_cores`` (threads created later inherit it) and
    run ``num_threads`` torch threads (default with cores given: one per physical core). Called
    before the model loads (and by core lending between steps). In an offline LLM this changes
    the calling process for good."""
    import torch

    if cpu_cores is not None:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpu_cores)
            except (ProcessLookupError, PermissionError):
                pass  # a thread that just ended
    threads = num_threads or (len(physical_cores(cpu_cores)) if cpu_cores is not None else None)
    if threads is not None:
        torch.set_num_threads(threads)
    if (cpu_cores is not None or num_threads is not None) and not quiet:
        logger.info("engine compute on cores %s with %d torch threads", available_cores(), torch.get_num_threads())
