// One layer of a CPU decode step in one call: the step's new keys and values written to their
// slots, then each decoding sequence's query (one token) attended over its blocks where they lie.
// kernels/cpu/native.py compiles it once per host (for the host's instruction set) and
// kernels/backends.py calls it as torch.ops.gptserve_cpu.paged_decode.
//
// Pools are one layer's (num_blocks, block_size, H_kv, D) views with the last dimension
// contiguous (head-major in memory: each (block, head) a (block_size, D) tile). A task is a
// sequence's run of KV heads (all of them when the sequences alone keep the threads busy); each
// KV head's G query heads score every key of the sequence in table order, take one softmax each
// and sum the values, all in float32, the same arithmetic whatever the run, so a sequence's
// result does not depend on the rest of the batch, the threads or where its blocks lie, to the
// bit.
//
// A sliding window (`window` > 0, kernels/window.py) lets a sequence's query, at position
// ctx - 1, see only the keys from ctx - window on: blocks wholly before that key are never read
// (their table entries may name blocks the engine has freed), and the keys before it in its
// block get no weight.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // independent partial sums of a dot product (vectorizable)
constexpr int64_t kSerialWork = 1 << 16;  // multiply-adds below which one thread does a step

// q (D,) float . k (D,) of T: kLanes partial sums added in a fixed order (no -ffast-math needed
// for the compiler to vectorize it, and the same order on every instruction set)
template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += q[d + l] * static_cast<float>(k[d + l]);
  }
  for (; d < n; ++d) acc[d % kLanes] += q[d] * static_cast<float>(k[d]);
  for (int64_t half = kLanes / 2; half > 0; half /= 2) {  // a tree: shuffles, not 15 adds
    for (int64_t l = 0; l < half; ++l) acc[l] += acc[l + half];
  }
  return acc[0];
}

// sum of n floats in kLanes partial sums, then the tree (a fixed order, vectorizable)
inline float sum(const float* x, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += x[t + l];
  }
  for (; t < n; ++t) acc[t % kLanes] += x[t];
  for (int64_t half = kLanes / 2; half > 0; half /= 2) {
    for (int64_t l = 0; l < half; ++l) acc[l] += acc[l + half];
  }
  return acc[0];
}

// one vector of floats: 16 with AVX-512, else 8 (two AVX2 registers' worth of shuffles across
// their halves cost more than they save)
#if defined(__AVX512F__)
constexpr int64_t kVec = 16;
#else
constexpr int64_t kVec = 8;
#endif
using vf = float __attribute__((vector_size(kVec * sizeof(float))));
using vi = int32_t __attribute__((vector_size(kVec * sizeof(int32_t))));

inline vf load_vec(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// kVec float16 values widened to float32 (exactly; one instruction where the CPU has F16C)
inline vf load_vec(const c10::Half* p) {
#if defined(__AVX512F__)
  const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vf w;
  for (int64_t i = 0; i < kVec; ++i) w[i] = static_cast<float>(p[i]);
#endif
  vf out;
  std::memcpy(&out, &w, sizeof(out));
  return out;
}

// kVec bfloat16 values widened to float32 (exactly: a bfloat16 is a float32's top 16 bits)
inline vf load_vec(const c10::BFloat16* p) {
  using vu16 = uint16_t __attribute__((vector_size(kVec * sizeof(uint16_t))));
  using vu32 = uint32_t __attribute__((vector_size(kVec * sizeof(uint32_t))));
  vu16 v;
  std::memcpy(&v, p, sizeof(v));
  const vu32 bits = __builtin_convertvector(v, vu32) << 16;
  vf out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// lanes {a[lo..], b[lo..]} + lanes {a[hi..], b[hi..]}: one step of the transposed sum below
inline vf fold(vf a, vf b, vi lo, vi hi) {
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// p[s] holds key s's products in kVec lanes; returns the kVec sums, key s in lane s: a tree of
// shuffles that folds all the keys together (about 3 operations a key, not a reduction each)
inline vf transposed_sum(const vf* p) {
#if defined(__AVX512F__)
  vf u[8], w[4], x[2];
  for (int s = 0; s < 8; ++s) {  // u[s]: key s in lanes 0-7, key s+8 in lanes 8-15
    u[s] = fold(p[s], p[s + 8], vi{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                vi{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  }
  for (int s = 0; s < 4; ++s) {  // w[s]: keys s, s+4, s+8, s+12 in 4 lanes each
    w[s] = fold(u[s], u[s + 4], vi{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                vi{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  }
  for (int s = 0; s < 2; ++s) {  // x[s]: keys s, s+2, ..., s+14 in 2 lanes each
    x[s] = fold(w[s], w[s + 2], vi{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                vi{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  }
  return fold(x[0], x[1], vi{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
              vi{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
#else
  vf u[4], w[2];
  for (int s = 0; s < 4; ++s) {  // u[s]: key s in lanes 0-3, key s+4 in lanes 4-7
    u[s] = fold(p[s], p[s + 4], vi{0, 1, 2, 3, 8, 9, 10, 11}, vi{4, 5, 6, 7, 12, 13, 14, 15});
  }
  for (int s = 0; s < 2; ++s) {  // w[s]: keys s, s+2, s+4, s+6 in 2 lanes each
    w[s] = fold(u[s], u[s + 2], vi{0, 1, 8, 9, 4, 5, 12, 13}, vi{2, 3, 10, 11, 6, 7, 14, 15});
  }
  return fold(w[0], w[1], vi{0, 8, 2, 10, 4, 12, 6, 14}, vi{1, 9, 3, 11, 5, 13, 7, 15});
#endif
}

// whether keys and values of T meet a query of Q in the vector loops below: float32 pools, and
// float16 or bfloat16 pools under a float32 query (a KV cache narrower than its model).
// bfloat16 and float16 models keep the scalar loops' order of sums, and so their bits.
template <typename Q, typename T>
constexpr bool kWidened =
    std::is_same_v<T, float> ||
    (std::is_same_v<Q, float> &&
     (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>));

// the scores of a tile's n keys of T (row stride `stride`) for one query q (dim, a multiple of
// kVec), kVec keys at a time, in float32: each key's products summed over the dimensions in
// order, the kVec keys' chains side by side (one multiply-add chain at a time had left the
// cores waiting on each add's latency), then folded by `transposed_sum`. Past the n-th key the
// rows read are the tile's first (in bounds); their lanes are never stored.
template <typename T>
inline void tile_scores(const float* q, const T* tile, int64_t n, int64_t stride,
                        int64_t dim, float* out) {
  for (int64_t base = 0; base < n; base += kVec) {
    const T* keys[kVec];
    for (int64_t s = 0; s < kVec; ++s) keys[s] = tile + (base + s < n ? base + s : 0) * stride;
    vf p[kVec];
    for (int64_t s = 0; s < kVec; ++s) p[s] = vf{};
    for (int64_t c = 0; c < dim; c += kVec) {
      const vf qc = load_vec(q + c);
      for (int64_t s = 0; s < kVec; ++s) p[s] += qc * load_vec(keys[s] + c);
    }
    const vf y = transposed_sum(p);
    for (int64_t s = 0; s < std::min(kVec, n - base); ++s) out[base + s] = y[s];
  }
}

// acc[0, M vectors) += p[s] * the same vectors of value row s, for a tile's n rows of T (row
// stride `stride`) in order, acc held in registers across the rows
template <int M, typename T>
inline void held_values(const float* p, const T* tile, int64_t n, int64_t stride,
                        float* acc) {
  vf a[M];
  for (int i = 0; i < M; ++i) a[i] = load_vec(acc + i * kVec);
  for (int64_t s = 0; s < n; ++s) {
    const T* row = tile + s * stride;
    const vf weight = vf{} + p[s];
    for (int i = 0; i < M; ++i) a[i] += weight * load_vec(row + i * kVec);
  }
  std::memcpy(acc, a, sizeof(a));
}

// acc (dim, a multiple of kVec) += p[s] * value row s of a tile's n rows of T, in order
template <typename T>
inline void tile_values(const float* p, const T* tile, int64_t n, int64_t stride,
                        int64_t dim, float* acc) {
  int64_t c = 0;
  for (; c + 8 * kVec <= dim; c += 8 * kVec) held_values<8, T>(p, tile + c, n, stride, acc + c);
  switch ((dim - c) / kVec) {
    case 7: return held_values<7, T>(p, tile + c, n, stride, acc + c);
    case 6: return held_values<6, T>(p, tile + c, n, stride, acc + c);
    case 5: return held_values<5, T>(p, tile + c, n, stride, acc + c);
    case 4: return held_values<4, T>(p, tile + c, n, stride, acc + c);
    case 3: return held_values<3, T>(p, tile + c, n, stride, acc + c);
    case 2: return held_values<2, T>(p, tile + c, n, stride, acc + c);
    case 1: return held_values<1, T>(p, tile + c, n, stride, acc + c);
    default: return;
  }
}

// ask for rows [0, n) of heads [h0, h1) of a block (row stride `stride`, head stride
// `head_stride`, `dim` elements each) to be cached
template <typename T>
inline void prefetch_rows(const T* block, int64_t n, int64_t stride, int64_t h0, int64_t h1,
                          int64_t head_stride, int64_t dim) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t h = h0; h < h1; ++h) {
      const T* row = block + s * stride + h * head_stride;
      for (int64_t d = 0; d < dim; d += kLine) __builtin_prefetch(row + d);
    }
  }
}

template <typename S, typename T>
void write_new(const at::Tensor& x, const at::Tensor& pool, const int64_t* block,
               const int64_t* offset) {
  // x (N, H_kv, D) of S -> pool[block[n], offset[n], h, :] of T (rounded to nearest, as
  // PyTorch's `to` rounds)
  const int64_t n_tok = x.size(0), n_kv = x.size(1), dim = x.size(2);
  const S* src = x.data_ptr<S>();
  T* dst = pool.data_ptr<T>();
  for (int64_t n = 0; n < n_tok; ++n) {
    for (int64_t h = 0; h < n_kv; ++h) {
      const S* from = src + n * x.stride(0) + h * x.stride(1);
      T* to = dst + block[n] * pool.stride(0) + offset[n] * pool.stride(1) + h * pool.stride(2);
      for (int64_t d = 0; d < dim; ++d) to[d] = static_cast<T>(from[d]);
    }
  }
}

template <typename Q, typename T, typename O>  // queries of Q, pools of T, outputs of O
void attend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
            const int32_t* tables, int64_t table_width, const int32_t* ctx_lens, int64_t n_seq,
            double scale, int64_t window, at::Tensor& out) {
  const int64_t n_head = q.size(1), dim = q.size(2);
  const int64_t n_kv = k_pool.size(2), bs = k_pool.size(1);
  const int64_t group = n_head / n_kv;
  const Q* qp = q.data_ptr<Q>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  O* op = out.data_ptr<O>();
  const int64_t kb = k_pool.stride(0), ks = k_pool.stride(1), kh = k_pool.stride(2);
  const int64_t vb = v_pool.stride(0), vs = v_pool.stride(1), vh = v_pool.stride(2);
  int64_t work = 0;  // (`check_step` has checked every context and table entry read below)
  for (int64_t b = 0; b < n_seq; ++b) {
    const int64_t ctx = ctx_lens[b];
    work += (window > 0 ? std::min(ctx, window) : ctx) * n_head * dim;
  }
  // A task is a sequence's run of `span` KV heads: it reads each block's rows of those heads
  // in memory order (the whole block when every head is one task's, as with many sequences).
  // Runs are split only as far as the threads need work.
  const int64_t threads = at::get_num_threads();
  const int64_t runs = std::min(n_kv, std::max<int64_t>(1, (2 * threads + n_seq - 1) / n_seq));
  const int64_t span = (n_kv + runs - 1) / runs;
  const int64_t per_seq = (n_kv + span - 1) / span;
  const int64_t tasks = n_seq * per_seq;
  const int64_t grain = work < kSerialWork ? tasks : 1;
  // keys in rows of whole vectors take `tile_scores` (a choice of the pools' shape alone: a
  // sequence's scores never depend on its batch)
  const bool tiled = dim % kVec == 0;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(span * group * dim), acc(span * group * dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / per_seq, h0 = task % per_seq * span;
      const int64_t h1 = std::min(n_kv, h0 + span), heads = (h1 - h0) * group;
      const int64_t ctx = ctx_lens[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;  // first key seen
      const int64_t first = lo / bs * bs;  // its block's first slot: blocks before it unread
      const int32_t* table = tables + b * table_width;
      for (int64_t j = 0; j < heads; ++j) {  // query heads h0 * group ... h1 * group - 1
        const Q* src = qp + b * q.stride(0) + (h0 * group + j) * q.stride(1);
        for (int64_t d = 0; d < dim; ++d) qf[j * dim + d] = static_cast<float>(src[d]) * fscale;
      }
      scores.resize(heads * ctx);  // (heads, ctx), keys [first, ctx) filled
      for (int64_t start = first; start < ctx; start += bs) {
        const T* block = kp + int64_t(table[start / bs]) * kb;
        const int64_t n = std::min(bs, ctx - start);
        // the next block's rows of head h are asked for while head h of this one computes
        const T* next = start + bs < ctx ? kp + int64_t(table[start / bs + 1]) * kb : nullptr;
        const int64_t next_n = std::min(bs, ctx - start - bs);
        for (int64_t h = h0; h < h1; ++h) {
          if (next != nullptr) prefetch_rows(next, next_n, ks, h, h + 1, kh, dim);
          const T* tile = block + h * kh;
          const int64_t row0 = (h - h0) * group;
          if constexpr (kWidened<Q, T>) {
            if (tiled) {
              for (int64_t g = 0; g < group; ++g) {
                const int64_t r = row0 + g;
                tile_scores(&qf[r * dim], tile, n, ks, dim, &scores[r * ctx + start]);
              }
              continue;
            }
          }
          for (int64_t s = 0; s < n; ++s) {
            for (int64_t g = 0; g < group; ++g) {
              const int64_t r = row0 + g;
              scores[r * ctx + start + s] = dot(&qf[r * dim], tile + s * ks, dim);
            }
          }
        }
      }
      for (int64_t r = 0; r < heads; ++r) {  // softmax numerators; the sum divides at the end
        float* row = &scores[r * ctx];
        const float top = *std::max_element(row + lo, row + ctx);
        for (int64_t t = lo; t < ctx; ++t) row[t] = fast_exp(row[t] - top);
        std::fill(row + first, row + lo, 0.f);  // before the window: no weight
        qf[r * dim] = 1.f / sum(row + lo, ctx - lo);  // the query is spent: its slot keeps 1 / sum
      }
      std::fill(acc.begin(), acc.begin() + heads * dim, 0.f);
      for (int64_t start = first; start < ctx; start += bs) {
        const T* block = vp + int64_t(table[start / bs]) * vb;
        const int64_t n = std::min(bs, ctx - start);
        const T* next = start + bs < ctx ? vp + int64_t(table[start / bs + 1]) * vb : nullptr;
        const int64_t next_n = std::min(bs, ctx - start - bs);
        if constexpr (kWidened<Q, T>) {
          if (tiled) {
            for (int64_t r = 0; r < heads; ++r) {
              const int64_t h = h0 + r / group;
              if (next != nullptr && r % group == 0) {
                prefetch_rows(next, next_n, vs, h, h + 1, vh, dim);
              }
              tile_values(&scores[r * ctx + start], block + h * vh, n, vs, dim, &acc[r * dim]);
            }
            continue;
          }
        }
        if (next != nullptr) prefetch_rows(next, next_n, vs, h0, h1, vh, dim);
        for (int64_t s = 0; s < n; ++s) {
          for (int64_t h = h0; h < h1; ++h) {
            const T* value = block + s * vs + h * vh;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t r = (h - h0) * group + g;
              const float p = scores[r * ctx + start + s];
              float* a = &acc[r * dim];
              for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(value[d]);
            }
          }
        }
      }
      for (int64_t j = 0; j < heads; ++j) {
        O* dst = op + b * out.stride(0) + (h0 * group + j) * out.stride(1);
        const float inv = qf[j * dim];
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<O>(acc[j * dim + d] * inv);
      }
    }
  });
}

// the step's new keys and values k, v (N, H_kv, D) of S written to the pools of T at their
// slots (write_block, write_offset), then the first n_seq sequences' queries q (n_seq.., H, D)
// of S attended over block_tables and context_lens into out (n_seq, H, D) of O
template <typename S, typename T, typename O>
void write_then_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& k_pool, const at::Tensor& v_pool,
                       const at::Tensor& write_block, const at::Tensor& write_offset,
                       const at::Tensor& block_tables, const at::Tensor& context_lens,
                       int64_t n_seq, double scale, int64_t window, at::Tensor& out) {
  const int64_t* block = write_block.data_ptr<int64_t>();
  const int64_t* offset = write_offset.data_ptr<int64_t>();
  write_new<S, T>(k, k_pool, block, offset);
  write_new<S, T>(v, v_pool, block, offset);
  attend<S, T, O>(q, k_pool, v_pool, block_tables.data_ptr<int32_t>(), block_tables.size(1),
                  context_lens.data_ptr<int32_t>(), n_seq, scale, window, out);
}

// the step's slots, (n_tokens,) int64 blocks and offsets, and the tables (B, nb) and context
// lengths (B,) int32 of its sequences, the first n_seq of them decoding (with a `window` > 0 the
// table entries before each one's window are not read, and not checked)
void check_step(const at::Tensor& k_pool, const at::Tensor& v_pool,
                const at::Tensor& write_block, const at::Tensor& write_offset, int64_t n_tokens,
                const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t n_seq,
                int64_t window) {
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes() &&
                  v_pool.scalar_type() == k_pool.scalar_type() && k_pool.stride(-1) == 1 &&
                  v_pool.stride(-1) == 1,
              "the pools must be alike, (blocks, slots, H_kv, D) with contiguous rows");
  TORCH_CHECK(write_block.scalar_type() == at::kLong && write_offset.scalar_type() == at::kLong &&
                  write_block.is_contiguous() && write_offset.is_contiguous() &&
                  write_block.numel() == n_tokens && write_offset.numel() == n_tokens,
              "write_block and write_offset must be (N,) contiguous int64");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && context_lens.scalar_type() == at::kInt &&
                  context_lens.is_contiguous() && context_lens.numel() >= n_seq &&
                  block_tables.size(0) >= n_seq,
              "block_tables (B, nb) and context_lens (B,) must be contiguous int32");
  const int64_t n_blocks = k_pool.size(0), slots = k_pool.size(1);
  const int64_t* block = write_block.data_ptr<int64_t>();
  const int64_t* offset = write_offset.data_ptr<int64_t>();
  for (int64_t n = 0; n < n_tokens; ++n) {
    TORCH_CHECK(block[n] >= 0 && block[n] < n_blocks && offset[n] >= 0 && offset[n] < slots,
                "a new token's slot lies outside the pool");
  }
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* ctx_lens = context_lens.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  for (int64_t b = 0; b < n_seq; ++b) {  // what the attention will read, before anything is written
    const int64_t ctx = ctx_lens[b];
    TORCH_CHECK(ctx > 0 && ctx <= width * slots, "a context length outside its block table");
    const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
    for (int64_t j = lo / slots; j < (ctx + slots - 1) / slots; ++j) {
      const int64_t entry = tables[b * width + j];
      TORCH_CHECK(entry >= 0 && entry < n_blocks, "a block table names a block past the pool");
    }
  }
}

// q (N, H, D); k, v (N, H_kv, D): the step's new tokens, the first n_decode of them one per
// decoding sequence. Writes k, v at (write_block, write_offset) (N,) int64, then returns
// (n_decode, H, D): each decoding sequence's attention over block_tables (B, nb) int32 and
// context_lens (B,) int32 (its first n_decode rows are those sequences); `window` > 0: each
// sees only its last `window` keys.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& write_block, const at::Tensor& write_offset,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        int64_t n_decode, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be (N, heads, D)");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4, "pools must be (blocks, slots, H_kv, D)");
  const at::ScalarType dtype = q.scalar_type(), pool_dtype = k_pool.scalar_type();
  // a float32 model over a float16 or bfloat16 cache passes float32 q, k, v (as
  // paged_decode_qkv computes them, so that a step's decodes get the same bits whether or not a
  // prefill shares it)
  const bool narrower = dtype == at::kFloat && (pool_dtype == at::kHalf || pool_dtype == at::kBFloat16);
  for (const at::Tensor* t : {&q, &k, &v, &k_pool, &v_pool}) {
    const at::ScalarType want = (t == &k_pool || t == &v_pool) ? pool_dtype : dtype;
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == want && (narrower || dtype == pool_dtype),
                "q, k, v and the pools must be CPU tensors of one dtype (or float32 q, k, v over "
                "float16 or bfloat16 pools)");
    TORCH_CHECK(t->stride(-1) == 1, "the last dimension must be contiguous");
  }
  TORCH_CHECK(q.size(1) % k_pool.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k.size(1) == k_pool.size(2) && k.size(2) == k_pool.size(3), "k does not fit pool");
  TORCH_CHECK(v.sizes() == k.sizes() && q.size(0) == k.size(0) && n_decode <= q.size(0) &&
                  q.size(2) == k_pool.size(3),
              "q (N, H, D), k and v (N, H_kv, D) must fit each other and the pools");
  check_step(k_pool, v_pool, write_block, write_offset, k.size(0), block_tables, context_lens,
             n_decode, window);
  at::Tensor out = at::empty({n_decode, q.size(1), q.size(2)}, q.options());
  if (narrower) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(pool_dtype, "paged_decode_narrower", [&] {
      write_then_attend<float, scalar_t, float>(q, k, v, k_pool, v_pool, write_block,
                                                write_offset, block_tables, context_lens,
                                                n_decode, scale, window, out);
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "paged_decode", [&] {
    write_then_attend<scalar_t, scalar_t, scalar_t>(q, k, v, k_pool, v_pool, write_block,
                                                    write_offset, block_tables, context_lens,
                                                    n_decode, scale, window, out);
  });
  return out;
}

// one row of rotary: x * cos + rotate_half(x) * sin with sin's first half negated
// (model/rotary.py), two products rounded and then added as PyTorch does (no fused multiply-add,
// which moves a GGUF model at its bits off its float twin), over the row's first `rotary`
// channels (all `dim` but for a partial rotation, Phi-4-mini's), the rest as they are; without
// cos and sin (a model without rotary positions) the row as it is, in float32
template <typename In>
__attribute__((optimize("fp-contract=off"))) void rotate_row(const In* x, const float* cos,
                                                             const float* sin, int64_t dim,
                                                             int64_t rotary, float* y) {
  if (cos == nullptr) {
    for (int64_t i = 0; i < dim; ++i) y[i] = static_cast<float>(x[i]);
    return;
  }
  const int64_t half = rotary / 2;
  for (int64_t i = 0; i < rotary; ++i) {
    const float turned = static_cast<float>(x[i < half ? i + half : i - half]);
    const float a = static_cast<float>(x[i]) * cos[i];
    const float b = turned * sin[i];
    y[i] = a + b;
  }
  for (int64_t i = rotary; i < dim; ++i) y[i] = static_cast<float>(x[i]);
}

// A decode step of a layer from its fused q/k/v product: qkv (N, (H + 2 H_kv) * D) float32 or
// bfloat16, one new token per sequence (N sequences); cos and sin (N, R) float32 of each token's
// position (model/rotary.py; R = D, or R < D for a partial rotation, which turns each head's
// first R channels only), or none for a model without rotary positions. Rotates q and k in
// float32, writes k and v to the pools at (write_block, write_offset) (float32 pools as they
// are; float16 or bfloat16 pools, the KV cache's dtype, rounded to it), attends with the query in
// float32, and returns (N, H, D) in out_dtype (the dtype of the product that follows): what the
// PyTorch steps between the two products computed, in one call. `window`: paged_decode's.
at::Tensor paged_decode_qkv(const at::Tensor& qkv, const std::optional<at::Tensor>& cos,
                            const std::optional<at::Tensor>& sin,
                            const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& write_block, const at::Tensor& write_offset,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t n_head, double scale, at::ScalarType out_dtype,
                            int64_t window) {
  const at::ScalarType pool_dtype = k_pool.scalar_type();
  TORCH_CHECK((pool_dtype == at::kFloat || pool_dtype == at::kHalf ||
               pool_dtype == at::kBFloat16) &&
                  v_pool.scalar_type() == pool_dtype && k_pool.dim() == 4 &&
                  k_pool.stride(-1) == 1 && v_pool.stride(-1) == 1,
              "the pools must be float32, float16 or bfloat16 (blocks, slots, H_kv, D) with "
              "contiguous rows");
  const int64_t n = qkv.size(0), n_kv = k_pool.size(2), dim = k_pool.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (n_head + 2 * n_kv) * dim &&
                  n_head % n_kv == 0 && dim % 2 == 0,
              "qkv must be (N, (H + 2 H_kv) * D) with contiguous rows");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and sin come together or not at all");
  const int64_t rotary = cos.has_value() && cos->dim() == 2 ? cos->size(1) : dim;
  TORCH_CHECK(!cos.has_value() ||
                  (cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat &&
                   cos->is_contiguous() && sin->is_contiguous() && cos->dim() == 2 &&
                   cos->size(0) == n && rotary % 2 == 0 && rotary <= dim &&
                   sin->sizes() == cos->sizes()),
              "cos and sin must be contiguous float32 (N, R), R even and at most D");
  check_step(k_pool, v_pool, write_block, write_offset, n, block_tables, context_lens, n, window);
  const auto f32 = qkv.options().dtype(at::kFloat);
  at::Tensor q = at::empty({n, n_head, dim}, f32);
  at::Tensor k = at::empty({n, n_kv, dim}, f32);
  at::Tensor v = at::empty({n, n_kv, dim}, f32);
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* cp = cos.has_value() ? cos->data_ptr<float>() : nullptr;
  const float* sp = sin.has_value() ? sin->data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "paged_decode_qkv", [&] {
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* row = qkv.data_ptr<scalar_t>() + t * qkv.stride(0);
      for (int64_t h = 0; h < n_head; ++h) {
        rotate_row(row + h * dim, cp ? cp + t * rotary : cp, sp ? sp + t * rotary : sp, dim,
                   rotary, qp + (t * n_head + h) * dim);
      }
      for (int64_t h = 0; h < n_kv; ++h) {
        rotate_row(row + (n_head + h) * dim, cp ? cp + t * rotary : cp,
                   sp ? sp + t * rotary : sp, dim, rotary, kp + (t * n_kv + h) * dim);
        const scalar_t* value = row + (n_head + n_kv + h) * dim;
        for (int64_t d = 0; d < dim; ++d) vp[(t * n_kv + h) * dim + d] = static_cast<float>(value[d]);
      }
    }
  });
  at::Tensor out = at::empty({n, n_head, dim}, qkv.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, pool_dtype, "paged_decode_qkv_pool", [&] {
    using pool_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out_dtype, "paged_decode_qkv_out", [&] {
      write_then_attend<float, pool_t, scalar_t>(q, k, v, k_pool, v_pool, write_block,
                                                 write_offset, block_tables, context_lens, n,
                                                 scale, window, out);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptserve_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, "
      "Tensor write_block, Tensor write_offset, Tensor block_tables, Tensor context_lens, "
      "int n_decode, float scale, int window=0) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
  m.def(
      "paged_decode_qkv(Tensor qkv, Tensor? cos, Tensor? sin, Tensor(a!) k_pool, Tensor(b!) v_pool, "
      "Tensor write_block, Tensor write_offset, Tensor block_tables, Tensor context_lens, "
      "int n_head, float scale, ScalarType out_dtype, int window=0) -> Tensor");
  m.impl("paged_decode_qkv", c10::DispatchKey::CPU, &paged_decode_qkv);
}
