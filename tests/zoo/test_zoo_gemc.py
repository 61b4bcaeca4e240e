"""Every zoo model and both bundled examples through gemc, as their authors wrote them.

``gemc compile`` (Python API, on the CPU, on meta): tiny at h200:1x1 and h200:1x8, the h200
preset at h200:1x1 (``--precision bf16``: see ``_compiled``), each timed. ``gemc run`` on the CPU: one rank in process with the plan's
generated kernels (Triton interpreted), and two gloo ranks in one launch for all models
(test_zoo_two_ranks.py, a file of its own: one pytest-xdist worker each), both 3 steps
against single-process eager training of the same model on the same batches
(``backends/torch/reference``). The plans are
run in fp32 (``harness.variant`` drops the compiler's bf16 sites, so both sides round the
same). The run report's ``local_batch`` and ``global_batch`` must be the batch the model
states, and samples/s must follow from it.

Kernels, for time (Triton interpreted on the CPU): the 1-rank runs keep every generated
kernel of the plan except ``batched_embedding_bag``, whose interpreted fused optimizer
update costs ~20 ms per looked-up id (measured: DLRM-DCNv2 tiny, 214 ids per sample, took
200 s for 2 steps with it); that kernel's graph mode is covered by
tests/runner/test_units.py. The bundled examples (gem, dlrm) run in module mode here: their
kernels are exercised by tests/fusion/test_gem.py and tests/runner (GEM tiny's 10 steps
with kernels take ~2 minutes interpreted). The 2-rank runs use ``--no-kernels`` (module mode); graph mode
across ranks is covered by tests/runner/test_distributed.py.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gemc.backends.torch.reference import reference_losses
from gemc.backends.torch.runner import RunOptions, run
from gemc.passes.precision import PrecisionOptions

from examples.zoo import MODELS
from gemc.api import compile as gemc_compile
from gemc.api import load_model
from gemc.plan import validate_plan
from tests.runner.harness import REPO, variant

ENTRY = {name: f"{REPO / 'examples' / 'zoo' / name}.py:build" for name in MODELS}
ENTRY["gem"] = f"{REPO / 'examples' / 'gem' / 'model.py'}:build"
ENTRY["dlrm"] = f"{REPO / 'examples' / 'dlrm' / 'model.py'}:build"
ALL = (*MODELS, "gem", "dlrm")
TINY = {name: {"preset": "tiny"} for name in ALL}
TINY["gem"] = {"preset": "tiny", "batch_size": 8}  # as tests/runner/test_distributed.py
STEPS = 3  # interpreted kernels: each step of a zoo model costs seconds on the CPU; three
# losses are two optimizer updates (step 2's loss follows step 1's update, step 3's both)
RTOL = 1e-4
SLOW_INTERPRETED = {"batched_embedding_bag"}  # see the module docstring
COMPILE_S = {"tiny": 30.0, "h200": 120.0}  # generous: a shared 2-core CI machine


@functools.cache
def _compiled(name: str, preset: str, topology: str,
              batch: int | None = None) -> tuple[dict[str, Any], float]:
    """The plan and its compile seconds. h200 compiles with ``--precision bf16``: the
    precision probe materialises the dense part on the CPU and runs fp32 steps (measured:
    Wukong h200 149 s, DLRM-DCNv2 97 s on this machine), which is the probe's cost, not
    the compile's; tiny compiles keep ``auto`` (probe included). ``batch``: tiny's
    ``batch_size`` replaced (test_zoo_two_ranks.TWO_RANK_BATCH)."""
    args = dict(_tiny(name, batch)) if preset == "tiny" else {"preset": preset}
    mode = "auto" if preset == "tiny" else "bf16"
    start = time.perf_counter()
    plan = gemc_compile(ENTRY[name], args, topology=topology,
                        precision=PrecisionOptions(mode=mode))
    return plan, time.perf_counter() - start


def _tiny(name: str, batch: int | None = None) -> dict[str, Any]:
    return TINY[name] if batch is None else {**TINY[name], "batch_size": batch}


def _stated_batch(name: str, batch: int | None = None) -> int:
    spec = load_model(ENTRY[name], _tiny(name, batch))
    size = spec.batch_size or spec.info.get("batch_size")
    assert isinstance(size, int) and size > 0, f"{name} states no batch size"
    return size


def _tables(name: str) -> int:
    model = load_model(ENTRY[name], TINY[name]).model
    return sum(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) for m in model.modules())


@pytest.mark.parametrize("topology", ["h200:1x1", "h200:1x8"])
@pytest.mark.parametrize("name", ALL)
def test_compile_tiny(name: str, topology: str) -> None:
    plan, seconds = _compiled(name, "tiny", topology)
    validate_plan(plan)
    world = int(topology.split("x")[-1])
    assert plan["mesh"]["world_size"] == world
    assert len(plan["tables"]) == _tables(name), "every nn.Embedding/EmbeddingBag is a table"
    assert plan["predicted"]["step_ms"] > 0
    assert plan["model"]["batch_size"] == _stated_batch(name), "the plan keeps the stated batch"
    assert seconds < COMPILE_S["tiny"], f"compile took {seconds:.1f}s"


@pytest.mark.parametrize("name", ALL)
def test_compile_h200_on_meta(name: str) -> None:
    plan, seconds = _compiled(name, "h200", "h200:1x1")
    validate_plan(plan)
    assert plan["model"]["args"]["preset"] == "h200"
    predicted = plan["predicted"]
    assert len(predicted["per_rank"]) == 1 and predicted["step_ms"] > 0
    assert 0 < predicted["max_memory_gb"] < 141, predicted["max_memory_gb"]  # one H200
    assert seconds < COMPILE_S["h200"], f"compile took {seconds:.1f}s"


def _check_report(report: dict[str, Any], batch: int, world: int) -> None:
    assert report["local_batch"] == batch, (report["local_batch"], batch)
    assert report["global_batch"] == batch * world
    step_ms = report.get("step_ms")
    sps = report["samples_per_s"]
    assert sps and step_ms, report
    assert sps == pytest.approx(batch * world / (step_ms / 1e3), rel=1e-6)


def _close(name: str, got: list[float], ref: list[float]) -> None:
    assert len(got) == len(ref) == STEPS
    bad = [(i + 1, g, r) for i, (g, r) in enumerate(zip(got, ref)) if abs(g - r) > RTOL * abs(r)]
    assert not bad, f"{name}: (step, gemc run, eager) off by more than rtol {RTOL}: {bad}"


WATCHED = {"din"}
"""The models whose one-rank run (test_run_one_rank_matches_eager) is also the graph-mode
run test_graph_mode_backward_and_table_step_never_wait_on_the_device reads, on the plan's
own table lookups: one run watched for syncs rather than two runs of the same plan. A run's
cost is mostly Dynamo's (DIN's packed region compiles twice: at step 1, and at step 2 with
its token count dynamic), so the second run cost as much as the first (~11 s)."""


def _one_rank_run(name: str, out: Path) -> tuple[Any, dict[str, Any], list[str]]:
    """The tiny plan of ``name`` at h200:1x1 run STEPS steps on one rank: (the run's result,
    the plan it ran, the ops that would make the host wait on the device found in the
    backward or the sparse optimizer's step; watched for :data:`WATCHED` only)."""
    kernels = name in MODELS  # the zoo's own; the examples' are tested elsewhere
    plan = variant(_compiled(name, "tiny", "h200:1x1")[0], kernels=kernels)
    plan["kernels"] = [k for k in plan["kernels"] if k["kind"] not in SLOW_INTERPRETED]
    found: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        if name in WATCHED:
            _watch_syncs(mp, found)
        res = run(plan, RunOptions(steps=STEPS, device="cpu", progress=False,
                                   report=str(out / "run.json")))
    return res, plan, found


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """``one_rank(name)``: :func:`_one_rank_run` of ``name``, run once for the module."""
    runs: dict[str, tuple[Any, dict[str, Any], list[str]]] = {}

    def get(name: str) -> tuple[Any, dict[str, Any], list[str]]:
        if name not in runs:
            runs[name] = _one_rank_run(name, tmp_path_factory.mktemp(f"run-{name}"))
        return runs[name]

    return get


@pytest.mark.parametrize("name", ALL)
def test_run_one_rank_matches_eager(name: str, one_rank) -> None:  # noqa: ANN001
    res, plan, _ = one_rank(name)
    ref = reference_losses(load_model(ENTRY[name], TINY[name]), steps=STEPS, world_size=1)
    _close(name, [loss for _, loss in res.losses], ref)
    _check_report(res.report, _stated_batch(name), 1)
    if plan["kernels"]:
        assert res.report["kernels_applied"], res.report.get("kernels_applied")


def _watch_syncs(mp: pytest.MonkeyPatch, found: list[str]) -> None:
    """Record in ``found`` every op that would make the host wait on the device run in a
    backward (the compiled graph's and the table lookups') or the sparse optimizer's step."""
    from gemc.backends.torch import sparse_optim

    from tests.runner.test_sync_free_tables import SyncOps

    backward, step = torch.Tensor.backward, sparse_optim.EmbeddingOptimizer.step

    def watched(fn):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            with SyncOps() as mode:
                out = fn(*args, **kwargs)
            found.extend(mode.found)
            return out
        return call

    mp.setattr(torch.Tensor, "backward", watched(backward))
    mp.setattr(sparse_optim.EmbeddingOptimizer, "step", watched(step))


@pytest.mark.parametrize("name,route", [("hstu", "sparse"), ("din", None)])
def test_graph_mode_backward_and_table_step_never_wait_on_the_device(
        name: str, route: str | None, one_rank) -> None:  # noqa: ANN001
    """Issue 16 item 3, end to end in graph mode: the H200 profiles showed HSTU's sparse
    route (its padded item table's masked backward, the optimizer's coalesce) and DIN's
    dense_grad tables (the optimizer's nonzero scan) syncing every step. No op that makes
    the host wait on the device runs in the backward (the compiled graph's and the table
    lookups') or the sparse optimizer's step, on either route (``route``: every table's
    plan lookup forced, else the plan's own: then the watched run is the one
    test_run_one_rank_matches_eager checks, :data:`WATCHED`)."""
    if route is None:
        assert name in WATCHED
        res, plan, found = one_rank(name)
        assert plan["kernels"], "graph mode: the plan's kernels"
        steps = STEPS
    else:
        plan = variant(_compiled(name, "tiny", "h200:1x1")[0], kernels=True)
        plan["kernels"] = [k for k in plan["kernels"] if k["kind"] not in SLOW_INTERPRETED]
        plan["tables"] = [{**t, "lookup": route} for t in plan["tables"]]
        found, steps = [], 2
        with pytest.MonkeyPatch.context() as mp:
            _watch_syncs(mp, found)
            res = run(plan, RunOptions(steps=steps, device="cpu", progress=False))
    assert len(res.losses) == steps
    paths = set(res.report["graph_executor"]["table_lookups"].values())
    assert paths == ({route} if route else {"dense_grad"}), paths
    assert not found, found
