"""KV events: an instance's prefix-cache changes, published for routers (vLLM 0.32's format).

Each engine step that changed the prefix cache publishes one ``KVEventBatch`` on a zmq PUB
socket as three frames: topic, sequence number (8 bytes big-endian, from 0, +1 per batch) and
the msgpack-encoded batch. ``BlockStored`` names blocks that entered the prefix cache (their
chained hashes, in order, the parent of the first, their tokens), ``BlockRemoved`` blocks that
left it (medium GPU; the CPU and disk tiers publish theirs too: kv_transfer/tier_events.py),
``AllBlocksCleared`` everything (always the first batch a publisher sends: a subscriber
seeing it drops what it knew of this instance, e.g. after a restart).

The encoding is vLLM 0.32's (``vllm.distributed.kv_events``, the version benchmarks/peer_venv.sh
installs): the batch is an array ``[ts, events, data_parallel_rank]`` and each event a map
tagged ``"type": "<class name>"`` whose fields with a default are left out while they hold it.
Pinned against bytes vLLM's own publisher produced (tests/fixtures/vllm_kv_events/) and checked
with vLLM's own decoder (tests/test_vllm_kv_events.py). ``decode_batch`` also reads the array
events of vLLM 0.20, which this engine published before (see there why). The hashes are those of
engine/block_pool.py (SHA-256 chains from a root derived from the model fingerprint, so anyone
with the tokens and the fingerprint computes the same ones), or with
``--prefix-caching-hash-algo`` vLLM's, as 64-bit integers (engine/vllm_block_hash.py).

A subscriber that sees a gap in the sequence asks the replay socket (ROUTER) for the batches
from a sequence number on: it sends the number (8 bytes big-endian; a DEALER sends an empty
delimiter frame first) and gets ``[seq, payload]`` messages for every batch still buffered
from there, then ``[-1 (8 bytes, signed), b""]``. The buffer keeps the last ``buffer_steps``
batches; a subscriber that fell further behind gets what is left, sees that the first replayed
number is past the one it asked for, and starts that instance's index over.

Both sockets bind loopback by default. Elsewhere they need the deployment secret (like the rest
of the KV plane): both are CURVE servers whose keypair derives from the secret, so a peer
without it cannot complete a handshake (block hashes say which prompts an instance has seen).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Union

import msgspec
import zmq
import zmq.utils.z85

logger = logging.getLogger("engine.kv_events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: maps tagged ``type`` = class name, as vLLM 0.32's."""


# Where the blocks an event names are. vLLM's names: GPU for an instance's own KV pool, whatever
# its device (a CPU engine's too), CPU for its CPU offload tier, STORAGE for the local-disk tier
# (vLLM 0.32's MEDIUM_STORAGE, what its offloading to disk publishes). The
# Redis tier publishes nothing: Redis evicts on its own and every instance on it can load its
# entries, so no instance can say what it holds there.
MEDIUM = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "STORAGE"

BlockHash = Union[bytes, int]  # the engine's 32-byte hashes, or vLLM's as 64-bit integers


# The fields, names and defaults of vLLM 0.32's, in its order (so the bytes are its bytes): the
# first seven are always sent, the rest only when set (never, here, but group_idx and extra_keys).
class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Per block, what vLLM's hash covers besides tokens: (cache_salt,) on a salted first block.
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None  # the KV cache group (always 0: one group)
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # LOCAL or REMOTE to the publisher (vLLM's offloading)
    ownership: str | None = None
    session_id: str | None = None


def event_extra_keys(first_block: int, num_blocks: int, cache_salt: str | None) -> list[tuple | None]:
    """vLLM's extra keys of blocks first_block.. of a request: (cache_salt,) on its first block."""
    return [(cache_salt,) if first_block + i == 0 and cache_salt else None for i in range(num_blocks)]


def stored_events(names: list, parent, token_ids: list[int], block_size: int, medium: str,
                  selected: list[int], extra_keys: list | None = None) -> list[BlockStored]:
    """BlockStored events for ``names[i]`` for i in ``selected`` (ascending): one per run of
    consecutive blocks, each naming the parent of its first (``parent`` before ``names[0]``).
    ``token_ids`` are the tokens of ``names``' blocks; ``extra_keys`` theirs (vLLM's hashes)."""
    runs: list[list[int]] = []
    for i in selected:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [BlockStored([names[i] for i in run], names[run[0] - 1] if run[0] else parent,
                        list(token_ids[run[0] * block_size:(run[-1] + 1) * block_size]), block_size, None,
                        medium, None, [extra_keys[i] for i in run] if extra_keys is not None else None, 0)
            for run in runs]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


# vLLM 0.20's events (this engine's format before): the same fields, as arrays.
class _LegacyEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _LegacyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[_LegacyBlockStored, _LegacyBlockRemoved, _LegacyAllBlocksCleared]]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_legacy_decoder = msgspec.msgpack.Decoder(_LegacyBatch)
_CURRENT = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def decode_batch(payload: bytes) -> KVEventBatch:
    """A published batch (vLLM 0.32's encoding), or msgspec.DecodeError (a ValidationError too).

    Also reads vLLM 0.20's array events, which instances of this engine sent before the switch to
    0.32's, into the same classes: a router is upgraded before the instances it follows
    (docs/routing.md), and one that could not read them would count every instance not yet
    upgraded as holding nothing for the whole rollout. A 0.32 decoder (vLLM's own, llm-d's)
    reads only the new encoding."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as error:
        try:
            legacy = _legacy_decoder.decode(payload)
        except msgspec.DecodeError:
            raise error from None
        events = [_CURRENT[type(e).__name__[len("_Legacy"):]](**msgspec.structs.asdict(e)) for e in legacy.events]
        return KVEventBatch(legacy.ts, events, legacy.data_parallel_rank)


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """``--kv-events-config`` (vLLM's keys)."""
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    topic: str = "kv-events"
    buffer_steps: int = 10_000

    def __post_init__(self) -> None:
        if self.publisher != "zmq":
            raise ValueError(f"kv_events_config.publisher: only zmq is supported, got {self.publisher!r}")
        if not 1 <= self.buffer_steps <= 1_000_000:
            raise ValueError("kv_events_config.buffer_steps must be between 1 and 1000000")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"kv_events_config.{name} must be tcp://HOST:PORT or ipc://PATH, got {value!r}")


def parse_kv_events_config(value) -> KVEventsConfig | None:
    """A config, dict or JSON string as a checked config (None when events are off);
    ValueError naming the field."""
    if value is None or isinstance(value, KVEventsConfig):
        config = value
    else:
        try:
            raw = msgspec.json.decode(value) if isinstance(value, (str, bytes)) else value
            config = msgspec.convert(raw, KVEventsConfig)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ValueError(f"kv-events-config: {exc}") from None
    return config if config is not None and config.enable_kv_cache_events else None


def endpoint_host(endpoint: str) -> str:
    """The host part of tcp://HOST:PORT ("" for ipc://, which never leaves this host)."""
    if not endpoint.startswith("tcp://"):
        return ""
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def event_keys(secret, role: str) -> tuple[bytes, bytes]:
    """The CURVE keypair of the event sockets' server or client, from the deployment secret."""
    secret_key = zmq.utils.z85.encode(secret.key(f"kv-events-curve-{role}"))
    return zmq.curve_public(secret_key), secret_key


class KVEventPublisher:
    """Publishes batches from the engine core on a thread of its own (which alone touches the
    sockets), so a slow subscriber or a replay never holds up a step."""

    def __init__(self, config: KVEventsConfig, secret=None) -> None:
        self.config, self.secret = config, secret
        # Where the sockets are bound (a port 0 in the config is chosen at bind): what /status shows.
        self.endpoint: str = config.endpoint
        self.replay_endpoint: str | None = config.replay_endpoint
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise ValueError("kv_events_config: the publisher did not start")
        if self._error is not None:
            raise ValueError(f"kv_events_config: cannot bind: {self._error}") from self._error
        self.publish([AllBlocksCleared()])

    def publish(self, events: list[KVCacheEvent]) -> None:
        if events:
            # data_parallel_rank as vLLM's publisher sets it (this engine is one rank).
            self._queue.put(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _socket(self, ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, ":" in endpoint_host(endpoint))
        if self.secret is not None:
            public, secret_key = event_keys(self.secret, "server")
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = public, secret_key
        sock.bind(endpoint)
        return sock

    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            pub = self._socket(ctx, zmq.PUB, self.config.endpoint)
            replay = (self._socket(ctx, zmq.ROUTER, self.config.replay_endpoint)
                      if self.config.replay_endpoint else None)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay is not None:
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay is not None:
                # A replay is the whole buffer at once: a ROUTER over its high-water mark drops
                # silently, so it has none (the buffer itself bounds what can queue).
                replay.setsockopt(zmq.SNDHWM, 0)
        except Exception as exc:  # a port in use, a bad address: the engine refuses to start
            self._error = exc
            self._ready.set()
            ctx.destroy(linger=0)
            return
        self._ready.set()
        topic = self.config.topic.encode()
        encoder = msgspec.msgpack.Encoder()
        buffer: deque[tuple[bytes, bytes]] = deque(maxlen=self.config.buffer_steps)
        poller = zmq.Poller()
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        seq = 0
        try:
            while True:
                # Replays are served between batches; an idle publisher waits on both.
                if replay is not None and poller.poll(0 if not self._queue.empty() else 20):
                    self._serve_replay(replay, buffer)
                while True:
                    try:
                        batch = self._queue.get(timeout=None if replay is None else 0)
                    except queue.Empty:
                        break
                    if batch is None:
                        return
                    seq_bytes, payload = seq.to_bytes(8, "big"), encoder.encode(batch)
                    pub.send_multipart([topic, seq_bytes, payload])
                    buffer.append((seq_bytes, payload))
                    seq += 1
        finally:
            ctx.destroy(linger=0)

    @staticmethod
    def _serve_replay(replay: zmq.Socket, buffer: deque) -> None:
        """Answers one request: 8 bytes, the first sequence number wanted, and optionally 8
        more, the first one not wanted (a subscriber filling a gap)."""
        frames = replay.recv_multipart()
        identity, request = frames[0], frames[-1]
        if len(request) not in (8, 16):  # not a request: ignore
            return
        first = int.from_bytes(request[:8], "big")
        until = int.from_bytes(request[8:], "big") if len(request) == 16 else None
        for seq_bytes, payload in list(buffer):
            seq = int.from_bytes(seq_bytes, "big")
            if seq >= first and (until is None or seq < until):
                replay.send_multipart([identity, b"", seq_bytes, payload])
        replay.send_multipart([identity, b"", END_OF_REPLAY, b""])
