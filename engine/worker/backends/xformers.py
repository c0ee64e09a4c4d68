"""xformers backend (CUDA): memory-efficient attention over the packed step with a
block-diagonal, bottom-right-causal bias (optionally local for sliding windows). Imported only
when selected."""
from __future__ import annotations

import torch

from engine.worker.attention import AttentionMetadata, build_varlen_attention_metadata
from engine.worker.backends.layout import kv_cache_shape, write_kv
from engine.worker.backends.varlen import gather_kv


class XFormersBackend:
    name = "xformers"

    def __init__(self, block_size: int) -> None:
        from xformers.ops import fmha
        self._fmha = fmha

    kv_cache_shape = staticmethod(kv_cache_shape)
    build_metadata = staticmethod(build_varlen_attention_metadata)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float | None = None) -> torch.Tensor:
        assert softcap is None, "xformers cannot soft-cap attention scores (refused at selection)"
        write_kv(kv_cache, k, v, meta.slot_mapping)
        varlen = meta.varlen
        keys, values = gather_kv(kv_cache[0], kv_cache[1], varlen)
        groups = q.shape[1] // keys.shape[1]
        if groups > 1:  # grouped-query attention: each kv head serves `groups` query heads
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        bias_type = self._fmha.attn_bias
        if varlen.sliding_window:
            bias = bias_type.BlockDiagonalCausalLocalAttentionFromBottomRightMask.from_seqlens(
                varlen.q_lens, kv_seqlen=varlen.seq_lens, window_size=varlen.sliding_window)
        else:
            bias = bias_type.BlockDiagonalCausalFromBottomRightMask.from_seqlens(varlen.q_lens,
                                                                                 kv_seqlen=varlen.seq_lens)
        out = self._fmha.memory_efficient_attention_forward(q[None], keys[None], values[None], attn_bias=bias,
                                                            scale=scale)
        return out[0]
