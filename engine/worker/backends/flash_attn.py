"""flash-attn backend (CUDA, fp16/bf16): one ``flash_attn_varlen_func`` call per layer over the
packed step, on contexts gathered from the paged cache (flash-attn 2's own paged-KV path needs
blocks of 256 tokens; the engine's are 16). Imported only when selected."""
from __future__ import annotations

import torch

from engine.worker.attention import AttentionMetadata, build_varlen_attention_metadata
from engine.worker.backends.layout import kv_cache_shape, write_kv
from engine.worker.backends.varlen import gather_kv


class FlashAttnBackend:
    name = "flash_attn"

    def __init__(self, block_size: int) -> None:
        from flash_attn import flash_attn_varlen_func
        self._varlen = flash_attn_varlen_func

    kv_cache_shape = staticmethod(kv_cache_shape)
    build_metadata = staticmethod(build_varlen_attention_metadata)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float | None = None) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        write_kv(kv_cache, k, v, meta.slot_mapping)
        varlen = meta.varlen
        window = (varlen.sliding_window - 1, 0) if varlen.sliding_window else (-1, -1)
        keys, values = gather_kv(kv_cache[0], kv_cache[1], varlen)
        extra = {} if softcap is None else {"softcap": softcap}  # flash-attn >= 2.6 only; passed when used
        return self._varlen(q, keys, values, varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.max_seqlen_q,
                            varlen.max_seqlen_k, softmax_scale=scale, causal=True, window_size=window, **extra)
