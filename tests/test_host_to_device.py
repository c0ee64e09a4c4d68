"""A step's host arrays reach the device in one packed copy (engine/worker/host_to_device.py):
the CUDA packing, run on the CPU (``stage=True``), gives back every array with its dtype, shape
and values, however many, whatever their sizes, and across reuses of (and growth of) its buffers."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from engine.worker.host_to_device import ALIGN, HostToDevice

DTYPES = (np.int32, np.int64, np.float32, np.uint8, np.int16)
array_specs = st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 7), min_size=1, max_size=3)),
                       min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(steps=st.lists(array_specs, min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_staged_arrays_come_back_whole(steps, seed):
    rng = np.random.default_rng(seed)
    staging = HostToDevice(torch.device("cpu"), stage=True)
    for specs in steps:  # one send per step, the buffers reused (and grown) between them
        arrays = [(rng.integers(0, 100, size=shape) * (1 if np.dtype(d).kind in "iu" else 0.5)).astype(d)
                  for d, shape in specs]
        sent = staging.send(*arrays)
        for a, t in zip(arrays, sent):
            assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
            np.testing.assert_array_equal(t.numpy(), a)
        # every array starts aligned, after the previous one: none overlaps another
        starts = [t.storage_offset() * t.element_size() for t in sent]
        assert all(s % ALIGN == 0 for s in starts)
        assert starts == sorted(starts)


def test_unstaged_cpu_arrays_are_wrapped_without_a_copy():
    a = np.arange(5, dtype=np.int64)
    t, = HostToDevice(torch.device("cpu")).send(a)
    a[0] = 42
    assert t[0].item() == 42
