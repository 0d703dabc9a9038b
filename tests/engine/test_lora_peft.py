"""Adapters of PEFT's own making, many in one batch, against PEFT: each row's greedy tokens and
logprobs are those of PEFT's model with that row's adapter (float32: the same tokens; bfloat16:
within rounding), with the base optimized as the server loads it. On an int8 base and a GGUF
file's own bits, where the base is not PEFT's, the oracle is our float adapter math on that
base: each adapted product's output plus scaling * (x @ A.T) @ B.T, by forward hooks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.loader import prepare_for_inference
from gptserve.engine.sampler import SamplingParams
from gptserve.kernels import SdpaGatherBackend
from gptserve.kernels.paged_kv import KVPools
from gptserve.model import GPT, get_tokenizer, load_checkpoint
from gptserve.model.lora.adapter import LoraAdapter
from gptserve.model.lora.batched import install_lora
from gptserve.model.lora.peft_format import read_peft
from gptserve.model.quantize import quantize

from tests.lora_testing import random_adapter
from tests.model.lora.hf_models import VOCAB, make_hf, randomize_lora_b

peft = pytest.importorskip("peft")

N_TOKENS = 5
ROW_ADAPTERS = [None, "a", "b", "c", "a", None, "c", "b"]  # 8 rows: 3 adapters and the base
TARGETS = {
    "gpt2": [["c_attn"], ["c_attn", "c_proj", "c_fc"], ["attn.c_proj", "mlp.c_proj"]],
    "llama": [
        ["q_proj", "v_proj"],
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ["o_proj", "down_proj", "up_proj"],
    ],
}


def _peft_adapters(kind: str, base_dir: Path, tmp: Path) -> dict[str, Path]:
    """Three PEFT adapters on the base at `base_dir`, of other targets, ranks and alphas."""
    import transformers

    dirs = {}
    for i, name in enumerate("abc"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        lora = peft.LoraConfig(
            r=2 + 2 * i, lora_alpha=4 + 4 * i, target_modules=TARGETS[kind][i],
            fan_in_fan_out=kind == "gpt2", use_rslora=i == 2,
        )  # fmt: skip
        model = peft.get_peft_model(hf, lora)
        randomize_lora_b(model, seed=10 + i)
        model.save_pretrained(tmp / name)
        dirs[name] = tmp / name
    return dirs


def _serve(served: GPT, adapters: dict[str, LoraAdapter], sdpa: bool = False) -> Engine:
    bank = install_lora(served, 4, 16)
    engine = Engine(served, get_tokenizer(), EngineConfig(kv_block_size=4), lora=bank)
    if sdpa:  # the gather + SDPA attention instead of the CPU paged one
        pools = KVPools.for_model(served, engine.pools.num_blocks, 4, backend=SdpaGatherBackend())
        engine.pools = engine.runner.pools = pools
    for name, adapter in adapters.items():
        engine.adapters.load(name, adapter)
    return engine


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, VOCAB, (3 + i % 4,), generator=g).tolist() for i in range(n)]


def _run_mixed(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Every prompt with its row's adapter, all at once: each one's tokens and logprobs."""
    for i, (ids, name) in enumerate(zip(prompts, ROW_ADAPTERS)):
        params = SamplingParams(
            max_tokens=N_TOKENS, temperature=0, ignore_eos=True, logprobs=0, lora=name
        )
        engine.add_request(str(i), ids, params)
    out: dict[str, list] = {}
    for _ in range(200):
        if not engine.has_work():
            break
        for ev in engine.step():
            assert ev.error is None, ev.error
            out.setdefault(ev.request_id, []).append(ev)
    results = []
    for i in range(len(prompts)):
        events = out[str(i)]
        results.append(
            (
                [t for ev in events for t in ev.token_ids],
                [lp.logprob for ev in events for lp in ev.logprobs],
            )
        )
    return results


@torch.no_grad()
def _teacher_forced(forward, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The oracle's log-probabilities (len(tokens), V) at each generated position."""
    ids = torch.tensor([prompt + tokens[:-1]])
    logits = forward(ids)[0, len(prompt) - 1 :].float()  # (len(tokens), V)
    return torch.log_softmax(logits, -1)


def _check_within(results, prompts, oracles, tol: float) -> None:
    """Each row's tokens are its oracle's greedy choice to within `tol` of the best logprob,
    and its logprobs are the oracle's to within `tol` (teacher-forced on the row's tokens)."""
    for (tokens, lps), ids, name in zip(results, prompts, ROW_ADAPTERS):
        want = _teacher_forced(oracles[name], ids, tokens)  # (N_TOKENS, V)
        chosen = want[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert (chosen >= want.max(-1).values - tol).all(), name
        assert lps == pytest.approx(chosen.tolist(), abs=tol), name


@pytest.mark.parametrize(
    ("kind", "sdpa"),
    [("gpt2", False), ("llama", False), ("llama", True)],
    ids=["gpt2-cpu-paged", "llama-cpu-paged", "llama-sdpa"],
)
def test_a_mixed_batch_is_pefts_each_row(kind: str, sdpa: bool, tmp_path: Path) -> None:
    make_hf(kind, tmp_path / "base")
    dirs = _peft_adapters(kind, tmp_path / "base", tmp_path)
    served = prepare_for_inference(load_checkpoint(tmp_path / "base"))
    adapters = {n: read_peft(d, served.config) for n, d in dirs.items()}
    prompts = _prompts(len(ROW_ADAPTERS))
    results = _run_mixed(_serve(served, adapters, sdpa), prompts)
    import transformers

    oracles = {None: transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()}
    for name, d in dirs.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        oracles[name] = peft.PeftModel.from_pretrained(hf, d).eval()
    changed = 0
    for (tokens, lps), ids, name in zip(results, prompts, ROW_ADAPTERS):
        want, want_lps, seq = [], [], list(ids)
        with torch.no_grad():
            for _ in range(N_TOKENS):  # PEFT's greedy tokens, one full forward each
                logprobs = torch.log_softmax(oracles[name](torch.tensor([seq])).logits[0, -1], -1)
                want.append(int(logprobs.argmax()))
                want_lps.append(float(logprobs.max()))
                seq.append(want[-1])
        assert tokens == want, name
        assert lps == pytest.approx(want_lps, abs=1e-4), name
        base = _teacher_forced(lambda x: oracles[None](x).logits, ids, tokens)
        changed += name is not None and not torch.allclose(base.max(-1).values, torch.tensor(lps))
    assert changed >= 5  # the adapters move every adapter row's logprobs


def test_a_mixed_batch_on_a_bfloat16_base_is_pefts_within_rounding(tmp_path: Path) -> None:
    import transformers

    make_hf("llama", tmp_path / "base")
    dirs = _peft_adapters("llama", tmp_path / "base", tmp_path)
    base = load_checkpoint(tmp_path / "base", dtype=torch.bfloat16)
    served = prepare_for_inference(base)
    adapters = {n: read_peft(d, served.config) for n, d in dirs.items()}
    prompts = _prompts(len(ROW_ADAPTERS))
    results = _run_mixed(_serve(served, adapters), prompts)

    def hf_bf16() -> torch.nn.Module:
        path = tmp_path / "base"
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)

    models = {None: hf_bf16().eval()}
    for name, d in dirs.items():
        models[name] = peft.PeftModel.from_pretrained(hf_bf16(), d).eval()
    oracles = {name: (lambda x, m=m: m(x).logits) for name, m in models.items()}
    _check_within(results, prompts, oracles, tol=0.05)


def _hooked(model: GPT, adapter: LoraAdapter | None):
    """`model`'s full forward with `adapter`'s update added to each adapted product's output
    in float32 (forward hooks); the oracle of our adapter math on a base of any kind."""

    def hook_for(pieces):
        def hook(module, inputs, out):
            x = inputs[0].float()
            out = out.clone()
            for p in pieces:
                delta = adapter.scaling * (x @ p.a.float().T) @ p.b.float().T  # (..., rows)
                out[..., p.offset : p.offset + p.rows] += delta.to(out.dtype)
            return out

        return hook

    def forward(ids: torch.Tensor) -> torch.Tensor:
        handles = []
        if adapter is not None:
            for name, pieces in adapter.pieces.items():
                module = model.get_submodule(name)
                handles.append(module.register_forward_hook(hook_for(pieces)))
        try:
            return model(ids)
        finally:
            for h in handles:
                h.remove()

    return forward


def test_a_mixed_batch_on_an_int8_base_is_our_float_math_on_it(tmp_path: Path) -> None:
    make_hf("llama", tmp_path / "base")
    dirs = _peft_adapters("llama", tmp_path / "base", tmp_path)
    served = prepare_for_inference(load_checkpoint(tmp_path / "base"), "int8")
    adapters = {n: read_peft(d, served.config) for n, d in dirs.items()}
    prompts = _prompts(len(ROW_ADAPTERS))
    results = _run_mixed(_serve(served, adapters), prompts)
    reference = quantize(load_checkpoint(tmp_path / "base"), "int8").eval()  # no CPU wing
    oracles = {n: _hooked(reference, adapters.get(n)) for n in (None, *adapters)}
    _check_within(results, prompts, oracles, tol=0.02)


def test_a_mixed_batch_on_a_gguf_base_is_our_float_math_on_it(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from tests.model.gguf.test_gguf import write_gguf

    path = tmp_path / "llama-q4.gguf"
    write_gguf(path, "llama", "Q4_0")
    served = prepare_for_inference(load_checkpoint(path, low_bit=True))
    adapters = {n: random_adapter(served.config, n, seed=i) for i, n in enumerate("abc")}
    prompts = _prompts(len(ROW_ADAPTERS))
    results = _run_mixed(_serve(served, adapters), prompts)
    reference = load_checkpoint(path, low_bit=True).eval()  # no CPU wing
    oracles = {n: _hooked(reference, adapters.get(n)) for n in (None, *adapters)}
    _check_within(results, prompts, oracles, tol=0.02)
