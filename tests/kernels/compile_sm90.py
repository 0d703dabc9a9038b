"""Compile every Triton kernel variant for an H100/H200 (sm_90) without a GPU.

The interpreter runs the kernels' Python, not Triton's compiler: an API the compiler rejects, a
non-constexpr global or a tile that overflows shared memory only shows up here. Run as a script
with TRITON_INTERPRET unset; prints one line per variant. `--quick` compiles a few variants that
between them reach every code path (test_compile.py runs that: each kernel takes seconds of
LLVM and ptxas time on a small CPU); the full sweep takes minutes.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
assert "TRITON_INTERPRET" not in os.environ, "the interpreter must be off to compile"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels.flash as flash  # noqa: E402
import kernels.paged as paged  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 227 * 1024  # bytes per block on sm_90
TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def compile_kernel(
    fn, pointers: dict[str, str], floats: set[str], const: dict, warps: int, stages: int
) -> int:
    """Compile fn to a cubin; return its shared memory in bytes."""
    signature = {}
    for name in fn.arg_names:
        if name in const:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=const)
    kernel = triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))
    shared = kernel.metadata.shared
    assert shared <= SHARED_LIMIT, f"{fn.__name__} {const}: {shared} bytes of shared memory"
    return shared


def main(quick: bool) -> None:
    flash_variants = list(itertools.product(TORCH, [64, 80, 128, 256], [True, False]))
    paged_variants = list(itertools.product(TORCH, [64, 80, 128], [True, False]))
    if quick:
        flash_variants = [("fp16", 80, True), ("fp32", 256, False)]
        paged_variants = [("bf16", 64, True), ("fp32", 80, False)]
    for dt, D, causal in flash_variants:
        bd = max(16, triton.next_power_of_2(D))
        prec = flash._dot_precision(TORCH[dt])
        ptrs = {n: "*" + dt for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}
        ptrs.update(LSE="*fp32", DELTA="*fp32")
        bm, bn, warps, stages = flash._fwd_config(D, TORCH[dt])
        const = dict(CAUSAL=causal, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, DOT_PREC=prec)
        fwd = compile_kernel(flash._flash_fwd_kernel, ptrs, {"qk_scale"}, const, warps, stages)
        bm, bn, warps, stages = flash._bwd_config(D, TORCH[dt])
        const.update(BLOCK_M=bm, BLOCK_N=bn)
        floats = {"qk_scale", "sm_scale"}
        dkdv = compile_kernel(flash._bwd_dkdv_kernel, ptrs, floats, const, warps, stages)
        dq = compile_kernel(flash._bwd_dq_kernel, ptrs, floats, const, warps, stages)
        pre = dict(HEAD_DIM=D, BLOCK_M=bm, BLOCK_D=bd)
        compile_kernel(flash._bwd_preprocess_kernel, ptrs, set(), pre, 4, 1)
        print(f"ok flash {dt} D={D} causal={causal} shared fwd={fwd} dkdv={dkdv} dq={dq}")
    for dt, D, split in paged_variants:
        bd = max(16, triton.next_power_of_2(D))
        ptrs = {
            "Q": "*" + dt,
            "KC": "*" + dt,
            "VC": "*" + dt,
            "TABLES": "*i32",
            "CTX_LENS": "*i32",
            "Q_START": "*i32",
            "LSE": "*fp32",
            "OUT": "*fp32" if split else "*" + dt,
            "PART": "*fp32",
        }
        const = dict(
            HEAD_DIM=D,
            BLOCK_M=16,
            BLOCK_N=64,
            BLOCK_D=bd,
            DOT_PREC=flash._dot_precision(TORCH[dt]),
            WRITE_LSE=split,
        )
        warps = 4 if bd <= 64 else 8
        shared = compile_kernel(paged._paged_attn_kernel, ptrs, {"qk_scale"}, const, warps, 2)
        ptrs["OUT"] = "*" + dt
        merge = dict(HEAD_DIM=D, BLOCK_S=8, BLOCK_D=bd)
        compile_kernel(paged._merge_splits_kernel, ptrs, set(), merge, 4, 1)
        print(f"ok paged {dt} D={D} split={split} shared={shared}")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
