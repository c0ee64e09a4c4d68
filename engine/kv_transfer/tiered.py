"""Prefix reuse and offload through KV stores (CPU memory, local disk, Redis): the scheduler
half and the metadata it sends. The worker half is in ``tiered_worker.py``.

Scheduler half: at admission, after the device prefix match, it needs to know how many further
full chunks (``chunk_tokens`` tokens, a multiple of the block size) the tiers hold. Finding out
is I/O (a Redis ``EXISTS``, a disk ``stat``), so it never does it itself: it asks the worker
half through the step's metadata, answers the scheduler "not known yet" (None; the request stays
queued without holding up the queue) and uses the answer, which comes back in
``KVConnectorOutput.lookups``, on a later step. After the full chunks it asks for the longest
*trailing chunk* (fewer than ``chunk_tokens`` tokens, whole blocks) some tier holds: a prompt's
last, partial chunk is stored too when its prefill completes, so a tier hit covers the whole
blocks of a prompt, as a device prefix hit would. An answer that has not come within
``lookup_timeout_s`` is a miss for that admission: a slow or hanging store delays a request by
at most that bound and never stalls a step. The scheduler then allocates blocks for the chunks
found and parks the request in WAITING_FOR_REMOTE_KV while the worker loads them. The last
known token is never loaded (its logits are needed). After a step computes a chunk in full,
the chunk is saved.

This half never calls a store: even an in-memory call (pin, unpin) takes a store lock that the
disk tier holds across file deletions. Pins are the worker's: a lookup pins what it found (a
lease) until the load has read it or the scheduler releases the lookup.

Load or recompute (``load_cost.py``): a lookup's answer says which tier holds each chunk found;
the chunks are loaded only as far as loading them is expected to be faster than computing them,
by the tiers' measured rates and this instance's measured prefill (``--kv-always-load``: all of
them, as before). A chunk promised by a prefill instance is always loaded.

Keys are the SHA-256 chained hash of a chunk's last block (it covers every token before it
and, through the root hash, the model fingerprint, dtype, block size and layout).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.kv_transfer.base import KVConnectorScheduler
from engine.kv_transfer.load_cost import LoadOption, LoadPlanner
from engine.kv_events import event_extra_keys
from engine.kv_transfer.params import KVTransferParams, token_digest
from engine.kv_transfer.tier_events import ChunkNames
from engine.outputs import KVConnectorOutput, SchedulerOutput
from engine.request import Request, RequestStatus

logger = logging.getLogger("engine.kv_store")

DEFAULT_CHUNK_TOKENS = 256
DEFAULT_PROMISED_WAIT_S = 10.0  # how long a decode waits for chunks a prefill instance promised
# How long a waiting request may wait for the worker half's lookup before it counts as a miss.
# Local tiers answer in well under a millisecond and a healthy Redis in about one; the bound
# only matters for a store that is slow or hanging (its own timeout is longer, 1 s for Redis).
LOOKUP_TIMEOUT_S = 0.5


@dataclass(slots=True)
class ChunkLoad:
    key: str
    first_block: int       # the chunk's first block to write (earlier ones were a device hit)
    block_ids: list[int]   # destinations of the chunk's blocks [first_block:]


@dataclass(slots=True)
class TierLoad:
    req_id: str
    chunks: list[ChunkLoad]
    wait_until: float = 0.0  # time.monotonic() until which a missing chunk is retried


@dataclass(slots=True)
class TierSave:
    key: str
    block_ids: list[int]  # the chunk's blocks, in order
    names: ChunkNames | None = None  # what KV events call its blocks (only with events on)


@dataclass(slots=True)
class TierLookup:
    """How many leading ``keys`` (consecutive chunks of one request) some tier holds, then the
    longest trailing chunk some tier holds where they stop: if all were found, the longest of
    ``tail_keys`` (after them, longest first: ``tail_keys[i]`` covers ``len(tail_keys) - i``
    blocks); if ``keys[m]`` is the first missing, the longest chunk of fewer blocks at its place
    (named by its last block's hash: ``block_hashes`` are the blocks of ``keys``' chunks, in
    order). A trailing chunk stored by a shorter prompt then serves a longer one (the next turn
    of a chat). The answer is ``KVConnectorOutput.lookups[req_id]``; the chunks found stay
    pinned until a load of the request takes them over or a release for it arrives."""
    req_id: str
    keys: list[str]
    tail_keys: list[str] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)

    def tails_at(self, m: int) -> list[str]:
        """The keys of the chunks of fewer blocks at ``keys[m]``'s place, longest first."""
        per_chunk = len(self.block_hashes) // len(self.keys)
        return [self.block_hashes[m * per_chunk + n - 1].hex() for n in range(per_chunk - 1, 0, -1)]


@dataclass(slots=True)
class TieredMetadata:
    loads: list[TierLoad] = field(default_factory=list)
    saves: list[TierSave] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    # Lookups to drop (their answer is no longer wanted; unpin what they found), then lookups
    # to start: a later lookup for a request supersedes an earlier one. A release never
    # follows a lookup for the same request within one step, so the worker applies releases
    # first.
    releases: list[str] = field(default_factory=list)
    lookups: list[TierLookup] = field(default_factory=list)


@dataclass(slots=True)
class PendingLookup:
    """A lookup the scheduler half asked for one admission of a request."""
    first_chunk: int        # the answer counts chunks from this one
    deadline: float         # time.monotonic() after which no answer is a miss
    found: int | None = None  # leading chunks found from first_chunk; None until answered
    tail_blocks: int = 0    # blocks of the trailing chunk found after them
    timed_out: bool = False   # the deadline passed first: a miss, and later answers are ignored
    sources: list[str] = field(default_factory=list)  # the tier of each chunk found, in order
    # The load-or-recompute decision last made on the answer: (local tokens it was made for,
    # the chunks it could load, how many of them it loads), counted once the request is admitted.
    plan: tuple[int, list[LoadOption], int] | None = None


# How long a kv_store_tokens promise may be acted on: it is used right after the prefill answers.
PROMISE_TTL_S = 60.0


class TieredConnectorScheduler(KVConnectorScheduler):
    def __init__(self, block_size: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 wait_s: float = DEFAULT_PROMISED_WAIT_S, lookup_timeout_s: float = LOOKUP_TIMEOUT_S,
                 planner: LoadPlanner | None = None, chunk_bytes: int = 0) -> None:
        """Never calls a store: lookups and pins are the worker half's (see the module docstring).
        ``planner`` decides how much of a hit to load (None: all of it), reading a full chunk
        costing ``chunk_bytes``."""
        self.planner = planner
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError(f"kv_chunk_tokens={chunk_tokens} must be a positive multiple of the block "
                             f"size ({block_size})")
        self.wait_s = wait_s
        self.params_ttl_s = PROMISE_TTL_S
        self.offers_kv = True  # store-mode disaggregation: the tiers hold the prompt's KV
        self.lookup_timeout_s = lookup_timeout_s
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // block_size
        self.block_bytes = chunk_bytes // self.blocks_per_chunk
        self.describe_saves = False  # KV events are on: saves carry their blocks' names
        self.lookup_timeouts = 0  # lookups that became misses because no answer came in time
        self._meta = TieredMetadata()
        self._requests: dict[str, Request] = {}
        self._saved: dict[str, int] = {}          # leading chunks known to be in the tiers
        self._loading: dict[str, int] = {}        # request -> first chunk of its load in flight
        # Waiting requests' lookups, from the first ask until admission or the end of the request.
        self._lookups: dict[str, PendingLookup] = {}
        self._no_lookup: set[str] = set()  # a load of theirs failed: they recompute from here on

    @staticmethod
    def _block_key(request: Request, end_block: int) -> str:
        """The key of a chunk that ends with block ``end_block - 1``: that block's chained hash."""
        return request.block_hashes[end_block - 1].hex()

    def _key(self, request: Request, chunk: int) -> str:
        return self._block_key(request, (chunk + 1) * self.blocks_per_chunk)

    def _loadable_blocks(self, request: Request) -> int:
        """Whole blocks before the last known token (which is always computed here)."""
        return min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool] | None:
        req_id = request.request_id
        loadable = self._loadable_blocks(request)
        first = num_computed_tokens // self.chunk_tokens
        last = loadable // self.blocks_per_chunk  # full chunks that end before the last token
        if loadable * self.block_size <= num_computed_tokens or req_id in self._no_lookup:
            return 0, False
        promised = self._promised_tokens(request)
        if promised:
            # Store-mode disaggregation: a prefill instance said it stored this many tokens of
            # this very prompt; its writes may still be on their way, so the loader waits for
            # them (up to a deadline). The promise decides what to allocate: no lookup.
            return self._match(min(promised // self.block_size, loadable), num_computed_tokens)
        lookup = self._lookups.get(req_id)
        if lookup is None or (lookup.found is not None and first < lookup.first_chunk):
            # Not asked yet, or the local prefix shrank (its blocks were evicted) since: the
            # answer says nothing about the chunks before the first one asked.
            self._ask(request, first, last, loadable)
            return None
        if lookup.found is not None:
            # A local prefix that grew since is fine: the answer still covers the chunks after it.
            end_chunk = min(lookup.first_chunk + lookup.found, last)
            tail = lookup.tail_blocks if end_chunk == lookup.first_chunk + lookup.found else 0
            end_block = min(end_chunk * self.blocks_per_chunk + tail, loadable)
            return self._match(self._worth_loading(request, lookup, end_block, num_computed_tokens),
                               num_computed_tokens)
        if lookup.timed_out:
            return 0, False
        if time.monotonic() < lookup.deadline:
            return None
        lookup.timed_out = True
        self.lookup_timeouts += 1
        self._meta.releases.append(req_id)  # the worker drops it and unpins what it finds
        logger.debug("KV store lookup for %s timed out after %.2f s: a miss", req_id, self.lookup_timeout_s)
        return 0, False

    def _worth_loading(self, request: Request, lookup: PendingLookup, end_block: int, num_computed: int) -> int:
        """The block up to which the chunks found are worth loading (the planner's choice, at a
        chunk's end: a chunk is read whole, so once read all of it is worth using)."""
        if self.planner is None or end_block * self.block_size <= num_computed:
            return end_block
        options = []
        bpc = self.blocks_per_chunk
        for c in range(num_computed // self.chunk_tokens, -(-end_block // bpc)):
            index = c - lookup.first_chunk
            is_tail = index == lookup.found  # the trailing chunk found after the full ones
            stored_blocks = lookup.tail_blocks if is_tail else bpc
            source = lookup.sources[index] if index < len(lookup.sources) else "unknown"
            options.append(LoadOption(min((c + 1) * bpc, end_block) * self.block_size,
                                      stored_blocks * self.block_bytes, source))
        loaded = self.planner.plan(num_computed, request.num_tokens, options)
        lookup.plan = (num_computed, options, loaded)
        return options[loaded - 1].end_token // self.block_size if loaded else num_computed // self.block_size

    @staticmethod
    def _promised_tokens(request: Request) -> int:
        """Tokens a prefill instance promised it stored for this very prompt; 0 for none (a
        promise made for other tokens is no promise: the request gets a lookup)."""
        params = request.kv_transfer_params
        if params is None or params.kv_store_tokens <= 0:
            return 0
        ok = params.token_digest == token_digest(request.prompt_token_ids[:params.kv_store_tokens])
        return params.kv_store_tokens if ok else 0

    def _match(self, end_block: int, num_computed_tokens: int) -> tuple[int, bool]:
        external = end_block * self.block_size - num_computed_tokens
        return (external, True) if external > 0 else (0, False)

    def _ask(self, request: Request, first: int, last: int, loadable: int) -> None:
        """One lookup per admission (a new one only if the local prefix shrank under it)."""
        self._lookups[request.request_id] = PendingLookup(first, time.monotonic() + self.lookup_timeout_s)
        # Trailing chunks are named by their own last block, which may hold the last token (a
        # block-aligned prompt's last chunk): those are asked for too, and loaded up to the
        # loadable blocks (as the device prefix cache uses a cached block-aligned prompt).
        longest = min(len(request.block_hashes), (last + 1) * self.blocks_per_chunk)
        tails = [self._block_key(request, end) for end in range(longest, last * self.blocks_per_chunk, -1)]
        self._meta.lookups.append(TierLookup(
            request.request_id, [self._key(request, c) for c in range(first, last)], tails,
            request.block_hashes[first * self.blocks_per_chunk:last * self.blocks_per_chunk]))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if self.planner is not None:
            for source, nbytes, seconds in output.transfer_samples:
                if not source.startswith("peer:"):  # (a peer's pulls are the P2P half's to count)
                    self.planner.observe_transfer(source, nbytes, seconds)
        for req_id, found in output.lookups.items():
            lookup = self._lookups.get(req_id)
            if lookup is None or lookup.timed_out or lookup.found is not None:
                continue  # late (a miss already), or for a request that was admitted or ended
            lookup.found, lookup.tail_blocks = found
            lookup.sources = output.lookup_sources.get(req_id, [])

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        end_chunk = (num_local_tokens + num_external_tokens) // self.chunk_tokens
        # (Set, not raised: after a failed load, or a load by another connector that failed,
        # the chunks it was to bring are not in the tiers on our account.)
        self._saved[req_id] = end_chunk
        lookup = self._lookups.get(req_id)
        if self.planner is not None and lookup is not None and lookup.plan is not None \
                and lookup.plan[0] == num_local_tokens:
            self.planner.count(*lookup.plan)
            if lookup.plan[2] < len(lookup.plan[1]):
                # Chunks found but recomputed instead are in the tiers already: saving them
                # again would send each back over the link just judged too slow to read them.
                self._saved[req_id] = max(end_chunk, lookup.first_chunk + lookup.found)
        # Admitted: its lookup is used up. A load takes over the lookup's pins (the worker
        # unpins them once it has read the chunks); otherwise the worker unpins them now.
        if num_external_tokens == 0:
            lookup = self._lookups.pop(req_id, None)
            if lookup is not None and not lookup.timed_out:
                self._meta.releases.append(req_id)
            return
        first_local_block = num_local_tokens // self.block_size
        end_block = (num_local_tokens + num_external_tokens) // self.block_size
        promised_tokens = self._promised_tokens(request)
        promised = promised_tokens > 0
        # The trailing chunk found (or promised) may hold more blocks than are loaded here.
        lookup = self._lookups.get(req_id)
        if promised:
            tail_end = min(promised_tokens // self.block_size, len(request.block_hashes))
        elif lookup is not None and lookup.found is not None and lookup.tail_blocks:
            tail_end = (lookup.first_chunk + lookup.found) * self.blocks_per_chunk + lookup.tail_blocks
        else:
            tail_end = end_block
        chunks = []
        for c in range(num_local_tokens // self.chunk_tokens, -(-end_block // self.blocks_per_chunk)):
            start = c * self.blocks_per_chunk
            stop = min(start + self.blocks_per_chunk, end_block)
            first = max(0, first_local_block - start)
            # A full chunk's key, or the trailing chunk's (named by its own last block).
            key = self._block_key(request, min(max(tail_end, stop), start + self.blocks_per_chunk))
            chunks.append(ChunkLoad(key, first, block_ids[start + first:stop]))
        # Only now, when nothing can raise any more: a request whose admission fails ends, and
        # request_finished releases the lookup it still holds.
        self._lookups.pop(req_id, None)
        self._loading[req_id] = num_local_tokens // self.chunk_tokens
        self._meta.loads.append(TierLoad(req_id, chunks, time.monotonic() + self.wait_s if promised else 0.0))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TieredMetadata:
        self._plan_saves(scheduler_output)
        meta, self._meta = self._meta, TieredMetadata()
        return meta

    def has_pending_metadata(self) -> bool:
        return bool(self._meta.cancels or self._meta.releases)

    def _plan_saves(self, so: SchedulerOutput) -> None:
        for req_id, n in so.num_scheduled_tokens.items():
            request = self._requests[req_id]
            # num_computed_tokens is advanced after this call: +n is what this step computes.
            full = (request.num_computed_tokens + n) // self.chunk_tokens
            blocks = self.block_ids_of(req_id)
            for c in range(self._saved.get(req_id, 0), full):
                start, end = c * self.blocks_per_chunk, (c + 1) * self.blocks_per_chunk
                self._meta.saves.append(TierSave(self._key(request, c), blocks[start:end],
                                                 self._names(request, start, end)))
            self._saved[req_id] = max(self._saved.get(req_id, 0), full)
            # The prompt's trailing chunk, once, in the step that completes its whole blocks.
            prompt_blocks = request.num_prompt_tokens // self.block_size
            tail_start = prompt_blocks // self.blocks_per_chunk * self.blocks_per_chunk
            if (tail_start < prompt_blocks and request.num_computed_tokens < prompt_blocks * self.block_size
                    <= request.num_computed_tokens + n):
                self._meta.saves.append(TierSave(self._block_key(request, prompt_blocks),
                                                 blocks[tail_start:prompt_blocks],
                                                 self._names(request, tail_start, prompt_blocks)))

    def _names(self, request: Request, start: int, end: int) -> ChunkNames | None:
        """What the KV events call blocks [start, end) of the request: the pool's names for them."""
        if not self.describe_saves:
            return None
        names = request.event_block_hashes or request.block_hashes
        extra = event_extra_keys(start, end - start, request.cache_salt) if request.event_block_hashes else None
        return ChunkNames(tuple(names[start:end]), names[start - 1] if start else None, extra)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        saved = self._saved.pop(req_id, 0)
        self._no_lookup.discard(req_id)
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None and not lookup.timed_out:
            self._meta.releases.append(req_id)  # ended while waiting: unpin what its lookup found
        if req_id in self._loading:
            # Ended while its chunks are loading: keep the blocks until the loader lets go.
            self._meta.cancels.append(req_id)
            return True, None
        params = request.kv_transfer_params
        if request.hands_off and params is not None and params.do_remote_decode and request.status in (
                RequestStatus.FINISHED_HANDED_OFF, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            # Store-mode disaggregation: the prompt's chunks are (being) stored; a decode
            # instance on the same store loads them instead of recomputing.
            full = request.num_prompt_tokens // self.chunk_tokens
            # All full chunks saved: the trailing chunk was saved with the last of them.
            tokens = (request.num_prompt_tokens // self.block_size * self.block_size if saved >= full
                      else saved * self.chunk_tokens)
            return False, KVTransferParams(kv_store_tokens=tokens,
                                           token_digest=token_digest(request.prompt_token_ids[:tokens]))
        return False, None

    def num_tracked_requests(self) -> int:
        return (len(self._requests) + len(self._saved) + len(self._loading)
                + len(self._lookups) + len(self._no_lookup))

    def transfer_done(self, req_id: str, failed: bool = False) -> None:
        first_chunk = self._loading.pop(req_id, None)
        if first_chunk is None:
            return
        if failed and req_id in self._requests:  # (an ended request's cancelled load: nothing to remember)
            # It recomputes: asking the tiers again could fail the same way, forever; and the
            # chunks it recomputes are saved again (a corrupt entry that was read is gone by now).
            self._no_lookup.add(req_id)
            if req_id in self._saved:
                self._saved[req_id] = first_chunk
