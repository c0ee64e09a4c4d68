"""Attention backends behind one interface: ``kv_cache_shape``, ``build_metadata(step, window)``
(once per step and window) and ``forward(q, k, v, kv_cache, meta, scale, softcap)``. ``cpu`` is
the native kernel (csrc/cpu, where engine/worker/native.py loads a build); ``torch`` (SDPA, CPU
and CUDA) is always there, the reference and the fallback; ``flash_attn`` and ``xformers`` are
CUDA-only extras (``pip install -e .[cuda]``) and are imported only when selected.
All of them use one KV layout, so KV moves between them without conversion."""
from __future__ import annotations

import importlib.util
import logging

import torch

from engine.worker import native
from engine.worker.backends.layout import KV_LAYOUT  # noqa: F401  (re-exported: the fingerprint's layout)
from engine.worker.ops import Kernels, NativeOps, TorchOps

logger = logging.getLogger("engine.worker")
AUTO_ORDER = ("flash_attn", "xformers", "cpu", "torch")  # fastest first
CPU_HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # what csrc/cpu's attention is built for


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                       softcap: float | None = None) -> str | None:
    """Why backend ``name`` cannot run here, or None if it can."""
    if name == "torch":
        return None
    if name not in AUTO_ORDER:
        return f"unknown attention backend {name!r}; choose from auto, {', '.join(AUTO_ORDER)}"
    if name == "cpu":
        if device.type != "cpu":
            return f"cpu runs on the CPU (this engine runs on {device.type})"
        if head_dim not in CPU_HEAD_DIMS:
            return f"cpu supports head_dim {', '.join(map(str, CPU_HEAD_DIMS))}, not {head_dim}"
        reason = native.unavailable_reason()
        return None if reason is None else f"the native CPU kernels cannot run: {reason}"
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
        if device.type == "cpu" and name == "torch":
            logger.warning("attention backend: torch, because %s", unavailable_reason("cpu", device, dtype, head_dim))
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
    if name == "cpu":
        from engine.worker.backends.cpu import CpuNativeBackend
        return CpuNativeBackend(native.ops())
    from engine.worker.backends.torch_sdpa import TorchSDPABackend
    return TorchSDPABackend()


def select_kernels(name: str, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int,
                   softcap: float | None = None) -> Kernels:
    """The attention backend for ``--attention-backend name`` and the layer ops that go with it:
    csrc/cpu's fused ones with the native backend, torch's with every other (``torch`` is the
    pure-torch reference path, end to end)."""
    backend = select_backend(name, device, dtype, block_size, head_dim, softcap)
    return Kernels(backend, NativeOps(native.ops()) if backend.name == "cpu" else TorchOps())
