"""Nothing a prefill instance does for a decode instance or a store (offering the prompt's KV,
saving it to a tier) sits between its prefill and the first token it sends: the engine core
sends a step's outputs first and makes the step's offers and saves after. Checked on a real
prefill instance with a CPU tier, from the order of the phase marks its engine core writes
(engine/timeline.py, one thread: an order, not a timing)."""
from __future__ import annotations

import time

from engine import timeline
from tests.server_utils import HTTP, ServerProcess, free_port


def _core_marks(log, core_pid: int, until_phase: str, timeout: float = 10.0) -> list[tuple[float, str, str]]:
    """(time, phase, request id) of the engine core's marks, once one is ``until_phase``."""
    deadline = time.monotonic() + timeout
    while True:
        marks = [(t, phase, rid) for t, pid, phase, rid in timeline.read(str(log)) if pid == core_pid] \
            if log.exists() else []
        if any(phase == until_phase for _, phase, _ in marks) or time.monotonic() > deadline:
            return marks
        time.sleep(0.05)


def test_the_first_token_goes_out_before_the_offer_and_the_tier_save(tiny_llama, tmp_path):
    log = tmp_path / "marks.jsonl"
    srv = ServerProcess(str(tiny_llama), "--num-blocks", "64", "--role", "prefill", "--kv-port", str(free_port()),
                        "--kv-store", "cpu:16MiB", "--kv-chunk-tokens", "32", env={timeline.ENV_VAR: str(log)})
    try:
        # 40 tokens: a whole 32-token chunk and the prompt's trailing whole block, saved in the
        # step that computes the prompt and samples the first token.
        answer = HTTP.post(f"{srv.url}/v1/completions", timeout=60, json={
            "prompt": list(range(5, 45)), "max_tokens": 4, "ignore_eos": True,
            "kv_transfer_params": {"do_remote_decode": True}}).json()
        request_id = answer["kv_transfer_params"]["remote_request_id"]
        marks = _core_marks(log, srv.engine_pid, "kv.offered")
        first = {}
        for t, phase, rid in marks:
            if rid == request_id:
                first.setdefault(phase, t)
        sampled, sent, offered = first["runner.sampled"], first["core.sent"], first["kv.offered"]
        assert sampled < sent < offered, first
        saved = [t for t, phase, _ in marks if phase == "kv.saved" and t > sampled]
        assert saved, "the tier saved nothing of the prompt"
        assert min(saved) > sent, "a tier save ran between the prefill and the first token's output"
    finally:
        srv.stop()
