"""The start-time probe of an attention backend: one small paged step (a prefill chunk over cached
context, a decode, a fresh prefill) in the model's head shape, dtype and windows, on the engine's
device, against the torch reference. A backend that raises or disagrees is not used: ``auto``
skips it (and logs why), a backend named explicitly is refused at start. Nothing a backend lacks
(an extension built for another torch, a dtype without kernels) may surface per request."""
from __future__ import annotations

import torch

from engine.worker.attention import StepAttention

PROBE_BLOCK_SIZE_BLOCKS = 8  # blocks in the probe's cache
# (cached, new) tokens of each probe request: a chunk with context, a decode, a fresh prefill.
PROBE_REQUESTS = ((5, 3), (20, 1), (0, 7))


def tolerance(dtype: torch.dtype) -> float:
    return 2e-3 if dtype == torch.float32 else 3e-2


def probe_failure(backend, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  device: torch.device, dtype: torch.dtype, softcap: float | None, windows) -> str | None:
    """Why ``backend`` fails the probe, or None when it matches the torch reference."""
    from engine.worker.backends.torch_sdpa import TorchSDPABackend
    generator = torch.Generator().manual_seed(0)
    blocks_per_req = -(-max(c + n for c, n in PROBE_REQUESTS) // block_size)
    num_blocks = 1 + blocks_per_req * len(PROBE_REQUESTS)  # block 0 unused: padding points there
    tables = [list(range(1 + i * blocks_per_req, 1 + (i + 1) * blocks_per_req)) for i in range(len(PROBE_REQUESTS))]
    step, _ = StepAttention.from_lists([n for _, n in PROBE_REQUESTS], [c for c, _ in PROBE_REQUESTS], tables,
                                       block_size, device)
    tokens = step.num_tokens

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, k, v = rand(tokens, num_heads, head_dim), rand(tokens, num_kv_heads, head_dim), rand(tokens, num_kv_heads,
                                                                                              head_dim)
    cache = rand(*TorchSDPABackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim))
    scale = head_dim ** -0.5
    reference = TorchSDPABackend()
    try:
        for window in windows:
            want = reference.forward(q, k, v, cache.clone(), reference.build_metadata(step, window), scale, softcap)
            got = backend.forward(q, k, v, cache.clone(), backend.build_metadata(step, window), scale, softcap)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if got.shape != want.shape:
                return f"probe step: output shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            error = (got.float() - want.float()).abs().max().item()
            if not error <= tolerance(dtype):  # also catches NaN
                return (f"probe step (window {window}): differs from the torch reference by {error:.3g} "
                        f"(tolerance {tolerance(dtype):g})")
    except Exception as exc:  # an extension that does not load, a dtype without kernels, ...
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        return f"probe step raised {type(exc).__name__}: {first_line}"
    return None
