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


@dataclass(slots=True)
class DecodeBatch:
    """The first ``num_decodes`` tokens: one query token per request, batched together."""
    num_decodes: int
    block_table: torch.Tensor   # [num_decodes, max_blocks] int64, padded with block 0
    seq_lens: torch.Tensor      # [num_decodes] int64
    mask: torch.Tensor          # [num_decodes, 1, 1, max_blocks * block_size] bool, True = attend


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
    decode: DecodeBatch | None
    prefills: list[PrefillSeq]


def build_attention_metadata(
    query_lens: list[int],
    num_computed: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> tuple[AttentionMetadata, np.ndarray]:
    """Metadata and the position of every new token. Requests must be ordered with all
    single-token queries first."""
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

    num_decodes = int(np.searchsorted(q_lens > 1, True)) if num_reqs else 0
    assert (q_lens[:num_decodes] == 1).all() and (q_lens[num_decodes:] > 1).all(), "decodes must come first"
    decode = None
    if num_decodes:
        dec_seq = seq_lens[:num_decodes]
        dec_blocks = int(-(-dec_seq.max() // block_size))
        key_pos = np.arange(dec_blocks * block_size)
        mask = key_pos[None, :] < dec_seq[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > (dec_seq[:, None] - 1 - sliding_window)
        decode = DecodeBatch(
            num_decodes,
            torch.from_numpy(table[:num_decodes, :dec_blocks].copy()).to(device),
            torch.from_numpy(dec_seq.copy()).to(device),
            torch.from_numpy(mask).view(num_decodes, 1, 1, -1).to(device),
        )
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
    return AttentionMetadata(num_tokens, torch.from_numpy(slots).to(device), decode, prefills), positions
