"""One scheme for the ids a request fans out into, used by every side (API server, engine core,
front end, tests): a request of several prompts becomes one engine request per prompt, and an
engine request with ``n`` sequences becomes ``n`` scheduler requests (vLLM's names for both).
With one prompt, or n == 1, the id is the request's own."""
from __future__ import annotations


def prompt_request_id(request_id: str, index: int, num_prompts: int) -> str:
    """The engine request of prompt ``index`` of a request with ``num_prompts`` prompts."""
    return request_id if num_prompts == 1 else f"{request_id}-{index}"


def sequence_id(request_id: str, index: int, n: int) -> str:
    """The scheduler request of sequence ``index`` of an engine request with ``n`` sequences."""
    return request_id if n == 1 else f"{index}_{request_id}"
