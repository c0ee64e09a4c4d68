// bfloat16 linear layers for steps of one to kSmallRows rows (the decode steps of a few streams),
// read straight from the weight's plain [N, K] rows: y = x W^T.
//
// Such a step is bound by reading the weights once. oneDNN's packed GEMM reads them at 18-20 GB/s
// at 1-4 rows on a 2-core Zen 4 VM (43 GB/s to read memory); this kernel streams 4 weight rows at
// a time, each with its own VDPBF16PS chain per row of x, and prefetches 8 rows ahead: 26-29 GB/s
// over a whole model's weights at 1-4 rows, 1.3-1.6x oneDNN's rate (docs/performance.md).
//
// Invariant: an output element is one chain over its weight row, 32 products per step in K order,
// summed in float32 and rounded to bfloat16 once, whatever the row count (up to kSmallRows), the
// weight rows beside it or the threads' split of N. Outputs therefore do not depend on which
// other streams share a step of up to kSmallRows rows; they differ from oneDNN's (the path for
// more rows) in the order of the additions only.
//
// Included by ops.cpp inside its namespace, after the helpers it calls.
#pragma once

constexpr int64_t kSmallRows = 4;

#if defined(__AVX512F__)
// One step of 32 products along K for NB weight rows (at rows, stride k) and R rows of x.
template <int R, int NB>
ALWAYS_INLINE ENGINE_TARGET_BF16 void small_rows_step(__m512 (&acc)[NB][R], const bf16_t* x, int64_t x_stride,
                                                      const bf16_t* rows, int64_t k, int64_t j, __mmask32 live) {
  __m512bh xs[R];
  UNROLL for (int r = 0; r < R; ++r) xs[r] = (__m512bh)_mm512_maskz_loadu_epi16(live, x + r * x_stride + j);
  UNROLL for (int i = 0; i < NB; ++i) {
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(live, rows + i * k + j);
    UNROLL for (int r = 0; r < R; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wv, xs[r]);
  }
}

// out[r][n - n0] (float, row stride out_stride) for rows r < R of x and weight rows [n0, n1).
// NB weight rows per pass, each with R accumulators (NB * R <= 16 of the 32 registers).
template <int R, int NB>
ENGINE_TARGET_BF16 void small_rows_dot(float* out, int64_t out_stride, const bf16_t* x, int64_t x_stride, int64_t k,
                                       const bf16_t* w, int64_t n0, int64_t n1) {
  constexpr int64_t kPrefetchRows = 8;  // measured best of 4, 8, 16 (a whole model's weights)
  const int64_t full = k / 32 * 32;
  const __mmask32 tail = __mmask32((1ull << (k - full)) - 1);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    const bf16_t* rows = w + n * k;
    // The rows kPrefetchRows ahead, within this call's rows (a pointer past them is not formed).
    const int64_t ahead_row = std::min<int64_t>(n + kPrefetchRows, n1 - 1);
    const char* ahead = reinterpret_cast<const char*>(w + ahead_row * k);
    const int64_t ahead_bytes = std::min<int64_t>(NB, n1 - ahead_row) * k * int64_t(sizeof(bf16_t));
    for (int64_t b = 0; b < ahead_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    __m512 acc[NB][R];
    UNROLL for (int i = 0; i < NB; ++i) UNROLL for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < full; j += 32) small_rows_step<R, NB>(acc, x, x_stride, rows, k, j, __mmask32(~0u));
    if (tail) small_rows_step<R, NB>(acc, x, x_stride, rows, k, full, tail);
    UNROLL for (int i = 0; i < NB; ++i) UNROLL for (int r = 0; r < R; ++r)
      out[r * out_stride + n + i - n0] = _mm512_reduce_add_ps(acc[i][r]);
  }
  if constexpr (NB > 1) {
    if (n < n1) small_rows_dot<R, 1>(out + (n - n0), out_stride, x, x_stride, k, w, n, n1);
  }
}
#endif

// out [M, N] = input [M, K] @ weight [N, K]^T, all bfloat16, M <= kSmallRows; needs AVX512-BF16
// (the model runner asks native.small_rows_linear_supported() first). Like oneDNN's, its
// float32 sums flush subnormals to zero (DAZ/FTZ).
void small_rows_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight) {
  check_cpu(input, "input", at::kBFloat16);
  check_cpu(out, "out", at::kBFloat16);
  check_cpu(weight, "weight", at::kBFloat16);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [N, K] matrix");
  const int64_t n = weight.size(0), k = weight.size(1), m = input.size(0);
  check_rows(input, "input", k);
  check_rows(out, "out", n);
  TORCH_CHECK(out.size(0) == m, "out and input must have the same rows");
  TORCH_CHECK(m <= kSmallRows, "small_rows_linear takes at most ", kSmallRows, " rows, got ", m);
  if (m == 0 || n == 0) return;
#if defined(__AVX512F__)
  TORCH_CHECK(cpu_has_avx512_bf16(), "small_rows_linear needs a CPU with AVX512-BF16");
  const bf16_t* x = static_cast<const bf16_t*>(input.data_ptr());
  const bf16_t* w = static_cast<const bf16_t*>(weight.data_ptr());
  bf16_t* y = static_cast<bf16_t*>(out.data_ptr());
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    const int64_t cols = n1 - n0, padded = (cols + W - 1) / W * W;
    std::vector<float> tile(m * padded, 0.0f);
    // 4 weight rows per pass at any row count: measured over a whole model's weights, the more
    // rows in flight the better up to 4 (2 rows of x: 8.7 ms a pass with 4 weight rows, 11.1
    // with 2, 9.9 with 1; 1 row of x: 4 weight rows 9.4 ms, 8 rows 10.4).
    auto dot = [&](auto rows) {
      small_rows_dot<decltype(rows)::value, 4>(tile.data(), padded, x, input.stride(0), k, w, n0, n1);
    };
    switch (m) {
      case 1: dot(std::integral_constant<int, 1>{}); break;
      case 2: dot(std::integral_constant<int, 2>{}); break;
      case 3: dot(std::integral_constant<int, 3>{}); break;
      default: dot(std::integral_constant<int, 4>{}); break;
    }
    for (int64_t r = 0; r < m; ++r) narrow_row(y + r * out.stride(0) + n0, tile.data() + r * padded, cols);
  });
#else
  TORCH_CHECK(false, "small_rows_linear needs the avx512 build and a CPU with AVX512-BF16");
#endif
}
