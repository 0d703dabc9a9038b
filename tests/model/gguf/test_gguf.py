"""GGUF files: small random ones written here with the `gguf` package, read by our loader and by
transformers (the oracle); the real SmolLM2 file's tokenizer and answer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gptserve.model import CheckpointError, load_checkpoint
from gptserve.model.gguf.checkpoint import unpermute_rows
from gptserve.model.gguf.kquant_blocks import quantize
from gptserve.model.known_models import fetch_known_model
from gptserve.model.tokenizers import load_tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

VOCAB = 260
HIDDEN, HEADS, KV_HEADS, FFN = 256, 4, 2, 512  # rows of 256: K-quant blocks fit


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order for Q and K (the inverse of ours)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def k_quant_bytes(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small, finite f16 scales (gguf-py cannot quantize K types)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    if qtype == Q.Q6_K:  # ql, qh, scales, then d
        blocks[..., -2:] = scale
    else:  # d, dmin first
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = scale
    return blocks.reshape(rows, -1)


def encode(w: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    if w.ndim == 1 or kind == "F32":
        return w.astype(np.float32), None
    if kind == "F16":
        return w.astype(np.float16), None
    if kind == "Q4_K":
        return k_quant_bytes(Q[kind], *w.shape, rng), Q[kind]
    if kind in ("Q5_K", "Q6_K"):  # the weights rounded to the format (our quantizer)
        return quantize(w.astype(np.float32), kind), Q[kind]
    return gguf.quants.quantize(w.astype(np.float32), Q[kind]), Q[kind]


def write_gguf(
    path: Path, arch: str, kind: str, tied: bool = False, window: int | None = None,
    rope_dims: int | None = None,
) -> None:  # fmt: skip
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    if window is not None:
        writer.add_sliding_window(window)
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    head_dim = 128 if arch == "qwen3" else 64  # Qwen3's heads are wider than n_embd / n_head
    context = 1024 if arch == "gpt2" else 128  # transformers reads gpt2's as 1024 always
    writer.add_context_length(context)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(2)
    writer.add_feed_forward_length(FFN if arch != "gpt2" else 4 * HIDDEN)
    writer.add_head_count(HEADS)
    if arch == "gpt2":
        writer.add_layer_norm_eps(1e-5)
    else:
        writer.add_head_count_kv(KV_HEADS)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(10000.0)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    byte_chars = [chr(c) for c in range(33, 127)]
    tokens = byte_chars + [f"t{i}" for i in range(VOCAB - len(byte_chars) - 1)] + ["<|end|>"]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (VOCAB - 1) + [3])
    writer.add_token_merges([])
    writer.add_eos_token_id(VOCAB - 1)

    def add(name: str, *shape: int, scale: float = 0.05, rows_permuted: int = 0) -> None:
        w = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1 and name.endswith("norm.weight"):
            w = 1.0 + w
        if rows_permuted:
            w = permute_rows(w, rows_permuted)
        data, qtype = encode(w, kind, rng)
        writer.add_tensor(name, data, raw_dtype=qtype)

    add("token_embd.weight", VOCAB, HIDDEN)
    if arch == "gpt2":
        add("position_embd.weight", context, HIDDEN)
    for i in range(2):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", HIDDEN)
        add(b + "ffn_norm.weight", HIDDEN)
        if arch == "gpt2":
            add(b + "attn_norm.bias", HIDDEN)
            add(b + "ffn_norm.bias", HIDDEN)
            add(b + "attn_qkv.weight", 3 * HIDDEN, HIDDEN)
            add(b + "attn_qkv.bias", 3 * HIDDEN)
            add(b + "attn_output.weight", HIDDEN, HIDDEN)
            add(b + "attn_output.bias", HIDDEN)
            add(b + "ffn_up.weight", 4 * HIDDEN, HIDDEN)
            add(b + "ffn_up.bias", 4 * HIDDEN)
            add(b + "ffn_down.weight", HIDDEN, 4 * HIDDEN)
            add(b + "ffn_down.bias", HIDDEN)
            continue
        permuted = arch == "llama"  # the converter reorders llama's Q and K rows
        add(b + "attn_q.weight", HEADS * head_dim, HIDDEN, rows_permuted=HEADS * permuted)
        add(b + "attn_k.weight", KV_HEADS * head_dim, HIDDEN, rows_permuted=KV_HEADS * permuted)
        add(b + "attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        if arch == "qwen2":
            add(b + "attn_q.bias", HEADS * head_dim)
            add(b + "attn_k.bias", KV_HEADS * head_dim)
            add(b + "attn_v.bias", KV_HEADS * head_dim)
        if arch == "qwen3":
            add(b + "attn_q_norm.weight", head_dim)
            add(b + "attn_k_norm.weight", head_dim)
        add(b + "attn_output.weight", HIDDEN, HEADS * head_dim)
        add(b + "ffn_gate.weight", FFN, HIDDEN)
        add(b + "ffn_up.weight", FFN, HIDDEN)
        add(b + "ffn_down.weight", HIDDEN, FFN)
    add("output_norm.weight", HIDDEN)
    if arch == "gpt2":
        add("output_norm.bias", HIDDEN)
    if not tied:
        add("output.weight", VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


CASES = [
    ("llama", "F32"), ("llama", "F16"), ("llama", "BF16"), ("llama", "Q8_0"), ("llama", "Q4_0"),
    ("llama", "Q4_1"), ("llama", "Q4_K"), ("llama", "Q5_K"), ("llama", "Q6_K"),
    ("qwen2", "Q8_0"), ("qwen3", "Q4_1"), ("gpt2", "Q8_0"),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "kind"), CASES, ids=[f"{a}-{k}" for a, k in CASES])
def test_logits_match_transformers(tmp_path: Path, arch: str, kind: str) -> None:
    path = tmp_path / f"{arch}-{kind}.gguf"
    write_gguf(path, arch, kind, tied=arch == "qwen3")
    ours = load_checkpoint(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(idx) - ref(idx).logits).abs().max().item() < 1e-4


def test_a_llama_files_sliding_window_is_every_layers(tmp_path: Path) -> None:
    """A `llama` file with attention.sliding_window (a Mistral's): every layer windowed, and its
    logits past the window those of the windowless file's weights no more."""
    write_gguf(tmp_path / "w.gguf", "llama", "F32", window=6)
    write_gguf(tmp_path / "plain.gguf", "llama", "F32")
    windowed, plain = load_checkpoint(tmp_path / "w.gguf"), load_checkpoint(tmp_path / "plain.gguf")
    assert windowed.config.layer_windows() == (6, 6)
    assert plain.config.layer_windows() == (None, None)
    idx = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = windowed(idx), plain(idx)
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-5)
    assert not torch.allclose(a[:, 8:], b[:, 8:], atol=1e-3)


def test_unpermute_inverts_the_converter() -> None:
    w = np.arange(8 * 64 * 3).reshape(8 * 64, 3)
    assert (unpermute_rows(permute_rows(w, 8), 8) == w).all()


def test_unsupported_architecture_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="architecture 'mamba' is not supported") as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_partial_rotation_is_refused_in_one_line(tmp_path: Path, arch: str) -> None:
    """rope.dimension_count below the head's width (a partial rotation) is refused, not served
    as a whole-head rotation; equal to it, the file loads as before."""
    head_dim = 128 if arch == "qwen3" else 64
    write_gguf(tmp_path / "whole.gguf", arch, "F32", rope_dims=head_dim)
    assert load_checkpoint(tmp_path / "whole.gguf").config.rotary_dim is None
    write_gguf(tmp_path / "part.gguf", arch, "F32", rope_dims=head_dim // 2)
    with pytest.raises(CheckpointError, match=f"rope.dimension_count {head_dim // 2}") as info:
        load_checkpoint(tmp_path / "part.gguf")
    assert "\n" not in str(info.value)


TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "Ça coûte 12,50 € — naïve café, Zürich.",
    "日本語のテキストと中文字符。",
    "emoji: 🙂👍🏽 and 👨‍👩‍👧",
    "digits 1234567890 3.14159 -42",
    "def f(x):\n    return {'a': [x, x ** 2]}  # code\n\n",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def test_the_real_files_tokenizer_matches_transformers() -> None:
    path = fetch_known_model("smollm2-135m-instruct")
    ours = load_tokenizer("gguf", path)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
    assert ours.eos_token_ids[0] == 2 and ours.bos_token_id == 1 and not ours.add_bos


def test_the_real_file_answers_paris() -> None:
    from gptserve.model.gguf.checkpoint import read_metadata
    from gptserve.server.chat.templates import JinjaChatTemplate

    path = fetch_known_model("smollm2-135m-instruct")
    model, tok = load_checkpoint(path), load_tokenizer("gguf", path)
    template = JinjaChatTemplate(read_metadata(path)["tokenizer.chat_template"])
    prompt = template.render([{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert "Paris" in tok.decode(ids[len(tok.encode(prompt)) :])
