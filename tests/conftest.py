import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOY = str(REPO / "tests" / "models" / "toy.py")


@pytest.fixture
def toy_entrypoint() -> str:
    return f"{TOY}:build"


def check_golden(name: str, text: str) -> None:
    """Compare with tests/golden/NAME; GEMC_UPDATE_GOLDEN=1 rewrites it (review the diff)."""
    path = REPO / "tests" / "golden" / name
    if os.environ.get("GEMC_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run with GEMC_UPDATE_GOLDEN=1 and review it"
    expected = path.read_text()
    assert text == expected, (
        f"dump differs from {path}; if intended, regenerate with GEMC_UPDATE_GOLDEN=1"
    )
