"""Phi-3 (and Phi-3.5/Phi-4-mini with their default rope): Llama's decoder, with checkpoints that
already fuse q/k/v and gate/up (the names the engine's own layers have), an optional sliding
window for every layer, and partial rotary embeddings (``partial_rotary_factor``). LongRoPE
checkpoints (the 128k variants) are refused: transformers switches their whole sequence to the
long factors once it passes the original length, which would change the KV of cached prefixes."""
from __future__ import annotations

from engine.worker.models.config import ModelConfig, base_config, check_activation, rope_settings
from engine.worker.models.llama import LlamaForCausalLM

ARCHITECTURES = ("Phi3ForCausalLM",)
Model = LlamaForCausalLM


def config_from_hf(cfg: dict, arch: str) -> ModelConfig:
    check_activation(cfg, "hidden_act", ("silu",))
    rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su", "yarn"):
        raise ValueError("unsupported rope scaling 'longrope' (Phi-3 128k variants); "
                         "the 4k variants (default rope) are supported")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    window = cfg.get("sliding_window")
    return base_config(cfg, arch, rope=rope_settings(cfg), rotary_dim=int(head_dim * factor),
                       qkv_bias=cfg.get("attention_bias", False), o_bias=cfg.get("attention_bias", False),
                       layer_windows=(window,) * cfg["num_hidden_layers"])
