"""A step's small host arrays (token ids, positions, slot mapping, attention metadata) to the
device in one copy.

On CUDA, copying each numpy array on its own costs a synchronous transfer from pageable memory
apiece (the host waits for each). ``HostToDevice.send`` instead packs the arrays, each at an
8-byte aligned offset, into one pinned host buffer and enqueues one asynchronous copy into one
device buffer; the tensors it returns are typed views of that device buffer.

Invariants:
- The views are valid until the next ``send`` on the same instance, which reuses both buffers:
  one instance per kind of use (a step's inputs, a backend's metadata), each used once a step.
- The pinned buffer is not refilled before the previous copy out of it has finished (an event
  recorded after the copy is waited on). The device buffer needs no wait: the next copy into it
  is enqueued on the same stream as the kernels that read the previous contents.

On the CPU the arrays are wrapped without a copy (``torch.from_numpy``), unless ``stage`` asks
for the CUDA packing (tests exercise it there).
"""
from __future__ import annotations

import numpy as np
import torch

ALIGN = 8  # bytes: every array starts where an int64 may


class HostToDevice:
    def __init__(self, device: torch.device, stage: bool | None = None) -> None:
        self.device = device
        self.stage = device.type == "cuda" if stage is None else stage
        self._pinned = self._on_device = None
        self._copied: torch.cuda.Event | None = None

    def send(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if not self.stage:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += -(-a.nbytes // ALIGN) * ALIGN
        self._reserve(end)
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the pinned buffer
        host = self._pinned.numpy()
        for a, at in zip(arrays, offsets):
            host[at:at + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        device = self._on_device[:end]
        device.copy_(self._pinned[:end], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return [device[at:at + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape) for a, at in zip(arrays, offsets)]

    def _reserve(self, nbytes: int) -> None:
        if self._pinned is not None and self._pinned.numel() >= nbytes:
            return
        size = max(4096, 1 << (nbytes - 1).bit_length())
        if self._copied is not None:
            self._copied.synchronize()  # the old pinned buffer may still be read
        self._pinned = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self._on_device = torch.empty(size, dtype=torch.uint8, device=self.device)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
