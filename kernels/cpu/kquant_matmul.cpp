// K-quant products: rows (M, K) in float32 times a matrix held as a GGUF file's Q5_K or Q6_K
// super-blocks of 256 weights, each output row's blocks one after another exactly as the file
// stores them (model/kquant_linear.py holds them so):
//
// - Q6_K, 210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), 16 int8 scales (one per 16
//   weights), then the float16 super scale d; w = d * scale * (q - 32), q in 0..63. Each half of
//   128 weights takes 64 bytes of ql and 32 of qh: weight l (l < 32) of its four runs of 32 has
//   ql[l] low, ql[l + 32] low, ql[l] high, ql[l + 32] high for its low bits and bits 0-1, 2-3,
//   4-5, 6-7 of qh[l] for its high ones;
// - Q5_K, 176 bytes: float16 d and dmin, 12 bytes of eight 6-bit scales and mins (as Q4_K's),
//   qh[32] (bit s of qh[l] is weight l of sub-block s's fifth bit), qs[128] (sub-blocks 2i and
//   2i + 1 are the low and high nibbles of bytes 32i..32i + 31); w = d * sc * q - dmin * m.
//
// Each weight is computed as gguf's reference dequantization computes it, in float32 and in
// the same order (d * scale first), so the weights are the file's dequantized values exactly;
// `kquant_dequantize` writes them out (the many-row path multiplies them by a float32 product).
// `kquant_matmul` reads an output row's blocks one by one and takes each weight from its code
// to the accumulators of kRows input rows at once in registers (a call of more rows reads the
// row's codes again for each kRows); each row's sum runs in one fixed order (kAcc vector
// accumulators over the row, then a fixed tree), so a row's result does not depend on its
// batch, to the bit. Output rows are shared out among threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_f32.h"

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kSuper = 256;       // weights a super-block holds
constexpr int64_t kQ6Bytes = 210;     // bytes of a Q6_K super-block
constexpr int64_t kQ5Bytes = 176;     // bytes of a Q5_K super-block
constexpr int kAcc = 4;               // independent accumulators a row keeps
#if defined(__AVX512F__)
constexpr int kRows = 4;  // input rows a pass over a row's codes serves (32 registers)
#else
constexpr int kRows = 2;
#endif

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// kLanes bytes widened to int32 lanes, as floats
#if defined(__AVX512F__)
using IVec = __m512i;
inline IVec load_bytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline IVec load_signed(const int8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec to_float(IVec a) { return _mm512_cvtepi32_ps(a); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
using IVec = __m256i;
inline IVec load_bytes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline IVec load_signed(const int8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline Vec to_float(IVec a) { return _mm256_cvtepi32_ps(a); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
#else  // one lane at a time, the same arithmetic
using IVec = int32_t;
inline IVec load_bytes(const uint8_t* p) { return *p; }
inline IVec load_signed(const int8_t* p) { return *p; }
inline Vec to_float(IVec a) { return static_cast<float>(a); }
inline Vec vmul(Vec a, Vec b) { return a * b; }
inline Vec vsub(Vec a, Vec b) { return a - b; }
#endif

// the product a * b rounded to float32 before it is used: no multiply-add may absorb it
inline Vec rounded(Vec v) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+v"(v));
#else
  volatile float keep = v;
  v = keep;
#endif
  return v;
}

// A super-block is read in two steps: its codes as bytes (plain byte loops, which the compiler
// vectorizes at any width) with its sub-blocks' scales as floats, then its weights kLanes at a
// time, each where it is used (`weights`): the same values for the products and for
// `kquant_dequantize`.

struct Q6Block {
  alignas(64) int8_t q[kSuper];  // the codes less 32, in -32..31
  alignas(64) float scale[16];   // d * scale, one per 16 weights
  static constexpr int64_t kBytes = kQ6Bytes;

  void read(const uint8_t* block) {
    const uint8_t* ql = block;
    const uint8_t* qh = block + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_at(block + 208);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* lo = ql + 64 * h;
      const uint8_t* hi = qh + 32 * h;
      int8_t* o = q + 128 * h;
      for (int l = 0; l < 32; ++l) {  // weight l of each of the half's four runs of 32
        const uint8_t a = lo[l], b = lo[l + 32], c = hi[l];  // c's bit pairs: the runs' high bits
        o[l] = static_cast<int8_t>(((a & 15) | ((c << 4) & 48)) - 32);
        o[l + 32] = static_cast<int8_t>(((b & 15) | ((c << 2) & 48)) - 32);
        o[l + 64] = static_cast<int8_t>(((a >> 4) | (c & 48)) - 32);
        o[l + 96] = static_cast<int8_t>(((b >> 4) | ((c >> 2) & 48)) - 32);
      }
    }
    const Vec dv = vset(d);
    for (int j = 0; j < 16; j += kLanes)
      vstore(scale + j, vmul(dv, to_float(load_signed(scales + j))));
  }
  // weights k .. k + kLanes - 1
  Vec weights(int k) const { return vmul(vset(scale[k / 16]), to_float(load_signed(q + k))); }
};

struct Q5Block {
  alignas(64) uint8_t q[kSuper];  // the codes, 0..31
  float scale[8], offset[8];      // d * sc and dmin * m, one per 32 weights
  static constexpr int64_t kBytes = kQ5Bytes;

  void read(const uint8_t* block) {
    const float d = half_at(block), dmin = half_at(block + 2);
    const uint8_t* packed = block + 4;
    const uint8_t* qh = block + 16;
    const uint8_t* qs = block + 48;
    for (int s = 0; s < 8; ++s) {
      const uint8_t* nibbles = qs + 32 * (s / 2);
      const int shift = 4 * (s & 1);
      for (int l = 0; l < 32; ++l)
        q[32 * s + l] =
            static_cast<uint8_t>(((nibbles[l] >> shift) & 15) | (((qh[l] >> s) & 1) << 4));
    }
    for (int s = 0; s < 8; ++s) {
      const int sc = s < 4 ? packed[s] & 63 : (packed[s + 4] & 15) | ((packed[s - 4] >> 6) << 4);
      const int m = s < 4 ? packed[s + 4] & 63 : (packed[s + 4] >> 4) | ((packed[s] >> 6) << 4);
      scale[s] = d * static_cast<float>(sc);
      offset[s] = dmin * static_cast<float>(m);
    }
  }
  // weights k .. k + kLanes - 1: d * sc * q rounded before dmin * m is taken off, as the
  // reference computes them
  Vec weights(int k) const {
    const Vec v = rounded(vmul(vset(scale[k / 32]), to_float(load_bytes(q + k))));
    return vsub(v, vset(offset[k / 32]));
  }
};

// a row's kAcc * kLanes partial sums -> its sum, in a fixed order
float reduce(const Vec* acc) {
  alignas(64) float lanes[kAcc * kLanes];
  for (int i = 0; i < kAcc; ++i) vstore(lanes + i * kLanes, acc[i]);
  for (int l = 0; l < kLanes; ++l)
    lanes[l] = (lanes[l] + lanes[kLanes + l]) + (lanes[2 * kLanes + l] + lanes[3 * kLanes + l]);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

// R input rows (x, ldx apart) times one output row's `count` super-blocks -> out (R values,
// ldo apart). Each weight goes from its code to every row's accumulators without leaving
// registers; a row's sums are the same whatever R.
template <int R, typename B>
void row_product(const uint8_t* row, int64_t count, const float* x, int64_t ldx, float* out,
                 int64_t ldo) {
  Vec acc[R][kAcc];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kAcc; ++i) acc[r][i] = vzero();
  B block;
  for (int64_t b = 0; b < count; ++b) {
    block.read(row + b * B::kBytes);
    const float* xb = x + b * kSuper;
    for (int k = 0; k < kSuper; k += kAcc * kLanes) {
#pragma GCC unroll 4
      for (int i = 0; i < kAcc; ++i) {
        const Vec w = block.weights(k + i * kLanes);
        for (int r = 0; r < R; ++r)
          acc[r][i] = vfma(w, vload(xb + r * ldx + k + i * kLanes), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = reduce(acc[r]);
}

// every output row for every input row, output rows shared out among threads
template <typename B>
void run_rows(const float* x, int64_t rows, int64_t width, const uint8_t* blocks, int64_t n,
              float* out) {
  const int64_t count = width / kSuper, row_bytes = count * B::kBytes;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* row = blocks + j * row_bytes;
      int64_t r = 0;
      for (; r + kRows <= rows; r += kRows)
        row_product<kRows, B>(row, count, x + r * width, width, out + r * n + j, n);
      for (; r < rows; ++r) row_product<1, B>(row, count, x + r * width, width, out + r * n + j, n);
    }
  });
}

template <typename B>
void dequantize_rows(const uint8_t* blocks, int64_t count, float* out) {
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    B block;
    for (int64_t b = begin; b < end; ++b) {
      block.read(blocks + b * B::kBytes);
      for (int k = 0; k < kSuper; k += kLanes) vstore(out + b * kSuper + k, block.weights(k));
    }
  });
}

void check_blocks(const at::Tensor& blocks, int64_t kind, int64_t k, int64_t& block_bytes) {
  TORCH_CHECK(kind == 5 || kind == 6, "kind must be 5 (Q5_K) or 6 (Q6_K)");
  block_bytes = kind == 6 ? kQ6Bytes : kQ5Bytes;
  TORCH_CHECK(k > 0 && k % kSuper == 0, "the width must be a multiple of 256");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == k / kSuper * block_bytes,
              "blocks must be (N, K / 256 * block bytes) contiguous uint8");
}

// x (M, K) float32 or bfloat16; blocks (N, K / 256 * block bytes) uint8 -> (M, N) float32
at::Tensor kquant_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be (M, K) float32 or bfloat16 on the CPU");
  const int64_t rows = x.size(0), width = x.size(1), n = blocks.size(0);
  int64_t block_bytes = 0;
  check_blocks(blocks, kind, width, block_bytes);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // (M, K)
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  if (kind == 6)
    run_rows<Q6Block>(xf.data_ptr<float>(), rows, width, blocks.data_ptr<uint8_t>(), n,
                      out.data_ptr<float>());
  else
    run_rows<Q5Block>(xf.data_ptr<float>(), rows, width, blocks.data_ptr<uint8_t>(), n,
                      out.data_ptr<float>());
  return out;
}

// blocks (N, K / 256 * block bytes) uint8 -> the weights (N, K) float32, exactly the file's
at::Tensor kquant_dequantize(const at::Tensor& blocks, int64_t kind, int64_t width) {
  int64_t block_bytes = 0;
  check_blocks(blocks, kind, width, block_bytes);
  const int64_t n = blocks.size(0);
  at::Tensor out = at::empty({n, width}, blocks.options().dtype(at::kFloat));
  const int64_t count = n * (width / kSuper);
  if (kind == 6)
    dequantize_rows<Q6Block>(blocks.data_ptr<uint8_t>(), count, out.data_ptr<float>());
  else
    dequantize_rows<Q5Block>(blocks.data_ptr<uint8_t>(), count, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def("kquant_matmul(Tensor x, Tensor blocks, int kind) -> Tensor");
  m.impl("kquant_matmul", c10::DispatchKey::CPU, &kquant_matmul);
  m.def("kquant_dequantize(Tensor blocks, int kind, int width) -> Tensor");
  m.impl("kquant_dequantize", c10::DispatchKey::CPU, &kquant_dequantize);
}
