"""The compiled RMSNorm and SwiGLU (`model.cpu.fused_rows`) against the modules they replace."""

import pytest
import torch
from gptserve.kernels.cpu.native import enabled, native_ops
from gptserve.model import GPT
from gptserve.model.config import ModelConfig
from gptserve.model.cpu import optimize_for_cpu
from gptserve.model.cpu.fused_rows import FusedRMSNorm, FusedSwiGLU, install_fused_rows
from gptserve.model.gguf.blocks import Int4Groups
from gptserve.model.gpt import MLP
from gptserve.model.int4_linear import Int4Linear
from gptserve.model.rmsnorm import RMSNorm

pytestmark = pytest.mark.skipif(not enabled(), reason="GPTSERVE_NATIVE=0")


def _llama(n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=96, block_size=64, n_layer=n_layer, n_head=4, n_embd=64,
                         n_kv_head=2, intermediate_size=96, bias=False, pos_encoding="rotary",
                         norm="rmsnorm", activation="swiglu", tokenizer="hf")  # fmt: skip
    return GPT(config).eval()


def _int4(linear: torch.nn.Linear, compiled: bool | None = None) -> Int4Linear:
    """An int4 layer of `linear`'s shape: codes 0..15, random scales and zeros per group of 32."""
    gen = torch.Generator().manual_seed(linear.out_features)
    out, width = linear.weight.shape
    codes = torch.randint(0, 16, (out, width), generator=gen, dtype=torch.uint8).numpy()
    scales = (torch.rand(out, width // 32, generator=gen) * 0.02).numpy()
    zeros = (torch.randn(out, width // 32, generator=gen) * 0.01).numpy()
    return Int4Linear(Int4Groups(codes, scales, zeros), compiled=compiled)


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows, width", [(15, 200), (1, 576), (7, 37), (64, 2048)])
def test_the_norm_is_rmsnorm_written_in_the_dtype_asked(out_dtype, rows, width):
    norm = RMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(rows, width) * 3).view(rows, 1, width) if rows > 1 else torch.randn(1, width)
    fused = FusedRMSNorm(norm, native_ops(), out_dtype)
    got, want = fused(x), norm(x)
    assert got.shape == x.shape and got.dtype == (out_dtype or torch.float32)
    # PyTorch's float32 rms_norm to the bit, then the cast the product would have made
    assert torch.equal(got, want.to(got.dtype))


def test_swiglu_is_silu_of_the_gate_times_up():
    mlp = _llama().transformer.h[0].mlp
    x = torch.randn(7, 64)
    with torch.no_grad():
        torch.testing.assert_close(FusedSwiGLU(mlp, native_ops())(x), mlp(x), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-int4", "pytorch-int4"])
def test_int4_layers_hand_their_dtype_along_and_the_model_computes_the_same(compiled):
    model = _llama()
    for block in model.transformer.h:  # every product int4, as a GGUF file's Q4 layers
        attn, mlp = block.attn, block.mlp
        attn.c_attn, attn.c_proj = _int4(attn.c_attn, compiled), _int4(attn.c_proj, compiled)
        mlp.c_fc, mlp.c_proj = _int4(mlp.c_fc, compiled), _int4(mlp.c_proj, compiled)
    rows = torch.float32 if compiled else torch.bfloat16  # what each kernel takes
    idx = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(idx)
        assert install_fused_rows(model, native_ops()) == 2
        block = model.transformer.h[0]
        assert isinstance(block.ln_1, FusedRMSNorm) and block.ln_1.out_dtype == rows
        assert isinstance(block.mlp, FusedSwiGLU) and block.mlp.c_fc.out_dtype == rows
        assert block.attn.c_attn.out_dtype == torch.float32  # q, k, v stay float32
        assert block.attn.c_proj.out_dtype == rows  # the residual add promotes it
        after = model(idx)
    assert after.dtype == torch.float32
    # the same rows reach every product: the norm is PyTorch's to the bit, and silu's exp
    # differs from PyTorch's by an ulp at most (below a bfloat16 rounding but at a tie)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_the_wing_installs_them_on_a_float32_llama_only():
    model = optimize_for_cpu(_llama())
    assert all(isinstance(b.ln_1, FusedRMSNorm) for b in model.transformer.h) == (
        native_ops() is not None
    )
    assert isinstance(model.transformer.ln_f, RMSNorm)  # the head reads float32 from it
    half = _llama().to(torch.bfloat16)
    assert install_fused_rows(half, native_ops()) == 0  # its norm multiplies after the cast
    assert all(isinstance(b.mlp, MLP) for b in half.transformer.h)


def test_a_quantized_gate_beside_a_float_down_projection():
    # a GGUF file may keep ffn_down in float: c_fc's bfloat16 must not reach a float32 c_proj
    model = _llama(n_layer=1)
    mlp = model.transformer.h[0].mlp
    mlp.c_fc = _int4(mlp.c_fc)
    x = torch.randn(5, 64)
    with torch.no_grad():
        want = model.transformer.h[0].mlp(x)
        install_fused_rows(model, native_ops())
        got = model.transformer.h[0].mlp(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
