// A LoRA adapter's update of a run of a product's output rows (lora_update.cpp), shared by the
// operator the products' wrappers call (model.lora.batched) and the one-call layers
// (llama_layer.cpp, decode_layer.cpp): one compiled function, so both paths add the very same
// bits.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace lora {

// x (n, in) and y (n, out) float32, rows of the step (any row stride, unit column stride);
// a_t (in, R) contiguous: the adapter's A of every piece, stacked, transposed; pieces: per piece
// c0, c1, lo, hi; b_ts: per piece its B (times the scaling), transposed, (c1 - c0, hi - lo)
// contiguous. Adds (x @ a_t)[:, c0:c1] @ b_t into y[:, lo:hi] for each piece.
void add_update(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a_t,
                at::IntArrayRef pieces, at::TensorList b_ts);

// A one-call layer's step (llama_layer.cpp, decode_layer.cpp): one adapter's update of one of
// the layer's products (0..3), on rows [r0, r1) of the step, as add_update takes it
struct Update {
  int64_t product, r0, r1;
  at::Tensor a_t;
  at::IntArrayRef pieces;
  at::TensorList b_ts;
};

// `meta` as model.lora.batched.LoraBank.one_call_updates writes it: per adapter run of rows,
// r0, r1, its update count, then per update its product (0..3), its piece count and per piece
// c0, c1, lo, hi; `weights` per update its a_t, then its pieces' b_t. The runs are checked
// against the step's n rows here, the pieces against their product by add_update.
std::vector<Update> read_updates(at::IntArrayRef meta, at::TensorList weights, int64_t n);

// Add each of `updates` of `product` into y, that product's output for `rows` (the step's rows
// of its input)
void apply(const std::vector<Update>& updates, int64_t product, const at::Tensor& rows,
           const at::Tensor& y);

// Whether any of `updates` is of `product`
bool updates_product(const std::vector<Update>& updates, int64_t product);

}  // namespace lora
