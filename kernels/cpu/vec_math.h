// Math the CPU kernels share, written so that the compiler vectorizes the loops calling it.
#pragma once

#include <cstdint>
#include <cstring>

// e^x, branch-free: 2^n * e^r with n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2] and e^r
// by its degree-6 Taylor polynomial (relative error about 1e-7, as the libm's within a few ulp).
// x is clamped to [-87, 88]: e^-87 ~ 1.6e-38 stands for anything smaller, e^88 for anything
// larger (a softmax subtracts its maximum first; silu's 1 + e^-x then divides g by ~1e38: 0).
inline float fast_exp(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest integer
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-06f;  // ln2 in two parts
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// the activations a product can apply to its outputs (model/cpu/few_rows_linear.py's codes)
enum Activation : int64_t { kNone = 0, kGeluTanh = 1, kRelu = 2 };

// v through `act`: GELU's tanh form as 0.5 v (1 + tanh(u)) = v (1 - 1 / (1 + e^(2u)))
inline float activate(float v, Activation act) {
  if (act == kGeluTanh) {
    const float u = 0.7978845608f * (v + 0.044715f * v * v * v);
    return v - v / (1.f + fast_exp(2.f * u));
  }
  if (act == kRelu) return v > 0.f ? v : 0.f;
  return v;
}
