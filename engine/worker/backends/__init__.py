"""Attention backends behind one interface: ``kv_cache_shape``, ``build_metadata(step, window)``
(once per step and window) and ``forward(q, k, v, kv_cache, meta, scale, softcap)``. ``cpu`` is
the native kernel (csrc/cpu, where engine/worker/native.py loads a build); ``torch`` (SDPA, CPU
and CUDA) is always there, the reference and the fallback; ``triton`` is paged attention in
place on CUDA (Triton ships with every CUDA torch; on CPU only under Triton's interpreter, for
tests); ``flash_attn`` and ``xformers`` are CUDA-only extras (``pip install -e .[cuda]``),
imported only when selected. Every backend but torch must pass a probe at start (probe.py): a
small paged step against the torch reference, on this device, dtype and head shape.
All of them use one KV layout, so KV moves between them without conversion."""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

from engine.worker import native
from engine.worker.backends.layout import KV_LAYOUT  # noqa: F401  (re-exported: the fingerprint's layout)
from engine.worker.backends.probe import probe_failure
from engine.worker.ops import Kernels, NativeOps, TorchOps

logger = logging.getLogger("engine.worker")
BACKENDS = ("triton", "flash_attn", "xformers", "cpu", "torch")
AUTO_ORDER = {"cuda": ("triton", "flash_attn", "xformers", "torch"),  # first that passes its probe
              "cpu": ("cpu", "torch")}
CPU_HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # what csrc/cpu's attention is built for


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                       softcap: float | None = None) -> str | None:
    """Why backend ``name`` cannot run here (before any probe), or None if it may."""
    if name == "torch":
        return None
    if name not in BACKENDS:
        return f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}"
    if name == "cpu":
        if device.type != "cpu":
            return f"cpu runs on the CPU (this engine runs on {device.type})"
        if head_dim not in CPU_HEAD_DIMS:
            return f"cpu supports head_dim {', '.join(map(str, CPU_HEAD_DIMS))}, not {head_dim}"
        reason = native.unavailable_reason()
        return None if reason is None else f"the native CPU kernels cannot run: {reason}"
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (it ships with CUDA builds of torch)"
        if device.type != "cuda" and not (device.type == "cpu" and _interpreted()):
            return f"triton needs a CUDA device (this engine runs on {device.type}; TRITON_INTERPRET=1 for tests)"
        if head_dim > 256:
            return f"triton supports head_dim up to 256, not {head_dim}"
        return None
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


def _instance(name: str, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
    if name == "triton":
        from engine.worker.backends.triton_attn import TritonBackend
        return TritonBackend(num_heads // num_kv_heads, head_dim, num_kv_heads)
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


def try_backend(name: str, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int,
                softcap: float | None = None, num_heads: int = 2, num_kv_heads: int = 1,
                windows=(None,)) -> tuple[object | None, str | None]:
    """(the backend, None) when ``name`` can run here and passes its probe, else (None, why)."""
    reason = unavailable_reason(name, device, dtype, head_dim, softcap)
    if reason is not None:
        return None, reason
    try:
        backend = _instance(name, block_size, num_heads, num_kv_heads, head_dim)
    except Exception as exc:  # an extension that does not import
        return None, f"loading it raised {type(exc).__name__}: {str(exc).strip()[:300]}"
    if name == "torch":
        return backend, None  # the reference itself
    reason = probe_failure(backend, num_heads, num_kv_heads, head_dim, block_size, device, dtype, softcap, windows)
    return (None, reason) if reason else (backend, None)


def select_backend(name: str, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int,
                   softcap: float | None = None, num_heads: int = 2, num_kv_heads: int = 1, windows=(None,)):
    """The backend instance for ``--attention-backend name`` (``auto``: the first of AUTO_ORDER
    for this device that passes its probe; the log says why each one before it was skipped).
    A backend named explicitly that cannot run or fails its probe raises ValueError, at start."""
    shape = dict(softcap=softcap, num_heads=num_heads, num_kv_heads=num_kv_heads, windows=windows)
    if name != "auto":
        backend, reason = try_backend(name, device, dtype, block_size, head_dim, **shape)
        if backend is None:
            raise ValueError(f"--attention-backend {name}: {reason}")
        return backend
    for candidate in AUTO_ORDER.get(device.type, ("torch",)):
        backend, reason = try_backend(candidate, device, dtype, block_size, head_dim, **shape)
        if backend is not None:
            logger.info("attention backend: %s (auto, %s %s)", candidate, device.type,
                        str(dtype).removeprefix("torch."))
            return backend
        log = logger.warning if candidate in ("cpu", "triton") else logger.info  # the expected ones
        log("attention backend %s skipped: %s", candidate, reason)
    raise AssertionError("the torch backend always runs")


def select_kernels(name: str, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int,
                   softcap: float | None = None, num_heads: int = 2, num_kv_heads: int = 1,
                   windows=(None,)) -> Kernels:
    """The attention backend for ``--attention-backend name`` and the layer ops that go with it:
    csrc/cpu's fused ones with the native backend, torch's with every other (``torch`` is the
    pure-torch reference path, end to end)."""
    backend = select_backend(name, device, dtype, block_size, head_dim, softcap, num_heads, num_kv_heads, windows)
    return Kernels(backend, NativeOps(native.ops()) if backend.name == "cpu" else TorchOps())
