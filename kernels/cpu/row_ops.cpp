// Row-wise steps between a layer's products, each one call instead of several PyTorch operations
// and a cast: RMSNorm and SwiGLU's silu(gate) * up, computed in float32 and written in the dtype
// the next product takes (bfloat16 for the int4 and int8 kernels). kernels/cpu/native.py builds
// them with paged_decode.cpp; model/cpu/optimize.py installs them where a product follows.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_math.h"

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kRowsPerTask = 8;

template <typename In, typename Out>
void rms_norm_rows(const In* x, const float* w, Out* y, int64_t rows, int64_t width, double eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const In* row = x + r * width;
      float acc[kLanes] = {0.f};  // sum of squares in lanes, then a tree: a fixed order
      int64_t c = 0;
      for (; c + kLanes <= width; c += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) {
          const float v = static_cast<float>(row[c + l]);
          acc[l] += v * v;
        }
      }
      for (; c < width; ++c) acc[c % kLanes] += static_cast<float>(row[c]) * static_cast<float>(row[c]);
      for (int64_t half = kLanes / 2; half > 0; half /= 2) {
        for (int64_t l = 0; l < half; ++l) acc[l] += acc[l + half];
      }
      const float inv = 1.f / std::sqrt(acc[0] / static_cast<float>(width) + static_cast<float>(eps));
      Out* out = y + r * width;
      for (int64_t i = 0; i < width; ++i) out[i] = static_cast<Out>(static_cast<float>(row[i]) * inv * w[i]);
    }
  });
}

// x (M, C) float32/bfloat16/float16, weight (C,) float32 -> (M, C) in out_dtype:
// x * rsqrt(mean(x^2) + eps) * weight, all in float32
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "x must be (M, C) contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "weight must be (C,) float32");
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_in", [&] {
    using In = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "rms_norm_out", [&] {
      rms_norm_rows<In, scalar_t>(x.data_ptr<In>(), weight.data_ptr<float>(), y.data_ptr<scalar_t>(),
                                  x.size(0), x.size(1), eps);
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
          const In* gate = src + r * stride;
          const In* up = gate + width;
          for (int64_t i = 0; i < width; ++i) {
            const float g = static_cast<float>(gate[i]);
            dst[r * width + i] = static_cast<scalar_t>(g / (1.f + fast_exp(-g)) * static_cast<float>(up[i]));
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
