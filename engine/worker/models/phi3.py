"""Phi-3, Phi-3.5 and Phi-4-mini: Llama's decoder, with checkpoints that already fuse q/k/v and
gate/up (the names the engine's own layers have), an optional sliding window for every layer,
partial rotary embeddings (``partial_rotary_factor``), and LongRoPE served up to the original
context (see _short_longrope)."""
from __future__ import annotations

import math

from engine.worker.models.config import ModelConfig, base_config, check_activation, rope_settings
from engine.worker.models.llama import LlamaForCausalLM

ARCHITECTURES = ("Phi3ForCausalLM",)
Model = LlamaForCausalLM


def config_from_hf(cfg: dict, arch: str) -> ModelConfig:
    check_activation(cfg, "hidden_act", ("silu",))
    rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    window = cfg.get("sliding_window")
    family = dict(rotary_dim=int(head_dim * factor), qkv_bias=cfg.get("attention_bias", False),
                  o_bias=cfg.get("attention_bias", False), layer_windows=(window,) * cfg["num_hidden_layers"])
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
        family.update(_short_longrope(cfg, rope))
    else:
        family["rope"] = rope_settings(cfg)
    return base_config(cfg, arch, **family)


def _short_longrope(cfg: dict, rope: dict) -> dict:
    """LongRoPE (Phi-3.5-mini, Phi-4-mini, Phi-3 128k) served up to its original context, where
    transformers uses the short factors at every position: the context is capped there, so no
    sequence ever reaches the long factors (which transformers would apply to the whole sequence,
    cached prefix included, once it grew past that length)."""
    original = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    if not original:
        raise ValueError("longrope without original_max_position_embeddings")
    factor = rope.get("factor") or cfg.get("max_position_embeddings", original) / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = {"rope_type": "rope_factors", "factors": [float(x) for x in rope["short_factor"]],
               "attention_factor": float(attention_factor)}
    return {"rope": (theta, scaling), "max_position_embeddings": int(original)}
