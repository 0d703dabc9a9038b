"""engine.loader: one pipeline from a checkpoint directory to a servable model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gptserve.engine.loader import (
    ModelLoadError,
    check_load,
    load_for_inference,
    prepare_for_inference,
    resolve_device,
)
from gptserve.model import GPT, ModelConfig, load_checkpoint, save_checkpoint
from gptserve.model.cpu import is_optimized_for_cpu
from gptserve.model.quantize import (
    MANY_ROWS,
    TILED_MANY_ROWS,
    Int8Linear,
    dequantize_from_rows,
    is_quantized,
)

TOKENS = torch.tensor([[1, 2, 3, 4]])


@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [("float32", "none"), ("bfloat16", "none"), ("float16", "none"), ("float32", "int8"),
     ("bfloat16", "int8")],
)  # fmt: skip
def test_each_dtype_and_quantization_loads_ready_to_serve(
    tiny_checkpoint: Path, dtype: str, quantization: str
):
    loaded = load_for_inference(
        tiny_checkpoint, device="cpu", dtype=dtype, quantization=quantization
    )
    want = getattr(torch, dtype)  # torch's own name for it
    assert loaded.dtype == want and loaded.device == torch.device("cpu")
    assert loaded.name == "tiny-gpt" and loaded.quantization == quantization
    assert loaded.model.transformer.ln_f.weight.dtype == want  # norms stay in the model's dtype
    assert is_quantized(loaded.model) == (quantization == "int8")
    # the CPU wing swaps the float layers; quantized, it only has the compiled int8 product of
    # each feed-forward block apply the activation (where the matrices are held in tiles)
    fc = loaded.model.transformer.h[0].mlp.c_fc
    compiled_int8 = quantization == "int8" and fc.q8 is not None
    assert is_optimized_for_cpu(loaded.model) == (quantization == "none" or compiled_int8)
    assert not compiled_int8 or fc.activation == "gelu_tanh"
    assert loaded.tokenizer.vocab_size <= loaded.model.config.vocab_size
    with torch.no_grad():
        logits = loaded.model(TOKENS)
    assert torch.isfinite(logits.float()).all()


def test_weight_bytes_count_each_matrix_once_as_served(tiny_checkpoint: Path):
    full = load_for_inference(tiny_checkpoint, device="cpu", dtype="float32")
    half = load_for_inference(tiny_checkpoint, device="cpu", dtype="bfloat16")
    int8 = load_for_inference(tiny_checkpoint, device="cpu", dtype="float32", quantization="int8")
    plain = load_checkpoint(tiny_checkpoint)
    params = sum(p.numel() for p in plain.parameters())  # the tied table counted once
    assert full.weight_bytes == 4 * params
    assert half.weight_bytes == 2 * params
    assert int8.weight_bytes < half.weight_bytes


def test_the_output_is_the_plain_models(tiny_checkpoint: Path):
    loaded = load_for_inference(tiny_checkpoint, device="cpu", dtype="float32")
    plain = load_checkpoint(tiny_checkpoint)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(TOKENS), plain(TOKENS), rtol=1e-4, atol=1e-4)


def test_a_bad_combination_is_one_error_before_anything_loads(tmp_path: Path):
    missing = tmp_path / "never-read"  # the combination is refused before the path is looked at
    with pytest.raises(ModelLoadError, match="float32 or bfloat16") as err:
        load_for_inference(missing, device="cpu", dtype="float16", quantization="int8")
    assert "\n" not in str(err.value)
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_for_inference(missing, device="cpu", quantization="int4")
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_for_inference(missing, device="cpu", dtype="float8")
    with pytest.raises(ModelLoadError, match="unknown device"):
        load_for_inference(missing, device="tpu:x")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_is_one_error():
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        check_load("cuda", "auto", "none")


def test_auto_resolves_to_the_machine():
    device, dtype = resolve_device("auto", "auto")
    if torch.cuda.is_available():
        assert (device.type, dtype) == ("cuda", torch.bfloat16)
    else:
        assert (device.type, dtype) == ("cpu", torch.float32)
    assert resolve_device("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)


def test_a_missing_or_broken_checkpoint_is_one_line(tmp_path: Path, tiny_checkpoint: Path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_for_inference(tmp_path / "missing", device="cpu")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="unreadable or truncated") as err:
        load_for_inference(broken, device="cpu")
    assert "\n" not in str(err.value)


def test_the_draft_model_goes_through_the_same_steps(tiny_checkpoint: Path):
    loaded = load_for_inference(
        tiny_checkpoint, device="cpu", dtype="float32", quantization="int8",
        draft_path=tiny_checkpoint,
    )  # fmt: skip
    assert loaded.draft is not None and loaded.draft is not loaded.model
    assert is_quantized(loaded.draft)


def test_prepare_quantizes_before_the_cpu_layouts():
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=101))
    prepared = prepare_for_inference(model.eval(), "int8")
    assert prepared is model
    assert isinstance(model.lm_head, Int8Linear)  # the CPU wing left the int8 head as it was
    assert isinstance(model.transformer.h[0].attn.c_attn, Int8Linear)


def test_batch_invariance_is_asked_where_it_holds(tmp_path):
    """--batch-invariant: refused in one line where it cannot hold; on a CPU the int8 products
    keep their int8 kernel at every row count."""
    with pytest.raises(ModelLoadError, match="--batch-invariant holds on a CPU"):
        check_load("cpu", "float16", "none", batch_invariant=True)
    path = tmp_path / "ckpt"
    torch.manual_seed(0)
    save_checkpoint(GPT(ModelConfig(n_layer=1, n_head=2, n_embd=64, block_size=32)), path)
    fast = dequantize_from_rows(torch.device("cpu")) is not None  # native bfloat16 products
    for invariant in (False, True):
        loaded = load_for_inference(path, device="cpu", quantization="int8",
                                    batch_invariant=invariant)  # fmt: skip
        layers = [m for m in loaded.model.modules() if isinstance(m, Int8Linear)]
        assert layers
        for m in layers:  # PyTorch's kernel or the compiled tiles switch at their own count
            switch = MANY_ROWS if m.q8 is None else TILED_MANY_ROWS
            assert m.many_rows == (switch if fast and not invariant else None)
