"""Core lending between two engine instances on one host (`engine disagg`).

A prefill instance computes in bursts; between them its cores idle while the decode instance
next to it is busy. With lending, the prefill instance (the lender) says through a small file
whether it is computing and on which cores; the decode instance (the borrower) reads that
before every step and runs on its own cores plus the lender's while the lender is idle, with
one torch thread per physical core. When the lender gets work, the borrower gives the cores
back at its next step, so the two share a core for at most one decode step.

The file holds one line, "<busy 0|1> <core list>", rewritten in place (a few bytes, so a reader
sees the old line or the new one). It only steers where this host's own compute runs: it lives
in a directory private to the deployment, it is opened without following links or blocking,
and the borrower takes only cores its deployment may use anyway (its API server's).
"""
from __future__ import annotations

import logging
import os
import stat

from engine.cpu_placement import apply_placement, parse_cores

logger = logging.getLogger("engine")

LINE_BYTES = 4096  # "1 0-31,64-95" and padding: the whole line is rewritten in one pwrite


def core_ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(f"{start}-{core}" if core != start else str(core))
            start = None
    return ",".join(parts)


class CoreLender:
    def __init__(self, path: str, cores: list[int]) -> None:
        self.cores = core_ranges(sorted(cores))
        if len(self.cores) + 2 > LINE_BYTES:
            raise ValueError("lend_cores_file: too many core ranges to lend")
        # Never through a link someone else planted (the file may be in a shared directory).
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        self.busy: bool | None = None
        self.borrowing = False  # (a lender never borrows)
        self.before_step(False)

    def before_step(self, busy: bool) -> None:
        """Tell the borrower whether this instance has work (only when that changes)."""
        if busy != self.busy:
            line = f"{int(busy)} {self.cores}".encode().ljust(LINE_BYTES)[:LINE_BYTES]
            os.pwrite(self.fd, line, 0)
            self.busy = busy

    def close(self) -> None:
        os.close(self.fd)


def core_lending(config) -> CoreLender | CoreBorrower | None:
    """The lending side an engine's config asks for (its cpu_cores are checked already)."""
    if config.lend_cores_file:
        return CoreLender(config.lend_cores_file, config.cpu_cores)
    if config.borrow_cores_file:
        return CoreBorrower(config.borrow_cores_file, config.cpu_cores)
    return None


class CoreBorrower:
    def __init__(self, path: str, own_cores: list[int]) -> None:
        self.path, self.own = path, sorted(own_cores)
        self.current = self.own
        self.failed = False
        # What the file may name: cores this deployment may use at all (the API server, our
        # parent, is not pinned), never more.
        try:
            self.allowed = set(os.sched_getaffinity(os.getppid())) | set(own_cores)
        except OSError:
            self.allowed = set(own_cores)

    @property
    def borrowing(self) -> bool:
        return self.current != self.own

    def _lent(self) -> list[int]:
        """The lender's cores while it is idle, else none (also when it has not started yet)."""
        try:
            # Not through a link, never blocking on a FIFO, only a regular file.
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return []
                busy, _, cores = os.read(fd, LINE_BYTES).decode().strip().partition(" ")
            finally:
                os.close(fd)
            return sorted(set(parse_cores(cores)) & self.allowed) if busy == "0" else []
        except (OSError, ValueError, UnicodeDecodeError):
            return []

    def before_step(self, busy: bool) -> None:
        """Run on our cores plus the lender's while it idles (checked only when we have work)."""
        if self.failed or not busy:
            return
        wanted = sorted(set(self.own) | set(self._lent()))
        if wanted == self.current:
            return
        try:
            apply_placement(wanted, None, quiet=True)
        except OSError as exc:  # cores we may not use: stay on our own from now on
            logger.warning("cannot borrow cores %s (%s); staying on %s", wanted, exc, self.own)
            apply_placement(self.own, None, quiet=True)
            self.failed, wanted = True, self.own
        self.current = wanted
        logger.debug("compute on cores %s", wanted)
