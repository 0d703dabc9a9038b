// Rows cut into blocks of 32 inputs, as the products that take them by block read them: each
// block's float32 sum (int4_matmul.cpp), and each block rounded to 8 bits with a scale, llama.cpp's
// Q8_0 for its activations (int4_q8_matmul.cpp, q8_matmul.cpp). Both in one fixed order per
// block, so a row's values do not depend on its batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace row_blocks {

constexpr int64_t kBlock = 32;  // inputs a block holds

// each row's sums over its blocks of 32 inputs, in a fixed order: (M, K) -> (M, K / 32)
inline std::vector<float> block_sums(const float* x, int64_t rows, int64_t width) {
  const int64_t blocks = width / kBlock;
  std::vector<float> sums(rows * blocks);
  for (int64_t i = 0; i < rows * blocks; ++i) {
    const float* g = x + i * kBlock;
    float lanes[8] = {0.f};
    for (int64_t k = 0; k < kBlock; k += 8)
      for (int l = 0; l < 8; ++l) lanes[l] += g[k + l];
    sums[i] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
              ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  }
  return sums;
}

// `blocks` blocks of 32 floats quantized each on its own: xq (blocks * 32) int8 within
// [-127, 127], d (blocks) float32, x ~ d * xq (amax / 127, the value rounded to nearest, halves
// away from zero). A NaN makes the block's scale NaN (the outputs then are, as a float product's
// would be); a block of values below 1e-30 counts as zeros (1 / scale would overflow).
inline void quantize_blocks(const float* x, int64_t blocks, int8_t* xq, float* d) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    bool nan = false;
    for (int64_t i = 0; i < kBlock; ++i) {
      amax = std::max(amax, std::fabs(xb[i]));
      nan |= xb[i] != xb[i];
    }
    const bool zero = nan || !(amax >= 1e-30f);
    const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : (zero ? 0.f : amax / 127.f);
    const float inverse = zero ? 0.f : 1.f / scale;
    d[b] = scale;
    for (int64_t i = 0; i < kBlock; ++i) {
      const float v = xb[i] * inverse;  // within [-127, 127]
      xq[b * kBlock + i] = static_cast<int8_t>(v >= 0.f ? v + 0.5f : v - 0.5f);
    }
  }
}

}  // namespace row_blocks
