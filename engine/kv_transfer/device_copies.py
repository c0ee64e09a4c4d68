"""KV copies made for transfers and tiers, on a CUDA stream of their own.

On CUDA, a copy between the paged KV tensor and host memory issued on the default stream holds
back every kernel enqueued after it. Connector code instead copies inside
``off_step_stream(device)``: a stream of its own per thread, which first waits for the work
already enqueued on the default stream (so a block a step is still writing, or that a step just
freed and the scheduler handed on, is never read or overwritten early), and is synchronised when
the block exits (so the bytes are complete where the code goes on). Steps enqueued after the
copy began do not wait for it. Host buffers from ``host_buffer`` are pinned, so a copy is DMA,
not staged through pageable memory. On the CPU both are no-ops.
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
    stream.wait_stream(torch.cuda.default_stream(device))  # what steps enqueued so far comes first
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of host memory to stage KV of ``device`` in (pinned when that is a GPU)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
