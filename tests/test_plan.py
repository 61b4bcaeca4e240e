import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gemc.errors import PlanError
from gemc.plan import Plan, Shard, Table, dumps, load_plan, read_plan, validate_plan, write_plan
from gemc.sharding import make_shards, split_even


@pytest.fixture(scope="module")
def plan(
    tmp_path_factory,
):
    from gemc.api import compile
    from tests.conftest import TOY

    return compile(f"{TOY}:build", topology="h200:2x4")


def test_round_trip_is_byte_identical(plan, tmp_path):
    path = tmp_path / "p.json"
    write_plan(path, plan)
    again = load_plan(path)
    assert again == plan
    assert dumps(again) == path.read_text()


def test_typed_plan_reads_and_writes_the_same_bytes(plan, tmp_path):
    path = tmp_path / "p.json"
    write_plan(path, plan)
    text = path.read_text()
    typed = Plan.from_json(text, source=str(path))
    assert typed.to_json() == text  # one writer: the bytes of the dict's dumps
    assert typed == Plan.from_json(plan, source="dict") == read_plan(path)
    assert typed.mesh.world_size == 8 and typed.mesh.shape == (2, 4)
    assert all(isinstance(t, Table) and all(isinstance(s, Shard) for s in t.shards)
               for t in typed.tables)
    assert {t.fqn for t in typed.tables} == {t["fqn"] for t in plan["tables"]}
    assert [k.kind for k in typed.kernels] == [k["kind"] for k in plan["kernels"]]
    assert typed.predicted.step_ms == plan["predicted"]["step_ms"]
    # keys no section types are kept, and written back where they were
    extra = {**plan, "tables": [{**plan["tables"][0], "note": "kept"}, *plan["tables"][1:]]}
    again = Plan.from_json(extra)
    assert again.tables[0].extra["note"] == "kept"
    assert again.to_json() == dumps(extra)
    # the plan owns its data: editing what to_dict gave changes neither the plan nor its text
    out = typed.to_dict()
    out["tables"][0]["shards"][0]["rows"] = -1
    out["model"]["args"]["x"] = 1
    assert typed.to_json() == text
    given = copy.deepcopy(plan)
    built = Plan.from_json(given)
    given["tables"][0]["shards"][0]["rows"] = -1  # nor editing the dict it was built from
    assert built.to_json() == text
    write_plan(path, typed)  # a Plan is written as is
    assert path.read_text() == text


def test_typed_plan_states_absent_optional_fields_as_none(plan):
    bare = {k: v for k, v in plan.items() if k not in ("exchange", "solver")}
    bare["tables"] = [{k: v for k, v in t.items() if k != "precision"} for t in plan["tables"]]
    typed = Plan.from_json(bare)
    assert typed.exchange is None and typed.solver is None
    assert all(t.precision is None for t in typed.tables)
    assert typed.to_json() == dumps(bare)  # absent stays absent, not written as null


def test_text_that_is_not_json_names_the_plan():
    with pytest.raises(PlanError, match="not valid JSON") as info:
        Plan.from_json("{not json", source="p.json")
    assert info.value.where == "p.json"


def test_invalid_plan_is_never_written(plan, tmp_path):
    path = tmp_path / "p.json"
    bad = {**plan, "mesh": {**plan["mesh"], "shape": [3, 3]}}
    with pytest.raises(PlanError, match="mesh.shape"):
        write_plan(path, bad)
    assert not path.exists()
    assert not list(tmp_path.iterdir())  # no temporary file left either


def test_missing_fields_are_named(plan):
    for key in ("topology", "predicted", "tables"):
        broken = {k: v for k, v in plan.items() if k != key}
        with pytest.raises(PlanError, match=key):
            validate_plan(broken)


def test_plan_says_its_planner_and_predictions_come_from_the_cost_model(plan):
    assert plan["planner"] == "default"
    pred = plan["predicted"]
    assert pred["step_ms"] > 0 and 0 < pred["mfu"] < 1
    assert pred["cost_model"] == "calibrated" and pred["calibration"] == "h200.json"
    assert [r["rank"] for r in pred["per_rank"]] == list(range(8))
    json.dumps(plan)  # serialisable as is


def test_without_calibration_the_plan_says_roofline():
    from gemc.api import compile
    from tests.conftest import TOY

    pred = compile(f"{TOY}:build", topology="h200:1x2", calibration=None)["predicted"]
    assert pred["cost_model"] == "roofline" and "roofline" in pred["note"]


def test_without_the_cost_model_predictions_are_null_not_invented():
    from gemc.api import compile
    from tests.conftest import TOY

    plan = compile(f"{TOY}:build", topology="h200:1x2", disabled_passes=["predict-time"])
    assert plan["predicted"]["step_ms"] is None and plan["predicted"]["mfu"] is None


@given(
    rows=st.integers(1, 10_000),
    dim=st.integers(1, 512),
    n=st.integers(1, 64),
    sharding=st.sampled_from(
        ["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise"]
    ),
)
def test_shards_tile_the_table_exactly(rows, dim, n, sharding):
    n = min(n, dim) if sharding == "column_wise" else n
    shards = make_shards(sharding, list(range(n)), rows, dim)
    copies = n if sharding == "data_parallel" else 1
    assert sum(s["rows"] * s["cols"] for s in shards) == rows * dim * copies
    assert all(
        s["row_offset"] + s["rows"] <= rows and s["col_offset"] + s["cols"] <= dim for s in shards
    )


@given(total=st.integers(0, 10**6), parts=st.integers(1, 4096))
def test_split_even_is_contiguous_and_balanced(total, parts):
    pieces = split_even(total, parts)
    assert sum(s for _, s in pieces) == total
    assert all(b[0] == a[0] + a[1] for a, b in zip(pieces, pieces[1:]))
    assert max(s for _, s in pieces) - min(s for _, s in pieces) <= 1


def test_diff_reads_typed_plans(plan):
    from gemc.diff import diff

    first = plan["tables"][0]
    lowered = {**plan, "tables": [{**first, "precision": "bf16"}, *plan["tables"][1:]],
               "exchange": {**plan.get("exchange", {}), "forward": "bf16"}}
    a, b = Plan.from_json(plan), Plan.from_json(lowered)
    assert b.wire.forward == "bf16" and a.wire.forward == (plan.get("exchange") or {}).get(
        "forward", "fp32")
    text = diff(a, b)
    assert f"{first['sharding']} -> {first['sharding']} bf16" in text
    assert f"table exchange (forward/backward): {a.wire.forward}/" in text and "-> bf16/" in text
    assert "dense strategies: unchanged" in diff(a, a) and "tables: unchanged" in diff(a, a)
