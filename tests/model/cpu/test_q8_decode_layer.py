"""A GPT-2 layer of `--quantize int8` products whose decode step is one compiled call
(`model.cpu.decode_layer.FusedQ8DecodeBlock`): installed where a layer fits, the Engine's tokens
and logprobs the module path's to the bit (alone, in batches, with LoRA adapter rows), and steps
of more rows than the 8-bit kernel takes left to that path."""

import pytest
import torch
from gptserve.kernels.cpu import native
from gptserve.model import GPT
from gptserve.model.config import ModelConfig
from gptserve.model.cpu import optimize_for_cpu
from gptserve.model.cpu.decode_layer import FusedQ8DecodeBlock
from gptserve.model.gpt import Block
from gptserve.model.quantize import Int8Linear, keep_int8_kernel, q8_ops, quantize

from tests.model.cpu.engine_runs import decode_together, with_adapters

OPS = native.native_ops() if native.enabled() else None
pytestmark = pytest.mark.skipif(
    q8_ops(64, torch.device("cpu")) is None or not hasattr(OPS, "q8_decode_layer"),
    reason="no compiled 8-bit product",
)


def _model(activation: str = "gelu", **window) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=50257,
                      activation=activation, **window)  # fmt: skip
    return optimize_for_cpu(quantize(GPT(cfg).eval(), "int8"), threads=2)


def _count_calls(model: GPT) -> list[int]:
    """Each layer's call records its rows from now on."""
    calls: list[int] = []
    op = model.transformer.h[0].op
    for block in model.transformer.h:
        block.op = lambda *args, _op=op: calls.append(args[0].shape[0]) or _op(*args)
    return calls


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("n_seq", [1, 3, 10])
def test_the_engine_decodes_the_module_paths_bits(monkeypatch, activation, n_seq):
    model = _model(activation)
    assert all(type(b) is FusedQ8DecodeBlock for b in model.transformer.h)
    assert all(type(p) is Int8Linear for b in model.transformer.h for p in b.products)
    calls = _count_calls(model)
    fused = decode_together(model, n_seq, 50257)
    assert calls and max(calls) == n_seq  # every decode step, the first with all the rows
    monkeypatch.setattr(FusedQ8DecodeBlock, "forward_cached", Block.forward_cached)
    assert decode_together(model, n_seq, 50257) == fused  # tokens and logprobs, exactly


def test_a_step_of_more_rows_than_the_8bit_kernel_takes_keeps_the_module_path(monkeypatch):
    model = _model()
    for block in model.transformer.h:
        for p in block.products:
            p.many_rows = 3  # from 3 rows on the module dequantizes: the call must not run
    calls = _count_calls(model)
    fused = decode_together(model, 5, 50257)
    assert calls and max(calls) == 2
    monkeypatch.setattr(FusedQ8DecodeBlock, "forward_cached", Block.forward_cached)
    assert decode_together(model, 5, 50257) == fused
    monkeypatch.undo()
    keep_int8_kernel(model)  # the 8-bit kernel at every row count: the call takes every step
    calls.clear()
    decode_together(model, 5, 50257)
    assert max(calls) == 5


def test_windowed_layers_decode_the_module_paths_bits(monkeypatch):
    model = _model(sliding_window=3, layer_types=["full_attention", "sliding_attention"])
    assert all(type(b) is FusedQ8DecodeBlock for b in model.transformer.h)
    fused = decode_together(model, 3, 50257)
    monkeypatch.setattr(FusedQ8DecodeBlock, "forward_cached", Block.forward_cached)
    assert decode_together(model, 3, 50257) == fused


def test_steps_with_lora_rows_decode_the_module_paths_bits(monkeypatch):
    model = _model()
    bank, adapters, updates = with_adapters(model)
    fused = decode_together(model, 6, 50257, bank, adapters)
    assert any(updates)  # adapter updates went into the calls
    monkeypatch.setattr(FusedQ8DecodeBlock, "forward_cached", Block.forward_cached)
    assert decode_together(model, 6, 50257, bank, adapters) == fused  # exactly
    base = decode_together(model, 6, 50257, bank, [])
    assert fused[1]["0"] != base[1]["0"]


def test_layers_that_do_not_fit_keep_their_block():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=1, n_head=4, n_embd=64, block_size=32, vocab_size=101, bias=False)
    model = optimize_for_cpu(quantize(GPT(cfg).eval(), "int8"), threads=2)  # no LayerNorm bias
    assert all(type(b) is Block for b in model.transformer.h)
    model = optimize_for_cpu(quantize(GPT(cfg).eval(), "int8"), batch_invariant=True)
    assert all(type(b) is Block for b in model.transformer.h)


def test_the_op_refuses_a_layer_of_another_shape():
    block = _model().transformer.h[0]
    x = torch.randn(1, 64)
    pools = torch.zeros(2, 16, 4, 8)
    slot = torch.zeros(1, dtype=torch.long)
    step = (pools, pools.clone(), slot, slot.clone(), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32))  # fmt: skip
    with pytest.raises(RuntimeError, match="a GPT-2 layer"):  # heads of 8, not 64 / 4
        block.op(x, block.norms, block.codes, block.scales, block.biases, block.widths, *step,
                 block.n_head, block.eps, block.activation, 0, [], [])  # fmt: skip
    with pytest.raises(RuntimeError, match="four each"):
        block.op(x, block.norms, block.codes[:2], block.scales, block.biases, block.widths,
                 *step, block.n_head, block.eps, block.activation, 0, [], [])  # fmt: skip
