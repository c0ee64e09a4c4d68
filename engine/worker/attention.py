"""Attention metadata, built once per step, and the Attention layer that consumes it.

Token layout of a step: requests with a single query token (decodes, or a prefill whose
last chunk is one token) come first, one token each; then the multi-token requests, each a
contiguous range. Every request attends to its whole context: the cached tokens plus its
own new ones.

    context:  | ---- num_computed (already in the cache) ---- | -- query (new) -- |
    seq_len = num_computed + query_len
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.worker.backends.varlen import VarlenMetadata, build_varlen_metadata


@dataclass(slots=True)
class DecodeGroup:
    """Single-query rows [start, end) of the step, batched into one attention call. Rows are
    grouped by context length so that padding to the longest stays small."""
    start: int
    end: int
    block_ids: torch.Tensor     # [num_rows * max_blocks] int64, row-major, padded with block 0
    mask: torch.Tensor          # [num_rows, 1, 1, max_blocks * block_size] bool, True = attend


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
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    decodes: list[DecodeGroup]
    prefills: list[PrefillSeq]
    varlen: VarlenMetadata | None = None  # for packed-batch kernels (flash-attn, xformers)


def build_attention_metadata(
    query_lens: list[int],
    num_computed: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    varlen: bool = False,
) -> tuple[AttentionMetadata, np.ndarray]:
    """Metadata and the position of every new token. Requests must be ordered with all
    single-token queries first. ``varlen``: build the packed-batch form instead of the torch
    backend's decode groups and prefill ranges."""
    num_reqs = len(query_lens)
    q_lens = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(num_computed, dtype=np.int64)
    seq_lens = ctx + q_lens
    num_tokens = int(q_lens.sum())

    # Positions and slots of every new token, vectorised over the whole step.
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)
    starts = np.cumsum(q_lens) - q_lens
    positions = np.arange(num_tokens) - np.repeat(starts, q_lens) + np.repeat(ctx, q_lens)
    max_blocks = max((len(b) for b in block_tables), default=0)
    table = np.zeros((num_reqs, max(max_blocks, 1)), dtype=np.int64)
    for i, blocks in enumerate(block_tables):
        # Padding stands in for missing blocks; a short table would write into block 0.
        assert len(blocks) * block_size >= seq_lens[i], "block table does not cover the sequence"
        table[i, :len(blocks)] = blocks
    slots = table[req_of_token, positions // block_size] * block_size + positions % block_size

    slot_mapping = torch.from_numpy(slots).to(device)
    if varlen:
        return AttentionMetadata(num_tokens, slot_mapping, [], [], build_varlen_metadata(
            q_lens, seq_lens, table, block_size, device, sliding_window)), positions
    num_decodes = int(np.searchsorted(q_lens > 1, True)) if num_reqs else 0
    assert (q_lens[:num_decodes] == 1).all() and (q_lens[num_decodes:] > 1).all(), "decodes must come first"
    decodes = []
    for start, end in _length_groups(seq_lens[:num_decodes]):
        group_seq = seq_lens[start:end]
        group_blocks = int(-(-group_seq.max() // block_size))
        key_pos = np.arange(group_blocks * block_size)
        mask = key_pos[None, :] < group_seq[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > (group_seq[:, None] - 1 - sliding_window)
        decodes.append(DecodeGroup(
            start, end,
            torch.from_numpy(table[start:end, :group_blocks].reshape(-1)).to(device),
            torch.from_numpy(mask).view(end - start, 1, 1, -1).to(device)))
    prefills = []
    for i in range(num_decodes, num_reqs):
        seq_len, q_len = int(seq_lens[i]), int(q_lens[i])
        mask = None
        if ctx[i] > 0 or (sliding_window is not None and seq_len > sliding_window):
            q_pos = np.arange(ctx[i], seq_len)[:, None]
            k_pos = np.arange(seq_len)[None, :]
            m = k_pos <= q_pos
            if sliding_window is not None:
                m &= k_pos > q_pos - sliding_window
            mask = torch.from_numpy(m).to(device)
        n_blocks = -(-seq_len // block_size)
        prefills.append(PrefillSeq(int(starts[i]), int(starts[i] + q_len),
                                   torch.tensor(block_tables[i][:n_blocks], dtype=torch.int64, device=device),
                                   seq_len, mask))
    return AttentionMetadata(num_tokens, slot_mapping, decodes, prefills), positions


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
