"""Llama family: Llama 2/3.x (llama3 rope scaling), Mistral (sliding window), Qwen2 (q/k/v bias),
SmolLM2 and TinyLlama. Tied embeddings and grouped-query attention. The decoder here is also
Qwen3's and Phi-3's (their files say how their configs differ); Gemma subclasses it.
Reads top to bottom."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from engine.worker.models.config import ModelConfig, base_config, check_activation, qwen_layer_windows
from engine.worker.models.layers import MLP, Attention, RMSNorm, rope_for_positions, rope_inv_freqs
from engine.worker.ops import Kernels
from engine.worker.quantized import TYPE_NAMES, quantize

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def config_from_hf(cfg: dict, arch: str) -> ModelConfig:
    check_activation(cfg, "hidden_act", ("silu",))
    layers = cfg["num_hidden_layers"]
    windows = (cfg.get("sliding_window"),) * layers
    if arch == "Qwen2ForCausalLM":  # a window only with use_sliding_window, from max_window_layers up
        windows = qwen_layer_windows(cfg)
    attention_bias = cfg.get("attention_bias", False)
    return base_config(cfg, arch, qkv_bias=attention_bias or arch == "Qwen2ForCausalLM", o_bias=attention_bias,
                       mlp_bias=cfg.get("mlp_bias", False), layer_windows=windows)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.ops)
        self.self_attn = Attention(cfg, kernels, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.ops)
        self.mlp = MLP(cfg, kernels.ops)

    def forward(self, h, residual, rope, kv_cache, metas):
        # h: what the previous layer adds to the residual stream (the embeddings, first);
        # returns what this one adds, and the stream so far.
        x, residual = self.input_layernorm.add_norm(h, residual)
        x, residual = self.post_attention_layernorm.add_norm(self.self_attn(x, rope, kv_cache, metas), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    layer_class = DecoderLayer
    norm_class = RMSNorm
    quantize_at_load = False  # --quantization int4/int8: float weights are quantized as they load
    fused = None  # a FusedDecoder (engine/worker/fused_decoder.py) that runs self.layers in one call

    def __init__(self, cfg: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.config = cfg
        # Built on the meta device and then loaded (ModelRunner), so nothing here computes: on
        # meta tensors torch runs its Python reference kernels, whose first call imports
        # torch._dynamo (seconds). Hence no random init of the embedding, and the rope tables
        # come from init_rope(device), called once the model has left the meta device.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.layer_class(cfg, kernels, i) for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, kernels.ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_rope(self, device: torch.device | None = None) -> None:
        self.rope_inv_freqs = rope_inv_freqs(self.config, device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                metas: dict) -> torch.Tensor:
        # input_ids, positions: [num_tokens]; kv_caches: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        # metas: the attention backend's metadata for each sliding window (None: global) the layers use.
        h = self.embed(input_ids)
        rope = rope_for_positions(self.rope_inv_freqs, positions, h.dtype)
        if self.fused is not None:
            h, residual = self.fused(h, rope, kv_caches, metas)
        else:
            residual = None
            for i, layer in enumerate(self.layers):
                h, residual = layer(h, residual, rope, kv_caches[i], metas)
        return self.norm.add_norm(h, residual)[0]  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [num_rows, vocab], in the model's dtype (the sampler widens what it must)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A checkpoint tensor's name in this module, or None for one the engine does not use."""
        return None if "rotary_emb" in name else name.removeprefix("model.")

    def param_slot(self, name: str) -> tuple[str, int | None, int | None]:
        """Where a checkpoint tensor goes: (parameter name, first row, rows), the rows for the
        parts of a fused projection (q/k/v into qkv_proj, gate/up into gate_up_proj), else None."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        fused = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
                 "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter)}
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in fused:
                target, start, size = fused[part]
                return ".".join(parts[:i] + [target] + parts[i + 1:]), start, size
        return name, None, None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors, packing q/k/v and gate/up into their fused projections. A float
        tensor bound for a quantized module is quantized to its block type on the way."""
        cfg = self.config
        params = dict(self.named_parameters())
        block_types = {f"{name}.weight": m.qtype for name, m in self.named_modules() if hasattr(m, "qtype")}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name is None or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, start, size = self.param_slot(name)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            if target in block_types and tensor.is_floating_point():
                if not self.quantize_at_load:  # a .gguf's manifest says blocks: its file must hold them
                    raise ValueError(f"weight {name!r} is {tensor.dtype}, but it should be stored as "
                                     f"{TYPE_NAMES[block_types[target]]} blocks")
                tensor = quantize(tensor, block_types[target])
            dest = params[target] if start is None else params[target].narrow(0, start, size)
            if dest.shape != tensor.shape or (dest.dtype == torch.uint8) != (tensor.dtype == torch.uint8):
                raise ValueError(f"weight {name!r} is {tensor.dtype} {tuple(tensor.shape)}, expected "
                                 f"{dest.dtype} {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(target if start is None else f"{target}[{start}]")
        expected = {n for n in params if n not in ("lm_head.weight",) or not cfg.tie_word_embeddings}
        missing = {n for n in expected if n not in loaded and not any(k.startswith(n + "[") for k in loaded)}
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")


Model = LlamaForCausalLM
