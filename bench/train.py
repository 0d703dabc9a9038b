"""Training throughput: train.py's step vs a plain Hugging Face baseline, in one run.

    python bench/train.py                       # CPU: fp32 (+ bf16 autocast rows), ratio table
    python bench/train.py --device cuda         # GPU: also MFU (H200 bf16 dense peak 989 TFLOP/s)

Both sides train the same config (6 layers, 6 heads, width 384, block 256, batch 8, GPT-2 vocab)
on the same random token batches with AdamW (lr 6e-4, weight decay 0.1, grad clip 1.0):
- ours: training.step's LossModule(GPT) + make_optimizer + train_step, in a process set up as
  train.py sets itself up (on a CPU: glibc keeps freed memory, model.cpu.malloc_tuning);
- baseline: transformers.GPT2LMHeadModel(labels=...) + torch.optim.AdamW with its defaults, in a
  plain process;
- on a CPU, also the baseline with the same allocator setting as ours, to show what that part of
  the difference is.
Each side lives in its own process (the allocator setting is per process); their steps alternate
in rounds so that a noisy machine slows all alike. The table shows the median tokens/s over rounds
and the ratio to the plain baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.model import GPT, ModelConfig  # noqa: E402
from gptserve.model.cpu.malloc_tuning import retain_freed_memory  # noqa: E402
from gptserve.training.step import LossModule, make_optimizer, train_step  # noqa: E402

from bench.host import print_host  # noqa: E402

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
    optimizer = make_optimizer(model, lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss, _, _ = train_step(module, optimizer, [(x, y)], 1.0, autocast)
        return loss

    return step, model.num_params()


def baseline(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.block_size,
            n_embd=cfg.n_embd,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ).to(device)
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


def timed(step, batches, device: torch.device) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) for one pass over `batches`."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    for x, y in batches:
        step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def side_worker(kind: str, tuned: bool, args: argparse.Namespace, dtype_name: str, conn) -> None:
    """One side in its own process: build it, then time a round whenever the parent asks."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if tuned:
        retain_freed_memory()
    device, dtype = torch.device(args.device), getattr(torch, dtype_name)
    cfg = model_config()
    batches = make_batches(args.steps, args.batch_size, cfg.block_size, cfg.vocab_size, device)
    if kind == "ours-mkl":  # the head's products on PyTorch's default (MKL), as before oneDNN
        from gptserve.model import dense_matmul

        dense_matmul.available = lambda: False
    if kind.startswith("ours"):
        step, info = ours(cfg, device, dtype, args.compile)
    else:
        step, info = baseline(cfg, device, dtype)
    for x, y in batches[: args.warmup]:
        step(x, y)
    conn.send((info, torch.get_num_threads()))
    while conn.recv():
        conn.send(timed(step, batches, device))
    conn.close()


def model_config() -> ModelConfig:
    return ModelConfig(n_layer=6, n_head=6, n_embd=384, block_size=256)


def run_sides(sides: dict[str, tuple[str, bool]], args: argparse.Namespace, dtype_name: str):
    """{name: (kind, tuned)} -> ({name: [(wall, CPU) seconds per round]}, {name: info}, threads)."""
    ctx = mp.get_context("spawn")
    procs, conns, infos = {}, {}, {}
    threads = 0
    try:
        for name, (kind, tuned) in sides.items():
            parent, child = ctx.Pipe()
            procs[name] = ctx.Process(
                target=side_worker, args=(kind, tuned, args, dtype_name, child), daemon=True
            )
            procs[name].start()
            child.close()  # the worker holds the only child end: its exit is an EOF here
            conns[name] = parent
            infos[name], threads = receive(parent, name)  # built and warmed up, one at a time
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name in sides:
                conns[name].send(True)
                times[name].append(receive(conns[name], name))
        for conn in conns.values():
            conn.send(False)
    finally:
        for conn in conns.values():
            conn.close()
        for proc in procs.values():
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    return times, infos, threads


def receive(conn, name: str):
    try:
        return conn.recv()
    except EOFError:
        raise SystemExit(f"error: the {name!r} process died (see its traceback above)") from None


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--steps", type=int, default=3, help="steps per round and side")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--compile", action="store_true", help="torch.compile our side")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 autocast rows")
    p.add_argument(
        "--no-before", action="store_true",
        help="skip the row of our step with its head's products on MKL (before oneDNN)",
    )  # fmt: skip
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = args.device == "cpu"
    if args.threads:  # as each side's process sets it, for the host line
        torch.set_num_threads(args.threads)
    print_host(bandwidth=cpu)
    cfg = model_config()
    tokens_per_step = args.batch_size * cfg.block_size
    dtypes = ["float32"] if cpu else ["bfloat16"]
    if cpu and not args.no_bf16:
        dtypes.append("bfloat16")

    rows: list[tuple[str, float, float]] = []  # (name, tokens/s, vs plain baseline)
    rounds: dict[str, list[tuple[float, float]]] = {}  # (wall, CPU) seconds a step, each round
    n_params, threads = 0, 0
    for dtype_name in dtypes:
        tag = "fp32" if dtype_name == "float32" else "bf16 autocast"
        sides = {f"ours ({tag})": ("ours", cpu), f"HF baseline ({tag})": ("hf", False)}
        if cpu:
            sides[f"HF baseline, glibc tuned as ours ({tag})"] = ("hf", True)
            if dtype_name == "float32" and not args.no_before:
                sides[f"ours, head on MKL as before ({tag})"] = ("ours-mkl", True)
        times, infos, threads = run_sides(sides, args, dtype_name)
        n_params = infos[f"ours ({tag})"]
        tok_s = {
            n: tokens_per_step * args.steps / statistics.median(w for w, _ in t)
            for n, t in times.items()
        }
        ref = tok_s[f"HF baseline ({tag})"]
        attn = infos[f"HF baseline ({tag})"]
        for name, value in tok_s.items():
            label = name.replace("HF baseline", f"HF (attn={attn})")
            rows.append((label, value, value / ref))
            rounds[label] = [(w / args.steps, c / args.steps) for w, c in times[name]]

    # nanoGPT's estimate: 6N per token for the matmuls plus attention's 12 * L * C * T.
    flops_per_token = 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    peak = None
    gpu = ""
    if not cpu:
        gpu = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in gpu), None)
    print(
        f"\ndevice {args.device} ({gpu or f'{threads} threads'}), torch {torch.__version__}; "
        f"config 6L/6H/384, block 256, batch {args.batch_size}, {n_params / 1e6:.1f}M params; "
        f"median of {args.rounds} rounds x {args.steps} steps, each side in its own process\n"
    )
    print(f"{'':52s} {'tokens/s':>10s} {'ms/step':>9s} {'vs HF':>7s}" + ("  MFU" if peak else ""))
    for name, value, ratio in rows:
        line = f"{name:52s} {value:10.0f} {1000 * tokens_per_step / value:9.1f} {ratio:6.2f}x"
        if peak:
            line += f"  {100 * value * flops_per_token / (peak * 1e12):4.1f}%"
        print(line)
    print("\nseconds per step in each round, wall / CPU (the machine's noise is the spread;")
    print("CPU seconds, all threads of the side's process, move less when the box is shared):")
    for name, values in rounds.items():
        cpu_median = statistics.median(c for _, c in values)
        print(
            f"  {name:50s} "
            + " ".join(f"{w:.2f}/{c:.2f}" for w, c in values)
            + f"   CPU median {cpu_median:.2f}"
        )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
