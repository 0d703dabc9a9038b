"""Grouped-query attention through the engine: a KV cache of n_kv_head heads, sized by them, and
greedy tokens equal to the full forward's (our tiny Llama) and to transformers' `generate`
(a tiny random Llama saved by transformers and loaded with `load_checkpoint`)."""

from __future__ import annotations

from pathlib import Path

import gptserve.kernels.backends as backends
import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.sampler import SamplingParams
from gptserve.kernels.backends import TritonBackend
from gptserve.kernels.paged_kv import KVPools
from gptserve.kernels.triton import available as triton_available
from gptserve.model import GPT, ModelConfig, get_tokenizer, load_checkpoint

GREEDY = dict(temperature=0, ignore_eos=True)
PATHS = ("decode_attention_cpu", "prefill_attention_cpu", "paged_attention_sdpa")  # the CPU's
LLAMA = dict(
    n_layer=2, n_head=6, n_kv_head=2, n_embd=96, pos_encoding="rotary", norm="rmsnorm",
    activation="swiglu", bias=False, tokenizer="gpt2", block_size=256,
)  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


@pytest.fixture(scope="module")
def llama() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**LLAMA)).eval()


def run(engine: Engine) -> dict[str, list[int]]:
    """Step until idle; each request's generated token ids."""
    out: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_work():
            return out
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    raise AssertionError("engine did not finish")


def greedy_reference(model: GPT, prompt: list[int], n: int) -> list[int]:
    """The full forward's argmax loop: no KV cache at all."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt) :].tolist()


def test_the_cache_holds_kv_heads_and_is_sized_by_them(llama: GPT, tok) -> None:
    cache = KVPools.for_model(llama, num_blocks=10, block_size=8)
    assert cache.k.shape == (2, 10, 8, 2, 16)  # (layers, blocks, block_size, n_kv_head, hs)
    assert cache.bytes_per_token == 2 * 2 * 2 * 16 * 4  # k and v, layers, KV heads, hs, fp32
    per_block = 8 * cache.bytes_per_token
    assert KVPools.bytes_per_block(2, 2, 16, 8, torch.float32) == per_block
    config = EngineConfig(kv_block_size=8, max_num_seqs=64, kv_cache_bytes=100 * per_block)
    engine = Engine(llama, tok, config)
    assert engine.blocks.num_blocks == 100  # three times what query-head pools would allow
    assert engine.pools.bytes_per_token == cache.bytes_per_token


def _prompts(tok) -> list[list[int]]:
    """Mixed lengths, two of them continuing the first (prefix caching shares its blocks)."""
    base = tok.encode("To be, or not to be, that is the question: whether 'tis nobler " * 2)
    return [
        base,
        tok.encode("A"),
        tok.encode("ROMEO: But soft, what light through yonder window breaks?"),
        base + tok.encode(" in the mind to suffer"),
        base + tok.encode(" the slings and arrows of outrageous fortune, or to take arms"),
    ]


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "pytorch"])
def test_greedy_decoding_equals_the_full_forward(
    llama: GPT, tok, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """Decodes read in place (the compiled kernel, or PyTorch operations), prefills over a
    cached prefix take the cascade, the others gather + SDPA; small steps chunk the prompts so
    decodes and prefills share steps."""
    if not native:
        monkeypatch.setattr(backends, "paged_decode_op", lambda: None)
    calls = {name: 0 for name in PATHS}
    for name in PATHS:
        path = getattr(backends, name)

        def counted(*args, _path=path, _name=name, **kwargs):
            calls[_name] += 1
            return _path(*args, **kwargs)

        monkeypatch.setattr(backends, name, counted)
    prompts = _prompts(tok)
    engine = Engine(llama, tok, EngineConfig(kv_block_size=8, max_batch_tokens=40))
    engine.add_request("0", prompts[0], SamplingParams(max_tokens=4, **GREEDY))
    run(engine)  # its blocks stay cached for the prompts that continue it
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=32, **GREEDY))
    out = run(engine)
    for i, ids in enumerate(prompts):
        assert out[str(i)] == greedy_reference(llama, ids, 32), f"prompt {i}"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    compiled = native and backends.paged_decode_op() is not None
    assert (calls.pop("decode_attention_cpu") > 0) != compiled, calls
    assert all(calls.values()), calls  # every other CPU path ran


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_greedy_decoding_through_the_triton_paged_kernel(llama: GPT, tok) -> None:
    """The same through the Triton paged kernel (in the interpreter on a CPU): its pools are
    laid out as the CPU backend's, so the engine's cache can take it after it is built."""
    prompts = _prompts(tok)[1:4]
    engine = Engine(llama, tok, EngineConfig(kv_block_size=8))
    engine.pools.backend = TritonBackend()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=8, **GREEDY))
    out = run(engine)
    for i, ids in enumerate(prompts):
        assert out[str(i)] == greedy_reference(llama, ids, 8), f"prompt {i}"


def test_a_transformers_llama_gives_the_tokens_of_its_generate(tmp_path: Path, tok) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert (model.config.n_head, model.config.kv_heads) == (6, 2)

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 23, 1, 40)]
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, max_batch_tokens=48))
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=32, **GREEDY))
    out = run(engine)
    for i, ids in enumerate(prompts):
        prompt = torch.tensor([ids])
        with torch.no_grad():  # every prompt token attended (no pad id guessed from the ids)
            want = reference.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                min_new_tokens=32, do_sample=False, pad_token_id=config.eos_token_id,
            )[0, len(ids) :].tolist()  # fmt: skip
        assert out[str(i)] == want, f"prompt {i}"
