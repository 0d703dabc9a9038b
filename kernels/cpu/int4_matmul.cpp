// Int4 products: rows (M, K) in float32 times a matrix of 4-bit codes with a scale and a zero
// point per group of 32 codes, each weight (code - 8) * scale + zero (model/int4_linear.py packs
// it). The matrix lies in tiles of kTile output columns, each tile (K / 2, kTile) bytes: byte
// (p, j) holds column j's codes for inputs 2p (low nibble) and 2p + 1 (high nibble), so a tile
// is one stream read front to back; its (groups, 2, kTile) float16 (or float32) table holds, per group and
// column, the scale and the offset zero - 8 scale. With `copies` > 1 each group of 32 inputs feeds that many consecutive code groups
// (a Q8_0 block as its high and low nibbles).
//
// A column's sum is, group by group, scale * sum(code * x) + offset * sum(x), in
// float32, in one fixed order whatever the number of rows and however the tiles are shared out
// among threads: a row's result does not depend on its batch, to the bit. A tile's codes are
// turned to float once per kRows rows, so a single row reads the matrix at memory speed and many
// rows reuse each tile from cache.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "int4_tiles.h"
#include "row_blocks.h"
#include "vec_f32.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using int4_tiles::kTile;  // output columns a tile holds
using int4_tiles::store_tile;

constexpr int64_t kGroup = 32;     // codes that share a scale and a zero point
constexpr int64_t kRowChunk = 64;  // rows a thread keeps in cache while its tiles pass over them
// codes asked for this many groups (8 KiB a tile) before they are read: one row's product waits
// on memory, and the hardware's prefetch does not run ahead of a tile's start
constexpr int64_t kPrefetchGroups = 16;

#if defined(__AVX512F__)
constexpr int kRows = 4;  // rows a tile's decoded codes serve at once (32 registers)
constexpr int kTilesPerRow = 4;  // tiles a lone row takes at once
// kLanes bytes -> their low and high nibbles as floats
inline void nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
// kLanes float16 or float32 values -> floats
inline Vec load_table(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 2;  // of 16 registers, some spill: still half the decoding a row
constexpr int kTilesPerRow = 1;
inline void nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline Vec load_table(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else  // any other CPU: one lane at a time, the same arithmetic
constexpr int kRows = 1;
constexpr int kTilesPerRow = 1;
inline void nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
  lo = static_cast<float>(*p & 15);
  hi = static_cast<float>(*p >> 4);
}
inline Vec load_table(const c10::Half* p) { return static_cast<float>(*p); }
#endif
inline Vec load_table(const float* p) { return vload(p); }

constexpr int kVecs = kTile / kLanes;  // vectors across a tile's columns

// R rows (x: R rows of ldx floats, xsum: R rows of ldsum group sums) times TL consecutive tiles
// (tile_bytes and tile_entries apart) of `groups` code groups -> y (TL, R, kTile). Several tiles
// at once give a single row independent chains of multiply-adds; each column's arithmetic is the
// same whatever R and TL.
template <int R, int TL, typename S>
void tile_rows(const float* x, int64_t ldx, const float* xsum, int64_t ldsum,
               const uint8_t* codes, int64_t tile_bytes, const S* table,
               int64_t tile_entries, int64_t groups, int64_t copies, float* y) {
  constexpr int U = TL * kVecs;  // vectors across the tiles' columns
  Vec out[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) out[r][u] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t xg = g / copies;  // the group of inputs these codes multiply
    // even and odd inputs in chains of their own: a row's two multiply-adds a step do not wait
    // on each other
    Vec even_acc[R][U], odd_acc[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) even_acc[r][u] = odd_acc[r][u] = vzero();
    const uint8_t* c = codes + g * (kGroup / 2) * kTile;
    for (int i = 0; i < TL; ++i)  // the group kPrefetchGroups ahead, a line at a time
      for (int64_t line = 0; line < (kGroup / 2) * kTile; line += 64)
        __builtin_prefetch(c + i * tile_bytes + kPrefetchGroups * (kGroup / 2) * kTile + line);
    for (int64_t p = 0; p < kGroup / 2; ++p) {
      Vec even[R], odd[R];
      for (int r = 0; r < R; ++r) {
        even[r] = vset(x[r * ldx + xg * kGroup + 2 * p]);
        odd[r] = vset(x[r * ldx + xg * kGroup + 2 * p + 1]);
      }
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        Vec lo, hi;
        nibbles(c + (u / kVecs) * tile_bytes + p * kTile + (u % kVecs) * kLanes, lo, hi);
        for (int r = 0; r < R; ++r) {
          even_acc[r][u] = vfma(lo, even[r], even_acc[r][u]);
          odd_acc[r][u] = vfma(hi, odd[r], odd_acc[r][u]);
        }
      }
    }
    const S* t = table + g * 2 * kTile;
    for (int u = 0; u < U; ++u) {
      const S* column = t + (u / kVecs) * tile_entries + (u % kVecs) * kLanes;
      const Vec s = load_table(column), z = load_table(column + kTile);  // scale, offset
      for (int r = 0; r < R; ++r) {
        out[r][u] = vfma(s, vadd(even_acc[r][u], odd_acc[r][u]), out[r][u]);
        out[r][u] = vfma(z, vset(xsum[r * ldsum + xg]), out[r][u]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u)
      vstore(y + ((u / kVecs) * R + r) * kTile + (u % kVecs) * kLanes, out[r][u]);
}

// every tile's columns for every row, the tiles shared out among threads; S: the table's type
template <typename S>
void run_tiles(const float* xp, int64_t rows, int64_t width, const float* sums,
               const uint8_t* cp, const S* tp, int64_t groups, int64_t copies, int64_t tiles,
               int64_t n, at::Tensor& out) {
  const int64_t ldsum = width / kGroup;
  const int64_t tile_bytes = groups * (kGroup / 2) * kTile, tile_entries = groups * kTile * 2;
  // read once: data_ptr checks the dtype at every call, and a row stores every tile
  float* out_f = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  at::BFloat16* out_b = out_f ? nullptr : out.data_ptr<at::BFloat16>();
  auto store = [&](const float* y, int64_t r, int64_t take, int64_t t) {
    const int64_t cols = std::min(kTile, n - t * kTile), at = r * n + t * kTile;
    out_f ? store_tile(y, take, cols, out_f + at, n) : store_tile(y, take, cols, out_b + at, n);
  };
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float y[kTilesPerRow * kRows * kTile];
    for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {
      const int64_t r1 = std::min(rows, r0 + kRowChunk);
      const int64_t blocked = r0 + (r1 - r0) / kRows * kRows;
      for (int64_t t = begin; t < end; ++t) {  // rows kRows at a time, a tile at a time
        for (int64_t r = r0; r < blocked; r += kRows) {
          tile_rows<kRows, 1>(xp + r * width, width, sums + r * ldsum, ldsum,
                              cp + t * tile_bytes, tile_bytes, tp + t * tile_entries,
                              tile_entries, groups, copies, y);
          store(y, r, kRows, t);
        }
      }
      for (int64_t r = blocked; r < r1; ++r) {  // the rest one by one, kTilesPerRow tiles at once
        const float* xr = xp + r * width;
        const float* sr = sums + r * ldsum;
        for (int64_t t = begin; t < end;) {
          const int64_t span = std::min<int64_t>(end - t, kTilesPerRow);
          if (span == kTilesPerRow)
            tile_rows<1, kTilesPerRow>(xr, width, sr, ldsum, cp + t * tile_bytes, tile_bytes,
                                       tp + t * tile_entries, tile_entries, groups, copies, y);
          else  // the thread's last few tiles, one at a time
            for (int64_t i = 0; i < span; ++i)
              tile_rows<1, 1>(xr, width, sr, ldsum, cp + (t + i) * tile_bytes, tile_bytes,
                              tp + (t + i) * tile_entries, tile_entries, groups, copies,
                              y + i * kTile);
          for (int64_t i = 0; i < span; ++i) store(y + i * kTile, r, 1, t + i);
          t += span;
        }
      }
    }
  });
}

// x (M, K) float32 or bfloat16; codes (tiles, K * copies / 2, kTile) uint8; table (tiles,
// K * copies / 32, 2, kTile) float16 or float32 -> (M, n) in out_dtype (float32 or bfloat16)
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& table,
                       int64_t n, int64_t copies, at::ScalarType out_dtype) {
  int4_tiles::check_rows(x, out_dtype);
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kTile && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous(),
              "codes must be (tiles, K * copies / 2, 32) contiguous uint8");
  const int64_t rows = x.size(0), width = x.size(1), tiles = codes.size(0);
  TORCH_CHECK(copies >= 1 && width % kGroup == 0 && codes.size(1) * 2 == width * copies,
              "x's width times copies must be the codes' and a multiple of 32");
  const int64_t groups = width * copies / kGroup;
  int4_tiles::check_table(table, tiles, groups, n);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // (M, K)
  const float* xp = xf.data_ptr<float>();
  const std::vector<float> sums = row_blocks::block_sums(xp, rows, width);  // (M, K / 32)
  at::Tensor out = at::empty({rows, n}, x.options().dtype(out_dtype));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  if (table.scalar_type() == at::kHalf)
    run_tiles(xp, rows, width, sums.data(), cp, table.data_ptr<c10::Half>(), groups, copies,
              tiles, n, out);
  else
    run_tiles(xp, rows, width, sums.data(), cp, table.data_ptr<float>(), groups, copies, tiles,
              n, out);
  return out;
}

// the float32 lanes this build multiplies at once: 1 where it has no vector path (the loader
// keeps PyTorch's vectorized int4 kernel there)
int64_t int4_lanes() { return kLanes; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def("int4_lanes() -> int", &int4_lanes);
  m.def(
      "int4_matmul(Tensor x, Tensor codes, Tensor table, int n, int copies, ScalarType out_dtype)"
      " -> Tensor");
  m.impl("int4_matmul", c10::DispatchKey::CPU, &int4_matmul);
}
