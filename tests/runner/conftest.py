"""Plans for the runner tests, compiled once per session (compiling is the slow part)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.runner.harness import MODEL


@pytest.fixture(scope="session")
def base_plans() -> dict[int, dict[str, Any]]:
    """The test model compiled for 1, 2 (one host) and 4 ranks (2 hosts x 2 GPUs)."""
    from gemc.api import compile as gemc_compile

    return {
        world: gemc_compile(MODEL, {}, topology=topo)
        for world, topo in ((1, "h200:1x1"), (2, "h200:1x2"), (4, "h200:2x2"))
    }


@pytest.fixture(scope="session")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plans")
