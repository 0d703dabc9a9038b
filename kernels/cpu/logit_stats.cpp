// What the sampler needs of each row of logits, in one pass over the vocabulary instead of a
// log_softmax (which writes a whole (B, V) table of which a few values are read) and an argmax:
// each row's first index of its largest logit and its log-sum-exp. A token's log-probability is
// then its logit minus the row's log-sum-exp. engine/sampler.py calls it where it builds
// (kernels/cpu/native.py), on float32 rows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vec_math.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

// independent partial results: one vector's worth (16 lanes in two AVX2 registers do not vectorize)
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// logits (B, V) float32 with contiguous rows -> (argmax (B,) int64, logsumexp (B,) float32);
// -inf logits (masked tokens) add nothing to the sum. Each row alone, in one fixed order.
// Without `with_lse` (no logprob is wanted) the exp pass is skipped and the second tensor
// holds NaN.
std::tuple<at::Tensor, at::Tensor> logit_stats(const at::Tensor& logits, bool with_lse) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1 && logits.device().is_cpu() && logits.size(1) > 0,
              "logits must be (B, V) float32 with contiguous rows on the CPU");
  const int64_t rows = logits.size(0), width = logits.size(1), stride = logits.stride(0);
  at::Tensor best = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor lse = at::empty({rows}, logits.options());
  const float* src = logits.data_ptr<float>();
  int64_t* best_out = best.data_ptr<int64_t>();
  float* lse_out = lse.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ x = src + r * stride;
      // each lane's largest logit and the first index it is at (strict >: a tie keeps the
      // earlier), so the argmax needs no second pass
      float lanes[kLanes];
      int32_t where[kLanes], nans[kLanes] = {0};
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] = kNegInf, where[l] = -1;
      int64_t i = 0;
      for (; i + kLanes <= width; i += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) {
          const float v = x[i + l];
          const bool up = v > lanes[l];
          lanes[l] = up ? v : lanes[l];
          where[l] = up ? static_cast<int32_t>(i + l) : where[l];
          nans[l] |= v != v;
        }
      float top = kNegInf;
      bool nan = false;
      for (int64_t l = 0; l < kLanes; ++l) {
        top = lanes[l] > top ? lanes[l] : top;
        nan = nan || nans[l];
      }
      int64_t arg = -1;  // the first index of `top` among the lanes
      for (int64_t l = 0; l < kLanes; ++l) {
        if (lanes[l] == top && where[l] >= 0 && (arg < 0 || where[l] < arg)) arg = where[l];
      }
      for (; i < width; ++i) {  // the tail lies after every lane's elements
        if (x[i] > top) top = x[i], arg = i;
        nan = nan || x[i] != x[i];
      }
      if (nan) {  // as torch.argmax and log_softmax: the first NaN wins, and nothing is a number
        arg = 0;
        while (!(x[arg] != x[arg])) ++arg;
        best_out[r] = arg;
        lse_out[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (arg < 0) arg = 0;  // every logit -inf
      if (!with_lse) {
        best_out[r] = arg;
        lse_out[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      float sums[kLanes] = {0.f};
      for (i = 0; i + kLanes <= width; i += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) {
          const float v = x[i + l];
          sums[l] += v == kNegInf ? 0.f : fast_exp(v - top);
        }
      float sum = 0.f;
      for (int64_t l = 0; l < kLanes; ++l) sum += sums[l];
      for (; i < width; ++i) sum += x[i] == kNegInf ? 0.f : fast_exp(x[i] - top);
      best_out[r] = arg;
      lse_out[r] = top + std::log(sum);  // a row of -inf: -inf
    }
  });
  return {best, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def("logit_stats(Tensor logits, bool with_lse=True) -> (Tensor, Tensor)");
  m.impl("logit_stats", c10::DispatchKey::CPU, &logit_stats);
}
