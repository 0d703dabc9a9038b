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
// `kquant_matmul` decodes an output row a chunk of blocks at a time into a buffer in L1 cache
// and multiplies every input row by it: the rows of a call share one decoding, and each row's
// sum runs in one fixed order (kAcc vector accumulators over the row, then a fixed tree), so a
// row's result does not depend on its batch, to the bit. Output rows are shared out among
// threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_f32.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kSuper = 256;       // weights a super-block holds
constexpr int64_t kQ6Bytes = 210;     // bytes of a Q6_K super-block
constexpr int64_t kQ5Bytes = 176;     // bytes of a Q5_K super-block
constexpr int64_t kChunkBlocks = 16;  // super-blocks decoded at a time: 16 KiB of floats
constexpr int kAcc = 4;               // independent accumulators a row keeps
#if defined(__AVX512F__)
constexpr int kRows = 4;  // input rows a pass over the decoded weights serves (32 registers)
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

// Each decoder first writes a super-block's 256 codes as bytes (plain byte loops, which the
// compiler vectorizes at any width), then turns them into weights kLanes at a time.

// kLanes signed codes -> their weights: scale * code
inline void scaled(const int8_t* q, Vec scale, float* w) {
  vstore(w, vmul(scale, to_float(load_signed(q))));
}

// one Q6_K super-block -> its 256 weights
void decode_q6_k(const uint8_t* block, float* w) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_at(block + 208);
  alignas(64) int8_t q[kSuper];  // the codes less 32, in -32..31
  for (int h = 0; h < 2; ++h) {
    const uint8_t* lo = ql + 64 * h;
    const uint8_t* hi = qh + 32 * h;
    int8_t* o = q + 128 * h;
    for (int l = 0; l < 32; ++l) {  // weight l of each of the half's four runs of 32
      const uint8_t a = lo[l], b = lo[l + 32], c = hi[l];
      o[l] = static_cast<int8_t>(((a & 15) | ((c & 3) << 4)) - 32);
      o[l + 32] = static_cast<int8_t>(((b & 15) | (((c >> 2) & 3) << 4)) - 32);
      o[l + 64] = static_cast<int8_t>(((a >> 4) | (((c >> 4) & 3) << 4)) - 32);
      o[l + 96] = static_cast<int8_t>(((b >> 4) | ((c >> 6) << 4)) - 32);
    }
  }
  for (int j = 0; j < 16; ++j) {  // 16 weights a scale
    const Vec scale = vset(d * static_cast<float>(scales[j]));
    for (int i = 0; i < 16; i += kLanes) scaled(q + 16 * j + i, scale, w + 16 * j + i);
  }
}

// one Q5_K super-block -> its 256 weights: d * sc * q is rounded before dmin * m is taken off,
// as the reference computes it
void decode_q5_k(const uint8_t* block, float* w) {
  const float d = half_at(block), dmin = half_at(block + 2);
  const uint8_t* packed = block + 4;
  const uint8_t* qh = block + 16;
  const uint8_t* qs = block + 48;
  alignas(64) uint8_t q[kSuper];  // the codes, 0..31
  for (int s = 0; s < 8; ++s) {
    const uint8_t* nibbles = qs + 32 * (s / 2);
    const int shift = 4 * (s & 1);
    for (int l = 0; l < 32; ++l)
      q[32 * s + l] = static_cast<uint8_t>(((nibbles[l] >> shift) & 15) | (((qh[l] >> s) & 1) << 4));
  }
  for (int s = 0; s < 8; ++s) {
    const int low = s < 4 ? packed[s] & 63 : (packed[s + 4] & 15) | ((packed[s - 4] >> 6) << 4);
    const int min = s < 4 ? packed[s + 4] & 63 : (packed[s + 4] >> 4) | ((packed[s] >> 6) << 4);
    const Vec scale = vset(d * static_cast<float>(low)), offset = vset(dmin * static_cast<float>(min));
    for (int i = 0; i < 32; i += kLanes) {
      const Vec v = rounded(vmul(scale, to_float(load_bytes(q + 32 * s + i))));
      vstore(w + 32 * s + i, vsub(v, offset));
    }
  }
}

using Decoder = void (*)(const uint8_t*, float*);

// R input rows (x, ldx apart) times `count` decoded weights w, added to the rows' accumulators
// (acc: R rows of kAcc * kLanes floats)
template <int R>
void chunk_dot(const float* w, const float* x, int64_t ldx, int64_t count, float* acc) {
  Vec a[R][kAcc];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kAcc; ++i) a[r][i] = vload(acc + (r * kAcc + i) * kLanes);
  for (int64_t k = 0; k < count; k += kAcc * kLanes) {
    for (int i = 0; i < kAcc; ++i) {
      const Vec wv = vload(w + k + i * kLanes);
      for (int r = 0; r < R; ++r) a[r][i] = vfma(wv, vload(x + r * ldx + k + i * kLanes), a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kAcc; ++i) vstore(acc + (r * kAcc + i) * kLanes, a[r][i]);
}

// a row's kAcc * kLanes partial sums -> its sum, in a fixed order
float reduce(const float* acc) {
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l)
    lanes[l] = (acc[l] + acc[kLanes + l]) + (acc[2 * kLanes + l] + acc[3 * kLanes + l]);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
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
  const float* xp = xf.data_ptr<float>();
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const Decoder decode = kind == 6 ? decode_q6_k : decode_q5_k;
  const int64_t row_blocks = width / kSuper, row_bytes = row_blocks * block_bytes;
  constexpr int64_t kAccFloats = kAcc * kLanes;
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    alignas(64) float w[kChunkBlocks * kSuper];
    std::vector<float> acc(rows * kAccFloats);
    for (int64_t j = begin; j < end; ++j) {
      std::fill(acc.begin(), acc.end(), 0.f);
      const uint8_t* row = bp + j * row_bytes;
      for (int64_t b0 = 0; b0 < row_blocks; b0 += kChunkBlocks) {
        const int64_t count = std::min(kChunkBlocks, row_blocks - b0);
        for (int64_t b = 0; b < count; ++b) decode(row + (b0 + b) * block_bytes, w + b * kSuper);
        const float* xc = xp + b0 * kSuper;
        int64_t r = 0;
        for (; r + kRows <= rows; r += kRows)
          chunk_dot<kRows>(w, xc + r * width, width, count * kSuper, acc.data() + r * kAccFloats);
        for (; r < rows; ++r)
          chunk_dot<1>(w, xc + r * width, width, count * kSuper, acc.data() + r * kAccFloats);
      }
      for (int64_t r = 0; r < rows; ++r) op[r * n + j] = reduce(acc.data() + r * kAccFloats);
    }
  });
  return out;
}

// blocks (N, K / 256 * block bytes) uint8 -> the weights (N, K) float32, exactly the file's
at::Tensor kquant_dequantize(const at::Tensor& blocks, int64_t kind, int64_t width) {
  int64_t block_bytes = 0;
  check_blocks(blocks, kind, width, block_bytes);
  const int64_t n = blocks.size(0), row_blocks = width / kSuper;
  at::Tensor out = at::empty({n, width}, blocks.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const Decoder decode = kind == 6 ? decode_q6_k : decode_q5_k;
  at::parallel_for(0, n * row_blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) decode(bp + b * block_bytes, op + b * kSuper);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def("kquant_matmul(Tensor x, Tensor blocks, int kind) -> Tensor");
  m.impl("kquant_matmul", c10::DispatchKey::CPU, &kquant_matmul);
  m.def("kquant_dequantize(Tensor blocks, int kind, int width) -> Tensor");
  m.impl("kquant_dequantize", c10::DispatchKey::CPU, &kquant_dequantize);
}
