"""Variable-length ("varlen") attention metadata, for kernels that take every request of a step
as one packed batch: flash-attn's ``flash_attn_varlen_func`` and xformers' block-diagonal
biases. Built once per step on the CPU, next to the torch backend's metadata.

Requests are packed in step order. Request i has ``q_lens[i]`` new tokens and attends to its
whole context of ``seq_lens[i]`` tokens (cached + new), causally aligned at the bottom right:
its j-th new token sees context positions ``[0, seq_lens[i] - q_lens[i] + j]`` (and, with a
sliding window W, only the last W of those).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class VarlenMetadata:
    q_lens: list[int]
    seq_lens: list[int]
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32: where each request's queries start
    cu_seqlens_k: torch.Tensor  # [num_reqs + 1] int32: where each request's context starts in kv_slots
    max_seqlen_q: int
    max_seqlen_k: int
    kv_slots: torch.Tensor      # [sum(seq_lens)] int64: cache slot of every context token, packed
    block_table: torch.Tensor   # [num_reqs, max_blocks] int32, padded with 0 (paged kernels)
    sliding_window: int | None


def build_varlen_metadata(q_lens: np.ndarray, seq_lens: np.ndarray, table: np.ndarray, block_size: int,
                          device: torch.device, sliding_window: int | None) -> VarlenMetadata:
    """``table``: [num_reqs, max_blocks] block ids (padded), as build_attention_metadata makes it."""
    num_reqs = len(q_lens)
    cu_q = np.zeros(num_reqs + 1, dtype=np.int32)
    cu_k = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu_q[1:])
    np.cumsum(seq_lens, out=cu_k[1:])
    # Every context position of every request, then its slot through the block table.
    req = np.repeat(np.arange(num_reqs), seq_lens)
    pos = np.arange(int(cu_k[-1])) - np.repeat(cu_k[:-1], seq_lens)
    slots = table[req, pos // block_size] * block_size + pos % block_size
    return VarlenMetadata(
        [int(x) for x in q_lens], [int(x) for x in seq_lens],
        torch.from_numpy(cu_q).to(device), torch.from_numpy(cu_k).to(device),
        int(q_lens.max(initial=0)), int(seq_lens.max(initial=0)),
        torch.from_numpy(slots.astype(np.int64)).to(device),
        torch.from_numpy(table.astype(np.int32)).to(device), sliding_window)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: VarlenMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed contexts: [sum(seq_lens), num_kv_heads, head_dim] each, from the paged caches
    ([num_blocks, block_size, num_kv_heads, head_dim])."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    keys = k_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, meta.kv_slots)
    values = v_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, meta.kv_slots)
    return keys, values


def reference_varlen_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: VarlenMetadata,
                               scale: float) -> torch.Tensor:
    """What flash_attn_varlen_func(causal=True, window_size=(W - 1, 0)) computes, in plain torch:
    the CPU check that the varlen metadata is right. q: [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != keys.shape[1]
    cu_q, cu_k = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_k.tolist()
    for i, (q_len, seq_len) in enumerate(zip(meta.q_lens, meta.seq_lens)):
        qi = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)            # [heads, q_len, dim]
        ki = keys[cu_k[i]:cu_k[i + 1]].transpose(0, 1)         # [kv_heads, seq_len, dim]
        vi = values[cu_k[i]:cu_k[i + 1]].transpose(0, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if meta.sliding_window is not None:
            mask &= k_pos > q_pos - meta.sliding_window
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[cu_q[i]:cu_q[i + 1]] = o.transpose(0, 1)
    return out
