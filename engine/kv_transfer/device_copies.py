"""KV copies made for transfers and tiers, kept off the step's CUDA stream.

On CUDA, a copy between the paged KV tensor and host memory issued on the default stream waits
behind the step's kernels and holds back the next step's. Connector code instead copies inside
``off_step_stream(device)``: a stream of its own per thread, synchronised when the block exits
(so the bytes are complete where the code goes on), with host buffers from ``host_buffer``
pinned so the copy is DMA, not staged through pageable memory. On the CPU both are no-ops.

Why no wait on the step's stream is needed (the invariant every caller keeps): the blocks a
connector reads were written by a step that has ended (the engine syncs on each step's sampled
ids before it offers or saves them, and holds them until the copy is done), and the blocks it
writes belong to a request that no step has scheduled yet (it is waiting for this load).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

_local = threading.local()


@contextmanager
def off_step_stream(device: torch.device):
    if device.type != "cuda":
        yield
        return
    stream = getattr(_local, "stream", None)
    if stream is None or stream.device != device:
        stream = _local.stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of host memory to stage KV of ``device`` in (pinned when that is a GPU)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
