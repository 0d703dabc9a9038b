"""train.py --lora-rank: an adapter trained on a frozen base, written in PEFT's format.

The oracle is peft itself: the adapter a run writes is loaded by PeftModel.from_pretrained onto
the transformers model of the base, and its logits must be ours (the base loaded by
load_checkpoint, the adapter read by read_peft and merged in). --merge's checkpoint must give
the same logits; --resume must continue the run exactly; bad flags are one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gptserve.model import load_checkpoint
from gptserve.model.lora.merge import merge_into
from gptserve.model.lora.peft_format import read_peft
from gptserve.training import cli as train
from gptserve.training.checkpointing import BEST_DIR, MERGED_DIR, STATE_FILE, TOKENIZER_FILES
from safetensors.torch import load_file
from tokenizers import processors

from tests.conftest import byte_level_bpe
from tests.model.lora.hf_models import make_hf
from tests.train.conftest import metric_rows

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

FAST = ["--max-steps", "6", "--eval-interval", "3", "--eval-iters", "1", "--batch-size", "4",
        "--block-size", "32", "--sample-tokens", "0", "--log-interval", "1", "--lr", "1e-2",
        "--warmup-steps", "0"]  # fmt: skip
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


@pytest.fixture(scope="module")
def text(shakespeare_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "slice.txt"
    path.write_text(shakespeare_path.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def gpt2_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Hugging Face GPT-2 directory (GPT-2's 50257 tokens: its tokenizer's)."""
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    make_hf("gpt2", path, vocab_size=50257)
    return path


@pytest.fixture(scope="module")
def llama_base(text: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Hugging Face Llama directory with its own byte-level tokenizer.json."""
    corpus = text.read_text(encoding="utf-8")
    tok = byte_level_bpe([corpus[i : i + 1000] for i in range(0, len(corpus), 1000)], 300, [BOS, EOS])  # fmt: skip
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    make_hf("llama", path, vocab_size=tok.get_vocab_size())
    tok.save(str(path / "tokenizer.json"))
    tok_config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    code = train.main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def logits_of(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out


def ours_with_adapter(base: Path, adapter_dir: Path) -> torch.nn.Module:
    model = load_checkpoint(base)
    merge_into(model, read_peft(adapter_dir, model.config))
    return model


def assert_peft_agrees(base: Path, adapter_dir: Path, vocab: int) -> None:
    """PEFT's model (transformers' base + our adapter files) gives our logits, and the adapter
    changes them (a zero adapter would prove nothing)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    idx = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = logits_of(theirs, idx)
    assert (logits_of(ours_with_adapter(base, adapter_dir), idx) - expected).abs().max() < 1e-5
    assert (logits_of(load_checkpoint(base), idx) - expected).abs().max() > 1e-3


def test_gpt2_adapter_loads_in_peft_and_merges(
    gpt2_base: Path, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    argv = ["--init-from", str(gpt2_base), "--data", str(text), "--out", str(out), *FAST]
    printed = run([*argv, "--lora-rank", "4", "--lora-targets", "q,v,down", "--merge"], capsys)
    assert "LoRA: rank 4, alpha 8 on q,v,down" in printed

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(gpt2_base.resolve())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["fan_in_fan_out"] is True
    # q and v are slices of GPT-2's fused c_attn: one PEFT module of rank 8 there
    assert sorted(config["target_modules"]) == ["c_attn", "mlp.c_proj"]
    assert config["rank_pattern"] == {"c_attn": 8}
    assert not (out / "config.json").exists() and (out / BEST_DIR / "adapter_config.json").is_file()
    # train_state.pt holds the adapter, not the base
    state = torch.load(out / STATE_FILE, weights_only=True)
    assert state["model"] and all(".lora_" in k for k in state["model"])
    assert_peft_agrees(gpt2_base, out, 50257)
    assert_peft_agrees(gpt2_base, out / BEST_DIR, 50257)

    # --merge: a checkpoint of the base with the adapter in, as the server loads it
    idx = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(1))
    merged = logits_of(load_checkpoint(out / MERGED_DIR), idx)
    assert (merged - logits_of(ours_with_adapter(gpt2_base, out), idx)).abs().max() < 1e-5


def test_llama_adapter_resumes_exactly_and_merges_with_its_tokenizer(
    llama_base: Path, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    argv = ["--init-from", str(llama_base), "--data", str(text), *FAST, "--lora-rank", "2"]
    argv += ["--lora-alpha", "5", "--lora-targets", "k,o,gate,up,down", "--lora-dropout", "0.1"]
    argv += ["--warmup-steps", "3"]  # the learning rates of steps 1-3 do not depend on --max-steps
    run([*argv, "--out", str(whole)], capsys)
    run([*argv, "--out", str(resumed), "--max-steps", "3"], capsys)
    run(["--out", str(resumed), "--resume", "--max-steps", "6", "--merge"], capsys)

    rows = [metric_rows(out) for out in (whole, resumed)]
    assert [r["step"] for r in rows[0]] == list(range(1, 7)) and rows[0] == rows[1]
    a, b = (load_file(str(out / "adapter_model.safetensors")) for out in (whole, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    config = json.loads((resumed / "adapter_config.json").read_text())
    assert config["lora_alpha"] == 5 and config["lora_dropout"] == 0.1
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "up_proj"]  # fmt: skip
    vocab = json.loads((llama_base / "config.json").read_text())["vocab_size"]
    assert_peft_agrees(llama_base, resumed, vocab)

    merged_dir = resumed / MERGED_DIR
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (merged_dir / name).read_bytes() == (llama_base / name).read_bytes()
    assert [n for n in TOKENIZER_FILES if (merged_dir / n).is_file()]
    idx = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    merged = logits_of(load_checkpoint(merged_dir), idx)
    assert (merged - logits_of(ours_with_adapter(llama_base, resumed), idx)).abs().max() < 1e-5


def test_a_gguf_base_is_dequantized_and_the_adapter_fits_transformers_reading_it(
    text: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("gguf")
    from tests.model.gguf.test_gguf import VOCAB, write_gguf

    base = tmp_path / "tiny-q8.gguf"
    write_gguf(base, "llama", "Q8_0")
    out = tmp_path / "out"
    run(["--init-from", str(base), "--data", str(text), "--out", str(out), *FAST,
         "--lora-rank", "4", "--lora-targets", "q,k,v"], capsys)  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=base.name, dtype=torch.float32
    )
    theirs = peft.PeftModel.from_pretrained(hf, out).eval()
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = logits_of(theirs, idx)
    assert (logits_of(ours_with_adapter(base, out), idx) - expected).abs().max() < 1e-4
    assert (logits_of(load_checkpoint(base), idx) - expected).abs().max() > 1e-3


def error_of(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    code = train.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


BAD = {
    "rank 0": (["--lora-rank", "0"], "--lora-rank must be positive"),
    "no base": (["--lora-rank", "4"], "--lora-rank needs --init-from"),
    "unknown target": (["--lora-rank", "4", "--lora-targets", "q,x"], "--lora-targets 'x'"),
    "lacking target": (["--lora-rank", "4", "--lora-targets", "gate"],
                       "GPT-2-shaped model has no such projection"),
    "merge alone": (["--merge"], "--merge needs --lora-rank"),
    "alpha alone": (["--lora-alpha", "8"], "--lora-alpha needs --lora-rank"),
    "bad dropout": (["--lora-rank", "4", "--lora-dropout", "1.5"], "--lora-dropout must be in"),
    "arch flag": (["--lora-rank", "4", "--n-layer", "3"], "drop --n-layer"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_lora_flags_are_one_line(
    case: str, gpt2_base: Path, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    extra, words = BAD[case]
    argv = ["--data", str(text), "--out", str(tmp_path / "out"), *FAST, *extra]
    if case != "no base":
        argv += ["--init-from", str(gpt2_base)]
    assert words in error_of(argv, capsys)
    assert not (tmp_path / "out" / "adapter_config.json").exists()


def test_merge_of_a_gguf_base_is_refused(text: Path, tmp_path: Path, capsys) -> None:
    argv = ["--data", str(text), "--out", str(tmp_path / "o"), "--init-from", "x.gguf"]
    assert "--merge cannot write a GGUF base's tokenizer" in error_of(
        [*argv, "--lora-rank", "4", "--merge"], capsys
    )


def test_resume_keeps_the_adapter_and_a_new_run_keeps_off_it(
    gpt2_base: Path, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out, full = tmp_path / "out", tmp_path / "full"
    base = ["--init-from", str(gpt2_base), "--data", str(text), *FAST, "--max-steps", "3"]
    run([*base, "--out", str(out), "--lora-rank", "2"], capsys)
    for change, key in ((["--lora-rank", "4"], "lora_rank"), (["--lora-alpha", "1"], "lora_alpha"),
                        (["--lora-targets", "q"], "lora_targets"),
                        (["--init-from", str(text)], "init_from")):  # fmt: skip
        line = error_of(["--out", str(out), "--resume", *change], capsys)
        assert f"holds a LoRA run with {key}=" in line
    # --merge on the --resume of a finished run writes the merged checkpoint, training nothing
    before = (out / "adapter_model.safetensors").read_bytes()
    assert "nothing to do" in run(["--out", str(out), "--resume", "--merge"], capsys)
    assert (out / "adapter_model.safetensors").read_bytes() == before
    idx = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(2))
    merged = logits_of(load_checkpoint(out / MERGED_DIR), idx)
    assert (merged - logits_of(ours_with_adapter(gpt2_base, out), idx)).abs().max() < 1e-5
    # a new run into it is refused: it holds a run; and a folder with only an adapter, too
    assert "holds a run" in error_of([*base, "--out", str(out), "--lora-rank", "2"], capsys)
    (out / STATE_FILE).unlink()
    assert "holds an adapter" in error_of([*base, "--out", str(out), "--lora-rank", "2"], capsys)
    # a full fine-tune cannot become a LoRA run on --resume
    run([*base, "--out", str(full)], capsys)
    line = error_of(["--out", str(full), "--resume", "--lora-rank", "2"], capsys)
    assert "holds a full training run; --lora-rank cannot be added" in line


@pytest.mark.parametrize(
    "arch,targets", [("gpt2", ("q", "v", "up")), ("gpt2", ("q", "k", "v")), ("llama", ("all",))]
)
def test_the_trained_forward_is_the_merged_adapter(arch: str, targets: tuple[str, ...]) -> None:
    """What training optimizes (LoraLinear's forward) is what the written adapter computes."""
    from gptserve.model import GPT
    from gptserve.training.config import TrainConfig
    from gptserve.training.lora import adapter_of, inject_lora, merge_lora, resolve_targets

    config = TrainConfig(out=Path("o"), data=Path("d"), arch=arch, n_layer=2, n_head=4,
                         n_embd=32, n_kv_head=2 if arch == "llama" else None,
                         block_size=32).model_config(vocab_size=64)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config).eval()
    inject_lora(model, resolve_targets(targets, model.config), rank=3, alpha=5.0, dropout=0.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    trained = logits_of(model, idx)
    merge_lora(model, adapter_of(model, "t", 3, 5.0, None))
    assert not any(p.requires_grad for p in model.parameters())
    assert (logits_of(model, idx) - trained).abs().max() < 1e-4
