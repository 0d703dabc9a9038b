// A whole GPT-2 layer of a CPU decode step of a few rows in one call: pre-norm LayerNorms, the
// four products from float32 tiles (f32_matmul.cpp), the one-call attention over the paged
// cache (paged_decode.cpp) and both residual adds. Each piece is the very kernel the Python
// path calls (ATen's layer_norm and add, the gptserve_cpu operators through the dispatcher), in
// the same order, so the result is that path's to the bit; what goes is the Python between them
// (model.cpu.decode_layer, where this is installed, has the measurements). A step's LoRA adapter
// updates come with it, added to each product's output by lora::add_update as the products'
// wrappers add them (c_fc's before its activation, which then runs as ATen's, as theirs does).
// `q8_decode_layer` is the same layer over `--quantize int8` products (q8_matmul.cpp, the
// operator `Int8Linear` calls, with its codes, scales and biases).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/relu.h>
#include <torch/library.h>

#include "layer_calls.h"
#include "lora_update.h"

#include <array>
#include <cmath>
#include <optional>
#include <vector>

namespace {

// the activation of f32_matmul's code (model/activations.py's KERNEL_CODES) as
// model.activations.activate runs it: ATen's GELU (tanh) or ReLU
at::Tensor activate(const at::Tensor& y, int64_t code) {
  TORCH_CHECK(code == 1 || code == 2, "an activation code is 1 (GELU, tanh) or 2 (ReLU)");
  return code == 1 ? at::gelu(y, "tanh") : at::relu(y);
}

using layer_calls::attend;
using layer_calls::q8_product;
using layer_calls::tiled_product;

// The layer around `product(i, rows, act)`, product i of `rows` (c_attn, attn's c_proj, c_fc,
// mlp's c_proj) with the kernel's activation code `act`, without adapter updates. x (N, C)
// float32, one new token per decoding sequence; norms: ln_1's weight and bias, then ln_2's;
// widths: the products' outputs. The pools and step tensors are paged_decode_qkv's, and so is
// `window` (0: none; else each row's query sees only its last `window` keys). lora_meta and
// lora_weights: the step's adapter updates (`lora::read_updates`; empty: none). Returns x after
// the layer, (N, C).
template <typename Product>
at::Tensor gpt2_layer(const at::Tensor& x, at::TensorList norms, at::IntArrayRef widths,
                      const Product& product, const at::Tensor& k_pool, const at::Tensor& v_pool,
                      const at::Tensor& write_block, const at::Tensor& write_offset,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      int64_t n_head, double eps, int64_t activation, int64_t window,
                      at::IntArrayRef lora_meta, at::TensorList lora_weights) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be (N, C) float32 on the CPU");
  TORCH_CHECK(norms.size() == 4 && widths.size() == 4, "norms and widths come four each");
  const int64_t n = x.size(0), width = x.size(1), dim = k_pool.size(-1);
  TORCH_CHECK(n_head > 0 && n_head * dim == width && widths[0] == 3 * width &&
                  widths[1] == width && widths[3] == width,
              "a GPT-2 layer: C = n_head * the pools' head size, c_attn's 3 C outputs");
  const std::vector<lora::Update> updates = lora::read_updates(lora_meta, lora_weights, n);
  // product i of `rows` with its adapters' updates; `act` the kernel's activation code
  auto apply = [&](int64_t i, const at::Tensor& rows, int64_t act) {
    if (act == 0 || !lora::updates_product(updates, i)) {
      at::Tensor y = product(i, rows, act);
      lora::apply(updates, i, rows, y);  // (none where act != 0)
      return y;
    }
    at::Tensor y = product(i, rows, 0);
    lora::apply(updates, i, rows, y);  // before the activation, which is ATen's then
    return activate(y, act);
  };
  const std::array<int64_t, 1> shape{width};  // LayerNorm over the last dimension
  at::Tensor h = at::layer_norm(x, shape, norms[0], norms[1], eps);
  at::Tensor qkv = apply(0, h, 0);
  at::Tensor y = attend(qkv, std::nullopt, std::nullopt, k_pool, v_pool, write_block,
                        write_offset, block_tables, context_lens, n_head,
                        std::pow(static_cast<double>(dim), -0.5), window);
  at::Tensor out = at::add(x, apply(1, y.view({n, width}), 0));
  h = at::layer_norm(out, shape, norms[2], norms[3], eps);
  h = apply(2, h, activation);
  return at::add(out, apply(3, h, 0));
}

// The layer whose products read float32 tiles: tiles and biases (f32_matmul's tiles, float32
// biases or none) of c_attn, attn's c_proj, c_fc (through `activation`) and mlp's c_proj.
at::Tensor decode_layer(const at::Tensor& x, at::TensorList norms, at::TensorList tiles,
                        const c10::List<std::optional<at::Tensor>>& biases,
                        at::IntArrayRef widths, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, const at::Tensor& write_block,
                        const at::Tensor& write_offset, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, int64_t n_head, double eps,
                        int64_t activation, int64_t window, at::IntArrayRef lora_meta,
                        at::TensorList lora_weights) {
  TORCH_CHECK(tiles.size() == 4 && biases.size() == 4, "tiles and biases come four each");
  auto product = [&](int64_t i, const at::Tensor& rows, int64_t act) {
    return tiled_product(rows, tiles[i], biases.get(i), widths[i], act);
  };
  return gpt2_layer(x, norms, widths, product, k_pool, v_pool, write_block, write_offset,
                    block_tables, context_lens, n_head, eps, activation, window, lora_meta,
                    lora_weights);
}

// The layer whose products are int8 (q8_matmul.cpp, as `Int8Linear` holds them): codes, scales
// and biases (float32 or none) of the four products, in the same order.
at::Tensor q8_decode_layer(const at::Tensor& x, at::TensorList norms, at::TensorList codes,
                           at::TensorList scales,
                           const c10::List<std::optional<at::Tensor>>& biases,
                           at::IntArrayRef widths, const at::Tensor& k_pool,
                           const at::Tensor& v_pool, const at::Tensor& write_block,
                           const at::Tensor& write_offset, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, int64_t n_head, double eps,
                           int64_t activation, int64_t window, at::IntArrayRef lora_meta,
                           at::TensorList lora_weights) {
  TORCH_CHECK(codes.size() == 4 && scales.size() == 4 && biases.size() == 4,
              "codes, scales and biases come four each");
  auto product = [&](int64_t i, const at::Tensor& rows, int64_t act) {
    return q8_product(rows, codes[i], scales[i], biases.get(i), widths[i], act);
  };
  return gpt2_layer(x, norms, widths, product, k_pool, v_pool, write_block, write_offset,
                    block_tables, context_lens, n_head, eps, activation, window, lora_meta,
                    lora_weights);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def(
      "decode_layer(Tensor x, Tensor[] norms, Tensor[] tiles, Tensor?[] biases, int[] widths, "
      "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor write_block, Tensor write_offset, "
      "Tensor block_tables, Tensor context_lens, int n_head, float eps, int activation, "
      "int window, int[] lora_meta, Tensor[] lora_weights) -> Tensor");
  m.impl("decode_layer", c10::DispatchKey::CPU, &decode_layer);
  m.def(
      "q8_decode_layer(Tensor x, Tensor[] norms, Tensor[] codes, Tensor[] scales, "
      "Tensor?[] biases, int[] widths, Tensor(a!) k_pool, Tensor(b!) v_pool, "
      "Tensor write_block, Tensor write_offset, Tensor block_tables, Tensor context_lens, "
      "int n_head, float eps, int activation, int window, int[] lora_meta, "
      "Tensor[] lora_weights) -> Tensor");
  m.impl("q8_decode_layer", c10::DispatchKey::CPU, &q8_decode_layer);
}
