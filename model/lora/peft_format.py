"""PEFT's LoRA adapter directory, read into a `LoraAdapter` and written from one.

A PEFT adapter is `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, rank_pattern,
alpha_pattern, base_model_name_or_path, ...) and `adapter_model.safetensors`, whose tensors are
"base_model.model.<module>.lora_A.weight" (rank, in) and "...lora_B.weight" (out, rank) for each
adapted Hugging Face module; the update of a module is scaling * B @ A, with scaling alpha / r
(alpha / sqrt(r) with rsLoRA). GPT-2's Conv1D modules (fan_in_fan_out) store A and B the same way.

Module names map to our layers as `model.lora.modules` says. A module whose rank or alpha differs
(rank_pattern, alpha_pattern) keeps its own rank and its scaling is folded into its B, so an
adapter has one scaling. Writing, a PEFT module that our pieces cover only in part (q and v of
GPT-2's fused c_attn) gets their A's stacked and a block B with zero rows elsewhere: the same
update at the sum of their ranks, written as that module's rank_pattern and alpha_pattern.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from gptserve.model.checkpoint import atomic_write, read_json_object
from gptserve.model.config import ModelConfig
from gptserve.model.lora.adapter import LoraAdapter, LoraPiece
from gptserve.model.lora.modules import (
    NOT_ADAPTABLE,
    Slice,
    hf_block_prefix,
    hf_module_slice,
    hf_modules,
    is_llama_family,
)
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
PREFIX = "base_model.model."
# LoraConfig fields that change what the adapter computes beyond scaling * B @ A, with the
# value that means "off"
_UNSUPPORTED = {
    "use_dora": (False, "DoRA (use_dora)"),
    "modules_to_save": (None, "modules_to_save (fully trained modules)"),
    "lora_bias": (False, "lora_bias"),
    "layer_replication": (None, "layer_replication"),
    "target_parameters": (None, "target_parameters"),
    "trainable_token_indices": (None, "trainable_token_indices"),
    "use_qalora": (False, "QA-LoRA (use_qalora)"),
    "alora_invocation_tokens": (None, "aLoRA (alora_invocation_tokens)"),
    "use_bdlora": (None, "BD-LoRA (use_bdlora)"),
    "arrow_config": (None, "Arrow routing (arrow_config)"),
}
_KEY = re.compile(r"(model\.layers|transformer\.h)\.(\d+)\.(.+)\.lora_([AB])\.weight")


class AdapterError(ValueError):
    """An adapter directory that cannot be read, or that our model cannot apply."""


class BaseMismatchError(AdapterError):
    """An adapter made for another base model: a module, layer or shape this one lacks."""


def read_peft(directory: str | Path, config: ModelConfig) -> LoraAdapter:
    """The PEFT LoRA adapter in `directory`, for a base model of `config`, as our pieces."""
    directory = Path(directory)
    raw = _read_config(directory)
    rank, alpha, rslora = _rank_alpha(raw)
    _check_targets(raw.get("target_modules"), config)
    tensors = _read_tensors(directory)
    scaling = _scaling(alpha, rank, rslora)
    modules = _group_modules(tensors, config)
    rank_pattern = raw.get("rank_pattern") or {}
    alpha_pattern = raw.get("alpha_pattern") or {}
    pieces: dict[str, list[LoraPiece]] = {}
    for (i, module), ab in sorted(modules.items()):
        name = hf_block_prefix(config, i) + module
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{directory}: {name} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        r = _pattern_value(rank_pattern, name, rank)
        s = hf_module_slice(config, i, module)
        _check_shapes(name, a, b, r, s, directory)
        own = _scaling(_pattern_value(alpha_pattern, name, alpha), r, rslora)
        if own != scaling:  # one scaling per adapter: this module's ratio goes into its B
            b = (b.float() * (own / scaling)).to(b.dtype)
        pieces.setdefault(s.layer, []).append(LoraPiece(a=a, b=b, offset=s.offset))
    if not pieces:
        raise AdapterError(f"{directory}/{WEIGHTS_FILE} holds no LoRA weights")
    for layer in pieces.values():
        layer.sort(key=lambda p: p.offset)
    base = raw.get("base_model_name_or_path")
    return LoraAdapter(
        name=directory.name,
        rank=rank,
        alpha=alpha,
        scaling=scaling,
        pieces=pieces,
        base=base if isinstance(base, str) else None,
    )


def write_peft(
    adapter: LoraAdapter,
    directory: str | Path,
    config: ModelConfig,
    base_name: str | None,
    dropout: float = 0.0,
) -> None:
    """Write `adapter` into `directory` as PEFT's adapter_config.json and
    adapter_model.safetensors for the Hugging Face model of `config` named `base_name`."""
    directory = Path(directory)
    _check_layers(adapter, config)
    rslora = _is_rslora(adapter)
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}  # every written module's rank, by its Hugging Face name
    for i in range(config.n_layer):
        for module in hf_modules(config):
            ab = _module_update(adapter, hf_module_slice(config, i, module))
            if ab is None:
                continue
            name = hf_block_prefix(config, i) + module
            tensors[f"{PREFIX}{name}.lora_A.weight"] = ab[0].contiguous()
            tensors[f"{PREFIX}{name}.lora_B.weight"] = ab[1].contiguous()
            ranks[name] = ab[0].shape[0]
    if not tensors:
        raise AdapterError(f"adapter {adapter.name!r} has no pieces to write")
    targets, rank_pattern = _targets_and_ranks(config, ranks, adapter.rank)
    alpha_pattern = {
        key: adapter.scaling * (math.sqrt(r) if rslora else r) for key, r in rank_pattern.items()
    }
    alpha = int(adapter.alpha) if float(adapter.alpha).is_integer() else adapter.alpha
    raw: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": adapter.rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "lora_dropout": dropout,
        "target_modules": targets,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "fan_in_fan_out": not is_llama_family(config),  # GPT-2's Conv1D stores (in, out)
        "bias": "none",
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(
        directory / WEIGHTS_FILE,
        lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}),
    )
    text = json.dumps(raw, indent=2) + "\n"
    atomic_write(directory / CONFIG_FILE, lambda tmp: Path(tmp).write_text(text))


# ---------------------------------------------------------------------------------- reading


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{directory} has no {CONFIG_FILE} (not a PEFT adapter directory)")
    raw = read_json_object(path, AdapterError)
    kind = raw.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{path}: peft_type {kind!r} is not supported (only LORA)")
    for key, (off, what) in _UNSUPPORTED.items():
        value = raw.get(key, off)
        if value not in (off, None, False, [], {}):
            raise AdapterError(f"{path}: {what} is not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias {raw['bias']!r} (trained base biases) is not supported")
    return raw


def _rank_alpha(raw: dict[str, Any]) -> tuple[int, float, bool]:
    rank, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(raw.get(key) or {}, dict):
            raise AdapterError(f"{CONFIG_FILE}: {key} must be an object")
    return rank, float(alpha), bool(raw.get("use_rslora", False))


def _scaling(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _pattern_value(pattern: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the end of `name`."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _check_targets(targets: Any, config: ModelConfig) -> None:
    """Each listed target_modules name must end in a module we adapt (a regex is not checked:
    the weights say what it matched)."""
    if not isinstance(targets, list):
        return
    known = {m.rsplit(".", 1)[-1] for m in hf_modules(config)}
    family = "Llama-family" if is_llama_family(config) else "GPT-2-shaped"
    for target in targets:
        last = str(target).rsplit(".", 1)[-1]
        if last in NOT_ADAPTABLE:
            raise AdapterError(
                f"{CONFIG_FILE}: target {target!r} is an embedding or the output head; only the "
                f"attention and MLP projections can be adapted"
            )
        if last not in known:
            raise BaseMismatchError(
                f"{CONFIG_FILE}: target {target!r} is no module of a {family} model (its "
                f"projections: {', '.join(sorted(known))})"
            )


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS_FILE
    if path.is_file():
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise AdapterError(f"{path} is unreadable or truncated: {exc}") from None
    binary = directory / BIN_FILE
    if binary.is_file():
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for corrupt or unsafe pickles
            raise AdapterError(f"{binary} is unreadable or not plain tensors: {exc}") from None
        if isinstance(state, dict):
            return state
        raise AdapterError(f"{binary} does not hold a state dict")
    raise AdapterError(f"{directory} has no {WEIGHTS_FILE} or {BIN_FILE}")


def _group_modules(
    tensors: dict[str, torch.Tensor], config: ModelConfig
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(block, module within it): {"A": tensor, "B": tensor}}; AdapterError for a tensor that is
    not a plain LoRA matrix of a block's projection."""
    blocks = "model.layers" if is_llama_family(config) else "transformer.h"
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PREFIX)
        m = _KEY.fullmatch(name)
        if m is None:
            raise AdapterError(f"{WEIGHTS_FILE}: {_what_is(name)}")
        if m[1] != blocks or m[3] not in hf_modules(config):
            family = "Llama-family" if is_llama_family(config) else "GPT-2-shaped"
            raise BaseMismatchError(f"{WEIGHTS_FILE}: {name} is no module of a {family} model")
        i = int(m[2])
        if i >= config.n_layer:
            raise BaseMismatchError(
                f"{WEIGHTS_FILE}: {name} adapts layer {i}; the model has {config.n_layer} layers"
            )
        out.setdefault((i, m[3]), {})[m[4]] = tensor
    return out


def _what_is(name: str) -> str:
    """Why a tensor of the adapter file is not one we can apply, in words."""
    if "lora_magnitude_vector" in name:
        return f"{name}: DoRA (use_dora) is not supported"
    if "lora_embedding" in name or name.split(".")[-2:-1] in (["wte"], ["embed_tokens"]):
        return f"{name}: an embedding adapter is not supported"
    if name.endswith(".lora_B.bias"):
        return f"{name}: lora_bias is not supported"
    if "lm_head" in name:
        return f"{name}: an output-head adapter is not supported"
    return f"{name} is not a LoRA matrix we can apply (modules_to_save or another method?)"


def _check_shapes(
    name: str, a: torch.Tensor, b: torch.Tensor, rank: int, s: Slice, directory: Path
) -> None:
    """AdapterError for one module's A and B of the wrong kind or rank, BaseMismatchError for
    shapes another base model has."""
    if a.dim() != 2 or b.dim() != 2 or not a.is_floating_point() or not b.is_floating_point():
        raise AdapterError(f"{directory}: {name}: lora_A and lora_B must be float matrices")
    if a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(
            f"{directory}: {name}: rank {a.shape[0]} in the weights, {rank} in {CONFIG_FILE}"
        )
    if a.shape[1] != s.in_features or b.shape[0] != s.rows:
        raise BaseMismatchError(
            f"{directory}: {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
            f"fit the base model's ({s.rows} x {s.in_features}) module (another base model?)"
        )


# ---------------------------------------------------------------------------------- writing


def _is_rslora(adapter: LoraAdapter) -> bool:
    """Whether the adapter's scaling is alpha / sqrt(r) (rsLoRA) rather than alpha / r."""
    if math.isclose(adapter.scaling, adapter.alpha / adapter.rank, rel_tol=1e-6):
        return False
    if math.isclose(adapter.scaling, adapter.alpha / math.sqrt(adapter.rank), rel_tol=1e-6):
        return True
    raise AdapterError(
        f"adapter {adapter.name!r}: scaling {adapter.scaling} is neither alpha / r nor "
        "alpha / sqrt(r)"
    )


def _check_layers(adapter: LoraAdapter, config: ModelConfig) -> None:
    """Every piece must lie in a projection of `config`'s model."""
    bounds = {}
    for i in range(config.n_layer):
        for module in hf_modules(config):
            s = hf_module_slice(config, i, module)
            end = bounds.get(s.layer, (0, 0))[0]
            bounds[s.layer] = (max(end, s.offset + s.rows), s.in_features)
    for layer, pieces in adapter.pieces.items():
        if layer not in bounds:
            raise AdapterError(f"adapter {adapter.name!r}: {layer} is no projection of the model")
        rows, in_features = bounds[layer]
        for p in pieces:
            if p.offset < 0 or p.offset + p.rows > rows or p.a.shape[1] != in_features:
                raise AdapterError(
                    f"adapter {adapter.name!r}: a piece of {layer} ({p.rows} rows from "
                    f"{p.offset}, {p.a.shape[1]} inputs) does not fit it ({rows} x {in_features})"
                )


def _module_update(adapter: LoraAdapter, s: Slice) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A (rank, in) and B (s.rows, rank) of the pieces over rows [s.offset, s.offset + s.rows)
    of s.layer: one piece's own when it covers exactly those rows, else their A's stacked and
    each B's overlapping rows in its own columns. None when no piece overlaps."""
    end = s.offset + s.rows
    over = [
        p
        for p in adapter.pieces.get(s.layer, [])
        if p.offset < end and s.offset < p.offset + p.rows
    ]
    if not over:
        return None
    if len(over) == 1 and over[0].offset == s.offset and over[0].rows == s.rows:
        return over[0].a.detach(), over[0].b.detach()
    a = torch.cat([p.a.detach() for p in over])  # (sum of ranks, in)
    b = a.new_zeros(s.rows, a.shape[0])  # (s.rows, sum of ranks)
    col = 0
    for p in over:
        lo, hi = max(s.offset, p.offset), min(end, p.offset + p.rows)
        rank = p.a.shape[0]
        b[lo - s.offset : hi - s.offset, col : col + rank] = p.b.detach()[
            lo - p.offset : hi - p.offset
        ]
        col += rank
    return a, b


def _targets_and_ranks(
    config: ModelConfig, ranks: dict[str, int], rank: int
) -> tuple[list[str], dict[str, int]]:
    """target_modules and rank_pattern for the written modules: a module's short name (q_proj;
    GPT-2's attn.c_proj and mlp.c_proj apart) where every layer has it at one rank, else the
    full names of those written."""
    lasts = [m.rsplit(".", 1)[-1] for m in hf_modules(config)]
    targets: list[str] = []
    pattern: dict[str, int] = {}
    for module, last in zip(hf_modules(config), lasts):
        short = last if lasts.count(last) == 1 else module
        names = [hf_block_prefix(config, i) + module for i in range(config.n_layer)]
        written = {n: ranks[n] for n in names if n in ranks}
        if len(written) == config.n_layer and len(set(written.values())) == 1:
            targets.append(short)
            if written[names[0]] != rank:
                pattern[short] = written[names[0]]
            continue
        targets.extend(written)
        pattern.update({n: r for n, r in written.items() if r != rank})
    return targets, pattern
