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


# Test files by their measured time (setup, call and teardown summed; junit times of a
# `-n 2` run on the 2-core CPU box at 8a449e6), the longest first. pytest-xdist's loadfile
# hands files to its two workers in collection order, one at a time as each frees up: a
# 95-s file handed out last ends the run ~95 s after the other worker went idle (the same
# suite took 13:49 and 16:20 on one box). Longest first bounds that tail by the shortest
# files. Files not listed keep their order after these.
LONGEST_FIRST = (
    "runner/test_distributed.py",  # 95 s
    "test_probes_sequence.py",  # 93 s
    "test_probes_sequence_c.py",  # 93 s
    "zoo/test_zoo_gemc.py",  # 80 s
    "kernels/test_uncovered_rows.py",  # 50 s
    "runner/test_table_precision.py",  # 48 s
    "runner/test_first_step_warm.py",  # 47 s
    "runner/test_e2e_benchmark.py",  # 39 s
    "test_bad_input_corpus.py",  # 37 s
    "runner/test_graph_breaks.py",  # 32 s
    "zoo/test_zoo_two_ranks.py",  # 31 s
    "runner/test_cli.py",  # 30 s
    "solver/test_fit_is_predicted.py",  # 27 s
    "fusion/test_row_reader_forms.py",  # 25 s
    "test_probes_sparse_d.py",  # 24 s
    "runner/test_plan_location.py",  # 23 s
    "kernels/test_custom_ops.py",  # 23 s
    "runner/test_kernel_choices_and_cache.py",  # 22 s
    "fusion/test_guarded_regions_compiled.py",  # 22 s
    "test_probes_sparse.py",  # 21 s
    "runner/test_exchange_precision.py",  # 20 s
    "passes/test_attention_choice.py",  # 20 s
    "solver/test_balance.py",  # 19 s
    "fusion/test_gathered_lookups.py",  # 18 s
    "test_cli_signals_and_options.py",  # 18 s
    "runner/test_graph_mode_tables.py",  # 18 s
    "runner/test_table_exchange_benchmark.py",  # 17 s
    "kernels/test_benchmark_smoke.py",  # 17 s
    "kernels/test_batched_columns_in_graph.py",  # 17 s
    "fusion/test_causal_softmax_nan.py",  # 16 s
    "kernels/test_silu_backward_variants.py",  # 15 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run :data:`LONGEST_FIRST`'s files first, in its order; each file's tests in their
    own order (a stable sort by file)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests_dir = Path(__file__).resolve().parent

    def key(item: pytest.Item) -> int:
        try:
            name = Path(str(item.fspath)).resolve().relative_to(tests_dir).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(name, len(rank))

    items.sort(key=key)


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
