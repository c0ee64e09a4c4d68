"""The offline API: ``LLM(...).generate(prompts, sampling_params)`` and ``.chat(...)``."""
from __future__ import annotations

import itertools
import time
import weakref
from typing import Sequence

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, OutputKind
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from entrypoints.llm_arguments import engine_arguments
from entrypoints.prompt_inputs import PromptInput, SaltedPrompt, parse_conversations, parse_prompts


class LLM:
    """Loads a model and generates for batches of prompts.

    ``LLM()`` loads the default model (SmolLM2-135M-Instruct). Keyword arguments follow vLLM:
    block_size, kv_cache_memory ("2GiB" or bytes) or num_blocks, max_num_seqs,
    max_num_batched_tokens, max_model_len, enable_prefix_caching, dtype, seed,
    kv_transfer_config, and kv_store ("cpu:4GiB,disk:/path:20GiB,redis://host:6379/0"),
    kv_chunk_tokens, kv_store_ttl_s; vLLM's others are accepted or refused by name
    (entrypoints/llm_arguments.py). None means the default.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_arguments(kwargs)))
        self._ids = itertools.count()
        # Stops the connector's threads and flushes pending KV store writes, at shutdown() or
        # when this object goes away (process exit included).
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs come back in input order. ``prompts``: one prompt or a list of them, each a
        str, a list of token ids, {"prompt": str} or {"prompt_token_ids": [...]} (vLLM's forms,
        entrypoints/prompt_inputs.py; a dict may carry a "cache_salt")."""
        prompts = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
        else:
            raise TypeError("sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        for p in params:  # an invalid schema, regex or grammar fails here, before anything runs
            if p.structured_outputs is not None:
                p.structured_outputs.check()
        return self._run(prompts, params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts, content a str or a list of
        text parts) or a list of them."""
        conversations = parse_conversations(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        tokenizer = self.engine.tokenizer
        conversation = parse_conversations(conversation, "conversation")[0]
        text = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt)
        # The template already spells out the special tokens.
        return tokenizer.encode(text, add_special_tokens=False)

    def _run(self, prompts: list[PromptInput], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = str(next(self._ids))
                prompt, salt = (prompt.prompt, prompt.cache_salt) if isinstance(prompt, SaltedPrompt) else (prompt, None)
                engine.add_request(request_id, prompt, p, OutputKind.FINAL_ONLY, cache_salt=salt)
                ids.append(request_id)
            results: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            bar.update(1)
                    if engine.last_num_scheduled_tokens == 0:
                        # Only KV loads or sends are in flight: let their threads have the GIL.
                        time.sleep(0.001)
        except BaseException:
            engine.abort_request(ids)
            raise
        return [results[i] for i in ids]
