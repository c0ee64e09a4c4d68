"""Qwen3 dense models: Llama's decoder with an RMSNorm over each query and key head before rope,
no q/k/v bias, an explicit head_dim, and sliding windows only when ``use_sliding_window`` is on
(then for the layers from ``max_window_layers`` up, as transformers has it)."""
from __future__ import annotations

from engine.worker.models.config import ModelConfig, base_config, check_activation, qwen_layer_windows
from engine.worker.models.llama import LlamaForCausalLM

ARCHITECTURES = ("Qwen3ForCausalLM",)
Model = LlamaForCausalLM


def config_from_hf(cfg: dict, arch: str) -> ModelConfig:
    check_activation(cfg, "hidden_act", ("silu",))
    bias = cfg.get("attention_bias", False)
    return base_config(cfg, arch, qkv_bias=bias, o_bias=bias, qk_norm=True, layer_windows=qwen_layer_windows(cfg))
