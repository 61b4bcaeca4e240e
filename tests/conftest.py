import os
from pathlib import Path

import pytest
import torch

# gemc's Triton kernels run in Triton's interpreter on a CPU-only machine, which has to be
# chosen before Triton is first imported (``@triton.jit`` reads it at decoration, and
# torch.export imports Triton through torch._dynamo): here, before any test module. A test
# file run on its own got compiled-mode Triton otherwise (its kernels refused on the CPU).
# tests/kernels and tests/precision choose by GEMC_TEST_DEVICE, tests/fusion always.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# gemc's attention kernels against the model's own attention: a priced choice
# (passes/attention_choice), under which every tiny attention of the suite would stay the
# model's (gemc's host cost per guarded call, ~1 ms, dwarfs it). The tests of the kernels'
# matching and numerics test the kernels: they run with the kernel wherever a pass matches,
# as before the choice, here and in the processes they start. tests/passes/
# test_attention_choice.py sets the priced default itself and tests the choice.
os.environ.setdefault("GEMC_ATTENTION_KERNEL", "always")

from tests.triton_interpreter import install  # noqa: E402  (after the variable is chosen)

install()  # a no-op unless interpreted

REPO = Path(__file__).resolve().parent.parent
TOY = str(REPO / "tests" / "models" / "toy.py")


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker (the default run has two, ``-n 2`` in pyproject.toml) computes
    on one thread, as do the processes its tests start: the workers already keep the cores
    busy, and torch's default of one thread per core each would oversubscribe them (on a
    loaded 2-core machine thread synchronisation costs more than the tiny ops it splits)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


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
