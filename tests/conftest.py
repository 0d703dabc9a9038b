from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO / "data" / "shakespeare.txt"


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.fail(f"training corpus not found at {SHAKESPEARE}")
    return SHAKESPEARE
