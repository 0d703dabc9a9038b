"""train.py with Llama-shaped models: `--arch llama` from scratch, `--init-from` a Hugging Face
Llama directory (fine-tuning with its own tokenizer), `--resume` of both, and their outputs served.

"Served" means what `gptserve serve --model DIR` does with the directory: load_checkpoint, the
tokenizer the config names (from DIR), and generation through the engine over the paged KV cache,
which must give the greedy tokens of the plain full forward. In-process runs of tiny models on a
slice of Shakespeare.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, ModelConfig, load_checkpoint
from gptserve.model.tokenizers import HFTokenizer, load_tokenizer
from gptserve.training import cli as train
from gptserve.training.args import parse_config
from gptserve.training.checkpointing import BEST_DIR, STATE_FILE, TOKENIZER_FILES
from gptserve.training.config import llama_mlp_width
from gptserve.training.data import token_dtype, tokenize_cached
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from tests.conftest import byte_level_bpe
from tests.train.conftest import metric_rows

LLAMA = [
    "--arch", "llama", "--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "32",
    "--intermediate-size", "128", "--rope-theta", "500000", "--batch-size", "8", "--lr", "3e-3",
    "--warmup-steps", "5", "--eval-iters", "2",
]  # fmt: skip
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("token-cache")


def run(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    code = train.main(argv)
    err = capsys.readouterr().err
    assert code == 0, err


def error_of(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    code = train.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def losses(out: Path) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train_loss"] for line in lines]


def served(path: Path) -> tuple[GPT, object]:
    """The model and tokenizer the server would load from `path`."""
    model = load_checkpoint(path, dtype=torch.float32)
    return model, load_tokenizer(model.config.tokenizer, path)


def greedy_reference(model: GPT, prompt: list[int], n: int) -> list[int]:
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[0, len(prompt) :].tolist()


def assert_engine_generates(path: Path, prompt: str, n: int = 12) -> None:
    """Greedy generation through the engine (paged KV cache) equals the full forward's."""
    model, tok = served(path)
    ids = tok.encode(prompt)
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=16))
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out: list[int] = []
    for _ in range(100):
        if not engine.has_work():
            break
        out += [t for ev in engine.step() for t in ev.token_ids]
    assert out == greedy_reference(model, ids, n)
    assert isinstance(tok.decode(out), str)


def assert_served_logits_are_the_trained_weights(out: Path) -> None:
    """model(idx) of the served checkpoint equals that of the fp32 weights in train_state.pt."""
    state = torch.load(out / STATE_FILE, weights_only=True)
    trained = GPT(ModelConfig.from_dict(state["config"])).eval()
    trained.load_state_dict(state["model"])
    model, tok = served(out)
    idx = torch.tensor([tok.encode("ROMEO: But soft, what light through yonder window")])
    with torch.no_grad():
        torch.testing.assert_close(model(idx), trained(idx), rtol=0, atol=0)


# ------------------------------------------------------------------------ from scratch


@pytest.fixture(scope="module")
def llama_run(text: Path, cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama")
    argv = ["--data", str(text), "--out", str(out), "--cache-dir", str(cache), *LLAMA]
    argv += ["--max-steps", "30", "--eval-interval", "15", "--log-interval", "5"]
    assert train.main([*argv, "--sample-tokens", "4"]) == 0
    return out


def test_llama_loss_falls_and_the_output_is_llama_shaped(llama_run: Path) -> None:
    loss = losses(llama_run)
    assert loss[0] > 9.0 and loss[-1] < loss[0] - 2.0  # ~ln(50257) = 10.8 at the start
    config = json.loads((llama_run / "config.json").read_text())
    expected = dict(
        pos_encoding="rotary", norm="rmsnorm", activation="swiglu", bias=False,
        n_kv_head=None, intermediate_size=128, rope_theta=500000.0, tie_embeddings=True,
        tokenizer="gpt2", block_size=32,
    )  # fmt: skip
    assert {k: config[k] for k in expected} == expected
    weights = load_file(str(llama_run / "model.safetensors"))
    assert weights["transformer.h.0.mlp.c_fc.weight"].shape == (2 * 128, 64)  # gate and up
    assert not any(k.endswith(".bias") for k in weights)  # Llama has no biases


def test_llama_output_generates_through_the_engine(llama_run: Path) -> None:
    for path in (llama_run, llama_run / BEST_DIR):
        assert_engine_generates(path, "ROMEO:\nBut soft")


@pytest.fixture(scope="module")
def gqa_runs(text: Path, cache: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Grouped-query attention (2 key/value heads for 4 query heads), 6 steps uninterrupted
    and 3 steps then --resume to 6."""
    root = tmp_path_factory.mktemp("gqa")
    whole, resumed = root / "whole", root / "resumed"
    argv = ["--data", str(text), "--cache-dir", str(cache), *LLAMA, "--n-kv-head", "2"]
    argv += ["--eval-interval", "3", "--log-interval", "1", "--sample-tokens", "0"]
    assert train.main([*argv, "--out", str(whole), "--max-steps", "6"]) == 0
    assert train.main([*argv, "--out", str(resumed), "--max-steps", "3"]) == 0
    assert train.main(["--out", str(resumed), "--resume", "--max-steps", "6"]) == 0
    return [whole, resumed]


def test_gqa_llama_resumes_exactly(gqa_runs: list[Path]) -> None:
    whole, resumed = gqa_runs
    rows = [metric_rows(out) for out in (whole, resumed)]
    assert [r["step"] for r in rows[0]] == list(range(1, 7)) and rows[0] == rows[1]
    a, b = (load_file(str(out / "model.safetensors")) for out in gqa_runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = torch.load(resumed / STATE_FILE, weights_only=True)
    assert state["args"]["arch"] == "llama" and state["args"]["n_kv_head"] == 2
    assert json.loads((resumed / "config.json").read_text())["n_kv_head"] == 2


def test_gqa_llama_output_loads_with_the_trained_weights(gqa_runs: list[Path]) -> None:
    # The engine's paged attention does not take n_kv_head < n_head yet (kernels are being
    # extended): the full forward checks the served GQA model meanwhile; the test below runs
    # the engine on it and passes once the kernels do.
    for out in gqa_runs:
        assert_served_logits_are_the_trained_weights(out)


def test_gqa_llama_output_generates_through_the_engine(gqa_runs: list[Path]) -> None:
    assert_engine_generates(gqa_runs[0], "ROMEO:\nBut soft")


# ------------------------------------------------------------- fine-tuning a Hugging Face Llama


def _byte_level_tokenizer(text: Path) -> Tokenizer:
    """A 400-token byte-level BPE with Llama 3's BOS and end tokens; BOS starts each encoding."""
    corpus = text.read_text(encoding="utf-8")
    tok = byte_level_bpe(
        [corpus[i : i + 1000] for i in range(0, len(corpus), 1000)], 400, [BOS, EOS]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def _save_hf_llama(path: Path, tok: Tokenizer, vocab_size: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS),
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    tok_config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def hf_llama(text: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    tok = _byte_level_tokenizer(text)
    return _save_hf_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", tok, tok.get_vocab_size())


def test_fine_tune_hf_llama_with_its_tokenizer_then_resume(
    hf_llama: Path, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    source = shutil.copytree(hf_llama, tmp_path / "source")  # removed before the resume
    out, cache = tmp_path / "out", tmp_path / "cache"
    argv = ["--data", str(text), "--out", str(out), "--cache-dir", str(cache)]
    argv += ["--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "2", "--block-size", "32"]
    argv += ["--eval-interval", "10", "--eval-iters", "2", "--log-interval", "1"]
    run([*argv, "--init-from", str(source), "--max-steps", "20", "--sample-tokens", "6"], capsys)

    loss = losses(out)
    assert loss[0] > 5.5  # ~ln(400) = 6.0: random weights
    assert np.mean(loss[-5:]) < loss[0] - 0.6  # 6.0 -> 5.0 here
    # The data was tokenized with the checkpoint's tokenizer: BOS first, its ids.
    hf_tok = HFTokenizer.from_directory(source)
    (token_file,) = cache.glob("tokens-hf-*.bin")
    ids = np.fromfile(token_file, dtype=token_dtype(token_file))
    first_line = text.read_text(encoding="utf-8").split("\n")[0]
    assert ids[0] == hf_tok.bos_token_id
    assert ids[1 : 1 + len(hf_tok.encode(first_line))].tolist() == hf_tok.encode(first_line)
    # The output carries what serving it needs; its context length is the checkpoint's.
    for path in (out, out / BEST_DIR):
        present = [name for name in TOKENIZER_FILES if (path / name).is_file()]
        assert present == list(TOKENIZER_FILES)  # generation_config.json from save_pretrained
        for name in present:
            assert (path / name).read_bytes() == (source / name).read_bytes()
        config = json.loads((path / "config.json").read_text())
        assert config["tokenizer"] == "hf" and config["block_size"] == 64
        assert config["vocab_size"] == hf_tok.vocab_size and config["tie_embeddings"] is False
    model, tok = served(out)
    assert tok.encode("ROMEO: soft!") == hf_tok.encode("ROMEO: soft!")
    assert tok.eos_token_ids == hf_tok.eos_token_ids
    assert_engine_generates(out, "ROMEO:\nBut soft")
    state = torch.load(out / STATE_FILE, weights_only=True)
    assert state["args"]["block_size"] == 32  # the training window
    assert state["args"]["arch"] == "llama" and state["args"]["tie_embeddings"] is False

    # --resume needs neither the Hugging Face directory nor its tokenizer files: --out has them.
    shutil.rmtree(source)
    run(["--out", str(out), "--resume", "--max-steps", "24"], capsys)
    assert len(losses(out)) == 24
    assert_served_logits_are_the_trained_weights(out)


def test_init_from_and_arch_errors_are_one_line(
    hf_llama: Path, llama_run: Path, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    small_vocab = _save_hf_llama(
        tmp_path / "small-vocab", Tokenizer.from_file(str(hf_llama / "tokenizer.json")), 300
    )
    data = ["--data", str(text), "--out", str(tmp_path / "o"), "--max-steps", "1"]
    cases = {
        "--rope-theta needs --arch llama (this run is --arch gpt2)": ["--rope-theta", "1e6"],
        "--n-kv-head needs --arch llama": ["--n-kv-head", "2"],
        "--pos-encoding needs --arch gpt2 (this run is --arch llama)": [
            "--arch", "llama", "--pos-encoding", "sinusoidal",
        ],
        "n_head (4) must be a multiple of n_kv_head (3)": [
            "--arch", "llama", "--n-head", "4", "--n-embd", "64", "--n-kv-head", "3",
        ],
        "--init-from takes the architecture from the checkpoint; drop --n-kv-head": [
            "--init-from", str(hf_llama), "--n-kv-head", "2",
        ],
        "drop --arch": ["--init-from", str(hf_llama), "--arch", "llama"],
        "--block-size 128 exceeds the checkpoint's context length 64": [
            "--init-from", str(hf_llama), "--block-size", "128",
        ],
        "has 400 tokens but the model embeds only 300": ["--init-from", str(small_vocab)],
    }  # fmt: skip
    for expected, argv in cases.items():
        line = error_of([*data, *argv], capsys)
        assert expected in line, (expected, line)
    line = error_of(["--out", str(llama_run), "--resume", "--arch", "gpt2"], capsys)
    assert "holds a model with arch=llama; --resume cannot change it to gpt2" in line
    assert not (tmp_path / "o" / "config.json").exists()


# ------------------------------------------------------------------------------- units


def test_arch_flags_become_the_model_config() -> None:
    base = ["--data", "d.txt", "--out", "o"]
    gpt2 = parse_config(base).model_config()
    assert gpt2 == ModelConfig(block_size=256, n_layer=6, n_head=6, n_embd=384)  # as before
    llama = parse_config([*base, "--arch", "llama"]).model_config()
    assert (llama.pos_encoding, llama.norm, llama.activation) == ("rotary", "rmsnorm", "swiglu")
    assert llama.bias is False and llama.tie_embeddings and llama.kv_heads == 6
    assert llama.intermediate_size == llama_mlp_width(384) == 1024
    assert llama.block_size == 256 and llama.tokenizer == "gpt2"
    flags = ["--n-kv-head", "2", "--head-size", "32", "--no-tie-embeddings", "--qk-norm"]
    grouped = parse_config([*base, "--arch", "llama", *flags]).model_config()
    assert (grouped.n_kv_head, grouped.head_dim, grouped.tie_embeddings) == (2, 32, False)
    assert grouped.qk_norm and llama_mlp_width(64) == 192


def test_a_vocabulary_past_65536_is_stored_as_uint32(tmp_path: Path) -> None:
    """Token files widen to uint32 when a checkpoint's tokenizer has more than 65536 ids."""
    words = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<eos>"])
    source = tmp_path / "tok"
    source.mkdir()
    tok.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (tmp_path / "a.txt").write_text("w69999 w3 w65536\nw12\n")
    (tmp_path / "b.txt").write_text("w70 w66000\n")
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    path = tokenize_cached(files, tmp_path / "cache", "hf", progress=False, source=source)
    assert token_dtype(path) == np.uint32
    eos = tok.token_to_id("<eos>")
    assert eos == 70_000
    expected = [69999, 3, 65536, 12, eos, 70, 66000]
    assert np.fromfile(path, dtype=np.uint32).tolist() == expected
    assert tokenize_cached(files, tmp_path / "cache", "hf", progress=False, source=source) == path
