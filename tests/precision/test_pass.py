"""choose-precision: golden dump, the numbers behind it, the plan entries and explain."""

from __future__ import annotations

import json

import pytest
import torch
from gemc.backends.torch import fp8
from gemc.backends.torch import precision as runner_precision
from gemc.cost_model.topology import parse_topology
from gemc.passes.precision import ChoosePrecision, PrecisionOptions
from gemc.passes.predict_time import PredictTime
from torch import fx

from gemc import ir
from gemc.api import compile as gemc_compile
from gemc.api import load_model, pass_context
from gemc.capture import capture
from gemc.config import CompileConfig
from gemc.dump import format_graph
from gemc.errors import GemcUserError, PlanError
from gemc.pass_manager import PassManager
from gemc.pipeline import annotation_passes
from gemc.plan_builder import precision_entries
from gemc.probe import ProbeConfig
from tests.conftest import check_golden
from tests.precision.conftest import MODEL

GEMMS = ("fwd", "dgrad", "wgrad")
FORCED = PrecisionOptions(require_gain=False)  # fp8 wherever allowed and accurate


def run_pass(options: PrecisionOptions, entry: str = MODEL, args: dict | None = None,
             calibration: object = None) -> tuple[fx.GraphModule, object]:
    """Annotation, predict-time and choose-precision on h200:1x1 (roofline unless given)."""
    args = dict(args or {})
    spec = load_model(entry, args)
    captured = capture(spec, entrypoint=entry)
    ctx = pass_context(entry, args, captured, parse_topology("h200:1x1"))
    ctx.calibration = calibration
    # only the passes choose-precision reads, so the golden dump does not move with others
    passes = [*annotation_passes(), PredictTime(), ChoosePrecision(options)]
    return PassManager(passes).run(captured.gm, ctx), ctx


@pytest.fixture(scope="module")
def forced() -> tuple[fx.GraphModule, object]:
    return run_pass(FORCED)


def _records(gm: fx.GraphModule) -> dict[str, dict]:
    return {n.name: n.meta[ir.PRECISION] for n in gm.graph.nodes
            if n.op == "call_function" and ir.PRECISION in n.meta}


def test_choose_precision_golden_dump(forced) -> None:
    check_golden("choose_precision.txt", format_graph(forced[0], "after choose-precision"))


def test_the_numbers_behind_the_dump(forced) -> None:
    gm, ctx = forced
    records = _records(gm)
    fp8_sites = {name for name, r in records.items() if "fp8" in {r[g][:3] for g in GEMMS}}
    # fp8 lands on the five linears with 16-aligned dims, never on attention scores or logits
    assert {records[n]["module"] for n in fp8_sites} <= {"block.up", "block.down", "attn.q",
                                                         "attn.k", "attn.v"}
    assert len(fp8_sites) >= 4
    for name, r in records.items():
        for g in GEMMS:
            d = r["gemms"][g]
            assert set(d["rejected"]) == {"fp32", "bf16", "fp8"} - {d["dtype"]}, (name, g)
            assert d["sqnr_db"] is not None and d["sqnr_db"] >= 25.0
            if d["dtype"] == "fp8":
                key = "fp8-row" if d["scaling"] == "rowwise" else "fp8-tensor"
                assert d["sqnr_db"] == d["sqnr_db_by"][key]
                if d["scaling"] == "tensorwise":
                    assert d["outlier_ratio"] <= FORCED.max_outlier_ratio
            elif "fp8-row" in d["sqnr_db_by"] and d["rejected"]["fp8"].startswith("SQNR"):
                assert d["sqnr_db_by"]["fp8-row"] < 25.0
        if r["op"] == "matmul":
            assert r["gemms"]["fwd"]["rejected"]["fp8"].startswith("attention scores")
    assert records["linear_5"]["gemms"]["fwd"]["rejected"]["fp8"].startswith("feeds the loss")
    facts = next(n for n in gm.graph.nodes if n.op == "output").meta[ir.PRECISION]
    checked = [b for b in facts["blocks"] if b["checked"]]
    assert {b["region"] for b in checked} >= {"block", "attn"}
    assert all(b["sqnr_db"] >= 23.0 for b in checked)
    assert not [w for w in ctx.warnings if "choose-precision" in w]
    # predicted_ms of a GEMM node is now its chosen precisions' time
    for n in gm.graph.nodes:
        r = n.meta.get(ir.PRECISION)
        if isinstance(r, dict) and "gemms" in r:
            chosen = sum(r["gemms"][g]["pred_ms"][r["gemms"][g]["dtype"]] for g in GEMMS)
            assert n.meta[ir.PREDICTED_MS] == pytest.approx(chosen, abs=1e-3)


def test_plan_entries_are_what_the_runner_applies(forced) -> None:
    gm, _ = forced
    entries = precision_entries(gm)
    assert entries[0]["target"] == "*" and entries[0]["dtype"] == "bf16"
    fp8_entries = [e for e in entries if e["dtype"] == "fp8"]
    assert fp8_entries and all("recipe" in e for e in fp8_entries)
    json.dumps(entries)  # plain JSON, no infinities
    model = load_model(MODEL, device="cpu").model
    resolved = runner_precision.resolve(entries, model)
    assert resolved.global_dtype == torch.bfloat16
    assert set(resolved.fp8_linears) == {e["target"] for e in fp8_entries}
    for e in fp8_entries:
        assert resolved.fp8_linears[e["target"]] == fp8.Fp8Recipe.from_dict(e["recipe"])
    # a later "*" (the runner's --precision) overrides every entry before it
    override = runner_precision.resolve([*entries, {"target": "*", "dtype": "fp32"}], model)
    assert override.global_dtype == torch.float32 and not override.fp8_linears
    runner_precision.install(model, resolved, "cpu")
    assert all(isinstance(model.get_submodule(t), fp8.Fp8Linear) for t in resolved.fp8_linears)
    spec = load_model(MODEL, device="cpu")
    with resolved.autocast("cpu"):
        loss = model(*spec.make_batch(0, "cpu"))
    loss.backward()
    assert torch.isfinite(loss)
    with pytest.raises(PlanError, match="nn.Linear"):
        runner_precision.resolve([{"target": "attn", "dtype": "fp8", "recipe": {}}], model)


def test_nested_modules_get_their_own_scope_only_when_they_differ() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    record = {"op": "linear", "region": "r", "shape": {"batch": 1, "m": 16, "n": 16, "k": 16},
              "block_sqnr_db": None}
    dtypes = {"r": "fp32", "r.inner": "bf16", "r.same": "fp32", "other": "bf16"}
    for module, dtype in dtypes.items():
        node = graph.call_function(torch.relu, (x,))
        gemm = {"dtype": dtype, "scaling": None, "sqnr_db": 40.0, "gain_ms": 0.0}
        node.meta[ir.PRECISION] = {"module": module, **record, **{g: dtype for g in GEMMS},
                                   "gemms": {g: gemm for g in GEMMS}}
    out = graph.output(x)
    out.meta[ir.PRECISION] = {"mode": "auto", "baseline": "bf16", "rule": {}, "probe": None,
                              "blocks": []}
    entries = precision_entries(fx.GraphModule(torch.nn.Module(), graph))
    applied = {e["target"]: e["dtype"] for e in entries}
    assert applied == {"*": "bf16", "r": "fp32", "r.inner": "bf16"}
    sites = {e["target"]: [s["module"] for s in e["sites"]] for e in entries}
    assert sites == {"*": ["other"], "r": ["r", "r.same"], "r.inner": ["r.inner"]}


@pytest.mark.parametrize("mode", ["bf16", "fp32"])
def test_uniform_modes_skip_the_probe(mode: str) -> None:
    gm, _ = run_pass(PrecisionOptions(mode=mode))
    for r in _records(gm).values():
        assert {r[g] for g in GEMMS} == {mode}
        assert all(f"--precision {mode}" in why for g in GEMMS
                   for why in r["gemms"][g]["rejected"].values())
    facts = next(n for n in gm.graph.nodes if n.op == "output").meta[ir.PRECISION]
    assert facts["baseline"] == mode and facts["probe"] is None


def test_a_model_the_probe_cannot_hold_stays_bf16_with_a_loud_warning() -> None:
    gm, ctx = run_pass(PrecisionOptions(require_gain=False,
                                        probe=ProbeConfig(max_dense_bytes=1.0)))
    assert any("no precision probe" in w and "dense weights" in w for w in ctx.warnings)
    for r in _records(gm).values():
        assert {r[g] for g in GEMMS} == {"bf16"}
        for g in GEMMS:
            why = r["gemms"][g]["rejected"]["fp8"]
            assert why.startswith("error not measured") or r["module"] in (
                "attn", "head"), why


def test_min_sqnr_above_bf16_forces_fp32() -> None:
    gm, _ = run_pass(PrecisionOptions(min_sqnr_db=70.0, block_margin_db=0.0))
    for r in _records(gm).values():
        assert {r[g] for g in GEMMS} == {"fp32"}
        assert r["gemms"]["fwd"]["rejected"]["bf16"].startswith("SQNR")


def test_cli_precision_flags_and_explain_table(tmp_path, capsys) -> None:
    from gemc.cli import main

    out = tmp_path / "plan.json"
    # --planner default: the flags under test do not need CP-SAT, and the GPU box that runs
    # this suite with GEMC_TEST_DEVICE=cuda has no ortools
    assert main(["compile", MODEL, "--topology", "h200:1x1", "--out", str(out), "--quiet",
                 "--precision", "bf16", "--planner", "default",
                 "--fp8-quantisation", "compiled"]) == 0
    assert json.loads(out.read_text())["precision"][0]["rule"]["quantisation"] == "compiled"
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "precision  baseline bf16 (mode bf16)" in text
    assert "precision by GEMM site (8" in text and "block.up" in text
    CompileConfig(precision=PrecisionOptions(mode="auto")).validate()
    with pytest.raises(GemcUserError, match="unknown precision mode"):
        CompileConfig(precision=PrecisionOptions(mode="fp4")).validate()
    with pytest.raises(GemcUserError, match="unknown compile option"):
        gemc_compile(MODEL, precision_mode="bf16")


def test_compiled_quantisation_is_priced_as_one_pass_per_operand(forced) -> None:
    """``quantisation="compiled"`` (opt-in): each fp8 operand costs one read + fp8 write +
    row scales and one launch, far below the eager kernel sequence; only the fp8 prices
    move, and the default stays eager."""
    from gemc import fp8_recipe

    assert PrecisionOptions().quantisation == fp8_recipe.EAGER_QUANT
    with pytest.raises(GemcUserError, match="unknown fp8 quantisation"):
        PrecisionOptions(quantisation="fused").validate()
    compiled, _ = run_pass(PrecisionOptions(require_gain=False, quantisation="compiled"))
    eager, got = _records(forced[0]), _records(compiled)
    launch = 2.5e-3  # ms, the roofline's launch cost
    for name, r in eager.items():
        for g in GEMMS:
            e, c = r["gemms"][g], got[name]["gemms"][g]
            assert c["pred_ms"]["bf16"] == e["pred_ms"]["bf16"], (name, g)
            assert 2 * launch <= c["quant_ms"] < e["quant_ms"], (name, g)
            assert c["pred_ms"]["fp8"] - c["quant_ms"] == pytest.approx(
                e["pred_ms"]["fp8"] - e["quant_ms"], abs=1e-4)
    facts = next(n for n in compiled.graph.nodes if n.op == "output").meta[ir.PRECISION]
    assert facts["rule"]["quantisation"] == "compiled"


def test_kernels_inside_a_module_scoped_to_fp32_are_left_out_of_the_plan() -> None:
    """The runner cannot run a kernel over a module scoped to another precision (it drops
    it: ``graph_precision.kernels_outside``); the plan leaves it out and prices the module's
    own ops, so the plan's kernels are the ones that run."""
    from gemc.backends.torch.graph_precision import scope_module_precision

    plan = gemc_compile(MODEL, topology="h200:1x1", planner="default",
                        precision=PrecisionOptions(min_sqnr_db=70.0, block_margin_db=0.0))
    scoped = {e["target"]: e["dtype"] for e in plan["precision"][1:]}
    assert scoped and set(scoped.values()) == {"fp32"}
    assert any("left out of the plan" in w for w in plan["warnings"])
    # what the runner would apply: scope the captured graph as the plan says, keep the rest
    model = load_model(MODEL, {})
    gm = capture(model, entrypoint=MODEL).gm
    per_module = {t: torch.float32 for t in scoped}
    kept, taken = scope_module_precision(gm, per_module, plan["kernels"], "cpu")
    assert taken, "the fp32 scopes take some nodes"
    assert [k["name"] for k in kept] == [k["name"] for k in plan["kernels"]]
    # and without the scopes the same model does plan kernels in those modules
    bf16 = gemc_compile(MODEL, topology="h200:1x1", planner="default",
                        precision=PrecisionOptions(mode="bf16"))
    inside = [k for k in bf16["kernels"]
              if any(m == t or m.startswith(t + ".") for m in k.get("replaces", [])
                     for t in scoped)]
    assert inside, "the test model has kernels inside the scoped modules"
