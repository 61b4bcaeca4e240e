"""A model whose forward takes one dict batch trains as written (gemc.batch_structure).

Intent: the translation to a flat batch keeps the author's parameter names and forward,
names the inputs after the batch's keys, and checks every batch's structure. Numbers: the
dict model's runs, on one rank in graph mode and on two ranks with sharded tables, give the
losses of the same model written with flat arguments (tests.runner.models) trained by the
single-process reference.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from gemc.backends.torch.optimizers import resolve_optimizers
from gemc.backends.torch.reference import reference_losses
from gemc.backends.torch.runner import RunOptions, run

from gemc.api import compile as gemc_compile
from gemc.api import load_model
from gemc.batch_structure import BatchStructureError, flat_spec
from gemc.errors import EntrypointError
from gemc.plan import write_plan
from gemc.spec import ModelSpec
from tests.runner import dict_batch_model, models
from tests.runner.harness import MODEL, REPO, run_scenarios, variant

DICT_MODEL = f"{REPO / 'tests' / 'runner' / 'dict_batch_model.py'}:build"
STEPS = 6


def _real_spec() -> ModelSpec:
    return flat_spec(dict_batch_model.build(), "dict_batch_model:build")


def test_flat_spec_keeps_the_authors_parameters_and_forward() -> None:
    torch.manual_seed(0)
    spec = _real_spec()
    original = dict_batch_model.DictBatchMultiTable()
    original.load_state_dict(spec.model.state_dict())
    assert [n for n, _ in spec.model.named_parameters()] == \
        [n for n, _ in original.named_parameters()]
    flat = spec.make_batch(3, "cpu")
    assert all(isinstance(t, torch.Tensor) for t in flat) and len(flat) == 13
    # the flat batch is the dict's tensors in the dict's order: the flat model's own batch
    for a, b in zip(flat, models.make_batch(3), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    got = spec.model(*flat)
    want = original(*dict_batch_model.make_batch(3))
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    for (name, p), q in zip(spec.model.named_parameters(), original.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_inputs_are_named_after_the_batch_keys() -> None:
    names = list(inspect.signature(_real_spec().model.forward).parameters)
    assert names[:3] == ["batch_dense", "batch_sparse_t0_0", "batch_sparse_t0_1"]
    assert "batch_sparse_t2_weights" in names and names[-1] == "batch_labels"
    assert len(set(names)) == len(names)


def test_a_batch_of_another_structure_is_a_named_error() -> None:
    spec = dict_batch_model.build()
    spec.make_batch = lambda step, device: ({"dense": torch.zeros(6, 3)},)  # type: ignore[assignment]
    flat = flat_spec(spec, "m.py:build")
    with pytest.raises(BatchStructureError) as err:
        flat.make_batch(2, "cpu")
    assert "make_batch(2)" in str(err.value) and "example_inputs" in str(err.value)


def test_a_value_that_is_not_a_tensor_names_its_key() -> None:
    spec = dict_batch_model.build()
    spec.example_inputs[0]["sparse"]["t2"]["weights"] = 1.0
    with pytest.raises(EntrypointError) as err:
        flat_spec(spec, "m.py:build")
    assert "['sparse']['t2']['weights']" in str(err.value)


def _reference(plan: dict, world: int) -> list[float]:
    dense_cfg, emb_cfg = resolve_optimizers(plan.get("optimizer"))
    return reference_losses(load_model(MODEL, {}), steps=STEPS, world_size=world,
                            dense_cfg=dense_cfg, emb_cfg=emb_cfg)


def _close(got: list[float], ref: list[float]) -> None:
    assert len(got) == len(ref)
    for step, (g, r) in enumerate(zip(got, ref, strict=True), 1):
        assert abs(g - r) <= 1e-4 * abs(r), (step, g, r)


def test_one_rank_graph_mode_trains_as_the_flat_model() -> None:
    plan = variant(gemc_compile(DICT_MODEL, {}, topology="h200:1x1"), kernels=True)
    # the plan names the batch's tensors by their keys (the batched lookup's ids, offsets)
    looked_up = {t["fqn"]: (t["ids"], t["offsets"]) for k in plan["kernels"]
                 for t in k.get("tables", [])}
    assert looked_up["t0.weight"] == ("batch_sparse_t0_0", "batch_sparse_t0_1")
    got = run(plan, RunOptions(steps=STEPS, device="cpu", progress=False))
    assert got.report["graph_executor"]["executor"] == "inductor"
    _close([loss for _, loss in got.losses], _reference(plan, 1))


def test_two_ranks_with_sharded_tables_train_as_the_flat_model(tmp_path: Path) -> None:
    plan = variant(
        gemc_compile(DICT_MODEL, {}, topology="h200:1x2"),
        {"t0.weight": ("row_wise", [0, 1]), "t1.weight": ("column_wise", [0, 1]),
         "t2.weight": ("table_wise", [1]), "t3.weight": ("table_wise", [0]),
         "t4.weight": ("table_wise", [1]), "t5.weight": ("data_parallel", [0, 1])},
        {"": "ddp"})
    path = tmp_path / "dict.json"
    write_plan(path, plan)
    out = run_scenarios(2, [{"name": "dict", "plan": str(path), "phases": [{"steps": STEPS}]}],
                        tmp_path / "losses.json")
    (losses,) = out["dict"]
    _close([loss for _, loss in losses], _reference(plan, 2))
    # the tables the forward calls with the batch's own tensors share one exchange
    assert out["_meta"]["dict"][0]["embedding_exchange"]["on_call"] == {}
