"""What bounds the int4 products of many streams: the core's float32 multiply-add peak.

    python bench/int4_bound.py [--rows 1,4,16,32,64]

One thread, CPU time of this process (steady on a busy machine). First the core's float32
fused multiply-add peak, measured with a compiled loop of 16 independent vector multiply-adds at
the widest width the host has (AVX-512 or AVX2; built with `-march=native`). Then SmolLM2-135M's
int4 layer matrices (a Q4_1 file's, `model.int4_linear` with the compiled kernel), by each row
count: time, the multiply-adds' rate (2 x rows x weights flops) as a share of that peak, and the
rate the weights are read at. One row is bound by reading the weights; from a few rows on the
kernel's float32 multiply-adds run near the peak, and then no reordering of float32 arithmetic
makes it faster: only fewer instructions per weight (8-bit activations and integer dot
products, as llama.cpp does) would.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.cpu_parts import SMOLLM2_INT4_SHAPES  # noqa: E402
from bench.host import print_host  # noqa: E402

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <torch/extension.h>
#include <cstring>
#if defined(__AVX512F__)
using V = __m512;
#define FMA _mm512_fmadd_ps
#define SET _mm512_set1_ps
constexpr int kLanes = 16;
#else
using V = __m256;
#define FMA _mm256_fmadd_ps
#define SET _mm256_set1_ps
constexpr int kLanes = 8;
#endif
template <typename... T>
V _mm_add_all(V first, T... rest) {
  V sum = first;
  ((sum = sum + rest), ...);
  return sum;
}
// 16 independent multiply-add chains at the widest vector width: the core's float32 peak
double fma_flops(int64_t iterations) {
  const V a = SET(1.0001f), b = SET(0.9999f);
  V c0 = SET(0), c1 = SET(1), c2 = SET(2), c3 = SET(3), c4 = SET(4), c5 = SET(5), c6 = SET(6),
    c7 = SET(7), c8 = SET(8), c9 = SET(9), c10 = SET(10), c11 = SET(11), c12 = SET(12),
    c13 = SET(13), c14 = SET(14), c15 = SET(15);
  for (int64_t n = 0; n < iterations; ++n) {
    c0 = FMA(a, c0, b); c1 = FMA(a, c1, b); c2 = FMA(a, c2, b); c3 = FMA(a, c3, b);
    c4 = FMA(a, c4, b); c5 = FMA(a, c5, b); c6 = FMA(a, c6, b); c7 = FMA(a, c7, b);
    c8 = FMA(a, c8, b); c9 = FMA(a, c9, b); c10 = FMA(a, c10, b); c11 = FMA(a, c11, b);
    c12 = FMA(a, c12, b); c13 = FMA(a, c13, b); c14 = FMA(a, c14, b); c15 = FMA(a, c15, b);
  }
  const V all = _mm_add_all(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15);
  float out[kLanes];
  std::memcpy(out, &all, sizeof(out));
  return 16.0 * kLanes * 2 * iterations + (out[0] == 1.2345f ? 1 : 0);  // the sums are used
}
"""


def fma_peak_gflops() -> float:
    """This core's float32 multiply-add peak in GFLOP/s (a compiled loop, one thread)."""
    from torch.utils.cpp_extension import load_inline

    module = load_inline(
        "gptserve_bench_fma_peak", cpp_sources=PEAK_SOURCE, functions=["fma_flops"],
        extra_cflags=["-O3", "-march=native"],
    )  # fmt: skip
    module.fma_flops(1_000_000)
    best = 0.0
    for _ in range(5):
        started = time.process_time()
        flops = module.fma_flops(20_000_000)
        best = max(best, flops / (time.process_time() - started) / 1e9)
    return best


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,16,32,64")
    args = p.parse_args()
    torch.set_num_threads(1)
    print_host(bandwidth=False)
    from gptserve.kernels.cpu.native import native_ops
    from gptserve.model.gguf.blocks import Int4Groups
    from gptserve.model.int4_linear import Int4Linear

    if native_ops() is None:
        sys.exit("the compiled kernels are not built here (GPTSERVE_NATIVE=0 or no compiler)")
    peak = fma_peak_gflops()
    rng = np.random.default_rng(0)
    layers = []
    for out, width in SMOLLM2_INT4_SHAPES:  # one layer's matrices, 2.2 MB: they stay in cache
        scales = rng.uniform(0.001, 0.02, (out, width // 32)).astype(np.float32)
        codes = rng.integers(0, 16, (out, width), dtype=np.uint8)
        layers.append(Int4Linear(Int4Groups(codes, scales, np.zeros_like(scales)), compiled=True))
    weights = sum(m.in_features * m.out_features for m in layers)
    nbytes = sum(b.numel() * b.element_size() for m in layers for b in m.buffers())
    print(f"\nthis core's float32 multiply-add peak: {peak:.0f} GFLOP/s (one thread)\n")
    print("| rows | ms a layer | GFLOP/s | share of the peak | weights read at |")
    print("|---|---|---|---|---|")
    for n in (int(r) for r in args.rows.split(",")):
        xs = {m.in_features: torch.randn(n, m.in_features) for m in layers}
        for m in layers:
            m(xs[m.in_features])
        calls = max(5, 2000 // n)
        started = time.process_time()
        for _ in range(calls):
            for m in layers:
                m(xs[m.in_features])
        seconds = (time.process_time() - started) / calls
        gflops = 2 * n * weights / seconds / 1e9
        print(f"| {n} | {seconds * 1e3:.3f} | {gflops:.0f} | {gflops / peak:.0%} | "
              f"{nbytes / seconds / 1e9:.1f} GB/s |")  # fmt: skip


if __name__ == "__main__":
    main()
