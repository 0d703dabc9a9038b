"""Our loader and forward pass against Hugging Face transformers on random GPT-2 weights."""

import pytest
import torch
from gptserve.model import load_checkpoint

transformers = pytest.importorskip("transformers")

SMALL = dict(n_layer=2, n_head=4, n_embd=64, n_positions=128)
GPT2_124M = dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024)


def _hf_model(tmp_path, cfg, safe: bool):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=safe)
    return hf


@pytest.mark.parametrize(
    "cfg,safe",
    [(SMALL, True), (SMALL, False), (GPT2_124M, True)],
    ids=["small", "small-bin", "124M"],
)
def test_logits_and_greedy_tokens_match(tmp_path, cfg, safe):
    hf = _hf_model(tmp_path, cfg, safe)
    ours = load_checkpoint(tmp_path)
    idx = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(idx).logits
        got = ours(idx)
    assert got.shape == ref.shape == (2, 24, 50257)
    assert (got - ref).abs().max().item() < 1e-4

    prompt = idx[:1, :8]
    with torch.no_grad():
        expected = hf.generate(
            prompt,
            max_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones_like(prompt),
        )[0, 8:].tolist()
        seq = prompt
        for _ in range(32):
            nxt = ours(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert seq[0, 8:].tolist() == expected
