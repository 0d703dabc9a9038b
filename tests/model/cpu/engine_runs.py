"""The Engine run the one-call decode layers' tests compare: greedy tokens and logprobs of a few
requests of different lengths decoded together."""

from collections.abc import Sequence

import torch

from engine.engine import Engine, EngineConfig
from engine.sampler import SamplingParams
from model import GPT, get_tokenizer
from model.lora.adapter import LoraAdapter
from model.lora.batched import LoraBank


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
