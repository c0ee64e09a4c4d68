"""The runner's persistent batch (engine/worker/input_batch.py): what it holds and what it costs."""
from __future__ import annotations

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.worker.input_batch import InputBatch


def test_token_ids_are_int32_allocated_once_for_max_num_seqs_rows():
    """vLLM keeps token ids as int32: a [rows, max_model_len] int64 array is 256 MiB at 128k x 256
    rows, and growing it by doubling copied it whole. Rows for max_num_seqs come up front."""
    batch = InputBatch(max_model_len=131_072, block_size=16, device=torch.device("cpu"), capacity=256)
    assert batch.token_ids.dtype == np.int32 and batch.token_ids.shape == (256, 131_072)
    arrays = batch.token_ids
    for i in range(256):
        batch.add(f"r{i}", [5, 6, 7], [], SamplingParams(), [i], 0)
    assert batch.token_ids is arrays  # never reallocated
    inputs = batch.prepare(["r3", "r200"], [3, 2])
    assert inputs.input_ids.dtype == torch.int64  # what the embedding takes
    assert inputs.input_ids.tolist() == [5, 6, 7, 5, 6]
