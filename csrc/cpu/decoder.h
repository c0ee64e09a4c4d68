// A Llama-style decoder's layers in one call: the same kernels, on the same tensors, in the same
// order as the Python layers (engine/worker/models/llama.py) run them, so the result is the same
// bit for bit; what goes is the host work between them (per layer, ~10 op calls through Python
// and the dispatcher, their views and allocations: ~3 ms of a 9 ms single-stream decode step of
// the default model). engine/worker/fused_decoder.py decides which models take it.
//
// Included by ops.cpp inside its namespace, after the ops it calls.
#pragma once

// Per layer, six weights: input norm, qkv, o, post-attention norm, gate_up, down; four linear
// kinds (a GGML block type for quant_linear; kOneDnnLinear: oneDNN's packed linear, as
// engine/worker/cpu_linear.py's PackedLinear calls it, kOneDnnPairedLinear the same with a single
// row computed as two; kTorchLinear: at::linear, as nn.Linear);
// one sliding window (0: none). small_weights: empty, or per layer four tensors: a linear's plain
// bf16 weight, which steps of up to kSmallRows rows read (small_rows_linear.h) instead of its own
// kind, or an empty tensor where it has none (a quantized linear beside dequantized ones).
constexpr int64_t kOneDnnLinear = -1, kTorchLinear = -2, kOneDnnPairedLinear = -3;
constexpr int kLayerWeights = 6, kLayerLinears = 4;
constexpr int kLinearSlot[kLayerLinears] = {1, 2, 4, 5};  // the linears' places among a layer's weights

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed_weight, bool pair_single_rows) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               c10::string_view, c10::List<std::optional<at::Scalar>>,
                                               std::optional<c10::string_view>)>();
  const auto none = c10::List<std::optional<at::Scalar>>();
  // A single row as two (itself twice) where oneDNN's one-row path gives other bits than the row
  // in a larger step (engine/worker/cpu_linear.py: single_row_differs).
  if (pair_single_rows && x.size(0) == 1)
    return op.call(x.expand({2, x.size(1)}).contiguous(), packed_weight, std::nullopt, "none", none, std::nullopt)
        .narrow(0, 0, 1);
  return op.call(x, packed_weight, std::nullopt, "none", none, std::nullopt);
}

at::Tensor run_linear(const at::Tensor& x, const at::Tensor& weight, int64_t kind, const at::Tensor* small_weight) {
  if (small_weight != nullptr && small_weight->numel() > 0 && x.size(0) <= kSmallRows) {
    at::Tensor out = at::empty({x.size(0), small_weight->size(0)}, x.options());
    small_rows_linear(out, x, *small_weight);
    return out;
  }
  if (kind == kOneDnnLinear || kind == kOneDnnPairedLinear) return onednn_linear(x, weight, kind == kOneDnnPairedLinear);
  if (kind == kTorchLinear) return at::linear(x, weight);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  quant_linear(out, x, weight, kind);
  return out;
}

// x: layer 0's normed input [tokens, hidden]; residual: the stream so far (updated in place).
// Returns the last layer's output (what it adds to the stream), as the Python loop does.
at::Tensor decoder_layers(const at::Tensor& x, at::Tensor& residual, at::TensorList weights, at::IntArrayRef kinds,
                          at::TensorList small_weights, at::IntArrayRef windows, const at::Tensor& cos, const at::Tensor& ssin,
                          const at::Tensor& kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_table,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t num_heads,
                          int64_t num_kv_heads, double eps, double scale, int64_t act) {
  const int64_t layers = int64_t(windows.size());
  TORCH_CHECK(int64_t(weights.size()) == kLayerWeights * layers && int64_t(kinds.size()) == kLayerLinears * layers,
              "decoder_layers: ", kLayerWeights, " weights and ", kLayerLinears, " linear kinds per layer");
  TORCH_CHECK(small_weights.empty() || int64_t(small_weights.size()) == kLayerLinears * layers,
              "decoder_layers: no small-row weights or ", kLayerLinears, " per layer (empty where none)");
  TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(0) == layers && kv_caches.size(1) == 2,
              "kv_caches must be [layers, 2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0, "decoder_layers: no heads");
  const int64_t tokens = x.size(0), head_dim = kv_caches.size(5);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor h = x;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + kLayerWeights * i;
    const int64_t* kind = kinds.data() + kLayerLinears * i;
    const at::Tensor* small = small_weights.empty() ? nullptr : small_weights.data() + kLayerLinears * i;
    auto linear = [&](const at::Tensor& in, int j) {
      return run_linear(in, w[kLinearSlot[j]], kind[j], small == nullptr ? nullptr : small + j);
    };
    if (i > 0) add_rms_norm(h, residual, w[0], eps, 0);  // h becomes this layer's normed input
    const at::Tensor qkv = linear(h, 0);
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "layer ", i, ": qkv has ", qkv.size(1), " features");
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    rope(q, k, cos, ssin);
    at::Tensor key_cache = kv_caches.select(0, i).select(0, 0), value_cache = kv_caches.select(0, i).select(0, 1);
    reshape_and_cache(k, v, key_cache, value_cache, slot_mapping);
    at::Tensor o = at::empty({tokens, num_heads, head_dim}, x.options());
    paged_attention(o, q, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, 0.0, windows[i]);
    at::Tensor attn = linear(o.view({tokens, q_size}), 1);
    add_rms_norm(attn, residual, w[3], eps, 0);  // attn becomes the MLP's normed input
    const at::Tensor gate_up = linear(attn, 2);
    at::Tensor mid = at::empty({tokens, gate_up.size(1) / 2}, x.options());
    act_and_mul(mid, gate_up, act);
    h = linear(mid, 3);
  }
  return h;
}
