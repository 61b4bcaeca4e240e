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
# `-n 2` run on the loaded 2-core CPU box at a5a9d46; "scaled": that time times the file's
# CPU-time ratio after / before the test cuts of session 33, measured with `-n 0`), the
# longest first. pytest-xdist's loadfile hands files to its two workers in the order of
# its queue, one at a time as each frees up: a 95-s file handed out last ends the run ~95 s
# after the other worker went idle (the same suite took 13:49 and 16:20 on one box).
# Longest first bounds that tail by the shortest files. The queue is the collection order
# only with `--no-loadscope-reorder` (pyproject.toml's addopts): by default pytest-xdist
# queues the files by their number of tests, most first, which put the one-test files
# (the zoo's two-rank launch, the CLI's kill and resume, the plan-location runs: 20-45 s
# each) last. Files not listed keep their collection order after these.
LONGEST_FIRST = (
    "test_probes_sequence.py",  # 146 s (scaled)
    "test_probes_sequence_c.py",  # 135 s
    "zoo/test_zoo_gemc.py",  # 100 s (scaled)
    "kernels/test_uncovered_rows.py",  # 98 s
    "runner/test_distributed.py",  # 60 s (scaled)
    "runner/test_e2e_benchmark.py",  # 46 s
    "kernels/test_custom_ops.py",  # 44 s
    "test_bad_input_corpus.py",  # 40 s
    "zoo/test_zoo_two_ranks.py",  # 39 s (scaled)
    "runner/test_first_step_warm.py",  # 39 s (scaled)
    "solver/test_fit_is_predicted.py",  # 38 s
    "runner/test_table_precision.py",  # 37 s (scaled)
    "test_cli_signals_and_options.py",  # 34 s
    "kernels/test_benchmark_smoke.py",  # 34 s
    "fusion/test_transact_padding_reps.py",  # 31 s
    "fusion/test_guarded_packed_tokens.py",  # 28 s
    "cost_model/test_accuracy_benchmark.py",  # 28 s
    "runner/test_graph_breaks.py",  # 28 s
    "test_probes_sparse_d.py",  # 25 s
    "kernels/test_guarded_attention_under_inductor.py",  # 24 s
    "kernels/test_silu_backward_variants.py",  # 23 s
    "runner/test_plan_location.py",  # 23 s
    "kernels/test_batched_columns_in_graph.py",  # 23 s (scaled)
    "fusion/test_guarded_regions_compiled.py",  # 22 s
    "test_import_contracts.py",  # 21 s
    "fusion/test_causal_softmax_nan.py",  # 20 s
    "test_probes_sparse.py",  # 20 s
    "solver/test_balance.py",  # 19 s
    "fusion/test_row_reader_forms.py",  # 19 s
    "runner/test_cli.py",  # 18 s (scaled)
    "fusion/test_gathered_lookups.py",  # 17 s
    "fusion/test_match_silu_attention.py",  # 17 s
    "runner/test_graph_mode_tables.py",  # 17 s
    "runner/test_fp8_audit.py",  # 16 s
    "runner/test_exchange_precision.py",  # 16 s (scaled)
    "runner/test_units.py",  # 15 s
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
