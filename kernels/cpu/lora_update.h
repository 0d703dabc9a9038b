// A LoRA adapter's update of a run of a product's output rows (lora_update.cpp), shared by the
// operator the products' wrappers call (model.lora.batched) and the one-call Llama layer
// (llama_layer.cpp): one compiled function, so both paths add the very same bits.
#pragma once

#include <ATen/core/Tensor.h>

namespace lora {

// x (n, in) and y (n, out) float32, rows of the step (any row stride, unit column stride);
// a_t (in, R) contiguous: the adapter's A of every piece, stacked, transposed; pieces: per piece
// c0, c1, lo, hi; b_ts: per piece its B (times the scaling), transposed, (c1 - c0, hi - lo)
// contiguous. Adds (x @ a_t)[:, c0:c1] @ b_t into y[:, lo:hi] for each piece.
void add_update(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a_t,
                at::IntArrayRef pieces, at::TensorList b_ts);

}  // namespace lora
