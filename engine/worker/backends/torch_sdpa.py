"""Reference paged attention on torch's scaled_dot_product_attention. Runs on CPU and CUDA."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.worker.attention import AttentionMetadata
from engine.worker.backends.layout import kv_cache_shape, write_kv


class TorchSDPABackend:
    name = "torch"
    needs_varlen = False  # consumes the decode groups and prefill ranges of AttentionMetadata

    kv_cache_shape = staticmethod(kv_cache_shape)

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
        write_kv(kv_cache, k, v, meta.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        out = torch.empty_like(q)
        gqa = q.shape[1] != num_kv_heads

        for d in meta.decodes:
            rows = d.end - d.start
            # index_select on the flat block list is ~2x faster than advanced indexing.
            keys = k_cache.index_select(0, d.block_ids).view(rows, -1, num_kv_heads, head_dim).transpose(1, 2)
            values = v_cache.index_select(0, d.block_ids).view(rows, -1, num_kv_heads, head_dim).transpose(1, 2)
            query = q[d.start:d.end].unsqueeze(2)  # [rows, num_heads, 1, head_dim]
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=d.mask, scale=scale, enable_gqa=gqa)
            out[d.start:d.end] = o.squeeze(2)

        for p in meta.prefills:
            keys = k_cache.index_select(0, p.block_ids).flatten(0, 1)[:p.seq_len].transpose(0, 1)
            values = v_cache.index_select(0, p.block_ids).flatten(0, 1)[:p.seq_len].transpose(0, 1)
            query = q[p.query_start:p.query_end].transpose(0, 1)  # [num_heads, query_len, head_dim]
            o = F.scaled_dot_product_attention(query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                               attn_mask=p.mask, is_causal=p.mask is None, scale=scale,
                                               enable_gqa=gqa)
            out[p.query_start:p.query_end] = o[0].transpose(0, 1)
        return out
