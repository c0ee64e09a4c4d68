"""Triton kernels of the ``triton`` attention backend: paged attention read in place through the
block table (one launch per layer for a step's whole mixed batch) and the write of a step's new
K/V into the paged cache.

Layout (engine/worker/backends/layout.py): a layer's cache is [2, num_blocks, block_size,
num_kv_heads, head_dim]. A step's tokens are packed request after request; request r owns
queries [query_start[r], query_start[r + 1]) and attends to the first seq_lens[r] positions of
its context, causally aligned at the bottom right (its j-th query sits at position
seq_lens[r] - q_len + j), and with a sliding window W only to the last W positions up to it.

The attention grid is (tiles, kv heads): a tile is BLOCK_Q consecutive queries of one request
(``tile_req``, ``tile_q``), and each program computes those queries for every query head of its
KV head (grouped-query attention: one load of K/V serves the whole group). Rows of the tile
are (query, head in group) pairs, padded to a power of two of at least 16 (tl.dot's minimum).
Keys are read BLOCK_N at a time, each through its block's id, with an online softmax in
float32. A request with no context (seq_len 0: the padding rows of a captured CUDA graph)
writes zeros.

Split-K (``num_splits`` > 1, for decodes too few to fill the GPU: one long sequence has only
num_kv_heads programs): a third grid axis cuts each tile's keys into that many segments of whole
BLOCK_N's, sized from the tile's own key count (so a captured graph's fixed split count fits any
context: a short one leaves trailing segments empty). Each segment writes its unnormalised
accumulator with its running max and sum; ``_merge_splits`` rescales them to a common max and
divides once. An empty segment has max -inf and sum 0 and weighs nothing.

Runs on CUDA, and on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), which is how
CI tests it against the torch reference without a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention(
    Q, K, V, Out, PartAcc, PartMax, PartSum, block_table, query_start, seq_lens, tile_req, tile_q,
    scale, softcap, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUPS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req + tile)
    q_first = tl.load(tile_q + tile)  # this tile's first query, within its request
    q_begin = tl.load(query_start + req)
    q_len = tl.load(query_start + req + 1) - q_begin
    seq_len = tl.load(seq_lens + req)
    context = seq_len - q_len  # positions already in the cache before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_first + rows // GROUPS  # the query of each row, within its request
    head = kv_head * GROUPS + rows % GROUPS
    row_ok = (rows < BLOCK_Q * GROUPS) & (q_idx < q_len)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    token = (q_begin + q_idx).to(tl.int64)
    q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = context + q_idx

    # Keys [lo, hi): up to the tile's last query; from the window's start for its first query.
    hi = tl.minimum(seq_len, context + q_first + BLOCK_Q)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context + q_first - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:  # this program's segment: whole BLOCK_N's, so every segment starts aligned
        segment = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * segment
        hi = tl.minimum(hi, lo + segment)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    table_row = block_table + req.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + cols
        key_ok = k_pos < hi
        page = tl.load(table_row + k_pos // PAGE, mask=key_ok, other=0).to(tl.int64)
        offset = page[:, None] * stride_kb + (k_pos % PAGE)[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(K + offset, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if USE_SOFTCAP:  # softcap * tanh(s / softcap), tanh from exp (saturates cleanly)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = key_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + offset, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:  # partials [token, head, split(, dim)], contiguous
        part = (token * (GROUPS * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(PartAcc + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(PartMax + part, m_i, mask=row_ok)
        tl.store(PartSum + part, l_i, mask=row_ok)


@triton.jit
def _merge_splits(PartAcc, PartMax, PartSum, Out, stride_ot, stride_oh,
                  NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """One (token, head): its segments' accumulators brought to their common max and summed."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(PartMax + part)
    m_top = tl.max(m, 0)
    weight = tl.exp(m - tl.where(m_top == float("-inf"), 0.0, m_top))  # an empty segment: exp(-inf) = 0
    total = tl.sum(tl.load(PartSum + part) * weight, 0)
    dims = tl.arange(0, HEAD_PAD)
    acc = tl.load(PartAcc + part[:, None] * HEAD_DIM + dims[None, :], mask=(dims < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + token * stride_ot + head * stride_oh + dims, out.to(Out.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _write_kv(K, V, KCache, VCache, slot_mapping, stride_kt, stride_vt, stride_cs,
              ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    """Token t's K and V rows (num_kv_heads * head_dim, contiguous) into slot slot_mapping[t];
    a negative slot (padding) writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    cols = tl.arange(0, ROW_PAD)
    ok = (cols < ROW) & ((tl.zeros([ROW_PAD], tl.int64) + slot) >= 0)  # vector & vector: the interpreter's mask
    tl.store(KCache + slot * stride_cs + cols, tl.load(K + t * stride_kt + cols, mask=ok), mask=ok)
    tl.store(VCache + slot * stride_cs + cols, tl.load(V + t * stride_vt + cols, mask=ok), mask=ok)


def tile_rows(groups: int, block_q: int) -> int:
    """Rows of a tile: (queries x heads of the group), a power of two, at least 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(groups * block_q))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    block_table: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                    tile_req: torch.Tensor, tile_q: torch.Tensor, block_q: int, scale: float,
                    softcap: float | None, window: int | None, block_n: int, num_splits: int = 1) -> torch.Tensor:
    """q, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, page, num_kv_heads,
    head_dim] (last two dims contiguous); block_table: [num_reqs, max_blocks] int32; query_start:
    [num_reqs + 1] int32; seq_lens: [num_reqs] int32; tile_req, tile_q: [num_tiles] int32;
    num_splits: a power of two, segments per tile's keys (split-K)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    groups = num_heads // num_kv_heads
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 attention stays fp32 (no TF32)
    num_tokens = q.shape[0]
    grid = (tile_req.shape[0], num_kv_heads, num_splits)
    if num_splits > 1:  # float32 partials; allocated per call (inside a graph: from its private pool)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # not read
    _paged_attention[grid](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum, block_table, query_start, seq_lens, tile_req, tile_q,
        scale, softcap or 1.0, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        GROUPS=groups, BLOCK_Q=block_q, BLOCK_M=tile_rows(groups, block_q), BLOCK_N=block_n, PAGE=page,
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
        USE_SOFTCAP=softcap is not None, USE_WINDOW=window is not None, PRECISION=precision,
        NUM_SPLITS=num_splits)
    if num_splits > 1 and num_tokens:
        _merge_splits[(num_tokens, num_heads)](part_acc, part_max, part_sum, out, out.stride(0), out.stride(1),
                                               NUM_SPLITS=num_splits, HEAD_DIM=head_dim,
                                               HEAD_PAD=triton.next_power_of_2(head_dim))
    return out


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The step's new K/V ([num_tokens, num_kv_heads, head_dim], heads and dims contiguous) into
    a layer's cache [2, num_blocks, page, num_kv_heads, head_dim]; slots < 0 are skipped."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    row = k.shape[1] * k.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), k_cache.stride(1),
                             ROW=row, ROW_PAD=triton.next_power_of_2(row))
