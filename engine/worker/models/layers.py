"""Layers the model families share: RMSNorm, rotary embeddings, paged attention and the gated MLP,
running on the kernels the runner chose (``Kernels``: an attention backend and its layer ops).

A step's attention inputs travel as two dicts built once per step: ``rope`` maps a rope table's
name ("global", or "local" for Gemma 3's sliding layers) to that step's (cos, signed_sin), and
``metas`` maps a sliding window (None: global) to its AttentionMetadata. Each layer picks its own.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.worker.models.config import ModelConfig
from engine.worker.ops import Kernels


def rope_inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "rope_factors":
        divisors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if divisors.shape != inv_freq.shape:
            raise ValueError(f"rope_factors has {divisors.numel()} entries, the rope {inv_freq.numel()} frequencies")
        return inv_freq / divisors
    factor = scaling["factor"]
    if rope_type == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are scaled by `factor`, short ones kept, the middle band blended.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def rope_inv_freqs(cfg: ModelConfig, device: torch.device | None) -> dict[str, tuple[torch.Tensor, float]]:
    """(inverse frequencies, attention factor) of each rope the layers use: "global" always,
    "local" for the sliding layers of a model that gives them their own base (Gemma 3)."""
    dim = cfg.rotary_dim or cfg.head_dim
    bases = {"global": (cfg.rope_theta, cfg.rope_scaling)}
    if cfg.local_rope_theta is not None:
        bases["local"] = (cfg.local_rope_theta, None)
    return {name: (rope_inv_freq(dim, theta, scaling).to(device), (scaling or {}).get("attention_factor", 1.0))
            for name, (theta, scaling) in bases.items()}


def rope_for_positions(inv_freqs: dict[str, tuple[torch.Tensor, float]], positions: torch.Tensor,
                       dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(cos, signed_sin) of this step's positions for each rope, computed in float32 as the
    reference does (position * inv_freq, one rounding, then cos/sin, times the attention factor
    when the scaling has one) and cast to ``dtype``. Per step rather than a table over every
    position: a 131k-position table of a 256-dim head would hold 256 MiB per rope."""
    out = {}
    for name, (inv_freq, attention_factor) in inv_freqs.items():
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [num_tokens, rotary_dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        out[name] = (torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1),
                     torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(1))
    return out


class RMSNorm(nn.Module):
    """Llama's RMSNorm, or Gemma's (scale by 1 + weight in float32, then cast). ``add_norm``
    first adds x to the residual stream (the decoder's skip connection, fused with the norm)."""
    gemma = False

    def __init__(self, dim: int, eps: float, ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if self.gemma else torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, self.gemma)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the first layer has no residual yet: x is it.
        May overwrite x and residual (the native ops work in place)."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, self.gemma)


class GemmaRMSNorm(RMSNorm):
    """Scales by (1 + weight), in float32, and only then casts back (Llama casts first)."""
    gemma = True


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels, layer_index: int, norm_class=RMSNorm) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps, kernels.ops)
            self.k_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps, kernels.ops)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.softcap = cfg.attn_softcap
        self.window = cfg.layer_windows[layer_index]
        self.rope_key = "local" if cfg.local_rope_theta is not None and self.window is not None else "global"
        self.backend = kernels.attention
        self.ops = kernels.ops

    def forward(self, x: torch.Tensor, rope: dict, kv_cache: torch.Tensor, metas: dict) -> torch.Tensor:
        # x: [num_tokens, hidden]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rope(q, k, *rope[self.rope_key])
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        meta = metas[self.window]  # the attention backend's metadata for this layer's window
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.softcap)  # [tokens, heads, head_dim]
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = cfg.hidden_act
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_and_mul(self.gate_up_proj(x), self.act))
