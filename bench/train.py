"""Training throughput: train.py's step vs a plain Hugging Face baseline, in one run.

    python bench/train.py                       # CPU: fp32 (+ bf16 autocast row), ratio table
    python bench/train.py --device cuda         # GPU: also MFU (H200 bf16 dense peak 989 TFLOP/s)

Both sides train the same config (6 layers, 6 heads, width 384, block 256, batch 8, GPT-2 vocab)
on the same random token batches with AdamW (lr 6e-4, weight decay 0.1, grad clip 1.0):
- ours: train.LossModule(GPT) + train.make_optimizer + train.train_step (what train.py runs);
- baseline: transformers.GPT2LMHeadModel(labels=...) + torch.optim.AdamW with its defaults.
Steps of the two alternate in rounds so that a noisy machine slows both alike; the table shows
the median tokens/s over rounds and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import GPT, ModelConfig  # noqa: E402
from train import LossModule, make_optimizer, train_step  # noqa: E402

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # bf16 dense


def make_batches(n: int, batch: int, block: int, vocab: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        w = torch.randint(0, vocab, (batch, block + 1), generator=g)
        out.append((w[:, :-1].contiguous().to(device), w[:, 1:].contiguous().to(device)))
    return out


def ours(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, compile_: bool):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    module = LossModule(model)
    if compile_:
        module.compile()
    opt_args = argparse.Namespace(lr=6e-4, weight_decay=0.1, beta1=0.9, beta2=0.95)
    optimizer = make_optimizer(model, opt_args, device.type)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss, _, _ = train_step(module, optimizer, [(x, y)], 1.0, autocast)
        return loss

    return step, model.num_params()


def baseline(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )).to(device)
    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=6e-4, weight_decay=0.1)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            # HF shifts labels itself: pass the whole window's input, labels = the same ids.
            loss = hf(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    return step, hf.config._attn_implementation


def timed(step, batches, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, y in batches:
        step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--steps", type=int, default=3, help="steps per round and side")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--compile", action="store_true", help="add a torch.compile row for ours")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 autocast rows")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "cuda" or (
        args.device == "auto" and torch.cuda.is_available()) else "cpu")
    cfg = ModelConfig(n_layer=6, n_head=6, n_embd=384, block_size=256)
    tokens_per_step = args.batch_size * cfg.block_size
    batches = make_batches(args.steps, args.batch_size, cfg.block_size, cfg.vocab_size, device)

    dtypes = [torch.float32] if device.type == "cpu" else [torch.bfloat16]
    if device.type == "cpu" and not args.no_bf16:
        dtypes.append(torch.bfloat16)
    sides: dict[str, object] = {}
    n_params = 0
    for dtype in dtypes:
        tag = "fp32" if dtype == torch.float32 else "bf16 autocast"
        sides[f"ours ({tag})"], n_params = ours(cfg, device, dtype, False)
        if args.compile:
            sides[f"ours + torch.compile ({tag})"], _ = ours(cfg, device, dtype, True)
        step, attn = baseline(cfg, device, dtype)
        sides[f"HF GPT2LMHeadModel + AdamW ({tag}, attn={attn})"] = step
    for step in sides.values():
        for x, y in batches[: args.warmup]:
            step(x, y)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, step in sides.items():
            times[name].append(timed(step, batches, device))

    tok_s = {n: tokens_per_step * args.steps / statistics.median(t) for n, t in times.items()}
    # nanoGPT's estimate: 6N per token for the matmuls plus attention's 12 * L * C * T.
    flops_per_token = 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    peak = None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in gpu), None)
    print(f"\ndevice {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else ''}"
          f"{torch.get_num_threads()} threads), torch {torch.__version__}; config 6L/6H/384, "
          f"block 256, batch {args.batch_size}, {n_params / 1e6:.1f}M params; median of "
          f"{args.rounds} rounds x {args.steps} steps\n")
    print(f"{'':58s} {'tokens/s':>10s} {'ms/step':>9s} {'vs HF':>7s}" + ("  MFU" if peak else ""))
    for name, value in tok_s.items():
        tag = name[name.index("(") + 1: name.index("(") + 5]
        ref = next(v for n, v in tok_s.items() if n.startswith("HF") and tag in n)
        line = f"{name:58s} {value:10.0f} {1000 * tokens_per_step / value:9.1f} {value / ref:6.2f}x"
        if peak:
            line += f"  {100 * value * flops_per_token / (peak * 1e12):4.1f}%"
        print(line)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
