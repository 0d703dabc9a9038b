"""The model runner: a StepPlan and its prepared blocks become one forward's packed tokens and
logits index, after the block copies the step asked for."""

from __future__ import annotations

import torch
import torch.nn as nn
from gptserve.engine.block_manager import BlockManager, StepBlocks
from gptserve.engine.runner import ModelRunner
from gptserve.engine.sampler import SamplingParams
from gptserve.engine.sequence import Sequence
from gptserve.engine.step_plan import StepPlan
from gptserve.kernels.paged_kv import KVPools
from gptserve.model import ModelConfig, get_tokenizer

TOK = get_tokenizer()
VOCAB = 11


class RecordingModel(nn.Module):
    """Records what each forward is given; logits row i is filled with its packed position."""

    def __init__(self) -> None:
        super().__init__()
        self.config = ModelConfig(n_layer=1, n_head=1, n_embd=2, block_size=64)
        self.w = nn.Parameter(torch.zeros(1))
        self.calls: list[tuple[list[int], list[int], list[int]]] = []

    def forward_cached(self, tokens, cache, meta, logits_index=None):
        self.calls.append((tokens.tolist(), logits_index.tolist(), list(meta.query_lens)))
        return logits_index[:, None].float().expand(-1, VOCAB)  # (rows, VOCAB)


def cached_seq(cache: BlockManager, seq_id: int, prompt: list[int]) -> Sequence:
    """A sequence whose prompt is in the cache and whose first token (99) is not yet."""
    seq = Sequence(seq_id, f"r{seq_id}", 0, prompt, SamplingParams(), TOK)
    cache.prepare([(seq_id, len(prompt))])
    seq.num_cached = len(prompt)
    seq.token_ids.append(99)
    return seq


def test_a_plan_is_packed_in_order_with_its_logits_rows():
    blocks = BlockManager(16, 4)
    a, b = cached_seq(blocks, 0, [1, 2, 3]), cached_seq(blocks, 1, [4, 5, 6])
    c = Sequence(2, "r2", 0, list(range(20, 30)), SamplingParams(), TOK)
    plan = StepPlan.build([(a, 1, []), (b, 4, [7, 8, 9]), (c, 3, [])], [])
    model = RecordingModel()
    step = blocks.prepare([(s.seq.seq_id, s.num_tokens) for s in plan.scheduled])

    logits = ModelRunner(model, KVPools(1, 1, 2, num_blocks=16, block_size=4)).run(plan, step)

    ((tokens, index, query_lens),) = model.calls
    assert tokens == [99, 99, 7, 8, 9, 20, 21, 22]
    assert index == plan.logits_positions == [0, 1, 2, 3, 4] and query_lens == [1, 4, 3]
    assert logits.shape == (5, VOCAB) and logits[:, 0].tolist() == [0, 1, 2, 3, 4]
    # the tables hold room for every new token; the sequences themselves are the engine's
    assert [blocks.seq_len(s.seq_id) for s in (a, b, c)] == [4, 7, 3]
    assert [s.num_cached for s in (a, b, c)] == [3, 3, 0]


def test_the_runner_makes_the_block_copies_before_the_forward():
    pools = KVPools(1, 1, 2, num_blocks=4, block_size=4)
    pools.k[:, 1] = 1.0
    pools.v[:, 1] = 2.0
    c = Sequence(0, "r0", 0, [1, 2], SamplingParams(), TOK)
    plan = StepPlan.build([(c, 2, [])], [])
    meta = BlockManager(4, 4).prepare([(0, 2)]).meta
    ModelRunner(RecordingModel(), pools).run(plan, StepBlocks(meta, [(1, 3)]))
    assert pools.k[:, 3].eq(1).all() and pools.v[:, 3].eq(2).all() and not pools.k[:, 2].any()
