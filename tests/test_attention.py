"""Paged attention against a dense causal reference: the torch backend, the native CPU backend
(each ISA build this CPU runs), and the packed "varlen" data path of the flash-attn and xformers
backends (their metadata and context gather, with a plain-torch kernel standing in for the CUDA
one, so the metadata is checked on CPU)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from engine.worker import native
from engine.worker.attention import StepAttention, build_varlen_attention_metadata
from engine.worker.backends.cpu import CpuNativeBackend
from engine.worker.backends.layout import write_kv
from engine.worker.backends.torch_sdpa import TorchSDPABackend
from engine.worker.backends.varlen import gather_kv, reference_varlen_attention

CPU = torch.device("cpu")
HEAD_DIM = 16  # the smallest head the native kernel is built for


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                    sliding_window: int | None) -> torch.Tensor:
    """softmax(QK^T)V for query positions [start, start + len(q)) over keys [0, len(k)).
    q: [q_len, H, D]; k, v: [seq_len, KVH, D] -> [q_len, H, D]"""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)  # GQA: query head h reads kv head h // rep
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


class VarlenReferenceBackend:
    """What FlashAttnBackend / XFormersBackend do, with their CUDA kernel replaced by the plain
    torch reference of flash_attn_varlen_func(causal=True, window_size=(W - 1, 0))."""
    build_metadata = staticmethod(build_varlen_attention_metadata)

    @staticmethod
    def forward(q, k, v, kv_cache, meta, scale):
        write_kv(kv_cache, k, v, meta.slot_mapping)
        keys, values = gather_kv(kv_cache[0], kv_cache[1], meta.varlen)
        return reference_varlen_attention(q, keys, values, meta.varlen, scale)


BACKENDS = {"torch": TorchSDPABackend, "varlen": VarlenReferenceBackend,
            **{f"cpu-{isa}": CpuNativeBackend(native.load(isa)) for isa in native.supported_isas()}}


def run_step(kv_cache, seqs, order, query_lens, num_computed, block_size, sliding_window, scale, backend="torch"):
    """One forward call for the given per-sequence query ranges, in the given order (decodes
    and prefills mixed, as the runner's rows come)."""
    step, positions = StepAttention.from_lists(
        [query_lens[i] for i in order], [num_computed[i] for i in order],
        [seqs[i]["blocks"] for i in order], block_size, CPU)
    meta = BACKENDS[backend].build_metadata(step, sliding_window)
    q = torch.cat([seqs[i]["q"][num_computed[i]:num_computed[i] + query_lens[i]] for i in order])
    k = torch.cat([seqs[i]["k"][num_computed[i]:num_computed[i] + query_lens[i]] for i in order])
    v = torch.cat([seqs[i]["v"][num_computed[i]:num_computed[i] + query_lens[i]] for i in order])
    expected_pos = np.concatenate([np.arange(num_computed[i], num_computed[i] + query_lens[i]) for i in order])
    np.testing.assert_array_equal(positions, expected_pos)
    out = BACKENDS[backend].forward(q, k, v, kv_cache, meta, scale)
    assert out.shape == q.shape
    row = 0
    for i in order:
        n = query_lens[i]
        ref = dense_reference(q[row:row + n], seqs[i]["k"][:num_computed[i] + n], seqs[i]["v"][:num_computed[i] + n],
                              num_computed[i], scale, sliding_window)
        torch.testing.assert_close(out[row:row + n], ref, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"seq {i} (ctx {num_computed[i]}, q {n}): {m}")
        row += n
    return meta


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("sliding_window", [None, 1, 5])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_matches_dense_reference(seed, block_size, sliding_window, backend):
    rng = random.Random(seed * 1000 + block_size * 10 + (sliding_window or 0))
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    num_heads, num_kv_heads = rng.choice([(4, 4), (4, 2), (6, 1)])
    scale = rng.choice([1 / math.sqrt(HEAD_DIM), 0.7])
    num_seqs = rng.randint(6, 9)
    # Both query kinds with and without context: 1-token queries (decode batch) and longer ones.
    # A context of exactly one token is the edge between plain causal and masked attention.
    shapes = [(rng.randint(0, 40), 1), (0, rng.randint(2, 12)), (rng.randint(2, 40), rng.randint(2, 12)),
              (1, rng.randint(2, 12)), (0, 1), (1, 1)]
    shapes += [(rng.randint(0, 40), rng.choice([1, rng.randint(2, 12)])) for _ in range(num_seqs - len(shapes))]
    rng.shuffle(shapes)

    seqs, total_blocks = [], 0
    for ctx, q_len in shapes:
        n = ctx + q_len
        seqs.append(dict(ctx=ctx, q_len=q_len,
                         q=torch.randn(n, num_heads, HEAD_DIM, generator=gen),
                         k=torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen),
                         v=torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen)))
        total_blocks += -(-n // block_size)
    num_blocks = total_blocks + 5
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # non-contiguous, unordered block tables
    for s in seqs:
        n_blocks = -(-(s["ctx"] + s["q_len"]) // block_size)
        s["blocks"], ids = ids[:n_blocks], ids[n_blocks:]
    # Garbage (finite) everywhere: reading a slot that was never written shows up in the output.
    kv_cache = torch.randn(TorchSDPABackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, HEAD_DIM),
                           generator=gen) * 10

    # 1. A first call computes the context (a prefill of the first ctx tokens) through the cache.
    with_ctx = [i for i, s in enumerate(seqs) if s["ctx"] > 0]
    if with_ctx:
        run_step(kv_cache, seqs, with_ctx, [s["ctx"] for s in seqs], [0] * len(seqs), block_size,
                 sliding_window, scale, backend)
    for s in seqs:  # the context K/V landed in the right slots
        for pos in range(s["ctx"]):
            block, off = s["blocks"][pos // block_size], pos % block_size
            assert torch.equal(kv_cache[0, block, off], s["k"][pos])
            assert torch.equal(kv_cache[1, block, off], s["v"][pos])

    # 2. The query call: every sequence, context from the cache plus its new tokens.
    meta = run_step(kv_cache, seqs, list(range(len(seqs))), [s["q_len"] for s in seqs], [s["ctx"] for s in seqs],
                    block_size, sliding_window, scale, backend)
    if backend == "varlen":
        assert meta.decodes == [] and meta.prefills == []
        assert meta.varlen.cu_seqlens_q[-1].item() == sum(s["q_len"] for s in seqs)
        assert meta.varlen.cu_seqlens_k[-1].item() == sum(s["ctx"] + s["q_len"] for s in seqs)
    elif backend == "torch":
        num_single = sum(1 for s in seqs if s["q_len"] == 1)
        assert sum(len(d.rows) for d in meta.decodes) == num_single
        assert len(meta.prefills) == len(seqs) - num_single


def test_decode_only_and_prefill_only_steps():
    gen = torch.Generator().manual_seed(0)
    block_size, kvh, h = 4, 2, 4
    seqs = []
    for i, n in enumerate([9, 3, 14]):
        seqs.append(dict(q=torch.randn(n, h, HEAD_DIM, generator=gen), k=torch.randn(n, kvh, HEAD_DIM, generator=gen),
                         v=torch.randn(n, kvh, HEAD_DIM, generator=gen), blocks=[[7, 2, 0], [5], [1, 8, 3, 6]][i]))
    kv_cache = torch.zeros(TorchSDPABackend.kv_cache_shape(9, block_size, kvh, HEAD_DIM))
    scale = 1 / math.sqrt(HEAD_DIM)
    lens = [len(s["q"]) for s in seqs]
    meta = run_step(kv_cache, seqs, [0, 1, 2], [n - 1 for n in lens], [0, 0, 0], block_size, None, scale)
    assert meta.decodes == []
    meta = run_step(kv_cache, seqs, [0, 1, 2], [1, 1, 1], [n - 1 for n in lens], block_size, None, scale)
    assert meta.prefills == []
    # Lengths 9, 3, 14 in step order: sorted 14, 9 | 3 (3 < half of 14 starts a second group).
    assert [d.rows.tolist() for d in meta.decodes] == [[2, 0], [1]]


def test_slot_mapping_of_a_hand_built_step():
    # Block size 4. Request A: 5 tokens cached, 1 new (position 5) in blocks [7, 2]: block 2,
    # offset 1 -> slot 9. Request B: 2 cached, 3 new (positions 2, 3, 4) in blocks [3, 0]:
    # slots 3*4+2=14, 15, then block 0 offset 0 -> 0.
    step, positions = StepAttention.from_lists([1, 3], [5, 2], [[7, 2], [3, 0]], 4, CPU)
    meta = TorchSDPABackend.build_metadata(step, None)
    assert meta.slot_mapping.tolist() == [9, 14, 15, 0]
    assert positions.tolist() == [5, 2, 3, 4]
    assert meta.num_tokens == 4
    (d,) = meta.decodes
    assert d.rows.tolist() == [0]
    assert d.block_ids.tolist() == [7, 2]
    assert d.mask.shape == (1, 1, 1, 8)
    assert d.mask.flatten().tolist() == [True] * 6 + [False] * 2
    (p,) = meta.prefills
    assert (p.query_start, p.query_end, p.seq_len) == (1, 4, 5)
    assert p.block_ids.tolist() == [3, 0]
    # Context: query i (position 2 + i) sees keys 0..2+i.
    assert p.mask.tolist() == [[True, True, True, False, False],
                               [True, True, True, True, False],
                               [True, True, True, True, True]]


def test_slot_mapping_with_block_size_one_and_no_context():
    step, positions = StepAttention.from_lists([3], [0], [[4, 1, 6]], 1, CPU)
    meta = TorchSDPABackend.build_metadata(step, None)
    assert meta.slot_mapping.tolist() == [4, 1, 6] and positions.tolist() == [0, 1, 2]
    assert meta.decodes == [] and meta.prefills[0].mask is None  # plain causal


def test_prefills_before_decodes_in_one_step():
    step, positions = StepAttention.from_lists([3, 1], [0, 4], [[0], [1, 2]], 4, CPU)
    meta = TorchSDPABackend.build_metadata(step, None)
    assert positions.tolist() == [0, 1, 2, 4] and meta.slot_mapping.tolist() == [0, 1, 2, 8]
    assert [d.rows.tolist() for d in meta.decodes] == [[3]]
    assert [(p.query_start, p.query_end) for p in meta.prefills] == [(0, 3)]


def test_decode_length_groups_bound_padding():
    from engine.worker.attention import _length_groups
    assert _length_groups(np.array([], dtype=np.int64)) == []
    assert _length_groups(np.array([100, 90, 60, 51])) == [(0, 4)]
    assert _length_groups(np.array([100, 49, 40, 10])) == [(0, 1), (1, 3), (3, 4)]
    # Never more than four groups, however spread the lengths are.
    assert len(_length_groups(np.array([2**k for k in range(20, 0, -1)]))) == 4
    with pytest.raises(AssertionError):
        _length_groups(np.array([1, 5]))
