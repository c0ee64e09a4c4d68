"""LLMEngine: the engine in one process, as the offline ``LLM`` uses it. The engine core
(token ids in, token ids out) and the front end's output processor (text, stop strings,
outputs) side by side; the server runs the same two in two processes (engine/core.py and
engine/core_client.py).

Attributes it does not define (scheduler, runner, kv_cache_manager, vocab_size, ...) are the
core's."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.errors import InvalidRequestError
from engine.kv_transfer.params import KVTransferParams
from engine.output_processor import OutputKind, OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLMEngine", "OutputKind"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.processor = OutputProcessor(self.core.tokenizer, config.kv_secret)

    def __getattr__(self, name: str):
        return getattr(self.core, name)

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.core.tokenizer.encode(prompt)
        return None, list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    kind: OutputKind = OutputKind.FINAL_ONLY, arrival_time: float | None = None,
                    kv_transfer_params: KVTransferParams | dict | None = None,
                    first_tokens_shown: bool = False, cache_salt: str | None = None) -> None:
        """Queue a request. Raises InvalidRequestError (a ValueError) for a bad one; then
        nothing was queued. With ``kv_transfer_params.first_token_ids`` (from a prefill
        instance) each sequence continues from its first token; ``first_tokens_shown``: the
        client was already shown them (as far as the stop strings allowed), so the deltas go on
        after them. ``cache_salt``: KV shared only with requests of the same salt."""
        if request_id in self.processor:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        try:
            self.core.add_request(request_id, prompt_token_ids, params, arrival_time, kv_transfer_params, cache_salt)
        except ValueError:  # refused before anything was queued
            raise
        except Exception:  # a failure part way: nothing of this request may stay behind
            self.core.discard_request(request_id, params.n)
            raise
        try:
            self.processor.add_request(request_id, prompt_text, prompt_token_ids, params, kind, first_tokens_shown)
        except BaseException:
            self.core.discard_request(request_id, params.n)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests (by the id given to add_request); their blocks are freed now."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            self.processor.abort(request_id)
        self.core.abort_request(ids)

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished_requests() or self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.processor.num_requests

    def num_tracked_requests(self) -> int:
        """Per-request state held anywhere above the runner: 0 when idle, or something leaks."""
        return self.core.num_tracked_requests() + self.processor.num_tracked_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.core.step()
        self.core.save_kv()  # (no one waits for the outputs before this returns)
        processed = self.processor.process(outputs)
        if processed.stop:
            self.core.stop_sequences(processed.stop)
        if processed.abort:
            self.core.abort_request(processed.abort)
        return processed.outputs
