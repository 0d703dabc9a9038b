// The operators a one-call decode layer (decode_layer.cpp, llama_layer.cpp) calls through the
// dispatcher, as the Python path calls them: each looked up once, then called like a function.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace layer_calls {

using Bias = std::optional<at::Tensor>;

// float32 rows times float32 tiles (f32_matmul.cpp), with the bias and `activation`
inline at::Tensor tiled_product(const at::Tensor& x, const at::Tensor& tiles, const Bias& bias,
                                int64_t n, int64_t activation) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("gptserve_cpu::f32_matmul", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const Bias&, int64_t, int64_t)>();
  return op.call(x, tiles, bias, n, activation);
}

// rows times int8 tiles (q8_matmul.cpp: the rows quantized to 8 bits per block of 32), with the
// per-column scales, the bias and `activation`
inline at::Tensor q8_product(const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& scales, const Bias& bias, int64_t n,
                             int64_t activation) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const Bias&, int64_t, int64_t);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gptserve_cpu::q8_matmul", "")
                             .typed<Signature>();
  return op.call(x, codes, scales, bias, n, activation);
}

// paged_decode_qkv (paged_decode.cpp): the rotation (cos, sin; none for GPT-2), the writes and
// the one-query attention of each row, float32 out
inline at::Tensor attend(const at::Tensor& qkv, const Bias& cos, const Bias& sin,
                         const at::Tensor& k_pool, const at::Tensor& v_pool,
                         const at::Tensor& write_block, const at::Tensor& write_offset,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         int64_t n_head, double scale, int64_t window) {
  using Signature = at::Tensor(const at::Tensor&, const Bias&, const Bias&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, int64_t, double,
                               at::ScalarType, int64_t);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gptserve_cpu::paged_decode_qkv", "")
                             .typed<Signature>();
  return op.call(qkv, cos, sin, k_pool, v_pool, write_block, write_offset, block_tables,
                 context_lens, n_head, scale, at::kFloat, window);
}

}  // namespace layer_calls
