// torch bindings of the CPU kernels. Compiled twice, once per ISA, through csrc/cpu/isa/*.cpp:
//   engine/_C_avx512 (-mavx512f ...)  registers torch.ops.engine_avx512.*
//   engine/_C_avx2   (-mavx2 -mfma)   registers torch.ops.engine_avx2.*
// engine/worker/native.py imports the one this CPU runs (both on an AVX-512 machine, for tests).
// Every op checks what it is given (device, dtype, shapes, strides, indices) before a kernel
// reads a byte, and raises a RuntimeError (a Python exception) instead.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <atomic>
#include <climits>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "elementwise.h"
#include "quant_linear.h"
#include "q8_dot.h"

#ifndef ENGINE_EXT_NAME
#error "define ENGINE_EXT_NAME (the module name) and ENGINE_OPS_NS (the op namespace)"
#endif

namespace engine_cpu {
namespace {

template <typename F>
void with_storage_type(const at::Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(bf16_t{}); break;
    case at::kHalf: f(fp16_t{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type(), " (float32, bfloat16 or float16)");
  }
}

void check_cpu(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
}

void check_rows(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == n && (t.stride(1) == 1 || t.numel() == 0), name, " must be [rows, ", n,
              "] with unit stride in its last dim, got sizes ", t.sizes(), " strides ", t.strides());
}

// Head sizes the attention kernel is built for (compile-time, so a row's accumulators stay in
// registers); engine/worker/native.py routes other sizes to the torch backend.
template <typename F>
void with_head_dim(int64_t head_dim, F&& f) {
  switch (head_dim) {
    case 16: f(std::integral_constant<int, 16 / W>{}); break;
    case 32: f(std::integral_constant<int, 32 / W>{}); break;
    case 64: f(std::integral_constant<int, 64 / W>{}); break;
    case 96: f(std::integral_constant<int, 96 / W>{}); break;
    case 128: f(std::integral_constant<int, 128 / W>{}); break;
    case 256: f(std::integral_constant<int, 256 / W>{}); break;
    default: TORCH_CHECK(false, "paged_attention supports head_dim 16, 32, 64, 96, 128 and 256, not ", head_dim);
  }
}

// Runs fn(i) for i in [0, n) on torch's intra-op threads; each thread takes the next index
// from a shared counter, so items of uneven cost spread evenly.
template <typename F>
void parallel_items(int64_t n, F&& fn) {
  if (n == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  });
}

// Row kernels run in parallel over rows once a step is big enough to pay for the threads.
template <typename F>
void parallel_rows(int64_t rows, int64_t row_elems, F&& fn) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1));
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) fn(i);
  });
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, double scale, double softcap, int64_t window) {
  const auto dtype = query.scalar_type();
  check_cpu(query, "query", dtype);
  check_cpu(out, "out", dtype);
  check_cpu(key_cache, "key_cache", dtype);
  check_cpu(value_cache, "value_cache", dtype);
  check_cpu(block_table, "block_table", at::kInt);
  check_cpu(query_start_loc, "query_start_loc", at::kInt);
  check_cpu(seq_lens, "seq_lens", at::kInt);
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && query.sizes() == out.sizes(),
              "query and out must be [tokens, heads, head_dim] of one shape");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.strides() == value_cache.strides(),
              "key_cache and value_cache must be [blocks, block_size, kv_heads, head_dim] of one layout");
  TORCH_CHECK(key_cache.size(1) > 0, "key_cache has a block size of 0");
  const int64_t heads = query.size(1), head_dim = query.size(2), kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "key_cache head_dim ", key_cache.size(3), " != query's ", head_dim);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads are not a multiple of ", kv_heads,
              " kv heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1,
              "head_dim must have unit stride");
  TORCH_CHECK(block_table.dim() == 2 && block_table.is_contiguous(), "block_table must be a contiguous [reqs, n]");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous(), "index tensors must be contiguous");
  const int64_t reqs = seq_lens.numel();
  TORCH_CHECK(query_start_loc.numel() == reqs + 1 && block_table.size(0) >= reqs,
              "query_start_loc needs reqs + 1 entries and block_table a row per request");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(window <= INT32_MAX, "window ", window, " is too large");
  const int32_t* qs = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t block_size = key_cache.size(1), num_blocks = key_cache.size(0), bt_stride = block_table.size(1);
  TORCH_CHECK(qs[0] == 0 && qs[reqs] == query.size(0), "query_start_loc must run from 0 to the number of tokens");
  for (int64_t r = 0; r < reqs; ++r) {
    const int64_t n = qs[r + 1] - qs[r];
    TORCH_CHECK(n >= 0 && sl[r] >= n, "request ", r, ": ", n, " new tokens but seq_len ", sl[r]);
    const int64_t blocks = (sl[r] + block_size - 1) / block_size;
    TORCH_CHECK(blocks <= bt_stride, "request ", r, ": seq_len ", sl[r], " needs ", blocks, " blocks, the table has ",
                bt_stride);
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK(bt[r * bt_stride + b] >= 0 && bt[r * bt_stride + b] < num_blocks, "request ", r,
                  ": block id ", bt[r * bt_stride + b], " out of range");
  }
  AttentionArgs a{query.data_ptr(), query.stride(0), query.stride(1),
                  key_cache.data_ptr(), value_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1),
                  key_cache.stride(2), bt, bt_stride, qs, sl, int(reqs),
                  out.data_ptr(), out.stride(0), out.stride(1),
                  int(heads), int(kv_heads), int(head_dim), int(block_size),
                  float(scale), float(softcap), int(window)};
  with_storage_type(query, [&](auto tag) {
    with_head_dim(head_dim, [&](auto nv) {
      PagedAttention<decltype(tag), decltype(nv)::value> attention(a);
      const std::vector<int64_t> order = attention.order();
      parallel_items(attention.num_items(), [&](int64_t i) {
        thread_local std::vector<float> scratch;
        attention.compute(order[i], scratch);
      });
      parallel_items(attention.num_split_groups(), [&](int64_t k) { attention.finish_split(k); });
    });
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  const auto dtype = key_cache.scalar_type();
  check_cpu(key_cache, "key_cache", dtype);
  check_cpu(key, "key", dtype);
  check_cpu(value, "value", dtype);
  check_cpu(value_cache, "value_cache", dtype);
  check_cpu(slot_mapping, "slot_mapping", at::kLong);
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.strides() == value_cache.strides() && key_cache.stride(3) == 1 &&
                  key_cache.stride(2) == key_cache.size(3),
              "caches must be [blocks, block_size, kv_heads, head_dim] with dense heads");
  const int64_t tokens = slot_mapping.numel(), kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && key.size(0) == tokens && key.size(1) == kv_heads && key.size(2) == head_dim &&
                  key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1 &&
                  key.stride(1) == head_dim && value.stride(1) == head_dim,
              "key and value must be [tokens, kv_heads, head_dim] with dense heads");
  TORCH_CHECK(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");
  const int64_t slots = key_cache.size(0) * key_cache.size(1), block_size = key_cache.size(1);
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sm[t] >= 0 && sm[t] < slots, "slot ", sm[t], " of token ", t, " is outside the cache (", slots, ")");
  const int64_t row_bytes = kv_heads * head_dim * key.element_size();
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t es = key.element_size();
  parallel_rows(tokens, kv_heads * head_dim, [&](int64_t t) {
    const int64_t at_ = (sm[t] / block_size) * key_cache.stride(0) * es + (sm[t] % block_size) * key_cache.stride(1) * es;
    std::memcpy(kc + at_, k + t * key.stride(0) * es, row_bytes);
    std::memcpy(vc + at_, v + t * value.stride(0) * es, row_bytes);
  });
}

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps, int64_t kind) {
  const auto dtype = input.scalar_type();
  check_cpu(input, "input", dtype);
  check_cpu(out, "out", dtype);
  check_cpu(weight, "weight", dtype);
  const int64_t n = input.size(-1);
  check_rows(input, "input", n);
  check_rows(out, "out", n);
  TORCH_CHECK(out.size(0) == input.size(0) && weight.numel() == n && weight.is_contiguous(), "shape mismatch");
  TORCH_CHECK(kind == 0 || kind == 1, "kind: 0 (Llama) or 1 (Gemma)");
  with_storage_type(input, [&](auto tag) {
    using T = decltype(tag);
    T* y = static_cast<T*>(out.data_ptr());
    const T* x = static_cast<const T*>(input.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    parallel_rows(input.size(0), n, [&](int64_t i) {
      rms_norm_row(y + i * out.stride(0), x + i * input.stride(0), w, int(n), float(eps), NormKind(kind));
    });
  });
}

void add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps, int64_t kind) {
  const auto dtype = input.scalar_type();
  check_cpu(input, "input", dtype);
  check_cpu(residual, "residual", dtype);
  check_cpu(weight, "weight", dtype);
  const int64_t n = input.size(-1);
  check_rows(input, "input", n);
  check_rows(residual, "residual", n);
  TORCH_CHECK(residual.size(0) == input.size(0) && weight.numel() == n && weight.is_contiguous(), "shape mismatch");
  TORCH_CHECK(kind == 0 || kind == 1, "kind: 0 (Llama) or 1 (Gemma)");
  with_storage_type(input, [&](auto tag) {
    using T = decltype(tag);
    T* x = static_cast<T*>(input.data_ptr());
    T* res = static_cast<T*>(residual.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    parallel_rows(input.size(0), n, [&](int64_t i) {
      add_rms_norm_row(x + i * input.stride(0), res + i * residual.stride(0), w, int(n), float(eps), NormKind(kind));
    });
  });
}

void act_and_mul(at::Tensor& out, const at::Tensor& input, int64_t act) {
  check_cpu(input, "input", input.scalar_type());
  check_cpu(out, "out", input.scalar_type());
  const int64_t n = out.size(-1);
  check_rows(input, "input", 2 * n);
  check_rows(out, "out", n);
  TORCH_CHECK(out.size(0) == input.size(0), "out and input must have the same rows");
  TORCH_CHECK(act == 0 || act == 1, "act: 0 (SiLU) or 1 (GeLU tanh)");
  with_storage_type(input, [&](auto tag) {
    using T = decltype(tag);
    T* y = static_cast<T*>(out.data_ptr());
    const T* x = static_cast<const T*>(input.data_ptr());
    parallel_rows(input.size(0), 3 * n, [&](int64_t i) {
      act_and_mul_row(y + i * out.stride(0), x + i * input.stride(0), int(n), Activation(act));
    });
  });
}

// query [tokens, heads, head_dim], key [tokens, kv_heads, head_dim] (views with unit head_dim
// stride), cos and signed sin [tokens, rotary_dim]: the first rotary_dim dims of every head turn.
void rope(at::Tensor& query, at::Tensor& key, const at::Tensor& cos, const at::Tensor& ssin) {
  const auto dtype = query.scalar_type();
  check_cpu(query, "query", dtype);
  check_cpu(key, "key", dtype);
  check_cpu(cos, "cos", dtype);
  check_cpu(ssin, "sin", dtype);
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == key.size(0) && query.size(2) == key.size(2) &&
                  query.stride(2) == 1 && key.stride(2) == 1,
              "query and key must be [tokens, heads, head_dim] with unit stride in head_dim");
  const int64_t tokens = query.size(0), rot = cos.size(-1);
  TORCH_CHECK(cos.sizes() == ssin.sizes() && cos.is_contiguous() && ssin.is_contiguous() &&
                  cos.numel() == tokens * rot,
              "cos and sin must be contiguous [tokens, rotary_dim]");
  TORCH_CHECK(rot % 2 == 0 && rot <= query.size(2) && rot <= 1024, "bad rotary_dim ", rot);
  with_storage_type(query, [&](auto tag) {
    using T = decltype(tag);
    T* q = static_cast<T*>(query.data_ptr());
    T* k = static_cast<T*>(key.data_ptr());
    const T* c = static_cast<const T*>(cos.data_ptr());
    const T* s = static_cast<const T*>(ssin.data_ptr());
    const int64_t hq = query.size(1), hk = key.size(1);
    parallel_rows(tokens, (hq + hk) * rot, [&](int64_t t) {
      for (int64_t h = 0; h < hq; ++h) rope_head(q + t * query.stride(0) + h * query.stride(1), c + t * rot, s + t * rot, int(rot));
      for (int64_t h = 0; h < hk; ++h) rope_head(k + t * key.stride(0) + h * key.stride(1), c + t * rot, s + t * rot, int(rot));
    });
  });
}


template <typename F>
void with_quant_type(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: f(std::integral_constant<int, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int, kQ4_1>{}); break;
    case kQ8_0: f(std::integral_constant<int, kQ8_0>{}); break;
    default: TORCH_CHECK(false, "quantized weights: GGML type 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), not ", type);
  }
}

// weight: uint8 [N, K / 32 * block_bytes], contiguous; returns K.
int64_t check_quant_weight(const at::Tensor& weight, int64_t type) {
  check_cpu(weight, "weight", at::kByte);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous uint8 [out_features, bytes]");
  const int64_t bb = block_bytes(int(type));
  TORCH_CHECK(weight.size(1) % bb == 0 && weight.size(1) > 0, "weight rows of ", weight.size(1),
              " bytes are not whole blocks of ", bb);
  return weight.size(1) / bb * kQK;
}

template <typename T>
void widen_row(float* dst, const T* src, int64_t n) {  // n is a multiple of 32
  for (int64_t i = 0; i < n; i += W) Vec::load(src + i).store(dst + i);
}

// sums[g] = the sum of block g (32 values) of a bf16 row, in float32, in one fixed order.
inline void block_sums(float* sums, const bf16_t* row, int64_t groups) {
  for (int64_t g = 0; g < groups; ++g) {
    Vec s = Vec::load(row + g * kQK);
    UNROLL for (int i = W; i < kQK; i += W) s = s + Vec::load(row + g * kQK + i);
    sums[g] = reduce_add(s);
  }
}

template <typename T>
void narrow_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) Vec::load(src + i).store(dst + i);
  if (i < n) store_partial(Vec::load(src + i), dst + i, int(n - i));  // src rows are padded to W
}

// Rows of x that share one pass over the weights: as many as keep their accumulators in
// registers (2 per row on AVX-512, of its 32 registers; 4 on AVX2, of 16). Rows of x are taken kQuantRowBlock
// at a time (they stay in L2) and weights kQuantWeightRows rows at a time (they stay in L1
// through every pass over those x rows).
constexpr int kQuantRows = W == 16 ? 8 : 2;
constexpr int64_t kQuantWeightRows = 16;
constexpr int64_t kQuantRowBlock = 64;

template <typename F>
void with_row_count(int rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
#if defined(__AVX512F__)
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
#else
    default: f(std::integral_constant<int, 2>{}); break;
#endif
  }
}

// Q4_0 and Q4_1 rows: the bf16 way where it applies, else the float32 way (quant_linear.h).
// for_tiles(narrow, dot) runs dot over every tile of out (see quant_linear).
template <int Type, typename T, typename Tiles, typename Narrow>
void quant_linear_q4(Tiles&& for_tiles, Narrow&& narrow, const T* in, int64_t stride, int64_t m, int64_t k,
                     const uint8_t* w) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (cpu_has_avx512_bf16()) {  // x as it is
      const int64_t groups = k / kQK;
      std::vector<float> sums(Type == kQ4_1 ? m * groups : 0);
      std::vector<bf16_t> paired(m * k);
      for (int64_t r = 0; r < m; ++r) {
        pair_activations(paired.data() + r * k, in + r * stride, k);
        if constexpr (Type == kQ4_1) block_sums(sums.data() + r * groups, in + r * stride, groups);
      }
      for_tiles(narrow, [&](auto rc, float* t, int64_t ts, int64_t base, int64_t row, int64_t w0, int64_t w1) {
        quant_dot_rows_bf16<Type, decltype(rc)::value>(t, ts, base, paired.data() + row * k, k,
                                                       sums.data() + (sums.empty() ? 0 : row * groups), k, w, w0, w1);
      });
      return;
    }
  }
#endif
  std::vector<float> x(m * k);
  for (int64_t r = 0; r < m; ++r) widen_row(x.data() + r * k, in + r * stride, k);
  for_tiles(narrow, [&](auto rc, float* t, int64_t ts, int64_t base, int64_t row, int64_t w0, int64_t w1) {
    quant_dot_rows<Type, decltype(rc)::value>(t, ts, base, x.data() + row * k, k, w, w0, w1);
  });
}

// out [M, N] = input [M, K] @ dequantize(weight)^T, in input's dtype, accumulated in float (for Q8_0
// weights, with the input rounded to Q8_0 first: q8_dot.h).
void quant_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, int64_t type) {
  const auto dtype = input.scalar_type();
  check_cpu(input, "input", dtype);
  check_cpu(out, "out", dtype);
  with_quant_type(type, [&](auto) {});
  const int64_t k = check_quant_weight(weight, type), n = weight.size(0), m = input.size(0);
  check_rows(input, "input", k);
  check_rows(out, "out", n);
  TORCH_CHECK(out.size(0) == m, "out and input must have the same rows");
  if (m == 0 || n == 0) return;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  // The columns [n0, n1) of out for all rows: rows of x kQuantRowBlock at a time into a float
  // tile, weights kQuantWeightRows rows at a time, kQuantRows rows of x per pass (dot(rows,
  // x_rows, weight_rows) computes tile rows [rows) for those weight rows).
  auto for_tiles = [&](auto&& narrow, auto&& dot) {
    at::parallel_for(0, n, W, [&](int64_t n0, int64_t n1) {
      const int64_t cols = n1 - n0, padded = (cols + W - 1) / W * W;
      std::vector<float> tile(std::min(m, kQuantRowBlock) * padded, 0.0f);  // out[m0:, n0:n1], as float
      for (int64_t m0 = 0; m0 < m; m0 += kQuantRowBlock) {
        const int64_t rows = std::min(kQuantRowBlock, m - m0);
        for (int64_t nb = n0; nb < n1; nb += kQuantWeightRows)
          for (int64_t r0 = 0; r0 < rows; r0 += kQuantRows)
            with_row_count(int(std::min<int64_t>(kQuantRows, rows - r0)), [&](auto r) {
              dot(r, tile.data() + r0 * padded, padded, n0, m0 + r0, nb, std::min(n1, nb + kQuantWeightRows));
            });
        for (int64_t r = 0; r < rows; ++r) narrow(m0 + r, tile.data() + r * padded, n0, cols);
      }
    });
  };
  with_storage_type(input, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(input.data_ptr());
    T* y = static_cast<T*>(out.data_ptr());
    auto narrow = [&](int64_t row, const float* tile_row, int64_t n0, int64_t cols) {
      narrow_row(y + row * out.stride(0) + n0, tile_row, cols);
    };
    with_quant_type(type, [&](auto qt) {
      constexpr int Type = decltype(qt)::value;
      if constexpr (Type == kQ8_0) {  // integer dot products on activations rounded to Q8_0 (q8_dot.h)
        Q8Activations xq(m, k);
        for (int64_t r = 0; r < m; ++r) quantize_activations_q8(xq, r, in + r * input.stride(0));
#if defined(__AVX512F__)
        if (cpu_has_avx512_vnni()) {
          for_tiles(narrow, [&](auto rc, float* t, int64_t ts, int64_t base, int64_t row, int64_t w0, int64_t w1) {
            q8_dot_rows_vnni<decltype(rc)::value>(t, ts, base, xq, row, w, w0, w1);
          });
          return;
        }
#endif
        for_tiles(narrow, [&](auto rc, float* t, int64_t ts, int64_t base, int64_t row, int64_t w0, int64_t w1) {
          q8_dot_rows_maddubs<decltype(rc)::value>(t, ts, base, xq, row, w, w0, w1);
        });
      } else {
        quant_linear_q4<Type>(for_tiles, narrow, in, input.stride(0), m, k, w);
      }
    });
  });
}

#include "small_rows_linear.h"  // small_rows_linear: bf16 steps of a few rows
#include "decoder.h"  // decoder_layers: the ops above, a whole decoder at a time

}  // namespace
}  // namespace engine_cpu

TORCH_LIBRARY(ENGINE_OPS_NS, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, float softcap, int window) -> ()");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float eps, int kind) -> ()");
  m.def("add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, int kind) -> ()");
  m.def("act_and_mul(Tensor(a!) out, Tensor input, int act) -> ()");
  m.def("rope(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  m.def("quant_linear(Tensor(a!) out, Tensor input, Tensor weight, int type) -> ()");
  m.def("small_rows_linear(Tensor(a!) out, Tensor input, Tensor weight) -> ()");
  m.def("decoder_layers(Tensor x, Tensor(a!) residual, Tensor[] weights, int[] kinds, Tensor[] small_weights, "
        "int[] windows, Tensor cos, "
        "Tensor sin, Tensor(b!) kv_caches, Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, "
        "Tensor seq_lens, int num_heads, int num_kv_heads, float eps, float scale, int act) -> Tensor");
}

TORCH_LIBRARY_IMPL(ENGINE_OPS_NS, CPU, m) {
  m.impl("paged_attention", &engine_cpu::paged_attention);
  m.impl("reshape_and_cache", &engine_cpu::reshape_and_cache);
  m.impl("rms_norm", &engine_cpu::rms_norm);
  m.impl("add_rms_norm", &engine_cpu::add_rms_norm);
  m.impl("act_and_mul", &engine_cpu::act_and_mul);
  m.impl("rope", &engine_cpu::rope);
  m.impl("quant_linear", &engine_cpu::quant_linear);
  m.impl("small_rows_linear", &engine_cpu::small_rows_linear);
  m.impl("decoder_layers", &engine_cpu::decoder_layers);
}

// A float32 model's oneDNN-packed weights are MkldnnCPU tensors, which send the whole call there.
TORCH_LIBRARY_IMPL(ENGINE_OPS_NS, MkldnnCPU, m) { m.impl("decoder_layers", &engine_cpu::decoder_layers); }

#define ENGINE_STR2(x) #x
#define ENGINE_STR(x) ENGINE_STR2(x)
#define ENGINE_CAT2(a, b) a##b
#define ENGINE_CAT(a, b) ENGINE_CAT2(a, b)

// Importing the module (engine._C_avx512 / engine._C_avx2) registers the ops above.
extern "C" PyMODINIT_FUNC ENGINE_CAT(PyInit_, ENGINE_EXT_NAME)(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, ENGINE_STR(ENGINE_EXT_NAME), "engine CPU kernels", -1, nullptr};
  return PyModule_Create(&def);
}
