"""Model families, one file each, and the table that picks one by a checkpoint's architecture.
A family file has ``ARCHITECTURES``, ``config_from_hf(cfg, arch)`` and its ``Model`` class."""
from __future__ import annotations

from engine.worker.models import gemma, llama, phi3, qwen3
from engine.worker.models.config import ModelConfig

_FAMILIES = {arch: family for family in (llama, qwen3, gemma, phi3) for arch in family.ARCHITECTURES}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)


def model_config_from_hf(cfg: dict) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in _FAMILIES), None)
    if arch is None:
        raise ValueError(f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return _FAMILIES[arch].config_from_hf(cfg, arch)


def model_class(cfg: ModelConfig):
    return _FAMILIES[cfg.architecture].Model


__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "model_class", "model_config_from_hf"]
