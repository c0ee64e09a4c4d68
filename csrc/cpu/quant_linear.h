// Linear layers over weights that stay in GGUF's block formats (Q4_0, Q4_1, Q8_0): y = x W^T,
// W [N, K] stored row by row as K/32 blocks of 32 weights each.
//
//   Q4_0  18 bytes: d (fp16), 16 bytes of nibbles      w = (q - 8) d
//   Q4_1  20 bytes: d (fp16), m (fp16), 16 nibbles     w = q d + m
//   Q8_0  34 bytes: d (fp16), 32 int8                  w = q d
//
// Nibble j (j < 16) of a Q4 block is byte j's low half; weight 16 + j is its high half.
//
// Exactness: the scales are widened from fp16 to float exactly and the integers are exact in
// float, so each weight is dequantized exactly as GGUF's reference does (q d is exact; Q4_1's
// + m rounds once), and a row is a float32 dot product with x: it differs from
// x @ dequantize(W)^T only in the order of its additions.
#pragma once

#include "vec.h"

namespace engine_cpu {

enum QuantType : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // GGML's type ids
constexpr int kQK = 32;                                    // weights per block

constexpr int block_bytes(int type) { return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : 34; }

// An fp16 value in every lane, widened exactly.
ALWAYS_INLINE Vec broadcast_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_set1_epi16(short(h)));
#else
  return _mm256_cvtph_ps(_mm_set1_epi16(short(h)));
#endif
}

// The 32 integers of one block as floats (Q4_0: q - 8), in 32 / W registers, in weight order.
template <int Type>
ALWAYS_INLINE void unpack_block(const uint8_t* qs, Vec* q) {
#if defined(__AVX512F__)
  if constexpr (Type == kQ8_0) {
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16))));
  } else {
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
  if constexpr (Type == kQ8_0) {
    UNROLL for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i))));
  } else {
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

template <int Type>
ALWAYS_INLINE const uint8_t* block_ints(const uint8_t* block) { return block + (Type == kQ4_1 ? 4 : 2); }

// out[r][n - base] for rows r < R of x (float, [R][k]) and weight rows n in [n0, n1). Each block
// is unpacked and dequantized once (w = q d, (q - 8) d or q d + m: one rounding, as GGUF's own
// dequantization) and serves all R rows. Invariant: a row's result is the same whatever R is and
// whichever rows share the pass (each row has its own accumulators, fed in the same order), so
// outputs never depend on batching or on how much of a prompt a prefix hit skipped.
// acc[Chain + v][r] += w_v * x[r] over block g: its weights dequantized once for all R rows.
template <int Type, int R, int Chain, int C>
ALWAYS_INLINE void accumulate_block(Vec (&acc)[C][R], const uint8_t* block, const float* x, int64_t k, int64_t g) {
  constexpr int V = kQK / W;
  Vec q[V];
  unpack_block<Type>(block_ints<Type>(block), q);
  const Vec d = broadcast_half(block);
  if constexpr (Type == kQ4_1) {
    const Vec m = broadcast_half(block + 2);
    UNROLL for (int v = 0; v < V; ++v) q[v] = fmadd(q[v], d, m);
  } else {
    UNROLL for (int v = 0; v < V; ++v) q[v] = q[v] * d;
  }
  UNROLL for (int r = 0; r < R; ++r) {
    const float* xg = x + r * k + g * kQK;
    UNROLL for (int v = 0; v < V; ++v) acc[Chain + v][r] = fmadd(q[v], Vec::load(xg + v * W), acc[Chain + v][r]);
  }
}

template <int Type, int R>
void quant_dot_rows(float* out, int64_t out_stride, int64_t base, const float* x, int64_t k, const uint8_t* w,
                    int64_t n0, int64_t n1) {
  constexpr int V = kQK / W;  // a block's registers: one accumulator chain per row for each
  const int64_t groups = k / kQK, row_bytes = groups * block_bytes(Type);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    Vec acc[V][R];
    UNROLL for (int v = 0; v < V; ++v) UNROLL for (int r = 0; r < R; ++r) acc[v][r] = Vec::zero();
    for (int64_t g = 0; g < groups; ++g) accumulate_block<Type, R, 0>(acc, row + g * block_bytes(Type), x, k, g);
    UNROLL for (int r = 0; r < R; ++r) {
      Vec sum = acc[0][r];
      UNROLL for (int v = 1; v < V; ++v) sum = sum + acc[v][r];
      out[r * out_stride + n - base] = reduce_add(sum);
    }
  }
}

}  // namespace engine_cpu
