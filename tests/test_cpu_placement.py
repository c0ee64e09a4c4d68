"""CPU placement (engine/cpu_placement.py, engine/core_lending.py): core lists, the split
`engine disagg` makes and the flags it hands its instances, a pinned `engine serve` whose engine
threads really run on the cores they were given, and a decode instance that runs on the prefill
instance's cores exactly while that one is idle."""
from __future__ import annotations

import os

import httpx
import pytest

from engine import core_lending
from engine.config import EngineConfig
from engine.core_lending import CoreBorrower, CoreLender
from engine.cpu_placement import (
    MAX_CORE_ID,
    apply_placement,
    available_cores,
    parse_cores,
    physical_cores,
    split_cores,
)
from entrypoints import cli, launcher
from entrypoints.launcher import core_split
from tests.server_utils import ServerProcess, wait_for


def test_core_lists_parse_and_bad_ones_name_the_field():
    assert parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cores(" 2, 0 ,2") == [0, 2]
    for bad in ("", " ", "a", "3-1", "-1", "0-", "1,,2", f"0-{MAX_CORE_ID + 1}", "0-4294967295"):
        with pytest.raises(ValueError, match="cpu_cores"):
            parse_cores(bad)
    with pytest.raises(ValueError, match="cpu_cores"):
        EngineConfig(cpu_cores=[max(available_cores()) + 1000])
    with pytest.raises(ValueError, match="cpu_cores"):
        EngineConfig(cpu_cores=5)
    for bad in (0, True, 10**9):
        with pytest.raises(ValueError, match="num_threads"):
            EngineConfig(num_threads=bad)
    core = available_cores()[0]
    assert EngineConfig(cpu_cores=f"{core},{core}").cpu_cores == [core]
    assert EngineConfig(cpu_cores=[core, core]).cpu_cores == [core]


def test_split_keeps_physical_cores_whole():
    cpus = available_cores()
    cores = physical_cores(cpus)
    assert sorted(c for core in cores for c in core) == cpus
    prefill, decode = split_cores(cpus, 2)
    assert sorted(set(prefill) | set(decode)) == cpus
    if len(cores) > 1:
        assert not set(prefill) & set(decode)
        for core in cores:  # siblings land on one side
            assert set(core) <= set(prefill) or set(core) <= set(decode)
    else:
        assert prefill == decode == cpus


def test_disagg_hands_each_instance_its_cores_and_refuses_shared_placement(monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "run_disagg", lambda *a, **k: calls.append(a) or 0)
    assert cli.main(["disagg", "--prefill-cores", str(available_cores()[0])]) == 0
    model, host, port, engine_args, prefill_cores, decode_cores, proxy_args = calls[0]
    assert proxy_args == ["--max-local-prefill-tokens", "512", "--max-prefill-queue", "4"]
    assert prefill_cores == str(available_cores()[0]) and decode_cores is None
    assert "--cpu-cores" not in engine_args and "--num-threads" not in engine_args
    p, d = core_split(prefill_cores, decode_cores)
    assert p == str(available_cores()[0])
    assert d == ",".join(map(str, available_cores()[1:] or available_cores()))
    for flag in (["--num-threads", "2"], ["--cpu-cores", "0"]):
        assert cli.main(["disagg", *flag]) == 2  # refused with a message naming the per-instance flags
    with pytest.raises(ValueError, match="cpu_cores"):
        core_split("", None)


def _allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of ``pid``."""
    lists = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            lists.add(next(line.split(":")[1].strip() for line in f if line.startswith("Cpus_allowed_list")))
    return lists


def test_a_pinned_server_runs_every_engine_thread_on_its_core(tiny_llama):
    core = available_cores()[-1]
    server = ServerProcess(str(tiny_llama), "--num-blocks", "32", "--max-model-len", "256",
                           "--cpu-cores", str(core), "--num-threads", "1")
    try:
        resp = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        assert _allowed(server.engine_pid) == {str(core)}  # after a forward: torch's pool exists
        assert f"engine compute on cores [{core}] with 1 torch threads" in server.log_path.read_text()
    finally:
        server.stop()


def test_lender_and_borrower_agree_through_the_file(tmp_path, monkeypatch):
    import torch
    placed = []
    everything, threads = os.sched_getaffinity(0), torch.get_num_threads()

    def place(cores, threads, quiet):
        """The real placement, recorded: every thread of this process ends up on ``cores``."""
        apply_placement(cores, threads, quiet)
        assert _affinities() == {frozenset(cores)}
        placed.append(cores)

    monkeypatch.setattr(core_lending, "apply_placement", place)
    try:
        _lend_and_borrow(tmp_path, placed)
    finally:
        apply_placement(sorted(everything), threads, quiet=True)  # this test process, as it was


def _affinities() -> set[frozenset]:
    """The distinct core sets of this process's threads (one that ends meanwhile is skipped)."""
    sets = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            sets.add(frozenset(os.sched_getaffinity(int(tid))))
        except OSError:
            pass
    return sets


def _lend_and_borrow(tmp_path, placed: list) -> None:
    cores = available_cores()
    assert len(cores) >= 2, "core lending needs two cores to show anything"
    own, lent = [cores[-1]], cores[:-1]
    board = str(tmp_path / "board")
    borrower = CoreBorrower(board, own)
    borrower.before_step(True)  # no lender yet: stays on its own cores
    assert placed == [] and not borrower.borrowing
    lender = CoreLender(board, lent)
    borrower.before_step(True)  # lender idle: borrow its cores
    assert placed == [cores] and borrower.borrowing  # (the core then lifts its prefill chunk limit)
    borrower.before_step(False)  # nothing to compute: nothing checked or changed
    lender.before_step(True)
    borrower.before_step(True)  # lender busy: give them back
    assert placed == [cores, own] and not borrower.borrowing
    borrower.before_step(True)  # unchanged: no new placement
    assert len(placed) == 2
    lender.before_step(False)
    borrower.before_step(True)
    assert placed[-1] == cores
    for junk in (b"x" * 64, b"0 0-99999999", b"\xff\xfe", b""):  # unreadable: own cores only
        with open(board, "wb") as f:
            f.write(junk)
        borrower.before_step(True)
        assert placed[-1] == own
    with open(board, "wb") as f:  # cores nobody here may use are never taken
        f.write(b"0 0-65535")
    borrower.before_step(True)
    assert placed[-1] == cores
    lender.close()
    os.remove(board)
    os.mkfifo(board)  # a FIFO in its place must not hang the engine
    borrower.before_step(True)
    assert placed[-1] == own
    assert core_lending.core_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_a_borrowing_decode_instance_runs_on_the_lenders_cores_only_while_it_idles(tiny_llama, tmp_path):
    cores = available_cores()
    assert len(cores) >= 2, "core lending needs two cores to show anything"
    own, lent = cores[-1], cores[0]
    board = tmp_path / "board"
    args = (str(tiny_llama), "--num-blocks", "32", "--max-model-len", "256")
    lender = ServerProcess(*args, "--cpu-cores", str(lent), "--lend-cores", str(board))
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    try:
        assert httpx.post(f"{lender.url}/v1/completions", timeout=60, json=body).status_code == 200
        wait_for(lambda: board.read_text().strip() == f"0 {lent}", timeout=10,
                 state=lambda: board.read_text())  # idle again after its request
    finally:
        lender.stop()
    board.write_text(f"1 {lent}".ljust(64))  # as a busy lender writes it
    server = ServerProcess(*args, "--cpu-cores", str(own), "--borrow-cores", str(board))
    try:
        assert httpx.post(f"{server.url}/v1/completions", timeout=60, json=body).status_code == 200
        assert _allowed(server.engine_pid) == {str(own)}
        board.write_text(f"0 {lent}".ljust(64))  # idle now
        assert httpx.post(f"{server.url}/v1/completions", timeout=60, json=body).status_code == 200
        both = ",".join(map(str, sorted({own, lent})))
        assert _allowed(server.engine_pid) == {both if abs(own - lent) > 1 else f"{min(own, lent)}-{max(own, lent)}"}
        board.write_text(f"1 {lent}".ljust(64))
        assert httpx.post(f"{server.url}/v1/completions", timeout=60, json=body).status_code == 200
        assert _allowed(server.engine_pid) == {str(own)}
    finally:
        server.stop()
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(cpu_cores=[own], lend_cores_file="a", borrow_cores_file="b")
    with pytest.raises(ValueError, match="cpu_cores"):
        EngineConfig(borrow_cores_file="b")
