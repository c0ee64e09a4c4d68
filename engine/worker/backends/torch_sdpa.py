"""Reference paged attention on torch's scaled_dot_product_attention. Runs on CPU and CUDA."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.worker.attention import AttentionMetadata, build_torch_metadata
from engine.worker.backends.layout import kv_cache_shape, write_kv


class TorchSDPABackend:
    name = "torch"

    kv_cache_shape = staticmethod(kv_cache_shape)
    build_metadata = staticmethod(build_torch_metadata)  # decode groups and prefill ranges

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float | None = None) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
        write_kv(kv_cache, k, v, meta.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        out = torch.empty_like(q)
        gqa = q.shape[1] != num_kv_heads

        for d in meta.decodes:
            rows = len(d.rows)
            # index_select on the flat block list is ~2x faster than advanced indexing.
            keys = k_cache.index_select(0, d.block_ids).view(rows, -1, num_kv_heads, head_dim).transpose(1, 2)
            values = v_cache.index_select(0, d.block_ids).view(rows, -1, num_kv_heads, head_dim).transpose(1, 2)
            query = q.index_select(0, d.rows).unsqueeze(2)  # [rows, num_heads, 1, head_dim]
            o = _attend(query, keys, values, d.mask, scale, gqa, softcap)
            out.index_copy_(0, d.rows, o.squeeze(2))

        for p in meta.prefills:
            keys = k_cache.index_select(0, p.block_ids).flatten(0, 1)[:p.seq_len].transpose(0, 1)
            values = v_cache.index_select(0, p.block_ids).flatten(0, 1)[:p.seq_len].transpose(0, 1)
            query = q[p.query_start:p.query_end].transpose(0, 1)  # [num_heads, query_len, head_dim]
            mask = p.mask
            if mask is None and softcap is not None:
                mask = torch.ones(p.seq_len, p.seq_len, dtype=torch.bool, device=q.device).tril()
            o = _attend(query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), mask, scale, gqa, softcap)
            out[p.query_start:p.query_end] = o[0].transpose(0, 1)
        return out


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            scale: float, gqa: bool, softcap: float | None) -> torch.Tensor:
    """SDPA (``mask`` None: causal); with ``softcap``, scores go through cap * tanh(s / cap)
    before the mask, which SDPA cannot do, so this computes them as transformers' eager path."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=gqa)
    if gqa:  # [batch, kv_heads, len, dim] -> one kv head per query head
        groups = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    # In place after the matmul: one [heads, queries, keys] buffer plus softmax's float32 one.
    scores = torch.matmul(query, keys.transpose(-1, -2)).mul_(scale)
    scores.div_(softcap).tanh_().mul_(softcap).masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), values)
