"""LoRA slots over a model's products: each row gets its own adapter's update (all rows, a run
of rows, scattered rows), over float, CPU-wing and int8 products, activations fused or not;
adapters that do not fit are refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from gptserve.engine.loader import prepare_for_inference
from gptserve.model import GPT, ModelConfig
from gptserve.model.lora.adapter import LoraPiece
from gptserve.model.lora.batched import (
    LoraLinear,
    LoraRankError,
    LoraShapeError,
    install_lora,
)

from tests.lora_testing import random_adapter

LLAMA = dict(
    vocab_size=64, block_size=32, n_layer=1, n_head=4, n_embd=32, n_kv_head=2,
    intermediate_size=48, bias=False, pos_encoding="rotary", norm="rmsnorm", activation="swiglu",
)  # fmt: skip
GPT2 = dict(vocab_size=64, block_size=32, n_layer=1, n_head=4, n_embd=32)


def _model(kind: str) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**(LLAMA if kind == "llama" else GPT2))).eval()


def _expected(product_out: torch.Tensor, x: torch.Tensor, adapter, name: str) -> torch.Tensor:
    """One row's output with `adapter`'s update of layer `name` (float64 reference)."""
    out = product_out.double().clone()
    for p in adapter.pieces[name]:
        out[p.offset : p.offset + p.rows] += adapter.scaling * (
            p.b.double() @ (p.a.double() @ x.double())
        )
    return out


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize(
    "slots",
    [[0, 0, 0, 0], [-1, 1, 1, -1], [0, -1, 1, 0, 2, -1]],
    ids=["all-rows", "a-run", "scattered"],
)
def test_each_row_gets_its_own_adapters_update(kind: str, quantization: str, slots) -> None:
    model = _model(kind)
    served = prepare_for_inference(copy.deepcopy(model), quantization)
    bank = install_lora(served, 3, 8)
    adapters = [random_adapter(model.config, f"a{i}", seed=i) for i in range(3)]
    for slot, adapter in enumerate(adapters):
        bank.load(slot, adapter)
    bank.set_step(slots)
    for name, wrapper in bank.layers.items():
        rows = torch.randn(len(slots), wrapper.in_features)  # (N, in)
        if quantization == "int8" or name.endswith("mlp.c_fc"):
            rows = rows.to(torch.bfloat16).float()  # exact in the int8 products' bf16 rows
        plain = wrapper.base  # the product it wraps, as it was
        got = wrapper(rows)
        split_activation = wrapper.pre is not None
        base = (wrapper.pre or plain)(rows) if split_activation else plain(rows)
        for i, slot in enumerate(slots):
            want = (
                base[i].double() if slot < 0 else _expected(base[i], rows[i], adapters[slot], name)
            )
            if split_activation:  # the update comes before the product's own activation
                want = torch.nn.functional.gelu(want, approximate="tanh")
            tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-4
            torch.testing.assert_close(got[i].double(), want, atol=tol, rtol=tol)
    bank.clear_step()
    for wrapper in bank.layers.values():  # no rows named: the base product's output
        rows = torch.randn(2, wrapper.in_features)
        assert torch.equal(wrapper(rows), wrapper.base(rows))


def test_a_fused_activation_gets_a_twin_without_it() -> None:
    served = prepare_for_inference(_model("gpt2"))
    bank = install_lora(served, 1, 8)
    c_fc = bank.layers["transformer.h.0.mlp.c_fc"]
    assert isinstance(c_fc, LoraLinear) and c_fc.pre is not None and c_fc.activation == "gelu_tanh"
    assert all(p is None for p in (bank.layers["transformer.h.0.attn.c_attn"].pre,))


def test_adapters_that_do_not_fit_are_refused_in_one_line() -> None:
    model = _model("llama")
    bank = install_lora(prepare_for_inference(copy.deepcopy(model)), 2, 4)
    with pytest.raises(LoraRankError, match="above --max-lora-rank 4"):
        bank.check(random_adapter(model.config, "big", rank=8))
    adapter = random_adapter(model.config, "x", rank=2)
    wide = copy.deepcopy(adapter)
    name = "transformer.h.0.attn.c_attn"
    wide.pieces[name] = [LoraPiece(torch.zeros(2, 33), torch.zeros(8, 2))]  # 33 inputs, not 32
    with pytest.raises(LoraShapeError, match="does not fit") as info:
        bank.check(wide)
    assert "\n" not in str(info.value)
    past = copy.deepcopy(adapter)
    past.pieces[name] = [LoraPiece(torch.zeros(2, 32), torch.zeros(8, 2), offset=60)]  # past 64
    with pytest.raises(LoraShapeError, match="does not fit"):
        bank.check(past)
    other = copy.deepcopy(adapter)
    other.pieces["transformer.h.5.attn.c_attn"] = adapter.pieces[name]
    with pytest.raises(LoraShapeError, match="does not have"):
        bank.check(other)
    bank.check(adapter)  # the one that fits
    with pytest.raises(ValueError, match="no adapter is loaded in slot 1"):
        bank.set_step([1])


def test_bfloat16_adapters_are_the_update_to_bfloat16_rounding() -> None:
    model = _model("llama")
    served = prepare_for_inference(copy.deepcopy(model))
    bank = install_lora(served, 2, 8, dtype=torch.bfloat16)
    adapter = random_adapter(model.config, "a")
    bank.load(1, adapter)
    bank.set_step([1, -1, 1])
    for name, wrapper in bank.layers.items():
        rows = torch.randn(3, wrapper.in_features)
        got, base = wrapper(rows), wrapper.base(rows)
        assert got.dtype == base.dtype == torch.float32
        torch.testing.assert_close(got[1], base[1])  # the base row is untouched
        for i in (0, 2):
            want = _expected(base[i], rows[i], adapter, name)
            delta = (want - base[i].double()).abs().max()
            assert (got[i].double() - want).abs().max() <= 0.02 * delta + 1e-3
            assert not torch.equal(got[i], base[i])


def test_a_wrapper_is_in_place_only_while_an_adapter_updates_its_product() -> None:
    model = _model("llama")
    served = prepare_for_inference(copy.deepcopy(model))
    products = {n: served.get_submodule(n) for n in install_lora(served, 2, 8).layers}
    bank = served.lora_slots
    assert all(served.get_submodule(n) is p for n, p in products.items())  # nothing loaded
    attn_only = random_adapter(model.config, "a")
    attn_only.pieces = {n: ps for n, ps in attn_only.pieces.items() if "attn" in n}
    bank.load(1, attn_only)
    for name, product in products.items():
        now = served.get_submodule(name)
        assert (now is bank.layers[name]) == ("attn" in name)
        assert bank.layers[name].base is product
    bank.unload(1)
    assert all(served.get_submodule(n) is p for n, p in products.items())
    with pytest.raises(ValueError, match="already has LoRA slots"):
        install_lora(served, 2, 8)
