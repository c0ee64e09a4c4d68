"""Gemma 2 and Gemma 3 text models: Llama's attention and gated MLP (GeLU-tanh) with Gemma's
habits — embeddings scaled by sqrt(hidden), RMSNorm weights stored as (w - 1), a norm after
attention and after the MLP as well as before them, attention scaled by
``query_pre_attn_scalar``, and layers alternating between a sliding window and global attention
(Gemma 2 every other layer, Gemma 3 five sliding to one global). Gemma 2 soft-caps attention
scores and logits with tanh; Gemma 3 instead normalizes each query and key head and gives its
sliding layers their own rope base."""
from __future__ import annotations

import torch
from torch import nn

from engine.worker.models.config import (ModelConfig, base_config, check_activation, rope_settings,
                                         windows_from_layer_types)
from engine.worker.models.layers import MLP, Attention, GemmaRMSNorm
from engine.worker.models.llama import LlamaForCausalLM
from engine.worker.ops import Kernels

# Gemma 3 4B and up ship as image-text models: the text model inside is served, the vision tower
# and projector are not loaded (prompts are text).
ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels, layer_index: int) -> None:
        super().__init__()
        eps, ops = cfg.rms_norm_eps, kernels.ops
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, ops)
        self.self_attn = Attention(cfg, kernels, layer_index, norm_class=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, ops)
        self.mlp = MLP(cfg, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, ops)

    def forward(self, h, residual, rope, kv_cache, metas):
        # As Llama's (h: what the previous layer adds to the residual stream), with a norm
        # after attention and after the MLP as well as before them.
        x, residual = self.input_layernorm.add_norm(h, residual)
        attention = self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, metas))
        x, residual = self.pre_feedforward_layernorm.add_norm(attention, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        # The normalizer is rounded to the model's dtype first, as in transformers.
        return h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                return name.removeprefix(prefix)
        return name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


Model = GemmaForCausalLM


def config_from_hf(cfg: dict, arch: str) -> ModelConfig:
    if arch == "Gemma3ForConditionalGeneration":
        # The text model's settings. Published configs list only what differs from
        # Gemma3TextConfig's defaults (4B: sizes, layer count, rope scaling, window; not even the
        # head count or vocabulary), so the defaults come from transformers' own class. Its output
        # is tied to the embedding unless the outer config says not.
        from transformers import Gemma3TextConfig
        text = {k: v for k, v in (cfg.get("text_config") or {}).items() if k not in ("model_type", "architectures")}
        cfg = {**Gemma3TextConfig(**text).to_dict(), "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
        arch = "Gemma3ForCausalLM"
    act = check_activation(cfg, "hidden_activation", ("gelu_pytorch_tanh",))
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not a causal LM")
    layers = cfg["num_hidden_layers"]
    gemma3 = arch == "Gemma3ForCausalLM"
    pattern = cfg.get("sliding_window_pattern", 6 if gemma3 else 2)
    default_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    windows = windows_from_layer_types(cfg, cfg.get("sliding_window", 4096), default_types)
    family = dict(hidden_act=act, tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                  attn_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5, layer_windows=windows,
                  attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"))
    if gemma3:
        # Global layers: rope_theta (with any scaling); sliding ones: their own base, unscaled.
        per_type = cfg.get("rope_parameters") or {}
        if "full_attention" in per_type:
            full, local = per_type["full_attention"], per_type.get("sliding_attention") or {}
            family["rope"] = rope_settings({"rope_parameters": full})
            if rope_settings({"rope_parameters": local})[1] is not None:
                raise ValueError("unsupported rope scaling on Gemma 3's sliding layers (no released model has it)")
            family["local_rope_theta"] = float(local.get("rope_theta", 10_000.0))
        else:
            family["rope"] = rope_settings({"rope_theta": cfg.get("rope_theta", 1_000_000.0),
                                            "rope_scaling": cfg.get("rope_scaling")})
            family["local_rope_theta"] = float(cfg.get("rope_local_base_freq", 10_000.0))
        family["qk_norm"] = True
    return base_config(cfg, arch, **family)
