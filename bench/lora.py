"""What LoRA adapters cost a decode step: adapter rows against base rows, in the same run.

    GPTSERVE_CACHE=/tmp/gc python bench/lora.py            # the default model (SmolLM2-135M GGUF)
    python bench/lora.py --targets all                     # every projection, not only q and v
    python bench/lora.py --model PATH --rank 8 --rounds 5 --threads 1
    python bench/lora.py --random                          # a random Llama of SmolLM2-135M's shape

The model loads as `gptserve serve` loads it (`load_for_inference`: a GGUF file at its own
bits, the CPU wing), gets 4 LoRA slots (`model.lora.batched.install_lora`, as `--lora` gives
them) holding 4 random adapters of rank `--rank` (16) on q and v (`--targets qv`, PEFT's default
for the Llama family) or on every projection (`--targets all`), in float32 (as PEFT computes
them) or bfloat16 (`--lora-dtype`). Each case prefills its streams (random prompts of `--prompt-len` tokens), warms
up, then times `--steps` decode steps; the cases take turns for `--rounds` rounds and each keeps
its best, so a slow spell on a shared machine falls on all of them. Cases:

- base, no slots: the model as served without --lora (no wrappers in place);
- base: the same streams with the adapters loaded (what --lora costs requests of the base: the
  products an adapter updates are wrapped);
- adapters: the same streams over the 4 adapters, in turn (16 streams: 4 each).

The table gives wall ms per step, tokens/s, the process's CPU ms per step and each case's cost
against "base" in the same run, by CPU time (what the step computes: on a machine others share,
with `--threads 1`, it moves far less than the wall clock) and by wall time;
goals: 16 streams over 4 adapters at most 30 % slower than 16 base streams, one adapter stream
at most 15 % slower than one base stream.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.engine.engine import Engine, EngineConfig  # noqa: E402
from gptserve.engine.loader import load_for_inference, prepare_for_inference  # noqa: E402
from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.model import GPT, ModelConfig  # noqa: E402
from gptserve.model.known_models import resolve_model  # noqa: E402
from gptserve.model.lora.adapter import LoraAdapter, LoraPiece  # noqa: E402
from gptserve.model.lora.batched import install_lora  # noqa: E402
from gptserve.model.tokenizers import get_tokenizer  # noqa: E402

from bench.host import print_host  # noqa: E402

# SmolLM2-135M's shape, for --random
SMOLLM2_135M = dict(
    vocab_size=49152, block_size=2048, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
    intermediate_size=1536, bias=False, tie_embeddings=True, pos_encoding="rotary",
    norm="rmsnorm", activation="swiglu", rope_theta=100000.0,
)  # fmt: skip


TARGETS = {
    "qv": ("q", "v"),  # PEFT's default target_modules for the Llama family
    "all": ("q", "k", "v", "o", "gate", "up", "down"),
}


def random_adapter(
    config: ModelConfig, name: str, rank: int, seed: int, targets: tuple[str, ...]
) -> LoraAdapter:
    """An adapter of the projections `targets` names (q, k, v of c_attn; o; gate and up of
    c_fc; down)."""
    g = torch.Generator().manual_seed(seed)
    q, kv = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    width, gated = config.mlp_width, config.gated_mlp

    def piece(n_in: int, rows: int, offset: int = 0) -> LoraPiece:
        return LoraPiece(torch.randn(rank, n_in, generator=g) * 0.01,
                         torch.randn(rows, rank, generator=g) * 0.01, offset)  # fmt: skip

    pieces: dict[str, list[LoraPiece]] = {}
    for i in range(config.n_layer):
        h, c = f"transformer.h.{i}", config.n_embd
        where = {  # projection -> (layer, inputs, rows, first row)
            "q": ("attn.c_attn", c, q, 0), "k": ("attn.c_attn", c, kv, q),
            "v": ("attn.c_attn", c, kv, q + kv), "o": ("attn.c_proj", q, c, 0),
            "gate": ("mlp.c_fc", c, width, 0), "up": ("mlp.c_fc", c, width, width if gated else 0),
            "down": ("mlp.c_proj", width, c, 0),
        }  # fmt: skip
        for target in targets:
            layer, n_in, rows, offset = where[target]
            if target == "gate" and not gated:
                continue
            pieces.setdefault(f"{h}.{layer}", []).append(piece(n_in, rows, offset))
    return LoraAdapter(name, rank, 2.0 * rank, 2.0, pieces)


def time_case(
    engine: Engine, loras: list[str | None], args: argparse.Namespace
) -> tuple[float, float]:
    """Wall and CPU (the process's) seconds per decode step of len(loras) streams, stream i
    with adapter loras[i]."""
    gen = torch.Generator().manual_seed(len(loras))
    vocab = engine.model.config.vocab_size
    for i, lora in enumerate(loras):
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
        params = SamplingParams(
            temperature=0, max_tokens=args.steps + 8, ignore_eos=True, lora=lora
        )
        engine.add_request(str(i), prompt, params)
    while engine.num_waiting:  # prefill every stream
        engine.step()
    for _ in range(4):  # warm-up
        engine.step()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        engine.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    while engine.has_work():
        engine.step()
    return wall / args.steps, cpu / args.steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="as `gptserve serve --model` (default: its)")
    p.add_argument("--random", action="store_true", help="a random Llama of SmolLM2-135M's shape")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument(
        "--targets",
        choices=TARGETS,
        default="qv",
        help="qv: q_proj and v_proj (PEFT's default for Llama); all: every projection",
    )
    p.add_argument("--lora-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the adapters' weights and products (as `gptserve serve --lora-dtype`)")  # fmt: skip
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per case")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_host()
    if args.random:
        torch.manual_seed(0)
        model, tokenizer = prepare_for_inference(GPT(ModelConfig(**SMOLLM2_135M))), get_tokenizer()
        what = "random Llama of SmolLM2-135M's shape, float32"
    else:
        path = resolve_model(args.model, warn=print)
        loaded = load_for_inference(path, device="cpu")
        model, tokenizer = loaded.model, loaded.tokenizer
        what = f"{path.name}, {loaded.quantization}, {loaded.dtype}"
    bank = install_lora(model, 4, max(64, args.rank), getattr(torch, args.lora_dtype))
    total = args.prompt_len + args.steps + 16
    config = EngineConfig(
        max_num_seqs=args.streams, kv_block_size=16, prefix_caching=False,
        num_blocks=args.streams * -(-total // 16) + 8,
    )  # fmt: skip
    engine = Engine(model, tokenizer, config, lora=bank)
    names = [f"lora{i}" for i in range(4)]
    for i, name in enumerate(names):
        adapter = random_adapter(model.config, name, args.rank, i, TARGETS[args.targets])
        engine.adapters.load(name, adapter)
    n = args.streams
    cases = {  # label -> (streams' adapters, slots installed)
        f"{n} streams, base, no slots": ([None] * n, False),
        f"{n} streams, base": ([None] * n, True),
        f"{n} streams over 4 adapters": ([names[i % 4] for i in range(n)], True),
        "1 stream, base, no slots": ([None], False),
        "1 stream, base": ([None], True),
        "1 stream, 1 adapter": ([names[0]], True),
    }
    wall = {label: float("inf") for label in cases}
    cpu = dict(wall)
    for _ in range(args.rounds):
        for label, (loras, wrapped) in cases.items():
            bank.place_wrappers(None if wrapped else False)
            w, c = time_case(engine, loras, args)
            wall[label], cpu[label] = min(wall[label], w), min(cpu[label], c)
    bank.place_wrappers()
    print(f"\n{what}; adapters of rank {args.rank} on {', '.join(TARGETS[args.targets])}, "
          f"{args.lora_dtype}; "
          f"{torch.get_num_threads()} threads; best of {args.rounds} rounds of {args.steps} "
          f"decode steps")  # fmt: skip
    print(f"{'case':32}{'wall ms':>9}{'tok/s':>8}{'CPU ms':>9}{'vs base':>9}{'(wall)':>9}")
    for label, (loras, _) in cases.items():
        base = f"{len(loras)} stream{'s' if len(loras) > 1 else ''}, base"
        print(f"{label:32}{wall[label] * 1e3:9.2f}{len(loras) / wall[label]:8.1f}"
              f"{cpu[label] * 1e3:9.2f}{cpu[label] / cpu[base] - 1:+9.1%}"
              f"{wall[label] / wall[base] - 1:+9.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
