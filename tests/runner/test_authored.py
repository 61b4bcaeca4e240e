"""The runner trains a model as its author wrote it (tests/models/authored.py).

Its root module makes ``pos``, ``query`` and a ``temperature`` buffer in ``__init__`` with
its own recipe and has no ``reset_parameters``; its batch is built on the CPU; its first
input is flat jagged ids (12 values for 4 samples). The runner must take the author's
values for those tensors, train exactly as the single-process reference on 1 and 2 ranks,
and report the stated batch (4 per rank), not the ids' length.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gemc.backends.torch.init import derive_seed
from gemc.backends.torch.reference import ReferenceTrainer, reference_losses
from gemc.backends.torch.runner import RunOptions, run

from gemc.api import compile as gemc_compile
from gemc.api import load_model
from gemc.plan import write_plan
from tests.models import authored
from tests.runner.harness import REPO, run_scenarios, variant

ENTRY = f"{REPO / 'tests' / 'models' / 'authored.py'}:build"
STEPS = 6


def _close(got: list[float], ref: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)


def test_reference_takes_the_authors_recipe_and_seeded_resets() -> None:
    trainer = ReferenceTrainer(load_model(ENTRY), seed=3)
    model = trainer.spec.model
    # the recipe, replayed by hand: the tables are built on meta (they draw nothing), so
    # pos and query are the first draws under the author-build seed
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(3, "author-build"))
        pos = torch.randn(authored.HIST, authored.DIM) * 0.02
        query = torch.randn(authored.DIM) * 0.5 + 1.0
    torch.testing.assert_close(model.pos.data, pos)
    torch.testing.assert_close(model.query.data, query)
    torch.testing.assert_close(model.temperature, torch.full((1,), authored.DIM**-0.5))
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(3, "module", "tower.0"))
        tower0 = torch.nn.Linear(2 * authored.DIM, 16)
    torch.testing.assert_close(model.tower[0].weight.data, tower0.weight.data)
    summary = trainer.init_report.summary()
    assert summary["per_module"] == {
        "(root)": "author's __init__", "tower.0": "reset_parameters",
        "tower.2": "reset_parameters",
    }
    assert summary["tables"] == 2
    assert summary["elements"]["table fill"] == 2 * authored.ROWS * authored.DIM


def test_to_cpu_calls_in_the_model_change_nothing_in_its_initial_values() -> None:
    plain = ReferenceTrainer(load_model(ENTRY)).spec.model
    moved = ReferenceTrainer(load_model(ENTRY, {"params_on_cpu": True})).spec.model
    for (name, a), (_, b) in zip(plain.state_dict().items(), moved.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_a_model_written_for_a_gpu_builds_and_initializes_on_the_cpu() -> None:
    spec = load_model(ENTRY, {"gpu_style": True})
    assert spec.model.bias.is_meta
    trainer = ReferenceTrainer(spec)
    assert spec.model.bias.device.type == "cpu"
    torch.testing.assert_close(spec.model.bias.data, torch.full((1,), 0.5))
    assert "bias" in trainer.init_report.author_tensors
    assert trainer.step(0) > 0


def test_a_model_built_for_real_keeps_its_own_author_values() -> None:
    torch.manual_seed(11)
    spec = authored.build()  # outside gemc: real values on the CPU, no origin
    pos, query = spec.model.pos.detach().clone(), spec.model.query.detach().clone()
    trainer = ReferenceTrainer(spec)
    torch.testing.assert_close(spec.model.pos.data, pos)
    torch.testing.assert_close(spec.model.query.data, query)
    assert trainer.init_report.summary()["author_source"].startswith("the model's own values")
    # the tables are still gemc's fill, not what the real build drew
    assert trainer.init_report.summary()["per_module"].get("bag") is None


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    out = tmp_path_factory.mktemp("authored")
    paths = {}
    for world in (1, 2):
        plan = gemc_compile(ENTRY, {}, topology=f"h200:1x{world}")
        if world == 2:  # both tables split over the ranks, dense replicated
            plan = variant(plan, {"bag.weight": ("row_wise", [0, 1]),
                                  "items.weight": ("column_wise", [0, 1])},
                           {r["name"]: "ddp" for r in plan["regions"]})
        else:
            plan = variant(plan)
        paths[world] = out / f"w{world}.json"
        write_plan(paths[world], plan)
    return paths


def test_one_rank_matches_the_reference_and_reports_the_stated_batch(plans) -> None:
    res = run(plans[1], RunOptions(steps=STEPS, device="cpu", progress=False))
    _close([loss for _, loss in res.losses],
           reference_losses(load_model(ENTRY), steps=STEPS, world_size=1))
    rep = res.report
    assert rep["local_batch"] == authored.B != authored.N_IDS
    assert rep["global_batch"] == authored.B
    assert rep["batch_size_source"] == "ModelSpec.batch_size"
    assert rep["samples_per_s"] == pytest.approx(authored.B / (rep["step_ms"] / 1e3))
    init = rep["initialization"]
    assert init["per_module"]["(root)"] == "author's __init__"
    assert sorted(init["author_tensors"]) == ["pos", "query", "temperature"]
    assert "tables left on meta" in init["definition"]


def test_two_ranks_match_the_reference_and_report_the_global_batch(plans, tmp_path) -> None:
    report = tmp_path / "w2.run.json"
    got = run_scenarios(2, [{"name": "w2", "plan": str(plans[2]),
                             "phases": [{"steps": STEPS, "report": str(report)}]}],
                        tmp_path / "out.json")
    _close([loss for _, loss in got["w2"][0]],
           reference_losses(load_model(ENTRY), steps=STEPS, world_size=2))
    rep = json.loads(report.read_text())
    assert (rep["local_batch"], rep["global_batch"]) == (authored.B, 2 * authored.B)
    assert rep["samples_per_s"] == pytest.approx(2 * authored.B / (rep["step_ms"] / 1e3))


def test_an_unstated_batch_is_null_not_guessed(plans, tmp_path) -> None:
    plan = json.loads(plans[1].read_text())
    plan["model"]["args"] = {"state_batch": False}
    # the fingerprint does not depend on the batch statement: same graph, same shapes
    path = tmp_path / "unstated.json"
    write_plan(path, plan)
    with pytest.warns(UserWarning, match="states no batch size"):
        res = run(path, RunOptions(steps=2, device="cpu", progress=False))
    rep = res.report
    assert rep["local_batch"] is None and rep["global_batch"] is None
    assert rep["samples_per_s"] is None
    assert "batch_size=B" in rep["batch_size_note"]


class _Unseeded(torch.nn.Module):
    """An author recipe that draws from a per-process source (here: the process id)."""

    def __init__(self) -> None:
        super().__init__()
        import os

        g = torch.Generator().manual_seed(os.getpid())
        self.w = torch.nn.Parameter(torch.randn(6, generator=g))


def _replica_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from gemc.backends.torch.init import init_dense_

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with torch.device("meta"):
            model = _Unseeded()
        model.to_empty(device="cpu")
        init_dense_(model, seed=0, author_build=_Unseeded)
        values: list = [None] * world
        dist.all_gather_object(values, model.w.data.tolist())
        if rank == 0:
            Path(out).write_text(json.dumps(values))
    finally:
        dist.destroy_process_group()
    from gemc.backends.torch.comm import exit_skipping_finalization

    exit_skipping_finalization(0)  # gloo can abort in finalization (seen here in CI runs)


def test_every_replica_starts_from_rank_0s_author_values(tmp_path) -> None:
    from tests.runner.harness import free_port, start_ranks

    out = tmp_path / "values.json"
    start_ranks(_replica_worker, (2, free_port(), str(out)), 2)
    values = json.loads(out.read_text())
    assert values[0] == values[1]  # the processes' own draws differed; rank 0's won
