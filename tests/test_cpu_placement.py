"""CPU placement (engine/cpu_placement.py): core lists, the split `engine disagg` makes, and a
pinned `engine serve` whose engine process really runs on the cores it was given."""
from __future__ import annotations

import httpx
import pytest

from engine.config import EngineConfig
from engine.cpu_placement import available_cores, parse_cores, split_cores
from entrypoints.launcher import core_split
from tests.server_utils import ServerProcess


def test_core_lists_parse_and_bad_ones_name_the_field():
    assert parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cores(" 2, 0 ,2") == [0, 2]
    for bad in ("", "a", "3-1", "-1", "0-", "1,,2"):
        with pytest.raises(ValueError, match="cpu_cores"):
            parse_cores(bad)
    with pytest.raises(ValueError, match="cpu_cores"):
        EngineConfig(cpu_cores=[max(available_cores()) + 1000])
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=0)
    assert EngineConfig(cpu_cores="0").cpu_cores == [0] or 0 not in available_cores()


def test_split_halves_and_shares_a_single_core():
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([5], 2) == [[5], [5]]
    prefill, decode = core_split(None, None)
    assert set(map(int, prefill.split(","))) | set(map(int, decode.split(","))) == set(available_cores())
    if len(available_cores()) > 1:
        assert not set(prefill.split(",")) & set(decode.split(","))
    assert core_split("0", None)[0] == "0"


def test_a_pinned_server_runs_on_its_cores(tiny_llama):
    core = available_cores()[-1]
    server = ServerProcess(str(tiny_llama), "--num-blocks", "32", "--max-model-len", "256",
                           "--cpu-cores", str(core), "--num-threads", "1")
    try:
        with open(f"/proc/{server.engine_pid}/status") as f:
            allowed = next(line.split(":")[1].strip() for line in f if line.startswith("Cpus_allowed_list"))
        assert allowed == str(core)
        resp = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200 and len(resp.json()["choices"][0]["text"]) > 0
        assert f"engine compute on cores [{core}] with 1 torch threads" in server.log_path.read_text()
    finally:
        server.stop()
