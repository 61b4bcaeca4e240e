"""Kernel choices recorded in the plan (``gemc record-choices``) and used by the runner, and
the compile cache shared across runs (``--cache-dir``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from gemc.backends.torch import compile_cache as cc
from gemc.backends.torch.kernel_choices import check_choices, plan_choices
from gemc.backends.torch.runner import RunOptions, run
from gemc.backends.triton import config_choice as tuning
from gemc.backends.triton.config_choice import AUTOTUNE_ENV
from gemc.backends.triton.inductor_graph import CHOICE_ENV, build, runner_for

from gemc.cli import main as gemc_main
from gemc.errors import GemcUserError, PlanError
from gemc.plan import load_plan, validate_plan, write_plan
from tests.fusion.helpers import compiled, entries_of, params_of

TOY = str(Path(__file__).resolve().parents[1] / "models" / "toy.py") + ":build"
CACHE_VARS = (cc.INDUCTOR, cc.TRITON, cc.AUTOTUNE, cc.CACHE_ENV)


@pytest.fixture(scope="module")
def toy_plan() -> dict[str, Any]:
    """The toy model (a batched lookup, a GEMM + GELU epilogue, a LayerNorm), fp32."""
    from gemc.api import compile as gemc_compile

    plan = gemc_compile(TOY, {}, topology="h200:1x1")
    plan["precision"] = []
    return plan


def _groups(plan: dict[str, Any]) -> dict[str, str]:
    """Fused group name -> kind."""
    return {k["name"]: k["kind"] for k in plan["kernels"] if "structure" in k}


def _report(plan: dict[str, Any], measured: dict[str, Any], device: str = "cuda"
            ) -> dict[str, Any]:
    """What gemc run --measure-kernels writes, as far as record-choices reads it."""
    return {"model": {"fingerprint": plan["model"]["fingerprint"]}, "device": device,
            "steps": {}, "losses": [], "graph_executor": {"measured": measured}}


@pytest.fixture
def clean_cache_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv(CHOICE_ENV, raising=False)
    monkeypatch.delenv(AUTOTUNE_ENV, raising=False)
    return monkeypatch


def test_record_choices_folds_a_run_report_into_the_plan(toy_plan, tmp_path, capsys) -> None:
    """The command stores each measured choice on its kernel entry (validated, atomic: no
    temporary file left), an old plan without choices still loads, and a bad record is
    refused naming the kernel, the file and the fix."""
    groups = _groups(toy_plan)
    gemm = next(n for n, k in groups.items() if k == "gemm_epilogue")
    norm = next(n for n, k in groups.items() if k == "norm")
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, toy_plan)  # no choice anywhere: the old schema loads
    measured = {gemm: {"kind": "gemm_epilogue", "choice": "gemc", "gemc_ms": 1.0,
                       "inductor_ms": 2.0},
                norm: {"kind": "norm", "choice": "inductor", "error": "RuntimeError: x"}}
    run_json = tmp_path / "plan.run.json"
    run_json.write_text(json.dumps(_report(toy_plan, measured)))
    assert gemc_main(["record-choices", str(plan_path), str(run_json)]) == 0
    assert f"gemc's kernel for {gemm}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "plan.run.json"]
    plan = load_plan(plan_path)
    by_name = {k["name"]: k for k in plan["kernels"]}
    assert by_name[gemm]["choice"] == {"use": "gemc", "gemc_ms": 1.0, "inductor_ms": 2.0,
                                       "measured_on": "cuda"}
    assert by_name[norm]["choice"]["use"] == "inductor"
    assert by_name[norm]["choice"]["error"] == "RuntimeError: x"
    assert plan_choices(plan["kernels"]) == {gemm: {"choice": "gemc", "source": "plan"},
                                             norm: {"choice": "inductor", "source": "plan"}}

    bad = dict(by_name[gemm], choice={"use": "fast"})
    broken = {**plan, "kernels": [bad if k["name"] == gemm else k for k in plan["kernels"]]}
    with pytest.raises(PlanError) as err:
        validate_plan(broken, source="p.json")
    i = [k["name"] for k in plan["kernels"]].index(gemm)
    assert err.value.where == f"p.json: kernels[{i}].choice.use" and "record-choices" in \
        err.value.fix
    bag = next(k for k in plan["kernels"] if k["kind"] == "batched_embedding_bag")
    broken = {**plan, "kernels": [dict(k, choice={"use": "gemc"}) if k is bag else k
                                  for k in plan["kernels"]]}
    with pytest.raises(PlanError, match="no Inductor alternative"):
        validate_plan(broken, source="p.json")

    with pytest.raises(GemcUserError) as err:
        check_choices({"gemm_epilogue_9": {"choice": "gemc"}}, plan["kernels"], "r.json")
    assert "'gemm_epilogue_9'" in err.value.what and err.value.where == "r.json: gemm_epilogue_9"
    assert gemm in err.value.fix and "--measure-kernels" in err.value.fix
    with pytest.raises(GemcUserError, match="no Inductor alternative"):
        check_choices({"batched_embedding_bag_0": {"choice": "gemc"}}, plan["kernels"], "r")
    with pytest.raises(GemcUserError) as err:
        check_choices({norm: {"choice": "fastest"}}, plan["kernels"], "r.json")
    assert err.value.where == f"r.json: {norm}.choice" and "gemc" in err.value.fix
    other = tmp_path / "other.run.json"
    other.write_text(json.dumps({**_report(toy_plan, measured), "model": {"fingerprint": "x"}}))
    assert gemc_main(["record-choices", str(plan_path), str(other)]) == 2
    assert "measured another model" in capsys.readouterr().err


def test_recorded_choices_reach_the_built_graph(clean_cache_env) -> None:
    """A group the plan records as gemc's is a ``gemc::fused_group`` call in the graph
    handed to torch.compile; the one recorded as Inductor's stays ATen nodes."""
    gm, ctx, spec = compiled(TOY)
    entries = [e for e in entries_of(gm, ctx) if e["kind"] != "batched_embedding_bag"]
    gemm = next(e["name"] for e in entries if e["kind"] == "gemm_epilogue")
    norm = next(e["name"] for e in entries if e["kind"] == "norm")
    for e in entries:
        e["choice"] = {"use": "gemc" if e["name"] == gemm else "inductor"}
    runner, _ = runner_for(gm, entries, params_of(spec.model))
    built = build(runner, measured=plan_choices(entries))
    assert built.choices[gemm] == "gemc" and built.sources[gemm] == "plan"
    assert built.choices[norm] == "inductor" and built.sources[norm] == "plan"
    assert built.module.code.count("_call_group(") == 1


def test_a_run_uses_the_plans_choices_and_says_where_each_came_from(
        toy_plan, tmp_path, clean_cache_env) -> None:
    """Graph mode on the CPU (Triton interpreted, AOTAutograd): the plan's recorded gemc
    choice runs gemc's kernel (source ``plan``), ``--kernel-choices`` overrides another
    group (source ``file``), the rest are defaults; the losses equal the run without
    kernels. The caches go to gemc-cache/ next to the plan, except Inductor's, which the
    user pointed elsewhere."""
    groups = _groups(toy_plan)
    gemm = next(n for n, k in groups.items() if k == "gemm_epilogue")
    norm = next(n for n, k in groups.items() if k == "norm")
    plan = json.loads(json.dumps(toy_plan))
    for k in plan["kernels"]:
        if k["name"] == gemm:
            k["choice"] = {"use": "gemc", "gemc_ms": 1.0, "inductor_ms": 2.0,
                           "measured_on": "cuda"}
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, plan)
    mine = tmp_path / "my-inductor-cache"
    clean_cache_env.setenv(cc.INDUCTOR, str(mine))
    opts = dict(steps=3, device="cpu", progress=False)
    seen: list[str | None] = []  # --autotune holds GEMC_AUTOTUNE=1 for the run, then restores
    got = run(plan_path, RunOptions(**opts, kernel_choices={norm: {"choice": "gemc"}},
                                    autotune=True,
                                    on_step=lambda n: seen.append(os.environ.get(AUTOTUNE_ENV))))
    assert seen == ["1"] * 3 and AUTOTUNE_ENV not in os.environ
    # an interpreted kernel of one config has nothing to choose, so nothing is reported;
    # only a kernel that keeps several there for its tests to force (the row kernel's two
    # orientations) reports its pick
    several = {name for name, (_, tuner) in tuning._KERNELS.items() if len(tuner.configs) > 1}
    assert set(got.report["kernel_tuning"]) <= several
    graph = got.report["graph_executor"]
    assert graph["kernel_choices"][gemm] == graph["kernel_choices"][norm] == "gemc"
    assert graph["choice_sources"][gemm] == "plan" and graph["choice_sources"][norm] == "file"
    assert graph["choice_sources"]["batched_embedding_bag_0"] == "default"
    cache = got.report["compile_cache"]
    assert cache["dir"] == str((tmp_path / "gemc-cache").resolve())
    assert cache["inductor"] == str(mine) and cache["from_environment"] == [cc.INDUCTOR]
    assert cache["triton"] == os.path.join(cache["dir"], "triton")
    assert os.environ[cc.INDUCTOR] == str(mine) and cc.TRITON not in os.environ  # restored
    ref = run(plan_path, RunOptions(**opts, kernels=False, report=str(tmp_path / "r.json")))
    torch.testing.assert_close([v for _, v in got.losses], [v for _, v in ref.losses],
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(GemcUserError, match="'norm_7'"):
        run(plan_path, RunOptions(**opts, kernel_choices={"norm_7": {"choice": "gemc"}}))


def test_the_inductor_cache_is_namespaced_by_gemcs_op_definitions(tmp_path, monkeypatch,
                                                                  clean_cache_env) -> None:
    """Compiled code calls gemc's ops by schema, which torch's cache keys do not cover: a
    gemc whose ops changed compiles into another directory instead of being served stale
    code."""
    fingerprint = cc.ops_fingerprint()
    assert len(fingerprint) == 12 and fingerprint != "no-ops"
    with cc.compile_cache(str(tmp_path / "c"), None) as cache:
        first = cache.inductor
    monkeypatch.setattr(cc, "ops_fingerprint", lambda: "0123456789ab")
    with cc.compile_cache(str(tmp_path / "c"), None) as cache:
        assert cache.inductor != first and cache.inductor.endswith("inductor-0123456789ab")
        assert Path(cache.triton) == tmp_path / "c" / "triton"  # Triton keys on the source


def test_cache_variables_a_person_set_win_and_none_keeps_nothing(tmp_path,
                                                                 clean_cache_env) -> None:
    """torch's own /tmp default is replaced, a person's directory is kept, everything is
    restored after the run, and ``none`` compiles in a temporary directory removed
    afterwards."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    clean_cache_env.setenv(cc.INDUCTOR, default_cache_dir())
    with cc.compile_cache(str(tmp_path / "c"), None) as cache:
        assert cache.inductor == str(tmp_path / "c" / f"inductor-{cc.ops_fingerprint()}") \
            == os.environ[cc.INDUCTOR]
        assert cache.triton == str(tmp_path / "c" / "triton") and os.environ[cc.AUTOTUNE] == "1"
        assert cache.from_environment == [] and not cache.warm
    assert os.environ[cc.INDUCTOR] == default_cache_dir() and cc.TRITON not in os.environ
    clean_cache_env.setenv(cc.TRITON, str(tmp_path / "my-triton"))
    clean_cache_env.setenv(cc.CACHE_ENV, str(tmp_path / "from-env"))
    with cc.compile_cache(None, tmp_path) as cache:
        assert cache.dir == str(tmp_path / "from-env") and cache.from_environment == [cc.TRITON]
        assert cache.triton == str(tmp_path / "my-triton")
    with cc.compile_cache("none", tmp_path) as cache:
        cold = Path(cache.inductor).parent
        assert cache.dir is None and cold.is_dir() and not cache.report()["kept"]
    assert not cold.exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(GemcUserError, match="--cache-dir"):
        with cc.compile_cache(str(tmp_path / "file"), None):
            pass


def test_two_runs_share_the_cache_and_the_second_finds_it_warm(toy_plan, tmp_path,
                                                               clean_cache_env) -> None:
    """With Inductor really compiling (its CPU code), the first run fills gemc-cache/ next
    to the plan and the second run finds it warm and hits torch's caches. About a minute on
    a loaded 2-core machine: Inductor's cold C++ compile."""
    clean_cache_env.setenv("GEMC_CPU_COMPILE_BACKEND", "inductor")
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, toy_plan)
    reports = [run(plan_path, RunOptions(steps=1, device="cpu", progress=False)).report
               for _ in range(2)]
    caches = [r["compile_cache"] for r in reports]
    assert caches[0]["dir"] == caches[1]["dir"] == str((tmp_path / "gemc-cache").resolve())
    assert not caches[0]["warm"] and caches[1]["warm"]
    assert any("hit" in k and v > 0 for k, v in caches[1]["counters"].items()), caches[1]
    assert all(r["first_step_s"] > 0 for r in reports)
