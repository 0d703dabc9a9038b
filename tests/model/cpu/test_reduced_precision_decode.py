"""Decoding through the Engine in bfloat16 and with int8 weights, as `gptserve serve` loads them:
the KV cache, the attention, the sampler and a tied embedding all run, and the engine's greedy
tokens and logprobs are those of the same model's full forward."""

import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.sampler import SamplingParams
from gptserve.model import SHAKESPEARE_DIR, get_tokenizer, load_checkpoint
from gptserve.model.cpu import optimize_for_cpu
from gptserve.model.quantize import quantize

PROMPTS = [
    "PAROLLES.\nNoble heroes, my sword and yours are kin. Good sparks and\n",
    "FIRST LORD.\nWe shall, noble captain.\n\n",
]


@pytest.mark.parametrize(
    "dtype, method",
    [(torch.bfloat16, "none"), (torch.float32, "int8"), (torch.bfloat16, "int8")],
    ids=["bf16", "int8", "int8-bf16"],
)
def test_the_engine_decodes_what_the_full_forward_predicts(dtype, method):
    model = optimize_for_cpu(quantize(load_checkpoint(SHAKESPEARE_DIR, dtype=dtype), method))
    tok = get_tokenizer()
    engine = Engine(model, tok, EngineConfig(max_num_seqs=4))
    assert engine.pools.k.dtype == dtype
    new = 12
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=2)
    prompts = [tok.encode(p) for p in PROMPTS]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {"0": [], "1": []}
    logprobs: dict[str, list[float]] = {"0": [], "1": []}
    while engine.has_work():
        for ev in engine.step():
            assert ev.error is None
            tokens[ev.request_id] += ev.token_ids
            logprobs[ev.request_id] += [lp.logprob for lp in ev.logprobs]
    for i, prompt in enumerate(prompts):
        got = tokens[str(i)]
        assert len(got) == new and len(set(got)) > 1  # text, not one repeated token
        with torch.no_grad():  # the same model without a cache: all positions at once
            full = model(torch.tensor([prompt + got]))[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(full, dim=-1)  # (new, V)
        chosen = lp[torch.arange(new), torch.tensor(got)]
        # each greedy token is the full forward's best, or at most once a near-tie with it: the
        # two paths round differently (int8 products quantize their rows to 8 bits per block)
        best = lp.argmax(-1).tolist()
        assert sum(g != b for g, b in zip(got, best)) <= (1 if method == "int8" else 0)
        assert (lp.max(-1).values - chosen <= 0.1).all()
        torch.testing.assert_close(torch.tensor(logprobs[str(i)]), chosen, rtol=0, atol=0.1)
