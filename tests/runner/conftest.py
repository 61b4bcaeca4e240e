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


@pytest.fixture
def one_process_group(tmp_path: Path):  # noqa: ANN201
    """A gloo group of this process alone: its all-reduce is the identity, so a replica
    told it is one of two sees its own gradient as the world's sum (a reference built for
    ``world_size=2`` is then fed half the gradient: it divides by two)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plans")
