"""The triton attention backend, on CPU under Triton's interpreter (TRITON_INTERPRET=1): its
paged attention and KV write against the torch reference on generated mixed steps, the padding
rows of a CUDA graph, and the engine end to end. Also the start-time probe that keeps a backend
which cannot run out of service, and the decode-graph bookkeeping that runs without a GPU.
(bfloat16 is left to the GPU probe and benchmarks/gpu_check.sh: the interpreter computes
bfloat16 dots wrongly.)"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton_kernels is first imported (lazily, by TritonBackend)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402,F401  (a test dependency: CI runs these kernels under the interpreter)
from hypothesis import given, settings, strategies as st  # noqa: E402

from engine.worker import backends  # noqa: E402
from engine.worker.attention import StepAttention  # noqa: E402
from engine.worker.backends import select_backend  # noqa: E402
from engine.worker.backends.torch_sdpa import TorchSDPABackend  # noqa: E402
from engine.worker.backends.triton_attn import (  # noqa: E402
    MIN_SPLIT_KEYS, TritonBackend, decode_splits, graph_metadata, tile_map)
from engine.worker.cuda_graphs import capture_sizes, padded_size, why_not_captured  # noqa: E402

CPU = torch.device("cpu")


def random_step(requests, block_size, num_heads, num_kv_heads, head_dim, dtype, seed):
    """A step of (cached, new) requests whose blocks are scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    per_req = [-(-(c + n) // block_size) for c, n in requests]
    num_blocks = 1 + sum(per_req) + 3
    order = rng.permutation(np.arange(1, num_blocks)).tolist()
    tables, at = [], 0
    for n in per_req:
        tables.append(order[at:at + n])
        at += n
    step, _ = StepAttention.from_lists([n for _, n in requests], [c for c, _ in requests], tables, block_size, CPU)
    tokens = step.num_tokens

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)
    q, k, v = rand(tokens, num_heads, head_dim), rand(tokens, num_kv_heads, head_dim), rand(tokens, num_kv_heads,
                                                                                              head_dim)
    cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
    return step, q, k, v, cache


def compare(step, q, k, v, cache, groups, window, softcap, dtype, target_programs=0):
    head_dim = q.shape[-1]
    reference, backend = TorchSDPABackend(), TritonBackend(groups, head_dim, cache.shape[3])
    backend.target_programs = target_programs  # > 0: decodes may split their keys (split-K)
    want_cache, got_cache = cache.clone(), cache.clone()
    want = reference.forward(q, k, v, want_cache, reference.build_metadata(step, window), head_dim ** -0.5, softcap)
    meta = backend.build_metadata(step, window)
    got = backend.forward(q, k, v, got_cache, meta, head_dim ** -0.5, softcap)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(got_cache, want_cache)  # the KV write puts every new token where torch does
    return meta


request_lists = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=4)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(requests=request_lists, kv_heads=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2, 3, 4]),
       head_dim=st.sampled_from([16, 32, 64, 80]), block_size=st.sampled_from([8, 16]),
       window=st.sampled_from([None, 5, 17]), softcap=st.sampled_from([None, 20.0]),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**16))
def test_triton_paged_attention_matches_torch(requests, kv_heads, groups, head_dim, block_size, window, softcap,
                                              dtype, seed):
    step, q, k, v, cache = random_step(requests, block_size, kv_heads * groups, kv_heads, head_dim, dtype, seed)
    compare(step, q, k, v, cache, groups, window, softcap, dtype)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(contexts=st.lists(st.integers(0, 70), min_size=1, max_size=6), groups=st.sampled_from([1, 4]),
       window=st.sampled_from([None, 9]))
def test_triton_decode_batches_match_torch(contexts, groups, window):
    """Decode-only steps take the one-query tiles (the graphs' metadata shape)."""
    step, q, k, v, cache = random_step([(c, 1) for c in contexts], 16, 2 * groups, 2, 32, torch.float32, 7)
    assert TritonBackend(groups, 32).build_metadata(step, window).block_q == 1
    compare(step, q, k, v, cache, groups, window, None, torch.float32)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(contexts=st.lists(st.integers(0, 2 * MIN_SPLIT_KEYS + 40), min_size=1, max_size=3),
       groups=st.sampled_from([1, 3]), window=st.sampled_from([None, 40, 300]), softcap=st.sampled_from([None, 10.0]),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**16))
def test_split_k_decodes_match_torch(contexts, groups, window, softcap, dtype, seed):
    """Long decodes too few to fill the device split their keys into segments merged after:
    contexts from empty (a graph's padding row) to past two segments, windows inside and across."""
    step, q, k, v, cache = random_step([(c, 1) for c in contexts], 16, 2 * groups, 2, 32, dtype, seed)
    meta = compare(step, q, k, v, cache, groups, window, softcap, dtype, target_programs=64)
    longest = max(contexts) + 1
    assert meta.num_splits == decode_splits(len(contexts), 2, longest, 64)
    assert (meta.num_splits > 1) == (longest >= 2 * MIN_SPLIT_KEYS)


def test_split_k_segments_are_sized_from_each_context():
    """A graph's split count is fixed at capture; a replayed context shorter than the segments
    leaves the trailing ones empty, and their merge weight is zero (no NaN from an empty one)."""
    from engine.worker.backends.triton_kernels import paged_attention
    step, q, k, v, cache = random_step([(0, 1), (5, 1), (70, 1)], 16, 4, 2, 32, torch.float32, 11)
    backend = TritonBackend(2, 32, 2)
    meta = backend.build_metadata(step, None)
    write = cache.clone()
    backend._kernels.write_kv(write, k, v, meta.slot_mapping)
    args = (q, write[0], write[1])
    rest = (meta.block_table, meta.query_start, meta.seq_lens, meta.tile_req, meta.tile_q, 1, 32 ** -0.5, None,
            None, 32)
    whole = paged_attention(*args, torch.empty_like(q), *rest, num_splits=1)
    for splits in (2, 8, 16):
        split = paged_attention(*args, torch.empty_like(q), *rest, num_splits=splits)
        torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_the_probe_checks_every_split_count(monkeypatch):
    """Where the probe's long decode splits (on a GPU), every split count the backend may choose
    later is run and compared at start: one that computes wrongly fails the probe."""
    from engine.worker.backends import probe, triton_kernels
    from engine.worker.backends import triton_attn
    monkeypatch.setattr(triton_attn, "target_programs", lambda device: 64)  # as a GPU's would split
    backend = TritonBackend(2, 32, 1)
    assert probe.probe_failure(backend, 2, 1, 32, 16, CPU, torch.float32, None, (None,)) is None
    real = triton_kernels.paged_attention

    def wrong_at_8(*args):  # (the backend passes num_splits last)
        out = real(*args)
        return out + 1.0 if args[-1] == 8 else out
    monkeypatch.setattr(triton_kernels, "paged_attention", wrong_at_8)
    assert "differs from the torch reference" in probe.probe_failure(TritonBackend(2, 32, 1), 2, 1, 32, 16, CPU,
                                                                     torch.float32, None, (None,))


def test_decode_splits_fill_the_device_and_no_more():
    assert decode_splits(1, 8, 4096, 264) == 16                      # one long stream: every segment used
    assert decode_splits(1, 8, 1024, 264) == 4                       # capped by MIN_SPLIT_KEYS per segment
    assert decode_splits(4, 8, 8192, 264) == 8                       # 32 programs -> 8 x 32 = 256
    assert decode_splits(64, 8, 8192, 264) == 1                      # the batch fills the device
    assert decode_splits(1, 8, MIN_SPLIT_KEYS * 2 - 1, 264) == 1     # too short to pay for a merge
    assert decode_splits(3, 2, 100_000, 0) == 1                      # CPU (interpreted): never


def test_tile_map_covers_every_query_once():
    req, first = tile_map(np.array([1, 33, 16, 17], dtype=np.int32), 16)
    assert req.tolist() == [0, 1, 1, 1, 2, 3, 3]
    assert first.tolist() == [0, 0, 16, 32, 0, 0, 16]


@pytest.mark.parametrize("splits", [1, 4])
def test_graph_padding_rows_write_nothing_and_leave_real_rows_alone(splits):
    """The graph's metadata over persistent buffers: rows past the real ones (slot -1, context 0)
    write no KV and do not change the real rows' output; split-K too (every segment of a padding
    row is empty: zeros, not NaN)."""
    step, q, k, v, cache = random_step([(20, 1), (3, 1)], 16, 4, 2, 32, torch.float32, 3)
    backend = TritonBackend(2, 32)
    eager_cache = cache.clone()
    eager = backend.forward(q, k, v, eager_cache, backend.build_metadata(step, None), 32 ** -0.5)

    buffers, metas_for = graph_metadata(8, 4, CPU, (None,), lambda rows: splits)
    rows, size = 2, 4
    buffers["slot_mapping"][:rows] = step.slot_mapping
    buffers["seq_lens"][:rows] = torch.from_numpy(step.seq_lens)
    buffers["block_table"][:rows, :step.block_table.shape[1]] = torch.from_numpy(step.block_table)
    pad = lambda t: torch.cat([t, torch.randn(size - rows, *t.shape[1:])])  # noqa: E731  garbage in padding rows
    graph_cache = cache.clone()
    out = backend.forward(pad(q), pad(k), pad(v), graph_cache, metas_for(size)[None], 32 ** -0.5)
    torch.testing.assert_close(out[:rows], eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[rows:], torch.zeros_like(out[rows:]))
    assert torch.equal(graph_cache, eager_cache)  # padding rows wrote nothing


def test_capture_sizes_and_padding():
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(256)[-3:] == [224, 240, 256]
    assert capture_sizes(3) == [1, 2, 3]
    sizes = capture_sizes(64)
    assert [padded_size(sizes, n) for n in (1, 3, 9, 17, 64, 65)] == [1, 4, 16, 32, 64, None]


def test_graphs_are_captured_only_where_they_can_run():
    from engine import EngineConfig
    cuda = torch.device("cuda")
    assert why_not_captured(EngineConfig(), cuda, "triton") is None
    assert "--enforce-eager" in why_not_captured(EngineConfig(enforce_eager=True), cuda, "triton")
    assert "host-side metadata" in why_not_captured(EngineConfig(), cuda, "torch")
    assert "device is cpu" in why_not_captured(EngineConfig(), CPU, "triton")


class _Broken:
    """A backend whose kernels cannot run on this machine (an extension built for another torch)."""
    name = "cpu"
    kv_cache_shape = staticmethod(TorchSDPABackend.kv_cache_shape)
    build_metadata = staticmethod(TorchSDPABackend.build_metadata)

    @staticmethod
    def forward(*args, **kwargs):
        raise RuntimeError("No operator found for memory_efficient_attention_forward")


class _Wrong(_Broken):
    @staticmethod
    def forward(q, *args, **kwargs):
        return torch.zeros_like(q)


@pytest.mark.parametrize("broken", [_Broken, _Wrong])
def test_a_backend_that_fails_its_probe_is_skipped_by_auto_and_refused_by_name(monkeypatch, caplog, broken):
    real = backends._instance
    monkeypatch.setattr(backends, "_instance", lambda name, *a: broken() if name == "cpu" else real(name, *a))
    monkeypatch.setattr(backends, "unavailable_reason", lambda *a, **k: None)
    with caplog.at_level(logging.INFO, logger="engine.worker"):
        assert select_backend("auto", CPU, torch.float32, 16, 64).name == "torch"
    why = "raised RuntimeError: No operator found" if broken is _Broken else "differs from the torch"
    assert any("attention backend cpu skipped" in r.message and why in r.message for r in caplog.records)
    with pytest.raises(ValueError, match=f"--attention-backend cpu: .*{why}"):
        select_backend("cpu", CPU, torch.float32, 16, 64)


def test_triton_on_cpu_needs_the_interpreter():
    code = ("import torch\nfrom engine.worker.backends import unavailable_reason\n"
            "print(unavailable_reason('triton', torch.device('cpu'), torch.float32, 64))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    assert "triton needs a CUDA device" in out


def test_engine_on_triton_equals_engine_on_torch(tiny_llama):
    """The whole engine on the triton backend (interpreted): chunked prefill over cached context,
    prefix-cache hits and batched decodes give torch's greedy tokens and prompt logprobs."""
    from engine import LLM, SamplingParams
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (37, 5, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    results = {}
    for name in ("torch", "triton"):
        llm = LLM(str(tiny_llama), dtype="float32", attention_backend=name, num_blocks=64,
                  max_num_batched_tokens=32, seed=0)
        assert llm.engine.runner.backend.name == name
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[name] = [(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]])
                         for o in outs]
        llm.shutdown()
    for (tokens, lps), (want_tokens, want_lps) in zip(results["triton"], results["torch"]):
        assert list(tokens) == list(want_tokens)
        np.testing.assert_allclose(lps, want_lps, atol=1e-4)


def test_engine_disagg_halves_the_gpu_share_when_the_instances_may_share_a_device():
    from entrypoints.cli import gpus_overlap
    assert gpus_overlap(None, None, None)            # both on whatever this process sees
    assert gpus_overlap("0", None, None)             # decode inherits every device, GPU 0 among them
    assert gpus_overlap("0", "0,1", None)
    assert gpus_overlap(None, "3", "2,3")            # the inherited list holds the decode's device
    assert not gpus_overlap("0", "1", None)
    assert not gpus_overlap(None, "1", "0")
    assert not gpus_overlap("0,1", "2,3", "0,1,2,3")


def test_probe_covers_long_contexts_decode_only_steps_and_windows(monkeypatch):
    """A backend wrong only past the first key block, only in decode-only steps, or only where a
    window cuts the context, must fail the probe (a probe of short mixed steps passed them all)."""
    from engine.worker.backends.probe import probe_failure

    class FirstKeysOnly(TritonBackend):  # reads at most 32 keys of each request
        def build_metadata(self, step, window):
            meta = super().build_metadata(step, window)
            meta.seq_lens = meta.seq_lens.clamp(max=32)
            return meta

    class NoWindow(TritonBackend):
        def build_metadata(self, step, window):
            return super().build_metadata(step, None)

    class WrongDecodes(TritonBackend):
        def forward(self, q, k, v, kv_cache, meta, scale, softcap=None):
            out = super().forward(q, k, v, kv_cache, meta, scale, softcap)
            return out * 0.5 if meta.block_q == 1 else out

    for backend, windows in ((FirstKeysOnly(2, 32), (None,)), (NoWindow(2, 32), (None, 4096)),
                             (WrongDecodes(2, 32), (None,))):
        assert probe_failure(backend, 4, 2, 32, 16, CPU, torch.float32, None, windows) is not None, backend
    assert probe_failure(TritonBackend(2, 32), 4, 2, 32, 16, CPU, torch.float32, None, (None, 4096)) is None
