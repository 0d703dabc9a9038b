"""Checkpoints: our directory format and Hugging Face directories, through one `load_checkpoint`.

Ours: `config.json` (ModelConfig with "format": "gptserve") + `model.safetensors`.
Hugging Face GPT-2: `config.json` (model_type gpt2) + `model.safetensors`, or `pytorch_model.bin`
read with `torch.load(weights_only=True)`; its Conv1D weights are stored (in, out) and transposed here.
Hugging Face Llama, Mistral, Qwen2, Qwen3 and Phi-3 (by `architectures`): `model.hf_llama`;
Gemma 3: `model.hf_gemma`.
Nothing is ever unpickled beyond plain tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from gptserve.model import hf_gemma, hf_llama
from gptserve.model.config import ConfigError, ModelConfig
from gptserve.model.gpt import GPT
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HF_BIN_FILE = "pytorch_model.bin"
_HF_TRANSPOSED = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, or does not match its config."""


def save_checkpoint(
    model: GPT, path: str | Path, extra_files: dict[str, str] | None = None
) -> None:
    """Write config.json and model.safetensors into directory `path`, each atomically."""
    _check_plain_weights(model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().contiguous().cpu()
        for k, v in model.state_dict().items()
        if not (model.config.tie_embeddings and k == "lm_head.weight")
    }
    atomic_write(path / WEIGHTS_FILE, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    config_text = json.dumps(model.config.to_dict(), indent=2) + "\n"
    atomic_write(path / CONFIG_FILE, lambda tmp: Path(tmp).write_text(config_text))
    for name, text in (extra_files or {}).items():
        atomic_write(path / name, lambda tmp, t=text: Path(tmp).write_text(t))


def _check_plain_weights(model: GPT) -> None:
    """Refuse a model whose layers were swapped for inference, before anything is written.

    A checkpoint holds a GPT's own weights: dense floating-point tensors of at most two
    dimensions. The CPU wing's layouts (oneDNN's opaque tensors, 3-D slabs) and int8 weights are
    none of these, and `load_checkpoint` could not read them back.
    """
    for name, tensor in model.state_dict().items():
        if tensor.layout != torch.strided or not tensor.is_floating_point() or tensor.dim() > 2:
            raise CheckpointError(
                f"this model's layers were swapped for inference ({name} is not a plain weight): "
                "it was optimized for CPU inference (model.cpu.optimize_for_cpu) or quantized "
                "(model.quantize); save the model as loaded or trained instead"
            )


def read_json_object(path: Path, error: type[Exception]) -> dict:
    """The JSON object in the file at `path`; `error` with one line when the file cannot be read
    or holds something else."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise error(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise error(f"{path} is not a JSON object")
    return raw


def atomic_write(target: Path, write: Callable[[str], object]) -> None:
    """Call write(temp_path) for a temp file beside target, fsync it, rename it over target.

    A reader (or a process killed half-way) sees the old file or the new one, never a mix.
    """
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        os.chmod(tmp, 0o644)  # safetensors creates 0600 files; a checkpoint is for others to read
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if tmp.exists():
            tmp.unlink()


def load_checkpoint(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    *,
    low_bit: bool = False,
) -> GPT:
    """Load our checkpoint directory, a Hugging Face directory (GPT-2, Llama, Mistral, Qwen2,
    Qwen3, Phi-3, Gemma 3) or a GGUF file into an eval-mode GPT.

    A GGUF file's weights are dequantized to float unless `low_bit`, which keeps its quantized
    matrices at their own bits (`model.gguf.quantized`; on a CPU, inference only); `low_bit` is
    ignored for other checkpoints.
    """
    path = Path(path)
    if path.suffix == ".gguf" and path.is_file():
        return _load_gguf(path, device, dtype, low_bit)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(f"{path} has no {CONFIG_FILE}")
    raw = read_json_object(cfg_path, CheckpointError)
    stored = None  # a Llama-family checkpoint keeps its dtype unless one is asked for
    try:
        if raw.get("format") == "gptserve" or not ("architectures" in raw or "model_type" in raw):
            config = ModelConfig.from_dict(raw)
            state = _read_weights(path, allow_bin=False)
        elif hf_llama.architecture(raw) == "GPT2LMHeadModel":
            config = _config_from_hf(raw)
            state = _hf_state_dict(_read_weights(path, allow_bin=True))
        else:
            family = hf_gemma if hf_llama.architecture(raw) in hf_llama.GEMMA else hf_llama
            config = family.config_from_hf(raw)
            state = family.state_from_hf(hf_llama.read_safetensors(path), config)
            stored = next((t.dtype for t in state.values() if t.is_floating_point()), None)
    except ConfigError as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from None

    model = GPT(config)
    _load_state(model, state, path)
    model.to(device=device, dtype=dtype or stored)
    return model.eval()


def _load_gguf(
    path: Path, device: torch.device | str, dtype: torch.dtype | None, low_bit: bool
) -> GPT:
    """A GGUF file's weights dequantized to float32 (or dtype), or at their own bits."""
    from gptserve.model.gguf.checkpoint import dequantized_state, read_gguf

    if low_bit and torch.device(device).type != "cpu":
        raise CheckpointError(
            f"a GGUF file at its own bits runs on a CPU, not {torch.device(device).type} "
            "(dequantize it to float there: --quantize dequantize)"
        )
    if low_bit:  # imported before the file's metadata is parsed: see the next comment
        from gptserve.model.gguf.quantized import build_low_bit_gpt
    try:
        gguf_model = read_gguf(path)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    if low_bit:
        # Parsing the metadata makes and drops ~10^5 small objects; what lives on from then (the
        # strings kept here, modules imported) would pin their allocator's pages for good.
        gguf_model.metadata.clear()  # ~100k strings (the tokenizer's): freed before the build
        try:
            model = build_low_bit_gpt(gguf_model, path, dtype or torch.float32)
        except ConfigError as exc:
            raise CheckpointError(f"{path.name}: {exc}") from None
    else:
        model = GPT(gguf_model.config)
        _load_state(model, dequantized_state(gguf_model), path)
    if gguf_model.rope_freq_factors is not None:  # Llama 3's long-context rescaling
        model.rope_inv_freq.div_(gguf_model.rope_freq_factors)
    if not low_bit:  # the low-bit modules are built in their device and dtypes
        model.to(device=device, dtype=dtype)
    return model.eval()


def _read_weights(path: Path, allow_bin: bool) -> dict[str, torch.Tensor]:
    st = path / WEIGHTS_FILE
    if st.is_file():
        try:
            return load_file(str(st))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{st} is unreadable or truncated: {exc}") from None
    binary = path / HF_BIN_FILE
    if allow_bin and binary.is_file():
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for corrupt or unsafe pickles
            raise CheckpointError(f"{binary} is unreadable or not plain tensors: {exc}") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{binary} does not hold a state dict")
        return state
    wanted = f"{WEIGHTS_FILE} or {HF_BIN_FILE}" if allow_bin else WEIGHTS_FILE
    raise CheckpointError(f"{path} has no {wanted}")


def _config_from_hf(raw: dict) -> ModelConfig:
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "relu"):
        raise ConfigError(f"unsupported activation_function {act!r}")
    n_embd = raw.get("n_embd", 768)
    if raw.get("n_inner") not in (None, 4 * n_embd):
        raise ConfigError("n_inner other than 4 * n_embd is not supported")
    return ModelConfig(
        vocab_size=raw.get("vocab_size", 50257),
        block_size=raw.get("n_positions", raw.get("n_ctx", 1024)),
        n_layer=raw.get("n_layer", 12),
        n_head=raw.get("n_head", 12),
        n_embd=n_embd,
        layer_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        activation="relu" if act == "relu" else "gelu",
        tie_embeddings=raw.get("tie_word_embeddings", True),
    )


def _hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state.items():
        name = key.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers of older transformers versions
        if name.endswith(_HF_TRANSPOSED):
            tensor = tensor.t()
        out[name if name == "lm_head.weight" else f"transformer.{name}"] = tensor
    return out


def _load_state(model: GPT, state: dict[str, torch.Tensor], path: Path) -> None:
    expected = model.state_dict()
    if model.config.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
        if unexpected:
            parts.append(
                f"unexpected {', '.join(unexpected[:3])}" + (" ..." if len(unexpected) > 3 else "")
            )
        raise CheckpointError(f"{path}: weights do not match config.json ({'; '.join(parts)})")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise CheckpointError(
                f"{path}: {key} has shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(expected[key].shape)}"
            )
    model.load_state_dict(state, strict=False)
