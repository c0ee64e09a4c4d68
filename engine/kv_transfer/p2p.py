"""Disaggregated prefill over pyzmq: the scheduler half.

A prefill instance (producer) finishes a request that asked for ``do_remote_decode``, keeps
its blocks (an ``insert`` into the lookup buffer, under a lease) and hands back
``kv_transfer_params`` naming where the KV can be pulled. A decode instance (consumer) gets
the same request with those params: the scheduler matches its own prefix cache first, then
asks here how many more tokens the peer has, allocates blocks for them and parks the request
in WAITING_FOR_REMOTE_KV while the worker half ``drop_select``s the KV straight into those
blocks. The producer frees its copy only once the transfer is done or its lease expired.

The producer samples the request's first token itself (``Request.hands_off``): its KV goes on
offer in the very step that computes the prompt's last token (the send is in that step's
metadata, announced to the worker half before the forward pass and registered right after the
step's output, which carries the parameters, went out; a pull that comes between waits for it),
and the request ends handed off. If the first token ends the answer (max_tokens, EOS, a stop string),
the offer stays under its lease all the same, for a router that sends the consumer the client's
own request next (vLLM's routers ask the producer for one token); those parameters carry no
first token. The consumer starts from the prompt plus the first token when it has one, so it
loads the whole prompt's KV and recomputes nothing; without one it recomputes the last prompt
token.
"""
from __future__ import annotations

import glob
import logging
import os
import socket
import time
from dataclasses import dataclass, field

import msgspec

from engine.config import KVTransferConfig
from engine.ipc import remove_stale_socket
from engine.kv_transfer.base import KVConnectorScheduler
from engine.kv_transfer.params import CLOCK_SKEW_S, MAX_BLOCK_IDS, KVTransferParams, token_digest
from engine.outputs import SchedulerOutput
from engine.request import Request, RequestStatus

logger = logging.getLogger("engine.kv_transfer")


def host_id() -> str:
    """Identifies this machine, so peers on it can use the ipc fast path."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def ipc_path(port: int) -> str:
    return f"ipc:///tmp/engine-kv-{port}.sock"


def remove_stale_kv_sockets() -> None:
    """Socket files of our KV servers that were killed (libzmq never removes an ipc file itself)."""
    for path in glob.glob("/tmp/engine-kv-*.sock"):
        remove_stale_socket(path)

DEFAULT_LEASE_S = 30.0
# A consumer renews the lease of KV it will pull for a request still queued there every third
# of the lease time its parameters had left when it queued (their expiry is the producer's wall
# clock plus CLOCK_SKEW_S: clocks that disagree by more than a lease make that guess wrong, so it
# is kept between MIN_RENEW_EVERY_S and RENEW_EVERY_S); a producer holds an offer at most
# MAX_LEASES_HELD leases from its start however often it is renewed (a decode that never gets
# to it cannot pin it).
RENEW_EVERY_S = 5.0
MIN_RENEW_EVERY_S = 0.25
MAX_LEASES_HELD = 10
DEFAULT_LOAD_TIMEOUT_S = 30.0


@dataclass(slots=True)
class SendSpec:
    """Producer side: KV of ``num_tokens`` tokens in ``block_ids`` may be pulled until the lease ends."""
    req_id: str
    block_ids: list[int]
    num_tokens: int
    lease_deadline: float  # time.monotonic() of the engine-core process
    token_digest: str  # of the tokens this KV was computed for: a pull must name the same ones
    # Test hook (only with ENGINE_ALLOW_KV_FAULTS=1): damage this transfer on purpose.
    fault: str | None = None
    # The lease's length: with it, the lease starts over when the offer is made (after the
    # forward pass, as the answer goes out) and each renewal restarts it, up to hold_until.
    lease_s: float = 0.0
    hold_until: float = 0.0


@dataclass(slots=True)
class LoadSpec:
    """Consumer side: pull remote blocks [start_block, start_block + len(block_ids)) of
    ``remote_request_id`` into local ``block_ids`` before ``deadline``."""
    req_id: str
    remote_addr: str
    remote_request_id: str
    start_block: int
    block_ids: list[int]
    deadline: float
    token_digest: str  # of our own first num_tokens prompt tokens; the producer compares
    peer: str = ""  # the producer's advertised KV address (remote_addr may be its same-host ipc path)


@dataclass(slots=True)
class ReleaseSpec:
    """Consumer side: KV the peer holds for us that we will never pull."""
    remote_addr: str
    remote_request_id: str
    token_digest: str


@dataclass(slots=True)
class RenewSpec:
    """Consumer side: KV the peer holds for a request still queued here; its lease restarts."""
    remote_addr: str
    remote_request_id: str
    token_digest: str


@dataclass(slots=True)
class P2PMetadata:
    sends: list[SendSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
    renewals: list[RenewSpec] = field(default_factory=list)
    withdrawals: list[str] = field(default_factory=list)  # offers (sends) nobody may pull any more


class P2PConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, engine_id: str, advertised_addr: str | None,
                 block_size: int) -> None:
        self.engine_id = engine_id
        self.advertised_addr = advertised_addr  # None on an instance that does not serve KV
        self.block_size = block_size
        self.load_failure_policy = config.kv_load_failure_policy
        self.lease_s = float(config.extra.get("lease_s", DEFAULT_LEASE_S))
        self.params_ttl_s = self.lease_s
        self.load_timeout_s = float(config.extra.get("load_timeout_s", DEFAULT_LOAD_TIMEOUT_S))
        self._meta = P2PMetadata()
        self._loading: set[str] = set()   # consumer requests whose load is in flight
        self._consumed: set[str] = set()  # remote KV already used or given up on: never pulled twice
        # Queued consumer requests whose peer holds their KV: (renewal, every, next due), until
        # admitted or ended.
        self._queued: dict[str, tuple[RenewSpec, float, float]] = {}
        self._producing: dict[str, Request] = {}  # producer requests whose KV is not on offer yet
        # Producer requests whose KV is on offer (or being withdrawn) -> the digest of its tokens.
        self._offered: dict[str, str] = {}

    # ---- consumer ------------------------------------------------------------------------
    def _remote(self, request: Request) -> KVTransferParams | None:
        """The request's pull parameters, unless they were used (or given up on) already."""
        params = request.kv_transfer_params
        if params is None or not params.do_remote_prefill or request.request_id in self._consumed:
            return None
        return params

    def request_queued(self, request: Request) -> None:
        params = self._remote(request)
        if params is not None:
            # However long it queues here, the peer keeps its KV (up to MAX_LEASES_HELD leases):
            # this instance's queueing never turns into a recompute.
            release = self._release(request, params)
            # The parameters expire with the producer's lease, plus the clock skew they allow.
            lease_left = (params.expires_at - CLOCK_SKEW_S - time.time() if params.expires_at
                          else 3 * RENEW_EVERY_S)
            every = min(max(lease_left / 3, MIN_RENEW_EVERY_S), RENEW_EVERY_S)
            self._queued[request.request_id] = (
                RenewSpec(release.remote_addr, release.remote_request_id, release.token_digest), every,
                time.monotonic() + every)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._remote(request)
        if params is None:
            return 0, False
        # At least the last known token is computed here (its logits are needed): with the first
        # token from the producer, that is the first token, and the whole prompt is loaded.
        usable = min(params.num_tokens, request.num_tokens - 1)
        external = usable - num_computed_tokens
        return (external, True) if external > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        if self._offers(request):
            self._producing[request.request_id] = request
        params = self._remote(request)
        if params is None:
            return
        self._queued.pop(request.request_id, None)
        self._consumed.add(request.request_id)
        if num_external_tokens == 0:
            # The local prefix cache already had everything: let the peer free its copy now.
            self._meta.releases.append(self._release(request, params))
            return
        # Local prefix hits are whole blocks, so the external range starts on a block boundary.
        start = num_local_tokens // self.block_size
        end = -(-(num_local_tokens + num_external_tokens) // self.block_size)
        self._meta.loads.append(LoadSpec(
            request.request_id, self._peer_addr(params), params.remote_request_id, start,
            block_ids[start:end], time.monotonic() + self.load_timeout_s,
            token_digest(request.prompt_token_ids[:params.num_tokens]), params.remote_kv_addr))
        self._loading.add(request.request_id)

    def release_peer(self, params: KVTransferParams) -> bool:
        if not (params.do_remote_prefill and params.remote_kv_addr and params.remote_request_id
                and params.token_digest):
            return False
        self._meta.releases.append(ReleaseSpec(self._peer_addr(params), params.remote_request_id,
                                               params.token_digest))
        return True

    def _release(self, request: Request, params: KVTransferParams) -> ReleaseSpec:
        return ReleaseSpec(self._peer_addr(params), params.remote_request_id,
                           token_digest(request.prompt_token_ids[:params.num_tokens]))

    @staticmethod
    def _peer_addr(params: KVTransferParams) -> str:
        addr = params.remote_kv_addr
        if params.remote_host_id == host_id():
            addr = ipc_path(int(addr.rsplit(":", 1)[1]))  # same machine: skip the TCP stack
        return addr

    # ---- producer ------------------------------------------------------------------------
    @property
    def offers_kv(self) -> bool:
        return self.advertised_addr is not None

    def _offers(self, request: Request) -> bool:
        params = request.kv_transfer_params
        return request.hands_off and params is not None and params.do_remote_decode and self.offers_kv

    def _offer(self, request: Request) -> None:
        """The step computes the prompt's last token: its KV goes on offer once its output is out."""
        num_tokens = request.num_prompt_tokens
        num_blocks = -(-num_tokens // self.block_size)
        params = request.kv_transfer_params
        fault = params.inject_fault if os.environ.get("ENGINE_ALLOW_KV_FAULTS") == "1" else None
        digest = self._offered[request.request_id] = token_digest(request.prompt_token_ids)
        self._meta.sends.append(SendSpec(request.request_id, self.block_ids_of(request.request_id)[:num_blocks],
                                         num_tokens, time.monotonic() + self.lease_s, digest, fault, self.lease_s))

    def withdraw(self, req_id: str) -> bool:
        if req_id not in self._offered:
            return False
        self._meta.withdrawals.append(req_id)
        return True

    # ---- both ------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2PMetadata:
        # Counters are advanced after this call: computed + scheduled is where the step ends.
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._producing.get(req_id)
            if request is not None and request.num_computed_tokens + n >= request.num_prompt_tokens:
                del self._producing[req_id]
                self._offer(request)
        now = time.monotonic()
        for req_id, (renewal, every, due) in self._queued.items():
            if now >= due:
                self._meta.renewals.append(renewal)
                self._queued[req_id] = (renewal, every, now + every)
        meta, self._meta = self._meta, P2PMetadata()
        return meta

    def has_pending_metadata(self) -> bool:
        meta = self._meta
        return bool(meta.sends or meta.loads or meta.cancels or meta.releases or meta.withdrawals)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        req_id = request.request_id
        remote = self._remote(request)
        if remote is not None:
            self._meta.releases.append(self._release(request, remote))
        self._consumed.discard(req_id)
        self._queued.pop(req_id, None)
        self._producing.pop(req_id, None)
        if req_id in self._loading:
            # Aborted while its KV is still arriving: keep the blocks until the worker confirms
            # the transfer is cancelled, so late bytes never land in reused blocks.
            self._meta.cancels.append(req_id)
            return True, None
        if req_id not in self._offered:
            return False, None
        # On offer: the blocks stay until the worker reports the offer done (pulled, expired or
        # withdrawn).
        if request.status not in (RequestStatus.FINISHED_HANDED_OFF, RequestStatus.FINISHED_LENGTH,
                                  RequestStatus.FINISHED_STOPPED):
            self.withdraw(req_id)  # aborted or failed: nobody will be told where the KV is
            return True, None
        params = KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id, remote_kv_addr=self.advertised_addr,
            remote_host_id=host_id(), remote_request_id=req_id, num_tokens=request.num_prompt_tokens,
            token_digest=self._offered[req_id])
        if request.kv_transfer_params.vllm_names:  # asked in vLLM's shape: answered in it too
            host, port = self.advertised_addr.removeprefix("tcp://").rsplit(":", 1)
            blocks = list(block_ids[:-(-request.num_prompt_tokens // self.block_size)])
            params = msgspec.structs.replace(  # (a block list past what a peer parses is left out)
                params, remote_host=host.strip("[]"), remote_port=int(port),
                remote_block_ids=blocks if len(blocks) <= MAX_BLOCK_IDS else None)
        return True, params

    def num_tracked_requests(self) -> int:
        return (len(self._loading) + len(self._consumed) + len(self._queued) + len(self._producing)
                + len(self._offered))

    def transfer_done(self, req_id: str, failed: bool = False) -> None:
        self._loading.discard(req_id)

    def send_done(self, req_id: str) -> None:
        self._offered.pop(req_id, None)
