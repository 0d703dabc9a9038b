"""The Engine run the one-call decode layers' tests compare: greedy tokens and logprobs of a few
requests of different lengths decoded together."""

import torch

from engine.engine import Engine, EngineConfig
from engine.sampler import SamplingParams
from model import GPT, get_tokenizer


def decode_together(model: GPT, n_seq: int, vocab: int) -> tuple[dict, dict]:
    """Greedy tokens and logprobs of `n_seq` requests decoded together, request i 4 + i tokens
    after a prompt of 5 + 3 i random ids below `vocab` (lengths apart: a step of many decodes
    ends in steps of fewer)."""
    engine = Engine(model, get_tokenizer(), EngineConfig(max_num_seqs=n_seq))
    gen = torch.Generator().manual_seed(n_seq)
    for i in range(n_seq):
        params = SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True, logprobs=1)
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
