// Float32 products: rows (M, K) times a matrix laid out in tiles of kTile output columns, each
// tile (K, kTile) so that it is one stream read front to back (model/cpu/tiled_linear.py packs
// it), plus a bias and an activation (GELU's tanh form or ReLU) applied while the result is in
// cache.
//
// Each output is one chain of multiply-adds over k = 0, 1, ..., K - 1, then the bias, then the
// activation: the same arithmetic whatever the number of rows and however the tiles are shared
// out among threads, so a row's result does not depend on its batch, to the bit. Several rows
// share each tile's loads from cache (kRows); a lone row takes kTilesLone tiles at once so that
// its multiply-adds form independent chains and the matrix streams at memory speed.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "vec_f32.h"
#include "vec_math.h"

namespace {

constexpr int64_t kTile = 32;      // output columns a tile holds
constexpr int64_t kRowChunk = 64;  // rows a thread keeps in cache while its tiles pass over them
constexpr int64_t kPrefetchRows = 8;  // a tile's rows of K asked for this far ahead (1 KiB)

#if defined(__AVX512F__)
constexpr int kRows = 4;       // rows that share a tile's loads (with kTilesMany: 16 sums)
constexpr int kTilesMany = 2;  // tiles those rows take at once
constexpr int kTilesLone = 4;  // tiles a lone row takes at once
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 3;  // 12 sums of 16 registers
constexpr int kTilesMany = 1;
constexpr int kTilesLone = 2;
#else
constexpr int kRows = 1;
constexpr int kTilesMany = 1;
constexpr int kTilesLone = 1;
#endif

constexpr int kVecs = kTile / kLanes;  // vectors across a tile's columns

// R rows (ldx floats apart) times TL consecutive tiles (tile_floats apart) -> y (TL, R, kTile)
template <int R, int TL>
void tile_rows(const float* x, int64_t ldx, const float* w, int64_t tile_floats, int64_t width,
               float* y) {
  constexpr int U = TL * kVecs;
  Vec acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u)
      acc[r][u] = vzero();
  for (int64_t k = 0; k < width; ++k) {
    if (R == 1 && k % 2 == 0)  // a lone row streams the matrix: ask ahead, a line at a time
      for (int i = 0; i < TL; ++i)
        for (int64_t line = 0; line < 2 * kTile; line += 16)
          __builtin_prefetch(w + i * tile_floats + (k + kPrefetchRows) * kTile + line);
    Vec xs[R];
    for (int r = 0; r < R; ++r) xs[r] = vset(x[r * ldx + k]);
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const Vec wv = vload(w + (u / kVecs) * tile_floats + k * kTile + (u % kVecs) * kLanes);
      for (int r = 0; r < R; ++r) acc[r][u] = vfma(wv, xs[r], acc[r][u]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u)
      vstore(y + ((u / kVecs) * R + r) * kTile + (u % kVecs) * kLanes, acc[r][u]);
}

// R rows times `span` (1..kTilesLone) tiles -> y (span, R, kTile): the widest compiled block
// that fits, the rest a tile at a time
template <int R>
void rows_fixed(int64_t span, const float* x, int64_t ldx, const float* w, int64_t tile_floats,
                int64_t width, float* y) {
  if (R == 1 && span == kTilesLone)
    return tile_rows<1, kTilesLone>(x, ldx, w, tile_floats, width, y);
  if (span == kTilesMany) return tile_rows<R, kTilesMany>(x, ldx, w, tile_floats, width, y);
  for (int64_t i = 0; i < span; ++i)
    tile_rows<R, 1>(x, ldx, w + i * tile_floats, tile_floats, width, y + i * R * kTile);
}

// `take` (1..R) rows times `span` tiles, as rows_fixed<take>
template <int R = kRows>
void rows_by_tiles(int64_t take, int64_t span, const float* x, int64_t ldx, const float* w,
                   int64_t tile_floats, int64_t width, float* y) {
  if constexpr (R > 1)
    if (take < R) return rows_by_tiles<R - 1>(take, span, x, ldx, w, tile_floats, width, y);
  rows_fixed<R>(span, x, ldx, w, tile_floats, width, y);
}

// y's rows (kTile apart) plus the bias, through the activation, into out's (ldo apart)
void finish(const float* y, int64_t rows, const float* bias, int64_t cols, Activation act,
            float* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = y + r * kTile;
    float* o = out + r * ldo;
    for (int64_t j = 0; j < cols; ++j) {
      o[j] = activate(bias ? yr[j] + bias[j] : yr[j], act);
    }
  }
}

// x (M, K) float32; tiles (T, K, kTile) float32; bias (n) or none -> act(x W^T + bias), (M, n)
at::Tensor f32_matmul(const at::Tensor& x, const at::Tensor& tiles,
                      const std::optional<at::Tensor>& bias, int64_t n, int64_t activation) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "x must be (M, K) float32 on the CPU");
  TORCH_CHECK(tiles.dim() == 3 && tiles.size(2) == kTile && tiles.scalar_type() == at::kFloat &&
                  tiles.is_contiguous() && tiles.size(1) == x.size(1),
              "tiles must be (tiles, K, 32) contiguous float32, K as x's width");
  const int64_t rows = x.size(0), width = x.size(1), count = tiles.size(0);
  TORCH_CHECK(n > (count - 1) * kTile && n <= count * kTile, "n does not match the tiles");
  TORCH_CHECK(activation >= kNone && activation <= kRelu, "activation must be 0, 1 or 2");
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == n && b.scalar_type() == at::kFloat,
                "bias must be (n) float32");
    bp = b.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* wp = tiles.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tile_floats = width * kTile;
  const auto act = static_cast<Activation>(activation);
  auto store = [&](const float* y, int64_t r, int64_t take, int64_t t) {
    const int64_t col = t * kTile;
    finish(y, take, bp ? bp + col : nullptr, std::min(kTile, n - col), act, op + r * n + col, n);
  };
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    float y[std::max(kTilesLone, kTilesMany) * kRows * kTile];
    for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {
      const int64_t r1 = std::min(rows, r0 + kRowChunk);
      const int64_t many = r1 - r0 == 1 ? kTilesLone : kTilesMany;
      for (int64_t t = begin; t < end;) {  // the tiles, kTilesMany at a time (a lone row more)
        const int64_t span = std::min<int64_t>(end - t, many);
        for (int64_t r = r0; r < r1; r += kRows) {  // the rows, kRows at a time
          const int64_t take = std::min<int64_t>(kRows, r1 - r);
          rows_by_tiles(take, span, xp + r * width, width, wp + t * tile_floats, tile_floats,
                        width, y);
          for (int64_t i = 0; i < span; ++i) store(y + i * take * kTile, r, take, t + i);
        }
        t += span;
      }
    }
  });
  return out;
}

// the float32 lanes this build multiplies at once: 1 where it has no vector path (oneDNN is
// faster there and keeps every product)
int64_t f32_lanes() { return kLanes; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def("f32_lanes() -> int", &f32_lanes);
  m.def("f32_matmul(Tensor x, Tensor tiles, Tensor? bias, int n, int activation) -> Tensor");
  m.impl("f32_matmul", c10::DispatchKey::CPU, &f32_matmul);
}
