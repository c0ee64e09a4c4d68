// Paged attention that reads K/V where they are: one call for a step's mixed batch (decodes,
// prefill chunks with cached context), through the block table, with an online softmax.
// No gather, no padding, no mask tensors. Sliding windows, tanh soft-capping, GQA.
//
// The arithmetic of one query row is fixed by the row alone, never by the batch around it:
//   * keys are taken in chunks of W (the vector width) or tiles of TK aligned at absolute
//     positions, and in partitions of PARTITION keys aligned the same way;
//   * inside a partition, an online softmax over its chunks or tiles (scores and values in a
//     fixed order: see scores_by_dot, scores_by_broadcast, accumulate_values, and for bf16 on a
//     CPU with AVX512-BF16 the pairs of scores_by_bf16_pairs and accumulate_value_pairs);
//   * the partitions' (max, sum, output) are merged in order into an empty state.
// Whether a partition was computed by the same work item as its neighbours (a prefill tile)
// or by its own (a long decode split across threads) changes nothing in the result, so an
// output never depends on batching, chunking or thread count.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

namespace engine_cpu {

constexpr int PARTITION = 512;  // keys; a multiple of every W
constexpr int TILE_ROWS = 48;   // query rows (tokens x heads of a group) a prefill work item takes

struct AttentionArgs {
  const void* q;  // [tokens, heads, head_dim], unit stride in head_dim
  int64_t q_tok_stride, q_head_stride;
  const void* k_cache;  // [blocks, block_size, kv_heads, head_dim]
  const void* v_cache;
  int64_t kv_block_stride, kv_tok_stride, kv_head_stride;
  const int32_t* block_table;  // [reqs, bt_stride]
  int64_t bt_stride;
  const int32_t* query_start;  // [reqs + 1]
  const int32_t* seq_lens;     // [reqs]: cached + new tokens
  int num_reqs;
  void* out;  // [tokens, heads, head_dim], unit stride in head_dim
  int64_t o_tok_stride, o_head_stride;
  int num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  float softcap;  // 0: none
  int window;     // 0: none; else a query at position p sees keys (p - window, p]
};

// Running softmax state of one row: max, sum of exponentials, unnormalised output.
struct RowState {
  float m, l;
  float* o;  // [head_dim]
};

// (m, l, o) += (pm, pl, po): the one merge used everywhere (exact when the left side is empty).
inline void merge_state(RowState& into, float pm, float pl, const float* po, int nv) {
  if (pm == neg_inf()) return;
  float m = std::max(into.m, pm);
  float a = exp_scalar(into.m - m), b = exp_scalar(pm - m);
  into.l = into.l * a + pl * b;
  Vec va = Vec::set1(a), vb = Vec::set1(b);
  for (int v = 0; v < nv; ++v) {
    Vec x = fmadd(Vec::load(po + v * W), vb, Vec::load(into.o + v * W) * va);
    x.store(into.o + v * W);
  }
  into.m = m;
}

template <typename T, int NV>
class PagedAttention {
 public:
  explicit PagedAttention(const AttentionArgs& a) : a_(a), group_(a.num_heads / a.num_kv_heads) { plan(); }

  // The caller runs compute(i) for every item, in any order and on any thread (most costly
  // first balances best: order() lists them so), and then finish_split(k) for every split group.
  int64_t num_items() const { return int64_t(items_.size()); }
  std::vector<int64_t> order() const;
  void compute(int64_t i, std::vector<float>& scratch) { compute(items_[i], scratch); }
  int64_t num_split_groups() const { return int64_t(split_groups_.size()); }
  void finish_split(int64_t k) const { finish_split(split_groups_[k].first, split_groups_[k].second); }

 private:
  // Rows of an item: (token t, query head) for t in [tok_begin, tok_end) and the query heads of
  // kv heads [kv_begin, kv_end); row i is token tok_begin + i / (heads * group), kv head
  // kv_begin + i / group % heads, query head (that kv head) * group + i % group.
  struct Item {
    int req, kv_begin, kv_end, tok_begin, tok_end;  // tokens relative to the request's first new token
    int part_begin, part_end;                        // partitions of keys this item computes
    int64_t partial;                                 // -1: writes the output; else its slot in partials_
    int64_t cost;
  };

  const AttentionArgs& a_;
  const int group_;
  std::vector<Item> items_;
  std::vector<float> partials_;  // per split item: its rows' (m, l, o[head_dim])
  std::vector<std::pair<int, int>> split_groups_;  // (first item, number of items)

  int q_len(int r) const { return a_.query_start[r + 1] - a_.query_start[r]; }
  int context(int r) const { return a_.seq_lens[r] - q_len(r); }
  // Keys [lo, hi) that the query at request-relative token t sees.
  int key_hi(int r, int t) const { return context(r) + t + 1; }
  int key_lo(int r, int t) const { return a_.window > 0 ? std::max(0, key_hi(r, t) - a_.window) : 0; }

  void plan();
  void compute(const Item& item, std::vector<float>& scratch);
  void finish_split(int first_item, int num_items) const;
  void write_row(int r, int t, int head, const RowState& s) const;
};

template <typename T, int NV>
void PagedAttention<T, NV>::plan() {
  const int64_t row_floats = 2 + a_.head_dim;
  int64_t partial_floats = 0;
  const int tile_tokens = std::max(1, TILE_ROWS / group_);
  for (int r = 0; r < a_.num_reqs; ++r) {
    const int n = q_len(r);
    if (n == 0) continue;
    if (n == 1) {
      // A decode: every kv head in one item, so its blocks stream through memory in order; a
      // long one is split by partition (merged after), so it spreads over the threads.
      const int lo = key_lo(r, 0), hi = key_hi(r, 0), heads = a_.num_kv_heads;
      const int pb = lo / PARTITION, pe = (hi - 1) / PARTITION + 1;
      if (pe - pb == 1) {
        items_.push_back({r, 0, heads, 0, 1, pb, pe, -1, int64_t(hi - lo) * a_.num_heads});
        continue;
      }
      split_groups_.push_back({int(items_.size()), pe - pb});
      for (int p = pb; p < pe; ++p) {
        const int keys = std::min(hi, (p + 1) * PARTITION) - std::max(lo, p * PARTITION);
        items_.push_back({r, 0, heads, 0, 1, p, p + 1, partial_floats, int64_t(keys) * a_.num_heads});
        partial_floats += a_.num_heads * row_floats;
      }
      continue;
    }
    // Prefill rows: tiles of tokens, one kv head each (the tile's keys stay in cache across its rows).
    for (int t0 = 0; t0 < n; t0 += tile_tokens) {
      const int t1 = std::min(n, t0 + tile_tokens);
      const int lo = key_lo(r, t0), hi = key_hi(r, t1 - 1);
      const int pb = lo / PARTITION, pe = (hi - 1) / PARTITION + 1;
      for (int h = 0; h < a_.num_kv_heads; ++h)
        items_.push_back({r, h, h + 1, t0, t1, pb, pe, -1, int64_t(hi - lo) * (t1 - t0) * group_});
    }
  }
  partials_.resize(partial_floats);
}

template <typename T, int NV>
std::vector<int64_t> PagedAttention<T, NV>::order() const {
  std::vector<int64_t> idx(items_.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = int64_t(i);
  std::stable_sort(idx.begin(), idx.end(), [this](int64_t x, int64_t y) { return items_[x].cost > items_[y].cost; });
  return idx;
}

template <typename T, int NV>
void PagedAttention<T, NV>::write_row(int r, int t, int head, const RowState& s) const {
  T* out = static_cast<T*>(a_.out) + (a_.query_start[r] + t) * a_.o_tok_stride + head * a_.o_head_stride;
  Vec inv = Vec::set1(1.0f / s.l);
  for (int v = 0; v < NV; ++v) (Vec::load(s.o + v * W) * inv).store(out + v * W);
}

// Scores of one row against a chunk of W keys, as dot products (decode rows: a handful of rows
// per chunk, so the keys are read as they lie): lane j = q . k_j, summed by transpose_sum.
template <int NV>
ALWAYS_INLINE Vec scores_by_dot(const float* q, const float* const* krow) {
  Vec acc[W];
  UNROLL for (int j = 0; j < W; ++j) acc[j] = Vec::zero();
  for (int v = 0; v < NV; ++v) {
    const Vec qv = Vec::load(q + v * W);
    UNROLL for (int j = 0; j < W; ++j) acc[j] = fmadd(qv, Vec::load(krow[j] + v * W), acc[j]);
  }
  return transpose_sum(acc);
}

// Keys per online-softmax update of prefill rows: KT chunks of W. RB x KT score accumulators
// hide the FMA latency (4 rows x 1 chunk left half the FMA slots idle) and the max, exp and
// rescale bookkeeping is paid once per tile, not once per chunk.
constexpr int KT = W == 16 ? 4 : 2;  // AVX-512: 16 accumulators of 32 registers; AVX2: 8 of 16
constexpr int TK = KT * W;

// Scores of RB rows against a tile of KT chunks whose keys are staged transposed
// (kt[(c * HD + d) * W + j] = key c * W + j, dim d): lane j of out[r][c] = sum over d of
// q_r[d] * k[d], in order of d (prefill rows: many rows share the transpose).
template <int NV, int RB>
ALWAYS_INLINE void scores_by_broadcast(const float* const* q, const float* kt, Vec (*out)[KT]) {
  constexpr int HD = NV * W;
  Vec acc[RB][KT];
  UNROLL for (int r = 0; r < RB; ++r)
    UNROLL for (int c = 0; c < KT; ++c) acc[r][c] = Vec::zero();
  for (int d = 0; d < HD; ++d) {
    Vec k[KT];
    UNROLL for (int c = 0; c < KT; ++c) k[c] = Vec::load(kt + (c * HD + d) * W);
    UNROLL for (int r = 0; r < RB; ++r) {
      const Vec qd = Vec::set1(q[r][d]);
      UNROLL for (int c = 0; c < KT; ++c) acc[r][c] = fmadd(qd, k[c], acc[r][c]);
    }
  }
  UNROLL for (int r = 0; r < RB; ++r)
    UNROLL for (int c = 0; c < KT; ++c) out[r][c] = acc[r][c];
}

#if defined(__AVX512F__)
// scores_by_broadcast for bf16 queries and keys, two dims per VDPBF16PS: keys staged transposed
// in pairs of dims (kt[(c * HD / 2 + d) * W + j] = key c * W + j, dims 2d and 2d + 1, as one
// 32-bit word), each row's query as the same pairs. A bf16 product is exact in float, so what
// differs from the float way is the order of the sums (by pairs of dims, in order of d) and
// VDPBF16PS's denormals (inputs read as zero, results flushed); a row's
// sums are still its own. Called only where cpu_has_avx512_bf16().
template <int NV, int RB>
ENGINE_TARGET_BF16 __attribute__((noinline)) void scores_by_bf16_pairs(const uint32_t* const* q, const uint32_t* kt,
                                                                       Vec (*out)[KT]) {
  constexpr int HP = NV * W / 2;
  __m512 acc[RB][KT];
  UNROLL for (int r = 0; r < RB; ++r)
    UNROLL for (int c = 0; c < KT; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int d = 0; d < HP; ++d) {
    __m512bh k[KT];
    UNROLL for (int c = 0; c < KT; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kt + (c * HP + d) * W);
    UNROLL for (int r = 0; r < RB; ++r) {
      const __m512bh qd = (__m512bh)_mm512_set1_epi32(int(q[r][d]));
      UNROLL for (int c = 0; c < KT; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qd, k[c]);
    }
  }
  UNROLL for (int r = 0; r < RB; ++r)
    UNROLL for (int c = 0; c < KT; ++c) out[r][c] = acc[r][c];
}
#endif

// o_r = o_r * alpha_r + sum over keys j in [j0, j1), in order, of p_r[j] * v_j, for RB rows at
// once (keys a row does not see have p = 0 and finite v, so they add an exact zero).
template <int NV, int RB>
ALWAYS_INLINE void accumulate_values(float* const* o, const float* const* p, const float* alpha, const float* const* vrow,
                              int j0, int j1) {
  // RB x VB accumulators and VB values stay in registers: 32 on AVX-512, 16 on AVX2.
  constexpr int VB = (W == 16 && NV % 4 == 0) ? 4 : (NV % 2 == 0 ? 2 : 1);
  static_assert(NV % VB == 0, "VB must divide NV");
  for (int vb = 0; vb < NV; vb += VB) {
    Vec acc[RB][VB];
    UNROLL for (int r = 0; r < RB; ++r)
      UNROLL for (int u = 0; u < VB; ++u) acc[r][u] = Vec::load(o[r] + (vb + u) * W) * Vec::set1(alpha[r]);
    for (int j = j0; j < j1; ++j) {
      Vec val[VB];
      UNROLL for (int u = 0; u < VB; ++u) val[u] = Vec::load(vrow[j] + (vb + u) * W);
      UNROLL for (int r = 0; r < RB; ++r) {
        const Vec pj = Vec::set1(p[r][j]);
        UNROLL for (int u = 0; u < VB; ++u) acc[r][u] = fmadd(pj, val[u], acc[r][u]);
      }
    }
    UNROLL for (int r = 0; r < RB; ++r)
      UNROLL for (int u = 0; u < VB; ++u) acc[r][u].store(o[r] + (vb + u) * W);
  }
}

#if defined(__AVX512F__)
// accumulate_values for bf16 values, two keys per VDPBF16PS: values staged in pairs of keys
// (vp[(j / 2) * HD + d] = value j, dim d in the low half, value j + 1 in the high half), the
// probabilities rounded to bf16 (as PyTorch's CPU flash attention rounds them for its bf16 GEMM;
// the row's sum l adds the rounded ones, so they still sum to one), p[r] their pairs.
template <int NV, int RB>
ENGINE_TARGET_BF16 __attribute__((noinline)) void accumulate_value_pairs(float* const* o, const uint32_t* const* p,
                                                                         const float* alpha, const uint32_t* vp,
                                                                         int jp0, int jp1) {
  constexpr int HD = NV * W;
  constexpr int VB = NV % 4 == 0 ? 4 : (NV % 2 == 0 ? 2 : 1);
  for (int vb = 0; vb < NV; vb += VB) {
    __m512 acc[RB][VB];
    UNROLL for (int r = 0; r < RB; ++r)
      UNROLL for (int u = 0; u < VB; ++u)
        acc[r][u] = _mm512_mul_ps(_mm512_loadu_ps(o[r] + (vb + u) * W), _mm512_set1_ps(alpha[r]));
    for (int jp = jp0; jp < jp1; ++jp) {
      __m512bh val[VB];
      UNROLL for (int u = 0; u < VB; ++u) val[u] = (__m512bh)_mm512_loadu_si512(vp + jp * HD + (vb + u) * W);
      UNROLL for (int r = 0; r < RB; ++r) {
        const __m512bh pj = (__m512bh)_mm512_set1_epi32(int(p[r][jp]));
        UNROLL for (int u = 0; u < VB; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], pj, val[u]);
      }
    }
    UNROLL for (int r = 0; r < RB; ++r)
      UNROLL for (int u = 0; u < VB; ++u) _mm512_storeu_ps(o[r] + (vb + u) * W, acc[r][u]);
  }
}

// e^x for x <= 0 (-inf included: 0) to ~2e-6 relative, enough for a value rounded to bf16 next
// (its half ulp is 2e-3): x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-5 Taylor polynomial,
// times 2^n by VSCALEFPS (0 below float's range; the subnormals it gives for x in about
// (-103, -87) become 0 in the bf16 rounding that follows).
ENGINE_TARGET_BF16 inline __m512 exp_to_round_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-110.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 120);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One row's online-softmax update over a tile of TK keys, for the bf16 pairs: its scores s
// (scaled and soft-capped here), seeing keys [klo, khi) of the tile (relative to its first);
// the probabilities are written rounded to bf16 (VCVTNE2PS2BF16, nearest even) and summed as
// rounded (VDPBF16PS by ones); m and l are updated, and the rescale of the row's output returned.
ENGINE_TARGET_BF16 __attribute__((noinline)) inline float softmax_tile_bf16(const Vec* s, float scale, float softcap,
                                                                            int klo, int khi, float& m, float& l,
                                                                            bf16_t* probs) {
  __m512 x[KT];
  __m512 top = _mm512_set1_ps(neg_inf());
  const bool edge = klo > 0 || khi < TK;  // masks only where the row's range starts or ends inside the tile
  for (int c = 0; c < KT; ++c) {
    Vec y = s[c] * Vec::set1(scale);
    if (softcap > 0.0f) y = vtanh(y * Vec::set1(1.0f / softcap)) * Vec::set1(softcap);
    x[c] = y.v;
    if (edge) {
      const int lo = std::clamp(klo - c * W, 0, W), hi = std::clamp(khi - c * W, 0, W);
      const __mmask16 seen = __mmask16(((1u << hi) - 1) & ~((1u << lo) - 1));
      x[c] = _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf()), seen, x[c]);
    }
    top = _mm512_max_ps(top, x[c]);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(top));
  const float alpha = m_new == m ? 1.0f : exp_scalar(m - m_new);  // (exp(0) is exactly 1)
  const __m512 mv = _mm512_set1_ps(m_new);
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < KT; c += 2) {
    const __m512bh e = _mm512_cvtne2ps_pbh(exp_to_round_bf16(_mm512_sub_ps(x[c + 1], mv)),
                                           exp_to_round_bf16(_mm512_sub_ps(x[c], mv)));
    _mm512_storeu_si512(probs + c * W, (__m512i)e);
    sum = _mm512_dpbf16_ps(sum, e, ones);
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
  return alpha;
}

// The 16 x 16 32-bit words in r, transposed in place (three rounds of unpacks and lane shuffles).
inline void transpose_16x16(__m512i* r) {
  __m512i t[16];
  UNROLL for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4g + k]: rows 4g..4g+3 of columns k, k + 4, k + 8, k + 12, one per 128-bit lane
  __m512i u[16];
  UNROLL for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  UNROLL for (int k = 0; k < 4; ++k) {
    const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), b = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i c = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd), d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    r[k] = _mm512_shuffle_i32x4(a, b, 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(a, b, 0xdd);
    r[k + 4] = _mm512_shuffle_i32x4(c, d, 0x88);
    r[k + 12] = _mm512_shuffle_i32x4(c, d, 0xdd);
  }
}

// Chunk c of a tile's keys (key(j): key j's bf16 row, null outside the partition: zeros) into
// dst in pairs of dims, transposed: dst[d * W + j] = key c * W + j, dims 2d and 2d + 1.
template <int NV, typename Key>
inline void stage_key_pairs(Key&& key, int c, uint32_t* dst) {
  constexpr int HP = NV * W / 2;  // pairs per key
  for (int p0 = 0; p0 < HP; p0 += W) {
    const int n = std::min(W, HP - p0);
    const __mmask16 live = __mmask16((1u << n) - 1);
    __m512i rows[W];
    UNROLL for (int j = 0; j < W; ++j) {
      const bf16_t* k = key(c * W + j);
      rows[j] = k ? _mm512_maskz_loadu_epi32(live, k + 2 * p0) : _mm512_setzero_si512();
    }
    transpose_16x16(rows);
    for (int d = 0; d < n; ++d) _mm512_storeu_si512(dst + (p0 + d) * W, rows[d]);
  }
}

// vp's pair of keys (a, b), either null for a key outside the partition (zeros).
inline void stage_value_pair(const bf16_t* a, const bf16_t* b, uint32_t* dst, int nv) {
  for (int v = 0; v < nv; ++v) {
    const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + v * W)))
                         : _mm512_setzero_si512();
    const __m512i hi = b ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + v * W))), 16)
                         : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + v * W, _mm512_or_si512(lo, hi));
  }
}
#endif

#if !defined(__AVX512F__)
// The 8 x 8 floats in r, transposed in place (unpacks, in-lane shuffles, then the lane halves).
inline void transpose_8x8(__m256* r) {
  __m256 t[8], u[8];
  UNROLL for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  UNROLL for (int h = 0; h < 2; ++h) {  // rows 0-3, then rows 4-7
    u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xee);
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xee);
  }
  UNROLL for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[k + 4] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}
#endif

// One chunk of W float keys (rows[j]: key j, the zero row outside the partition) into dst
// transposed: dst[d * W + j] = key j, dim d; moved in W x W blocks through registers (float
// prefill attention 1.07-1.10x faster than with the scalar loop this replaced, in
// benchmarks/attention_ab.py). Moves only: the scores are the same bits.
template <int NV>
inline void stage_keys_transposed(const float* const* rows, float* dst) {
  constexpr int HD = NV * W;
  for (int d0 = 0; d0 < HD; d0 += W) {
#if defined(__AVX512F__)
    __m512i r[W];
    UNROLL for (int j = 0; j < W; ++j) r[j] = _mm512_loadu_si512(rows[j] + d0);
    transpose_16x16(r);
    UNROLL for (int d = 0; d < W; ++d) _mm512_storeu_si512(dst + (d0 + d) * W, r[d]);
#else
    __m256 r[W];
    UNROLL for (int j = 0; j < W; ++j) r[j] = _mm256_loadu_ps(rows[j] + d0);
    transpose_8x8(r);
    UNROLL for (int d = 0; d < W; ++d) _mm256_storeu_ps(dst + (d0 + d) * W, r[d]);
#endif
  }
}

// f(integral_constant<rb>) for a block of 1 to 4 rows.
template <typename F>
inline void with_rows(int rb, F&& f) {
  switch (rb) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

template <typename T, int NV>
void PagedAttention<T, NV>::compute(const Item& it, std::vector<float>& scratch) {
  constexpr int HD = NV * W;
  constexpr int RB = 4;
  const int g = group_, heads = it.kv_end - it.kv_begin, per_token = heads * g;
  const int rows = (it.tok_end - it.tok_begin) * per_token;
  // bf16 K/V on a CPU with VDPBF16PS: every row (decodes too, so a token computes the same bits
  // as a decode as inside a prefill chunk) takes tiles of TK keys, two products per instruction
  // from the bf16 bits as they are (the bf16 pairs: scores_by_bf16_pairs, softmax_tile_bf16,
  // accumulate_value_pairs).
#if defined(__AVX512F__)
  const bool bf16_pairs = std::is_same_v<T, bf16_t> && cpu_has_avx512_bf16();
#else
  constexpr bool bf16_pairs = false;
#endif
  // Otherwise decode rows' scores are dot products of keys read in place (scores_by_dot), one
  // chunk of W keys per step of the loop below; prefill rows take tiles of KT chunks.
  const bool by_dot = q_len(it.req) == 1 && !bf16_pairs;
  const int tile_keys = by_dot ? W : TK, chunks = by_dot ? 1 : KT;
  // scratch: q rows, run o, partition o, staged K (as rows, and transposed) and V, a zero row,
  // per-row scalars and probabilities, and for the bf16 pairs the q rows and probabilities as bf16
  scratch.resize(size_t(rows) * HD * 3 + size_t(TK) * HD * 3 + HD + size_t(rows) * (6 + TK + HD / 2 + TK / 2));
  float* qf = scratch.data();
  float* run_o = qf + size_t(rows) * HD;
  float* part_o = run_o + size_t(rows) * HD;
  float* kc = part_o + size_t(rows) * HD;
  float* kt = kc + size_t(TK) * HD;
  float* vc = kt + size_t(TK) * HD;
  float* zero = vc + size_t(TK) * HD;
  float* run_m = zero + HD;
  float* run_l = run_m + rows;
  float* part_m = run_l + rows;
  float* part_l = part_m + rows;
  int* row_lo = reinterpret_cast<int*>(part_l + rows);
  int* row_hi = row_lo + rows;
  float* probs = reinterpret_cast<float*>(row_hi + rows);  // [rows][TK]
  uint32_t* q_pairs = reinterpret_cast<uint32_t*>(probs + size_t(rows) * TK);  // [rows][HD / 2]
  uint32_t* kt_pairs = reinterpret_cast<uint32_t*>(kt);  // [KT][HD / 2][W]: kt's room, half used
  bf16_t* probs_bf16 = reinterpret_cast<bf16_t*>(q_pairs + size_t(rows) * HD / 2);  // [rows][TK]
  uint32_t* v_pairs = reinterpret_cast<uint32_t*>(vc);  // [TK / 2][HD]: vc's room, half used
  std::fill(zero, zero + HD, 0.0f);

  const int r = it.req;
  auto head_of = [&](int i) { return (it.kv_begin + i / g % heads) * g + i % g; };
  auto token_of = [&](int i) { return it.tok_begin + i / per_token; };
  const T* q = static_cast<const T*>(a_.q);
  for (int i = 0; i < rows; ++i) {
    const T* src = q + (a_.query_start[r] + token_of(i)) * a_.q_tok_stride + head_of(i) * a_.q_head_stride;
    for (int v = 0; v < NV; ++v) Vec::load(src + v * W).store(qf + size_t(i) * HD + v * W);
    if constexpr (std::is_same_v<T, bf16_t>)
      if (bf16_pairs) std::memcpy(q_pairs + size_t(i) * HD / 2, src, HD * sizeof(bf16_t));
    row_lo[i] = key_lo(r, token_of(i));
    row_hi[i] = key_hi(r, token_of(i));
    run_m[i] = neg_inf();
    run_l[i] = 0.0f;
    std::fill(run_o + size_t(i) * HD, run_o + size_t(i + 1) * HD, 0.0f);
  }
  const int lo = row_lo[0], hi = row_hi[rows - 1];
  const int32_t* table = a_.block_table + int64_t(r) * a_.bt_stride;
  const T* kcache = static_cast<const T*>(a_.k_cache);
  const T* vcache = static_cast<const T*>(a_.v_cache);
  const Vec scale = Vec::set1(a_.scale);
  const bool capped = a_.softcap > 0.0f;
  const Vec cap = Vec::set1(a_.softcap), inv_cap = Vec::set1(capped ? 1.0f / a_.softcap : 0.0f);
  const Vec lane = Vec::iota(), minus_inf = Vec::set1(neg_inf());
  int64_t key_at[TK];  // element offset of each key of the tile (its first kv head), -1 outside
  const float* krow[TK];  // the tile's keys and values as float rows
  const float* vrow[TK];
  const int64_t head_bytes = int64_t(heads) * HD * sizeof(T);

  // Offsets of keys [c0, c0 + tile_keys) through the block table; those outside [k0, k1) get -1.
  auto locate = [&](int c0, int k0, int k1, int64_t* at) {
    int blk = c0 / a_.block_size, off = c0 % a_.block_size;
    for (int j = 0; j < tile_keys; ++j) {
      const int k = c0 + j;
      at[j] = (k < k0 || k >= k1) ? -1
              : int64_t(table[blk]) * a_.kv_block_stride + int64_t(off) * a_.kv_tok_stride +
                    int64_t(it.kv_begin) * a_.kv_head_stride;
      if (++off == a_.block_size) { off = 0; ++blk; }
    }
  };

  for (int part = it.part_begin; part < it.part_end; ++part) {
    const int pk0 = std::max(lo, part * PARTITION), pk1 = std::min(hi, (part + 1) * PARTITION);
    for (int i = 0; i < rows; ++i) {
      part_m[i] = neg_inf();
      part_l[i] = 0.0f;
      std::fill(part_o + size_t(i) * HD, part_o + size_t(i + 1) * HD, 0.0f);
    }
    // Tiles start at multiples of tile_keys (absolute positions: a row's arithmetic is its own).
    locate(pk0 / tile_keys * tile_keys, pk0, pk1, key_at);
    for (int c0 = pk0 / tile_keys * tile_keys; c0 < pk1; c0 += tile_keys) {
      int64_t next_at[TK];
      const bool more = c0 + tile_keys < pk1;
      if (more) locate(c0 + tile_keys, pk0, pk1, next_at);
      if (more) {  // start the next tile's loads now: blocks lie anywhere in the pool
        for (int j = 0; j < tile_keys; ++j) {
          if (next_at[j] < 0) continue;
          const char* kp = reinterpret_cast<const char*>(kcache + next_at[j]);
          const char* vp = reinterpret_cast<const char*>(vcache + next_at[j]);
          for (int64_t b = 0; b < head_bytes; b += 64) {
            _mm_prefetch(kp + b, _MM_HINT_T0);
            _mm_prefetch(vp + b, _MM_HINT_T0);
          }
        }
      }
      for (int hh = 0; hh < heads; ++hh) {
        // Stage this kv head's keys and values of the tile as float rows; keys outside
        // [pk0, pk1) read zeros.
        for (int j = 0; j < tile_keys && !bf16_pairs; ++j) {
          if (key_at[j] < 0) {
            krow[j] = vrow[j] = zero;
            continue;
          }
          const int64_t at = key_at[j] + int64_t(hh) * a_.kv_head_stride;
          if constexpr (std::is_same_v<T, float>) {
            krow[j] = kcache + at;
            vrow[j] = vcache + at;
          } else {
            for (int v = 0; v < NV; ++v) {
              Vec::load(kcache + at + v * W).store(kc + j * HD + v * W);
              Vec::load(vcache + at + v * W).store(vc + j * HD + v * W);
            }
            krow[j] = kc + j * HD;
            vrow[j] = vc + j * HD;
          }
        }
        if (bf16_pairs) {
#if defined(__AVX512F__)
          if constexpr (std::is_same_v<T, bf16_t>) {
            // Key or value j of the tile in this kv head, null outside the partition.
            auto row = [&](const T* cache, int j) {
              return key_at[j] < 0 ? nullptr : cache + key_at[j] + int64_t(hh) * a_.kv_head_stride;
            };
            for (int c = 0; c < KT; ++c)
              stage_key_pairs<NV>([&](int j) { return row(kcache, j); }, c, kt_pairs + c * HD / 2 * W);
            for (int j = 0; j < tile_keys; j += 2)
              stage_value_pair(row(vcache, j), row(vcache, j + 1), v_pairs + j / 2 * HD, NV);
          }
#endif
        } else if (!by_dot) {
          for (int c = 0; c < KT; ++c) stage_keys_transposed<NV>(krow + c * W, kt + c * HD * W);
        }

        // This head's rows in blocks of RB (a row that sees nothing of the chunk is skipped:
        // it would add nothing), each: scores, its mask, the online-softmax update, then the values.
        int active[RB], na = 0;
        auto flush = [&]() {
          float* o[RB];
          const float* pp[RB];
          float alpha[RB];
          Vec s[RB][KT];
          int j0 = tile_keys, j1 = 0;
          const float* qrows[RB];
          for (int b = 0; b < na; ++b) qrows[b] = qf + size_t(active[b]) * HD;
          if (by_dot) {
            for (int b = 0; b < na; ++b) s[b][0] = scores_by_dot<NV>(qrows[b], krow);
#if defined(__AVX512F__)
          } else if (bf16_pairs) {
            const uint32_t* qp[RB];
            for (int b = 0; b < na; ++b) qp[b] = q_pairs + size_t(active[b]) * HD / 2;
            with_rows(na, [&](auto rb) { scores_by_bf16_pairs<NV, decltype(rb)::value>(qp, kt_pairs, s); });
#endif
          } else {
            with_rows(na, [&](auto rb) { scores_by_broadcast<NV, decltype(rb)::value>(qrows, kt, s); });
          }
          for (int b = 0; b < na; ++b) {
            const int i = active[b];
            const int klo = std::max(row_lo[i], pk0), khi = std::min(row_hi[i], pk1);
            o[b] = part_o + size_t(i) * HD;
            j0 = std::min(j0, std::max(klo - c0, 0));
            j1 = std::max(j1, std::min(khi - c0, tile_keys));
#if defined(__AVX512F__)
            if (bf16_pairs) {
              alpha[b] = softmax_tile_bf16(s[b], a_.scale, a_.softcap, klo - c0, khi - c0, part_m[i], part_l[i],
                                           probs_bf16 + size_t(i) * TK);
              continue;
            }
#endif
            Vec x[KT];
            Vec top = minus_inf;
            for (int c = 0; c < chunks; ++c) {
              Vec y = s[b][c] * scale;
              if (capped) y = vtanh(y * inv_cap) * cap;
              const int at = c0 + c * W;  // lanes outside [klo, khi): -inf
              y = where_less(lane, Vec::set1(float(klo - at)), minus_inf, y);
              x[c] = where_less(lane, Vec::set1(float(khi - at)), y, minus_inf);
              top = vmax(top, x[c]);
            }
            const float m_new = std::max(part_m[i], reduce_max(top));
            // exp(0) is exactly 1: an unchanged max rescales nothing, so skip the exp.
            alpha[b] = m_new == part_m[i] ? 1.0f : exp_scalar(part_m[i] - m_new);
            Vec sum = Vec::zero();
            for (int c = 0; c < chunks; ++c) {
              const Vec e = vexp(x[c] - Vec::set1(m_new));
              sum = sum + e;
              e.store(probs + size_t(i) * TK + c * W);
            }
            part_l[i] = part_l[i] * alpha[b] + reduce_add(sum);
            part_m[i] = m_new;
            pp[b] = probs + size_t(i) * TK;
          }
#if defined(__AVX512F__)
          if (bf16_pairs) {
            const uint32_t* ppairs[RB];
            for (int b = 0; b < na; ++b)
              ppairs[b] = reinterpret_cast<const uint32_t*>(probs_bf16 + size_t(active[b]) * TK);
            with_rows(na, [&](auto rb) {
              accumulate_value_pairs<NV, decltype(rb)::value>(o, ppairs, alpha, v_pairs, j0 / 2, (j1 + 1) / 2);
            });
            na = 0;
            return;
          }
#endif
          with_rows(na, [&](auto rb) { accumulate_values<NV, decltype(rb)::value>(o, pp, alpha, vrow, j0, j1); });
          na = 0;
        };
        for (int i = hh * g; i < rows; i += (i % g == g - 1) ? per_token - g + 1 : 1) {
          const int klo = std::max(row_lo[i], pk0), khi = std::min(row_hi[i], pk1);
          if (klo >= khi || khi <= c0 || klo >= c0 + tile_keys) continue;  // nothing this row sees in the tile
          active[na++] = i;
          if (na == RB) flush();
        }
        if (na > 0) flush();
      }
      if (more) std::copy(next_at, next_at + tile_keys, key_at);
    }
    if (it.partial >= 0) {  // a split decode: hand the partition's state to finish_split
      float* dst = partials_.data() + it.partial;
      for (int i = 0; i < rows; ++i, dst += 2 + HD) {
        dst[0] = part_m[i];
        dst[1] = part_l[i];
        std::copy(part_o + size_t(i) * HD, part_o + size_t(i + 1) * HD, dst + 2);
      }
      return;
    }
    for (int i = 0; i < rows; ++i) {
      RowState st{run_m[i], run_l[i], run_o + size_t(i) * HD};
      merge_state(st, part_m[i], part_l[i], part_o + size_t(i) * HD, NV);
      run_m[i] = st.m;
      run_l[i] = st.l;
    }
  }
  for (int i = 0; i < rows; ++i)
    write_row(r, token_of(i), head_of(i), RowState{run_m[i], run_l[i], run_o + size_t(i) * HD});
}

// Items [first, first + n) are one split decode (same request, partitions in order).
template <typename T, int NV>
void PagedAttention<T, NV>::finish_split(int first, int n) const {
  const int hd = a_.head_dim, rows = a_.num_heads;
  std::vector<float> o(size_t(rows) * hd, 0.0f);
  for (int i = 0; i < rows; ++i) {  // row i is query head i (all kv heads, in order)
    RowState s{neg_inf(), 0.0f, o.data() + size_t(i) * hd};
    for (int k = 0; k < n; ++k) {
      const float* src = partials_.data() + items_[first + k].partial + int64_t(i) * (2 + hd);
      merge_state(s, src[0], src[1], src + 2, NV);
    }
    write_row(items_[first].req, 0, i, s);
  }
}

}  // namespace engine_cpu
