"""Random LoRA adapters for a model's config, and the oracle of our own float adapter math: a
copy of the float model with an adapter's update merged into its weights."""

from __future__ import annotations

import copy

import torch
from gptserve.model import GPT, ModelConfig
from gptserve.model.lora.adapter import LoraAdapter, LoraPiece


def random_adapter(
    config: ModelConfig, name: str, rank: int = 4, alpha: float = 8.0, seed: int = 0,
    std: float = 0.15,
) -> LoraAdapter:  # fmt: skip
    """An adapter of every layer: q and v of c_attn, c_proj, both halves of a gated c_fc (or the
    whole c_fc), the feed-forward c_proj; weights large enough to change greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    q, kv = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    width = config.mlp_width
    gated = config.gated_mlp

    def piece(n_in: int, rows: int, offset: int = 0) -> LoraPiece:
        a = torch.randn(rank, n_in, generator=g) * std
        b = torch.randn(rows, rank, generator=g) * std
        return LoraPiece(a, b, offset)

    pieces: dict[str, list[LoraPiece]] = {}
    for i in range(config.n_layer):
        h = f"transformer.h.{i}"
        pieces[f"{h}.attn.c_attn"] = [piece(config.n_embd, q), piece(config.n_embd, kv, q + kv)]
        pieces[f"{h}.attn.c_proj"] = [piece(q, config.n_embd)]
        fc = (
            [piece(config.n_embd, width), piece(config.n_embd, width, width)]
            if gated
            else [piece(config.n_embd, width)]
        )
        pieces[f"{h}.mlp.c_fc"] = fc
        pieces[f"{h}.mlp.c_proj"] = [piece(width, config.n_embd)]
    return LoraAdapter(name, rank, alpha, alpha / rank, pieces)


@torch.no_grad()
def merged(model: GPT, adapter: LoraAdapter | None) -> GPT:
    """A copy of the float `model` (not optimized) with `adapter`'s update in its weights."""
    out = copy.deepcopy(model).eval()
    if adapter is None:
        return out
    for name, pieces in adapter.pieces.items():
        weight = out.get_submodule(name).weight  # (out, in)
        for p in pieces:
            delta = adapter.scaling * (p.b.double() @ p.a.double())  # (rows, in)
            weight[p.offset : p.offset + p.rows] += delta.to(weight.dtype)
    return out


@torch.no_grad()
def greedy_with_logprobs(model: GPT, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """`n` greedy tokens after `prompt` by full forwards, with each token's logprob."""
    ids, lps = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1].float()  # (V,)
        logprobs = torch.log_softmax(logits, -1)
        token = int(logits.argmax())
        ids.append(token)
        lps.append(float(logprobs[token]))
    return ids[len(prompt) :], lps
