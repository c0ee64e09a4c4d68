"""The first-token protocol of disaggregated prefill, in one place.

1. The prefill instance (P) is asked for ``do_remote_decode``. Its engine core samples the first
   token of each of the request's ``n`` sequences with the client's own parameters (the request
   "hands off": ``Request.hands_off``), offers the prompt's KV under a lease, and signs
   ``kv_transfer_params`` carrying those tokens, their logprob entries and a digest of the prompt
   (``hand_off_params``).
2. P's front end detokenizes the first tokens. If every sequence ended with its first token
   (max_tokens, EOS, or a stop string), the answer is final. The prompt's KV stays on offer
   under its lease all the same, as vLLM's prefill keeps it: vLLM's routers ask P for one token
   and send D the client's own request. Those parameters carry no first tokens
   (``without_first_tokens``: they were sampled with the router's parameters, not the client's),
   so D samples its own. Our proxy answers from P's final answer and releases the offer.
3. The proxy shows the first tokens to a streaming client at once and sends the decode
   instance (D) the original request with P's parameters, saying whether the client was shown
   them (the ``FIRST_TOKENS_SHOWN`` header).
4. D's engine core starts each sequence from its first token, exactly as if it had sampled it
   (``first_tokens_for`` checks them against the prompt), loads the prompt's KV and continues;
   D's front end shows the first tokens again only when the client has not seen them.
"""
from __future__ import annotations

import msgspec

from engine.errors import InvalidRequestError
from engine.kv_transfer.params import KVTransferParams, sign_kv_transfer_params, sign_until, token_digest
from engine.kv_transfer.secret import KVSecret
from engine.sampling_params import SamplingParams

# Request header from the proxy to D: "1" when a streaming client was already shown P's first tokens.
FIRST_TOKENS_SHOWN = "X-Engine-First-Tokens-Shown"

# (token, logprob, rank) entries of one sampled token: the sampled token first, then the top-k.
Entries = list[tuple[int, float, int]]


def hand_off_params(offer: KVTransferParams | None, prompt_token_ids: list[int], first_token_ids: list[int],
                    first_logprobs: list[Entries | None], secret: KVSecret | None, ttl_s: float) -> KVTransferParams:
    """P: the signed parameters D continues from (``offer``: where the KV can be pulled, or None
    when this instance offers none)."""
    params = msgspec.structs.replace(
        offer or KVTransferParams(), first_token_ids=list(first_token_ids),
        first_tokens_digest=token_digest(prompt_token_ids),
        first_logprobs=list(first_logprobs) if all(e is not None for e in first_logprobs) else None)
    return sign_kv_transfer_params(params, secret, ttl_s)


def without_first_tokens(params: KVTransferParams, secret: KVSecret | None) -> KVTransferParams:
    """P's front end found the answer final (stop strings): the offer alone, with the same
    expiry, signed again."""
    offer = msgspec.structs.replace(params, first_token_ids=None, first_logprobs=None, first_tokens_digest=None)
    return sign_until(offer, secret, params.expires_at)


def first_tokens_for(params: KVTransferParams | None, sampling: SamplingParams, prompt_token_ids: list[int],
                     vocab_size: int) -> list[tuple[int, Entries | None]] | None:
    """D: (token, logprob entries) per sequence, when P sampled the first tokens for this very
    prompt (parameters replayed with another prompt bring none: D samples its own). Raises
    InvalidRequestError for parameters that cannot be right."""
    if params is None or params.first_token_ids is None:
        return None
    ids, entries = params.first_token_ids, params.first_logprobs
    field = "kv_transfer_params.first_token_ids"
    if len(ids) != sampling.n:
        raise InvalidRequestError(f"{field} has {len(ids)} tokens for n={sampling.n} sequences", field)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} in {field} is out of vocabulary (size {vocab_size})", field)
    if entries is not None and any(not e or e[0][0] != t or any(i >= vocab_size for i, _, _ in e)
                                   for t, e in zip(ids, entries)):
        raise InvalidRequestError("kv_transfer_params.first_logprobs must hold, per first token, that token's "
                                  "entry first and in-vocabulary tokens only", "kv_transfer_params.first_logprobs")
    if sampling.logprobs is None:
        entries = None
    elif entries is None:
        raise InvalidRequestError("this request asks for logprobs but kv_transfer_params.first_logprobs is "
                                  "missing", "kv_transfer_params.first_logprobs")
    if params.first_tokens_digest != token_digest(prompt_token_ids):
        return None
    return [(t, entries[i] if entries is not None else None) for i, t in enumerate(ids)]
