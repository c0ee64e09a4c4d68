"""Layers the model families share: RMSNorm, rotary embeddings, paged attention and the gated MLP.

A step's attention inputs travel as two dicts built once per step: ``rope`` maps a rope table's
name ("global", or "local" for Gemma 3's sliding layers) to that step's (cos, signed_sin), and
``metas`` maps a sliding window (None: global) to its AttentionMetadata. Each layer picks its own.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.attention import AttentionMetadata
from engine.worker.models.config import ModelConfig

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit, in three kernels instead of six:
    rotate_half(x) = cat(-x2, x1) = roll(x, half) with the sign folded into ``signed_sin``
    (= cat(-sin1, sin2), from rope_for_positions). With partial rotary, only the first cos.shape[-1]
    dims of each head turn."""
    # x: [num_tokens, heads, head_dim]; cos, signed_sin: [num_tokens, 1, rotary_dim]
    dim = cos.shape[-1]
    if dim != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :dim], cos, signed_sin), x[..., dim:]), dim=-1)
    return x * cos + x.roll(dim // 2, dims=-1) * signed_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, layer_index: int, norm_class=RMSNorm) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.softcap = cfg.attn_softcap
        self.window = cfg.layer_windows[layer_index]
        self.rope_key = "local" if cfg.local_rope_theta is not None and self.window is not None else "global"
        self.backend = backend

    def forward(self, x: torch.Tensor, rope: dict, kv_cache: torch.Tensor, metas: dict) -> torch.Tensor:
        # x: [num_tokens, hidden]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope[self.rope_key]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        meta: AttentionMetadata = metas[self.window]
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.softcap)  # [tokens, heads, head_dim]
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
