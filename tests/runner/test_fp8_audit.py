"""The runner's fp8 audit (backends/torch/fp8_audit.py): every N steps each fp8 site's GEMMs
against fp32 on the step's operands; a GEMM under the precision pass's bound runs bf16 for
the rest of the run, in module mode, compiled module mode and graph mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gemc.backends.torch import fp8
from gemc.backends.torch.fp8_audit import (
    FLAG,
    Fp8Audit,
    fp8_sites,
    gemm_sqnr,
    plan_bound,
    recipe_gemms,
)
from gemc.backends.torch.runner import RunOptions, run
from torch import nn

from gemc import checks
from gemc.errors import GemcUserError
from gemc.fp8_recipe import BF16, FP8_ROW, MIN_SQNR_DB, Fp8Recipe
from gemc.plan import write_plan

MODEL = str(Path(__file__).with_name("fp8_audit_model.py")) + ":build"
ROW = Fp8Recipe.uniform(FP8_ROW)
SITES = ("cancel.up", "cancel.down", "healthy.up", "healthy.down")


def _operands(cancel: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, output-gradient weights) of 64 tokens: Gaussian, or a common vector plus 1%
    noise with weights of zero mean over the tokens (the weight gradient cancels)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 32, generator=g)
    r = torch.randn(64, 48, generator=g)
    if cancel:
        x = torch.randn(32, generator=g) + 0.01 * x
        r = r - r.mean(0)
    return x.bfloat16(), r


def _step(lin: nn.Module, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One forward and backward; (y, dx, dW, dy)."""
    x = x.clone().requires_grad_()
    lin.weight.grad = None
    seen = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    y.register_hook(lambda g: seen.__setitem__("dy", g))
    (y.float() * r).sum().backward()
    return y.detach(), x.grad, lin.weight.grad.clone(), seen["dy"]


def _fp8_linear() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48, bias=False))
    fp8.swap_linear(model, "0", ROW, emulate=True)
    return model


def test_it_measures_the_sites_own_gemms() -> None:
    """What the audit compares is bit for bit what the fp8 linear computes, forward and
    backward; row-wise e4m3 reads 25-33 dB on Gaussian operands, bf16 above 40."""
    model = _fp8_linear()
    x, r = _operands(cancel=False)
    y, dx, dw, dy = _step(model[0], x, r)
    got = recipe_gemms(x, model[0].weight, dy, ROW, emulate=True, out_dtype=torch.bfloat16)
    torch.testing.assert_close(got["fwd"], y, rtol=0, atol=0)
    torch.testing.assert_close(got["dgrad"], dx, rtol=0, atol=0)
    torch.testing.assert_close(got["wgrad"], dw, rtol=0, atol=0)
    fp8_db = gemm_sqnr(x, model[0].weight, dy, ROW, emulate=True)
    bf16_db = gemm_sqnr(x, model[0].weight, dy, Fp8Recipe.uniform(BF16))
    assert all(25 < v < 33 for v in fp8_db.values()), fp8_db
    assert all(v > 40 for v in bf16_db.values()), bf16_db


def test_a_cancelling_weight_gradient_is_switched_and_then_runs_bf16() -> None:
    model = _fp8_linear()
    lin = model[0]
    x, r = _operands(cancel=True)
    off = _step(lin, x, r)
    audit = Fp8Audit(fp8_sites(model), every=1, bound_db=MIN_SQNR_DB, bound_source="test")
    audit.begin(1)
    on = _step(lin, x, r)
    for a, b in zip(on, off):  # the audited step's numerics are the audit-off step's
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.warns(UserWarning, match=r"site 0: its wgrad GEMM measured -?\d+\.\d dB at "
                      r"step 1, under the 25 dB bound.*bf16 from step 2"):
        changed = audit.finish(1)
    assert changed == {"0": Fp8Recipe(FP8_ROW, FP8_ROW, BF16)} and lin.recipe == changed["0"]
    assert not audit._handles and not audit._energy  # nothing kept after the audit
    rep = audit.report()
    (point,) = rep["sites"]["0"]["series"]
    assert point["step"] == 1 and point["wgrad"] < MIN_SQNR_DB < min(point["fwd"],
                                                                    point["dgrad"])
    assert rep["switched"] == 1 and rep["switches"][0]["gemm"] == "wgrad"
    assert rep["sites"]["0"]["recipe_now"]["wgrad"] == "bf16"
    # the next step's weight gradient is the bf16 GEMM's, bit for bit (before: fp8's)
    _, _, dw, dy = _step(lin, x, r)
    bf16 = fp8.gemm(dy.t(), x, BF16, torch.float32)
    torch.testing.assert_close(dw, bf16, rtol=0, atol=0)
    assert not torch.equal(off[2], bf16)
    assert audit.finish(2) == {}  # not armed: nothing measured, nothing switched


def test_a_healthy_site_is_recorded_and_left_alone() -> None:
    model = _fp8_linear()
    audit = Fp8Audit(fp8_sites(model), every=2, bound_db=MIN_SQNR_DB, bound_source="test")
    for step in range(1, 5):
        audit.begin(step)
        _step(model[0], *_operands(cancel=False, seed=step))
        audit.finish(step)
    rep = audit.report()
    assert [p["step"] for p in rep["sites"]["0"]["series"]] == [2, 4]
    assert rep["switched"] == 0 and model[0].recipe == ROW and rep["audits"] == 2


def test_the_bound_is_the_plans_rule() -> None:
    assert plan_bound([{"target": "*", "dtype": "bf16", "rule": {"min_sqnr_db": 31.5}}])[0] \
        == 31.5
    bound, source = plan_bound([{"target": "*", "dtype": "bf16"}])
    assert bound == MIN_SQNR_DB and "MIN_SQNR_DB" in source


def _plan(tmp_path: Path, wgrad_bf16: tuple[str, ...] = ()) -> Path:
    from gemc.api import compile as gemc_compile

    plan = gemc_compile(MODEL, {}, topology="h200:1x1")
    star = plan["precision"][0]
    assert star["target"] == "*" and star["rule"]["min_sqnr_db"] == MIN_SQNR_DB
    switched = Fp8Recipe(FP8_ROW, FP8_ROW, BF16)
    plan["precision"] = [star] + [
        {"target": s, "dtype": "fp8",
         "recipe": (switched if s in wgrad_bf16 else ROW).to_dict()} for s in SITES]
    path = tmp_path / ("switched" if wgrad_bf16 else "fp8") / "plan.json"
    path.parent.mkdir()
    write_plan(path, json.loads(json.dumps(plan)))
    return path


MODES = {"module": {"kernels": False, "compile_modules": "off"},
         "module-compiled": {"kernels": False, "compile_modules": "on"},
         "graph": {}}


@pytest.mark.parametrize("mode", list(MODES))
def test_the_run_switches_the_cancelling_sites_and_trains_them_bf16_after(
        tmp_path, mode: str) -> None:
    """Audited at steps 2 and 4: the cancel branch's weight gradients fall under the plan's
    25 dB at step 2 and run bf16 from step 3; the healthy branch stays fp8. Up to step 3
    the losses are the audit-off run's; from step 3 on they are, bit for bit, those of a
    run resumed at step 2 from a plan with those GEMMs bf16 (so the switched GEMM really
    runs bf16: in graph mode the compiled graph is rebuilt, under torch.compile Dynamo
    recompiles on the recipe)."""
    plan = _plan(tmp_path)
    common = dict(device="cpu", progress=False, divergence="off", **MODES[mode])
    on = run(plan, RunOptions(steps=4, fp8_audit_every=2, **common))
    off = run(plan, RunOptions(steps=4, fp8_audit_every=0, **common))
    rep = on.report["fp8_audit"]
    assert on.report["execution"].startswith("graph" if mode == "graph" else "module")
    assert ("torch.compile" in on.report["execution"]) == (mode == "module-compiled")
    assert rep["mode"] == ("step" if mode == "module" else "shadow")
    assert rep["audits"] == 2 and rep["bound_db"] == MIN_SQNR_DB
    assert [(s["site"], s["gemm"], s["step"]) for s in rep["switches"]] == [
        ("cancel.down", "wgrad", 2), ("cancel.up", "wgrad", 2)]
    for site in ("healthy.up", "healthy.down"):
        assert [p["step"] for p in rep["sites"][site]["series"]] == [2, 4]
        assert rep["sites"][site]["recipe_now"] == rep["sites"][site]["recipe"]
        assert all(p[g] > MIN_SQNR_DB for p in rep["sites"][site]["series"]
                   for g in ("fwd", "dgrad", "wgrad"))
    # after the switch the cancel sites' wgrad is no longer fp8, so no longer audited
    assert "wgrad" not in rep["sites"]["cancel.up"]["series"][1]
    assert off.report["fp8_audit"]["off"] == f"{FLAG} 0"
    losses_on = [v for _, v in on.losses]
    losses_off = [v for _, v in off.losses]
    assert losses_on[:3] == losses_off[:3]  # the audited step 2 trained as without audit
    assert losses_on[3] != losses_off[3]  # step 3's bf16 weight gradients moved step 4

    ckpt = tmp_path / "ckpt"
    run(plan, RunOptions(steps=2, fp8_audit_every=0, checkpoint_dir=str(ckpt), **common))
    resumed = run(_plan(tmp_path, wgrad_bf16=("cancel.up", "cancel.down")),
                  RunOptions(steps=4, fp8_audit_every=0, checkpoint_dir=str(ckpt),
                             resume=True, **common))
    assert [s for s, _ in resumed.losses] == [3, 4]
    assert losses_on[2:] == [v for _, v in resumed.losses]
    if mode == "graph":  # compiled once for the plan's recipes, once after the switch
        assert len(on.report["graph_executor"]["compiled_variants"]) == 2


def test_bad_intervals_are_refused_by_name(tmp_path, capsys) -> None:
    from gemc.backends.torch.cli import add_arguments

    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(GemcUserError, match=r"fp8 audit interval") as exc:
            run(tmp_path / "absent.json", RunOptions(fp8_audit_every=bad))
        assert exc.value.where == FLAG and f"{FLAG} 0 to turn the audit off" in exc.value.fix
    parser = checks.ArgumentParser(prog="gemc run")
    add_arguments(parser)
    assert parser.parse_args(["p.json"]).fp8_audit_every == 100
    assert parser.parse_args(["p.json", FLAG, "0"]).fp8_audit_every == 0
    for bad in ("-1", "ten"):
        with pytest.raises(SystemExit):
            parser.parse_args(["p.json", FLAG, bad])
        err = capsys.readouterr().err
        assert FLAG in err and "or 0 to turn the audit off" in err
