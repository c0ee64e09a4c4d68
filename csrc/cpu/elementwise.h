// Row kernels of a decoder layer, each fusing what torch's eager path runs as several ops:
// RMSNorm (Llama's and Gemma's), the residual add before it, SiLU/GeLU-tanh times up, rotary
// embeddings, and the write of new K/V into their cache slots.
//
// Each rounds to the storage type exactly where the eager torch code does (round_to<T>), so
// in float32 the results equal torch's to the ulp of a sum's order, and in bfloat16 the same
// roundings happen in the same places.
#pragma once

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace engine_cpu {

enum class NormKind : int { kLlama = 0, kGemma = 1 };

// y = weight * round(x * rsqrt(mean(x^2) + eps))        (Llama: cast, then scale)
// y = round(x * rsqrt(mean(x^2) + eps) * (1 + weight))  (Gemma: scale in float32, then cast)
template <typename T>
inline void rms_norm_row(T* y, const T* x, const T* weight, int n, float eps, NormKind kind) {
  Vec sq = Vec::zero();
  int i = 0;
  for (; i + W <= n; i += W) {
    Vec v = Vec::load(x + i);
    sq = fmadd(v, v, sq);
  }
  if (i < n) {
    Vec v = load_partial(x + i, n - i);
    sq = fmadd(v, v, sq);
  }
  const Vec r = Vec::set1(1.0f / std::sqrt(reduce_add(sq) / float(n) + eps));
  const Vec one = Vec::set1(1.0f);
  for (i = 0; i < n; i += W) {
    const int m = n - i < W ? n - i : W;
    Vec v = m == W ? Vec::load(x + i) : load_partial(x + i, m);
    Vec w = m == W ? Vec::load(weight + i) : load_partial(weight + i, m);
    Vec out = kind == NormKind::kLlama ? round_to<T>(w * round_to<T>(v * r)) : round_to<T>(v * r * (one + w));
    if (m == W) out.store(y + i); else store_partial(out, y + i, m);
  }
}

// residual = round(residual + x); x = rms_norm(residual)   (in place: the next layer's input)
template <typename T>
inline void add_rms_norm_row(T* x, T* residual, const T* weight, int n, float eps, NormKind kind) {
  for (int i = 0; i < n; i += W) {
    const int m = n - i < W ? n - i : W;
    if (m == W) (Vec::load(residual + i) + Vec::load(x + i)).store(residual + i);
    else store_partial(load_partial(residual + i, m) + load_partial(x + i, m), residual + i, m);
  }
  rms_norm_row(x, residual, weight, n, eps, kind);
}

enum class Activation : int { kSilu = 0, kGeluTanh = 1 };

inline Vec activate(Vec g, Activation act) {
  const Vec one = Vec::set1(1.0f);
  if (act == Activation::kSilu) return g / (one + vexp(Vec::zero() - g));
  // 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
  Vec inner = Vec::set1(0.7978845608028654f) * (g + Vec::set1(0.044715f) * g * g * g);
  return Vec::set1(0.5f) * g * (one + vtanh(inner));
}

// y[i] = round(round(act(gate[i])) * up[i]) for a row [gate (n) | up (n)]
template <typename T>
inline void act_and_mul_row(T* y, const T* gate_up, int n, Activation act) {
  const T* up = gate_up + n;
  for (int i = 0; i < n; i += W) {
    const int m = n - i < W ? n - i : W;
    Vec g = m == W ? Vec::load(gate_up + i) : load_partial(gate_up + i, m);
    Vec u = m == W ? Vec::load(up + i) : load_partial(up + i, m);
    Vec out = round_to<T>(round_to<T>(activate(g, act)) * u);
    if (m == W) out.store(y + i); else store_partial(out, y + i, m);
  }
}

// One head's first `rot` dims, in place: x = round(round(x * cos) + round(roll(x, rot/2) * ssin)),
// with ssin = (-sin, sin): what engine/worker/models/layers.py apply_rope does in torch.
template <typename T>
inline void rope_head(T* x, const T* cos, const T* ssin, int rot) {
  const int half = rot / 2;
  float buf[1024];  // rot <= 1024 (checked by the caller)
  for (int i = 0; i < rot; i += W) {
    const int m = rot - i < W ? rot - i : W;
    Vec v = m == W ? Vec::load(x + i) : load_partial(x + i, m);
    if (m == W) v.store(buf + i); else store_partial(v, buf + i, m);
  }
  for (int i = 0; i < rot; i += W) {
    const int m = rot - i < W ? rot - i : W;
    float rolled[W] = {};
    if (half % W == 0 && m == W) {
      Vec::load(buf + (i < half ? i + half : i - half)).store(rolled);
    } else {
      for (int j = 0; j < m; ++j) rolled[j] = i + j < half ? buf[i + j + half] : buf[i + j - half];
    }
    Vec c = m == W ? Vec::load(cos + i) : load_partial(cos + i, m);
    Vec s = m == W ? Vec::load(ssin + i) : load_partial(ssin + i, m);
    Vec v = m == W ? Vec::load(buf + i) : load_partial(buf + i, m);
    Vec r = m == W ? Vec::load(rolled) : load_partial(rolled, m);
    Vec out = round_to<T>(round_to<T>(v * c) + round_to<T>(r * s));
    if (m == W) out.store(x + i); else store_partial(out, x + i, m);
  }
}

}  // namespace engine_cpu
