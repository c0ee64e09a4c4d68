"""The worker: owns the model, the paged KV tensors and per-request token state.

It receives one SchedulerOutput per step, mirrors the request state it describes, builds the
attention metadata once, runs the model, samples, and returns one ModelRunnerOutput.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from engine import timeline
from engine.config import EngineConfig
from engine.grammar import bitmask_to_bound, bitmask_to_bound_on_device
from engine.kv_transfer.base import KVConnectorWorker, NoOpConnectorWorker, allocate_kv_tensor
from engine.outputs import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker import fused_decoder, loader, native
from engine.worker.backends import select_kernels
from engine.worker.cpu_linear import SMALL_ROWS, onednn_available, pack_linears, small_rows_candidates
from engine.worker.cuda_graphs import DecodeGraphs, why_not_captured
from engine.worker.input_batch import InputBatch, RowState
from engine.worker.models import ModelConfig, model_class
from engine.worker.quantized import METHODS, pack_modules, quantized_targets, swap_modules, widen_modules
from engine.worker.sampler import NONFINITE, NONFINITE_ERROR, Sampler, SamplingMetadata, logprob_entries

logger = logging.getLogger("engine.worker")

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 2**30
PROMPT_LOGPROBS_SLICE = 256  # prompt positions whose logits are computed at a time (prompt_logprobs)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


CUDA_CONTEXT_BYTES = 512 * 2**20  # this process's CUDA context and library workspaces (outside torch's allocator)


def cuda_kv_budget(total: int, free: int, own: int, utilization: float, reserve: int) -> int:
    """Bytes for the KV cache on a GPU, vLLM's way: this instance may hold ``utilization`` of the
    device's memory in all; what it holds already (``own``: its weights, as torch's allocator
    has them, plus its CUDA context) and the ``reserve`` for activations and CUDA graphs come off
    that. Other processes' memory is not charged to this share, but must leave room for it.
    Raises, with the numbers, when nothing is left."""
    budget = int(total * utilization) - own - reserve
    gib = 2**30
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache: this instance may use {utilization:.0%} of "
                         f"{total / gib:.1f} GiB, and holds {own / gib:.1f} GiB (weights) + {reserve / gib:.1f} GiB "
                         "kept for activations and CUDA graphs; raise --gpu-memory-utilization")
    others = total - free - own  # other processes, and whatever our own context holds past the allowance
    if budget > free - reserve:
        if others > CUDA_CONTEXT_BYTES:
            raise ValueError(f"the KV cache's {budget / gib:.1f} GiB ({utilization:.0%} of {total / gib:.1f} GiB, "
                             f"less this instance's {own / gib:.1f} GiB) do not fit the {free / gib:.1f} GiB free: "
                             f"other processes hold about {others / gib:.1f} GiB of this GPU; lower "
                             "--gpu-memory-utilization (or give --kv-cache-memory)")
        # Only this process's own CUDA context outgrew its allowance (a share near 1.0): what is free.
        budget = free - reserve - CUDA_CONTEXT_BYTES // 2
        if budget <= 0:
            raise ValueError(f"no GPU memory left for the KV cache: {free / gib:.1f} GiB free")
    return budget


def allocate_on(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model.to_empty(device=device)``, without its cost: to_empty's ``empty_like`` of a meta
    tensor runs torch's Python reference, which imports torch.fx's symbolic shapes and sympy
    (~500 modules, ~20 MiB resident for the process's life)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on GPUs of compute capability 8.0 and up (float16 below, as vLLM: no
    bfloat16 tensor cores there) and on CPUs that compute it natively (AVX512-BF16 or AMX, where
    it is the faster path by far: half the bytes of weights and KV to read), float32 elsewhere."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
        return torch.bfloat16 if native.cpu_has_native_bf16() else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, model_config: ModelConfig, eos_token_ids: frozenset[int],
                 max_model_len: int, connector: KVConnectorWorker | None = None, reserved_bytes: int = 0) -> None:
        """``connector``: the KV connector's worker half. The runner owns it: it alone calls it,
        with each step's metadata, and hands back what it reports in ``ModelRunnerOutput``."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.model_config = model_config  # parsed once, by the engine
        cfg = self.model_config
        self.kernels = select_kernels(config.attention_backend, self.device, self.dtype, self.block_size,
                                      cfg.head_dim, cfg.attn_softcap, cfg.num_heads, cfg.num_kv_heads,
                                      cfg.attention_windows)
        self.backend = self.kernels.attention

        start = time.perf_counter()
        torch.manual_seed(config.seed)
        # Built on the meta device so no time goes into random init, given its dtype there (free)
        # so memory is allocated once, in that dtype (never an fp32 copy of a bf16 model on the
        # way), then filled tensor by tensor by load_weights.
        with torch.device("meta"):
            model = model_class(self.model_config)(self.model_config, self.kernels)
        quantized_ops = self._quantize(model, model_dir)
        model = allocate_on(model.to(self.dtype), self.device)
        if self.model_config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.init_rope(self.device)
        model.load_weights(loader.iter_weights(model_dir, lambda name: model.checkpoint_name(name) is not None))
        if quantized_ops is None:
            widen_modules(model, self.dtype)
        else:
            pack_modules(model)
        small_rows_ops = self._small_rows_ops(model)
        if onednn_available(self.device, self.dtype):
            pack_linears(model, small_rows_ops)
        model.fused = fused_decoder.fuse(model, self.kernels)
        self.model = model.eval()
        logger.info("loaded %s (%s, %s) in %.1fs", model_dir.name, self.dtype, self.device,
                    time.perf_counter() - start)

        self.num_blocks = self._num_blocks(reserved_bytes)
        self.connector = connector or NoOpConnectorWorker()
        self.kv_caches = self._allocate_kv_caches()
        self.sampler = Sampler()
        self.batch = InputBatch(max_model_len, self.block_size, self.device, capacity=config.max_num_seqs)
        self.graphs = self._capture_graphs()
        # Test hooks, only with ENGINE_ALLOW_FAULTS=1. ENGINE_FAULT_FORWARD_AT=N (FAULTS 24): the
        # Nth forward pass and every later one raise (a broken model). ENGINE_FAULT_REQUEST=
        # PREFIX@N: a forward that computes position N of a request whose id contains PREFIX
        # raises (one request that a kernel cannot run: engine_core contains it).
        faults = os.environ.get("ENGINE_ALLOW_FAULTS") == "1"
        self._fail_at_forward = int(os.environ.get("ENGINE_FAULT_FORWARD_AT", "0")) if faults else 0
        prefix, _, position = (os.environ.get("ENGINE_FAULT_REQUEST", "") if faults else "").rpartition("@")
        self._fail_request = (prefix, int(position)) if prefix else None
        self._num_forwards = 0
        self.connector_meta_delivered = True
        self._unsaved = None  # the last step's connector metadata, until save_kv

    def _capture_graphs(self) -> DecodeGraphs | None:
        why = why_not_captured(self.config, self.device, self.backend.name)
        if why is not None:
            if self.device.type == "cuda":
                logger.info("decode steps run eagerly (no CUDA graphs): %s", why)
            return None
        try:
            with torch.inference_mode():
                return DecodeGraphs(self.model, self.kv_caches, self.model_config.attention_windows,
                                    min(self.config.max_capture_size, self.config.max_num_seqs),
                                    self.batch.max_blocks, self.device, self.backend)
        except Exception:  # an op that cannot be captured: serve eagerly rather than not at all
            logger.exception("capturing the decode CUDA graphs failed; decode steps run eagerly")
            torch.cuda.synchronize(self.device)
            return None

    def _quantize(self, model: torch.nn.Module, model_dir: Path):
        """Swaps in the quantized modules the model's weights need (on the meta device) and
        returns the kernels they run on; None: none, or no kernels here (the weights are then
        dequantized once loaded, and the log says why)."""
        method = self.config.quantization
        stored = loader.stored_block_types(model_dir)
        if method == "gguf" and stored is None:
            raise ValueError(f"quantization='gguf' needs a .gguf model; {model_dir} is not one")
        targets = quantized_targets(model, stored, method)
        if not targets:
            return None
        if self.device.type != "cpu" and method in METHODS:
            raise ValueError(f"quantization={method!r} runs on the CPU kernels; on {self.device.type} load the "
                             "float checkpoint (or a checkpoint quantized for it)")
        ops = native.ops() if self.device.type == "cpu" else None
        why = native.unavailable_reason() if self.device.type == "cpu" else f"the device is {self.device}"
        if ops is not None and not hasattr(ops, "quant_linear"):
            ops, why = None, "the native build predates them: pip install --no-build-isolation -e ."
        with torch.device("meta"):
            swap_modules(model, targets, self.dtype, ops)
        model.quantize_at_load = method in METHODS
        if ops is None:
            logger.warning("%d quantized weights are dequantized to %s at load (%s): the quantized kernels are "
                           "CPU-native", len(targets), self.dtype, why)
        return ops

    def _small_rows_ops(self, model: torch.nn.Module):
        """The native kernels when steps of up to SMALL_ROWS rows read plain copies of the linear
        weights (EngineConfig.small_rows_linear), else None; what was done is logged."""
        if not self.config.small_rows_linear:
            return None
        if self.dtype != torch.bfloat16 or not onednn_available(self.device, self.dtype):  # CPU only
            logger.warning("small_rows_linear applies to bfloat16 on a CPU with oneDNN; this model runs in %s on %s",
                           self.dtype, self.device)
            return None
        ops = native.ops()
        if ops is None or not hasattr(ops, "small_rows_linear") or not native.small_rows_linear_supported():
            logger.warning("small_rows_linear: the kernel needs the avx512 build on a CPU with AVX512-BF16 (%s); "
                           "oneDNN runs every step", native.unavailable_reason() or "this CPU has none")
            return None
        linears, extra = small_rows_candidates(model)
        if not linears:
            logger.info("small_rows_linear: no linear layer can take it (all quantized or with a bias)")
            return None
        logger.info("steps of up to %d rows read a plain copy of %d linear weights (+%.0f MiB)", SMALL_ROWS, linears,
                    extra / 2**20)
        return ops

    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _allocate_kv_caches(self) -> torch.Tensor:
        """The paged KV tensors, where the connector wants them (e.g. in shared memory a
        same-host peer can read), handed to the connector."""
        cfg = self.model_config
        shape = (cfg.num_layers, *self.backend.kv_cache_shape(self.num_blocks, self.block_size,
                                                              cfg.num_kv_heads, cfg.head_dim))
        kv = allocate_kv_tensor(shape, self.dtype, self.device, self.connector.kv_cache_file(shape, self.dtype,
                                                                                           self.device))
        self.connector.register_kv_caches(kv)
        return kv

    def shutdown(self) -> None:
        self.connector.shutdown()

    def _num_blocks(self, reserved_bytes: int) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        memory = self.config.cache.kv_cache_memory
        if memory is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            own = torch.cuda.memory_reserved(self.device) + CUDA_CONTEXT_BYTES
            reserve = self._activation_bytes() + self._graph_bytes()
            memory = cuda_kv_budget(total, free, own, self.config.gpu_memory_utilization, reserve)
            logger.info("KV cache budget: %.2f GiB (%.0f%% of %.1f GiB, less %.2f GiB held by this instance and "
                        "%.2f GiB kept for activations and CUDA graphs)", memory / 2**30,
                        100 * self.config.gpu_memory_utilization, total / 2**30, own / 2**30, reserve / 2**30)
        # Transfer staging buffers come out of the same budget: they never grow past it.
        memory = (memory or DEFAULT_CPU_KV_CACHE_MEMORY) - reserved_bytes
        num_blocks = memory // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={memory} bytes holds no block of {self.bytes_per_block} bytes")
        return num_blocks

    def _activation_bytes_per_token(self) -> int:
        """The widest layer's tensors for one token (input, qkv, attention, gate/up, down)."""
        cfg = self.model_config
        return (3 * cfg.hidden_size + 2 * cfg.intermediate_size
                + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim) * self.dtype.itemsize

    def _activation_bytes(self) -> int:
        """A bound on one step's activations: the widest layer's tensors for a full token
        budget, plus the logits of a full batch, twice over for the allocator's slack."""
        tokens = self.config.max_num_batched_tokens
        # sampled in float32; prompt_logprobs take PROMPT_LOGPROBS_SLICE positions' logits more
        logits = (self.config.max_num_seqs + PROMPT_LOGPROBS_SLICE) * self.model_config.vocab_size * 4
        return 2 * (tokens * self._activation_bytes_per_token() + logits)

    def _graph_bytes(self) -> int:
        """A bound on the captured decode graphs' private memory: one forward of the largest
        captured batch (they share one pool, largest first), with the same slack."""
        if why_not_captured(self.config, self.device, self.backend.name) is not None:
            return 0
        rows = min(self.config.max_capture_size, self.config.max_num_seqs)
        return 2 * rows * self._activation_bytes_per_token() * 2 + 64 * 2**20

    # ---- per-step state ----------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's diff to the persistent batch."""
        batch = self.batch
        for req_id in so.finished_req_ids:
            batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            batch.add(new.req_id, new.prompt_token_ids, new.output_token_ids, new.sampling_params, new.block_ids,
                      new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            batch.append_blocks(req_id, block_ids)
            batch.set_num_computed(req_id, num_computed)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.save_kv()  # the previous step's, if its caller has not: before anything loads or computes
        self.connector_meta_delivered = False  # until then, a failure loses other requests' transfers
        self._update_states(so)
        self.connector.start_load_kv(so.kv_connector_metadata)
        self.connector_meta_delivered = True
        output = ModelRunnerOutput()
        if so.total_num_scheduled_tokens == 0:
            output.kv_connector_output = self._connector_output()
            return output

        batch = self.batch
        inputs = batch.prepare(list(so.num_scheduled_tokens), list(so.num_scheduled_tokens.values()))
        self._num_forwards += 1
        if 0 < self._fail_at_forward <= self._num_forwards:
            raise RuntimeError(f"injected failure in forward pass {self._num_forwards} (ENGINE_FAULT_FORWARD_AT)")
        if self._fail_request is not None:
            self._inject_request_fault(inputs)
        if self.graphs is not None and self.graphs.fits(inputs.attention):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.attention)
        else:
            # One metadata per sliding window the layers use (None: global attention).
            metas = {window: self.backend.build_metadata(inputs.attention, window)
                     for window in self.model_config.attention_windows}
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, metas)

        rows = inputs.rows
        output.prompt_logprobs = self._prompt_logprobs(hidden, inputs)
        # Sample for requests whose known tokens are now all computed; the rest are mid-prefill.
        batch.num_computed[rows] += inputs.attention.query_lens
        sampling = np.flatnonzero(batch.num_computed[rows] == batch.num_tokens[rows])
        if len(sampling):
            last_index = torch.from_numpy(inputs.attention.query_start[sampling + 1].astype(np.int64) - 1)
            states = [batch.states[rows[i]] for i in sampling]
            logits = self.model.compute_logits(hidden[last_index.to(self.device)])
            sampled = self.sampler(logits, SamplingMetadata.build(
                [s.sampling_params for s in states],
                [s.prompt_token_ids for s in states],
                [s.output_token_ids for s in states],
                [self._banned_ids(s) for s in states],
                self.device,
                grammar=self._grammar_rows(so, [s.req_id for s in states])))
            for i, (row, state) in enumerate(zip(rows[sampling], states)):
                token = sampled.sampled_token_ids[i]
                if token == NONFINITE:  # no token: the scheduler fails this request alone
                    output.failed[state.req_id] = NONFINITE_ERROR
                    continue
                batch.append_token(int(row), token)
                output.sampled_token_ids[state.req_id] = token
                if sampled.logprobs is not None and state.sampling_params.logprobs is not None:
                    output.logprobs[state.req_id] = sampled.logprobs[i]
            timeline.mark("runner.sampled", *output.sampled_token_ids)
        # Offers and tier saves are the caller's to make (save_kv) once this output is on its
        # way: a step that raised before here offered nothing (engine_core recomputes its
        # requests in blocks it may hand to others).
        output.kv_connector_output = self._connector_output()
        self._unsaved = so.kv_connector_metadata  # last: if anything above raised, nothing is offered
        return output

    def save_kv(self) -> None:
        """The last step's offers and tier saves (the connector's save_kv), made after its output
        went out, so that nothing done for a decode instance or a store delays the tokens it
        carries (a prefill instance's first token): the engine core process calls it right after
        sending the outputs, and the next step first thing if nobody did, before anything loads
        into or computes over the blocks, which so still hold what the step computed (a request
        that ended in it may have freed them; no one has written them since)."""
        metadata, self._unsaved = self._unsaved, None
        if metadata is None:
            return
        try:
            self.connector.save_kv(metadata)
        except Exception:  # the step's output stands; a save is never worth the engine
            logger.exception("the KV connector's saves after a step failed")

    def _inject_request_fault(self, inputs) -> None:
        prefix, position = self._fail_request
        for i, row in enumerate(inputs.rows):
            start = int(self.batch.num_computed[row])
            if (prefix in self.batch.states[row].req_id
                    and start <= position < start + int(inputs.attention.query_lens[i])):
                raise RuntimeError(f"injected failure at position {position} of {self.batch.states[row].req_id} "
                                   "(ENGINE_FAULT_REQUEST)")

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs) -> dict[str, tuple[int, list]]:
        """For the rows that asked for prompt_logprobs: each prompt token that this step's
        positions predict (position p's logits predict token p + 1), with the top k, from the raw
        logits; PROMPT_LOGPROBS_SLICE positions at a time, so a long chunk never holds its whole
        [positions, vocab] logits. Called before num_computed advances past this step."""
        result = {}
        for i, row in enumerate(inputs.rows):
            state = self.batch.states[row]
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            start, prompt = int(self.batch.num_computed[row]), state.prompt_token_ids
            end = min(start + int(inputs.attention.query_lens[i]), len(prompt) - 1)
            base = int(inputs.attention.query_start[i]) - start  # hidden row of position p: base + p
            entries = []
            for p0 in range(start, end, PROMPT_LOGPROBS_SLICE):
                p1 = min(end, p0 + PROMPT_LOGPROBS_SLICE)
                logits = self.model.compute_logits(hidden[base + p0:base + p1])
                targets = torch.tensor(prompt[p0 + 1:p1 + 1], dtype=torch.int64, device=logits.device)
                entries += logprob_entries(logits, targets, k)
            if entries:
                result[state.req_id] = (start + 1, entries)
        return result

    def _connector_output(self) -> KVConnectorOutput:
        """What the connector learned since the last step, with its counters read after it (so
        a transfer reported done is already counted)."""
        out = self.connector.get_finished()
        try:
            out.stats = self.connector.stats()
        except Exception:  # counters are never worth a step: keep the previous ones
            logger.exception("reading the KV connector's counters failed")
        return out

    def _grammar_rows(self, so: SchedulerOutput, sampling_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, their logits' upper bound: +inf allowed, -inf not) of the sampling rows the
        scheduler sent a grammar bitmask for."""
        if so.grammar_bitmask is None:
            return None
        row_of = {req_id: i for i, req_id in enumerate(sampling_ids)}
        pairs = sorted((row_of[r], i) for i, r in enumerate(so.grammar_req_ids) if r in row_of)  # row order
        if not pairs:
            return None
        rows, mask_rows = zip(*pairs)
        bitmask, vocab = so.grammar_bitmask[list(mask_rows)], self.model_config.vocab_size
        if self.device.type == "cpu":
            bound = torch.from_numpy(bitmask_to_bound(bitmask, vocab))
        else:  # the packed mask crosses to the device, not a [rows, vocab] float32 array
            bound = bitmask_to_bound_on_device(torch.from_numpy(bitmask).to(self.device), vocab)
        return torch.tensor(rows, dtype=torch.int64, device=self.device), bound

    def _banned_ids(self, state: RowState) -> list[int]:
        """EOS and stop tokens may not end a request before it has min_tokens tokens."""
        params = state.sampling_params
        if len(state.output_token_ids) >= params.min_tokens:
            return []
        return self.eos_token_ids + list(params.stop_token_ids)
