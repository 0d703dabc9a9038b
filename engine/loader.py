"""From a checkpoint directory to a model the engine can serve: the one loading pipeline.

The server (`server.runtime`), the offline CLI (`gptserve generate`), each Ray replica and the
benchmarks all load through `load_for_inference`, which runs these steps in this order:

1. device and dtype: "auto" picks CUDA when there is one, bfloat16 there and float32 on a CPU;
2. the quantization is checked against them before anything loads (`check_load`), so a bad
   combination is one error at once rather than after a long load;
3. glibc malloc keeps freed memory (`model.cpu.malloc_tuning`), before the weights are allocated;
4. the checkpoint loads in that device and dtype; a GGUF file on a CPU keeps its own bits unless
   asked otherwise (`low_bit_gguf`: quantization "none"; "dequantize" gives float weights);
5. `prepare_for_inference`: quantization first, then the CPU wing (`optimize_for_cpu`), which
   leaves int8 and int4 layers as they are (`quantize` refuses to run after it);
6. the tokenizer the checkpoint names, and the optional draft model of speculative decoding
   through the same steps, which must use the same tokenizer;
7. the memory the load freed goes back to the system (`release_freed_memory`): step 3 keeps freed
   memory for good, and a load frees several times the weights' size in temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from gptserve.model.checkpoint import load_checkpoint
from gptserve.model.cpu import optimize_for_cpu
from gptserve.model.cpu.malloc_tuning import release_freed_memory, retain_freed_memory
from gptserve.model.cpu.onednn_linear import keep_rows_alike
from gptserve.model.dtypes import DTYPES
from gptserve.model.gguf.quantized import split_head_for_8_bit_rows
from gptserve.model.gpt import GPT
from gptserve.model.int4_linear import int4_supported, use_int8_activations
from gptserve.model.quantize import (
    QuantizeError,
    check_quantization,
    keep_int8_kernel,
    quantize,
    weight_bytes,
)
from gptserve.model.tokenizers import Tokenizer, load_tokenizer

DEVICES = ("auto", "cpu", "cuda")


class ModelLoadError(RuntimeError):
    """The checkpoint cannot be served as asked; the message is one line for the user."""


@dataclass(frozen=True)
class InferenceModel:
    """A checkpoint loaded and prepared for the engine."""

    model: GPT
    tokenizer: Tokenizer
    name: str  # the checkpoint directory's name
    path: Path
    device: torch.device
    dtype: torch.dtype  # of the activations (and of the weights unless quantized)
    quantization: str
    weight_bytes: int  # the weights as served, each matrix once (before the CPU wing's layouts;
    # a GGUF file's quantized token table, read from the file on use, is not in memory)
    draft: GPT | None = None  # the draft model of speculative decoding


def resolve_device(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """The device and dtype "auto" (or a name) stands for; raises ModelLoadError."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but CUDA is not available")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {device!r}; choose from {DEVICES}") from None
    if dtype == "auto":
        return resolved, torch.bfloat16 if resolved.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose from auto, {', '.join(DTYPES)}")
    return resolved, DTYPES[dtype]


def check_load(
    device: str = "auto", dtype: str = "auto", quantization: str = "none",
    batch_invariant: bool = False, int8_activations: bool = False,
) -> tuple[torch.device, torch.dtype]:  # fmt: skip
    """The checks that need no loading: the device, the dtype, and the quantization with both.
    Returns the resolved device and dtype; raises ModelLoadError."""
    resolved, torch_dtype = resolve_device(device, dtype)
    try:
        check_quantization(quantization, resolved, torch_dtype)
    except QuantizeError as exc:
        raise ModelLoadError(str(exc)) from None
    if batch_invariant and (resolved.type != "cpu" or torch_dtype == torch.float16):
        raise ModelLoadError(
            "--batch-invariant holds on a CPU in float32 or bfloat16 (with or without "
            f"--quantize int8), not on {resolved.type} in {str(torch_dtype).removeprefix('torch.')}"
        )
    if int8_activations and (resolved.type != "cpu" or quantization != "none"):
        where = f"--quantize {quantization}" if quantization != "none" else resolved.type
        raise ModelLoadError(
            "--int8-activations takes a GGUF file's int4 products at their own bits on a CPU, "
            f"not {where}"
        )
    return resolved, torch_dtype


def low_bit_gguf(path: str | Path, device: torch.device, quantization: str) -> bool:
    """Whether a checkpoint loads at its own low bits: a GGUF file, on a CPU with PyTorch's int4
    kernel, unless a quantization ("int8") or float weights ("dequantize") are asked for. Elsewhere
    a GGUF file is dequantized to float."""
    path = Path(path)
    is_gguf = path.suffix == ".gguf" and path.is_file()
    return is_gguf and quantization == "none" and device.type == "cpu" and int4_supported()


def _load(path: Path, device: torch.device, dtype: torch.dtype, quantization: str) -> GPT:
    low_bit = low_bit_gguf(path, device, quantization)
    return load_checkpoint(path, device=device, dtype=dtype, low_bit=low_bit)


def int8_activations_on(model: GPT) -> int:
    """`--int8-activations` on a loaded model, in place: a refined Q8_0 head as int4 groups
    (`split_head_for_8_bit_rows`), then every compiled int4 product with 8-bit rows. Returns how
    many products take them (0: none could)."""
    split_head_for_8_bit_rows(model)
    return use_int8_activations(model)


def prepare_for_inference(model: GPT, quantization: str = "none") -> GPT:
    """Quantize a loaded model, then give it the CPU wing's layouts (on a CPU); in place.

    The order matters: the CPU wing leaves int8 layers as they are, and `quantize` refuses a
    model that already has the CPU layouts. The model can no longer be trained or saved.
    """
    return optimize_for_cpu(quantize(model, quantization))


def load_for_inference(
    path: str | Path,
    *,
    device: str = "auto",
    dtype: str = "auto",
    quantization: str = "none",
    draft_path: str | Path | None = None,
    batch_invariant: bool = False,
    int8_activations: bool = False,
) -> InferenceModel:
    """Load a checkpoint (ours, a Hugging Face directory or a GGUF file) ready to serve; raises
    ModelLoadError with a one-line message.

    `batch_invariant`: the model's products compute a row alike whatever the row count (int8
    keeps its int8 kernel), the part of batch invariance that is the model's; the engine's
    `EngineConfig.batch_invariant` is the attention's part. `int8_activations`: a GGUF file's int4
    products (Q4_0, Q4_1, Q4_K, Q8_0) take their input rows rounded to 8 bits per block of 32, as
    llama.cpp's do (`model.int4_linear`): faster, no longer the float32 oracle's answers.
    """
    path = Path(path)
    resolved, torch_dtype = check_load(
        device, dtype, quantization, batch_invariant, int8_activations
    )
    retain_freed_memory()  # process-wide; before the weights are allocated
    try:
        model = quantize(_load(path, resolved, torch_dtype, quantization), quantization)
        if batch_invariant:
            keep_int8_kernel(model)
        if int8_activations and not int8_activations_on(model):
            raise ModelLoadError(
                "--int8-activations needs int4 products: a GGUF file's Q4_0, Q4_1, Q4_K or Q8_0 "
                "matrices at their own bits, on a CPU where the compiled kernels build"
            )
        size = weight_bytes(model)
        model = optimize_for_cpu(model, batch_invariant=batch_invariant)
        if batch_invariant:
            keep_rows_alike(model)  # oneDNN's products past a decode batch's rows, too
        draft = None
        if draft_path is not None:
            draft = _load(Path(draft_path), resolved, torch_dtype, quantization)
            draft = prepare_for_inference(draft, quantization)
        tokenizer = load_tokenizer(model.config.tokenizer, path)
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelLoadError(_first_line(exc)) from None
    finally:
        release_freed_memory()
    if draft is not None and draft.config.tokenizer != model.config.tokenizer:
        raise ModelLoadError(
            f"the draft model's tokenizer {draft.config.tokenizer!r} is not the model's "
            f"{model.config.tokenizer!r}"
        )
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ModelLoadError(
            f"the model's vocab_size {model.config.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size}"
        )
    return InferenceModel(
        model=model, tokenizer=tokenizer, name=path.resolve().name, path=path, device=resolved,
        dtype=torch_dtype, quantization=quantization, weight_bytes=size, draft=draft,
    )  # fmt: skip


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else repr(exc)
