"""The one paged KV layout every attention backend uses, and the write of a step's new K/V into it.

Per layer: [K/V, num_blocks, block_size, num_kv_heads, head_dim] — also flash-attn's paged
layout per K and V — so KV moves between backends, peers and stores without conversion.
"""
from __future__ import annotations

import torch

KV_LAYOUT = "[L,2,N,bs,H,D]"  # [layers, K/V, blocks, block_size, kv heads, head dim]


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's new keys and values ([num_tokens, num_kv_heads, head_dim]) in their slots."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
