"""A Llama-family layer's decode step as one compiled call (`model.cpu.llama_layer`): installed
where a layer fits (int4 products as a GGUF file's, with float32 or 8-bit rows, or float32 tiles), the Engine's tokens and
logprobs the Python path's to the bit, with and without LoRA adapter rows in the step, and every
step it does not suit left to that path."""

import pytest
import torch
from gptserve.kernels.cpu import native
from gptserve.model import GPT
from gptserve.model.config import ModelConfig
from gptserve.model.cpu import optimize_for_cpu
from gptserve.model.cpu.few_rows_linear import LAYER_FEW_ROWS, compiled_tiles
from gptserve.model.cpu.llama_layer import INT4_ROWS8, FusedLlamaBlock
from gptserve.model.gguf.blocks import Int4Groups
from gptserve.model.gpt import Block
from gptserve.model.int4_linear import Int4Linear, use_int8_activations

from tests.model.cpu.engine_runs import decode_together, with_adapters

OPS = native.native_ops() if native.enabled() else None
pytestmark = pytest.mark.skipif(not compiled_tiles(OPS), reason="no compiled CPU kernels")
VOCAB = 96


def _int4(linear: torch.nn.Linear, bias: bool = False) -> Int4Linear:
    """An int4 layer of `linear`'s shape: codes 0..15, random scales and zeros per group of 32."""
    gen = torch.Generator().manual_seed(linear.out_features)
    out, width = linear.weight.shape
    codes = torch.randint(0, 16, (out, width), generator=gen, dtype=torch.uint8).numpy()
    scales = (torch.rand(out, width // 32, generator=gen) * 0.02).numpy()
    zeros = (torch.randn(out, width // 32, generator=gen) * 0.01).numpy()
    b = torch.randn(out, generator=gen) * 0.1 if bias else None
    return Int4Linear(Int4Groups(codes, scales, zeros), bias=b, compiled=True)


def _llama(
    int4: bool, qkv_bias: bool = False, qk_norm: bool = False, window: int | None = None,
    rows8: bool = False,
) -> GPT:  # fmt: skip
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, block_size=128, n_layer=2, n_head=4, n_embd=64,
                         n_kv_head=2, intermediate_size=96, bias=False, qkv_bias=qkv_bias,
                         qk_norm=qk_norm, pos_encoding="rotary", norm="rmsnorm",
                         activation="swiglu", tokenizer="gpt2", sliding_window=window,
                         layer_types=["sliding_attention", "full_attention"] if window else None,
                         )  # fmt: skip
    model = GPT(config).eval()
    if int4:  # every product int4, as a GGUF file's Q4 layers
        for block in model.transformer.h:
            attn, mlp = block.attn, block.mlp
            attn.c_attn, attn.c_proj = _int4(attn.c_attn, qkv_bias), _int4(attn.c_proj)
            mlp.c_fc, mlp.c_proj = _int4(mlp.c_fc), _int4(mlp.c_proj)
    if rows8:  # --int8-activations
        assert use_int8_activations(model) == 4 * config.n_layer
    return optimize_for_cpu(model, threads=2)


@pytest.mark.parametrize(
    "int4, qkv_bias, window, rows8",
    [(True, False, None, False), (True, True, None, False), (False, False, None, False),
     (True, False, 6, False), (True, True, None, True)],
    ids=["int4", "int4-qkv-bias", "float32-tiles", "int4-window-6", "int4-8-bit-rows"],
)  # fmt: skip
@pytest.mark.parametrize("n_seq", [1, 3, LAYER_FEW_ROWS + 2])  # the last: more than few rows
def test_the_engine_decodes_the_python_paths_bits(
    monkeypatch, int4, qkv_bias, window, rows8, n_seq
):
    model = _llama(int4, qkv_bias, window=window, rows8=rows8)
    if rows8:
        assert model.transformer.h[0].kinds == [INT4_ROWS8] * 4
    assert all(type(b) is FusedLlamaBlock for b in model.transformer.h)
    calls = []
    op = model.transformer.h[0].op
    for block in model.transformer.h:
        block.op = lambda *args, _op=op: calls.append(args[0].shape[0]) or _op(*args)
    fused = decode_together(model, n_seq, VOCAB)
    assert calls  # it ran: float32 tiles only for steps of few rows, int4 for any
    assert max(calls) <= (LAYER_FEW_ROWS if not int4 else n_seq)
    if int4 and n_seq > LAYER_FEW_ROWS:
        assert max(calls) == n_seq
    monkeypatch.setattr(FusedLlamaBlock, "forward_cached", Block.forward_cached)
    assert decode_together(model, n_seq, VOCAB) == fused  # tokens and logprobs, exactly


@pytest.mark.parametrize("int4", [True, False], ids=["int4", "float32-tiles"])
@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16])
def test_steps_with_lora_rows_decode_the_python_paths_bits(monkeypatch, int4, lora_dtype):
    model = _llama(int4)
    bank, adapters, updates = with_adapters(model, lora_dtype)  # updates: each call's lora_meta
    n_seq = 6  # requests of a, b, c, the base, a, b (fewer as requests end)
    fused = decode_together(model, n_seq, VOCAB, bank, adapters)
    if lora_dtype == torch.float32:  # the call took steps with adapter rows
        assert any(meta for meta in updates)
        assert not bank.active  # the runner cleared the step
    else:  # bfloat16 adapters: steps with adapter rows take the products' wrappers
        assert not any(meta for meta in updates)
    monkeypatch.setattr(FusedLlamaBlock, "forward_cached", Block.forward_cached)
    assert decode_together(model, n_seq, VOCAB, bank, adapters) == fused  # exactly
    base = decode_together(model, n_seq, VOCAB, bank, [])
    for i in range(n_seq - 1):  # the adapters change what their rows decode
        if i % 4 != 3:
            assert fused[1][str(i)] != base[1][str(i)]


def test_the_op_refuses_lora_updates_that_do_not_fit():
    block = _llama(int4=True).transformer.h[0]
    x = torch.randn(2, 64)
    pools = torch.zeros(2, 16, 2, 16)
    slots = torch.zeros(2, dtype=torch.long)
    rot = torch.ones(2, 16)
    step = (pools, pools.clone(), slots, slots.clone(), torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32))  # fmt: skip
    a_t, b_t = torch.randn(64, 4), torch.randn(4, 64)
    cases = {  # lora_meta -> the message
        (0, 3, 1, 1, 1, 0, 4, 0, 64): "outside the step's rows",
        (0, 2, 1, 4, 1, 0, 4, 0, 64): "product is 0..3",
        (0, 2, 1, 1, 1, 0, 4, 32, 96): "does not fit its product",
        (0, 2, 1, 1, 2, 0, 4, 0, 64): "ends early",
        (0, 1, 2, 0, -1, 0, 4, 0, 8, 0, 4): "piece count out of range",
        (0, 2, -1): "negative LoRA update count",
        (0, 2, 1, 1, 0): "more tensors than lora_meta names",
    }
    for meta, message in cases.items():
        with pytest.raises(RuntimeError, match=message):
            block.op(x, block.norms, block.eps, block.kinds, block.weights, block.tables,
                     block.biases, block.widths, block.copies, rot, rot, *step, block.n_head,
                     0, list(meta), [a_t, b_t])  # fmt: skip


def test_layers_that_do_not_fit_keep_their_block():
    assert all(type(b) is Block for b in _llama(int4=True, qk_norm=True).transformer.h)
    model = _llama(int4=False)
    assert type(model.transformer.h[0]) is FusedLlamaBlock
    torch.manual_seed(0)
    bf16 = GPT(model.config).to(torch.bfloat16).eval()  # no float32 norms or tiles
    assert all(type(b) is Block for b in optimize_for_cpu(bf16, threads=2).transformer.h)
    invariant = optimize_for_cpu(GPT(model.config).eval(), threads=2, batch_invariant=True)
    assert all(type(b) is Block for b in invariant.transformer.h)  # oneDNN's products


def test_the_op_refuses_a_layer_of_another_shape():
    block = _llama(int4=True).transformer.h[0]
    x = torch.randn(1, 64)
    pools = torch.zeros(2, 16, 2, 8)  # heads of 8, not 64 / 4
    slot = torch.zeros(1, dtype=torch.long)
    rot = torch.ones(1, 8)
    step = (pools, pools.clone(), slot, slot.clone(), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32))  # fmt: skip
    with pytest.raises(RuntimeError, match="a Llama layer"):
        block.op(x, block.norms, block.eps, block.kinds, block.weights, block.tables,
                 block.biases, block.widths, block.copies, rot, rot, *step, block.n_head, 0,
                 [], [])  # fmt: skip
