// Row-wise steps between a layer's products, each one call instead of several PyTorch operations
// and a cast: RMSNorm and SwiGLU's silu(gate) * up, computed in float32 and written in the dtype
// the next product takes (bfloat16 for the int4 and int8 kernels). kernels/cpu/native.py builds
// them with paged_decode.cpp; model/cpu/optimize.py installs them where a product follows.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_math.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRowsPerTask = 8;

// x (M, C) float32, weight (C,) float32 -> (M, C) in out_dtype: x * rsqrt(mean(x^2) + eps) *
// weight as PyTorch's rms_norm computes it in float32, to the bit: the sum of squares by ATen's
// own reduction (whose order a hand-written sum would not keep: one flipped bfloat16 rounding
// per layer moved a GGUF model's top-1 agreement with its float twin from 99.0 to 98.4 %), the
// rest rounded here as ATen rounds it, then the two products one after the other, and the cast
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() &&
                  x.scalar_type() == at::kFloat,
              "x must be (M, C) contiguous float32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "weight must be (C,) float32");
  const int64_t rows = x.size(0), width = x.size(1);
  const float* src = x.data_ptr<float>();
  at::Tensor squares = at::empty_like(x);  // x^2: pow(x, 2) is x * x
  float* sq = squares.data_ptr<float>();
  for (int64_t i = 0; i < rows * width; ++i) sq[i] = src[i] * src[i];
  // the reduction is ATen's own; mean is that sum divided by the width, then + eps, then
  // 1 / sqrt(): each rounded in float32 as ATen's div_, add_ and rsqrt_ round them
  const at::Tensor sums = at::sum(squares, -1);  // (M,)
  std::vector<float> scale(rows);
  const float* sum = sums.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float mean = sum[r] / static_cast<float>(width);
    scale[r] = 1.f / std::sqrt(mean + static_cast<float>(eps));
  }
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype));
  const float* w = weight.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "rms_norm", [&] {
    scalar_t* dst = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < width; ++i) {
          const float normed = src[r * width + i] * scale[r];
          dst[r * width + i] = static_cast<scalar_t>(normed * w[i]);
        }
      }
    });
  });
  return y;
}

// h (M, 2W): gate columns, then up columns -> (M, W) silu(gate) * up in out_dtype, in float32
at::Tensor silu_mul(const at::Tensor& h, at::ScalarType out_dtype) {
  TORCH_CHECK(h.dim() == 2 && h.size(1) % 2 == 0 && h.stride(1) == 1 && h.device().is_cpu(),
              "h must be (M, 2W) with contiguous rows");
  const int64_t rows = h.size(0), width = h.size(1) / 2;
  at::Tensor y = at::empty({rows, width}, h.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "silu_mul_in", [&] {
    using In = scalar_t;
    const In* src = h.data_ptr<In>();
    const int64_t stride = h.stride(0);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "silu_mul_out", [&] {
      scalar_t* dst = y.data_ptr<scalar_t>();
      at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          // restrict: the rows do not overlap, which lets the compiler vectorize the loop
          const In* __restrict__ gate = src + r * stride;
          const In* __restrict__ up = gate + width;
          scalar_t* __restrict__ out = dst + r * width;
          for (int64_t i = 0; i < width; ++i) {
            const float g = static_cast<float>(gate[i]);
            out[i] = static_cast<scalar_t>(g / (1.f + fast_exp(-g)) * static_cast<float>(up[i]));
          }
        }
      });
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, ScalarType out_dtype) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("silu_mul(Tensor h, ScalarType out_dtype) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
}
