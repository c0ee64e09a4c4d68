"""`kv_transfer_params`: the one typed structure a client, proxy or peer can send about KV.

It is parsed (``parse_kv_transfer_params``) at the edge — the API server, the offline API —
so a wrong type, a missing field or an unknown key is a 400 naming the field, and nothing
inside the engine core ever reads a client's raw dict.

Parameters that make an instance act on someone else's KV (``do_remote_prefill``: connect to
an address and pull; ``kv_store_tokens``: wait for store entries) are signed by the instance
that produced them with the deployment secret (HMAC-SHA256 over every field and an expiry).
With a secret configured, an instance acts only on parameters that carry a valid, unexpired
signature: it never connects to an address a client made up.
"""
from __future__ import annotations

import hashlib
import re
import time
from array import array
from typing import Annotated

import msgspec

from engine.kv_transfer.secret import KVSecret

NonNegative = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
ShortStr = Annotated[str, msgspec.Meta(max_length=256)]
MAX_SEQUENCES = 1024  # first tokens: one per sequence (n), far above any --max-num-seqs
MAX_LOGPROB_ENTRIES = 21  # the sampled token and up to 20 top logprobs
MAX_BLOCK_IDS = 65536  # remote_block_ids: a 1M-token prompt in 16-token blocks
VLLM_NAMES = ("remote_host", "remote_port", "remote_block_ids")
_FAULT = re.compile(r"drop|truncate|duplicate|reorder|corrupt|bad_dtype|bad_shape|delay=(60(\.0+)?|[1-5]?\d(\.\d+)?)")
_KV_ADDR = re.compile(r"^tcp://([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})$")


class KVTransferParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What one (sub-)request asks of the KV plane, or what a prefill instance hands back.

    - ``do_remote_decode`` (client -> prefill): keep the prompt's KV for a decode instance.
    - ``do_remote_prefill`` (prefill -> decode): pull ``num_tokens`` tokens of KV from
      ``remote_kv_addr`` under ``remote_request_id``; ``token_digest`` names the tokens that
      KV belongs to, and the producer refuses a pull whose tokens differ.
    - ``kv_store_tokens`` (store-mode disaggregation): that many prompt tokens are in the
      shared KV store.
    - ``first_token_ids`` (prefill -> decode): the first token of each of the request's ``n``
      sequences, sampled on the prefill instance with the request's own parameters, and with
      ``first_logprobs`` their logprob entries ((token, logprob, rank), sampled first). The
      decode instance continues from the prompt plus that token, as a colocated engine would,
      but only for the prompt they were sampled for (``first_tokens_digest``, of the whole prompt).
    - ``max_local_prefill_tokens`` (proxy -> decode, conditional disaggregation): prefill here
      only when at most this many prompt tokens are missing from this instance's prefix cache;
      otherwise refuse with 409 ``prefill_remotely`` before queueing anything (the proxy then
      sends the request through a prefill instance). It only ever makes an instance do less, so
      it needs no signature.
    """
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: ShortStr | None = None
    remote_kv_addr: ShortStr | None = None
    remote_host_id: ShortStr | None = None
    remote_request_id: ShortStr | None = None
    num_tokens: NonNegative = 0
    token_digest: ShortStr | None = None
    kv_store_tokens: NonNegative = 0
    first_token_ids: Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_SEQUENCES)] | None = None
    first_logprobs: Annotated[list[Annotated[list[tuple[NonNegative, float, NonNegative]],
                                             msgspec.Meta(max_length=2 * MAX_LOGPROB_ENTRIES)]],
                              msgspec.Meta(max_length=MAX_SEQUENCES)] | None = None
    first_tokens_digest: ShortStr | None = None
    max_local_prefill_tokens: NonNegative | None = None
    inject_fault: ShortStr | None = None  # test hook, honoured only with ENGINE_ALLOW_KV_FAULTS=1
    expires_at: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 0  # unix seconds; part of what is signed
    signature: ShortStr | None = None  # hex HMAC-SHA256 (key "params") of the other fields
    # vLLM's names for the same hand-off, so its routers (which send them as nulls to a prefill
    # instance and pass its answer on to a decode instance) read a familiar shape. A prefill
    # instance fills them beside its own fields (remote_kv_addr's host and port, the blocks that
    # hold the prompt) only when asked in that shape (``vllm_names``, set by parsing a request
    # that names any of them): an instance of the previous release refuses fields it does not
    # know. A decode instance here acts on remote_kv_addr. Last, so that signatures over the
    # fields before them keep their form.
    remote_host: ShortStr | None = None
    remote_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    remote_block_ids: Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_BLOCK_IDS)] | None = None
    vllm_names: bool = False

    @property
    def acts_on_remote_kv(self) -> bool:
        """Whether these parameters make the receiver act on KV, or tokens, it did not compute:
        with a deployment secret, only when signed by one of its prefill instances."""
        return self.do_remote_prefill or self.kv_store_tokens > 0 or self.first_token_ids is not None

    def __post_init__(self) -> None:
        if self.inject_fault is not None and not _FAULT.fullmatch(self.inject_fault):
            raise ValueError("kv_transfer_params.inject_fault must be one of drop, truncate, duplicate, reorder, "
                             "corrupt, bad_dtype, bad_shape or delay=SECONDS (0-60)")
        if self.first_logprobs is not None and len(self.first_logprobs) != len(self.first_token_ids or ()):
            raise ValueError("kv_transfer_params.first_logprobs must have one entry per first token")
        if not self.do_remote_prefill:
            return
        for name in ("remote_kv_addr", "remote_request_id", "token_digest"):
            if not getattr(self, name):
                raise ValueError(f"kv_transfer_params.{name} is required with do_remote_prefill")
        if self.num_tokens < 1:
            raise ValueError("kv_transfer_params.num_tokens must be >= 1 with do_remote_prefill")
        match = _KV_ADDR.match(self.remote_kv_addr)
        if match is None or not 0 < int(match.group(2)) < 65536:
            raise ValueError(f"kv_transfer_params.remote_kv_addr must look like tcp://HOST:PORT, "
                             f"got {self.remote_kv_addr!r}")


class KVTransferParamsError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse_kv_transfer_params(value: object) -> KVTransferParams | None:
    """A client's value (dict, struct or None) as a validated struct; raises
    KVTransferParamsError naming the field."""
    if value is None or isinstance(value, KVTransferParams):
        return value
    if not isinstance(value, dict):
        raise KVTransferParamsError(f"kv_transfer_params must be an object, got {type(value).__name__}",
                                    "kv_transfer_params")
    try:
        params = msgspec.convert(value, KVTransferParams)
    except msgspec.ValidationError as exc:
        message = str(exc)
        field = re.search(r"at `\$\.(\w+)", message) or re.search(r"unknown field `(\w+)`", message)
        param = f"kv_transfer_params.{field.group(1)}" if field else "kv_transfer_params"
        if message.startswith("kv_transfer_params."):
            param = message.split(" ", 1)[0]
        raise KVTransferParamsError(message if message.startswith("kv_transfer_params") else
                                    f"{param}: {message}", param) from None
    if params.do_remote_decode and not params.vllm_names and any(name in value for name in VLLM_NAMES):
        # A prefill request in vLLM's shape: answered in vLLM's words too. (Only there: a
        # hand-off's fields are signed as they came.)
        params = msgspec.structs.replace(params, vllm_names=True)
    return params


# Slack on the expiry for clocks that differ between hosts.
CLOCK_SKEW_S = 60


def sign_kv_transfer_params(params: KVTransferParams, secret: KVSecret | None, ttl_s: float) -> KVTransferParams:
    """``params`` with an expiry and, with a secret, its signature."""
    return sign_until(params, secret, int(time.time() + ttl_s + CLOCK_SKEW_S))


# Signatures cover one of two forms. Both leave out the fields at their defaults, so a field a
# newer release adds (at its default) changes neither. This release signs the form the
# previous one verifies (the struct's JSON in field order) and verifies both; the next release
# signs the canonical form (keys sorted, versioned), which no longer depends on field order.
# Two phases, so that instances of adjacent releases verify each other's hand-offs.


def signed_bytes(params: msgspec.Struct) -> bytes:
    """The canonical form: the fields that differ from their defaults (the signature left out),
    keys sorted, behind a version tag."""
    fields = msgspec.to_builtins(params)
    fields.pop("signature", None)
    return b"kv-params-v2\0" + msgspec.json.encode(fields, order="sorted")


def legacy_signed_bytes(params: msgspec.Struct) -> bytes:
    """The form this and the previous release sign: the struct's JSON in field order."""
    return msgspec.json.encode(msgspec.structs.replace(params, signature=None))


def sign_until(params: KVTransferParams, secret: KVSecret | None, expires_at: int) -> KVTransferParams:
    """``params`` expiring at ``expires_at`` and, with a secret, signed."""
    unsigned = msgspec.structs.replace(params, expires_at=expires_at, signature=None)
    if secret is None:
        return unsigned
    return msgspec.structs.replace(unsigned, signature=secret.mac("params", legacy_signed_bytes(unsigned)).hex())


def check_kv_transfer_params_signature(params: KVTransferParams | None, secret: KVSecret | None) -> None:
    """Raises KVTransferParamsError unless ``params`` may be acted on: nothing to act on, no
    secret configured (a loopback-only deployment), or a valid signature that has not expired."""
    if params is None or secret is None or not params.acts_on_remote_kv:
        return
    field = "kv_transfer_params.signature"
    if not params.signature:
        raise KVTransferParamsError(f"{field} is missing: this instance acts only on kv_transfer_params signed "
                                    "by a prefill instance of its deployment", field)
    try:
        tag = bytes.fromhex(params.signature)
    except ValueError:
        tag = b""
    if not (secret.verify("params", tag, signed_bytes(params)) or
            secret.verify("params", tag, legacy_signed_bytes(params))):
        raise KVTransferParamsError(f"{field} does not verify: these kv_transfer_params were not issued by this "
                                    "deployment, or were changed", field)
    if params.expires_at < time.time():
        raise KVTransferParamsError("kv_transfer_params.expires_at has passed: the KV they name is gone",
                                    "kv_transfer_params.expires_at")


def token_digest(token_ids: list[int]) -> str:
    """Names a token sequence: the producer compares it before any KV leaves, so KV is only
    ever handed to a request with the very tokens it was computed for."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()
