"""The Engine run the one-call decode layers' tests compare: greedy tokens and logprobs of a few
requests of different lengths decoded together, with or without LoRA adapters."""

from collections.abc import Sequence

import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, get_tokenizer
from gptserve.model.lora.adapter import LoraAdapter
from gptserve.model.lora.batched import LoraBank, install_lora

from tests.lora_testing import random_adapter


def decode_together(
    model: GPT, n_seq: int, vocab: int, lora: LoraBank | None = None,
    adapters: Sequence[LoraAdapter] = (),
) -> tuple[dict, dict]:  # fmt: skip
    """Greedy tokens and logprobs of `n_seq` requests decoded together, request i 4 + i tokens
    after a prompt of 5 + 3 i random ids below `vocab` (lengths apart: a step of many decodes
    ends in steps of fewer). With `lora` (the model's slots) loaded with `adapters`, request i
    names adapter i mod (len(adapters) + 1), the last of each cycle none (the base)."""
    engine = Engine(model, get_tokenizer(), EngineConfig(max_num_seqs=n_seq), lora=lora)
    for adapter in adapters:
        engine.adapters.load(adapter.name, adapter)
    names = [a.name for a in adapters] + [None]
    gen = torch.Generator().manual_seed(n_seq)
    for i in range(n_seq):
        params = SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True, logprobs=1,
                                lora=names[i % len(names)])  # fmt: skip
        prompt = torch.randint(0, vocab, (5 + 3 * i,), generator=gen).tolist()
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while engine.has_work():
        for ev in engine.step():
            assert ev.error is None
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            logprobs.setdefault(ev.request_id, []).extend(lp.logprob for lp in ev.logprobs)
    return tokens, logprobs


def with_adapters(
    model: GPT, lora_dtype: torch.dtype = torch.float32
) -> tuple[LoraBank, list[LoraAdapter], list[list[int]]]:
    """New LoRA slots on `model` (optimized: its layers one-call ones) and 3 random adapters
    "a", "b", "c" for them, each layer's call recording the lora_meta it is given; returns the
    slots, the adapters and the record."""
    bank = install_lora(model, max_loras=3, max_rank=8, dtype=lora_dtype)
    assert all(b.lora_bank is bank for b in model.transformer.h)
    adapters = [random_adapter(model.config, name, seed=i, std=0.3) for i, name in
                enumerate("abc")]  # fmt: skip
    metas: list[list[int]] = []
    op = model.transformer.h[0].op
    for block in model.transformer.h:
        block.op = lambda *args, _op=op: metas.append(args[-2]) or _op(*args)
    return bank, adapters, metas
