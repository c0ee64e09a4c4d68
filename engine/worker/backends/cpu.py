"""The native CPU backend: csrc/cpu's paged attention, which reads each request's K/V through
its block table where they lie (no gather, no padding, no masks), for a whole mixed step in one
call per layer. fp32, bf16 and fp16; head sizes 16, 32, 64, 96, 128, 256; sliding windows,
soft-capping, GQA. Selected by ``auto`` on a CPU where engine/worker/native.py loads a build."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.worker.attention import StepAttention
from engine.worker.backends.layout import kv_cache_shape

HEAD_DIMS = (16, 32, 64, 96, 128, 256)


@dataclass(slots=True)
class NativeMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start: torch.Tensor   # [num_reqs + 1] int32
    seq_lens: torch.Tensor      # [num_reqs] int32
    block_table: torch.Tensor   # [num_reqs, max_blocks] int32
    window: int                 # 0: global attention


class CpuNativeBackend:
    name = "cpu"

    def __init__(self, kernels) -> None:
        self.k = kernels  # torch.ops.engine_<isa>

    kv_cache_shape = staticmethod(kv_cache_shape)

    @staticmethod
    def build_metadata(step: StepAttention, sliding_window: int | None) -> NativeMetadata:
        # Views of the step's arrays, no copies: the kernel reads them as they are.
        return NativeMetadata(step.slot_mapping, torch.from_numpy(step.query_start), torch.from_numpy(step.seq_lens),
                              torch.from_numpy(step.block_table), sliding_window or 0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: NativeMetadata, scale: float, softcap: float | None = None) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.k.reshape_and_cache(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype)
        self.k.paged_attention(out, q, kv_cache[0], kv_cache[1], meta.block_table, meta.query_start, meta.seq_lens,
                               scale, softcap or 0.0, meta.window)
        return out
