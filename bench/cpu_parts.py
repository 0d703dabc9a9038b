"""The CPU decode path's parts, each against what it replaced, in one run (GPT-2 124M shapes).

    python bench/cpu_parts.py

1. The 48 layer matrices (12 layers, all distinct so nothing stays in cache) and the vocabulary
   head, multiplied by 1, 8 and 32 rows: `nn.Linear` against weights in per-thread slabs
   (`PackedLinear`), and slabs against what the Engine uses now (`pack_linear`: oneDNN's layout;
   `pack_head`: slabs for one row, oneDNN for more); for one row, also the head in oneDNN's
   layout alone.
2. Decode attention for 1 and 32 sequences of 150-192 tokens over 12 layers: each sequence's
   keys and values gathered in one group against cache-sized groups (`kernels.sdpa_paged`),
   those groups against head-major pools read in place (`kernels.cpu.decode`), and that path
   against the compiled kernel (`kernels.cpu.native`), both through the backend with the step's
   key/value writes.
3. A decode step of the Engine with 32 sequences, in two fresh processes: glibc's default
   allocator against the tuned one (model.cpu.malloc_tuning), which parts 1 and 2 run with.
4. Reduced precision (`--dtype bfloat16`, `--quantize int8`): the layer matrices and the head
   with 1, 8 and 32 rows, float32 as the Engine runs it against bfloat16 in the same layouts and
   against int8 (`model.quantize.Int8Linear`, bfloat16 inputs); int8's kernel against the
   dequantized product it switches to from `MANY_ROWS` rows on; and whole decode steps of the
   Engine with 1 and 32 sequences in the three formats. The last column is the bandwidth the
   "after" side reads the weights at.
5. `--parts int4`: SmolLM2-135M's int4 layer matrices (a GGUF file's Q4_1) by 1 to 512 rows,
   PyTorch's int4 kernel against the compiled one (`model.int4_linear`).
6. `--parts f32`: GPT-2's layer matrices and head by 1 to 16 float32 rows, oneDNN's layout
   against the tiles that the engine reads for a few rows (`model.cpu.few_rows_linear`).
7. `--parts q8`: GPT-2's int8 matrices by 1 to 512 rows, PyTorch's int8 kernel against the
   tiles of 8-bit products (`model.quantize.Int8Linear`, kernels/cpu/q8_matmul.cpp).
8. `--parts layer`: the Engine's float32 decode step with 1 and 4 sequences, each GPT-2 layer
   through its Python path against one compiled call (`model.cpu.decode_layer`);
   `--parts llama-layer`: the same for the default model (SmolLM2's Q4_1 file, 1 and 16
   sequences) against `model.cpu.llama_layer`'s one call a layer.
   `--parts lora`: a LoRA adapter's update of SmolLM2's products by 1, 4 and 16 rows,
   PyTorch's `mm` and `addmm_` against the compiled `lora_update_` (1000 calls a row).
   `--parts sampler`: the sampler's pass over the vocabulary (kernels/cpu/logit_stats.cpp)
   with the log-sum-exp a logprob needs against the argmax alone. `--parts kv`: the Engine's
   decode step (float32 and int8, 1 and 32 sequences) over a float32 KV cache against a
   float16 one (`--kv-cache-dtype float16`), two engines taking steps in turn.
9. `--parts shared` and `--parts prefill`: attention over a 1024-token prefix that 8 (decode) or
   7 (a chat's second-turn prefill) sequences share, read once against a copy per holder; for
   the prefill, also the whole model step and the score product (MKL against oneDNN).

The two sides of a row run in alternation and each keeps its best, so the machine's slow spells
(memory bandwidth here drifts by 20 %) fall on both.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))

import gptserve.kernels.cpu.cascade as cpu_cascade  # noqa: E402
import gptserve.kernels.cpu.decode as cpu_decode  # noqa: E402
import gptserve.kernels.cpu.products as cpu_products  # noqa: E402
import gptserve.kernels.sdpa_paged as sdpa_paged  # noqa: E402
from gptserve.engine.block_manager import BlockManager  # noqa: E402
from gptserve.kernels.backends import CpuPagedBackend  # noqa: E402
from gptserve.kernels.cpu.native import native_ops  # noqa: E402
from gptserve.kernels.metadata import AttentionMetadata  # noqa: E402
from gptserve.kernels.paged_kv import KVPools  # noqa: E402
from gptserve.model import GPT, ModelConfig  # noqa: E402
from gptserve.model.cpu import optimize_for_cpu  # noqa: E402
from gptserve.model.cpu.malloc_tuning import retain_freed_memory  # noqa: E402
from gptserve.model.cpu.onednn_linear import OneDnnLinear  # noqa: E402
from gptserve.model.cpu.packed_linear import PackedLinear, pack_head, pack_linear, slab_count  # noqa: E402
from gptserve.model.quantize import Int8Linear, quantize  # noqa: E402

from bench.host import print_host  # noqa: E402

LAYER_SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # (in, out) per layer
Row = tuple  # (part, what it replaced, before ms, after ms[, bytes the after side reads])


def alternate(before: Callable[[], object], after: Callable[[], object], rounds: int = 7):
    """Best milliseconds of each side, the two run turn about."""
    before(), after()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in zip((before, after), times):
            t0 = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - t0))
    return min(times[0]), min(times[1])


def apply_all(modules: list[nn.Module], plain: list[nn.Linear], xs: dict[int, torch.Tensor]):
    """A callable that multiplies each module by the input of its `nn.Linear`'s width."""
    return lambda: [m(xs[p.in_features]) for m, p in zip(modules, plain)]


def gpt2_matrices() -> tuple[list[nn.Linear], nn.Linear]:
    """GPT-2 124M's 48 layer matrices and its vocabulary head, seeded random weights."""
    torch.manual_seed(0)
    layers = [nn.Linear(i, o) for _ in range(12) for i, o in LAYER_SHAPES]
    return layers, nn.Linear(768, 50257, bias=False)


@torch.no_grad()
def linear_rows() -> list[Row]:
    threads = torch.get_num_threads()
    layers, head = gpt2_matrices()
    forms = {
        "48 layer matrices": (
            layers,
            [PackedLinear(m, slab_count(m, threads)) for m in layers],
            [pack_linear(m, threads) for m in layers],
        ),
        "vocabulary head": (
            [head],
            [PackedLinear(head, slab_count(head, threads), column_major=True)],
            [pack_head(head, threads)[0]],
        ),
    }
    rows = []
    for name, (plain, slabs, engine) in forms.items():
        for n in (1, 8, 32):
            xs = {768: torch.randn(n, 768), 3072: torch.randn(n, 3072)}
            before, slabbed, now = (apply_all(f, plain, xs) for f in (plain, slabs, engine))
            rows.append((f"{name}, {n} rows", "nn.Linear -> slabs", *alternate(before, slabbed)))
            rows.append((f"{name}, {n} rows", "slabs -> engine's", *alternate(slabbed, now)))
            if name == "vocabulary head" and n == 1:  # why the head keeps its slabs
                onednn = apply_all([OneDnnLinear(head)], plain, xs)
                rows.append((f"{name}, {n} rows", "oneDNN only -> engine's",
                             *alternate(onednn, now)))  # fmt: skip
    return rows


def attention_rows(batch: int) -> list[Row]:
    torch.manual_seed(0)
    cache = KVPools(12, 12, 64, num_blocks=batch * 12 + 8, block_size=16)
    blocks = BlockManager(batch * 12 + 8, 16)
    cache.k.normal_(), cache.v.normal_()
    lens = torch.randint(150, 193, (batch,)).tolist()
    blocks.prepare([(i, n - 1) for i, n in enumerate(lens)])
    step = blocks.prepare([(i, 1) for i in range(batch)]).meta  # a decode step
    q = torch.randn(batch, 12, 64)
    token_major = [(cache.k[i].contiguous(), cache.v[i].contiguous()) for i in range(12)]
    default_group = sdpa_paged.GROUP_BYTES

    def gather(one_group: bool) -> None:  # one step: its plan, then every layer
        sdpa_paged.GROUP_BYTES = 1 << 40 if one_group else default_group
        plan = sdpa_paged.plan_gather(step, 16, 12, 64, 4)
        for k, v in token_major:
            sdpa_paged.paged_attention_sdpa(q, k, v, step, plan=plan)

    def in_place() -> None:
        plan = cpu_decode.plan_decode(step, 16, 12)
        for i in range(12):
            cpu_decode.decode_attention_cpu(q, cache.k[i], cache.v[i], step, plan=plan)

    k_new, v_new = torch.randn(batch, 12, 64), torch.randn(batch, 12, 64)

    def backend_step(native: bool) -> None:  # one step through the backend: writes, attention
        backend = CpuPagedBackend(native=native)
        plan = backend.plan(step, cache.spec)
        for i in range(12):
            backend.forward(q, k_new, v_new, cache.k[i], cache.v[i], plan)

    label = f"decode attention, {batch} seq x 12 layers"
    rows = []
    if native_ops() is not None:
        compiled = alternate(lambda: backend_step(False), lambda: backend_step(True))
        rows.append((label, "in place -> compiled, with writes", *compiled))
    try:
        if batch > 1:
            times = alternate(lambda: gather(True), lambda: gather(False))
            rows.append((label, "one group -> groups", *times))
        rows.append((label, "groups -> in place", *alternate(lambda: gather(False), in_place)))
    finally:
        sdpa_paged.GROUP_BYTES = default_group
    return rows


def shared_prefix_rows(batch: int = 8, shared: int = 64, private: int = 20) -> list[Row]:
    """Decode attention for sequences over one cached prefix of `shared` blocks (16 tokens each),
    `private` blocks of their own each: a gathered copy of every holder's blocks (how shared
    blocks were read before) against reading each block where it lies."""
    torch.manual_seed(0)
    per_seq = shared + private

    def pool(n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = (torch.randn(12, n_blocks, 12, 16, 64).transpose(2, 3) for _ in range(2))
        return k, v  # head-major, as KVPools stores them: (layers, blocks, 16, H, 64)

    # before: each holder has its own copy of the prefix, spread over the pool: gathered
    spread = [[3 * (i * per_seq + j) for j in range(per_seq)] for i in range(batch)]
    # after: one copy of the prefix, at the front, then each sequence's own blocks
    tables = [list(range(shared)) + [shared + i * private + j for j in range(private)]
              for i in range(batch)]  # fmt: skip
    lens = [per_seq * 16 - 5] * batch
    q = torch.randn(batch, 12, 64)
    k_spread, v_spread = pool(3 * batch * per_seq)
    k_shared, v_shared = pool(shared + batch * private)

    def step(k: torch.Tensor, v: torch.Tensor, table: list[list[int]]) -> None:
        meta = AttentionMetadata.build(table, lens, [1] * batch, block_size=16)
        plan = cpu_decode.plan_decode(meta, 16, 12)
        for layer in range(12):
            cpu_decode.decode_attention_cpu(q, k[layer], v[layer], meta, plan=plan)

    label = f"decode attention, {batch} seqs sharing {shared * 16}"
    times = alternate(lambda: step(k_spread, v_spread, spread),
                      lambda: step(k_shared, v_shared, tables))  # fmt: skip
    return [(label, "a copy per holder -> in place", *times)]


def prefill_rows(shared: int = 64) -> list[Row]:
    """Prefill attention of a chat's second turn (as `bench/prefix.py` sees it): 7 sequences
    continue one cached prefix of `shared` blocks with ~70 tokens of their own history each and
    19-58 new tokens, over 12 layers: each sequence's keys gathered for one SDPA call
    (`kernels.sdpa_paged`) against the prefix read once for all of them (`kernels.cpu.cascade`)."""
    torch.manual_seed(0)
    new = [19, 26, 36, 54, 55, 58, 54]
    lens = [shared * 16 + 67 + 2 * i + n for i, n in enumerate(new)]
    own = [-(-n // 16) - shared for n in lens]
    first = [shared + sum(own[:i]) for i in range(len(new))]
    tables = [list(range(shared)) + list(range(f, f + o)) for f, o in zip(first, own)]
    k, v = (torch.randn(12, first[-1] + own[-1], 12, 16, 64).transpose(2, 3) for _ in range(2))
    q = torch.randn(sum(new), 12, 64)
    step = AttentionMetadata.build(tables, lens, new, block_size=16)

    def attend(cascade: bool) -> None:  # one step: its plan, then every layer
        if cascade:
            plan = cpu_cascade.plan_cascade(step, 16)
            for layer in range(12):
                cpu_cascade.prefill_attention_cpu(q, k[layer], v[layer], step, plan=plan)
        else:
            plan = sdpa_paged.plan_gather(step, 16, 12, 64, 4)
            for layer in range(12):
                sdpa_paged.paged_attention_sdpa(q, k[layer], v[layer], step, plan=plan)

    label = f"prefill attention, 7 seqs sharing {shared * 16}"
    times = alternate(lambda: attend(False), lambda: attend(True))
    return [(label, "gather + SDPA -> cascade", *times), prefill_step_row(new, lens, shared),
            score_product_row(sum(new), shared * 16)]  # fmt: skip


def prefill_step_row(new: list[int], lens: list[int], shared: int) -> Row:
    """The same step through the whole model (GPT-2 124M, CPU wing): the KV cache holds a
    shared prefix and each sequence's history; the step's new tokens are taken back after each
    run. The "before" side's cache backend has the cascade switched off."""
    torch.manual_seed(0)
    model = optimize_for_cpu(GPT(ModelConfig(block_size=2048)).eval())
    cache = KVPools.for_model(model, shared + 16 * len(new), 16)
    blocks = BlockManager(shared + 16 * len(new), 16)

    def forward(batch: list[tuple[int, int]]) -> None:
        step = blocks.prepare(batch)
        cache.copy_blocks(step.copies)
        tokens = torch.randint(0, 50000, (step.meta.num_tokens,))
        with torch.inference_mode():
            model.forward_cached(tokens, cache, step.meta)

    for _ in range(shared * 16 // 512):  # the prefix, then each sequence's history
        forward([(0, 512)])
    for i, (n, m) in enumerate(zip(lens, new), start=1):
        blocks.fork(0, i)
        forward([(i, n - m - shared * 16)])

    def step(cascade: bool) -> None:
        cache.backend = CpuPagedBackend(cascade=cascade)  # the same pool layout either way
        forward([(i, m) for i, m in enumerate(new, start=1)])
        for i, (n, m) in enumerate(zip(lens, new), start=1):
            blocks.truncate(i, n - m)

    return ("prefill step, GPT-2 124M", "gather + SDPA -> cascade", *alternate(
        lambda: step(False), lambda: step(True)))  # fmt: skip


def score_product_row(rows: int, keys: int) -> Row:
    """One layer's shared score products, (rows, 64) x (64, keys) for 12 heads: PyTorch's
    float32 matmul (MKL) against oneDNN's (`kernels.cpu.products.product_nt`); the last column
    is the rate in GFLOP/s rather than GB/s."""
    q, k = torch.randn(12, rows, 64), torch.randn(12, keys, 64)
    times = alternate(lambda: torch.matmul(q, k.transpose(1, 2)),
                      lambda: [cpu_products.product_nt(q[h], k[h]) for h in range(12)])  # fmt: skip
    flop = 2 * 12 * rows * keys * 64
    return (f"scores {rows} x {keys}, 12 heads", "matmul (MKL) -> oneDNN", *times, flop)


def decode_step_ms(retain: bool) -> float:
    """Median decode step with 32 sequences (after 20 warm-up steps), in this process."""
    import gptserve.engine.engine as engine_module
    from gptserve.engine.sampler import SamplingParams
    from gptserve.model import GPT, ModelConfig, get_tokenizer

    if retain:
        retain_freed_memory()
    torch.manual_seed(0)
    model = optimize_for_cpu(GPT(ModelConfig()))
    engine = engine_module.Engine(
        model, get_tokenizer(), engine_module.EngineConfig(max_num_seqs=32)
    )
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(32):
        engine.add_request(str(i), torch.randint(0, 50257, (64,), generator=gen).tolist(), params)
    for _ in range(20):
        engine.step()
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def allocator_row() -> Row:
    def child(retain: bool) -> float:
        code = f"import bench.cpu_parts as b; print(b.decode_step_ms({retain}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        return float(out.stdout.strip().splitlines()[-1])

    return ("engine decode step, 32 seqs", "glibc default -> tuned", child(False), child(True))


def int8_products(
    layers: list[Int8Linear], xs: dict[int, torch.Tensor], dequantize: bool
) -> list[torch.Tensor]:
    """Each layer's product by one of int8's two ways, whatever the row count."""
    if dequantize:
        return [F.linear(xs[m.in_features], m.weight.to(xs[768].dtype)) * m.scales for m in layers]
    return [
        torch.ops.aten._weight_int8pack_mm(xs[m.in_features], m.weight, m.scales) for m in layers
    ]


def _bf16(linear: nn.Linear) -> nn.Linear:
    return nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None).to(
        torch.bfloat16
    )


@torch.no_grad()
def precision_rows() -> list[Row]:
    """fp32 as the Engine runs it -> bf16 and -> int8, per part; int8's two products."""
    threads = torch.get_num_threads()
    layers, head = gpt2_matrices()
    layers16, head16 = [_bf16(m) for m in layers], _bf16(head)
    forms = {
        "48 layer matrices": (
            layers,
            [pack_linear(m, threads) for m in layers],
            [pack_linear(m, threads) for m in layers16],
            [Int8Linear(m, tiled=False) for m in layers16],
        ),
        "vocabulary head": (
            [head],
            [pack_head(head, threads)[0]],
            [pack_head(head16, threads)[0]],
            [Int8Linear(head16, tiled=False)],
        ),
    }
    rows = []
    for name, (plain, fp32, bf16, int8) in forms.items():
        n_weights = sum(m.weight.numel() for m in plain)
        for n in (1, 8, 32):
            xs = {768: torch.randn(n, 768), 3072: torch.randn(n, 3072)}
            hs = {k: v.to(torch.bfloat16) for k, v in xs.items()}
            before = apply_all(fp32, plain, xs)
            label = f"{name}, {n} rows"
            rows.append((label, "fp32 -> bf16", *alternate(before, apply_all(bf16, plain, hs)),
                         2 * n_weights))  # fmt: skip
            rows.append((label, "fp32 -> int8", *alternate(before, apply_all(int8, plain, hs)),
                         n_weights))  # fmt: skip
            if name == "vocabulary head" and n == 1:  # why the bf16 head keeps its slabs
                onednn = apply_all([OneDnnLinear(head16)], plain, hs)
                now = apply_all(bf16, plain, hs)
                rows.append((label, "bf16 oneDNN only -> engine's", *alternate(onednn, now),
                             2 * n_weights))  # fmt: skip
            if name == "48 layer matrices" and n > 1:  # where int8 switches products
                kernel = partial(int8_products, int8, hs, dequantize=False)
                dequant = partial(int8_products, int8, hs, dequantize=True)
                rows.append((label, "int8 kernel -> dequantized", *alternate(kernel, dequant),
                             n_weights))  # fmt: skip
    return rows


@torch.no_grad()
def read_rows() -> list[Row]:
    """How far each format's single-row products are from reading their bytes (a float32 sum of
    as many bytes: the memory's read rate), all matrices of GPT-2 124M, on 1 thread and on all."""
    torch.manual_seed(0)
    layers = [nn.Linear(i, o).to(torch.bfloat16) for _ in range(12) for i, o in LAYER_SHAPES]
    layers.append(nn.Linear(768, 50257, bias=False).to(torch.bfloat16))
    n_weights = sum(m.weight.numel() for m in layers)
    int8 = [Int8Linear(m) for m in layers]
    bf16 = [OneDnnLinear(m) for m in layers]
    hs = {768: torch.randn(1, 768, dtype=torch.bfloat16), 3072: torch.randn(1, 3072, dtype=torch.bfloat16)}  # fmt: skip
    rows = []
    threads = torch.get_num_threads()
    for n_threads in sorted({1, threads}):
        torch.set_num_threads(n_threads)
        for label, forms, size in (("int8", int8, n_weights), ("bf16 oneDNN", bf16, 2 * n_weights)):
            plain = torch.randn(size // 4)  # float32, `size` bytes
            rows.append((f"all 49 matrices, 1 row, {n_threads} thread(s)",
                         f"reading them -> {label}", *alternate(plain.sum, apply_all(forms, layers, hs)),
                         size))  # fmt: skip
    torch.set_num_threads(threads)
    return rows


def step_rows() -> list[Row]:
    """Median decode step of the Engine with 1 and 32 sequences: fp32 -> bf16, fp32 -> int8."""
    import gptserve.engine.engine as engine_module
    from gptserve.engine.sampler import SamplingParams
    from gptserve.model import GPT, ModelConfig, get_tokenizer

    torch.manual_seed(0)
    state = GPT(ModelConfig()).state_dict()

    def engine(dtype: torch.dtype, method: str, seqs: int):
        model = GPT(ModelConfig())
        model.load_state_dict(state)
        model = optimize_for_cpu(quantize(model.to(dtype).eval(), method))
        eng = engine_module.Engine(
            model, get_tokenizer(), engine_module.EngineConfig(max_num_seqs=32, num_blocks=448)
        )
        gen = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
        for i in range(seqs):
            prompt = torch.randint(0, 50257, (64,), generator=gen).tolist()
            eng.add_request(str(i), prompt, params)
        for _ in range(5):
            eng.step()
        return eng

    rows = []
    for seqs, steps in ((1, 31), (32, 9)):
        fp32 = engine(torch.float32, "none", seqs)
        for change, other in (("fp32 -> bf16", engine(torch.bfloat16, "none", seqs)),
                              ("fp32 -> int8", engine(torch.float32, "int8", seqs))):  # fmt: skip
            times: tuple[list[float], list[float]] = ([], [])
            for _ in range(steps):
                for eng, out in zip((fp32, other), times):
                    t0 = time.perf_counter()
                    eng.step()
                    out.append(1000 * (time.perf_counter() - t0))
            rows.append((f"engine decode step, {seqs} seqs", change,
                         statistics.median(times[0]), statistics.median(times[1])))  # fmt: skip
    return rows


def _apply_each(calls: list[tuple[nn.Module, torch.Tensor]]) -> None:
    for module, x in calls:
        module(x)


# SmolLM2-135M's int4 matrices a layer (out, in): q/k/v joined, attention out, gate/up joined, down
SMOLLM2_INT4_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


@torch.no_grad()
def int4_rows() -> list[Row]:
    """SmolLM2-135M's 120 int4 layer matrices (30 distinct layers, 66 MB: none stays in cache)
    by 1, 4, 16, 64 and 512 rows: PyTorch's int4 kernel (bfloat16 rows) against the compiled one
    (float32 rows), as `model.int4_linear.Int4Linear` holds each."""
    import numpy as np
    from gptserve.kernels.cpu.native import native_ops
    from gptserve.model.gguf.blocks import Int4Groups
    from gptserve.model.int4_linear import Int4Linear

    if native_ops() is None:
        print("int4: the compiled kernels are not built here (GPTSERVE_NATIVE=0 or no compiler)")
        return []
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(30):
        for out, width in SMOLLM2_INT4_SHAPES:
            scales = rng.uniform(0.001, 0.02, (out, width // 32)).astype(np.float16)
            groups = Int4Groups(rng.integers(0, 16, (out, width), dtype=np.uint8),
                                scales.astype(np.float32), np.zeros_like(scales, np.float32))  # fmt: skip
            pairs.append((Int4Linear(groups, compiled=False), Int4Linear(groups, compiled=True)))
    size = sum(b.numel() * b.element_size() for _, m in pairs for b in m.buffers())
    rows = []
    for n in (1, 4, 16, 64, 512):
        xs = {w: torch.randn(n, w) for w in (576, 1536)}
        sides = [[(pair[i], xs[pair[i].in_features]) for pair in pairs] for i in (0, 1)]
        before, after = (partial(_apply_each, side) for side in sides)
        timed = alternate(before, after, rounds=7 if n < 512 else 3)
        rows.append((f"SmolLM2's 120 int4 matrices, {n} row(s)", "PyTorch's int4 kernel",
                     *timed, size))  # fmt: skip
    return rows


@torch.no_grad()
def f32_rows() -> list[Row]:
    """GPT-2's 48 layer matrices and its head by 1 to 16 float32 rows: oneDNN's layout against
    the compiled tiles (`model.cpu.few_rows_linear`, which the engine takes for up to
    LAYER_FEW_ROWS and HEAD_FEW_ROWS rows)."""
    from gptserve.kernels.cpu.native import native_ops
    from gptserve.model.cpu.few_rows_linear import FewRowsLinear, compiled_tiles

    ops = native_ops()
    if not compiled_tiles(ops):
        print("f32: the compiled kernels are not built here (GPTSERVE_NATIVE=0 or no compiler)")
        return []
    layers, head = gpt2_matrices()
    rows = []
    for name, plain in (("48 layer matrices", layers), ("vocabulary head", [head])):
        onednn = [OneDnnLinear(m) for m in plain]
        tiles = [FewRowsLinear(m, o, ops, few_rows=1 << 30) for m, o in zip(plain, onednn)]
        size = sum(m.weight.numel() * 4 for m in plain)
        for n in (1, 2, 4, 8, 16):
            xs = {768: torch.randn(n, 768), 3072: torch.randn(n, 3072)}
            timed = alternate(apply_all(onednn, plain, xs), apply_all(tiles, plain, xs))
            rows.append((f"{name}, {n} float32 row(s)", "oneDNN -> tiles", *timed, size))
    return rows


@torch.no_grad()
def q8_rows() -> list[Row]:
    """GPT-2's 48 layer matrices and its head in int8 by 1 to 512 rows: `Int8Linear` with
    PyTorch's int8 kernel (bfloat16 rows; the dequantized product from MANY_ROWS rows where
    bfloat16 is native) against the compiled tiles (float32 rows quantized to 8 bits per block;
    dequantized from TILED_MANY_ROWS rows where bfloat16 is native)."""
    from gptserve.model.quantize import q8_ops

    if q8_ops(768, torch.device("cpu")) is None:
        print("q8: the compiled kernels are not built here (GPTSERVE_NATIVE=0 or no compiler)")
        return []
    layers, head = gpt2_matrices()
    plain = [*layers, head]
    pytorch = [Int8Linear(m, tiled=False) for m in plain]
    tiles = [Int8Linear(m) for m in plain]
    size = sum(m.weight.numel() for m in plain)
    rows = []
    for n in (1, 2, 4, 8, 16, 32, 128, 512):
        xs = {768: torch.randn(n, 768), 3072: torch.randn(n, 3072)}
        timed = alternate(apply_all(pytorch, plain, xs), apply_all(tiles, plain, xs),
                          rounds=7 if n < 128 else 3)  # fmt: skip
        rows.append((f"49 int8 matrices, {n} row(s)", "PyTorch's int8 -> tiles", *timed, size))
    return rows


@torch.no_grad()
def switched_steps(model: nn.Module, tokenizer, fused: type, seqs: int, vocab: int) -> tuple:
    """Median decode step (ms) of one Engine over `model` with `seqs` sequences of 64-token
    prompts, each `fused` layer's step through its Python path (`Block.forward_cached`) and
    through its compiled call, the two switched every 10 steps."""
    import gptserve.engine.engine as engine_module
    from gptserve.engine.sampler import SamplingParams
    from gptserve.model.gpt import Block

    compiled = fused.forward_cached
    eng = engine_module.Engine(
        model, tokenizer, engine_module.EngineConfig(max_num_seqs=seqs, num_blocks=16 * seqs + 32)
    )
    gen = torch.Generator().manual_seed(seqs)
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    for i in range(seqs):
        eng.add_request(str(i), torch.randint(0, vocab, (64,), generator=gen).tolist(), params)
    for _ in range(5):
        eng.step()
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for _ in range(12):
            for forward, out in zip((Block.forward_cached, compiled), times):
                fused.forward_cached = forward
                t0 = time.perf_counter()
                for _ in range(10):
                    eng.step()
                out.append(100 * (time.perf_counter() - t0))  # ms a step
    finally:
        fused.forward_cached = compiled
    return statistics.median(times[0]), statistics.median(times[1])


def layer_rows() -> list[Row]:
    """Median decode step of the Engine (GPT-2 124M float32, 1 and 4 sequences) with each
    layer's step through its Python path against one `decode_layer` call
    (`model.cpu.decode_layer`), the two switched every 10 steps of one engine."""
    from gptserve.model import get_tokenizer
    from gptserve.model.cpu.decode_layer import FusedDecodeBlock

    torch.manual_seed(0)
    model = optimize_for_cpu(GPT(ModelConfig()).eval())
    if not any(isinstance(b, FusedDecodeBlock) for b in model.transformer.h):
        print("layer: the compiled kernels are not built here (GPTSERVE_NATIVE=0 or no compiler)")
        return []
    return [
        (f"engine decode step, {seqs} float32 seq(s)", "Python -> decode_layer",
         *switched_steps(model, get_tokenizer(), FusedDecodeBlock, seqs, 50257))
        for seqs in (1, 4)
    ]  # fmt: skip


def llama_layer_rows() -> list[Row]:
    """Median decode step of the Engine over the default model (SmolLM2-135M-Instruct's Q4_1
    file, 1 and 16 sequences) with each layer's step through its Python path against one
    `llama_decode_layer` call (`model.cpu.llama_layer`), switched every 10 steps of one engine."""
    from gptserve.engine.loader import load_for_inference
    from gptserve.model.cpu.llama_layer import FusedLlamaBlock
    from gptserve.model.known_models import DEFAULT_MODEL_NAME, resolve_model

    loaded = load_for_inference(resolve_model(DEFAULT_MODEL_NAME))
    model, tokenizer = loaded.model, loaded.tokenizer
    if not any(isinstance(b, FusedLlamaBlock) for b in model.transformer.h):
        print("llama-layer: the compiled kernels are not built here (GPTSERVE_NATIVE=0?)")
        return []
    vocab = model.config.vocab_size
    return [
        (f"engine decode step, SmolLM2 Q4_1, {seqs} seq(s)", "Python -> llama_decode_layer",
         *switched_steps(model, tokenizer, FusedLlamaBlock, seqs, vocab))
        for seqs in (1, 16)
    ]  # fmt: skip


def kv_dtype_rows() -> list[Row]:
    """Median decode step of two Engines on one GPT-2 124M (float32, then `--quantize int8`)
    with 1 and 32 sequences of 64-token prompts: the KV cache in float32 (the model's dtype)
    against float16 (`--kv-cache-dtype float16`), the two taking 10 steps in turn, so that their
    contexts grow alike (69 to 189 tokens)."""
    import gptserve.engine.engine as engine_module
    from gptserve.engine.sampler import SamplingParams
    from gptserve.model import get_tokenizer
    from gptserve.model.quantize import quantize

    rows = []
    for method in ("none", "int8"):
        torch.manual_seed(0)
        model = GPT(ModelConfig()).eval()
        model = optimize_for_cpu(quantize(model, method) if method != "none" else model)
        for seqs in (1, 32):
            blocks = seqs * 24
            configs = [
                engine_module.EngineConfig(seqs, num_blocks=blocks, kv_cache_dtype=kv)
                for kv in (None, torch.float16)
            ]
            engines = [engine_module.Engine(model, get_tokenizer(), c) for c in configs]
            gen = torch.Generator().manual_seed(seqs)
            params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
            prompts = [torch.randint(0, 50257, (64,), generator=gen).tolist() for _ in range(seqs)]
            for eng in engines:
                for i, prompt in enumerate(prompts):
                    eng.add_request(str(i), prompt, params)
                for _ in range(5):
                    eng.step()
            times: tuple[list[float], list[float]] = ([], [])
            for _ in range(12):
                for eng, out in zip(engines, times):
                    t0 = time.perf_counter()
                    for _ in range(10):
                        eng.step()
                    out.append(100 * (time.perf_counter() - t0))  # ms a step
            label = "float32" if method == "none" else "int8"
            rows.append((f"engine decode step, {seqs} {label} seq(s)", "KV float32 -> float16",
                         statistics.median(times[0]), statistics.median(times[1])))  # fmt: skip
            del engines
    return rows


def sampler_rows() -> list[Row]:
    """The sampler's pass over GPT-2's vocabulary for 1 and 32 greedy rows: argmax and
    log-sum-exp (a row reports logprobs) against the argmax alone (none does)."""
    from gptserve.engine.sampler import _argmax_and_logsumexp

    rows = []
    for n in (1, 32):
        logits = torch.randn(n, 50257)

        def stats(with_lse: bool, logits: torch.Tensor = logits):
            return lambda: [_argmax_and_logsumexp(logits, with_lse) for _ in range(100)]

        before, after = alternate(stats(True), stats(False))
        rows.append((f"sampler pass, {n} row(s) x 50257", "with lse -> argmax only",
                     before / 100, after / 100))  # fmt: skip
    return rows


def lora_rows() -> list[Row]:
    """One LoRA adapter's update of SmolLM2-135M's products (rank 16 a piece: q and v of the
    q/k/v product, gate and up, down) for 1, 4 and 16 rows, timed over 1000 calls from Python:
    PyTorch's `mm` and an `addmm_` per piece (the products' wrappers before) against the
    compiled `lora_update_` (kernels/cpu/lora_update.cpp)."""
    from gptserve.kernels.cpu.native import native_ops

    ops = native_ops()
    if ops is None:
        print("lora: the compiled kernels are not built here (GPTSERVE_NATIVE=0 or no compiler)")
        return []
    shapes = {  # product -> (inputs, each piece's output columns)
        "q/k/v (q, v)": (576, (576, 192)),
        "gate/up": (576, (1536, 1536)),
        "down": (1536, (576,)),
    }
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, (n_in, widths) in shapes.items():
        rank = 16 * len(widths)
        a_t = torch.randn(n_in, rank, generator=gen) * 0.01  # (in, R)
        b_ts = [torch.randn(16, w, generator=gen) * 0.01 for w in widths]  # (r, out) each
        spans = [n for i, w in enumerate(widths)
                 for n in (16 * i, 16 * i + 16, sum(widths[:i]), sum(widths[: i + 1]))]  # fmt: skip
        for n in (1, 4, 16):
            x, y = torch.randn(n, n_in, generator=gen), torch.zeros(n, sum(widths))

            def torch_update(x=x, y=y, a_t=a_t, b_ts=b_ts, spans=spans):
                for _ in range(1000):
                    h = torch.mm(x, a_t)  # (n, R)
                    for k, b_t in enumerate(b_ts):
                        c0, c1, lo, hi = spans[4 * k : 4 * k + 4]
                        y[:, lo:hi].addmm_(h[:, c0:c1], b_t)

            def compiled(x=x, y=y, a_t=a_t, b_ts=b_ts, spans=spans):
                for _ in range(1000):
                    ops.lora_update_(y, x, a_t, spans, b_ts)

            before, after = alternate(torch_update, compiled)
            rows.append((f"LoRA update x1000, {label}, {n} row(s)", "mm + addmm_ -> lora_update_",
                         before, after))  # fmt: skip
    return rows


PARTS = {
    "linear": linear_rows,
    "attention": lambda: attention_rows(1) + attention_rows(32),
    "shared": shared_prefix_rows,
    "prefill": prefill_rows,
    "allocator": lambda: [allocator_row()],
    "precision": lambda: precision_rows() + read_rows(),
    "steps": step_rows,
    "int4": int4_rows,
    "f32": f32_rows,
    "q8": q8_rows,
    "layer": layer_rows,
    "llama-layer": llama_layer_rows,
    "sampler": sampler_rows,
    "kv": kv_dtype_rows,
    "lora": lora_rows,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    parts = parser.parse_args().parts.split(",")
    if any(part not in PARTS for part in parts):
        parser.error(f"--parts takes {', '.join(PARTS)}")
    print_host()
    retain_freed_memory()  # as the CLIs do (the allocator row compares both in subprocesses)
    rows = [row for part in parts for row in PARTS[part]()]
    print(f"\n{torch.get_num_threads()} threads, torch {torch.__version__}; best of 7 rounds, "
          "the two sides in turn (the engine steps: median, one process each for the "
          "allocator, alternating steps for reduced precision)\n")  # fmt: skip
    print(f"{'':40s} {'what it replaced':28s} {'before ms':>10s} {'after ms':>9s} "
          f"{'speed-up':>9s} {'after GB/s':>10s}")  # fmt: skip
    for name, change, before, after, *size in rows:
        rate = f"{size[0] / after / 1e6:10.1f}" if size else ""
        print(f"{name:40s} {change:28s} {before:10.1f} {after:9.1f} {before / after:8.2f}x {rate}")
    print(
        "\nslabs: PackedLinear; engine's: oneDNN's layout (the head: slabs for one row); "
        "groups: gather + SDPA in cache-sized groups; in place: kernels.cpu.decode; "
        "cascade: kernels.cpu.cascade (the scores row's last column: GFLOP/s); "
        "fp32/bf16: the Engine's layouts; int8: model.quantize.Int8Linear"
    )


if __name__ == "__main__":
    main()
