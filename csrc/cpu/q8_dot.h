// Q8_0 weights by integer dot products, as llama.cpp multiplies them: the activations are
// rounded to Q8_0 too, per row and per block of 32 values, at the layer's input
// (quantize_activations_q8: d = amax / 127, q = round-half-even(x / d) in [-127, 127]), and
// then each block's dot product is an integer sum, scaled once by d_w * d_x in float32:
//
//   y[n] = sum over blocks b of  d_w[n][b] * d_x[b] * sum_i q_w[n][b][i] * q_x[b][i]
//
// Only the activation rounding differs from x @ dequantize(W)^T (its relative error is about
// 1 / 254 of a block's largest value; docs/quantization.md measures the perplexity), and every
// ISA computes the same rounding; the float32 sums differ only in order (and on VNNI by the
// offset below, taken off in float32). tests/conftest.py's rounded_to_q8_0 is the same rounding
// in torch, written apart from this file (the dense fallback does not round).
//
// Two kernels, the same sums:
//  - q8_dot_rows_vnni (AVX512-VNNI, vpdpbusd: unsigned bytes x signed bytes, 64 products and
//    their sums by fours per instruction). The weights are made unsigned by flipping their sign
//    bit (q_w + 128, once per block for all rows); the excess, 128 * sum(q_x) per block, is
//    taken off at the end as sum over blocks of d_w * offset_x (offset_x = 128 * d_x * sum(q_x),
//    per activation block, 16 blocks per FMA).
//  - q8_dot_rows_maddubs (AVX2: vpmaddubsw, pairs of products summed in 16 bits): |q_w| as
//    unsigned bytes times q_x carrying q_w's sign; |q_w| <= 128 and |q_x| <= 127, so a pair
//    never saturates 16 bits (2 * 128 * 127 = 32512).
// Invariant (as quant_linear.h's): each activation row has its own accumulators, fed in the
// same order, so a row's result never depends on the batch around it.
#pragma once

#include <vector>

#include "quant_linear.h"

namespace engine_cpu {

// The rows of a layer's input rounded to Q8_0, laid out for both kernels.
struct Q8Activations {
  int64_t k = 0, groups = 0, pairs = 0;
  std::vector<int8_t> q;             // [rows][k]
  std::vector<float> scale;          // [rows][groups]: d_x
  std::vector<float> pair_scale;     // [rows][pairs][16]: [d_x(A) x8 | d_x(B) x8] per pair of blocks
  std::vector<float> offset;         // [rows][groups]: 128 * d_x * sum(q_x)
  Q8Activations(int64_t rows, int64_t k_)
      : k(k_), groups(k_ / kQK), pairs((k_ / kQK + 1) / 2), q(rows * k_), scale(rows * groups),
        pair_scale(rows * pairs * 16, 0.0f), offset(rows * groups) {}
};

// 32 floats rounded to nearest even and narrowed to int8 (they are within [-127, 127]).
ALWAYS_INLINE void round_to_int8(const Vec* v, float inverse, int8_t* q) {
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(inverse);
  UNROLL for (int i = 0; i < kQK / W; ++i)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * W),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v[i].v, s))));
#else
  const __m256 s = _mm256_set1_ps(inverse);
  __m256i i32[4];
  UNROLL for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i].v, s));
  // packs work within 128-bit lanes: [0 1 2 3 | 4 5 6 7] of dwords ends permuted; undo it.
  const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i8);
#endif
}

inline int32_t sum_int8(const int8_t* q) {  // the sum of 32 int8
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Row `row` of a: k values of x rounded block by block. A block with a NaN or an infinity gets
// scale NaN (its integers 0), so the layer's outputs are NaN as a float product's would be; a
// block whose scale would be subnormal or 0 (all of it below 127 * FLT_MIN) rounds to zeros.
template <typename T>
void quantize_activations_q8(Q8Activations& a, int64_t row, const T* x) {
  for (int64_t g = 0; g < a.groups; ++g) {
    Vec v[kQK / W], amax = Vec::zero(), nonfinite = Vec::zero();
    UNROLL for (int i = 0; i < kQK / W; ++i) {
      v[i] = Vec::load(x + g * kQK + i * W);
      amax = vmax(amax, vabs(v[i]));
      nonfinite = nonfinite + (v[i] - v[i]);  // 0 exactly, unless some lane is NaN or infinite
    }
    float d = reduce_max(amax) / 127.0f, inverse = 1.0f / d;
    if (reduce_add(nonfinite) != 0.0f) {  // (NaN too)
      d = std::numeric_limits<float>::quiet_NaN(), inverse = 0.0f;
    } else if (!(d >= std::numeric_limits<float>::min())) {
      d = 0.0f, inverse = 0.0f;
    }
    int8_t* q = a.q.data() + row * a.k + g * kQK;
    round_to_int8(v, inverse, q);
    a.scale[row * a.groups + g] = d;
    a.offset[row * a.groups + g] = d * float(128 * sum_int8(q));  // 128 * sum: exact in float (< 2^19)
    float* pair = a.pair_scale.data() + (row * a.pairs + g / 2) * 16 + (g % 2) * 8;
    for (int i = 0; i < 8; ++i) pair[i] = d;
  }
}

inline float sum_lanes(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// out[r][n - base] for activation rows [row, row + R) of a and weight rows n in [n0, n1).
template <int R>
void q8_dot_rows_maddubs(float* out, int64_t out_stride, int64_t base, const Q8Activations& a, int64_t row,
                         const uint8_t* w, int64_t n0, int64_t n1) {
  const int64_t groups = a.groups, row_bytes = groups * block_bytes(kQ8_0);
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(64) float d[kScaleStage];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* ints = w + n * row_bytes;
    prefetch(ints + row_bytes, row_bytes);
    __m256 acc[2][R];  // two chains per row, alternate blocks
    UNROLL for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    auto block = [&](int64_t j, int64_t g, __m256* chain) {
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ints + g * kQK));
      const __m256i magnitude = _mm256_abs_epi8(wq);
      const __m256 dw = _mm256_set1_ps(d[j]);
      UNROLL for (int r = 0; r < R; ++r) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (row + r) * a.k + g * kQK));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xq, wq)), ones);
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.scale[(row + r) * groups + g]));
        chain[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, chain[r]);
      }
    };
    for (int64_t g0 = 0; g0 < groups; g0 += kScaleStage) {
      const int64_t stage = std::min<int64_t>(kScaleStage, groups - g0);
      widen_halves(d, ints + groups * kQK + 2 * g0, stage);
      int64_t j = 0;
      for (; j + 2 <= stage; j += 2) {
        block(j, g0 + j, acc[0]);
        block(j + 1, g0 + j + 1, acc[1]);
      }
      if (j < stage) block(j, g0 + j, acc[0]);
    }
    UNROLL for (int r = 0; r < R; ++r)
      out[r * out_stride + n - base] = sum_lanes(_mm256_add_ps(acc[0][r], acc[1][r]));
  }
}

#if defined(__AVX512F__)
#define ENGINE_TARGET_VNNI __attribute__((target("avx512vnni")))

inline bool cpu_has_avx512_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
}

// As q8_dot_rows_maddubs, two blocks per register: lanes 0-7 sum block A's products, 8-15
// block B's; a row's last block, when its count is odd, pairs with nothing (masked loads: its
// B half reads zeros and its B scale is 0).
template <int R>
ENGINE_TARGET_VNNI void q8_dot_rows_vnni(float* out, int64_t out_stride, int64_t base, const Q8Activations& a,
                                         int64_t row, const uint8_t* w, int64_t n0, int64_t n1) {
  const int64_t groups = a.groups, row_bytes = groups * block_bytes(kQ8_0);
  const __m512i sign_bit = _mm512_set1_epi8(char(0x80));
  const __m512i pair_scale = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  alignas(64) float d[kScaleStage + 1];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* ints = w + n * row_bytes;
    prefetch(ints + row_bytes, row_bytes);
    __m512 acc[2][R];
    UNROLL for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    // Blocks g and g + 1 (live: the bytes that exist); j: g's index in the stage of scales.
    auto pair = [&](int64_t j, int64_t g, __mmask64 live, __m512* chain) ENGINE_TARGET_VNNI {
      const __m512i wu = _mm512_xor_si512(_mm512_maskz_loadu_epi8(live, ints + g * kQK), sign_bit);
      const __m512 dw = _mm512_permutexvar_ps(
          pair_scale, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d + j)))));
      UNROLL for (int r = 0; r < R; ++r) {
        const __m512i xq = _mm512_maskz_loadu_epi8(live, a.q.data() + (row + r) * a.k + g * kQK);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xq);
        const __m512 dx = _mm512_loadu_ps(a.pair_scale.data() + ((row + r) * a.pairs + g / 2) * 16);
        chain[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dx, dw), chain[r]);
      }
    };
    for (int64_t g0 = 0; g0 < groups; g0 += kScaleStage) {
      const int64_t stage = std::min<int64_t>(kScaleStage, groups - g0);
      widen_halves(d, ints + groups * kQK + 2 * g0, stage);
      d[stage] = 0.0f;  // the missing partner of an odd last block (kScaleStage is even)
      int64_t j = 0;
      for (; j + 4 <= stage; j += 4) {
        pair(j, g0 + j, ~__mmask64(0), acc[0]);
        pair(j + 2, g0 + j + 2, ~__mmask64(0), acc[1]);
      }
      for (; j < stage; j += 2) pair(j, g0 + j, j + 1 < stage ? ~__mmask64(0) : __mmask64(0xffffffffu), acc[0]);
    }
    // - sum over blocks of d_w * 128 * d_x * sum(q_x): 16 blocks per FMA
    const uint8_t* scales = ints + groups * kQK;
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 live = __mmask16(groups - g >= 16 ? 0xffff : (1u << (groups - g)) - 1);
      const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, scales + 2 * g));
      UNROLL for (int r = 0; r < R; ++r)
        acc[0][r] = _mm512_fnmadd_ps(dw, _mm512_maskz_loadu_ps(live, a.offset.data() + (row + r) * groups + g),
                                     acc[0][r]);
    }
    UNROLL for (int r = 0; r < R; ++r)
      out[r * out_stride + n - base] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]));
  }
}
#endif

}  // namespace engine_cpu
