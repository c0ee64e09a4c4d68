"""Messages between the API server process and the engine-core process (msgpack over zmq).

Typed msgspec structs, decoded against these exact types: nothing from a socket is ever
unpickled or turned into arbitrary objects.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import stat
import tempfile
import time

import msgspec

from engine.kv_transfer.params import KVTransferParams
from engine.outputs import EngineCoreOutput
from engine.sampling_params import SamplingParams

# The server binds its two sockets inside a private directory named with this prefix.
IPC_DIR_PREFIX = "engine-ipc-"


def remove_ipc_dir(address: str) -> None:
    """Removes the private directory of an ``ipc://DIR/name`` address this engine made."""
    directory = os.path.dirname(address.removeprefix("ipc://"))
    if os.path.basename(directory).startswith(IPC_DIR_PREFIX):
        shutil.rmtree(directory, ignore_errors=True)


def is_stale_socket(path: str, min_age_s: float = 60.0) -> bool:
    """A unix socket file of ours that nobody listens on any more (its process was killed).
    Only our own sockets count (in a shared /tmp another user's files are never touched), and
    young ones are left alone: a server may be between creating its socket and listening."""
    try:
        info = os.lstat(path)
        if (not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid()
                or time.time() - info.st_mtime < min_age_s):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.5)  # a listener that never accepts must not hold up a start
            probe.connect(path)
        return False
    except ConnectionRefusedError:
        return True
    except OSError:  # gone, timed out, not ours to reach
        return False


def remove_stale_ipc_dirs() -> None:
    """Directories left by servers killed with their engine core (a crash cleans nothing up):
    only our own private (0700) directories, never a link, with a socket nobody listens on."""
    for directory in glob.glob(os.path.join(tempfile.gettempdir(), IPC_DIR_PREFIX + "*")):
        try:
            info = os.lstat(directory)
        except OSError:
            continue
        if (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
                and is_stale_socket(os.path.join(directory, "in"))):
            shutil.rmtree(directory, ignore_errors=True)


def remove_stale_socket(path: str) -> None:
    if is_stale_socket(path):
        with contextlib.suppress(OSError):
            os.unlink(path)


# ---- server -> core -------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    kv_transfer_params: KVTransferParams | None = None
    cache_salt: str | None = None
    traced: bool = False  # the front end traces it: its outputs carry engine/request_trace.py's record


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]  # requests, or single sequences of one


class StopSequences(msgspec.Struct, tag="stop"):
    """The front end found stop strings: these sequences end (engine/output_processor.py)."""
    sequence_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class ReleaseOffer(msgspec.Struct, tag="release"):
    """A router will not use a hand-off it was given (its client left, or no decode instance
    took it): the KV these signed parameters offer is freed now, not when the lease ends."""
    kv_transfer_params: KVTransferParams


ToCore = AddRequest | AbortRequests | StopSequences | ReleaseOffer | Shutdown


# ---- core -> server -------------------------------------------------------------------
class EngineInfo(msgspec.Struct, tag="ready"):
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    fingerprint: str
    max_num_seqs: int = 256
    # The core's first stats, so the server's /status shows every configured KV store tier from
    # its first answer (before, it showed none until the core's first stats message arrived).
    stats: EngineStats | None = None
    # Where the KV events are published, as bound (ports chosen at bind: --kv-events).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None


class Ack(msgspec.Struct, tag="ack"):
    """Answer to AddRequest: accepted (status 200) or refused with an HTTP status."""
    request_id: str
    status: int = 200
    message: str | None = None
    param: str | None = None


class TierStats(msgspec.Struct):
    hits: int = 0  # chunks loaded from this tier
    misses: int = 0  # chunks looked up here and not found
    bytes_stored: int = 0
    bytes_loaded: int = 0
    used_bytes: int = 0
    load_seconds: list[float] = []  # since the previous stats message
    rejected: dict[str, int] = {}  # entries refused on read and deleted, by reason (bad_tag, corrupt, wrong_format)


class PeerPulls(msgspec.Struct):
    """KV pulled from one producer since start (whole blocks: tokens rounded up to them),
    pulls that timed out included (``timeouts`` of them), each with the time it took."""
    pulls: int = 0
    timeouts: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0


class EngineStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    kv_blocks_held: int = 0
    num_waiting_for_remote_kv: int = 0  # of num_waiting: parked until their KV arrives
    num_held: int = 0  # finished requests whose blocks a KV transfer still reads
    num_tracked_requests: int = 0  # per-request state anywhere in the engine (0 when idle)
    kv_transfer_bytes: int = 0
    kv_transfer_failures: dict[str, int] = {}
    kv_auth_failures: dict[str, int] = {}  # messages the KV server refused from unauthenticated peers
    # Durations of transfers that completed since the previous stats message.
    kv_transfer_seconds: list[float] = []
    kv_store: dict[str, TierStats] = {}  # per KV store tier ("cpu", "disk", "redis")
    kv_pulls: dict[str, PeerPulls] = {}  # per producer's KV address
    # The load-or-recompute decision (engine/kv_transfer/load_cost.py LoadPlanner.snapshot): its
    # totals, each source's rate and the prefill fit; empty without KV store tiers.
    kv_load_decision: dict = {}


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]  # token ids per sequence: the front end makes the text
    stats: EngineStats
    # The core's time.monotonic() when the step made these outputs (vLLM's EngineCoreOutputs
    # timestamp): the front end's inter-token, prefill and decode times are measured on it.
    # (CLOCK_MONOTONIC is one clock for every process of the host.)
    timestamp: float = 0.0


class EngineDead(msgspec.Struct, tag="dead"):
    error: str


FromCore = EngineInfo | Ack | Outputs | EngineDead
