"""The start-time probe of an attention backend: one small paged step (a prefill chunk over cached
context, a decode, a fresh prefill) in the model's head shape, dtype and windows, on the engine's
device, against the torch reference. A backend that raises or disagrees is not used: ``auto``
skips it (and logs why), a backend named explicitly is refused at start. Nothing a backend lacks
(an extension built for another torch, a dtype without kernels) may surface per request."""
from __future__ import annotations

from dataclasses import replace

import torch

# Steps of (cached, new) tokens per request: a mixed one (a chunk over context that spans
# several key blocks and query tiles, a decode, a fresh prefill), a decode-only one (the shape
# every pure decode step and CUDA graph runs) and one long decode (alone on a GPU it splits its
# keys: triton's split-K). Sliding windows are probed at most
# PROBE_WINDOW wide, so that they cut into these contexts (the window is a runtime argument:
# the same compiled kernel serves the model's own width).
PROBE_STEPS = (((70, 40), (45, 1), (0, 7)), ((90, 1), (3, 1), (33, 1)), ((600, 1),))
PROBE_WINDOW = 8
SPLIT_COUNTS = (2, 4, 8, 16)  # triton's split-K variants (triton_attn.MAX_SPLITS = 16)


def tolerance(dtype: torch.dtype) -> float:
    return 2e-3 if dtype == torch.float32 else 3e-2


def probe_failure(backend, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  device: torch.device, dtype: torch.dtype, softcap: float | None, windows) -> str | None:
    """Why ``backend`` fails the probe, or None when it matches the torch reference. A CUDA
    error is raised, not reported: it leaves the device unusable for any other backend."""
    for requests in PROBE_STEPS:
        for window in windows:
            why = _probe_step(backend, requests, None if window is None else min(window, PROBE_WINDOW), num_heads,
                              num_kv_heads, head_dim, block_size, device, dtype, softcap)
            if why is not None:
                return why
    return None


def _probe_step(backend, requests, window, num_heads, num_kv_heads, head_dim, block_size, device, dtype,
                softcap) -> str | None:
    from engine.worker.attention import StepAttention  # (attention imports the backends package)
    from engine.worker.backends.torch_sdpa import TorchSDPABackend
    generator = torch.Generator().manual_seed(0)
    blocks_per_req = -(-max(c + n for c, n in requests) // block_size)
    num_blocks = 1 + blocks_per_req * len(requests)  # block 0 unused: padding points there
    tables = [list(range(1 + i * blocks_per_req, 1 + (i + 1) * blocks_per_req)) for i in range(len(requests))]
    step, _ = StepAttention.from_lists([n for _, n in requests], [c for c, _ in requests], tables, block_size,
                                       device)
    tokens = step.num_tokens

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, k, v = rand(tokens, num_heads, head_dim), rand(tokens, num_kv_heads, head_dim), rand(tokens, num_kv_heads,
                                                                                              head_dim)
    cache = rand(*TorchSDPABackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim))
    scale = head_dim ** -0.5
    reference = TorchSDPABackend()
    shape = f"{'decode' if all(n == 1 for _, n in requests) else 'mixed'} step, window {window}"
    try:
        want = reference.forward(q, k, v, cache.clone(), reference.build_metadata(step, window), scale, softcap)
        meta = backend.build_metadata(step, window)
        got = backend.forward(q, k, v, cache.clone(), meta, scale, softcap)
        if getattr(meta, "num_splits", 1) > 1:
            # A split decode: every split count the backend may choose later is compiled and
            # checked now, not on the first long decode of its kind while serving.
            for splits in SPLIT_COUNTS:
                split = backend.forward(q, k, v, cache.clone(), replace(meta, num_splits=splits), scale, softcap)
                got = torch.where((split.float() - want.float()).abs() > (got.float() - want.float()).abs(),
                                  split, got)  # the worst of them is what is compared below
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # an extension that does not load, a dtype without kernels, ...
        if _is_device_fault(exc):
            raise RuntimeError(f"attention backend {backend.name}'s probe ({shape}) broke the CUDA device; "
                               f"choose another with --attention-backend: {exc}") from exc
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        return f"probe ({shape}) raised {type(exc).__name__}: {first_line}"
    if got.shape != want.shape:
        return f"probe ({shape}): output shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    error = (got.float() - want.float()).abs().max().item()
    if not error <= tolerance(dtype):  # also catches NaN
        return f"probe ({shape}): differs from the torch reference by {error:.3g} (tolerance {tolerance(dtype):g})"
    return None


def _is_device_fault(exc: Exception) -> bool:
    """An illegal address or a device-side assert: the CUDA context is lost (every later call
    fails), unlike a missing kernel or an unsupported dtype, which raise before launching."""
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in str(exc)
