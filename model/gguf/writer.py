"""Writing a GPT as a GGUF file (llama.cpp's format) with the `gguf` package: its weights under
llama.cpp's tensor names, its hyper-parameters, its tokenizer (`model.gguf.vocab`) and chat
template in the metadata, so that llama.cpp and `load_checkpoint` both read it.

Two architectures: `gpt2` (learned positions, LayerNorm, GELU, biases: train.py's default
models and Hugging Face GPT-2) and `llama` (rotary positions, RMSNorm, SwiGLU, no biases: Llama,
SmolLM2, Mistral and the Llama-shaped train.py models); any other shape is refused by name.
Matrices are written in F32, F16, BF16 or Q8_0 (int8 in blocks of 32 columns, one scale each,
by the `gguf` package's own quantizer; a matrix whose rows are not whole blocks stays F16, as
llama.cpp's converter leaves it), vectors (norms, biases) in F32.

llama.cpp rotates each neighbouring pair of a `llama` head's channels, where we (and Hugging
Face) rotate its two halves: Q and K rows are written in its order (`permute_rows`, the inverse of
`model.gguf.checkpoint.unpermute_rows`). Llama 3's long-context rescaling of the rotary
frequencies is written as llama.cpp's `rope_freqs` divisors, taken from the model's own
frequencies (so a model loaded from such a file writes them back).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gptserve.model.checkpoint import atomic_write
from gptserve.model.config import ModelConfig
from gptserve.model.gguf.vocab import GGUFVocab, gpt2_vocab
from gptserve.model.gpt import GPT
from gptserve.model.rotary import rotary_inv_freq

FORMATS = ("f32", "f16", "bf16", "q8_0")
# what each architecture needs of a config: field -> (value, what it means); a value of None for
# a name in _DERIVED is that check instead
_SHAPES: dict[str, dict[str, tuple[Any, str]]] = {
    "gpt2": {
        "pos_encoding": ("learned", "learned positions"),
        "norm": ("layernorm", "LayerNorm"),
        "activation": ("gelu", "a GELU MLP"),
        "bias": (True, "biases"),
        "attn_bias": (True, "attention biases"),
        "qk_norm": (False, "no query/key norms"),
        "sliding_window": (None, "no attention window"),
        "mlp_width": (None, "an MLP 4 x n_embd wide"),
        "kv_heads": (None, "as many key/value heads as query heads"),
        "head_dim": (None, "heads n_embd / n_head wide"),
    },
    "llama": {
        "pos_encoding": ("rotary", "rotary positions"),
        "norm": ("rmsnorm", "RMSNorm"),
        "activation": ("swiglu", "a SwiGLU MLP"),
        "bias": (False, "no biases"),
        "attn_bias": (False, "no attention biases (Qwen2's q/k/v biases)"),
        "qk_norm": (False, "no query/key norms (Qwen3's)"),
        "rope_dim": (None, "every channel of a head rotating"),
    },
}
_COMMON: dict[str, tuple[Any, str]] = {
    "norm_position": ("pre", "pre-norm blocks"),
    "sandwich_norm": (False, "no sandwich norms"),
    "embed_scale": (None, "an unscaled embedding"),
    "query_pre_attn_scalar": (None, "the usual attention scale"),
    "logit_softcap": (None, "no logit soft-cap"),
    "layer_types": (None, "every layer alike"),
    "rope_local_theta": (None, "one rotary base"),
}
_DERIVED: dict[str, Callable[[ModelConfig], bool]] = {
    "mlp_width": lambda c: c.mlp_width == 4 * c.n_embd,
    "kv_heads": lambda c: c.kv_heads == c.n_head,
    "head_dim": lambda c: c.head_dim * c.n_head == c.n_embd,
    "rope_dim": lambda c: c.rope_dim == c.head_dim,
}


class GGUFWriteError(ValueError):
    """A model that a GGUF file of a supported architecture cannot hold; one line."""


def ggml_types() -> dict[str, tuple]:
    """Format name -> (the type of a GGUF file's matrices, its general.file_type)."""
    import gguf

    q, f = gguf.GGMLQuantizationType, gguf.LlamaFileType
    return {
        "f32": (q.F32, f.ALL_F32),
        "f16": (q.F16, f.MOSTLY_F16),
        "bf16": (q.BF16, f.MOSTLY_BF16),
        "q8_0": (q.Q8_0, f.MOSTLY_Q8_0),
    }


def add_weights(writer: Any, tensors: dict[str, np.ndarray], fmt: str) -> None:
    """Add float32 tensors, named as GGUF names them, to a GGUFWriter: matrices in `fmt` (the
    gguf package's own conversion and quantization; F16 for a matrix whose rows are not whole
    blocks of a quantized format), vectors in float32. A matrix is given as PyTorch holds an
    nn.Linear weight, (out, in)."""
    import gguf

    qtype, file_type = ggml_types()[fmt]
    writer.add_file_type(file_type)
    if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        if array.ndim == 1:
            writer.add_tensor(name, array)
            continue
        kind = qtype if array.shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)


def architecture(config: ModelConfig) -> str:
    """ "gpt2" or "llama": the GGUF architecture of this config; GGUFWriteError naming what
    neither can hold."""
    arch = "llama" if config.pos_encoding == "rotary" else "gpt2"
    for name, (value, meaning) in {**_SHAPES[arch], **_COMMON}.items():
        ok = _DERIVED[name](config) if name in _DERIVED else getattr(config, name) == value
        if not ok:
            raise GGUFWriteError(
                f"a GGUF '{arch}' model has {meaning}; this model's {name} is "
                f"{getattr(config, name)!r} (GGUF export supports GPT-2- and Llama-shaped models)"
            )
    scaling = (config.rope_scaling or {}).get("rope_type", "default")
    if arch == "llama" and scaling not in ("default", "llama3", "linear"):
        raise GGUFWriteError(f"rope_scaling {scaling!r} cannot be written to a GGUF 'llama' file")
    return arch


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Q or K rows of each head from (first half, second half) to llama.cpp's interleaved order."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _numpy_state(model: GPT) -> dict[str, np.ndarray]:
    return {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}


def gpt2_tensors(model: GPT) -> dict[str, np.ndarray]:
    """A GPT-2-shaped GPT's weights under llama.cpp's "gpt2" names."""
    cfg, state = model.config, _numpy_state(model)
    out = {
        "token_embd.weight": state["transformer.wte.weight"],
        "position_embd.weight": state["transformer.wpe.weight"],
        "output_norm.weight": state["transformer.ln_f.weight"],
        "output_norm.bias": state["transformer.ln_f.bias"],
    }
    if not cfg.tie_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    parts = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
             "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}  # fmt: skip
    for i in range(cfg.n_layer):
        for gguf_name, ours in parts.items():
            for kind in ("weight", "bias"):
                out[f"blk.{i}.{gguf_name}.{kind}"] = state[f"transformer.h.{i}.{ours}.{kind}"]
    return out


def llama_tensors(model: GPT) -> dict[str, np.ndarray]:
    """A Llama-shaped GPT's weights under llama.cpp's "llama" names: the fused q/k/v and
    gate/up matrices apart, Q and K rows in llama.cpp's rotary order, and `rope_freqs` when the
    model's rotary frequencies are rescaled."""
    cfg, state = model.config, _numpy_state(model)
    q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out = {
        "token_embd.weight": state["transformer.wte.weight"],
        "output_norm.weight": state["transformer.ln_f.weight"],
    }
    if not cfg.tie_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    factors = rope_freq_factors(model)
    if factors is not None:
        out["rope_freqs.weight"] = factors
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}"
        qkv = state[f"{h}.attn.c_attn.weight"]  # (q_rows + 2 * kv_rows, n_embd)
        gate_up = state[f"{h}.mlp.c_fc.weight"]  # (2 * mlp_width, n_embd)
        out |= {
            f"blk.{i}.attn_norm.weight": state[f"{h}.ln_1.weight"],
            f"blk.{i}.attn_q.weight": permute_rows(qkv[:q_rows], cfg.n_head),
            f"blk.{i}.attn_k.weight": permute_rows(qkv[q_rows : q_rows + kv_rows], cfg.kv_heads),
            f"blk.{i}.attn_v.weight": qkv[q_rows + kv_rows :],
            f"blk.{i}.attn_output.weight": state[f"{h}.attn.c_proj.weight"],
            f"blk.{i}.ffn_norm.weight": state[f"{h}.ln_2.weight"],
            f"blk.{i}.ffn_gate.weight": gate_up[: cfg.mlp_width],
            f"blk.{i}.ffn_up.weight": gate_up[cfg.mlp_width :],
            f"blk.{i}.ffn_down.weight": state[f"{h}.mlp.c_proj.weight"],
        }
    return out


def rope_freq_factors(model: GPT) -> np.ndarray | None:
    """(head_dim / 2,) divisors of the plain rotary frequencies that give the model's own (Llama
    3's rescaling, a linear scaling), or None when it rotates by the plain ones."""
    cfg = model.config
    plain = rotary_inv_freq(cfg.rope_dim, cfg.rope_theta)  # (head_dim / 2,)
    own = model.rope_inv_freq.detach().float().cpu()
    if torch.allclose(own, plain, rtol=1e-6, atol=0.0):
        return None
    return (plain / own).numpy().astype(np.float32)


def add_hyperparameters(writer: Any, arch: str, config: ModelConfig) -> None:
    """The `{arch}.*` keys that `load_checkpoint` and llama.cpp read the config from."""
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.mlp_width)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    if arch == "gpt2":
        writer.add_layer_norm_eps(config.layer_norm_eps)
        return
    writer.add_vocab_size(config.vocab_size)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_layer_norm_rms_eps(config.layer_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.head_dim)
    if config.head_dim * config.n_head != config.n_embd:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.sliding_window is not None:  # read by gptserve; llama.cpp's llama has no window
        writer.add_sliding_window(config.sliding_window)


def write_gguf(
    path: str | Path, arch: str, metadata: Callable[[Any], None],
    tensors: dict[str, np.ndarray], fmt: str,
) -> Path:  # fmt: skip
    """One GGUF file, written beside `path` and renamed over it once whole: `metadata(writer)`
    adds the model's keys, then the tensors in `fmt`."""
    import gguf

    if fmt not in FORMATS:
        raise GGUFWriteError(f"unknown GGUF type {fmt!r}; choose from {', '.join(FORMATS)}")

    def write(tmp: str) -> None:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            metadata(writer)
            add_weights(writer, tensors, fmt)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()

    path = Path(path)
    atomic_write(path, write)
    return path


def write_model_gguf(
    path: str | Path, model: GPT, fmt: str, vocab: GGUFVocab,
    chat_template: str | None = None, name: str | None = None,
) -> Path:  # fmt: skip
    """`model` (float weights, not optimized or quantized for inference) as a GGUF file of its
    architecture, with `vocab` (padded to the model's vocabulary) and `chat_template` (Jinja)."""
    arch = architecture(model.config)
    vocab = vocab.padded(model.config.vocab_size)
    tensors = gpt2_tensors(model) if arch == "gpt2" else llama_tensors(model)

    def metadata(writer: Any) -> None:
        writer.add_name(name or Path(path).stem)
        add_hyperparameters(writer, arch, model.config)
        vocab.add_to(writer)
        if chat_template:
            writer.add_chat_template(chat_template)

    return write_gguf(path, arch, metadata, tensors, fmt)


def write_gpt2_gguf(path: str | Path, model: GPT, fmt: str, name: str = "gpt2") -> Path:
    """A GPT-2-shaped model with GPT-2's tokenizer as a GGUF file (the benchmarks' writer)."""
    return write_model_gguf(path, model, fmt, gpt2_vocab(), name=name)
