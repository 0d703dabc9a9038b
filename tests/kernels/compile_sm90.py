"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU, as real launches would.

The interpreter runs the kernels' Python, not Triton's compiler: an API the compiler rejects, a
non-constexpr global or a tile that overflows shared memory only shows up here. Run as a script
with TRITON_INTERPRET unset; it prints one `ok` line per variant and asserts that each kernel's
shared memory fits sm_90. `--quick` compiles four variants that between them reach every kernel,
every code path, bf16, and each kernel with and without grouped-query attention (GROUP 1 and 4) (test_compile.py runs that: each kernel takes seconds of LLVM and ptxas
time on a small CPU), and two more with a sliding window (flash forward and backward, paged
prefill); the full sweep takes many minutes on 2 cores.

Each variant runs the host wrappers (`triton_flash_attention` forward and backward,
`triton_paged_attention`) on CPU tensors laid out as the model lays them out (q, k and v are
views of one qkv projection, the KV pools are head-major like `KVCache`'s), with every kernel
replaced by a recorder. So what is compiled is exactly what the wrappers launch: arguments, tile
sizes, warps and stages. Each recorded launch then goes through Triton's own launch binder, which
specialises it as a launch on a GPU would: an integer argument equal to 1 becomes a constant, and
pointers and integers divisible by 16 get the `tt.divisibility = 16` attribute (what lets the
compiler vectorise loads and pick wider copies, which changes the shared memory a kernel needs).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

sys.path.append(str(Path(__file__).resolve().parents[2]))
assert "TRITON_INTERPRET" not in os.environ, "the interpreter must be off to compile"

import gptserve.kernels.triton.flash as flash  # noqa: E402
import gptserve.kernels.triton.paged as paged  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from gptserve.kernels.metadata import AttentionMetadata  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
KERNELS = {  # the kernels a launch may reach, and the short names the output uses
    (flash, "_flash_fwd_kernel"): "fwd",
    (flash, "_bwd_preprocess_kernel"): "pre",
    (flash, "_flash_bwd_kernel"): "bwd",  # dkdv or dq, after its DQ_PASS
    (paged, "_paged_attn_kernel"): "paged",
    (paged, "_merge_splits_kernel"): "merge",
}
Launch = tuple[JITFunction, str, tuple, dict]  # kernel, short name, args, keyword args
_described: set[str] = set()


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` appends the launch to a list."""

    def __init__(self, kernel: JITFunction, short: str, launches: list[Launch]) -> None:
        self.kernel, self.short, self.launches = kernel, short, launches

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        def record(*args, **kwargs) -> None:
            name = self.short
            if name == "bwd":
                name = "dq" if kwargs["DQ_PASS"] else "dkdv"
            self.launches.append((self.kernel, name, args, kwargs))

        return record


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Within the block the kernels only record their launches, in the list yielded."""
    launches: list[Launch] = []
    with contextlib.ExitStack() as stack:
        for (module, attr), short in KERNELS.items():
            recorder = _Recorder(getattr(module, attr), short, launches)
            stack.enter_context(mock.patch.object(module, attr, recorder))
        yield launches


def compile_launch(kernel: JITFunction, short: str, args: tuple, kwargs: dict) -> int:
    """Compile one recorded launch for sm_90, specialised as Triton specialises launches.

    Returns the shared memory it needs in bytes, after asserting that it fits.
    """
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        BACKEND, kwargs, bound, specialization, options
    )
    names = kernel.arg_names
    ones = [names[i] for (i,) in constexprs if not kernel.params[i].is_constexpr]
    aligned = [names[i] for (i,), attr in attrs.items() if ["tt.divisibility", 16] in attr]
    assert aligned, f"{short}: nothing specialised; has Triton's launch binder changed?"
    if short not in _described:  # once per kernel: what the launch specialised
        _described.add(short)
        print(f"  {short}: constant 1: {', '.join(ones)}; divisible by 16: {', '.join(aligned)}")
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=TARGET, options=options.__dict__)
    shared = compiled.metadata.shared
    consts = {k: v for k, v in kwargs.items() if k.isupper()}
    assert shared <= SHARED_LIMIT, f"{short} {consts}: {shared} bytes of shared memory"
    return shared


def compile_all(launches: list[Launch]) -> str:
    """Compile every launch; 'name=bytes ...' of shared memory, in launch order."""
    return " ".join(f"{short}={compile_launch(k, short, a, kw)}" for k, short, a, kw in launches)


def qkv_views(
    rows: tuple[int, ...], n_head: int, head_dim: int, dtype: torch.dtype, group: int = 1
):  # fmt: skip
    """q (*rows, H, D), k and v (*rows, H // group, D) as the model makes them: views of one
    (*rows, (H + 2 * H // group) * D) tensor."""
    q_width, kv_width = n_head * head_dim, n_head // group * head_dim
    qkv = torch.randn(*rows, q_width + 2 * kv_width, dtype=dtype)
    q, k, v = qkv.split((q_width, kv_width, kv_width), dim=-1)
    return q.unflatten(-1, (n_head, head_dim)), *(
        t.unflatten(-1, (n_head // group, head_dim)) for t in (k, v)
    )


def flash_variant(
    dt: str, head_dim: int, causal: bool, group: int, window: int | None = None
) -> str:
    """Forward and backward of a training step: B=2, T=128, H * D = 4 * D, H // group KV
    heads, each query seeing its last `window` keys where one is given."""
    B, T, H = 2, 128, 4
    q, k, v = (
        t.transpose(1, 2).requires_grad_()  # (B, heads, T, D), strided like the model's
        for t in qkv_views((B, T), H, head_dim, DTYPES[dt], group)
    )
    with recording() as launches:
        y = flash.triton_flash_attention(
            q, k, v, causal=causal, enable_gqa=group > 1, window=window
        )
        y = y.transpose(1, 2).reshape(B, T, H * head_dim)  # what the model's c_proj reads
        y.backward(torch.randn_like(y))
    shared = compile_all(launches)
    shown = "" if window is None else f" window={window}"
    return f"ok flash {dt} D={head_dim} causal={causal} GROUP={group}{shown} shared {shared}"


def paged_variant(
    dt: str, head_dim: int, query_lens: list[int], split: bool, group: int,
    window: int | None = None,
) -> str:  # fmt: skip
    """One step over a head-major pool of 16-token pages holding H // group KV heads;
    split=True cuts contexts into 64 keys; `window`: a sliding window's."""
    H, page = 4, 16
    context_lens = [200 + n for n in query_lens]
    width = -(-max(context_lens) // page)
    tables = [list(range(1 + i * width, 1 + (i + 1) * width)) for i in range(len(query_lens))]
    meta = AttentionMetadata.build(tables, context_lens, query_lens, page, "cpu")
    q, _, _ = qkv_views((meta.num_tokens,), H, head_dim, DTYPES[dt], group)  # (N, H, D)
    pools = [
        torch.zeros(
            1 + len(tables) * width, H // group, page, head_dim, dtype=DTYPES[dt]
        ).transpose(1, 2)
        for _ in "kv"
    ]  # (blocks, page, H // group, D), each (block, head) one contiguous tile
    with recording() as launches:
        paged.triton_paged_attention(
            q, *pools, meta, split_size=64 if split else None, window=window
        )
    block_m = launches[0][3]["BLOCK_M"]
    shared = compile_all(launches)
    shown = "" if window is None else f" window={window}"
    return (
        f"ok paged {dt} D={head_dim} BLOCK_M={block_m} split={split} GROUP={group}{shown} "
        f"shared {shared}"
    )


def main(quick: bool, only_windows: bool = False) -> None:
    decode, prefill = [1, 1, 1, 1], [1, 100, 37]  # BLOCK_M 16; BLOCK_M 64 (the largest)
    windowed = [("fp16", 64, True, 2, 40)], [("fp16", 64, prefill, True, 1, 50)]
    if only_windows:
        flash_variants, paged_variants = windowed
    elif quick:  # each kernel with GROUP 1 once and GROUP 4 (grouped-query attention) once
        flash_variants = [("bf16", 80, True, 4), ("fp32", 256, False, 1), *windowed[0]]
        paged_variants = [
            ("bf16", 64, prefill, True, 1), ("fp32", 80, decode, False, 4), *windowed[1]
        ]  # fmt: skip
    else:
        flash_variants = [
            (dt, d, c, g) for dt in DTYPES for d in (64, 80, 128, 256) for c in (True, False)
            for g in (1, 4)
        ]  # fmt: skip
        paged_variants = [
            (dt, d, q, s, g) for dt in DTYPES for d in (64, 80, 128, 256)
            for q in (decode, prefill) for s in (False, True) for g in (1, 4)
        ]  # fmt: skip
    for variant in flash_variants:
        print(flash_variant(*variant), flush=True)
    for variant in paged_variants:
        print(paged_variant(*variant), flush=True)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:], only_windows="--windows" in sys.argv[1:])
