// A LoRA adapter's update of a product's output, for the few rows of a decode step: h = x @ A.T
// once, then each piece's h[:, c0:c1] @ B.T added into its output columns. PyTorch's mm and
// addmm_ spend a few microseconds each on these products however small (rank 16 over 576
// inputs: 9k multiply-adds), several times what they compute (`python bench/cpu_parts.py
// --parts lora` has the figures); here they are loops over blocks of up to 4
// rows and 4 vectors of columns held in registers, each sum a chain of fused multiply-adds in
// one fixed order (along the inputs for x @ A.T, along the rank for the pieces). Runs of more
// rows go to at::mm and addmm_ (a prefill's rows: threads and blocking pay there).
#include "lora_update.h"

#include "vec_f32.h"

#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace lora {

namespace {

constexpr int64_t kFewRows = 16;  // up to this many rows: the loops
constexpr int kGroup = 4;  // rows summed together: each weight read once for them

// The products below: out[g * os + j] (+)= the sum over k < depth, in order from 0, of
// left[g * ls + k] * right[k * rs + j], each step one fused multiply-add, for rows g < G and the
// block's columns j. Every sum runs the same way in a vector lane or alone and whatever G, so a
// row's result depends on nothing but its own inputs.
template <int G, int W>  // G rows x W vectors of columns
void vector_block(const float* left, int64_t ls, const float* right, int64_t rs, int64_t depth,
                  float* out, int64_t os, bool add) {
  Vec acc[G][W];
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) acc[g][w] = vzero();
  for (int64_t k = 0; k < depth; ++k) {
    for (int w = 0; w < W; ++w) {
      const Vec r = vload(right + k * rs + w * kLanes);
      for (int g = 0; g < G; ++g) acc[g][w] = vfma(vset(left[g * ls + k]), r, acc[g][w]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int w = 0; w < W; ++w) {
      float* o = out + g * os + w * kLanes;
      vstore(o, add ? vadd(vload(o), acc[g][w]) : acc[g][w]);
    }
  }
}

template <int G>  // G rows x one column
void scalar_column(const float* left, int64_t ls, const float* right, int64_t rs, int64_t depth,
                   float* out, int64_t os, bool add) {
  float acc[G] = {};
  for (int64_t k = 0; k < depth; ++k) {
    for (int g = 0; g < G; ++g) acc[g] = __builtin_fmaf(left[g * ls + k], right[k * rs], acc[g]);
  }
  for (int g = 0; g < G; ++g) out[g * os] = add ? out[g * os] + acc[g] : acc[g];
}

template <int G>  // G rows x `cols` columns
void row_group(const float* left, int64_t ls, const float* right, int64_t rs, int64_t depth,
               int64_t cols, float* out, int64_t os, bool add) {
  int64_t j = 0;  // as many chains of sums at once as registers allow, to hide their latency
  if constexpr (G <= 2) {
    for (; j + 4 * kLanes <= cols; j += 4 * kLanes)
      vector_block<G, 4>(left, ls, right + j, rs, depth, out + j, os, add);
  }
  for (; j + 2 * kLanes <= cols; j += 2 * kLanes)
    vector_block<G, 2>(left, ls, right + j, rs, depth, out + j, os, add);
  for (; j + kLanes <= cols; j += kLanes)
    vector_block<G, 1>(left, ls, right + j, rs, depth, out + j, os, add);
  for (; j < cols; ++j) scalar_column<G>(left, ls, right + j, rs, depth, out + j, os, add);
}

// n rows x `cols` columns, kGroup rows at a time
void product(int64_t n, const float* left, int64_t ls, const float* right, int64_t rs,
             int64_t depth, int64_t cols, float* out, int64_t os, bool add) {
  for (int64_t r0 = 0; r0 < n; r0 += kGroup) {
    const float* l = left + r0 * ls;
    float* o = out + r0 * os;
    switch (std::min<int64_t>(kGroup, n - r0)) {
      case 1: row_group<1>(l, ls, right, rs, depth, cols, o, os, add); break;
      case 2: row_group<2>(l, ls, right, rs, depth, cols, o, os, add); break;
      case 3: row_group<3>(l, ls, right, rs, depth, cols, o, os, add); break;
      default: row_group<4>(l, ls, right, rs, depth, cols, o, os, add); break;
    }
  }
}

void check(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a_t,
           at::IntArrayRef pieces, at::TensorList b_ts) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "LoRA update: x (n, in) and y (n, out)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                  a_t.scalar_type() == at::kFloat && x.device().is_cpu() && y.device().is_cpu() &&
                  a_t.device().is_cpu(),
              "LoRA update: float32 on the CPU");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "LoRA update: rows of unit column stride");
  TORCH_CHECK(a_t.dim() == 2 && a_t.size(0) == x.size(1) && a_t.is_contiguous(),
              "LoRA update: a_t (in, R) contiguous");
  TORCH_CHECK(pieces.size() == 4 * b_ts.size(), "LoRA update: four numbers per piece");
  const int64_t rank = a_t.size(1);
  for (size_t k = 0; k < b_ts.size(); ++k) {
    const int64_t c0 = pieces[4 * k], c1 = pieces[4 * k + 1];
    const int64_t lo = pieces[4 * k + 2], hi = pieces[4 * k + 3];
    const at::Tensor& b = b_ts[k];
    TORCH_CHECK(0 <= c0 && c0 < c1 && c1 <= rank && 0 <= lo && lo < hi && hi <= y.size(1) &&
                    b.dim() == 2 && b.size(0) == c1 - c0 && b.size(1) == hi - lo &&
                    b.scalar_type() == at::kFloat && b.device().is_cpu() && b.is_contiguous(),
                "a LoRA piece that does not fit its product");
  }
}

}  // namespace

void add_update(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a_t,
                at::IntArrayRef pieces, at::TensorList b_ts) {
  check(x, y, a_t, pieces, b_ts);
  const int64_t n = x.size(0), in = x.size(1), rank = a_t.size(1);
  if (n > kFewRows) {
    at::Tensor h = at::mm(x, a_t);  // (n, R)
    for (size_t k = 0; k < b_ts.size(); ++k) {
      const int64_t c0 = pieces[4 * k], lo = pieces[4 * k + 2];
      y.narrow(1, lo, pieces[4 * k + 3] - lo)
          .addmm_(h.narrow(1, c0, pieces[4 * k + 1] - c0), b_ts[k]);
    }
    return;
  }
  std::vector<float> h(n * rank);  // (n, R): x @ a_t
  product(n, x.data_ptr<float>(), x.stride(0), a_t.data_ptr<float>(), rank, in, rank, h.data(),
          rank, false);
  for (size_t k = 0; k < b_ts.size(); ++k) {  // y[:, lo:hi] += h[:, c0:c1] @ b_t
    const int64_t c0 = pieces[4 * k], lo = pieces[4 * k + 2], width = pieces[4 * k + 3] - lo;
    product(n, h.data() + c0, rank, b_ts[k].data_ptr<float>(), width, pieces[4 * k + 1] - c0,
            width, y.data_ptr<float>() + lo, y.stride(0), true);
  }
}

std::vector<Update> read_updates(at::IntArrayRef meta, at::TensorList weights, int64_t n) {
  std::vector<Update> updates;
  size_t i = 0, t = 0;
  auto take = [&](int64_t count) {  // the next `count` numbers (count checked >= 0 first)
    TORCH_CHECK(static_cast<size_t>(count) <= meta.size() - i, "lora_meta ends early");
    i += count;
    return meta.slice(i - count, count);
  };
  auto take_weights = [&](int64_t count) {
    TORCH_CHECK(static_cast<size_t>(count) <= weights.size() - t, "lora_weights ends early");
    t += count;
    return weights.slice(t - count, count);
  };
  while (i < meta.size()) {
    const at::IntArrayRef run = take(3);  // r0, r1, updates
    TORCH_CHECK(0 <= run[0] && run[0] < run[1] && run[1] <= n,
                "a LoRA run of rows outside the step's rows");
    TORCH_CHECK(run[2] >= 0, "a negative LoRA update count");
    for (int64_t u = 0; u < run[2]; ++u) {
      const at::IntArrayRef head = take(2);  // product, pieces
      TORCH_CHECK(0 <= head[0] && head[0] < 4, "a LoRA product is 0..3");
      TORCH_CHECK(head[1] >= 0 && head[1] <= (1 << 20), "a LoRA piece count out of range");
      const at::Tensor& a_t = take_weights(1)[0];
      const at::IntArrayRef pieces = take(4 * head[1]);
      updates.push_back({head[0], run[0], run[1], a_t, pieces, take_weights(head[1])});
    }
  }
  TORCH_CHECK(t == weights.size(), "lora_weights has more tensors than lora_meta names");
  return updates;
}

void apply(const std::vector<Update>& updates, int64_t product, const at::Tensor& rows,
           const at::Tensor& y) {
  for (const Update& u : updates) {
    if (u.product == product) {
      add_update(rows.narrow(0, u.r0, u.r1 - u.r0), y.narrow(0, u.r0, u.r1 - u.r0), u.a_t,
                 u.pieces, u.b_ts);
    }
  }
}

bool updates_product(const std::vector<Update>& updates, int64_t product) {
  for (const Update& u : updates) {
    if (u.product == product) return true;
  }
  return false;
}

}  // namespace lora

namespace {

// y (n, out) float32, written in place: the operator the products' wrappers call
void lora_update_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a_t,
                  at::IntArrayRef pieces, at::TensorList b_ts) {
  lora::add_update(x, y, a_t, pieces, b_ts);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def("lora_update_(Tensor(a!) y, Tensor x, Tensor a_t, int[] pieces, Tensor[] b_ts) -> ()");
  m.impl("lora_update_", c10::DispatchKey::CPU, &lora_update_);
}
