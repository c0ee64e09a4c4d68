"""The ``triton`` attention backend (CUDA; CPU under Triton's interpreter): paged attention read
in place through the block table, one kernel launch per layer for the step's whole mixed batch
(decodes and prefill chunks with cached context alike), and a Triton KV write. The kernels are
in triton_kernels.py; this file turns a step into their metadata.

The metadata's device tensors are int32 and come from one host→device copy per step (pinned and
asynchronous on CUDA: host_to_device.py), shared by every sliding window of the step. A CUDA
graph (engine/worker/cuda_graphs.py) instead keeps one ``TritonMetadata`` whose tensors are
views of persistent buffers it refills before each replay (``graph_metadata``)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.worker.attention import StepAttention
from engine.worker.backends.layout import kv_cache_shape
from engine.worker.host_to_device import HostToDevice

DECODE_BLOCK_N = 32   # keys per iteration when every query is a decode
PREFILL_BLOCK_N = 32
MAX_TILE_ELEMENTS = 64 * 128  # rows x head dim of a tile's float32 accumulator (registers)
MIN_SPLIT_KEYS = 256  # split-K: a segment of fewer keys saves less than its merge costs
MAX_SPLITS = 16


@dataclass(slots=True)
class TritonMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64; < 0: write nothing (graph padding)
    block_table: torch.Tensor   # [num_reqs, max_blocks] int32
    query_start: torch.Tensor   # [num_reqs + 1] int32
    seq_lens: torch.Tensor      # [num_reqs] int32
    tile_req: torch.Tensor      # [num_tiles] int32: the request of each tile
    tile_q: torch.Tensor        # [num_tiles] int32: the tile's first query within its request
    block_q: int                # queries per tile
    block_n: int
    sliding_window: int | None
    num_splits: int = 1         # split-K segments per decode (triton_kernels.py)


def prefill_block_q(groups: int, head_dim: int) -> int:
    """Queries per tile for steps with prefill chunks: as many as keep the tile's rows (queries
    x group heads) times the head dim within MAX_TILE_ELEMENTS, at most 16."""
    head_pad = 1 << (head_dim - 1).bit_length()
    return max(1, min(16, MAX_TILE_ELEMENTS // head_pad // groups))


def decode_splits(num_reqs: int, num_kv_heads: int, longest: int, target_programs: int) -> int:
    """Split-K segments for a decode step: enough that (requests x kv heads x segments) reaches
    ``target_programs`` (about two per streaming multiprocessor), each segment at least
    MIN_SPLIT_KEYS of the longest context; a power of two, at most MAX_SPLITS; 1 when the batch
    alone fills the device."""
    programs = num_reqs * num_kv_heads
    if programs >= target_programs:
        return 1
    splits = min(MAX_SPLITS, -(-target_programs // programs), longest // MIN_SPLIT_KEYS)
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)


def target_programs(device: torch.device) -> int:
    """Programs a decode's attention should launch to fill ``device``: two per streaming
    multiprocessor on CUDA; 0 (never split) on CPU, where Triton only runs interpreted."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def tile_map(query_lens: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """(request, first query) of every tile: request r gets ceil(q_len / block_q) tiles."""
    tiles = -(-query_lens.astype(np.int64) // block_q)
    req = np.repeat(np.arange(len(query_lens), dtype=np.int32), tiles)
    first_tile = np.repeat(np.cumsum(tiles) - tiles, tiles)
    return req, ((np.arange(len(req)) - first_tile) * block_q).astype(np.int32)


class TritonBackend:
    name = "triton"
    kv_cache_shape = staticmethod(kv_cache_shape)

    def __init__(self, groups: int, head_dim: int, num_kv_heads: int = 1) -> None:
        from engine.worker.backends import triton_kernels  # imports triton: only when selected
        self._kernels = triton_kernels
        self.groups = groups
        self.num_kv_heads = num_kv_heads
        self.prefill_block_q = prefill_block_q(groups, head_dim)
        self.target_programs: int | None = None  # target_programs(device), on the first step
        self._to_device: HostToDevice | None = None  # its views live until the next step's metadata
        self._last: tuple[StepAttention, TritonMetadata] | None = None

    def splits_for(self, num_reqs: int, longest: int, device: torch.device) -> int:
        if self.target_programs is None:
            self.target_programs = target_programs(device)
        return decode_splits(num_reqs, self.num_kv_heads, longest, self.target_programs)

    def build_metadata(self, step: StepAttention, sliding_window: int | None) -> TritonMetadata:
        """The step's metadata for one window: built and copied once per step, whatever the
        number of windows (the layers of a model with sliding windows ask once per window)."""
        last = self._last
        if last is not None and last[0] is step:
            return replace(last[1], sliding_window=sliding_window)
        meta = self._build(step, sliding_window)
        self._last = (step, meta)
        return meta

    def _build(self, step: StepAttention, sliding_window: int | None) -> TritonMetadata:
        decode_only = bool((step.query_lens <= 1).all())
        block_q = 1 if decode_only else self.prefill_block_q
        tile_req, tile_q = tile_map(step.query_lens, block_q)
        num_reqs = len(step.query_lens)
        table = step.block_table
        # One host->device copy: [query_start | seq_lens | tile_req | tile_q | block_table].
        packed = np.concatenate([step.query_start, step.seq_lens, tile_req, tile_q, table.ravel()]).astype(np.int32)
        if self._to_device is None or self._to_device.device != step.device:
            self._to_device = HostToDevice(step.device)
        dev, = self._to_device.send(packed)
        at = np.cumsum([0, num_reqs + 1, num_reqs, len(tile_req), len(tile_q)])
        return TritonMetadata(
            step.num_tokens, step.slot_mapping, dev[at[4]:].view(table.shape), dev[at[0]:at[1]], dev[at[1]:at[2]],
            dev[at[2]:at[3]], dev[at[3]:at[4]], block_q, DECODE_BLOCK_N if decode_only else PREFILL_BLOCK_N,
            sliding_window,
            self.splits_for(num_reqs, int(step.seq_lens.max(initial=0)), step.device) if decode_only else 1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: TritonMetadata, scale: float, softcap: float | None = None) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        kernels = self._kernels
        kernels.write_kv(kv_cache, _rows(k), _rows(v), meta.slot_mapping)
        q = _rows(q)
        out = torch.empty_like(q)
        return kernels.paged_attention(q, kv_cache[0], kv_cache[1], out, meta.block_table,
                                       meta.query_start, meta.seq_lens, meta.tile_req, meta.tile_q, meta.block_q,
                                       scale, softcap, meta.sliding_window, meta.block_n, meta.num_splits)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] with each token's heads and dims contiguous, as the kernels
    read them (any token stride: v is a view into the fused qkv projection, used as it is)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def graph_metadata(max_rows: int, max_blocks: int, device: torch.device, windows,
                   splits_for=lambda rows: 1) -> tuple[dict, dict]:
    """Persistent buffers for decode graphs of up to ``max_rows`` requests, and ``metas_for(rows)``:
    the metadata (per window) of a decode step of ``rows`` requests over their leading slices, so
    a replay sees whatever was copied in last; ``splits_for(rows)``: its split-K segments, fixed at
    capture (the kernel sizes each segment from the replayed context). The graph fills 'slot_mapping' [max_rows] int64,
    'seq_lens' [max_rows] int32 and 'block_table' [max_rows, max_blocks] int32; 'query_start'
    (0..max_rows) and the tile map (tile i: request i, query 0) are constant."""
    buffers = {
        "slot_mapping": torch.full((max_rows,), -1, dtype=torch.int64, device=device),
        "seq_lens": torch.zeros(max_rows, dtype=torch.int32, device=device),
        "block_table": torch.zeros((max_rows, max_blocks), dtype=torch.int32, device=device),
        "query_start": torch.arange(max_rows + 1, dtype=torch.int32, device=device),
        "tiles": torch.arange(max_rows, dtype=torch.int32, device=device),
        "zeros": torch.zeros(max_rows, dtype=torch.int32, device=device),
    }

    def metas_for(rows: int) -> dict:
        return {window: TritonMetadata(rows, buffers["slot_mapping"][:rows], buffers["block_table"][:rows],
                                       buffers["query_start"][:rows + 1], buffers["seq_lens"][:rows],
                                       buffers["tiles"][:rows], buffers["zeros"][:rows], 1, DECODE_BLOCK_N, window,
                                       splits_for(rows))
                for window in windows}
    return buffers, metas_for
