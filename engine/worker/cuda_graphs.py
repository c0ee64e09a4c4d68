"""CUDA graphs of decode steps (vLLM's piecewise-free "full" decode graphs, for one backend).

A decode step (every scheduled request computes one token) launches hundreds of small kernels;
on a GPU its time is the host's, not the device's. At start, the model's forward is captured
once per padded batch size (1, 2, 4, 8, then every 16 up to ``max_capture_size``) over
persistent device buffers: token ids, positions, slot mapping, context lengths and block
table. A decode step of n requests copies its inputs into the first n rows, marks rows n..size
as padding (slot -1: no KV write; context 0: attention writes zeros) and replays the graph of
the smallest captured size >= n. Prefill and mixed steps, and decode batches larger than the
largest graph, run eagerly.

Only the ``triton`` backend can be captured: its metadata is device tensors of fixed shape and
its kernels read lengths on the device (the torch backend builds per-step host-side groups).

Invariant: padding rows never touch real rows. Every op of the forward is row-local except
attention, which reads only the KV of its own request through its own block-table row.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.worker.attention import StepAttention
from engine.worker.backends.triton_attn import graph_metadata
from engine.worker.host_to_device import HostToDevice

logger = logging.getLogger("engine.worker")


def capture_sizes(max_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 16, up to max_size (included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_size] + list(range(16, max_size + 1, 16))
    if max_size > 0 and sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def padded_size(sizes: list[int], rows: int) -> int | None:
    """The smallest captured size that holds ``rows``, or None when none does."""
    return next((s for s in sizes if s >= rows), None)


def why_not_captured(config, device: torch.device, backend_name: str) -> str | None:
    """None when decode steps are to be captured, else why not."""
    if device.type != "cuda":
        return f"the device is {device.type}"
    if config.enforce_eager:
        return "--enforce-eager"
    transfer = config.kv_transfer_config
    if transfer is not None and transfer.kv_role == "kv_producer":
        return "a prefill instance (kv_producer) hands its decodes to the decode instance"
    if backend_name != "triton":
        return f"the {backend_name} attention backend builds host-side metadata per step (graphs need triton)"
    if min(config.max_capture_size, config.max_num_seqs) < 1:
        return "--max-capture-size 0"
    return None


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: torch.Tensor, windows, max_size: int, max_blocks: int,
                 device: torch.device, backend) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_size)
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        longest = max_blocks * kv_caches.shape[3]  # [layers, 2, blocks, block_size, ...]: any context may replay
        self.buffers, self._metas_for = graph_metadata(max_size, max_blocks, device, windows,
                                                       lambda rows: backend.splits_for(rows, longest, device))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._to_device = HostToDevice(device)
        start = time.perf_counter()
        held_before = torch.cuda.memory_reserved(device)  # this process's, whatever others allocate meanwhile
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            metas = self._metas_for(size)
            self._forward(size, metas)  # warm-up outside capture (Triton compiles, allocator grows)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size, metas)
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1fs, %.2f GiB", len(self.sizes), max_size,
                    time.perf_counter() - start, (torch.cuda.memory_reserved(device) - held_before) / 2**30)

    def _forward(self, size: int, metas: dict) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, metas)

    def fits(self, step: StepAttention) -> bool:
        return bool(len(step.query_lens) <= self.sizes[-1] and (step.query_lens == 1).all())

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepAttention) -> torch.Tensor:
        """The hidden states [rows, hidden] of a decode step (``fits``), by replaying a graph."""
        rows = len(step.query_lens)
        size = padded_size(self.sizes, rows)
        buf = self.buffers
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        buf["slot_mapping"][:rows].copy_(step.slot_mapping)
        buf["slot_mapping"][rows:size].fill_(-1)
        lengths = np.zeros(size, dtype=np.int32)
        lengths[:rows] = step.seq_lens
        table = step.block_table
        lengths, table = self._to_device.send(lengths, table.astype(np.int32, copy=False))  # one async copy
        buf["seq_lens"][:size].copy_(lengths)
        buf["block_table"][:rows, :table.shape[1]].copy_(table)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[:rows]
