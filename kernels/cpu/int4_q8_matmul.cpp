// Int4 products with 8-bit rows (`--int8-activations`): the int4 groups of int4_matmul.cpp, each
// weight code * scale + offset per group of 32 codes and column, times rows rounded to 8 bits per
// block of 32 inputs (row_blocks.h: x ~ d * xq), as llama.cpp multiplies its Q4 matrices:
//   y = sum over groups of  scale * d * sum(code * xq)  +  offset * d * sum(xq)
// the product of the weights with the rounded rows, its integer sums exact. (The offset term
// with the rows' exact float32 sums instead would weigh each rounding error by code * scale, a
// weight not centred on zero, rather than by the weight itself: on SmolLM2 that doubled the
// departure from float32 rows.)
//
// The codes lie in tiles of 32 output columns as (K * copies / 8, 32, 4) bytes (model/
// int4_linear.py's `q8_layout`): for each 8 inputs, each column's 4 bytes hold the codes of
// the first 4 in their low nibbles and of the last 4 in their high ones. A vector of 8 columns
// then multiplies 4 inputs at once, byte by byte, with the 4 products summed in each 32-bit lane
// (a dot-product instruction where the CPU has one, VNNI; else pairs of 16-bit sums, at most
// 16 * 15 * 127 = 30480 a group, widened once a group). The integer sums enter each column's
// float32 sum group by group in one fixed order whatever the number of rows and however the tiles
// are shared among threads: a row's result does not depend on its batch, to the bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "int4_tiles.h"
#include "row_blocks.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using int4_tiles::kTile;  // output columns a tile holds
using int4_tiles::store_tile;

using row_blocks::kBlock;  // inputs of a group of codes and of a row's block

constexpr int64_t kGroupBytes = 16 * kTile;  // a group's codes in a tile: 32 x 32 nibbles
constexpr int64_t kRowChunk = 64;         // rows a thread keeps in cache while tiles pass
constexpr int64_t kPrefetchGroups = 8;    // codes asked for this many groups ahead

#if defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;  // columns a vector holds
constexpr int kRows = 4;  // rows a tile's codes serve at once
using IVec = __m256i;
using FVec = __m256;
inline IVec izero() { return _mm256_setzero_si256(); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec fset(float v) { return _mm256_set1_ps(v); }
inline FVec fma(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline FVec mul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline IVec xquad(const int8_t* p) {  // 4 bytes of a row in every lane
  int32_t quad;
  std::memcpy(&quad, p, sizeof(quad));
  return _mm256_set1_epi32(quad);
}
// 8 columns' 4 bytes -> their low and high nibbles, each lane's 4 codes
inline void nibbles(const uint8_t* p, IVec& lo, IVec& hi) {
  const IVec v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const IVec mask = _mm256_set1_epi8(15);
  lo = _mm256_and_si256(v, mask);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// acc (int32 lanes) + each lane's 4 codes (unsigned) times the row's 4 bytes (signed)
inline IVec dot_add(IVec acc, IVec codes, IVec x) { return _mm256_dpbusd_epi32(acc, codes, x); }
inline IVec widen(IVec acc) { return acc; }
#elif defined(__AVXVNNI__)
inline IVec dot_add(IVec acc, IVec codes, IVec x) { return _mm256_dpbusd_avx_epi32(acc, codes, x); }
inline IVec widen(IVec acc) { return acc; }
#else
// acc (int16 pairs) + each pair of codes times the row's bytes; widened to int32 once a group
inline IVec dot_add(IVec acc, IVec codes, IVec x) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(codes, x));
}
inline IVec widen(IVec acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
#endif
inline FVec to_float(IVec v) { return _mm256_cvtepi32_ps(v); }
inline FVec load_table(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline FVec load_table(const float* p) { return _mm256_loadu_ps(p); }
inline void fstore(float* p, FVec v) { _mm256_storeu_ps(p, v); }
constexpr int kVecs = kTile / kLanes;  // vectors across a tile's columns

// R quantized rows (xq: R rows of ldq bytes; d and xsum: R rows of ldg per-block values, the
// scales and d * sum(xq)) times U vectors of one tile's columns from vector v0, `groups` code
// groups (codes, its table) -> y (R, kTile) at those columns
template <int R, int U, typename S>
void tile_part(const int8_t* xq, int64_t ldq, const float* d, const float* xsum, int64_t ldg,
               const uint8_t* codes, const S* table, int64_t groups, int64_t copies, int v0,
               float* y) {
  FVec out[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) out[r][u] = fzero();
  for (int64_t g = 0, xg = 0, copy = 0; g < groups; ++g) {  // xg: the rows' block, g / copies
    const uint8_t* c = codes + g * kGroupBytes + v0 * kLanes * 4;
    for (int64_t s = 0; s < kBlock / 8; ++s)  // the lines of these columns' codes, ahead
      for (int64_t b = 0; b < U * kLanes * 4; b += 64)
        __builtin_prefetch(c + kPrefetchGroups * kGroupBytes + s * kTile * 4 + b);
    IVec acc[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = izero();
#pragma GCC unroll 4
    for (int64_t s = 0; s < kBlock / 8; ++s) {  // 8 inputs a step
      IVec lo[U], hi[U];
      for (int u = 0; u < U; ++u) nibbles(c + (s * kTile + u * kLanes) * 4, lo[u], hi[u]);
      for (int r = 0; r < R; ++r) {
        const IVec first = xquad(xq + r * ldq + xg * kBlock + 8 * s);
        const IVec last = xquad(xq + r * ldq + xg * kBlock + 8 * s + 4);
        for (int u = 0; u < U; ++u) acc[r][u] = dot_add(dot_add(acc[r][u], lo[u], first), hi[u], last);
      }
      // the sums stay chains in registers: left free, GCC reorders them into trees whose
      // terms spill to the stack
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < U; ++u) asm("" : "+x"(acc[r][u]));
    }
    const S* t = table + g * 2 * kTile + v0 * kLanes;
    for (int u = 0; u < U; ++u) {
      const FVec scale = load_table(t + u * kLanes), offset = load_table(t + kTile + u * kLanes);
      for (int r = 0; r < R; ++r) {
        const FVec sd = mul(scale, fset(d[r * ldg + xg]));
        out[r][u] = fma(to_float(widen(acc[r][u])), sd, out[r][u]);
        out[r][u] = fma(offset, fset(xsum[r * ldg + xg]), out[r][u]);
      }
    }
    if (++copy == copies) copy = 0, ++xg;
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) fstore(y + r * kTile + (v0 + u) * kLanes, out[r][u]);
}

// R rows times a whole tile: 4 rows in two halves of the tile (each half's codes decoded once
// for 4 rows, 15 registers), fewer rows in one pass
template <int R, typename S>
void tile_rows(const int8_t* xq, int64_t ldq, const float* d, const float* xsum, int64_t ldg,
               const uint8_t* codes, const S* table, int64_t groups, int64_t copies, float* y) {
  if constexpr (R == 4) {
    tile_part<R, 2>(xq, ldq, d, xsum, ldg, codes, table, groups, copies, 0, y);
    tile_part<R, 2>(xq, ldq, d, xsum, ldg, codes, table, groups, copies, 2, y);
  } else {
    tile_part<R, kVecs>(xq, ldq, d, xsum, ldg, codes, table, groups, copies, 0, y);
  }
}
#else  // any other CPU: a column at a time, the same sums in the same order
constexpr int kRows = 1;
template <int R, typename S>
void tile_rows(const int8_t* xq, int64_t ldq, const float* d, const float* xsum, int64_t ldg,
               const uint8_t* codes, const S* table, int64_t groups, int64_t copies, float* y) {
  for (int64_t j = 0; j < kTile; ++j) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t xg = g / copies;
      int32_t sum = 0;
      for (int64_t k = 0; k < kBlock; ++k) {
        const uint8_t byte = codes[g * kGroupBytes + ((k / 8) * kTile + j) * 4 + k % 4];
        sum += int32_t(k % 8 < 4 ? byte & 15 : byte >> 4) * xq[xg * kBlock + k];
      }
      const float scale = static_cast<float>(table[g * 2 * kTile + j]);
      const float offset = static_cast<float>(table[g * 2 * kTile + kTile + j]);
      acc = __builtin_fmaf(static_cast<float>(sum), scale * d[xg], acc);
      acc = __builtin_fmaf(offset, xsum[xg], acc);
    }
    y[j] = acc;
  }
}
#endif

// every tile's columns for every row, the tiles shared out among threads; S: the table's type
template <typename S>
void run_tiles(const int8_t* xq, const float* d, const float* sums, int64_t rows, int64_t width,
               const uint8_t* cp, const S* tp, int64_t groups, int64_t copies, int64_t tiles,
               int64_t n, at::Tensor& out) {
  const int64_t ldg = width / kBlock;
  const int64_t tile_bytes = groups * kGroupBytes, tile_entries = groups * 2 * kTile;
  float* out_f = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  at::BFloat16* out_b = out_f ? nullptr : out.data_ptr<at::BFloat16>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float y[kRows * kTile];
    for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {
      const int64_t r1 = std::min(rows, r0 + kRowChunk);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t cols = std::min(kTile, n - t * kTile);
        for (int64_t r = r0; r < r1;) {  // kRows rows at a time, the rest 2 or 1
          const int64_t take = r + kRows <= r1 ? kRows : (r + 2 <= r1 && kRows > 2 ? 2 : 1);
          const int8_t* x = xq + r * width;
          const float *dr = d + r * ldg, *sr = sums + r * ldg;
          const uint8_t* c = cp + t * tile_bytes;
          const S* table = tp + t * tile_entries;
          if (take == kRows)
            tile_rows<kRows>(x, width, dr, sr, ldg, c, table, groups, copies, y);
          else if (take == 2)
            tile_rows<2>(x, width, dr, sr, ldg, c, table, groups, copies, y);
          else
            tile_rows<1>(x, width, dr, sr, ldg, c, table, groups, copies, y);
          const int64_t at = r * n + t * kTile;
          out_f ? store_tile(y, take, cols, out_f + at, n) : store_tile(y, take, cols, out_b + at, n);
          r += take;
        }
      }
    }
  });
}

// x (M, K) float32 or bfloat16; codes (tiles, K * copies / 8, 32, 4) uint8; table (tiles,
// K * copies / 32, 2, 32) float16 or float32 -> (M, n) in out_dtype (float32 or bfloat16)
at::Tensor int4_q8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& table,
                          int64_t n, int64_t copies, at::ScalarType out_dtype) {
  int4_tiles::check_rows(x, out_dtype);
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kTile && codes.size(3) == 4 &&
                  codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be (tiles, K * copies / 8, 32, 4) contiguous uint8");
  const int64_t rows = x.size(0), width = x.size(1), tiles = codes.size(0);
  TORCH_CHECK(copies >= 1 && width % kBlock == 0 && codes.size(1) * 8 == width * copies,
              "x's width times copies must be the codes' and a multiple of 32");
  const int64_t groups = width * copies / kBlock;
  int4_tiles::check_table(table, tiles, groups, n);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // (M, K)
  const float* xp = xf.data_ptr<float>();
  at::Tensor out = at::empty({rows, n}, x.options().dtype(out_dtype));
  if (rows == 0) return out;
  std::vector<int8_t> xq(rows * width);           // (M, K)
  std::vector<float> d(rows * width / kBlock);     // (M, K / 32)
  std::vector<float> sums(rows * width / kBlock);  // (M, K / 32): d * sum(xq), each block's
  at::parallel_for(0, rows * width / kBlock, 256, [&](int64_t b0, int64_t b1) {
    // each block alone: the threads' shares of blocks change no bit
    row_blocks::quantize_blocks(xp + b0 * kBlock, b1 - b0, xq.data() + b0 * kBlock, d.data() + b0);
    for (int64_t b = b0; b < b1; ++b) {
      int32_t total = 0;
      for (int64_t k = 0; k < kBlock; ++k) total += xq[b * kBlock + k];
      sums[b] = d[b] * static_cast<float>(total);
    }
  });
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  if (table.scalar_type() == at::kHalf)
    run_tiles(xq.data(), d.data(), sums.data(), rows, width, cp, table.data_ptr<c10::Half>(),
              groups, copies, tiles, n, out);
  else
    run_tiles(xq.data(), d.data(), sums.data(), rows, width, cp, table.data_ptr<float>(), groups,
              copies, tiles, n, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def(
      "int4_q8_matmul(Tensor x, Tensor codes, Tensor table, int n, int copies, "
      "ScalarType out_dtype) -> Tensor");
  m.impl("int4_q8_matmul", c10::DispatchKey::CPU, &int4_q8_matmul);
}
