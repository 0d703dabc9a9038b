// A whole Llama-family layer of a CPU decode step in one call: RMSNorm, the q/k/v product, the
// rotation with the cache writes and the one-query paged attention (paged_decode_qkv), the output
// product and residual add, RMSNorm, the gate/up product, SwiGLU and the down product with its
// residual add. Each piece is the very kernel the Python path calls (the gptserve_cpu operators
// through the dispatcher, ATen's add), in the same order and dtypes, so the result is that
// path's to the bit; what goes is the Python between them, about 40 operations' worth a layer
// (model.cpu.llama_layer installs it and has the measurements). A step's LoRA adapter updates
// come with it (model.lora.batched packs them), each added to its product's output rows by
// lora::add_update, the function the products' wrappers call through the lora_update_ operator.
// gemma_decode_layer is the same for a Gemma 3 layer (model.cpu.gemma_layer): its (1 + w) norms
// around both branches and on each head's query and key, and GeGLU.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <torch/library.h>

#include "layer_calls.h"
#include "lora_update.h"

#include <cmath>
#include <optional>

namespace {

using layer_calls::attend;
using layer_calls::Bias;
using layer_calls::tiled_product;

// how a product's matrix is held: int4 groups in tiles (int4_matmul.cpp), float32 tiles
// (f32_matmul.cpp) or int4 groups multiplied with 8-bit rows (int4_q8_matmul.cpp); the codes
// match model/cpu/llama_layer.py
enum Kind : int64_t { kInt4 = 0, kFloatTiles = 1, kInt4Rows8 = 2 };

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("gptserve_cpu::rms_norm", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, at::ScalarType)>();
  return op.call(x, weight, eps, at::kFloat);
}

at::Tensor silu_mul(const at::Tensor& h) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gptserve_cpu::silu_mul", "")
                             .typed<at::Tensor(const at::Tensor&, at::ScalarType)>();
  return op.call(h, at::kFloat);
}

// x (N, in) float32 -> (N, n) float32: `weight` (and `table` for int4 groups, `copies` inputs a
// group) as the layer's module holds them; the bias added as Int4Linear adds it (bias + y)
at::Tensor product(const at::Tensor& x, int64_t kind, const at::Tensor& weight,
                   const at::Tensor& table, const Bias& bias, int64_t n, int64_t copies) {
  if (kind == kInt4 || kind == kInt4Rows8) {
    using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 int64_t, int64_t, at::ScalarType);
    static const auto float_rows = c10::Dispatcher::singleton()
                                       .findSchemaOrThrow("gptserve_cpu::int4_matmul", "")
                                       .typed<Signature>();
    static const auto byte_rows = c10::Dispatcher::singleton()
                                      .findSchemaOrThrow("gptserve_cpu::int4_q8_matmul", "")
                                      .typed<Signature>();
    const auto& op = kind == kInt4 ? float_rows : byte_rows;
    at::Tensor y = op.call(x, weight, table, n, copies, at::kFloat);
    return bias.has_value() ? at::add(*bias, y) : y;
  }
  return tiled_product(x, weight, bias, n, 0);
}

// x (N, C) float32, one new token per decoding sequence. norms: ln_1's and ln_2's weights
// (float32). kinds, weights, tables, biases, widths (outputs) and copies: c_attn (q, k, v),
// attn's c_proj, c_fc (gate, then up), mlp's c_proj, each as `product` takes it. cos, sin (N, R)
// float32: each token's rotation of each head's first R of D channels (R < D: a partial
// rotation). The pools, step tensors and `window` (0: none; else each row's query sees only its
// last `window` keys) are paged_decode_qkv's. lora_meta and lora_weights:
// the step's adapter updates (`lora::read_updates`; empty: none), each added to its product's output
// before anything reads it. Returns x after the layer, (N, C) float32.
at::Tensor llama_decode_layer(const at::Tensor& x, at::TensorList norms, double eps,
                              at::IntArrayRef kinds, at::TensorList weights,
                              at::TensorList tables, const c10::List<std::optional<at::Tensor>>& biases,
                              at::IntArrayRef widths, at::IntArrayRef copies,
                              const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& write_block, const at::Tensor& write_offset,
                              const at::Tensor& block_tables, const at::Tensor& context_lens,
                              int64_t n_head, int64_t window, at::IntArrayRef lora_meta,
                              at::TensorList lora_weights) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be (N, C) float32 on the CPU");
  TORCH_CHECK(norms.size() == 2, "norms: ln_1's and ln_2's weights");
  TORCH_CHECK(kinds.size() == 4 && weights.size() == 4 && tables.size() == 4 &&
                  biases.size() == 4 && widths.size() == 4 && copies.size() == 4,
              "kinds, weights, tables, biases, widths and copies come four each");
  const int64_t n = x.size(0), width = x.size(1), dim = k_pool.size(-1);
  const int64_t kv_width = k_pool.size(-2) * dim;
  TORCH_CHECK(widths[0] == n_head * dim + 2 * kv_width && widths[1] == width &&
                  widths[2] % 2 == 0 && widths[3] == width,
              "a Llama layer: c_attn's (H + 2 H_kv) D outputs, c_fc's gate and up");
  const double scale = std::pow(static_cast<double>(dim), -0.5);
  const std::vector<lora::Update> updates = lora::read_updates(lora_meta, lora_weights, n);
  auto apply = [&](int64_t i, const at::Tensor& rows) {
    at::Tensor y =
        product(rows, kinds[i], weights[i], tables[i], biases.get(i), widths[i], copies[i]);
    lora::apply(updates, i, rows, y);
    return y;
  };
  at::Tensor qkv = apply(0, rms_norm(x, norms[0], eps));  // (N, (H + 2 H_kv) D)
  at::Tensor y = attend(qkv, cos, sin, k_pool, v_pool, write_block, write_offset, block_tables,
                        context_lens, n_head, scale, window);  // (N, H, D)
  at::Tensor out = at::add(x, apply(1, y.view({n, n_head * dim})));
  at::Tensor h = apply(2, rms_norm(out, norms[1], eps));  // (N, 2 W): gate, then up
  return at::add(out, apply(3, silu_mul(h)));
}

// qkv (N, (H + 2 H_kv) D) float32 -> the same with each query head normed by q_weight and then
// times q_scale (1: none), each key head by k_weight, the values as they are: Gemma's q/k norms
// as its GemmaRMSNorm computes them (model/rmsnorm.py), its (1 + w) the weight given here, which
// rms_norm's F.rms_norm arithmetic then reproduces to the bit
at::Tensor norm_heads(const at::Tensor& qkv, int64_t n_head, int64_t n_kv, int64_t dim,
                      const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
                      double q_scale) {
  const int64_t n = qkv.size(0);
  const at::Tensor heads = qkv.view({n, n_head + 2 * n_kv, dim});
  // (N * H, D) and (N * H_kv, D) contiguous rows: views for one token, copies for more
  auto rows = [&](int64_t first, int64_t count) {
    return heads.narrow(1, first, count).reshape({n * count, dim}).contiguous();
  };
  at::Tensor q = rms_norm(rows(0, n_head), q_weight, eps);
  if (q_scale != 1.0) q.mul_(q_scale);  // as GemmaRMSNorm's `h * self.scale`
  at::Tensor k = rms_norm(rows(n_head, n_kv), k_weight, eps);
  at::Tensor v = qkv.narrow(1, (n_head + n_kv) * dim, n_kv * dim);
  return at::cat({q.view({n, n_head * dim}), k.view({n, n_kv * dim}), v}, 1);
}

// h (N, 2W): gate columns, then up columns -> gelu_tanh(gate) * up (N, W), by the very ATen
// operations model.gpt's MLP runs (so that both paths round alike)
at::Tensor gelu_mul(const at::Tensor& h) {
  const int64_t w = h.size(1) / 2;
  return at::mul(at::gelu(h.narrow(1, 0, w), "tanh"), h.narrow(1, w, w));
}

// A Gemma 3 layer's decode step (model.gpt's SandwichBlock): x (N, C) float32 as
// llama_decode_layer takes it, with six norm weights, each already 1 + w as GemmaRMSNorm
// multiplies by it: ln_1, the query heads' and the key heads' norms, post_attn_norm, ln_2 and
// post_mlp_norm, all with `eps`; q_scale multiplies the normed queries (query_pre_attn_scalar's
// share; 1: none). c_fc's outputs are the gate, then up, of GeGLU (GELU's tanh form). The
// products, rotation, pools, window and LoRA updates are llama_decode_layer's.
at::Tensor gemma_decode_layer(const at::Tensor& x, at::TensorList norms, double eps,
                              double q_scale, at::IntArrayRef kinds, at::TensorList weights,
                              at::TensorList tables,
                              const c10::List<std::optional<at::Tensor>>& biases,
                              at::IntArrayRef widths, at::IntArrayRef copies,
                              const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& write_block, const at::Tensor& write_offset,
                              const at::Tensor& block_tables, const at::Tensor& context_lens,
                              int64_t n_head, int64_t window, at::IntArrayRef lora_meta,
                              at::TensorList lora_weights) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be (N, C) float32 on the CPU");
  TORCH_CHECK(norms.size() == 6,
              "norms: ln_1's, q_norm's, k_norm's, post_attn_norm's, ln_2's and post_mlp_norm's "
              "weights");
  TORCH_CHECK(kinds.size() == 4 && weights.size() == 4 && tables.size() == 4 &&
                  biases.size() == 4 && widths.size() == 4 && copies.size() == 4,
              "kinds, weights, tables, biases, widths and copies come four each");
  const int64_t n = x.size(0), width = x.size(1), dim = k_pool.size(-1), n_kv = k_pool.size(-2);
  TORCH_CHECK(widths[0] == (n_head + 2 * n_kv) * dim && widths[1] == width &&
                  widths[2] % 2 == 0 && widths[3] == width,
              "a Gemma layer: c_attn's (H + 2 H_kv) D outputs, c_fc's gate and up");
  const double scale = std::pow(static_cast<double>(dim), -0.5);
  const std::vector<lora::Update> updates = lora::read_updates(lora_meta, lora_weights, n);
  auto apply = [&](int64_t i, const at::Tensor& rows) {
    at::Tensor y =
        product(rows, kinds[i], weights[i], tables[i], biases.get(i), widths[i], copies[i]);
    lora::apply(updates, i, rows, y);
    return y;
  };
  at::Tensor qkv = apply(0, rms_norm(x, norms[0], eps));  // (N, (H + 2 H_kv) D)
  qkv = norm_heads(qkv, n_head, n_kv, dim, norms[1], norms[2], eps, q_scale);
  at::Tensor y = attend(qkv, cos, sin, k_pool, v_pool, write_block, write_offset, block_tables,
                        context_lens, n_head, scale, window);  // (N, H, D)
  at::Tensor attn = apply(1, y.view({n, n_head * dim}));  // (N, C)
  at::Tensor out = at::add(x, rms_norm(attn, norms[3], eps));
  at::Tensor h = apply(2, rms_norm(out, norms[4], eps));  // (N, 2 W): gate, then up
  return at::add(out, rms_norm(apply(3, gelu_mul(h)), norms[5], eps));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def(
      "llama_decode_layer(Tensor x, Tensor[] norms, float eps, int[] kinds, Tensor[] weights, "
      "Tensor[] tables, Tensor?[] biases, int[] widths, int[] copies, Tensor cos, Tensor sin, "
      "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor write_block, Tensor write_offset, "
      "Tensor block_tables, Tensor context_lens, int n_head, int window, int[] lora_meta, "
      "Tensor[] lora_weights) -> Tensor");
  m.impl("llama_decode_layer", c10::DispatchKey::CPU, &llama_decode_layer);
  m.def(
      "gemma_decode_layer(Tensor x, Tensor[] norms, float eps, float q_scale, int[] kinds, "
      "Tensor[] weights, Tensor[] tables, Tensor?[] biases, int[] widths, int[] copies, "
      "Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor write_block, "
      "Tensor write_offset, Tensor block_tables, Tensor context_lens, int n_head, int window, "
      "int[] lora_meta, Tensor[] lora_weights) -> Tensor");
  m.impl("gemma_decode_layer", c10::DispatchKey::CPU, &gemma_decode_layer);
}
