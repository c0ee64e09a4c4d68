"""Qwen3 dense models: Llama's decoder with an RMSNorm over each query and key head before rope,
no q/k/v bias, an explicit head_dim, and sliding windows only when ``use_sliding_window`` is on
(then for the layers from ``max_window_layers`` up, as transformers has it)."""
from __future__ import annotations

from engine.worker.models.config import ModelConfig, base_config, check_activation, windows_from_layer_types
from engine.worker.models.llama import LlamaForCausalLM

ARCHITECTURES = ("Qwen3ForCausalLM",)
Model = LlamaForCausalLM


def config_from_hf(cfg: dict, arch: str) -> ModelConfig:
    check_activation(cfg, "hidden_act", ("silu",))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    first_sliding = cfg.get("max_window_layers", cfg["num_hidden_layers"])
    default = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
               for i in range(cfg["num_hidden_layers"])]
    bias = cfg.get("attention_bias", False)
    return base_config(cfg, arch, qkv_bias=bias, o_bias=bias, qk_norm=True,
                       layer_windows=windows_from_layer_types(cfg, window, default) if window else
                       (None,) * cfg["num_hidden_layers"])
