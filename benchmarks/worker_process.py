"""A benchmark side in its own process (its own venv's python): it loads once, says so in a JSON
line, then answers each JSON line sent on stdin with one JSON line on stdout (other output lines,
a library's chatter, are skipped). benchmarks/peer_worker.py and gguf_peer_worker.py speak it."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess


class WorkerProcess:
    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        # Its own process group: pause() stops its children too (vLLM's engine core process).
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        self.info = self._answer()  # the ready line
        assert self.info.get("ready"), self.info

    def _answer(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} worker exited (rc {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def request(self, command: dict) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def pause(self) -> None:
        """Stop every process of this side (SIGSTOP) while another is measured, so nothing of it
        (a polling thread, a spinning OpenMP team) takes the measured side's cores."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
