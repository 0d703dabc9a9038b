"""Embedding requests through the engine: prefilled in chunks alongside a generating request, pooled
from the final hidden states after the final norm, equal to transformers' `hidden_states[-1]`
pooled the same way and normalized (a tiny random Llama and Qwen3 saved by transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gptserve.engine.block_manager import BlockManager
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.errors import RequestError
from gptserve.engine.loader import load_for_inference
from gptserve.engine.pooling import EmbeddingSpec, PoolingParams
from gptserve.engine.sampler import SamplingParams
from gptserve.engine.scheduler import Scheduler
from gptserve.engine.sequence import Sequence
from gptserve.engine.step_plan import StepKind
from gptserve.model import get_tokenizer

from tests.model.test_hf_llama import VOCAB, make
from tests.server.test_hf_models_served import save_word_tokenizer

transformers = pytest.importorskip("transformers")

LENGTHS = (1, 5, 31, 33, 70, 100)  # some longer than max_batch_tokens: chunked
GEN_TOKENS = 12


def reference(model, prompt: list[int], mode: str) -> torch.Tensor:  # noqa: ANN001
    """transformers' final hidden states (after the final norm), pooled and normalized."""
    with torch.no_grad():
        h = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    return F.normalize(h[-1] if mode == "last" else h.mean(0), dim=-1)


def greedy(model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def run(engine: Engine) -> dict[str, list]:
    events: dict[str, list] = {}
    for _ in range(10_000):
        if not engine.has_work():
            return events
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(ev)
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module", params=["llama-gqa-untied", "qwen3-qknorm-headdim"])
def served(request, tmp_path_factory):  # noqa: ANN001, ANN201
    path = tmp_path_factory.mktemp(request.param)
    ref = make(request.param, path)
    save_word_tokenizer(path)
    loaded = load_for_inference(path, device="cpu")
    return ref, loaded


def test_pooled_vectors_equal_transformers_and_share_steps_with_generation(served) -> None:  # noqa: ANN001
    ref, loaded = served
    config = EngineConfig(max_num_seqs=8, max_batch_tokens=32, kv_block_size=16)
    engine = Engine(loaded.model, loaded.tokenizer, config)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    gen_prompt = prompts[3][:20]  # shares a prefix with an embedding: no reuse for that one
    engine.add_request("gen", gen_prompt, SamplingParams(temperature=0, ignore_eos=True,
                                                         max_tokens=GEN_TOKENS))  # fmt: skip
    for i, prompt in enumerate(prompts):
        for mode in ("last", "mean"):
            params = SamplingParams(max_tokens=0, pooling=PoolingParams(mode))
            engine.add_request(f"{mode}-{i}", prompt, params)
    steps_with_both = 0
    events: dict[str, list] = {}
    while engine.has_work():
        step = engine.step()
        ids = {e.request_id for e in step}
        steps_with_both += "gen" in ids and any(r != "gen" for r in ids)
        for ev in step:
            events.setdefault(ev.request_id, []).append(ev)
    assert steps_with_both >= 1  # an embedding finished in a step that also drew a token
    assert [t for e in events["gen"] for t in e.token_ids] == greedy(ref, gen_prompt, GEN_TOKENS)
    for i, prompt in enumerate(prompts):
        for mode in ("last", "mean"):
            (event,) = events[f"{mode}-{i}"]  # one event, which ends it
            assert event.finish_reason == "stop" and event.error is None
            assert event.token_ids == [] and event.num_cached_tokens == 0
            assert event.num_prompt_tokens == len(prompt)
            got = torch.tensor(event.embedding)
            assert got.shape == (loaded.model.config.n_embd,)
            want = reference(ref, prompt, mode)
            assert (got - want).abs().max().item() < 1e-5, (mode, len(prompt))
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.num_running == 0 and not engine._requests


def test_mean_pooling_starts_over_after_a_preemption(served) -> None:  # noqa: ANN001
    """A pool too small for everyone: sequences are preempted and recomputed, and a mean-pooled
    embedding cut short by that still sums each position once."""
    ref, loaded = served
    config = EngineConfig(max_num_seqs=8, max_batch_tokens=16, kv_block_size=4, num_blocks=40)
    engine = Engine(loaded.model, loaded.tokenizer, config)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (60, 40, 30)]
    for i, prompt in enumerate(prompts[:2]):
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=60)
        engine.add_request(f"gen-{i}", prompt[:30], params)
    engine.add_request("emb", prompts[2] * 2, SamplingParams(max_tokens=0,
                                                             pooling=PoolingParams("mean")))  # fmt: skip
    events = run(engine)
    assert engine.num_preemptions >= 1
    (event,) = events["emb"]
    want = reference(ref, prompts[2] * 2, "mean")
    assert (torch.tensor(event.embedding) - want).abs().max().item() < 1e-5


def test_matryoshka_dimensions_cut_before_normalizing() -> None:
    pooled = torch.tensor([3.0, 4.0, 12.0])
    assert PoolingParams("last", 2).finish(pooled, 1) == pytest.approx([0.6, 0.8])
    assert PoolingParams("mean").finish(pooled, 2) == pytest.approx([3 / 13, 4 / 13, 12 / 13])


def test_an_embedding_samples_nothing() -> None:
    with pytest.raises(RequestError) as err:
        SamplingParams(max_tokens=4, pooling=PoolingParams("last")).validate()
    assert err.value.param == "max_tokens"
    with pytest.raises(ValueError):
        PoolingParams("cls")


def test_the_checkpoint_names_its_pooling_and_matryoshka_widths(tmp_path: Path) -> None:
    assert EmbeddingSpec.read(tmp_path, 64) == EmbeddingSpec("last", 64, False)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        '{"pooling_mode_mean_tokens": true, "pooling_mode_lasttoken": false}'
    )
    (tmp_path / "config.json").write_text('{"matryoshka_dimensions": [32, 64]}')
    spec = EmbeddingSpec.read(tmp_path, 64)
    assert spec.pooling == "mean" and spec.allows(32) and not spec.allows(16)
    assert EmbeddingSpec.read(tmp_path, 64, pooling="last").pooling == "last"
    (tmp_path / "config.json").write_text('{"is_matryoshka": true}')
    assert EmbeddingSpec.read(tmp_path, 64).allows(16)
    assert not EmbeddingSpec("last", 64, False).allows(32)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    assert EmbeddingSpec.read(gguf, 64) == EmbeddingSpec("last", 64, False)


def test_the_plan_gives_embeddings_hidden_rows_and_no_logits_rows() -> None:
    """Packed order: a decode, a mean-pooled chunk that ends inside its prompt, a last-pooled
    chunk that ends its prompt. Hidden rows: every position of the mean one's chunk, the last
    one's last token; logits rows: the decode's only. Neither embedding reuses a cached prefix."""
    tok = get_tokenizer()
    blocks = BlockManager(64, 4, torch.device("cpu"))
    scheduler = Scheduler(blocks, max_num_seqs=4, max_batch_tokens=12)
    gen = Sequence(0, "gen", 0, list(range(1, 9)), SamplingParams(max_tokens=4), tok)
    scheduler.add(gen)
    plan = scheduler.schedule()
    blocks.prepare([(p.seq.seq_id, p.num_tokens) for p in plan.scheduled])
    gen.num_cached = 8
    blocks.register_full_blocks(gen.seq_id, gen.token_ids, None)
    gen.token_ids.append(50)  # decoding from now on
    emb = dict(max_tokens=0)
    mean = Sequence(1, "mean", 0, list(range(1, 17)), SamplingParams(**emb, pooling=PoolingParams("mean")), tok)  # fmt: skip
    last = Sequence(2, "last", 0, list(range(1, 5)), SamplingParams(**emb, pooling=PoolingParams("last")), tok)  # fmt: skip
    scheduler.add(mean)
    scheduler.add(last)
    plan = scheduler.schedule()
    assert [(p.seq.request_id, p.kind, p.num_tokens) for p in plan.scheduled] == [
        ("gen", StepKind.DECODE, 1), ("mean", StepKind.PREFILL, 11),
    ]  # fmt: skip
    assert mean.num_cached == 0  # its prompt starts like gen's, but it reuses nothing
    assert plan.logits_positions == [0]
    assert plan.hidden_positions == list(range(1, 12))
    part = plan.scheduled[1]
    assert part.num_rows == 0 and not part.pools and part.hidden_rows == slice(0, 11)
    blocks.prepare([(p.seq.seq_id, p.num_tokens) for p in plan.scheduled])
    gen.num_cached += 1
    gen.token_ids.append(51)
    mean.num_cached = 11
    plan = scheduler.schedule()
    assert [(p.seq.request_id, p.num_tokens, p.pools) for p in plan.scheduled] == [
        ("gen", 1, False), ("mean", 5, True), ("last", 4, True),
    ]  # fmt: skip
    assert plan.logits_positions == [0]
    assert plan.hidden_positions == [1, 2, 3, 4, 5, 9]  # mean's five, last's last
    assert plan.scheduled[2].hidden_rows == slice(5, 6)
