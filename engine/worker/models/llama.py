"""Llama family: Llama 2/3.x (llama3 rope scaling), Mistral (sliding window), Qwen2 (q/k/v bias),
SmolLM2 and TinyLlama. Tied embeddings and grouped-query attention. Reads top to bottom."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.attention import AttentionMetadata

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu is supported")
        # transformers >= 5 nests rope settings under rope_parameters.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or rope
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: default, linear, llama3")
        num_heads = cfg["num_attention_heads"]
        sliding = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding = None
        attention_bias = cfg.get("attention_bias", False)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling if rope_type != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_bias=attention_bias,
            mlp_bias=cfg.get("mlp_bias", False),
            sliding_window=sliding,
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit, in three kernels instead of six:
    rotate_half(x) = cat(-x2, x1) = roll(x, half) with the sign folded into ``signed_sin``
    (= cat(-sin1, sin2), from init_rope_tables)."""
    # x: [num_tokens, heads, head_dim]; cos, signed_sin: [num_tokens, 1, head_dim]
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


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
    def __init__(self, cfg: ModelConfig, backend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim ** -0.5
        self.backend = backend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [num_tokens, hidden]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, kv_cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend) -> None:
        super().__init__()
        self.config = cfg
        # Built on the meta device and then loaded (ModelRunner), so nothing here computes: on
        # meta tensors torch runs its Python reference kernels, whose first call imports
        # torch._dynamo (seconds). Hence no random init of the embedding, and the rope tables
        # come from init_rope_tables(device), called once the model has left the meta device.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_rope_tables(self, device: torch.device | None = None) -> None:
        """cos/sin for every position, kept in float32 like the reference implementation."""
        cfg = self.config
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, rope_inv_freq(cfg).to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_signed_sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: [num_tokens]; kv_caches: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        h = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(h.dtype).unsqueeze(1)
        sin = self.rope_signed_sin[positions].to(h.dtype).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_caches[i], meta)
        return self.norm(h)  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [num_rows, vocab]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors, packing q/k/v and gate/up into their fused projections."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        packed = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
                  "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter)}
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            parts = name.split(".")
            target, start, size = name, None, None
            for i, part in enumerate(parts):
                if part in packed:
                    fused, start, size = packed[part]
                    target = ".".join(parts[:i] + [fused] + parts[i + 1:])
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            dest = params[target] if start is None else params[target].narrow(0, start, size)
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(target if start is None else f"{target}[{start}]")
        expected = {n for n in params if n not in ("lm_head.weight",) or not cfg.tie_word_embeddings}
        missing = {n for n in expected if n not in loaded and not any(k.startswith(n + "[") for k in loaded)}
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
