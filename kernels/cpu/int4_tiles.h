// What the two int4 products (int4_matmul.cpp: float32 rows; int4_q8_matmul.cpp: 8-bit rows)
// share: the tiles of 32 output columns their matrices lie in, the checks of their rows, scale
// table and output width, and the store of a tile's sums into the output's rows.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace int4_tiles {

constexpr int64_t kTile = 32;  // output columns a tile holds

// x (M, K) float32 or bfloat16 on the CPU; the output float32 or bfloat16
inline void check_rows(const at::Tensor& x, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be (M, K) float32 or bfloat16 on the CPU");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "out_dtype must be float32 or bfloat16");
}

// table (tiles, groups, 2, 32) float16 or float32: each group's scale and offset per column; n
// output columns in `tiles` tiles
inline void check_table(const at::Tensor& table, int64_t tiles, int64_t groups, int64_t n) {
  TORCH_CHECK(table.dim() == 4 && table.size(0) == tiles && table.size(1) == groups &&
                  table.size(2) == 2 && table.size(3) == kTile &&
                  (table.scalar_type() == at::kHalf || table.scalar_type() == at::kFloat) &&
                  table.is_contiguous(),
              "table must be (tiles, groups, 2, 32) contiguous float16 or float32");
  TORCH_CHECK(n > (tiles - 1) * kTile && n <= tiles * kTile, "n does not match the tiles");
}

// a tile's sums y (rows, kTile) -> the first `cols` columns of `rows` output rows ldo apart
template <typename T>
void store_tile(const float* y, int64_t rows, int64_t cols, T* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) out[r * ldo + j] = static_cast<T>(y[r * kTile + j]);
}

}  // namespace int4_tiles
