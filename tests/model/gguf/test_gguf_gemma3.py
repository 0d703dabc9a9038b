"""Gemma 3 GGUF files: a small random one written here with the `gguf` package as llama.cpp's
converter writes them (norms stored as 1 + w, no output matrix, a SentencePiece vocabulary without
merges), read by our loader and by transformers (`gguf_file=`, the oracle): logits, the
tokenizer's ids and text, the chat template.

Six layers, so that llama.cpp's pattern (every sixth layer global) has both kinds; a window of 8
over 24 tokens; heads 256 wide, the width whose attention scale llama.cpp and transformers' GGUF
loader agree on (transformers reads no query_pre_attn_scalar from the file: 256).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gptserve.model import load_checkpoint
from gptserve.model.tokenizers import load_tokenizer
from gptserve.server.chat.templates import load_chat_format

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
Q = gguf.GGMLQuantizationType

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, WINDOW = 64, 2, 1, 256, 96, 6, 8
CONTROL, UNKNOWN, BYTE = 3, 2, 6
SPECIALS = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN)]
TURNS = [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
LETTERS = "abcdefghijklmnopqrstuvwxyzTW,.:'\n"
PIECES = ["\u2581t", "th", "he", "\u2581the", "in", "\u2581a", "an", "nd", "and", "\u2581and",
          "er", "\u2581to", "\u2581be", "or", "ot", "\u2581not", "\u2581o", "\u2581or", "is",
          "\u2581is", "at", "\u2581that", "on", "ti", "io", "ion", "\u2581q", "qu", "es", "st",
          "\u2581\u2581"]  # fmt: skip
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def vocabulary() -> tuple[list[str], list[int]]:
    """Gemma's layout: special tokens, the 256 byte tokens, turn markers, then pieces; a token of
    two spaces stored as spaces, as llama.cpp's converter writes Gemma's."""
    entries = SPECIALS + [(f"<0x{b:02X}>", BYTE) for b in range(256)] + TURNS
    entries += [("\u2581", 1)] + [(c, 1) for c in LETTERS]
    entries += [(p.replace("\u2581\u2581", "  "), 1) for p in PIECES]
    return [t for t, _ in entries], [k for _, k in entries]


def write_gemma3_gguf(path: Path, kind: str = "F32") -> None:
    rng = np.random.default_rng(0)
    tokens, types = vocabulary()
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(WINDOW)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(TEMPLATE)

    def add(name: str, *shape: int, scale: float = 0.15) -> None:
        w = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name.endswith("norm.weight"):
            w = 1.0 + 0.3 * rng.standard_normal(shape).astype(np.float32)  # 1 + w, as stored
        if len(shape) == 1 or kind == "F32":
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, Q[kind]), raw_dtype=Q[kind])

    add("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", HIDDEN)
        add(b + "attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        add(b + "attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        add(b + "attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        add(b + "attn_q_norm.weight", HEAD_DIM)
        add(b + "attn_k_norm.weight", HEAD_DIM)
        add(b + "attn_output.weight", HIDDEN, HEADS * HEAD_DIM, scale=0.05)
        add(b + "post_attention_norm.weight", HIDDEN)
        add(b + "ffn_norm.weight", HIDDEN)
        add(b + "ffn_gate.weight", FFN, HIDDEN)
        add(b + "ffn_up.weight", FFN, HIDDEN)
        add(b + "ffn_down.weight", HIDDEN, FFN)
        add(b + "post_ffw_norm.weight", HIDDEN)
    add("output_norm.weight", HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gemma3-gguf")
    for kind in ("F32", "Q8_0"):
        write_gemma3_gguf(directory / f"gemma3-{kind}.gguf", kind)
    return directory


def reference(files: Path, kind: str):  # noqa: ANN201
    return transformers.AutoModelForCausalLM.from_pretrained(
        files, gguf_file=f"gemma3-{kind}.gguf", dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_logits_match_transformers_past_the_window(files: Path, kind: str) -> None:
    ours = load_checkpoint(files / f"gemma3-{kind}.gguf")
    ref = reference(files, kind)
    c = ours.config
    assert c.layer_windows() == (WINDOW,) * 5 + (None,) and c.tie_embeddings
    assert (c.norm, c.sandwich_norm, c.rope_local_theta) == ("gemma_rmsnorm", True, 10_000.0)
    vocab = c.vocab_size
    idx = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(idx).logits
        assert expected.std() > 0.3
        assert (ours(idx) - expected).abs().max().item() < 1e-4


def test_q8_0_at_its_own_bits_is_close_to_the_float_model(files: Path) -> None:
    path = files / "gemma3-Q8_0.gguf"
    low, full = load_checkpoint(path, low_bit=True), load_checkpoint(path)
    idx = torch.randint(
        0, full.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        a, b = low(idx), full(idx)
    assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()


TEXTS = [
    "To be, or not to be: that is the question.",
    "  Whether 'tis nobler\n\nin the mind",
    "caf\u00e9 \u2713 and \u65e5\u672c",  # bytes outside the vocabulary fall back to <0xNN>
    "<start_of_turn>user\nthe question<end_of_turn>\n",
]


def test_tokenizer_ids_and_text_match_transformers(files: Path) -> None:
    path = files / "gemma3-F32.gguf"
    ours = load_tokenizer("gguf", path)
    ref = transformers.AutoTokenizer.from_pretrained(files, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False) == text
    assert ours.bos_token_id == 2 and 1 in ours.eos_token_ids
    assert len(ours.encode("the question")) < len("the question")  # merged pieces


def test_chat_template_comes_from_the_file(files: Path) -> None:
    path = files / "gemma3-F32.gguf"
    chat = load_chat_format(path, load_tokenizer("gguf", path))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    assert chat.render_messages(messages) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nyes<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_served_file_generates_transformers_greedy_tokens(files: Path) -> None:
    """The F32 file as the server loads it (the file's own bits, the CPU wing) through the engine
    over the paged cache, a batch of two, past the window."""
    from gptserve.engine.engine import Engine, EngineConfig
    from gptserve.engine.loader import load_for_inference
    from gptserve.engine.sampler import SamplingParams

    loaded = load_for_inference(files / "gemma3-F32.gguf", device="cpu")
    ref = reference(files, "F32")
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS[:2]]
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(kv_block_size=8))
    for i, ids in enumerate(prompts):
        engine.add_request(
            str(i), ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for ev in engine.step():
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
    for i, ids in enumerate(prompts):
        seq = list(ids)
        with torch.no_grad():
            for _ in range(12):
                seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
        assert got[str(i)] == seq[len(ids) :]
