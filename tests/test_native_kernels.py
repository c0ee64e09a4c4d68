"""csrc/cpu's kernels against the torch reference, on generated shapes, for every ISA build this
CPU can run (an AVX-512 machine checks the AVX2 build too): paged attention against a float64
dense reference (block sizes, contexts across block and partition edges, head counts and
ratios, windows, soft-caps, dtypes, head sizes), its batch invariance, the fused layer ops
against TorchOps, and refusals of bad input."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.worker import native
from engine.worker.ops import NativeOps, TorchOps

ISAS = native.supported_isas()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_DIMS = [16, 32, 64, 96, 128, 256]
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_a_build_runs_on_this_cpu():
    """On an x86 CPU with AVX2, `pip install -e .` must have built a kernel this CPU runs (a
    broken build fails here instead of quietly running the torch path)."""
    if platform.machine() not in ("x86_64", "AMD64") or not ISAS:
        pytest.skip(f"no native build for this CPU ({platform.machine()}): the torch path runs")
    assert native.unavailable_reason() is None
    assert native.ops() is native.load(ISAS[0])


def test_engine_native_0_falls_back_to_torch_and_says_why():
    code = ("import logging, torch\nlogging.basicConfig(level=logging.INFO)\n"
            "from engine.worker.backends import select_kernels\n"
            "k = select_kernels('auto', torch.device('cpu'), torch.float32, 16, 64)\n"
            "print(k.attention.name, k.ops.name)\n")
    env = {**os.environ, "ENGINE_NATIVE": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torch", "torch"]
    assert "attention backend cpu skipped: the native CPU kernels cannot run: ENGINE_NATIVE=0" in result.stderr
    assert "attention backend: torch (auto, cpu float32)" in result.stderr


# ---- paged attention ---------------------------------------------------------------------------

def dense_reference(q, k_cache, v_cache, block_table, query_start, seq_lens, scale, softcap, window):
    """softmax over each request's context, in float64, from the paged cache."""
    out = torch.empty(q.shape, dtype=torch.float64)
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    for r in range(len(seq_lens)):
        n, length = query_start[r + 1] - query_start[r], seq_lens[r]
        blocks = block_table[r, :-(-length // bs)]
        k = k_cache[blocks].reshape(-1, kv_heads, q.shape[2])[:length].double().repeat_interleave(heads // kv_heads, 1)
        v = v_cache[blocks].reshape(-1, kv_heads, q.shape[2])[:length].double().repeat_interleave(heads // kv_heads, 1)
        s = torch.einsum("qhd,khd->hqk", q[query_start[r]:query_start[r + 1]].double(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(length - n, length)[:, None]
        k_pos = torch.arange(length)[None, :]
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        out[query_start[r]:query_start[r + 1]] = torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, -torch.inf)
                                                              .softmax(-1), v)
    return out


def make_case(rng: np.random.Generator, dtype, head_dim, kv_heads, group, block_size, shapes):
    """A paged cache with shuffled block tables and the queries of requests (context, new)."""
    seq_lens = [c + n for c, n in shapes]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    ids = rng.permutation(num_blocks).astype(np.int32)
    table = np.zeros((len(shapes), max(need)), dtype=np.int32)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = ids[used:used + n]
        used += n
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    query_start = np.concatenate([[0], np.cumsum([n for _, n in shapes])]).astype(np.int32)
    # Queries as a view of a wider qkv buffer (the layout the model hands the kernel).
    qkv = torch.randn(int(query_start[-1]), kv_heads * (group + 2), head_dim, generator=gen).to(dtype)
    q = qkv[:, :kv_heads * group]
    return q, k_cache, v_cache, torch.from_numpy(table), torch.from_numpy(query_start), \
        torch.tensor(seq_lens, dtype=torch.int32)


def run_attention(kernels, q, k_cache, v_cache, table, query_start, seq_lens, scale, softcap, window):
    out = torch.empty(q.shape, dtype=q.dtype)
    kernels.paged_attention(out, q, k_cache, v_cache, table, query_start, seq_lens, scale, softcap, window)
    return out


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}

request_shapes = st.lists(st.tuples(st.integers(0, 700), st.integers(1, 40)).map(
    lambda s: (s[0], 1) if s[1] > 30 else s),  # plenty of decodes (one new token)
    min_size=1, max_size=5)


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES), head_dim=st.sampled_from(HEAD_DIMS),
       kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4, 7]),
       block_size=st.sampled_from([1, 3, 8, 16, 32]), shapes=request_shapes,
       window=st.sampled_from([0, 0, 1, 5, 100, 600]), softcap=st.sampled_from([0.0, 0.0, 5.0, 50.0]))
def test_paged_attention_matches_dense_reference(isa, data, dtype, head_dim, kv_heads, group, block_size, shapes,
                                                 window, softcap):
    kernels = native.load(isa)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    case = make_case(rng, dtype, head_dim, kv_heads, group, block_size, shapes)
    scale = data.draw(st.sampled_from([head_dim ** -0.5, 0.3]))
    out = run_attention(kernels, *case, scale, softcap, window)
    expected = dense_reference(*case, scale, softcap, window)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES), shapes=request_shapes,
       long_decode=st.integers(513, 2200), threads=st.sampled_from([1, 2]))
def test_a_request_computes_the_same_alone_as_in_any_batch(isa, data, dtype, shapes, long_decode, threads):
    """Every row's arithmetic is fixed by the row (chunks and partitions at absolute key
    positions; partitions merged in order), so a request's output is bit for bit the same alone,
    in a batch, with a long decode split across threads, and on any thread count."""
    kernels = native.load(isa)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    shapes = shapes + [(long_decode, 1)]
    q, k_cache, v_cache, table, query_start, seq_lens = make_case(rng, dtype, 64, 2, 3, 16, shapes)
    batched = run_attention(kernels, q, k_cache, v_cache, table, query_start, seq_lens, 0.125, 0.0, 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for r in range(len(shapes)):
            a, b = int(query_start[r]), int(query_start[r + 1])
            alone = run_attention(kernels, q[a:b], k_cache, v_cache, table[r:r + 1],
                                  torch.tensor([0, b - a], dtype=torch.int32), seq_lens[r:r + 1], 0.125, 0.0, 0)
            assert torch.equal(alone, batched[a:b]), f"request {r} {shapes[r]} differs alone"
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [0, 1, 5])
def test_bf16_short_contexts_match_the_dense_reference_at_every_position(isa, window):
    """Short contexts, where one key more or less in a row's mask moves its output far past the
    bf16 tolerance: every chunk length from 1 to 40 over contexts 0 to 70, each position."""
    kernels = native.load(isa)
    rng = np.random.default_rng(7)
    shapes = [(int(rng.integers(0, 71)), n) for n in range(1, 41)]
    case = make_case(rng, torch.bfloat16, 64, 3, 3, 16, shapes)
    out = run_attention(kernels, *case, 0.125, 0.0, window)
    expected = dense_reference(*case, 0.125, 0.0, window)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.bfloat16], rtol=TOLERANCE[torch.bfloat16])


@pytest.mark.skipif("avx512_bf16" not in native.cpu_flags(),
                    reason="bf16 rows take the VDPBF16PS pairs on CPUs with AVX512-BF16 only")
@SETTINGS
@given(data=st.data(), context=st.integers(0, 1300), chunk=st.integers(2, 70), head_dim=st.sampled_from(HEAD_DIMS),
       kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4, 7]), block_size=st.sampled_from([1, 3, 8, 16, 32]),
       others=request_shapes, window=st.sampled_from([0, 0, 1, 5, 100]), softcap=st.sampled_from([0.0, 0.0, 30.0]))
def test_a_bf16_token_computes_the_same_as_a_decode_as_inside_a_prefill_chunk(data, context, chunk, head_dim, kv_heads,
                                                                             group, block_size, others, window,
                                                                             softcap):
    """bf16 on a CPU with AVX512-BF16: decode rows take the prefill rows' tiles and pairs, so a
    token computed alone (a decode; the last prompt token after a full prefix hit) gives the bits
    it gets inside a prefill chunk (a recompute after preemption; a prompt without the hit)."""
    kernels = native.load("avx512")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    # The chunk is the first request of a mixed batch; its tokens are then computed alone.
    q, k_cache, v_cache, table, query_start, seq_lens = make_case(rng, torch.bfloat16, head_dim, kv_heads, group,
                                                                  block_size, [(context, chunk), *others])
    chunked = run_attention(kernels, q, k_cache, v_cache, table, query_start, seq_lens, 0.125, softcap, window)
    for i in sorted({0, chunk - 1, data.draw(st.integers(0, chunk - 1))}):
        alone = run_attention(kernels, q[i:i + 1], k_cache, v_cache, table[:1], torch.tensor([0, 1], dtype=torch.int32),
                              torch.tensor([context + i + 1], dtype=torch.int32), 0.125, softcap, window)
        assert torch.equal(alone, chunked[i:i + 1]), f"token {i} of the chunk differs as a decode"


@pytest.mark.parametrize("isa", ISAS)
def test_paged_attention_refuses_what_it_cannot_read(isa):
    kernels = native.load(isa)
    q, k_cache, v_cache, table, query_start, seq_lens = make_case(np.random.default_rng(0), torch.float32, 64, 2, 2,
                                                                  16, [(40, 3)])
    args = (0.125, 0.0, 0)
    bad_table = table.clone()
    bad_table[0, 1] = k_cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="block id .* out of range"):
        run_attention(kernels, q, k_cache, v_cache, bad_table, query_start, seq_lens, *args)
    with pytest.raises(RuntimeError, match="needs 4 blocks, the table has 3"):
        run_attention(kernels, q, k_cache, v_cache, table, query_start, seq_lens + 10, *args)
    with pytest.raises(RuntimeError, match="not 48"):
        run_attention(kernels, q[..., :48], k_cache[..., :48], v_cache[..., :48], table, query_start, seq_lens, *args)
    with pytest.raises(RuntimeError, match="not a multiple"):
        run_attention(kernels, q[:, :3], k_cache, v_cache, table, query_start, seq_lens, *args)
    with pytest.raises(RuntimeError, match="dtype"):
        run_attention(kernels, q, k_cache.bfloat16(), v_cache.bfloat16(), table, query_start, seq_lens, *args)
    with pytest.raises(RuntimeError, match="block size of 0"):
        run_attention(kernels, q, k_cache[:, :0], v_cache[:, :0], table, query_start, seq_lens, *args)
    with pytest.raises(RuntimeError, match="query must be on the CPU|Meta"):  # (the dispatcher may refuse first)
        run_attention(kernels, q.to("meta"), k_cache, v_cache, table, query_start, seq_lens, *args)
    with pytest.raises(RuntimeError, match="too large"):
        run_attention(kernels, q, k_cache, v_cache, table, query_start, seq_lens, 0.125, 0.0, 2**40)


# ---- layer ops ------------------------------------------------------------------------------

ULP = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
rows = st.integers(1, 70)
widths = st.sampled_from([8, 16, 24, 64, 100, 576, 1536])


def randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(DTYPES), n=rows, width=widths, gemma=st.booleans())
def test_norms_match_torch(isa, seed, dtype, n, width, gemma):
    ops, gen = NativeOps(native.load(isa)), torch.Generator().manual_seed(seed)
    x, residual, weight = randn(gen, n, width, dtype=dtype), randn(gen, n, width, dtype=dtype), randn(gen, width,
                                                                                                      dtype=dtype)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6, gemma), TorchOps.rms_norm(x, weight, 1e-6, gemma),
                               atol=ULP[dtype], rtol=ULP[dtype])
    expected, expected_residual = TorchOps.add_rms_norm(x, residual, weight, 1e-6, gemma)
    got, got_residual = ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6, gemma)
    assert torch.equal(got_residual, expected_residual)  # the skip connection's add rounds once, as torch's
    torch.testing.assert_close(got, expected, atol=ULP[dtype], rtol=ULP[dtype])
    # Head norms (Qwen3, Gemma 3) normalise each head of a [tokens, heads, head_dim] view.
    heads = torch.cat([x, x], dim=1).view(n, 2, width)
    torch.testing.assert_close(ops.rms_norm(heads, weight, 1e-6, gemma), TorchOps.rms_norm(heads, weight, 1e-6, gemma),
                               atol=ULP[dtype], rtol=ULP[dtype])


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(DTYPES), n=rows, width=widths,
       act=st.sampled_from(["silu", "gelu_pytorch_tanh"]))
def test_activation_times_up_matches_torch(isa, seed, dtype, n, width, act):
    ops, gen = NativeOps(native.load(isa)), torch.Generator().manual_seed(seed)
    x = randn(gen, n, 2 * width, dtype=dtype) * 4
    torch.testing.assert_close(ops.act_and_mul(x, act), TorchOps.act_and_mul(x, act), atol=4 * ULP[dtype],
                               rtol=ULP[dtype])


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(DTYPES), n=rows, head_dim=st.sampled_from([16, 64, 96, 256]),
       heads=st.integers(1, 9), kv_heads=st.integers(1, 3), partial=st.sampled_from([1.0, 0.5, 0.75]))
def test_rope_is_torch_bit_for_bit(isa, seed, dtype, n, head_dim, heads, kv_heads, partial):
    ops, gen = NativeOps(native.load(isa)), torch.Generator().manual_seed(seed)
    rot = int(head_dim * partial) // 2 * 2
    qkv = randn(gen, n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, :heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    angle = torch.rand(n, 1, rot // 2, generator=gen) * 100
    cos = torch.cat([angle.cos()] * 2, -1).to(dtype)
    sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)
    expected = TorchOps.rope(q, k, cos, sin)
    got = ops.rope(q, k, cos, sin)  # in place
    assert got[0].data_ptr() == q.data_ptr()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("isa", ISAS)
def test_reshape_and_cache_writes_each_token_to_its_slot(isa):
    kernels, gen = native.load(isa), torch.Generator().manual_seed(0)
    k_cache = torch.zeros(6, 4, 2, 16)
    v_cache = torch.zeros(6, 4, 2, 16)
    qkv = torch.randn(5, 8, 16, generator=gen)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([23, 0, 5, 4, 17])
    kernels.reshape_and_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 16)[slots], k) and torch.equal(v_cache.view(-1, 2, 16)[slots], v)
    assert int((k_cache.view(-1, 2, 16).abs().sum((1, 2)) > 0).sum()) == 5
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.reshape_and_cache(k, v, k_cache, v_cache, torch.tensor([24, 0, 1, 2, 3]))
