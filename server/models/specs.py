"""Which models a server of several serves, by name: the repeated --model flags and --models-dir.

`--model PATH` is named by the GGUF file's stem, the folder's name, or the known model's name;
`--model NAME=PATH` names it. In `--models-dir DIR` every GGUF file (named by its stem) and every
folder with a config.json (a Hugging Face directory or a train.py output, named by the folder)
is a model; whatever there cannot be read is kept with its error, so that the others serve and
/v1/models names the bad one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from gptserve.model.known_models import known_name
from gptserve.server.settings import Settings, SettingsError, split_named

log = logging.getLogger(__name__)
GGUF_MAGIC = b"GGUF"
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class ModelSpec:
    """One served model: its name in the API, what --model gives for it (a path or a known
    model's name), and why it cannot be served when that was found at start."""

    name: str
    source: str
    error: str | None = None


def spec_from_flag(flag: str) -> ModelSpec:
    """One --model flag's model: `NAME=PATH`, a known model's name, a GGUF file or a folder."""
    name, source = split_named(flag)
    if name is None:
        name = known_name(source)
    if name is None:
        path = Path(source).expanduser()
        name = path.stem if path.suffix == ".gguf" else (path.resolve().name or source)
    return ModelSpec(name, source)


def scan_models_dir(directory: Path) -> list[ModelSpec]:
    """The models in `directory`, sorted by name: each with its error when it cannot be read."""
    specs = []
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        raise SettingsError(f"--models-dir: cannot read {directory}: {exc}") from None
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if entry.suffix == ".gguf" and not entry.is_dir():
            specs.append(ModelSpec(entry.stem, str(entry), _gguf_error(entry)))
        elif entry.is_dir() and (entry / "config.json").exists():
            specs.append(ModelSpec(entry.name, str(entry), _checkpoint_error(entry)))
    return specs


def _gguf_error(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        return f"cannot read {path.name}: {exc.strerror or exc}"
    return None if magic == GGUF_MAGIC else f"{path.name} is not a GGUF file"


def _checkpoint_error(directory: Path) -> str | None:
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{directory.name}/config.json cannot be read: {exc}"
    if not isinstance(config, dict):
        return f"{directory.name}/config.json is not a JSON object"
    if not any((directory / w).is_file() for w in _WEIGHTS):
        return f"{directory.name} has no weights (model.safetensors or pytorch_model.bin)"
    return None


def model_specs(settings: Settings) -> list[ModelSpec]:
    """Every model of a server of several (`settings.serves_many`), the default first: the
    --model flags in order, then --models-dir's. Raises SettingsError for two --model flags of
    one name; a folder entry whose name a --model took is kept with that error."""
    flags = [settings.model] if settings.model else []
    specs = [spec_from_flag(f) for f in [*flags, *settings.extra_models]]
    names = [s.name for s in specs]
    for name in names:
        if names.count(name) > 1:
            raise SettingsError(f"--model: two models are named {name!r} (use --model NAME=PATH)")
    if settings.models_dir:
        for spec in scan_models_dir(Path(settings.models_dir)):
            if spec.name in names:
                spec = replace(spec, error=f"another model is named {spec.name!r}")
            else:
                names.append(spec.name)
            specs.append(spec)
    if not specs:
        raise SettingsError(f"--models-dir: no model in {settings.models_dir}")
    if specs[0].error is not None:  # the default: the first that can be served, when one can
        good = [s for s in specs if s.error is None]
        specs = good[:1] + [s for s in specs if s not in good[:1]]
    for spec in specs:
        if spec.error is not None:
            log.error("model %s cannot be served: %s", spec.name, spec.error)
    return specs


def check_preload(settings: Settings, names: list[str]) -> None:
    """SettingsError for a --preload that names no model of this server of several."""
    for name in settings.preload:
        if name not in names:
            raise SettingsError(f"--preload {name}: no such model (the models: {', '.join(names)})")


def model_settings(settings: Settings, spec: ModelSpec, default: bool) -> Settings:
    """The settings one model of a server of several loads and serves with: the server's, its
    own path and name; --lora's adapters belong to the default model only."""
    return replace(
        settings, model=spec.source, served_model_name=spec.name, extra_models=[],
        models_dir=None, preload=[], lora=settings.lora if default else [],
    )  # fmt: skip
