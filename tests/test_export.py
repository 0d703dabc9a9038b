"""`gptserve export`: a model with its LoRA adapter merged, as a GGUF file that gptserve serves
like the merged model and llama.cpp loads.

Two bases: the bundled Shakespeare model (train.py's GPT-2 shape, GPT-2's tokenizer, the plain
chat template) with a random adapter of ours, and a tiny random Llama built with transformers
(a byte-level BPE of its own, a Jinja chat template, untied head) with a PEFT adapter, whose
oracle is transformers with PEFT's merge. Each file is loaded back as `gptserve serve` loads it
(`load_for_inference`: a GGUF file at its own bits on a CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gptserve.engine.loader import load_for_inference
from gptserve.model import SHAKESPEARE_DIR, load_checkpoint
from gptserve.model.gguf.checkpoint import read_metadata
from gptserve.model.lora.peft_format import read_peft, write_peft
from gptserve.model.tokenizers import load_tokenizer
from gptserve.server.chat.templates import load_chat_format

from gptserve.export import main as export_main
from tests.conftest import byte_level_bpe
from tests.llamacpp_testing import llamacpp_greedy, llamacpp_reason
from tests.lora_testing import merged, random_adapter
from tests.model.lora.hf_models import randomize_lora_b

FORMATS = ("f32", "f16", "q8_0")
# How far a served file's logits may be from the merged float model's, as a fraction of the
# largest logit's magnitude over the sequence: f16 rounds each weight to 11 bits, q8_0 to 8 bits
# in blocks of 32. Measured: f32 1e-6 and 4e-7 (Shakespeare, tiny Llama), f16 1.4e-4 and 9.5e-4,
# q8_0 1.5e-2 and 3.0e-2 (the file's dequantized weights alone give the tiny Llama 2.9e-2).
TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "q8_0": 6e-2}
NEW_TOKENS = 12
CHAT = [
    {"role": "system", "content": "Speak in verse."},
    {"role": "user", "content": "Who goes there?"},
    {"role": "assistant", "content": " A friend."},
    {"role": "user", "content": "Then stand, and unfold yourself."},
]
LLAMA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Case:
    """A base model, an adapter on it, the merged oracle and a prompt."""

    def __init__(self, model: str, adapter: Path, oracle, prompt: list[int]) -> None:  # noqa: ANN001
        self.model, self.adapter, self.oracle, self.prompt = model, adapter, oracle, prompt

    def export(self, out: Path, fmt: str) -> Path:
        if not out.is_file():
            argv = ["--model", self.model, "--lora", str(self.adapter), "--out", str(out)]
            assert export_main([*argv, "--type", fmt]) == 0
        return out


@torch.no_grad()
def greedy(logits_of, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    """`n` greedy tokens by full forwards; `logits_of(ids (1, T))` -> (1, T, V)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(logits_of(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory: pytest.TempPathFactory) -> Case:
    base = load_checkpoint(SHAKESPEARE_DIR)
    adapter_dir = tmp_path_factory.mktemp("export") / "shakespeare-lora"
    write_peft(random_adapter(base.config, "lora", std=0.08), adapter_dir, base.config, "gpt2")
    oracle = merged(base, read_peft(adapter_dir, base.config))
    prompt = load_tokenizer("gpt2").encode("ROMEO:\nBut soft, what light")
    return Case("shakespeare", adapter_dir, oracle, prompt)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, shakespeare_path: Path) -> Case:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("export-llama")
    corpus = shakespeare_path.read_text(encoding="utf-8")[:100_000]
    tok = byte_level_bpe([corpus[i : i + 1000] for i in range(0, len(corpus), 1000)], 320,
                         ["<|im_start|>", "<|im_end|>"])  # fmt: skip
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.1,
        eos_token_id=tok.token_to_id("<|im_end|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    base_dir = root / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(base_dir)
    tok.save(str(base_dir / "tokenizer.json"))
    tok_config = {"eos_token": "<|im_end|>", "chat_template": LLAMA_TEMPLATE}
    (base_dir / "tokenizer_config.json").write_text(json.dumps(tok_config))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = transformers.LlamaForCausalLM.from_pretrained(base_dir).eval()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    randomize_lora_b(model)
    model.save_pretrained(root / "adapter")
    oracle = model.merge_and_unload().eval()
    prompt = tok.encode("ROMEO:\nBut soft, what light").ids
    return Case(str(base_dir), root / "adapter", lambda ids: oracle(ids).logits, prompt)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-files")


@pytest.fixture(params=["shakespeare", "llama"])
def case(request: pytest.FixtureRequest) -> Case:
    return request.getfixturevalue(request.param)


def served_logits(path: Path):  # noqa: ANN201
    model = load_for_inference(path, device="cpu", dtype="float32").model
    return lambda ids: model(ids).float()


def test_f32_file_serves_the_merged_models_greedy_tokens(case: Case, files: Path) -> None:
    path = case.export(files / f"{Path(case.model).name}-f32.gguf", "f32")
    want = greedy(case.oracle, case.prompt, NEW_TOKENS)
    assert greedy(served_logits(path), case.prompt, NEW_TOKENS) == want
    # the adapter changed them: the test would catch a merge left out
    base = load_checkpoint(SHAKESPEARE_DIR if case.model == "shakespeare" else case.model)
    assert greedy(base, case.prompt, NEW_TOKENS) != want


@pytest.mark.parametrize("fmt", FORMATS)
def test_served_logits_are_the_merged_models_within_the_formats_tolerance(
    case: Case, fmt: str, files: Path
) -> None:
    path = case.export(files / f"{Path(case.model).name}-{fmt}.gguf", fmt)
    ids = torch.tensor([case.prompt + greedy(case.oracle, case.prompt, NEW_TOKENS)])
    with torch.no_grad():
        want = case.oracle(ids).float()  # (1, T, V)
        got = served_logits(path)(ids)
    error = float((got - want).abs().max() / want.abs().max())
    assert error <= TOLERANCE[fmt], f"{fmt}: largest error {error:.2e} of the largest logit"


@pytest.mark.parametrize("fmt", ("f16", "q8_0"))
def test_shakespeare_greedy_text_survives_f16_and_q8_0(
    shakespeare: Case, fmt: str, files: Path
) -> None:
    path = shakespeare.export(files / f"shakespeare-{fmt}.gguf", fmt)
    n = 6  # a short answer: the 16M model's top two logits are close further on
    want = greedy(shakespeare.oracle, shakespeare.prompt, n)
    assert greedy(served_logits(path), shakespeare.prompt, n) == want


def test_file_sizes_follow_the_format(shakespeare: Case, files: Path) -> None:
    sizes = {f: shakespeare.export(files / f"shakespeare-{f}.gguf", f).stat().st_size
             for f in FORMATS}  # fmt: skip
    assert sizes["q8_0"] < 0.6 * sizes["f16"] < 0.6 * sizes["f32"]


def test_metadata_holds_the_tokenizer_and_the_chat_template(case: Case, files: Path) -> None:
    path = case.export(files / f"{Path(case.model).name}-f32.gguf", "f32")
    meta = read_metadata(path)
    source_path = SHAKESPEARE_DIR if case.model == "shakespeare" else Path(case.model)
    source = load_tokenizer(load_checkpoint(source_path).config.tokenizer, source_path)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"]) == load_checkpoint(path).config.vocab_size
    assert meta["tokenizer.ggml.merges"] and meta["tokenizer.chat_template"]
    assert meta["tokenizer.ggml.eos_token_id"] == source.eot_token
    rebuilt = load_tokenizer("gguf", path)
    text = "ROMEO:\nBut soft! 1234 what light through yonder window breaks?\n\n  <|im_end|>"
    assert rebuilt.encode(text) == source.encode(text)
    assert rebuilt.decode(source.encode(text)) == text
    # the chat template renders the prompt the source is served with
    want = load_chat_format(source_path, source).render_messages(CHAT)
    assert load_chat_format(path, rebuilt).render_messages(CHAT) == want


def test_a_gguf_base_merges_on_its_dequantized_weights(llama: Case, files: Path) -> None:
    """A Q8_0 file as the base: the adapter is added to its float32 dequantization, and its
    tokenizer and template are copied."""
    base = files / "base-q8_0.gguf"
    argv = ["--model", llama.model, "--out", str(base), "--type", "q8_0"]
    assert export_main(argv) == 0
    out = Case(str(base), llama.adapter, None, llama.prompt).export(files / "again.gguf", "f32")
    float_base = load_checkpoint(base)
    oracle = merged(float_base, read_peft(llama.adapter, float_base.config))
    with torch.no_grad():
        ids = torch.tensor([llama.prompt])
        np.testing.assert_allclose(served_logits(out)(ids).numpy(), oracle(ids).numpy(), atol=1e-4)
    before, after = read_metadata(base), read_metadata(out)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template",
                "tokenizer.ggml.token_type", "tokenizer.ggml.eos_token_id"):  # fmt: skip
        assert after[key] == before[key]


@pytest.mark.skipif(llamacpp_reason() is not None, reason=str(llamacpp_reason()))
def test_llamacpp_loads_the_f32_file_and_gives_the_same_greedy_tokens(
    case: Case, files: Path
) -> None:
    path = case.export(files / f"{Path(case.model).name}-f32.gguf", "f32")
    ours = greedy(served_logits(path), case.prompt, NEW_TOKENS)
    theirs = llamacpp_greedy(path, case.prompt, NEW_TOKENS)
    assert theirs == ours[: len(theirs)] and len(theirs) >= 4, (theirs, ours)
    if len(theirs) < NEW_TOKENS:  # llama.cpp stopped at an end-of-generation token
        specials = load_tokenizer("gguf", path).special_token_ids
        assert ours[len(theirs)] in specials


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = export_main(argv)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "change, message",
    [
        (["--type", "q4_k"], "unknown --type 'q4_k'"),
        (["--lora", "no/such/adapter"], "no adapter directory"),
        (["--out", "model.bin"], "must end in .gguf"),
        (["--model", "no/such/model"], "does not exist"),
    ],
)
def test_bad_input_is_one_line(
    change: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = {"--model": "shakespeare", "--out": str(tmp_path / "x.gguf"), "--type": "f16"}
    argv.update(dict(zip(change[::2], change[1::2])))
    code, err = run_cli([a for kv in argv.items() for a in kv], capsys)
    assert code == 2 and message in err, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x.gguf").exists()


def test_an_adapter_of_another_base_is_one_line(
    llama: Case, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = [
        "--model",
        "shakespeare",
        "--lora",
        str(llama.adapter),
        "--out",
        str(tmp_path / "x.gguf"),
    ]
    code, err = run_cli(argv, capsys)
    assert code == 2 and "GPT-2-shaped" in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.gguf").exists()
