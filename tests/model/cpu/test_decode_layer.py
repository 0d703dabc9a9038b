"""A GPT-2 layer's decode step as one compiled call (`model.cpu.decode_layer`): installed where a
layer fits, the Engine's tokens and logprobs the Python path's to the bit, with and without LoRA
adapter rows in the step, and every step it does not suit left to that path."""

import pytest
import torch
from gptserve.kernels.cpu import native
from gptserve.model import GPT
from gptserve.model.config import ModelConfig
from gptserve.model.cpu import optimize_for_cpu
from gptserve.model.cpu.decode_layer import FusedDecodeBlock
from gptserve.model.cpu.few_rows_linear import LAYER_FEW_ROWS, compiled_tiles
from gptserve.model.gpt import Block

from tests.model.cpu.engine_runs import decode_together, with_adapters

OPS = native.native_ops() if native.enabled() else None
pytestmark = pytest.mark.skipif(not compiled_tiles(OPS), reason="no compiled float32 tiles")


def _model(activation: str = "gelu", dtype: torch.dtype = torch.float32, **window) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=50257,
                      activation=activation, **window)  # fmt: skip
    return optimize_for_cpu(GPT(cfg).to(dtype).eval(), threads=2)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("n_seq", [1, 3, LAYER_FEW_ROWS + 2])  # the last: some steps too many
def test_the_engine_decodes_the_python_paths_bits(monkeypatch, activation, n_seq):
    model = _model(activation)
    assert all(type(b) is FusedDecodeBlock for b in model.transformer.h)
    calls = []
    op = model.transformer.h[0].op
    for block in model.transformer.h:
        block.op = lambda *args, _op=op: calls.append(args[0].shape[0]) or _op(*args)
    fused = decode_together(model, n_seq, 50257)
    assert calls and max(calls) <= LAYER_FEW_ROWS  # it ran, and only for steps of few rows
    monkeypatch.setattr(FusedDecodeBlock, "forward_cached", Block.forward_cached)
    assert decode_together(model, n_seq, 50257) == fused  # tokens and logprobs, exactly


@pytest.mark.parametrize(
    "window",
    [
        dict(sliding_window=3),
        dict(sliding_window=5, layer_types=["full_attention", "sliding_attention"]),
    ],
    ids=["all-windowed", "mixed"],
)
def test_windowed_layers_decode_the_python_paths_bits(monkeypatch, window):
    """The one-call layer takes each layer's window: the same tokens and logprobs as the block's
    own forward, and not those of the same weights without windows."""
    model = _model(**window)
    assert all(type(b) is FusedDecodeBlock for b in model.transformer.h)
    fused = decode_together(model, 3, 50257)
    unwindowed = decode_together(_model(), 3, 50257)
    monkeypatch.setattr(FusedDecodeBlock, "forward_cached", Block.forward_cached)
    assert decode_together(model, 3, 50257) == fused
    assert fused[1] != unwindowed[1]  # logprobs past the window differ


def _products(meta: list[int]) -> set[int]:
    """The products a call's lora_meta updates (`LoraBank.one_call_updates`' layout)."""
    out, i = set(), 0
    while i < len(meta):
        count, i = meta[i + 2], i + 3  # a run: r0, r1, its updates
        for _ in range(count):
            out.add(meta[i])
            i += 2 + 4 * meta[i + 1]  # product, pieces, then c0, c1, lo, hi each
    return out


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_steps_with_lora_rows_decode_the_python_paths_bits(monkeypatch, activation):
    """Adapters on every product, c_fc's update before its activation: the call's tokens and
    logprobs are those of the products' wrappers."""
    model = _model(activation)
    bank, adapters, updates = with_adapters(model)  # updates: each call's lora_meta
    n_seq = 6  # requests of a, b, c, the base, a, b (fewer as requests end)
    fused = decode_together(model, n_seq, 50257, bank, adapters)
    assert {0, 1, 2, 3} in [_products(meta) for meta in updates]  # c_fc's updates went in
    monkeypatch.setattr(FusedDecodeBlock, "forward_cached", Block.forward_cached)
    assert decode_together(model, n_seq, 50257, bank, adapters) == fused  # exactly
    base = decode_together(model, n_seq, 50257, bank, [])
    assert all(fused[1][str(i)] != base[1][str(i)] for i in (0, 1, 2, 4))


def test_layers_that_do_not_fit_keep_their_block():
    model = _model(dtype=torch.bfloat16)  # no float32 tiles
    assert all(type(b) is Block for b in model.transformer.h)
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=1, n_head=4, n_embd=64, block_size=32, vocab_size=101, bias=False)
    model = optimize_for_cpu(GPT(cfg).eval(), threads=2)  # LayerNorms without a bias
    assert all(type(b) is Block for b in model.transformer.h)


def test_the_op_refuses_a_layer_of_another_shape():
    block = _model().transformer.h[0]
    x = torch.randn(1, 64)
    pools = torch.zeros(2, 16, 4, 8)
    slot = torch.zeros(1, dtype=torch.long)
    step = (pools, pools.clone(), slot, slot.clone(), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32))  # fmt: skip
    with pytest.raises(RuntimeError, match="a GPT-2 layer"):  # heads of 8, not 64 / 4
        block.op(x, block.norms, block.tiles, block.biases, block.widths, *step, block.n_head,
                 block.eps, block.activation, 0, [], [])  # fmt: skip
    with pytest.raises(RuntimeError, match="four each"):
        block.op(x, block.norms[:2], block.tiles, block.biases, block.widths, *step,
                 block.n_head, block.eps, block.activation, 0, [], [])  # fmt: skip
