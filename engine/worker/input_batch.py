"""The runner's requests as rows of preallocated arrays (vLLM's InputBatch and BlockTable).

A request holds one row from its first schedule until it finishes or is preempted; rows stay
dense in [0, num_rows) (a finished row's place goes to the last row). Each step changes only
what its SchedulerOutput says changed (new rows, dropped rows, appended blocks, computed
counts) plus the one token each sampling row appends, so the host work of a step grows with
what changed, not with the batch. The step's inputs (token ids, positions, slot mapping, block
table, query starts) come out of the arrays in a few vectorised numpy operations.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.worker.attention import StepAttention, token_positions
from engine.worker.host_to_device import HostToDevice


@dataclass(slots=True)
class RowState:
    """What sampling needs of a row, beyond the arrays."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor   # [num_tokens] int64
    positions: torch.Tensor   # [num_tokens] int64
    attention: StepAttention
    rows: np.ndarray          # [num_reqs] the row of each scheduled request, in step order


class InputBatch:
    def __init__(self, max_model_len: int, block_size: int, device: torch.device, capacity: int = 16) -> None:
        """``capacity``: rows allocated up front (the scheduler's max_num_seqs: then it never grows).
        The arrays are np.zeros, mapped by the OS page by page as rows are first written (huge
        pages of 2 MiB where numpy asks for them): like vLLM's, the token array costs up to
        rows x max_model_len x 4 bytes once that many rows have been used."""
        self.max_model_len, self.block_size, self.device = max_model_len, block_size, device
        self._to_device = HostToDevice(device)
        self.max_blocks = -(-max_model_len // block_size)
        self.states: list[RowState] = []
        self.row_of: dict[str, int] = {}
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate for ``capacity`` rows, keeping what the current rows hold."""
        n = len(self.states)
        token_ids = np.zeros((capacity, self.max_model_len), dtype=np.int32)  # vocabularies fit int32, as vLLM keeps them
        block_table = np.zeros((capacity, self.max_blocks), dtype=np.int32)
        num_tokens = np.zeros(capacity, dtype=np.int64)
        num_computed = np.zeros(capacity, dtype=np.int64)
        num_blocks = np.zeros(capacity, dtype=np.int64)
        if n:
            token_ids[:n], block_table[:n] = self.token_ids[:n], self.block_table[:n]
            num_tokens[:n], num_computed[:n], num_blocks[:n] = (self.num_tokens[:n], self.num_computed[:n],
                                                                self.num_blocks[:n])
        self.token_ids, self.block_table = token_ids, block_table
        self.num_tokens, self.num_computed, self.num_blocks = num_tokens, num_computed, num_blocks

    @property
    def num_rows(self) -> int:
        return len(self.states)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    def add(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int], params: SamplingParams,
            block_ids: list[int], num_computed: int) -> None:
        row = self.num_rows
        if row == len(self.num_tokens):
            self._allocate(2 * row)
        tokens = len(prompt_token_ids) + len(output_token_ids)
        if tokens > self.max_model_len:
            raise ValueError(f"request {req_id} has {tokens} tokens, more than max_model_len={self.max_model_len}")
        self.token_ids[row, :len(prompt_token_ids)] = prompt_token_ids
        self.token_ids[row, len(prompt_token_ids):tokens] = output_token_ids
        self.num_tokens[row] = tokens
        self.num_computed[row] = num_computed
        self.num_blocks[row] = 0
        self.states.append(RowState(req_id, list(prompt_token_ids), list(output_token_ids), params))
        self.row_of[req_id] = row
        self.append_blocks(req_id, block_ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        last = self.num_rows - 1
        if row != last:  # the last row moves into the hole
            moved = self.states[last]
            self.states[row] = moved
            self.row_of[moved.req_id] = row
            used = int(self.num_tokens[last])  # a row's tokens past num_tokens are never read
            self.token_ids[row, :used] = self.token_ids[last, :used]
            for array in (self.block_table, self.num_tokens, self.num_computed, self.num_blocks):
                array[row] = array[last]
        self.states.pop()

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.row_of[req_id]
        start = int(self.num_blocks[row])
        if start + len(block_ids) > self.block_table.shape[1]:  # never with the scheduler's limits
            self.block_table = np.pad(self.block_table, ((0, 0), (0, start + len(block_ids))))
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def set_num_computed(self, req_id: str, num_computed: int) -> None:
        self.num_computed[self.row_of[req_id]] = num_computed

    def append_token(self, row: int, token: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token
        self.num_tokens[row] = n + 1
        self.states[row].output_token_ids.append(token)

    def prepare(self, req_ids: list[str], num_scheduled: list[int]) -> StepInputs:
        """The step's inputs for these requests (in this order), computing num_scheduled[i]
        tokens of request i from its num_computed on."""
        rows = np.fromiter((self.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        q_lens = np.asarray(num_scheduled, dtype=np.int32)
        computed = self.num_computed[rows]
        seq_lens = (computed + q_lens).astype(np.int32)
        assert (seq_lens <= self.num_tokens[rows]).all(), "scheduled past a request's known tokens"
        query_start = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start[1:])
        positions = token_positions(query_start, computed)
        row_of_token = np.repeat(rows, q_lens)
        bs = self.block_size
        table = np.ascontiguousarray(self.block_table[rows, :-(-int(seq_lens.max()) // bs)])
        slots = self.block_table[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        # One host->device copy (pinned, asynchronous on CUDA); the views live until the next step.
        slot_mapping, input_ids, positions = self._to_device.send(
            slots, self.token_ids[row_of_token, positions].astype(np.int64), positions)
        step = StepAttention(q_lens, seq_lens, query_start, table, slot_mapping, bs, self.device)
        return StepInputs(input_ids, positions, step, rows)
