// One SIMD register of floats, the same interface on AVX-512 (16 lanes) and AVX2 (8 lanes).
//
// This header is compiled once per ISA, each time into its own extension module
// (engine/_C_avx512, engine/_C_avx2); engine/worker/native.py loads the one the CPU runs.
// Nothing here touches torch: the kernels see raw pointers only.
//
// Storage types: float, bf16_t and fp16_t (16-bit payloads). Loads widen to float, stores
// round to nearest even (torch's rounding: a bfloat16 NaN becomes 0x7FC0), so a kernel that
// rounds wherever torch's eager ops round gives torch's results bit for bit.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// Small fixed-trip loops over registers must be unrolled, or GCC keeps the Vec arrays on the
// stack and every FMA waits on a store.
#define UNROLL _Pragma("GCC unroll 32")
#define ALWAYS_INLINE inline __attribute__((always_inline))

namespace engine_cpu {

struct bf16_t { uint16_t x; };
struct fp16_t { uint16_t x; };

#if defined(__AVX512F__)

// VDPBF16PS (two bf16 products per float lane) in a function of the avx512 build, which runs on
// AVX-512 CPUs with and without it: such a function is called only where this says yes.
#define ENGINE_TARGET_BF16 __attribute__((target("avx512bf16")))
inline bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

struct Vec {
  static constexpr int W = 16;
  __m512 v;
  Vec() = default;
  Vec(__m512 x) : v(x) {}
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const bf16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static Vec load(const fp16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(bf16_t* p) const {
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i hi = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    hi = _mm512_mask_blend_epi32(nan, hi, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(hi));
  }
  void store(fp16_t* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  Vec round_bf16() const {  // nearest even, NaN stays NaN; the low 16 bits cleared
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                 _mm512_set1_epi32(int(0xffff0000u)));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(r), v);
  }
  Vec round_fp16() const { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
};

inline Vec operator+(Vec a, Vec b) { return _mm512_add_ps(a.v, b.v); }
inline Vec operator-(Vec a, Vec b) { return _mm512_sub_ps(a.v, b.v); }
inline Vec operator*(Vec a, Vec b) { return _mm512_mul_ps(a.v, b.v); }
inline Vec operator/(Vec a, Vec b) { return _mm512_div_ps(a.v, b.v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a.v, b.v); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a.v, b.v); }
inline Vec vabs(Vec a) { return _mm512_abs_ps(a.v); }
inline Vec vfloor(Vec a) { return _mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline Vec copysign(Vec magnitude, Vec sign) {
  __m512i m = _mm512_set1_epi32(0x80000000);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(m, _mm512_castps_si512(magnitude.v)),
                                             _mm512_and_si512(m, _mm512_castps_si512(sign.v))));
}
// Lanes where ``a < b`` take ``if_less``, the others keep ``a``'s counterpart ``other``.
inline Vec where_less(Vec a, Vec b, Vec if_less, Vec other) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ), other.v, if_less.v);
}
inline Vec pow2i(Vec n) {  // 2^n for integral n in [-126, 127]
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n.v), _mm512_set1_epi32(127)), 23);
  return _mm512_castsi512_ps(e);
}
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }

// Lane j of the result is the sum of a[j]'s lanes: W horizontal sums in 45 instructions
// (the order of additions is fixed, so a row's score never depends on the batch around it).
inline Vec transpose_sum(const Vec* a) {
  __m512 t[8], u[4];
  UNROLL for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i].v, a[2 * i + 1].v),
                         _mm512_unpackhi_ps(a[2 * i].v, a[2 * i + 1].v));
  UNROLL for (int i = 0; i < 4; ++i) {
    __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(3, 1, 3, 1)));
}

#elif defined(__AVX2__)

struct Vec {
  static constexpr int W = 8;
  __m256 v;
  Vec() = default;
  Vec(__m256 x) : v(x) {}
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(const bf16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static Vec load(const fp16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(bf16_t* p) const {
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i hi = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    hi = _mm256_blendv_epi8(hi, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  void store(fp16_t* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  Vec round_bf16() const {
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_and_si256(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                 _mm256_set1_epi32(int(0xffff0000u)));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  Vec round_fp16() const { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
};

inline Vec operator+(Vec a, Vec b) { return _mm256_add_ps(a.v, b.v); }
inline Vec operator-(Vec a, Vec b) { return _mm256_sub_ps(a.v, b.v); }
inline Vec operator*(Vec a, Vec b) { return _mm256_mul_ps(a.v, b.v); }
inline Vec operator/(Vec a, Vec b) { return _mm256_div_ps(a.v, b.v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a.v, b.v); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a.v, b.v); }
inline Vec vabs(Vec a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v); }
inline Vec vfloor(Vec a) { return _mm256_floor_ps(a.v); }
inline Vec copysign(Vec magnitude, Vec sign) {
  __m256 m = _mm256_set1_ps(-0.0f);
  return _mm256_or_ps(_mm256_andnot_ps(m, magnitude.v), _mm256_and_ps(m, sign.v));
}
inline Vec where_less(Vec a, Vec b, Vec if_less, Vec other) {
  return _mm256_blendv_ps(other.v, if_less.v, _mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ));
}
inline Vec pow2i(Vec n) {
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(e);
}
inline float reduce_add(Vec a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline float reduce_max(Vec a) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline Vec transpose_sum(const Vec* a) {
  __m256 t[4], u[2];
  UNROLL for (int i = 0; i < 4; ++i)
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i].v, a[2 * i + 1].v),
                         _mm256_unpackhi_ps(a[2 * i].v, a[2 * i + 1].v));
  UNROLL for (int i = 0; i < 2; ++i) {
    __m256d x = _mm256_castps_pd(t[2 * i]), y = _mm256_castps_pd(t[2 * i + 1]);
    u[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

#else
#error "csrc/cpu needs AVX2 or AVX-512 (the build compiles it once per ISA with -mavx2 or -mavx512f)"
#endif

constexpr int W = Vec::W;
inline float neg_inf() { return -std::numeric_limits<float>::infinity(); }

// Loads and stores of the first n < W lanes (the rest read as zero).
template <typename T>
inline Vec load_partial(const T* p, int n) {
  T tmp[W];
  std::memset(tmp, 0, sizeof(tmp));
  std::memcpy(tmp, p, sizeof(T) * n);
  return Vec::load(tmp);
}
template <typename T>
inline void store_partial(Vec x, T* p, int n) {
  T tmp[W];
  x.store(tmp);
  std::memcpy(p, tmp, sizeof(T) * n);
}

// Round a float vector to T's precision and back (identity for float), in registers: what
// torch does between two eager ops on a bfloat16 or half tensor.
template <typename T>
inline Vec round_to(Vec x);
template <>
inline Vec round_to<float>(Vec x) { return x; }
template <>
inline Vec round_to<bf16_t>(Vec x) { return x.round_bf16(); }
template <>
inline Vec round_to<fp16_t>(Vec x) { return x.round_fp16(); }

// e^x, Cephes' single-precision polynomial (about 1 ulp); exactly 0 below -87.3 (so e^-inf = 0).
inline Vec vexp(Vec x) {
  const Vec hi = Vec::set1(88.3762626647949f), lo = Vec::set1(-87.3365447505531f);
  Vec under = x;
  x = vmax(vmin(x, hi), lo);
  Vec fx = vfloor(fmadd(x, Vec::set1(1.44269504088896341f), Vec::set1(0.5f)));
  x = x - fx * Vec::set1(0.693359375f);
  x = x - fx * Vec::set1(-2.12194440e-4f);
  Vec y = Vec::set1(1.9875691500E-4f);
  y = fmadd(y, x, Vec::set1(1.3981999507E-3f));
  y = fmadd(y, x, Vec::set1(8.3334519073E-3f));
  y = fmadd(y, x, Vec::set1(4.1665795894E-2f));
  y = fmadd(y, x, Vec::set1(1.6666665459E-1f));
  y = fmadd(y, x, Vec::set1(5.0000001201E-1f));
  y = fmadd(y, x * x, x + Vec::set1(1.0f));
  return where_less(under, lo, Vec::zero(), y * pow2i(fx));
}

// tanh(x) = sign(x) (1 - 2 / (e^{2|x|} + 1)); absolute error about 1e-7.
inline Vec vtanh(Vec x) {
  Vec e = vexp(vabs(x) * Vec::set1(2.0f));
  Vec one = Vec::set1(1.0f);
  return copysign(one - Vec::set1(2.0f) / (e + one), x);
}

inline float exp_scalar(float x) {
  float tmp[W];
  vexp(Vec::set1(x)).store(tmp);
  return tmp[0];
}

}  // namespace engine_cpu
