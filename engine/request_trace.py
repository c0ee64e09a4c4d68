"""What a traced request went through inside the engine core, as timestamps and counts: the
front end builds OpenTelemetry spans from them (entrypoints/tracing.py), so the core needs no
OpenTelemetry. Only requests the front end marks as traced (a sampled span) carry one; for the
others nothing here is ever made, so tracing off costs nothing.

Times are ``time.monotonic()`` of the core's host (CLOCK_MONOTONIC: the same clock in the API
server's process, which converts them to wall-clock nanoseconds once)."""
from __future__ import annotations

import msgspec


class TierLoadTrace(msgspec.Struct, omit_defaults=True):
    """The chunks one KV store tier supplied to one load."""
    chunks: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0


class KVLoadTrace(msgspec.Struct, omit_defaults=True):
    """One load of KV from outside into a sequence's blocks, as the connector's worker half saw it:
    a P2P pull (``source`` "p2p", from ``peer``) or a load from the KV store tiers (``source``
    "tiers", per tier in ``tiers``). ``outcome`` is "ok" or the failure's reason (timeout, auth,
    miss, ...); ``attempts`` counts the handshakes a pull needed (a restarted producer takes two)."""
    source: str
    start: float
    end: float
    tokens: int = 0
    bytes: int = 0
    peer: str | None = None
    attempts: int = 1
    outcome: str = "ok"
    error: str | None = None
    tiers: dict[str, TierLoadTrace] = {}


class SequenceTrace(msgspec.Struct, omit_defaults=True):
    """One sequence's way through the scheduler. Sent (a copy) with the output that carries its
    first token sampled here and with its last output."""
    arrival: float
    admitted: float | None = None  # first given blocks (its queue time ends here)
    scheduled: float | None = None  # first ran in a model step
    first_token: float | None = None  # its first token sampled here (a decode's: the one after P's)
    finished: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # found in the device prefix cache (the pool) at admission
    external_tokens: int = 0  # supplied from outside (a P2P pull or the store tiers) at admission
    prefill_chunks: int = 0  # model steps that computed prompt tokens
    prefill_tokens: int = 0  # prompt tokens computed here
    decode_tokens: int = 0  # output tokens, the first included (a decode's: P's too)
    preemptions: int = 0
    loads: list[KVLoadTrace] = []
    finish_reason: str | None = None


def snapshot(trace: SequenceTrace, num_output_tokens: int, num_preemptions: int) -> SequenceTrace:
    """A copy to send: the core goes on editing the original."""
    return msgspec.structs.replace(trace, decode_tokens=num_output_tokens, preemptions=num_preemptions,
                                   loads=list(trace.loads))
