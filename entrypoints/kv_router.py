"""KV-aware routing for `engine proxy --routing kv-aware`: which instance holds a prompt's prefix.

Every instance publishes its prefix-cache changes (engine/kv_events.py). The router subscribes
to each one on a thread of its own and keeps, per instance, the set of block hashes it holds.
For a request it asks an instance to tokenize it (`POST /tokenize`, the exact tokens the engine
will run, chat template included), hashes the full blocks the way the engines do (chained
SHA-256 from the root hash the instance reports in /status) and picks the instance with the
lowest cost:

    cost(i) = uncached_prompt_tokens(i) + load_weight * in_flight(i)

where uncached_prompt_tokens(i) is the prompt length minus the longest prefix of its blocks
instance i holds (a block in one of its tiers, not its pool, counts as cached for the share of
its recompute that loading it saves, by the instance's own estimate in its /status
``kv_load_decision``: engine/kv_transfer/load_cost.py ``load_share``), and in_flight(i) the requests this proxy has open there. ``load_weight``
(``--kv-load-weight``, tokens per open request, default 32) trades cache hits against load: a
cached prefix of 1,000 tokens outweighs 31 extra open requests, because an engine batches a new
request with its running ones (an open request costs it little) while a prefix computed again
costs its whole prefill and a second copy in another pool. Ties go to the least loaded, and an
instance with more than ``--kv-max-skew`` (default 8) open requests above the least loaded one
is not a candidate, so a prefix every request shares (a long system prompt) cannot pile all the
traffic on the one replica that holds it.
(benchmarks/routing.py, 16 chats x 6 turns on 4 replicas: weight 256 scattered the early turns,
whose history is short, and reached a 64.9% hit rate against the single big instance's 74.8%;
weight 32 reached 74.6%.)

Stays correct when things go wrong, because a wrong index only ever costs a cache miss: an
instance's first batch after a (re)start is AllBlocksCleared, so its entries are dropped; a gap
in the sequence numbers is filled from the replay socket, or, when the replay no longer has it,
the instance's entries are dropped and rebuilt from then on; an instance whose events cannot be
reached counts as holding nothing.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.utils.monitor

from engine.block_pool import BlockHasher
from engine.kv_transfer.load_cost import load_share
from engine.kv_events import (
    END_OF_REPLAY,
    MEDIUM,
    MEDIUM_CPU,
    MEDIUM_DISK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    endpoint_host,
    event_keys,
)
from engine.vllm_block_hash import VllmBlockHasher

logger = logging.getLogger("engine.proxy")

REPLAY_TIMEOUT_MS = 2000
TIER_OF_MEDIUM = {MEDIUM_CPU: "cpu", MEDIUM_DISK: "disk"}  # what the load estimate calls each tier


@dataclass
class InstanceIndex:
    """The block hashes one instance holds, as its events say."""
    url: str
    hashes: set[bytes | int] = field(default_factory=set)  # in the instance's pool (medium GPU)
    # In its CPU and disk tiers, by medium: loading from there costs far less than a prefill,
    # so a block held in any medium counts as cached.
    tiers: dict[str, set] = field(default_factory=dict)
    publishing: bool = False  # the instance advertises KV events and they are followed
    last_seq: int = -1
    resyncs: int = 0  # times the index was dropped (restart, or a gap the replay could not fill)
    routed: int = 0  # requests routed here
    prompt_tokens: int = 0  # of those requests
    predicted_hits: int = 0  # prompt tokens the index said were cached here
    # Its /status kv_load_decision at the last poll: how much a tier hit there saves.
    load_decision: dict | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        with self.lock:
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self.hashes.clear()
                    self.tiers.clear()
                elif isinstance(event, BlockStored):
                    self._held(event.medium).update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._held(event.medium).difference_update(event.block_hashes)
            self.last_seq = seq

    def _held(self, medium: str | None) -> set:
        return self.hashes if medium in (None, MEDIUM) else self.tiers.setdefault(medium, set())

    def reset(self) -> None:
        with self.lock:
            self.hashes.clear()
            self.tiers.clear()
            self.resyncs += 1

    def prefix_blocks(self, hashes: list[bytes]) -> int:
        return len(self.prefix_media(hashes))

    def prefix_media(self, hashes: list[bytes]) -> list[str]:
        """Where each block of the longest held prefix is: MEDIUM (the pool) or a tier's medium."""
        with self.lock:
            media = []
            for h in hashes:
                medium = MEDIUM if h in self.hashes else next(
                    (m for m, held in self.tiers.items() if h in held), None)
                if medium is None:
                    break
                media.append(medium)
            return media

    def hit_tokens(self, hashes: list[bytes], block_size: int) -> float:
        """Prompt tokens as good as cached here: the pool's blocks in full, a tier's for the share
        of their recompute that loading them saves (by the instance's own estimate)."""
        hit = 0.0
        for i, medium in enumerate(self.prefix_media(hashes)):
            cost = 0.0 if medium == MEDIUM else load_share(
                self.load_decision, TIER_OF_MEDIUM.get(medium, ""), i * block_size, (i + 1) * block_size)
            hit += block_size * (1.0 - cost)
        return hit


class EventSubscriber(threading.Thread):
    """Feeds one InstanceIndex from its instance's PUB socket; fills gaps from the replay socket."""

    def __init__(self, index: InstanceIndex, endpoint: str, replay_endpoint: str | None, topic: str,
                 secret=None) -> None:
        super().__init__(name=f"kv-events {index.url}", daemon=True)
        self.index, self.topic, self.secret = index, topic.encode(), secret
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.ctx = zmq.Context()
        self._stop_event = threading.Event()
        # vLLM 0.32's encoding, and 0.20's that instances not yet upgraded send (kv_events.py).
        self.decode = decode_batch

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, ":" in endpoint_host(endpoint))
        if self.secret is not None:
            sock.curve_serverkey = event_keys(self.secret, "server")[0]
            sock.curve_publickey, sock.curve_secretkey = event_keys(self.secret, "client")
        sock.connect(endpoint)
        return sock

    def run(self) -> None:
        sub = self._socket(zmq.SUB, self.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        # Connections coming and going: a reconnect may be a restarted instance whose first
        # batch (AllBlocksCleared) went out before we were back.
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.replay = self._socket(zmq.DEALER, self.replay_endpoint) if self.replay_endpoint else None
        replay = self.replay is not None
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        dropped = False
        try:
            # What the instance holds already: everything its replay buffer still has.
            if replay:
                self._replay(0)
            while not self._stop_event.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        # Gone, restarting, or (with ports it chooses) moving elsewhere: what it
                        # held is not known any more; a reconnect replays what it holds then.
                        dropped = True
                        self.index.reset()
                    elif event == zmq.EVENT_CONNECTED and dropped and replay:
                        dropped = False
                        self._replay(0)
                if sub not in ready:
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big")
                try:
                    batch = self.decode(frames[2])
                except msgspec.DecodeError:
                    logger.warning("undecodable KV event batch from %s", self.index.url)
                    continue
                last = self.index.last_seq
                if seq <= last and not _starts_over(batch):
                    # Already applied (a replay overlapping the subscription). A restart shows as
                    # a dropped connection, followed by a replay from 0 (above).
                    continue
                if seq > last + 1 and last >= 0:
                    if replay:
                        self._replay(last + 1, until=seq)
                    else:
                        self.index.reset()  # a gap nothing can fill
                self.index.apply(seq, batch)
        except Exception as exc:  # the index would go stale: it is dropped instead
            if not self._stop_event.is_set():
                logger.warning("KV events of %s stopped (%s): its index is dropped", self.index.url, exc)
            self.index.reset()
        finally:
            self.ctx.destroy(linger=0)

    def _replay(self, first: int, until: int | None = None) -> None:
        """Apply the buffered batches from ``first`` (up to ``until``). When the instance no
        longer has ``first``, its index starts over with what it still has."""
        replay = self.replay
        # The publisher stops at ``until`` (its 8 extra bytes; this engine's publisher only: vLLM
        # 0.32's would read all 16 as the start and replay nothing, but the router follows only
        # instances of this engine, whose /status names the endpoints).
        request = first.to_bytes(8, "big") + (until.to_bytes(8, "big") if until is not None else b"")
        # zmq has nowhere to queue the request while the connection is down after a failed
        # transport handshake (an instance holding another secret): a blocking send would hang.
        sent = bool(replay.poll(REPLAY_TIMEOUT_MS, zmq.POLLOUT))
        if sent:
            try:
                replay.send_multipart([b"", request], flags=zmq.NOBLOCK)
            except zmq.Again:  # the connection went between the poll and the send
                sent = False
        expected, received = first, False
        while sent and replay.poll(REPLAY_TIMEOUT_MS):
            frames = replay.recv_multipart()
            if len(frames) != 3 or frames[1] == END_OF_REPLAY:
                return
            seq = int.from_bytes(frames[1], "big")
            if until is not None and seq >= until:
                continue
            if seq != expected and (received or first > 0):
                # Missed more than the buffer holds, or a hole in the replay itself: what we
                # know of this instance is incomplete, so start over from here. (A replay from
                # 0 may start later: the buffer's oldest batch.)
                self.index.reset()
            expected, received = seq + 1, True
            try:
                self.index.apply(seq, self.decode(frames[2]))
            except msgspec.DecodeError:
                self.index.reset()
        logger.warning("KV events of %s: no complete answer from the replay socket", self.index.url)
        self.index.reset()
        # A late answer must not be read as the answer to the next request: a new socket.
        replay.close(linger=0)
        self.replay = self._socket(zmq.DEALER, self.replay_endpoint)

    def stop(self) -> None:
        self._stop_event.set()


def _starts_over(batch: KVEventBatch) -> bool:
    return bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)


def connectable(endpoint: str, instance_url: str) -> str:
    """An endpoint as the instance advertised it, with a wildcard host replaced by the host the
    proxy reaches the instance at."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    bare = host.strip("[]")
    # A wildcard, or loopback on an instance that is not on this host: the instance's own host.
    if bare in ("*", "0.0.0.0", "::", "") or bare in ("127.0.0.1", "localhost", "::1"):
        host = urlsplit(instance_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port}"


@dataclass
class PromptBlocks:
    num_tokens: int
    by_hasher: dict[tuple, list]  # hasher_key(...) -> the prompt's block hashes under it


def hasher_key(events_info: dict) -> tuple:
    """What determines the hashes an instance's events name: algorithm, block size, root (the
    engine's; vLLM's is H(PYTHONHASHSEED), or vLLM's fixed default when unset, here as there)."""
    algo = events_info.get("hash_algo", "engine")
    root = events_info["root_block_hash"] if algo == "engine" else None
    return (algo, int(events_info["block_size"]), root)


def make_hasher(key: tuple) -> BlockHasher | VllmBlockHasher:
    algo, block_size, root = key
    if algo == "engine":
        return BlockHasher(block_size, bytes.fromhex(root))
    return VllmBlockHasher(algo, block_size)


class KVRouter:
    def __init__(self, load_weight: float = 32.0, secret=None, max_skew: int = 8) -> None:
        self.load_weight, self.secret, self.max_skew = load_weight, secret, max_skew
        self.indexes: dict[str, InstanceIndex] = {}
        self.hasher_keys: dict[str, tuple] = {}  # url -> hasher_key of its events
        self.hashers: dict[tuple, BlockHasher | VllmBlockHasher] = {}
        self._warned: set[str] = set()  # instances said once to publish no events
        # url -> (what its /status said, the subscriber following it)
        self.subscribers: dict[str, tuple[dict, EventSubscriber]] = {}

    def watch(self, url: str, events_info: dict | None) -> None:
        """Follow an instance's events (``events_info``: its /status ``kv_events``). Called again
        with what /status says now: unchanged, nothing happens; changed (a restarted instance
        with ports of its own choosing, another hash algorithm), the index starts over and the
        new endpoints are followed."""
        index = self.indexes.setdefault(url, InstanceIndex(url))
        previous = self.subscribers.get(url)
        if previous is not None and previous[0] == events_info:
            return
        if previous is not None:
            previous[1].stop()
            del self.subscribers[url]
            # A new index (the old subscriber may apply one last batch to the old one as it stops),
            # keeping the counters.
            index = self.indexes[url] = InstanceIndex(url, resyncs=index.resyncs + 1, routed=index.routed,
                                                      prompt_tokens=index.prompt_tokens,
                                                      predicted_hits=index.predicted_hits)
        index.publishing = False
        self.hasher_keys.pop(url, None)
        if not events_info:
            if previous is not None or url not in self._warned:
                logger.warning("%s publishes no KV events (start it with --kv-events): it counts as holding "
                               "nothing", url)
                self._warned.add(url)
            return
        try:
            key = hasher_key(events_info)
            self.hashers.setdefault(key, make_hasher(key))
        except (KeyError, ValueError, TypeError) as exc:
            logger.warning("%s: cannot follow its KV events (%s): it counts as holding nothing", url, exc)
            return
        self.hasher_keys[url] = key
        index.publishing = True
        replay = events_info.get("replay_endpoint")
        subscriber = EventSubscriber(index, connectable(events_info["endpoint"], url),
                                     connectable(replay, url) if replay else None,
                                     events_info.get("topic", "kv-events"), self.secret)
        subscriber.start()
        self.subscribers[url] = (events_info, subscriber)

    def prompt_blocks(self, token_ids: list[int], cache_salt: str | None = None) -> "PromptBlocks":
        """The prompt's block hashes under every way the instances hash (one per model
        fingerprint, block size and hash algorithm), salted as the instances salt them. CPU work:
        callers run it off the event loop."""
        return PromptBlocks(len(token_ids), {key: hasher.prompt_hashes(token_ids, cache_salt)  # watch() may add
                                             for key, hasher in list(self.hashers.items())})

    def choose(self, candidates: list, prompt: "PromptBlocks | None", extra: dict[str, float] | None = None):
        """(the upstream with the lowest cost, predicted cached tokens there). ``candidates``
        have ``url`` and ``in_flight``, in tie-breaking order; ``extra``: load to add per url
        (a hand-off's slow path: engine proxy's transfer_load), weighed as in-flight requests."""
        best, best_cost, best_hit = None, None, 0
        # However much it holds, an instance with max_skew more open requests than the least
        # loaded one is passed over: a hot shared prefix must not pile everything on one replica.
        least = min((u.in_flight for u in candidates), default=0)
        for upstream in candidates:
            if upstream.in_flight > least + self.max_skew:
                continue
            hit = 0
            key, index = self.hasher_keys.get(upstream.url), self.indexes.get(upstream.url)
            if prompt is not None and key is not None and index is not None:
                hit = round(index.hit_tokens(prompt.by_hasher.get(key, []), key[1]))
            load = upstream.in_flight
            if extra:  # a pull's cost, for the part of the prompt not cached there
                uncached = 1 - hit / prompt.num_tokens if prompt and prompt.num_tokens else 1
                load += extra.get(upstream.url, 0.0) * uncached
            cost = ((prompt.num_tokens if prompt else 0) - hit) + self.load_weight * load
            if best_cost is None or cost < best_cost:
                best, best_cost, best_hit = upstream, cost, hit
        return best, best_hit

    def observe_load_decision(self, url: str, decision: dict | None) -> None:
        """An instance's /status kv_load_decision, read with its KV events' endpoints."""
        index = self.indexes.get(url)
        if index is not None:
            index.load_decision = decision if isinstance(decision, dict) else None

    def count(self, url: str, prompt: "PromptBlocks | None", hit: int) -> None:
        """One routed request (counted once, whatever was tried before)."""
        index = self.indexes.get(url)
        if index is not None:
            index.routed += 1
            index.prompt_tokens += prompt.num_tokens if prompt else 0
            index.predicted_hits += hit

    def status(self) -> list[dict]:
        return [{"url": i.url, "kv_events": i.publishing, "index_blocks": len(i.hashes),
                 "tier_blocks": {medium: len(held) for medium, held in i.tiers.items()}, "last_seq": i.last_seq,
                 "resyncs": i.resyncs,
                 "routed": i.routed, "prompt_tokens": i.prompt_tokens, "predicted_hits": i.predicted_hits,
                 "predicted_hit_rate": round(i.predicted_hits / i.prompt_tokens, 4)
                 if i.prompt_tokens else None} for i in self.indexes.values()]

    def forget(self, url: str) -> None:
        """An instance that is gone for good (a Ray Serve replica removed): its index and
        subscriber go too."""
        followed = self.subscribers.pop(url, None)
        if followed is not None:
            followed[1].stop()
        self.indexes.pop(url, None)
        self.hasher_keys.pop(url, None)
        self._warned.discard(url)

    def stop(self) -> None:
        for _, subscriber in self.subscribers.values():
            subscriber.stop()
