"""The whole model through the Triton kernels matches the PyTorch path.

The model's training attention is routed by patching `model.gpt.flash_attention` in each test;
its cached forward runs through the KV cache's backend, given explicitly.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")

import gptserve.kernels.triton.flash  # noqa: E402
from gptserve.kernels import AttentionBackend, CpuPagedBackend, SdpaGatherBackend, TritonBackend  # noqa: E402
from gptserve.model import GPT, ModelConfig  # noqa: E402
from gptserve.model import gpt as gpt_module  # noqa: E402

from tests.conftest import PagedCache  # noqa: E402
from tests.kernels.kernel_testing import rel_error  # noqa: E402


@pytest.fixture
def kernel_calls(monkeypatch) -> dict[str, int]:
    """Count calls that reach the Triton entry points, so a silent fallback cannot pass."""
    import gptserve.kernels.triton.flash
    import gptserve.kernels.triton.paged

    calls = {"flash": 0, "paged": 0}

    def counted(module, attr, key):
        inner = getattr(module, attr)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, attr, wrapper)

    counted(gptserve.kernels.triton.flash, "triton_flash_attention", "flash")
    counted(gptserve.kernels.triton.paged, "triton_paged_attention", "paged")
    return calls


# a Llama-shaped model that rotates the first 10 of each head's 16 channels (Phi-4-mini's
# partial rotation): the model rotates, the Triton kernels attend over what it stored
PARTIAL_ROTARY = dict(pos_encoding="rotary", rotary_dim=10, n_kv_head=2, norm="rmsnorm",
                      activation="swiglu", bias=False)  # fmt: skip


def _model(device: torch.device, **fields) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=101, block_size=32, n_layer=2, n_head=4, n_embd=64, **fields)
    return GPT(cfg).to(device)


def _sdpa(q, k, v, causal=True, sm_scale=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)


def _triton(q, k, v, causal=True, sm_scale=None):
    return gptserve.kernels.triton.flash.triton_flash_attention(
        q, k, v, causal=causal, sm_scale=sm_scale
    )


def _route(monkeypatch, backend: str) -> None:
    """The model's training attention through Triton ("triton") or SDPA ("torch")."""
    monkeypatch.setattr(gpt_module, "flash_attention", _triton if backend == "triton" else _sdpa)


def _paged_backend(backend: str, device: torch.device) -> AttentionBackend:
    """The Triton backend, or the PyTorch one the device would get."""
    if backend == "triton":
        return TritonBackend()
    return CpuPagedBackend() if device.type == "cpu" else SdpaGatherBackend()


def _loss_and_grads(
    model: GPT, idx: torch.Tensor, targets: torch.Tensor, backend: str, monkeypatch
):  # fmt: skip
    _route(monkeypatch, backend)
    model.zero_grad(set_to_none=True)
    loss = model.loss(idx, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def test_training_step_matches_torch_path(monkeypatch, kernel_calls, device):
    model = _model(device)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 101, (2, 32), generator=gen).to(device)
    targets = torch.randint(0, 101, (2, 32), generator=gen).to(device)
    targets[0, :5] = -1  # ignored positions
    loss_t, grads_t = _loss_and_grads(model, idx, targets, "triton", monkeypatch)
    assert kernel_calls["flash"] == 2  # one per layer
    loss_r, grads_r = _loss_and_grads(model, idx, targets, "torch", monkeypatch)
    assert torch.isfinite(loss_t)
    assert abs(loss_t.item() - loss_r.item()) < 1e-4
    for name, grad in grads_r.items():
        assert rel_error(grads_t[name], grad) < 1e-3, name


def test_logits_match_for_a_short_sequence(monkeypatch, device):
    model = _model(device).eval()
    idx = torch.randint(0, 101, (3, 13), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        _route(monkeypatch, "triton")
        got = model(idx)
        _route(monkeypatch, "torch")
        want = model(idx)
    assert rel_error(got, want) < 1e-4


def _cached_logits(
    model: GPT,
    seqs: list[torch.Tensor],
    prompt_lens: list[int],
    steps: int,
    backend: str,
    device: torch.device,
) -> list[torch.Tensor]:
    """Prefill all prompts in one batch, then decode `steps` tokens each (teacher forced)."""
    order = list(range(32))
    random.Random(0).shuffle(order)
    cache = PagedCache(model, 32, 8, block_order=order, device=device,
                       backend=_paged_backend(backend, device))  # fmt: skip
    cache.pools.k.fill_(float("nan"))  # unused slots hold garbage
    cache.pools.v.fill_(float("nan"))
    out = []
    with torch.no_grad():
        batch = cache.prepare([(i, n) for i, n in enumerate(prompt_lens)])
        tokens = torch.cat([s[:n] for s, n in zip(seqs, prompt_lens)]).to(device)
        every = torch.arange(len(tokens), device=device)
        out.append(model.forward_cached(tokens, cache.pools, batch, logits_index=every))
        for step in range(steps):
            batch = cache.prepare([(i, 1) for i in range(len(seqs))])
            tokens = torch.stack([s[n + step] for s, n in zip(seqs, prompt_lens)]).to(device)
            out.append(model.forward_cached(tokens, cache.pools, batch))
    return out


@pytest.mark.parametrize("fields", [{}, PARTIAL_ROTARY], ids=["gpt2", "partial-rotary"])
def test_forward_cached_matches_reference_path(kernel_calls, device, fields):
    model = _model(device, **fields).eval()
    prompt_lens = [1, 9, 23]  # below, across and well past the 8-token cache block
    steps = 4
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 101, (n + steps,), generator=gen) for n in prompt_lens]
    got = _cached_logits(model, seqs, prompt_lens, steps, "triton", device)
    assert kernel_calls["paged"] == 2 * (1 + steps)  # every layer of every step
    want = _cached_logits(model, seqs, prompt_lens, steps, "torch", device)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert rel_error(g, w) < 1e-4
    # and the cache path agrees with the full forward on the last decoded token's logits
    full = model(seqs[1][: prompt_lens[1] + steps][None].to(device))  # (1, T, V)
    assert rel_error(got[-1][1], full[0, -1]) < 1e-4
