"""Attention kernel benchmarks (CUDA only), each compared with its baseline in the same run.

1. flash_attention (Triton) vs F.scaled_dot_product_attention pinned to its flash backend:
   causal forward and forward+backward, T = 512 .. 16k, head dims 64 and 128, fp16 and bf16.
   TFLOP/s counts the causal half only: forward 2 * 2 * B * H * T^2 * D / 2, backward 2.5x that.
2. paged attention (Triton) decode: one query per sequence over a paged cache, batch 1 .. 256,
   context 128 .. 32k; achieved bandwidth = K/V bytes read / time, next to the device's copy
   bandwidth (read + write bytes of a large copy / time).

    python bench/attention.py [--quick]

Goals (docs/KERNELS.md): forward >= 1.1x SDPA flash at T >= 2k, backward >= 1.0x, paged decode
>= 70% of copy bandwidth when batch x context >= 1M tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run from anywhere in the tree

MODEL_DIM = 2048  # H * D for the flash runs: 32 heads of 64 or 16 heads of 128
TOKENS = 16384  # B * T for the flash runs


def bench_ms(fn, grad_to_none=None) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, grad_to_none=grad_to_none))


def flash_case(B: int, H: int, T: int, D: int, dtype: torch.dtype) -> dict:
    """Times (ms) of ours and SDPA-flash, forward and forward+backward, plus the max difference."""
    from gptserve.kernels.triton.flash import triton_flash_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (
        torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)
    )
    grad = torch.randn_like(q)

    def ours() -> torch.Tensor:
        return triton_flash_attention(q, k, v, causal=True)

    def sdpa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        err = (ours().float() - sdpa().float()).abs().max().item()
    times = {"err": err}
    for name, fn in (("ours", ours), ("sdpa", sdpa)):
        with torch.no_grad():
            times[name + "_fwd"] = bench_ms(fn)
        times[name + "_fb"] = bench_ms(lambda fn=fn: fn().backward(grad), grad_to_none=[q, k, v])
    return times


def bench_flash(dtypes, head_dims, lengths) -> list[dict]:
    rows = []
    print(f"\n== flash attention, causal, B*T = {TOKENS}, H*D = {MODEL_DIM} ==")
    header = f"{'dtype':>8} {'D':>4} {'T':>6} {'B':>3} | {'fwd TF/s':>8} {'sdpa':>6} {'ratio':>5}"
    header += f" | {'f+b TF/s':>8} {'sdpa':>6} {'ratio':>5} | {'bwd ratio':>9} {'max err':>8}"
    print(header)
    for dtype in dtypes:
        for D in head_dims:
            for T in lengths:
                B, H = max(1, TOKENS // T), MODEL_DIM // D
                t = flash_case(B, H, T, D, dtype)
                fwd_flops = 4 * B * H * T * T * D / 2  # causal: half of the T x T scores
                row = dict(
                    dtype=str(dtype).removeprefix("torch."),
                    D=D,
                    T=T,
                    B=B,
                    err=t["err"],
                    fwd=fwd_flops / t["ours_fwd"] / 1e9,
                    fwd_sdpa=fwd_flops / t["sdpa_fwd"] / 1e9,
                    fb=3.5 * fwd_flops / t["ours_fb"] / 1e9,
                    fb_sdpa=3.5 * fwd_flops / t["sdpa_fb"] / 1e9,
                )
                row["fwd_ratio"] = row["fwd"] / row["fwd_sdpa"]
                row["fb_ratio"] = row["fb"] / row["fb_sdpa"]
                # backward alone = (forward + backward) - forward, for both
                row["bwd_ratio"] = (t["sdpa_fb"] - t["sdpa_fwd"]) / (t["ours_fb"] - t["ours_fwd"])
                rows.append(row)
                print(
                    f"{row['dtype']:>8} {D:>4} {T:>6} {B:>3} | {row['fwd']:8.1f} "
                    f"{row['fwd_sdpa']:6.1f} {row['fwd_ratio']:5.2f} | {row['fb']:8.1f} "
                    f"{row['fb_sdpa']:6.1f} {row['fb_ratio']:5.2f} | {row['bwd_ratio']:9.2f} "
                    f"{row['err']:8.1e}",
                    flush=True,
                )
    return rows


def copy_bandwidth_gbs() -> float:
    """Read + write bytes of a 4 GiB device copy per second."""
    src = torch.empty(2**31, device="cuda", dtype=torch.float16)  # 4 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def bench_paged(
    batches, contexts, n_head=16, head_dim=128, page=16, max_tokens=4 << 20
) -> list[dict]:
    from gptserve.kernels.metadata import AttentionMetadata
    from gptserve.kernels.triton.paged import triton_paged_attention

    dtype = torch.float16
    copy_gbs = copy_bandwidth_gbs()
    print(f"\n== paged decode, H={n_head} D={head_dim} fp16, page {page} ==")
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    print(f"{'batch':>6} {'context':>7} {'tokens':>9} | {'us':>8} {'GB/s':>7} {'% copy':>6}")
    num_blocks = max_tokens // page
    # one shared pool: every configuration reads its blocks from it in shuffled order
    k_cache = torch.randn(num_blocks, page, n_head, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    rows = []
    for batch in batches:
        for ctx in contexts:
            tokens = batch * ctx
            if tokens > max_tokens:
                print(f"{batch:>6} {ctx:>7} {tokens:>9} | skipped: more than {max_tokens} tokens")
                continue
            per_seq = -(-ctx // page)
            perm = torch.randperm(num_blocks)[: batch * per_seq].view(batch, per_seq)
            meta = AttentionMetadata.build(perm.tolist(), [ctx] * batch, [1] * batch, page, "cuda")
            q = torch.randn(batch, n_head, head_dim, device="cuda", dtype=dtype)
            ms = bench_ms(lambda q=q, meta=meta: triton_paged_attention(q, k_cache, v_cache, meta))
            nbytes = 2 * tokens * n_head * head_dim * k_cache.element_size()
            gbs = nbytes / ms / 1e6
            rows.append(dict(batch=batch, ctx=ctx, tokens=tokens, gbs=gbs, frac=gbs / copy_gbs))
            print(
                f"{batch:>6} {ctx:>7} {tokens:>9} | {ms * 1e3:8.1f} {gbs:7.0f} {gbs / copy_gbs:6.0%}",
                flush=True,
            )
    return rows


def summary(flash_rows: list[dict], paged_rows: list[dict]) -> None:
    print(
        "\n== summary (goals: fwd >= 1.1x and bwd >= 1.0x SDPA flash at T >= 2k; "
        "paged >= 70% of copy bandwidth at batch x context >= 1M) =="
    )
    long = [r for r in flash_rows if r["T"] >= 2048]
    for D in sorted({r["D"] for r in long}):
        sel = [r for r in long if r["D"] == D]
        fwd, bwd = min(r["fwd_ratio"] for r in sel), min(r["bwd_ratio"] for r in sel)
        print(
            f"flash D={D:<3} T>=2k  min fwd ratio {fwd:4.2f} [{'ok' if fwd >= 1.1 else 'MISS'}]"
            f"  min bwd ratio {bwd:4.2f} [{'ok' if bwd >= 1.0 else 'MISS'}]"
            f"  max err {max(r['err'] for r in sel):.1e}"
        )
    big = [r for r in paged_rows if r["tokens"] >= 1 << 20]
    if big:
        frac = min(r["frac"] for r in big)
        print(
            f"paged decode >=1M tokens: min {frac:.0%} of copy bandwidth "
            f"[{'ok' if frac >= 0.7 else 'MISS'}]"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/attention.py: no CUDA device, nothing to measure (the kernels need a GPU)")
        return 0
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", end="")
    import triton

    print(f"  triton {triton.__version__}")
    if args.quick:
        flash = bench_flash([torch.float16], [64], [512, 2048])
        paged = bench_paged([1, 64], [1024, 16384])
    else:
        lengths = [512, 1024, 2048, 4096, 8192, 16384]
        flash = bench_flash([torch.float16, torch.bfloat16], [64, 128], lengths)
        paged = bench_paged([1, 4, 16, 64, 256], [128, 512, 2048, 8192, 32768])
    summary(flash, paged)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
