"""Structured output in the engine core: grammars compiled off the step loop, one matcher per
sequence, and the step's token bitmask.

Flow: ``LLMEngine.add_request`` gets a ``RequestGrammar`` per sequence from the
``GrammarCompiler`` (compiling on its own thread, cached by grammar). The scheduler leaves a
request waiting until its grammar is compiled, and for every request that samples in a step
fills one row of the step's bitmask (``fill_bitmask``); the sampler masks those rows' logits
in one go. Each token appended to the request advances its matcher, so preemption and
recompute keep the grammar state, and a decode instance replays the prefill's first token.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import numpy as np
import torch

from engine.structured_output import StructuredOutputsParams

logger = logging.getLogger("engine.grammar")

# Compiled grammars kept (each key is at most structured_output.MAX_SPEC_CHARS long).
MAX_CACHED_GRAMMARS = 128


class GrammarCompiler:
    """Compiles each distinct grammar once, on a thread of its own (llguidance drops the GIL
    while it compiles), and keeps the most recent ones."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        # (an EOS id outside the model's logits could never be sampled, nor fit a bitmask row)
        self.eos_token_ids = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)
        self._hf_tokenizer = hf_tokenizer
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.5 s)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self.num_compiled = 0

    def request_grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A sequence's own grammar state; its compile may still be running. Nothing here
        translates or compiles: that is the compile thread's, off the step loop."""
        key = params.cache_key
        future = self._cache.pop(key, None)
        if future is None:
            future = self._executor.submit(self._compile, params)
        self._cache[key] = future  # most recent last
        while len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return RequestGrammar(future, self)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self.eos_token_ids)
        matcher = llguidance.LLMatcher(self._ll_tokenizer, params.grammar_spec(), log_level=0)
        self.num_compiled += 1
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One sequence's matcher. Tokens accepted before the compile finished (the first token a
    prefill instance sampled) are replayed into it when it is first used."""

    def __init__(self, compiled: Future, compiler: GrammarCompiler) -> None:
        self._compiled = compiled
        self._compiler = compiler
        self._pending: list[int] = []
        self._matcher: llguidance.LLMatcher | None = None

    def ready(self) -> bool:
        return self._matcher is not None or self._compiled.done()

    @property
    def terminated(self) -> bool:
        """The grammar is complete (or broken): only EOS may follow."""
        return self._matcher is not None and (self._matcher.is_stopped() or self._matcher.is_error())

    @property
    def error(self) -> str | None:
        """Why the grammar cannot be used (only once ready)."""
        if self._matcher is not None or not self._compiled.done():
            return None
        exc = self._compiled.exception()
        return None if exc is None else f"structured output grammar failed to compile: {exc}"

    def _get_matcher(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            self._matcher = self._compiled.result().deep_copy()
            for token in self._pending:
                self._consume(token)
            self._pending.clear()
        return self._matcher

    def accept(self, token: int) -> None:
        if self._matcher is None and not self._compiled.done():
            self._pending.append(token)
        elif self.error is None:
            self._get_matcher()
            self._consume(token)

    def _consume(self, token: int) -> None:
        matcher = self._matcher
        # After the grammar ended (EOS with ignore_eos, or a stop before min_tokens) nothing
        # more is parsed; an illegal token (never sampled under the mask) leaves it in error.
        # llguidance reports grammar and token errors as a state, never by raising.
        if not matcher.is_stopped() and not matcher.consume_token(token):
            logger.warning("a sampled token broke its grammar: %s", matcher.get_error())

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into ``row`` (int32 words, bit i = token i). A finished
        or broken grammar allows only EOS, so the sequence ends."""
        matcher = self._get_matcher()
        if not (matcher.is_stopped() or matcher.is_error()):
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            return
        words = row.view(np.uint32)
        words[:] = 0
        for eos in self._compiler.eos_token_ids:
            words[eos // 32] |= np.uint32(1 << (eos % 32))


_NEG_INF_BITS = np.array(-np.inf, dtype=np.float32).view(np.uint32)
_SIGN_BIT = np.uint32(1 << 31)


def bitmask_to_bound(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[rows, words] int32 bitmask -> [rows, vocab] float32 upper bound for the logits: +inf
    where allowed, -inf elsewhere (min(x, +inf) == x exactly, +inf logits included). Built by
    integer arithmetic on the bit patterns: a select over the vocabulary costs far more."""
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return (_NEG_INF_BITS - allowed.astype(np.uint32) * _SIGN_BIT).view(np.float32)


def bitmask_to_bound_on_device(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask_to_bound on the bitmask's device (a GPU): the packed [rows, words] int32 mask
    crosses to the device (4 bytes per 32 tokens, not 4 per token) and is unpacked there."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    return torch.where(allowed, float("inf"), float("-inf"))


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def build_bitmask(grammars: list[RequestGrammar], vocab_size: int) -> np.ndarray:
    """[len(grammars), words] int32: each row the next tokens its grammar allows."""
    bitmask = np.empty((len(grammars), bitmask_words(vocab_size)), dtype=np.int32)
    for i, grammar in enumerate(grammars):
        grammar.fill_bitmask(bitmask[i])
    return bitmask
