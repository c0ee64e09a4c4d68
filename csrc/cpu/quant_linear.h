// Linear layers over weights that stay in GGUF's block formats (Q4_0, Q4_1, Q8_0): y = x W^T,
// W [N, K], each row K/32 blocks of 32 weights:
//
//   Q4_0  d (fp16), 16 bytes of nibbles           w = (q - 8) d
//   Q4_1  d (fp16), m (fp16), 16 bytes of nibbles  w = q d + m
//   Q8_0  d (fp16), 32 int8                        w = q d
//
// The kernel's row layout (engine/worker/quantized.py packs GGUF's blocks into it at load, the
// same bytes in another order): all of a row's integers, block after block, then its K/32
// scales d, then (Q4_1) its K/32 minimums m. A pass over a row widens its scales 16 at a time
// instead of one fp16 broadcast per block. Nibble j (j < 16) of a Q4 block is byte j's low half;
// weight 16 + j is its high half.
//
// Q8_0 rows take integer dot products on activations rounded to Q8_0 (q8_dot.h). Q4 rows take
// one of two ways, chosen per call by the activations' dtype and the CPU alone (never by the
// batch: a row's result is the same in any batch, see quant_dot_rows):
//  - float32 (quant_dot_rows): x widened to float; each block dequantized exactly (q d is
//    exact; Q4_1's + m rounds once, as GGUF's reference), then float32 FMAs. It differs from
//    x @ dequantize(W)^T only in the order of its additions.
//  - bfloat16 dot products (quant_dot_rows_bf16: bf16 activations, Q4 blocks, a CPU with
//    AVX512-BF16): a nibble's integer is exact in bf16 and so is x, so VDPBF16PS's products are
//    exact and summed in float32: per block d * sum(x q) (+ m * sum(x) for Q4_1, sum(x) per
//    block of x in float32), two blocks per register. A third of the float32 way's work per
//    weight, where a single stream is bound by it.
#pragma once

#include "vec.h"

namespace engine_cpu {

enum QuantType : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // GGML's type ids
constexpr int kQK = 32;                                    // weights per block

constexpr int block_bytes(int type) { return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : 34; }

constexpr int int_bytes(int type) { return type == kQ8_0 ? kQK : kQK / 2; }  // a block's integers

// The 32 integers of one Q4 block as floats (Q4_0: q - 8), in 32 / W registers, in weight order.
template <int Type>
ALWAYS_INLINE void unpack_block(const uint8_t* qs, Vec* q) {
  static_assert(Type != kQ8_0, "Q8_0 rows take integer dot products (q8_dot.h)");
#if defined(__AVX512F__)
  {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(b, 4);
    if constexpr (Type == kQ4_0) {
      lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
      hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
    }
    q[0] = _mm512_cvtepi32_ps(lo);
    q[1] = _mm512_cvtepi32_ps(hi);
  }
#else
  {
    UNROLL for (int i = 0; i < 2; ++i) {
      __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i)));
      __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(15)), hi = _mm256_srli_epi32(b, 4);
      if constexpr (Type == kQ4_0) {
        lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(8));
        hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(8));
      }
      q[i] = _mm256_cvtepi32_ps(lo);
      q[2 + i] = _mm256_cvtepi32_ps(hi);
    }
  }
#endif
}

// n fp16 values widened (exactly) to float.
ALWAYS_INLINE void widen_halves(float* dst, const uint8_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) Vec::load(reinterpret_cast<const fp16_t*>(src) + i).store(dst + i);
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    dst[i] = _cvtsh_ss(h);
  }
}

// The next weight row into L1 while this one is summed. Rows are read once, one after another,
// and each pass starts at the row's scales (after its integers): without this, that first touch
// waits on memory (measured: a Q8_0 output layer's single-row pass took 2.3x as long).
ALWAYS_INLINE void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + b), _MM_HINT_T0);
}

constexpr int kScaleStage = 64;  // blocks whose scales are widened at a time (on the stack); even

// The pass over one weight row: its scales widened kScaleStage blocks at a time, then
// block(j, g) for each block in order (j: its index in the stage, g: in the row).
template <int Type, typename F>
ALWAYS_INLINE void for_each_block(const uint8_t* row, int64_t groups, float* d, float* m, F&& block) {
  const uint8_t* scales = row + groups * int_bytes(Type);
  for (int64_t g0 = 0; g0 < groups; g0 += kScaleStage) {
    const int64_t stage = std::min<int64_t>(kScaleStage, groups - g0);
    widen_halves(d, scales + 2 * g0, stage);
    if constexpr (Type == kQ4_1) widen_halves(m, scales + 2 * (groups + g0), stage);
    for (int64_t j = 0; j < stage; ++j) block(j, g0 + j);
  }
}

// out[r][n - base] for rows r < R of x (float, [R][k]) and weight rows n in [n0, n1). Each block
// is unpacked and dequantized once (w = q d, (q - 8) d or q d + m: one rounding, as GGUF's own
// dequantization) and serves all R rows. Invariant: a row's result is the same whatever R is and
// whichever rows share the pass (each row has its own accumulators, fed in the same order), so
// outputs never depend on batching or on how much of a prompt a prefix hit skipped.
template <int Type, int R>
void quant_dot_rows(float* out, int64_t out_stride, int64_t base, const float* x, int64_t k, const uint8_t* w,
                    int64_t n0, int64_t n1) {
  constexpr int V = kQK / W;  // a block's registers: one accumulator chain per row for each
  const int64_t groups = k / kQK, row_bytes = groups * block_bytes(Type);
  alignas(64) float d[kScaleStage], m[kScaleStage];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* ints = w + n * row_bytes;
    prefetch(ints + row_bytes, row_bytes);
    Vec acc[V][R];
    UNROLL for (int v = 0; v < V; ++v) UNROLL for (int r = 0; r < R; ++r) acc[v][r] = Vec::zero();
    for_each_block<Type>(ints, groups, d, m, [&](int64_t j, int64_t g) {
      Vec q[V];
      unpack_block<Type>(ints + g * int_bytes(Type), q);
      const Vec scale = Vec::set1(d[j]);
      if constexpr (Type == kQ4_1) {
        const Vec min = Vec::set1(m[j]);
        UNROLL for (int v = 0; v < V; ++v) q[v] = fmadd(q[v], scale, min);
      } else {
        UNROLL for (int v = 0; v < V; ++v) q[v] = q[v] * scale;
      }
      UNROLL for (int r = 0; r < R; ++r) {
        const float* xg = x + r * k + g * kQK;
        UNROLL for (int v = 0; v < V; ++v) acc[v][r] = fmadd(q[v], Vec::load(xg + v * W), acc[v][r]);
      }
    });
    UNROLL for (int r = 0; r < R; ++r) {
      Vec sum = acc[0][r];
      UNROLL for (int v = 1; v < V; ++v) sum = sum + acc[v][r];
      out[r * out_stride + n - base] = reduce_add(sum);
    }
  }
}

#if defined(__AVX512F__)
inline uint16_t bf16_bits(float v) {  // the top half of an exactly representable float
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return uint16_t(bits >> 16);
}

// The bf16 way (see the top of this file), for Q4_0 and Q4_1, two blocks at a time: one
// 32-byte load holds blocks A and B's nibbles; vpermw turns their low nibbles into
// [A 0..15 | B 0..15] and their high nibbles into [A 16..31 | B 16..31], each as 32 bf16
// integers, so VDPBF16PS's lanes 0-7 sum A's products and lanes 8-15 B's, then one FMA by
// [d_A x8 | d_B x8]. The activations come with each pair of blocks in that order
// (pair_activations: [A 0..15, B 0..15, A 16..31, B 16..31]); a row's last block, when its
// count is odd, alone as [0..31]. out[r][n - base] for rows r < R of x (row r at x + r *
// x_stride) and weight rows n in [n0, n1); sums[r][g] = the sum of block g of row r of the
// activations, in float32 (Q4_1's minimums multiply it). The same invariant as quant_dot_rows:
// each row has its own accumulators, fed in the same order, in any batch.
template <int Type, int R>
ENGINE_TARGET_BF16 void quant_dot_rows_bf16(float* out, int64_t out_stride, int64_t base, const bf16_t* x,
                                            int64_t x_stride, const float* sums, int64_t k, const uint8_t* w,
                                            int64_t n0, int64_t n1) {
  static_assert(Type != kQ8_0, "Q8_0 rows take integer dot products (q8_dot.h)");
  // A nibble's bf16 by table lookup: vpermw reads an index's low 5 bits, so entries j and
  // j + 16 hold the same value and a byte's low nibble needs no mask.
  alignas(64) uint16_t table_values[32];
  for (int j = 0; j < 32; ++j) table_values[j] = bf16_bits(float((j & 15) - (Type == kQ4_0 ? 8 : 0)));
  const __m512i table = _mm512_load_si512(table_values);
  const __m512i pair_scale = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const int64_t groups = k / kQK, row_bytes = groups * block_bytes(Type);
  alignas(64) float d[kScaleStage];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* ints = w + n * row_bytes;
    prefetch(ints + row_bytes, row_bytes);
    // Two chains per row, alternate pairs of blocks: a chain waits on one FMA per two pairs.
    __m512 acc[2][R];
    UNROLL for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    auto pair = [&](int64_t j, int64_t g, __m512* chain) ENGINE_TARGET_BF16 {
      const __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ints + g * kQK / 2)));
      const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(idx, table);
      const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(idx, 4), table);
      const __m512 scale = _mm512_permutexvar_ps(
          pair_scale, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d + j)))));
      UNROLL for (int r = 0; r < R; ++r) {
        const bf16_t* xg = x + r * x_stride + g * kQK;
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(xg));
        dot = _mm512_dpbf16_ps(dot, hi, (__m512bh)_mm512_loadu_si512(xg + kQK));
        chain[r] = _mm512_fmadd_ps(dot, scale, chain[r]);
      }
    };
    for (int64_t g0 = 0; g0 < groups; g0 += kScaleStage) {
      const int64_t stage = std::min<int64_t>(kScaleStage, groups - g0);
      widen_halves(d, ints + groups * int_bytes(Type) + 2 * g0, stage);
      int64_t j = 0;
      for (; j + 4 <= stage; j += 4) {
        pair(j, g0 + j, acc[0]);
        pair(j + 2, g0 + j + 2, acc[1]);
      }
      if (j + 2 <= stage) {
        pair(j, g0 + j, acc[0]);
        j += 2;
      }
      if (j < stage) {  // a last, unpaired block (stage is odd only at the row's end)
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ints + (g0 + j) * kQK / 2)));
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
        const __m512bh q = (__m512bh)_mm512_permutexvar_epi16(idx, table);
        const __m512 scale = _mm512_set1_ps(d[j]);
        UNROLL for (int r = 0; r < R; ++r) {
          const __m512bh xg = (__m512bh)_mm512_loadu_si512(x + r * x_stride + (g0 + j) * kQK);
          acc[1][r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q, xg), scale, acc[1][r]);
        }
      }
    }
    if constexpr (Type == kQ4_1) {  // + sum over blocks of m * sum(x): 16 blocks per FMA
      const uint8_t* mins = ints + groups * (int_bytes(Type) + 2);
      for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 live = __mmask16(groups - g >= 16 ? 0xffff : (1u << (groups - g)) - 1);
        const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mins + 2 * g));
        UNROLL for (int r = 0; r < R; ++r)
          acc[0][r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(live, sums + r * groups + g), acc[0][r]);
      }
    }
    UNROLL for (int r = 0; r < R; ++r)
      out[r * out_stride + n - base] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]));
  }
}

// dst: a row of activations (k values) in the order quant_dot_rows_bf16 reads them: in each
// pair of blocks [A 0..15, A 16..31, B 0..15, B 16..31] becomes [A 0..15, B 0..15, A 16..31,
// B 16..31]; an odd last block stays as it is.
inline void pair_activations(bf16_t* dst, const bf16_t* src, int64_t k) {
  constexpr int64_t half = kQK / 2, bytes = half * sizeof(bf16_t);
  int64_t g = 0;
  for (; g + 2 * kQK <= k; g += 2 * kQK) {
    std::memcpy(dst + g, src + g, bytes);
    std::memcpy(dst + g + half, src + g + kQK, bytes);
    std::memcpy(dst + g + kQK, src + g + half, bytes);
    std::memcpy(dst + g + kQK + half, src + g + kQK + half, bytes);
  }
  std::memcpy(dst + g, src + g, (k - g) * sizeof(bf16_t));
}
#endif

}  // namespace engine_cpu
