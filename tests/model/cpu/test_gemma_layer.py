"""A Gemma 3 layer's decode step as one compiled call (`model.cpu.gemma_layer`): installed where
a layer fits (int4 products as a GGUF file's, or float32 tiles), the Engine's tokens and
logprobs the modules' path's to the bit (windowed layers, the query norm's scale and LoRA
adapter rows included), a checkpoint saved by transformers decoding transformers' greedy tokens
through it, and every step or layer it does not suit left to the modules."""

from pathlib import Path

import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.loader import load_for_inference
from gptserve.engine.sampler import SamplingParams
from gptserve.kernels.cpu import native
from gptserve.model import GPT, get_tokenizer
from gptserve.model.config import ModelConfig
from gptserve.model.cpu import optimize_for_cpu
from gptserve.model.cpu.few_rows_linear import LAYER_FEW_ROWS, compiled_tiles
from gptserve.model.cpu.gemma_layer import FusedGemmaBlock
from gptserve.model.cpu.llama_layer import FLOAT_TILES
from gptserve.model.gpt import Block, SandwichBlock

from tests.model.cpu.engine_runs import decode_together, with_adapters
from tests.model.cpu.test_llama_layer import _int4

OPS = native.native_ops() if native.enabled() else None
pytestmark = pytest.mark.skipif(not compiled_tiles(OPS), reason="no compiled CPU kernels")
VOCAB = 96


def _gemma(
    int4: bool, window: int | None = None, dtype: torch.dtype = torch.float32,
    batch_invariant: bool = False,
) -> GPT:  # fmt: skip
    """Two Gemma 3 layers (a sliding one, then a global one), heads 24 wide with a query scale
    of sqrt(24 / 40), norms around 1 + 0, optimized for the CPU."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, block_size=128, n_layer=2, n_head=4, n_embd=64,
                         n_kv_head=2, head_size=24, intermediate_size=96, bias=False,
                         qk_norm=True, pos_encoding="rotary", norm="gemma_rmsnorm",
                         sandwich_norm=True, activation="geglu", layer_norm_eps=1e-6,
                         rope_theta=100_000.0, rope_local_theta=10_000.0,
                         sliding_window=window or 128,
                         layer_types=["sliding_attention", "full_attention"], embed_scale=8.0,
                         query_pre_attn_scalar=40, logit_softcap=30.0, tokenizer="gpt2",
                         )  # fmt: skip
    model = GPT(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # (1 + w) with w far from 0: a norm taken as w would show
                p.copy_(0.3 * torch.randn_like(p))
    if int4:  # every product int4, as a GGUF file's Q4 layers
        for block in model.transformer.h:
            attn, mlp = block.attn, block.mlp
            attn.c_attn, attn.c_proj = _int4(attn.c_attn), _int4(attn.c_proj)
            mlp.c_fc, mlp.c_proj = _int4(mlp.c_fc), _int4(mlp.c_proj)
    return optimize_for_cpu(model.to(dtype), threads=2, batch_invariant=batch_invariant)


def _count_calls(model: GPT) -> list[int]:
    """Each one-call step's row count, recorded as the layers' calls run."""
    calls: list[int] = []
    op = model.transformer.h[0].op
    for block in model.transformer.h:
        block.op = lambda *args, _op=op: calls.append(args[0].shape[0]) or _op(*args)
    return calls


@pytest.mark.parametrize(
    "int4, window",
    [(True, None), (False, None), (True, 6), (False, 6)],
    ids=["int4", "float32-tiles", "int4-window-6", "float32-window-6"],
)  # fmt: skip
@pytest.mark.parametrize("n_seq", [1, 3, LAYER_FEW_ROWS + 2])  # the last: more than few rows
def test_the_engine_decodes_the_modules_paths_bits(monkeypatch, int4, window, n_seq):
    model = _gemma(int4, window)
    assert all(type(b) is FusedGemmaBlock for b in model.transformer.h)
    calls = _count_calls(model)
    fused = decode_together(model, n_seq, VOCAB)
    assert calls  # it ran: float32 tiles only for steps of few rows, int4 for any
    assert max(calls) <= (LAYER_FEW_ROWS if not int4 else n_seq)
    if int4 and n_seq > LAYER_FEW_ROWS:
        assert max(calls) == n_seq
    monkeypatch.setattr(FusedGemmaBlock, "forward_cached", Block.forward_cached)
    modules = decode_together(model, n_seq, VOCAB)  # SandwichBlock's own residuals
    assert modules == fused  # tokens and logprobs, exactly


def test_decoded_logprobs_are_an_uncached_forwards_within_rounding():
    """Tokens decoded through the calls past a window of 6: greedy tokens and logprobs those of
    the modules' uncached forward of the whole sequence (no cache, no calls) within float32
    rounding."""
    model = _gemma(int4=False, window=6)
    calls = _count_calls(model)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = Engine(model, get_tokenizer(), EngineConfig(max_num_seqs=1, kv_block_size=8))
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   logprobs=1))  # fmt: skip
    tokens, logprobs = [], []
    while engine.has_work():
        for ev in engine.step():
            tokens.extend(ev.token_ids)
            logprobs.extend(lp.logprob for lp in ev.logprobs)
    assert len(calls) == 2 * 5  # two layers, each decode step after the prefill's token
    with torch.no_grad():
        full = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1].log_softmax(-1)
    assert full.argmax(-1).tolist() == tokens
    expected = full.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("int4", [True, False], ids=["int4", "float32-tiles"])
def test_steps_with_lora_rows_decode_the_modules_paths_bits(monkeypatch, int4):
    model = _gemma(int4)
    bank, adapters, updates = with_adapters(model)  # updates: each call's lora_meta
    n_seq = 6  # requests of a, b, c, the base, a, b (fewer as requests end)
    fused = decode_together(model, n_seq, VOCAB, bank, adapters)
    assert any(meta for meta in updates)  # the call took steps with adapter rows
    monkeypatch.setattr(FusedGemmaBlock, "forward_cached", Block.forward_cached)
    assert decode_together(model, n_seq, VOCAB, bank, adapters) == fused  # exactly
    base = decode_together(model, n_seq, VOCAB, bank, [])
    assert any(fused[1][str(i)] != base[1][str(i)] for i in range(n_seq) if i % 4 != 3)


def test_a_transformers_checkpoint_decodes_transformers_greedy_tokens_through_the_call(
    tmp_path: Path,
) -> None:
    """A random Gemma 3 saved by transformers (4 layers, windows of 8 on every other, a query
    scale, soft-capped logits), loaded as the server loads it: every layer one call, which
    decodes transformers' float32 greedy tokens and logprobs for a batch past the window."""
    pytest.importorskip("transformers")
    from tests.engine.test_gemma_phi3_engine import reference
    from tests.model.test_hf_gemma_phi3 import VOCAB as HF_VOCAB
    from tests.model.test_hf_gemma_phi3 import make
    from tests.server.test_hf_models_served import save_word_tokenizer

    ref = make("gemma3", tmp_path, sliding_window=8)
    save_word_tokenizer(tmp_path)
    loaded = load_for_inference(tmp_path, device="cpu")
    assert all(type(b) is FusedGemmaBlock for b in loaded.model.transformer.h)
    calls = _count_calls(loaded.model)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, HF_VOCAB, (n,), generator=gen).tolist() for n in (4, 13, 21)]
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(kv_block_size=8))
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
        engine.add_request(str(i), ids, params)
    got: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_work():
        for ev in engine.step():
            tokens, lps = got.setdefault(ev.request_id, ([], []))
            tokens.extend(ev.token_ids)
            lps.extend(lp.logprob for lp in ev.logprobs)
    assert len(calls) >= 4 * 9 and max(calls) == len(prompts)  # the batch's steps, every layer
    for i, ids in enumerate(prompts):
        tokens, lps = reference(ref, ids)
        assert got[str(i)][0] == tokens[:10]
        assert max(abs(a - b) for a, b in zip(got[str(i)][1], lps)) < 1e-3


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_a_gguf_file_at_its_own_bits_decodes_the_modules_paths_bits(monkeypatch, kind, tmp_path):
    """A Gemma 3 GGUF file of Q4_0 or Q8_0 layers as the server loads it: int4 products, every
    layer one call, for a batch past its window of 8."""
    pytest.importorskip("gguf")
    from tests.model.gguf.test_gguf_gemma3 import write_gemma3_gguf

    write_gemma3_gguf(tmp_path / "gemma3.gguf", kind)
    model = load_for_inference(tmp_path / "gemma3.gguf", device="cpu").model
    assert all(type(b) is FusedGemmaBlock for b in model.transformer.h)
    assert all(FLOAT_TILES not in b.kinds for b in model.transformer.h)  # int4 groups
    calls = _count_calls(model)
    vocab = model.config.vocab_size
    fused = decode_together(model, 4, vocab)
    assert max(calls) == 4
    monkeypatch.setattr(FusedGemmaBlock, "forward_cached", Block.forward_cached)
    assert decode_together(model, 4, vocab) == fused  # tokens and logprobs, exactly


def test_layers_and_models_that_do_not_fit_keep_their_block():
    assert all(type(b) is FusedGemmaBlock for b in _gemma(int4=False).transformer.h)
    bf16 = _gemma(int4=False, dtype=torch.bfloat16)  # no float32 norms or tiles
    assert all(type(b) is SandwichBlock for b in bf16.transformer.h)
    invariant = _gemma(int4=False, batch_invariant=True)
    assert all(type(b) is SandwichBlock for b in invariant.transformer.h)  # oneDNN's products
    int4_invariant = _gemma(int4=True, batch_invariant=True)  # a row's product alike in any batch
    assert all(type(b) is FusedGemmaBlock for b in int4_invariant.transformer.h)


def test_the_op_refuses_a_layer_of_another_shape():
    block = _gemma(int4=True).transformer.h[0]
    x = torch.randn(1, 64)
    pools = torch.zeros(2, 16, 2, 16)  # heads of 16, not 24
    slot = torch.zeros(1, dtype=torch.long)
    rot = torch.ones(1, 16)
    step = (pools, pools.clone(), slot, slot.clone(), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32))  # fmt: skip
    with pytest.raises(RuntimeError, match="a Gemma layer"):
        block.op(x, block.norms, block.eps, block.q_scale, block.kinds, block.weights,
                 block.tables, block.biases, block.widths, block.copies, rot, rot, *step,
                 block.n_head, 0, [], [])  # fmt: skip
    with pytest.raises(RuntimeError, match="norms: ln_1's"):
        block.op(x, block.norms[:2], block.eps, block.q_scale, block.kinds, block.weights,
                 block.tables, block.biases, block.widths, block.copies, rot, rot, *step,
                 block.n_head, 0, [], [])  # fmt: skip
