// Int8 products with 8-bit rows: x (M, K) float32, quantized here per block of 32 inputs to int8
// with a float32 scale (amax / 127, the value rounded to nearest, halves away from zero), times an
// int8 matrix with one scale per output column, an optional bias and an optional activation
// (GELU's tanh form or ReLU, vec_math.h):
// y = act(scale * sum_blocks(d_block * sum_k(w * xq)) + bias), in float32.
//
// The matrix lies in tiles of 32 output columns (model/quantize.py packs it): a tile is (K / 4,
// 32, 4) bytes, each column's 4 weights for 4 consecutive inputs side by side, so that a vector
// of 8 columns multiplies 4 inputs at once and a tile is one stream read front to back. Bytes
// times bytes: |x| times w with x's sign, 4 products summed exactly in each 32-bit lane (a
// dot-product instruction where the CPU has one, VNNI; else pairs of 16-bit sums, each at most
// 2 * 127 * 127), so the weights are never widened to float32 one by one, which on the
// development box costs as much time as reading them. After each block of 32 inputs the integer
// sums enter the column's float32 sum times the block's scale, in the blocks' order: the same
// arithmetic whatever the number of rows and however the tiles are shared out among threads, so
// a row's result does not depend on its batch, to the bit. The rows' quantization is llama.cpp's
// Q8_0 for its activations; the weights keep `Int8Linear`'s per-column scales.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "row_blocks.h"
#include "vec_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // inputs that share a scale
constexpr int64_t kTile = 32;   // output columns a tile holds
constexpr int64_t kQuad = 4;    // inputs a column's consecutive bytes hold

#if defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kVecs = kTile / kLanes;  // vectors across a tile's columns
using IVec = __m256i;
using FVec = __m256;
inline IVec izero() { return _mm256_setzero_si256(); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline IVec load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// acc + each lane's 4 products of |x| (x_abs) and w with x's sign (each at most 127 * 127)
inline IVec dot_add(IVec acc, IVec x_abs, IVec x, IVec w) {
  const IVec ws = _mm256_sign_epi8(w, x);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, x_abs, ws);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, x_abs, ws);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x_abs, ws), _mm256_set1_epi16(1)));
#endif
}
#endif

// how far a block's 8 steps of 4 inputs are unrolled: all 8 with a dot-product instruction; 2
// without, whose 4 instructions a step need more registers than AVX2 has for 8 (GCC then spills
// partial sums to the stack: unrolling 2 made GPT-2's 32-row products 8-10 % faster on AVX2 and
// 15 % slower with VNNI, in one process, the two builds' loops alternating)
#define Q8_PRAGMA(x) _Pragma(#x)
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define Q8_UNROLL Q8_PRAGMA(GCC unroll 8)
#else
#define Q8_UNROLL Q8_PRAGMA(GCC unroll 2)
#endif

using row_blocks::quantize_blocks;

// one quantized row (xq, d) times one tile (K / 4, 32, 4) -> 32 sums
void tile_row(const int8_t* xq, const float* d, const int8_t* w, int64_t width, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  FVec acc[kVecs];
  for (int u = 0; u < kVecs; ++u) acc[u] = fzero();
  for (int64_t k0 = 0; k0 < width; k0 += kBlock) {
    IVec sums[kVecs];
    for (int u = 0; u < kVecs; ++u) sums[u] = izero();
    const int8_t* wb = w + k0 * kTile;  // the block's (8, 32, 4) bytes
    __builtin_prefetch(wb + 8 * kBlock * kTile);  // 8 blocks ahead, a line a block
    __builtin_prefetch(wb + 8 * kBlock * kTile + 64);
    Q8_UNROLL
    for (int64_t q = 0; q < kBlock / kQuad; ++q) {
      int32_t quad;
      std::memcpy(&quad, xq + k0 + q * kQuad, sizeof(quad));
      const IVec x = _mm256_set1_epi32(quad), x_abs = _mm256_abs_epi8(x);
      for (int u = 0; u < kVecs; ++u)
        sums[u] = dot_add(sums[u], x_abs, x, load(wb + (q * kTile + u * kLanes) * kQuad));
    }
    const FVec scale = _mm256_set1_ps(d[k0 / kBlock]);
    for (int u = 0; u < kVecs; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[u]), scale, acc[u]);
  }
  for (int u = 0; u < kVecs; ++u) _mm256_storeu_ps(out + u * kLanes, acc[u]);
#else  // any other CPU: a column at a time, the same sums
  for (int64_t j = 0; j < kTile; ++j) {
    float acc = 0.f;
    for (int64_t k0 = 0; k0 < width; k0 += kBlock) {
      int32_t sum = 0;
      for (int64_t k = k0; k < k0 + kBlock; ++k)
        sum += int32_t(w[((k / kQuad) * kTile + j) * kQuad + k % kQuad]) * xq[k];
      acc = __builtin_fmaf(static_cast<float>(sum), d[k0 / kBlock], acc);
    }
    out[j] = acc;
  }
#endif
}

// x (M, K) float32, K a multiple of 32; codes (tiles, K / 4, 32, 4) int8; scales (N) float32;
// bias (N) float32 or none; activation a code of vec_math.h's -> (M, N) float32
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, int64_t n, int64_t activation) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "x must be (M, K) float32 on the CPU");
  const int64_t rows = x.size(0), width = x.size(1), tiles = codes.dim() ? codes.size(0) : 0;
  TORCH_CHECK(width % kBlock == 0, "x's width must be a multiple of 32");
  TORCH_CHECK(codes.dim() == 4 && codes.size(1) * kQuad == width && codes.size(2) == kTile &&
                  codes.size(3) == kQuad && codes.scalar_type() == at::kChar &&
                  codes.is_contiguous(),
              "codes must be (tiles, K / 4, 32, 4) contiguous int8, K as x's width");
  TORCH_CHECK(n > (tiles - 1) * kTile && n <= tiles * kTile, "n does not match the tiles");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous(),
              "scales must be (n) contiguous float32");
  TORCH_CHECK(activation >= kNone && activation <= kRelu, "activation must be 0, 1 or 2");
  const auto act = static_cast<Activation>(activation);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                "bias must be (n) contiguous float32");
    bp = bias->data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  std::vector<int8_t> xq(rows * width);
  std::vector<float> d(rows * width / kBlock);
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, rows * width / kBlock, 256, [&](int64_t b0, int64_t b1) {
    // each block alone: the threads' shares of blocks change no bit
    quantize_blocks(xp + b0 * kBlock, b1 - b0, xq.data() + b0 * kBlock, d.data() + b0);
  });
  const int8_t* wp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float sums[kTile];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c0 = t * kTile, cols = std::min(kTile, n - c0);
      for (int64_t r = 0; r < rows; ++r) {  // the tile stays in cache for every row
        tile_row(xq.data() + r * width, d.data() + r * (width / kBlock), wp + t * width * kTile,
                 width, sums);
        for (int64_t c = 0; c < cols; ++c) {
          const float v = sums[c] * sp[c0 + c];
          op[r * n + c0 + c] = activate(bp ? v + bp[c0 + c] : v, act);
        }
      }
    }
  });
  return out;
}

// codes (tiles, K / 4, 32, 4) int8 -> the (n, K) matrix in rows, in bfloat16 (exact: |w| <= 127),
// for products of many rows by an ordinary bfloat16 product
at::Tensor q8_dense(const at::Tensor& codes, int64_t n) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kTile && codes.size(3) == kQuad &&
                  codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be (tiles, K / 4, 32, 4) contiguous int8");
  const int64_t tiles = codes.size(0), width = codes.size(1) * kQuad;
  TORCH_CHECK(n > (tiles - 1) * kTile && n <= tiles * kTile, "n does not match the tiles");
  at::Tensor out = at::empty({n, width}, codes.options().dtype(at::kBFloat16));
  const int8_t* cp = codes.data_ptr<int8_t>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> rows(kTile * width);  // a tile's columns as rows of int8
    for (int64_t t = begin; t < end; ++t) {
      const int64_t cols = std::min(kTile, n - t * kTile);
      const int8_t* tile = cp + t * width * kTile;
      for (int64_t q = 0; q < width / kQuad; ++q)  // 4 bytes at a time to each column's row
        for (int64_t j = 0; j < cols; ++j)
          std::memcpy(&rows[j * width + q * kQuad], tile + (q * kTile + j) * kQuad, kQuad);
      for (int64_t j = 0; j < cols; ++j) {  // then each row to bfloat16: a float's top half
        const int8_t* src = &rows[j * width];
        uint16_t* dst = op + (t * kTile + j) * width;
        for (int64_t k = 0; k < width; ++k) {
          const float v = src[k];
          uint32_t b;
          std::memcpy(&b, &v, sizeof(b));
          dst[k] = static_cast<uint16_t>(b >> 16);  // exact: |v| <= 128 has 8 significant bits
        }
      }
    }
  });
  return out;
}

// the int8 lanes this build multiplies at once, times 4: 1 where it has no vector path
// (PyTorch's int8 kernel is kept there)
int64_t q8_lanes() {
#if defined(__AVX2__) && defined(__FMA__)
  return kLanes;
#else
  return 1;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def("q8_lanes() -> int", &q8_lanes);
  m.def(
      "q8_matmul(Tensor x, Tensor codes, Tensor scales, Tensor? bias, int n, int activation=0) "
      "-> Tensor");
  m.impl("q8_matmul", c10::DispatchKey::CPU, &q8_matmul);
  m.def("q8_dense(Tensor codes, int n) -> Tensor");
  m.impl("q8_dense", c10::DispatchKey::CPU, &q8_dense);
}
