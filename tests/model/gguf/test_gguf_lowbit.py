"""GGUF files at their own bits: block formats read exactly, the int4 kernel's products, the
low-bit model against the dequantized float one (small random files and the real SmolLM2 file:
top-token agreement, loss, resident memory), and the loader's choice of path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from gptserve.kernels.cpu.native import native_ops
from gptserve.model import CheckpointError, load_checkpoint
from gptserve.model.cpu import optimize_for_cpu
from gptserve.model.cpu.fused_rows import FusedRMSNorm, FusedSwiGLU
from gptserve.model.gguf.blocks import int4_groups, q8_0_split_groups
from gptserve.model.gguf.checkpoint import RawTensor
from gptserve.model.gguf.quantized import StackedLinear, linear_module
from gptserve.model.gguf.rows import FileRows, RefinedHead, RowsEmbedding
from gptserve.model.int4_linear import Int4Linear
from gptserve.model.known_models import fetch_known_model
from gptserve.model.kquant_linear import KQuantLinear, kquant_compiled
from gptserve.model.quantize import Int8Linear, is_quantized, keep_int8_kernel, quantize_rows
from gptserve.model.tokenizers import load_tokenizer

from tests.model.gguf.test_gguf import CASES, k_quant_bytes, write_gguf
from tests.model.gguf.test_kquant_blocks import random_blocks

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
REPO = Path(__file__).resolve().parents[3]


def quantized(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random (rows, cols) weights in GGML type `kind`, as the file's bytes."""
    rng = np.random.default_rng(seed)
    if kind in ("Q5_K", "Q6_K"):
        return random_blocks(kind, rows, cols, seed)
    if kind == "Q4_K":
        data = k_quant_bytes(Q[kind], rows, cols, rng)
        blocks = data.reshape(rows, -1, 144)  # every scale and min of the sub-blocks, not only d
        blocks[..., 4:16] = rng.integers(0, 256, size=blocks[..., 4:16].shape)
        return data
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, Q[kind])


def dequantized(data: np.ndarray, kind: str, shape: tuple[int, int]) -> np.ndarray:
    return gguf.quants.dequantize(data, Q[kind]).astype(np.float32).reshape(shape)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_groups_are_the_files_values(kind: str) -> None:
    data = quantized(kind, 48, 512)
    groups = int4_groups(data, kind, (48, 512))
    assert groups.codes.min() >= 0 and groups.codes.max() <= 15
    assert np.array_equal(groups.dequantize(), dequantized(data, kind, (48, 512)))


def test_q8_0_is_two_int4_groups_a_block_exactly() -> None:
    data = quantized("Q8_0", 48, 256)
    groups = q8_0_split_groups(data, (48, 256))
    halves = groups.dequantize().reshape(48, 8, 2, 32).sum(axis=2).reshape(48, 256)
    assert np.array_equal(halves, dequantized(data, "Q8_0", (48, 256)))


@pytest.mark.parametrize(
    ("kind", "rows", "cols"),
    [("Q4_1", 96, 256), ("Q4_0", 40, 128), ("Q4_K", 64, 512), ("Q8_0", 48, 256)],
    ids=["q4_1", "q4_0-rows-padded", "q4_k", "q8_0-split"],
)
def test_int4_kernel_multiplies_the_dequantized_weights(kind: str, rows: int, cols: int) -> None:
    data = quantized(kind, rows, cols)
    weight = torch.from_numpy(dequantized(data, kind, (rows, cols))).double()
    copies = 2 if kind == "Q8_0" else 1
    if copies == 2:
        groups = q8_0_split_groups(data, (rows, cols))
    else:
        groups = int4_groups(data, kind, (rows, cols))
    x = torch.randn(5, 3, cols, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ weight.t()  # (5, 3, rows)
    exact = Int4Linear(groups, op_dtype=torch.float32, input_copies=copies)
    assert (exact(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # float rounding
    served = Int4Linear(groups, input_copies=copies)  # bfloat16 products, as served
    assert served(x).shape == (5, 3, rows) and served(x).dtype == torch.float32
    assert (served(x).double() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_packing_in_chunks_is_packing_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    data = quantized("Q4_1", 200, 128)
    groups = int4_groups(data, "Q4_1", (200, 128))
    whole = Int4Linear(groups, op_dtype=torch.float32)
    monkeypatch.setattr("gptserve.model.int4_linear.PACK_ROWS", 64)
    chunked = Int4Linear(groups, op_dtype=torch.float32)
    assert torch.equal(whole.weight, chunked.weight)


def test_joined_parts_of_different_types_are_stacked() -> None:
    parts = [
        RawTensor(quantized("Q4_0", 64, 256, seed=1), "Q4_0", (64, 256)),
        RawTensor(quantized("Q6_K", 32, 256, seed=2), "Q6_K", (32, 256)),
    ]
    generator = torch.Generator().manual_seed(0)
    bias = [torch.randn(64, generator=generator), torch.randn(32, generator=generator)]
    parts.append(RawTensor(quantized("Q5_K", 16, 256, seed=3), "Q5_K", (16, 256)))
    bias.append(torch.randn(16, generator=generator))
    module = linear_module(parts, bias, torch.float32)
    assert isinstance(module, StackedLinear)
    k_quant = KQuantLinear if kquant_compiled() else Int8Linear  # int8 rows without the kernels
    assert [type(p) for p in module.parts] == [Int4Linear, k_quant, k_quant]
    weight = np.concatenate([dequantized(p.data, p.type, p.shape) for p in parts])
    x = torch.randn(4, 256, generator=generator)
    ref = x @ torch.from_numpy(weight).t() + torch.cat(bias)  # (4, 112)
    assert module(x).shape == (4, 112)
    assert (module(x) - ref).abs().max() <= 2e-2 * ref.abs().max()
    if kquant_compiled():  # the K-quant parts exactly the file's weights' products
        torch.testing.assert_close(module(x)[:, 64:], ref[:, 64:], rtol=1e-5, atol=1e-5)


def test_the_refined_head_gets_the_top_logits_exactly() -> None:
    rows, cols = 512, 128
    data = quantized("Q8_0", rows, cols)
    weight = torch.from_numpy(dequantized(data, "Q8_0", (rows, cols)))
    table = FileRows(data, "Q8_0", (rows, cols))
    fast = Int8Linear.from_rows(*quantize_rows(weight))
    head = RefinedHead(fast, table, refine=8)
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(0))
    ref = x @ weight.t()  # (6, rows)
    logits = head(x)
    refined = fast(x).topk(8, dim=-1).indices  # the rows the head recomputes
    assert (
        logits.gather(1, refined) - ref.gather(1, refined)
    ).abs().max() <= 1e-5 * ref.abs().max()
    for row in range(6):  # the float head's leaders are among them, so its top token is found
        assert set(ref[row].topk(4).indices.tolist()) <= set(refined[row].tolist())
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    others = torch.ones_like(logits, dtype=torch.bool).scatter(1, refined, False)
    assert (logits - ref)[others].abs().max() <= 2e-2 * ref.abs().max()  # the fast product's
    embedded = RowsEmbedding(table, torch.float32)(torch.tensor([[3, 7], [511, 0]]))
    assert torch.equal(embedded, weight[torch.tensor([[3, 7], [511, 0]])])
    assert table(torch.tensor([], dtype=torch.long)).shape == (0, cols)  # no rows asked


def module_kinds(model: nn.Module) -> set[type]:
    return {type(m) for m in model.modules()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize(("arch", "kind"), CASES, ids=[f"{a}-{k}" for a, k in CASES])
def test_small_files_at_their_bits_compute_the_float_model(
    tmp_path: Path, arch: str, kind: str
) -> None:
    path = tmp_path / f"{arch}-{kind}.gguf"
    write_gguf(path, arch, kind, tied=arch == "qwen3")
    low, ref = load_checkpoint(path, low_bit=True), load_checkpoint(path)
    k_quant = KQuantLinear if kquant_compiled() else Int8Linear
    expected = {"Q4_0": Int4Linear, "Q4_1": Int4Linear, "Q4_K": Int4Linear, "Q8_0": Int4Linear,
                "Q5_K": k_quant, "Q6_K": k_quant}.get(kind, nn.Linear)  # fmt: skip
    assert expected in module_kinds(low.transformer.h)
    if kind not in ("F32", "F16", "BF16"):
        assert isinstance(low.transformer.wte, RowsEmbedding)
        head = KQuantLinear if k_quant is KQuantLinear and kind in ("Q5_K", "Q6_K") else RefinedHead
        assert isinstance(low.lm_head, head)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, module in ref.named_modules():  # each product, Q and K rows in their order
            if isinstance(module, nn.Linear) and name != "lm_head":
                x = torch.randn(4, module.in_features, generator=generator)
                assert relative_error(low.get_submodule(name)(x), module(x)) < 2e-2, name
        idx = torch.randint(0, 260, (2, 24), generator=generator)
        got, want = low(idx), ref(idx)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert relative_error(got, want) < 3e-2
    if expected is KQuantLinear:  # the file's weights exactly: float32 rounding apart
        assert relative_error(got, want) < 1e-5


K_QUANT_FILES = [("llama", "Q6_K"), ("llama", "Q5_K"), ("qwen3", "Q6_K")]  # qwen3: a tied head


@pytest.mark.skipif(not kquant_compiled(), reason="int8 rows without the compiled kernels")
@pytest.mark.parametrize(
    ("arch", "kind"), K_QUANT_FILES, ids=[f"{a}-{k}" for a, k in K_QUANT_FILES]
)
def test_k_quant_files_at_their_bits_are_transformers_logits(
    tmp_path: Path, arch: str, kind: str
) -> None:
    transformers = pytest.importorskip("transformers")
    path = tmp_path / f"{arch}-{kind}.gguf"
    write_gguf(path, arch, kind, tied=arch == "qwen3")
    low = load_checkpoint(path, low_bit=True)
    held = [m for m in low.modules() if isinstance(m, KQuantLinear)]
    assert len(held) == 2 * 4 + 1 and isinstance(low.lm_head, KQuantLinear)  # q/k/v joined
    assert all(m.blocks.numel() == m.out_features * m.in_features // 256 * (210 if kind == "Q6_K" else 176) for m in held)  # fmt: skip
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    idx = torch.randint(0, 260, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(idx).logits
        assert (low(idx) - want).abs().max().item() < 1e-4  # float32 rounding apart
        decode = low(idx[:1, :3])  # three rows: the few-row kernel throughout
        assert (decode - ref(idx[:1, :3]).logits).abs().max().item() < 1e-4


def test_cpu_wing_leaves_low_bit_layers_alone(tmp_path: Path) -> None:
    path = tmp_path / "llama-q4.gguf"
    write_gguf(path, "llama", "Q4_1")
    model = load_checkpoint(path, low_bit=True)
    idx = torch.randint(0, 260, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(idx)
        products = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
        kinds = module_kinds(model)
        optimize_for_cpu(model)
        after = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
        assert [id(m) for m in after] == [id(m) for m in products]  # the same low-bit layers
        if native_ops() is None:
            assert module_kinds(model) == kinds
            assert torch.equal(model(idx), before)
        else:  # norms and SwiGLU compiled (model.cpu.fused_rows): float32 rounding apart
            assert {FusedRMSNorm, FusedSwiGLU} <= module_kinds(model)
            torch.testing.assert_close(model(idx), before, atol=1e-4, rtol=1e-4)


def test_the_loader_keeps_a_gguf_files_bits_unless_asked(tmp_path: Path) -> None:
    from gptserve.engine.loader import load_for_inference

    path = tmp_path / "llama-q4.gguf"
    write_gguf(path, "llama", "Q4_0")
    own = load_for_inference(path, device="cpu", dtype="float32")
    assert Int4Linear in module_kinds(own.model) and own.quantization == "none"
    floats = load_for_inference(path, device="cpu", dtype="float32", quantization="dequantize")
    assert not is_quantized(floats.model) and floats.weight_bytes > 3 * own.weight_bytes
    int8 = load_for_inference(path, device="cpu", dtype="float32", quantization="int8")
    assert Int8Linear in module_kinds(int8.model) and Int4Linear not in module_kinds(int8.model)
    idx = torch.randint(0, 260, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # the dequantized path, CPU layouts and all, is today's float model
        assert (floats.model(idx) - load_checkpoint(path)(idx)).abs().max() < 1e-4


@pytest.mark.skipif(native_ops() is None, reason="no compiled CPU kernels")
def test_the_loader_rounds_int4_products_rows_to_8_bits_when_asked(tmp_path: Path) -> None:
    from gptserve.engine.loader import ModelLoadError, load_for_inference

    path = tmp_path / "llama-q4.gguf"
    write_gguf(path, "llama", "Q4_1")
    own = load_for_inference(path, device="cpu", dtype="float32")
    rows8 = load_for_inference(path, device="cpu", dtype="float32", int8_activations=True)
    layers = [m for m in rows8.model.modules() if type(m) is Int4Linear]
    assert layers and all(m.int8_activations for m in layers)
    assert not any(m.int8_activations for m in own.model.modules() if type(m) is Int4Linear)
    idx = torch.randint(0, 260, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = own.model(idx), rows8.model(idx)
    gap = (got - want).abs().max().item()
    assert 0 < gap < 0.05 * want.abs().max().item()  # the rows' rounding, no more
    for quantization in ("dequantize", "int8"):  # no int4 products left to take 8-bit rows
        with pytest.raises(
            ModelLoadError, match=f"own bits on a CPU, not --quantize {quantization}"
        ):
            load_for_inference(path, device="cpu", quantization=quantization,
                               int8_activations=True)  # fmt: skip
    floats = tmp_path / "llama-f32.gguf"
    write_gguf(floats, "llama", "F32")
    with pytest.raises(ModelLoadError, match="--int8-activations needs int4") as info:
        load_for_inference(floats, device="cpu", int8_activations=True)
    assert "\n" not in str(info.value)


def test_own_bits_elsewhere_than_a_cpu_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "llama-q4.gguf"
    write_gguf(path, "llama", "Q4_0")
    with pytest.raises(CheckpointError, match="runs on a CPU") as info:
        load_checkpoint(path, device="cuda", low_bit=True)
    assert "\n" not in str(info.value)


# The real file: SmolLM2-135M-Instruct, Q4_1 layers and a Q8_0 table (98 MB).


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return fetch_known_model("smollm2-135m-instruct")


def test_smollm2_at_its_bits_agrees_with_its_float_weights(smollm2: Path) -> None:
    text = (REPO / "data" / "shakespeare.txt").read_text()[:20000]
    tokens = load_tokenizer("gguf", smollm2).encode(text)
    ids = torch.tensor([tokens[:513]])
    idx, targets = ids[:, :-1], ids[0, 1:]  # 512 positions
    with torch.no_grad():
        want = load_checkpoint(smollm2)(idx)[0]
        # as served: the CPU wing's compiled norms and SwiGLU where they are built
        served = optimize_for_cpu(load_checkpoint(smollm2, low_bit=True))
        keep_int8_kernel(served)  # the Q8_0 head's 512 rows as decode steps run theirs
        got = served(idx)[0]
    choice = got.argmax(-1)
    agreement = (choice == want.argmax(-1)).float().mean().item()
    loss = torch.nn.functional.cross_entropy(got, targets).item()
    float_loss = torch.nn.functional.cross_entropy(want, targets).item()
    # where the two disagree, how far below the float model's best its choice scores
    gaps = want.max(-1).values - want.gather(1, choice[:, None])[:, 0]  # (512,)
    print(f"top-1 agreement {agreement:.4f}, loss {loss:.4f} (float {float_loss:.4f}), "
          f"largest float gap of a disagreement {gaps.max().item():.4f}")  # fmt: skip
    # 100 % with the compiled int4 kernel (float32 rows, the file's scales exactly); 99.0 % with
    # PyTorch's AVX-512 kernels, 98.8 % with AVX2 ones (bfloat16 rows; docs/GUIDE.md): only
    # near-ties move
    assert agreement >= 0.985
    assert gaps.max().item() <= 0.05  # each disagreement a near-tie of the float model's
    assert abs(loss - float_loss) <= 0.01 * float_loss


@pytest.mark.skipif(native_ops() is None, reason="no compiled CPU kernels")
def test_smollm2_with_8_bit_rows_stays_near_its_float_weights(smollm2: Path) -> None:
    """--int8-activations: the rows' rounding moves some near-ties and the loss a little (the
    measure in full: bench/int8_activations.py, docs/BENCHMARKS.md)."""
    text = (REPO / "data" / "shakespeare.txt").read_text()[:20000]
    ids = torch.tensor([load_tokenizer("gguf", smollm2).encode(text)[:513]])
    idx, targets = ids[:, :-1], ids[0, 1:]  # 512 positions
    with torch.no_grad():
        want = load_checkpoint(smollm2)(idx)[0]
        model = load_checkpoint(smollm2, low_bit=True)
        from gptserve.engine.loader import int8_activations_on

        assert int8_activations_on(model) == 4 * model.config.n_layer + 1  # qkv, o, gate-up, down
        assert type(model.lm_head.fast) is Int4Linear  # the Q8_0 head, as two int4 groups
        served = optimize_for_cpu(model)
        keep_int8_kernel(served)
        got = served(idx)[0]
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    loss = torch.nn.functional.cross_entropy(got, targets).item()
    float_loss = torch.nn.functional.cross_entropy(want, targets).item()
    print(f"8-bit rows: top-1 agreement {agreement:.4f}, loss {loss:.4f} (float {float_loss:.4f})")
    # 97.9 % and the loss 0.07 % above the float model's (llama.cpp's own answers on the same
    # file: bench/int8_activations.py); only near-ties move
    assert 0.96 <= agreement < 1
    assert abs(loss - float_loss) <= 0.005 * float_loss


@pytest.mark.skipif(not kquant_compiled(), reason="int8 rows without the compiled kernels")
@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K"])
def test_smollm2_with_k_quant_layers_at_their_bits_agrees_with_its_float_weights(
    smollm2: Path, kind: str
) -> None:
    """SmolLM2's FFN down matrices (1536 inputs: whole super-blocks; its others have 576)
    requantized to `kind`, at their own bits against the same file's weights in float32."""
    from gptserve.model.gguf.checkpoint import dequantized_state, read_gguf
    from gptserve.model.gguf.kquant_blocks import quantize
    from gptserve.model.gguf.quantized import build_low_bit_gpt, float_rows
    from gptserve.model.gpt import GPT

    source = read_gguf(smollm2)
    for name, raw in source.tensors.items():
        if name.endswith("mlp.c_proj.weight"):
            blocks = quantize(float_rows(raw).numpy(), kind)
            source.tensors[name] = RawTensor(blocks, kind, raw.shape)
    text = (REPO / "data" / "shakespeare.txt").read_text()[:20000]
    ids = torch.tensor([load_tokenizer("gguf", smollm2).encode(text)[:513]])
    idx, targets = ids[:, :-1], ids[0, 1:]  # 512 positions
    with torch.no_grad():
        reference = GPT(source.config)
        reference.load_state_dict(dequantized_state(source), strict=False)
        want = reference.eval()(idx)[0]
        served = optimize_for_cpu(build_low_bit_gpt(source, smollm2))
        keep_int8_kernel(served)  # the head's rows as decode steps run theirs
        assert sum(isinstance(m, KQuantLinear) for m in served.modules()) == 30
        got = served(idx)[0]
    choice = got.argmax(-1)
    agreement = (choice == want.argmax(-1)).float().mean().item()
    loss = torch.nn.functional.cross_entropy(got, targets).item()
    float_loss = torch.nn.functional.cross_entropy(want, targets).item()
    gaps = want.max(-1).values - want.gather(1, choice[:, None])[:, 0]  # (512,)
    print(f"{kind}: top-1 agreement {agreement:.4f}, loss {loss:.4f} (float {float_loss:.4f}), "
          f"largest float gap of a disagreement {gaps.max().item():.4f}")  # fmt: skip
    assert agreement >= 0.985  # as the file's own layers (above): only near-ties may move
    assert gaps.max().item() <= 0.05
    assert abs(loss - float_loss) <= 0.01 * float_loss


MEMORY_PROBE = """
import gc, json, sys
import gguf, tokenizers  # libraries' code is not the model's memory
from gptserve.engine.loader import load_for_inference
from gptserve.model.cpu.malloc_tuning import release_freed_memory
from gptserve.model.tokenizers import load_tokenizer

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

gc.collect()
before = rss()
if sys.argv[2] == "serve":
    held = load_for_inference(sys.argv[1], device="cpu", dtype="float32")
    weights = held.weight_bytes
else:  # the tokenizer alone, which a float model's server holds as well
    held, weights = load_tokenizer("gguf", sys.argv[1]), 0
gc.collect()
release_freed_memory()
print(json.dumps({"resident": rss() - before, "weights": weights}))
"""


def resident_after(path: Path, what: str) -> dict[str, int]:
    """Resident bytes a fresh process gains loading `what` ("serve": the model as the server
    loads it; "tokenizer": the tokenizer alone), and the weights' bytes."""
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(path), what],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_smollm2_serves_in_little_more_memory_than_its_file(smollm2: Path) -> None:
    served, tokenizer = resident_after(smollm2, "serve"), resident_after(smollm2, "tokenizer")
    size = smollm2.stat().st_size
    model = served["resident"] - tokenizer["resident"]
    print(
        f"file {size / 1e6:.0f} MB; loaded to serve +{served['resident'] / 1e6:.0f} MB resident "
        f"({served['resident'] / size:.2f}x), the tokenizer alone +"
        f"{tokenizer['resident'] / 1e6:.0f} MB, the rest {model / 1e6:.0f} MB "
        f"({model / size:.2f}x); weights {served['weights'] / 1e6:.0f} MB"
    )
    assert served["weights"] <= size
    assert model <= 1.5 * size
    assert served["resident"] <= 1.5 * size  # the tokenizer included (the goal)


def test_smollm2_at_its_bits_answers_paris(smollm2: Path) -> None:
    from gptserve.model.gguf.checkpoint import read_metadata
    from gptserve.server.chat.templates import JinjaChatTemplate

    model, tok = load_checkpoint(smollm2, low_bit=True), load_tokenizer("gguf", smollm2)
    template = JinjaChatTemplate(read_metadata(smollm2)["tokenizer.chat_template"])
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.encode(template.render(question))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert "Paris" in tok.decode(ids[len(prompt) :])
