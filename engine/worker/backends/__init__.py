"""Attention backends behind one interface: ``kv_cache_shape`` and ``forward(q, k, v, kv_cache,
meta, scale)``. ``torch`` (SDPA, CPU and CUDA) is always there; ``flash_attn`` and ``xformers``
are CUDA-only extras (``pip install -e .[cuda]``) and are imported only when selected.
All of them use one KV layout, so KV moves between them without conversion."""
from __future__ import annotations

import importlib.util
import logging

import torch

from engine.worker.backends.layout import KV_LAYOUT  # noqa: F401  (re-exported: the fingerprint's layout)

logger = logging.getLogger("engine.worker")
AUTO_ORDER = ("flash_attn", "xformers", "torch")  # fastest first


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                       softcap: float | None = None) -> str | None:
    """Why backend ``name`` cannot run here, or None if it can."""
    if name == "torch":
        return None
    if name not in AUTO_ORDER:
        return f"unknown attention backend {name!r}; choose from auto, {', '.join(AUTO_ORDER)}"
    if device.type != "cuda":
        return f"{name} needs a CUDA device (this engine runs on {device.type})"
    if importlib.util.find_spec(name) is None:
        return f"{name} is not installed (pip install -e .[cuda])"
    if name == "flash_attn" and dtype not in (torch.float16, torch.bfloat16):
        return f"flash_attn needs float16 or bfloat16, not {dtype}"
    if name == "xformers" and softcap is not None:
        return "xformers cannot soft-cap attention scores (Gemma 2)"
    if name == "flash_attn" and head_dim > 256:
        return f"flash_attn supports head_dim up to 256, not {head_dim}"
    return None


def select_backend(name: str, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int,
                   softcap: float | None = None):
    """The backend instance for ``--attention-backend name`` (``auto``: the fastest that can run)."""
    if name == "auto":
        name = next(n for n in AUTO_ORDER if unavailable_reason(n, device, dtype, head_dim, softcap) is None)
        logger.info("attention backend: %s (auto, %s %s)", name, device.type, str(dtype).removeprefix("torch."))
    else:
        reason = unavailable_reason(name, device, dtype, head_dim, softcap)
        if reason is not None:
            raise ValueError(f"--attention-backend {name}: {reason}")
    if name == "flash_attn":
        from engine.worker.backends.flash_attn import FlashAttnBackend
        return FlashAttnBackend(block_size)
    if name == "xformers":
        from engine.worker.backends.xformers import XFormersBackend
        return XFormersBackend(block_size)
    from engine.worker.backends.torch_sdpa import TorchSDPABackend
    return TorchSDPABackend()
