"""A step's attention metadata, built once per step: what every backend needs (``StepAttention``)
and each backend's own form of it (``backend.build_metadata(step, window)``, once per sliding
window the layers use).

Token layout of a step: requests in the runner's row order, each a contiguous range of its new
tokens. Every request attends to its whole context: the cached tokens plus its own new ones.

    context:  | ---- num_computed (already in the cache) ---- | -- query (new) -- |
    seq_len = num_computed + query_len
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.worker.backends.varlen import VarlenMetadata, build_varlen_metadata


@dataclass(slots=True)
class StepAttention:
    """One step's requests as arrays (the runner's input batch fills them without Python loops)."""
    query_lens: np.ndarray   # [num_reqs] int32: new tokens of each request
    seq_lens: np.ndarray     # [num_reqs] int32: cached + new
    query_start: np.ndarray  # [num_reqs + 1] int32: where each request's tokens start in the step
    block_table: np.ndarray  # [num_reqs, max_blocks] int32: covers every seq_len (padding: block 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    block_size: int
    device: torch.device

    @property
    def num_tokens(self) -> int:
        return int(self.query_start[-1])

    @classmethod
    def from_lists(cls, query_lens: list[int], num_computed: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device) -> tuple[StepAttention, np.ndarray]:
        """The step and its tokens' positions, from per-request lists (tests and benchmarks)."""
        q_lens = np.asarray(query_lens, dtype=np.int32)
        seq_lens = np.asarray(num_computed, dtype=np.int32) + q_lens
        table = np.zeros((len(q_lens), max([len(b) for b in block_tables] + [1])), dtype=np.int32)
        for i, blocks in enumerate(block_tables):
            assert len(blocks) * block_size >= seq_lens[i], "block table does not cover the sequence"
            table[i, :len(blocks)] = blocks
        query_start = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start[1:])
        positions = token_positions(query_start, seq_lens - q_lens)
        req_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
        slots = table[req_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
        return cls(q_lens, seq_lens, query_start, table, torch.from_numpy(slots).to(device), block_size,
                   device), positions


def token_positions(query_start: np.ndarray, num_computed: np.ndarray) -> np.ndarray:
    """Position of every new token of a step: request i's run from num_computed[i]."""
    q_lens = np.diff(query_start)
    return (np.arange(int(query_start[-1]), dtype=np.int64)
            - np.repeat(query_start[:-1].astype(np.int64) - num_computed, q_lens))


# ---- the torch backend's form: decode rows batched by length, one SDPA call per prefill ----

@dataclass(slots=True)
class DecodeGroup:
    """Single-query requests batched into one attention call, grouped by context length so that
    padding to the longest stays small."""
    rows: torch.Tensor       # [num_rows] int64: the rows of these queries in the step
    block_ids: torch.Tensor  # [num_rows * max_blocks] int64, row-major, padded with block 0
    mask: torch.Tensor       # [num_rows, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass(slots=True)
class PrefillSeq:
    """One request with several query tokens: rows [query_start, query_end) of the step."""
    query_start: int
    query_end: int
    block_ids: torch.Tensor     # [num_blocks] int64
    seq_len: int
    mask: torch.Tensor | None   # [query_len, seq_len] bool; None = plain causal (no context)


@dataclass(slots=True)
class AttentionMetadata:
    """The torch backend's metadata (decodes, prefills), or the packed-batch kernels' (varlen)."""
    num_tokens: int
    slot_mapping: torch.Tensor
    decodes: list[DecodeGroup]
    prefills: list[PrefillSeq]
    varlen: VarlenMetadata | None = None  # for packed-batch kernels (flash-attn, xformers)


def build_torch_metadata(step: StepAttention, sliding_window: int | None) -> AttentionMetadata:
    q_lens, seq_lens, table, bs, device = step.query_lens, step.seq_lens, step.block_table, step.block_size, step.device
    decode_reqs = np.flatnonzero(q_lens == 1)
    decode_reqs = decode_reqs[np.argsort(-seq_lens[decode_reqs], kind="stable")]  # longest first
    decodes = []
    for start, end in _length_groups(seq_lens[decode_reqs]):
        reqs = decode_reqs[start:end]
        group_seq = seq_lens[reqs]
        group_blocks = int(-(-group_seq.max() // bs))
        key_pos = np.arange(group_blocks * bs)
        mask = key_pos[None, :] < group_seq[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > (group_seq[:, None] - 1 - sliding_window)
        decodes.append(DecodeGroup(
            torch.from_numpy(step.query_start[reqs].astype(np.int64)).to(device),
            torch.from_numpy(table[reqs, :group_blocks].astype(np.int64).reshape(-1)).to(device),
            torch.from_numpy(mask).view(end - start, 1, 1, -1).to(device)))
    prefills = []
    for i in np.flatnonzero(q_lens > 1):
        seq_len, q_len = int(seq_lens[i]), int(q_lens[i])
        ctx = seq_len - q_len
        mask = None
        if ctx > 0 or (sliding_window is not None and seq_len > sliding_window):
            q_pos = np.arange(ctx, seq_len)[:, None]
            k_pos = np.arange(seq_len)[None, :]
            m = k_pos <= q_pos
            if sliding_window is not None:
                m &= k_pos > q_pos - sliding_window
            mask = torch.from_numpy(m).to(device)
        n_blocks = -(-seq_len // bs)
        start = int(step.query_start[i])
        prefills.append(PrefillSeq(start, start + q_len,
                                   torch.from_numpy(table[i, :n_blocks].astype(np.int64)).to(device), seq_len, mask))
    return AttentionMetadata(step.num_tokens, step.slot_mapping, decodes, prefills)


def build_varlen_attention_metadata(step: StepAttention, sliding_window: int | None) -> AttentionMetadata:
    return AttentionMetadata(step.num_tokens, step.slot_mapping, [], [], build_varlen_metadata(
        step.query_lens, step.seq_lens, step.block_table, step.block_size, step.device, sliding_window))


def _length_groups(seq_lens: np.ndarray, max_waste: float = 0.5, max_groups: int = 4) -> list[tuple[int, int]]:
    """Split rows (sorted by descending length) where padding to the group's longest row would
    waste more than `max_waste` of a row; at most `max_groups` groups."""
    if len(seq_lens) == 0:
        return []
    assert (np.diff(seq_lens) <= 0).all(), "decode rows must be sorted by descending length"
    groups, start = [], 0
    for i in range(1, len(seq_lens)):
        if len(groups) + 1 < max_groups and seq_lens[i] < (1 - max_waste) * seq_lens[start]:
            groups.append((start, i))
            start = i
    groups.append((start, len(seq_lens)))
    return groups
