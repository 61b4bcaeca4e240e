"""benchmarks/zoo.py without running a model (its ``--smoke`` run takes minutes on two CPU
cores: Inductor compiles every variant): the model list, the summary arithmetic, the table
and the refusal of unknown names."""

from __future__ import annotations

import math
from pathlib import Path

from tests.benchmark_module import load_benchmark


def _row(variant: str, sps: float | None, first: float | None = None) -> dict:
    return {"variant": variant, "samples_per_s": sps, "step_ms": 1e3 / sps if sps else None,
            "first_step_s": first, "losses": [1.0], "peak_memory_bytes": None}


def test_models_are_the_examples_then_the_zoo() -> None:
    zoo = load_benchmark("zoo")
    models = zoo.models()
    assert list(models)[:2] == ["gem", "dlrm"]
    for name, entry in models.items():
        path = Path(entry.rsplit(":", 1)[0])
        assert path.is_file() and entry.endswith(":build"), name
    on_disk = sorted(p.stem for p in (zoo.REPO / "examples" / "zoo").glob("[!_]*.py"))
    assert list(models)[2:] == on_disk


def test_summary_is_gemc_over_compile_per_model_and_their_geometric_mean() -> None:
    zoo = load_benchmark("zoo")
    results = {
        "a": [_row("eager", 50.0), _row("compile", 100.0, 10.0), _row("gemc", 200.0, 12.0)],
        "b": [_row("compile", 100.0, 10.0), _row("gemc", 50.0, None)],
        "c": [_row("compile", None), _row("gemc", 70.0)],  # compile failed: no ratio
    }
    s = zoo.summary(results)
    assert s["per_model"]["a"]["gemc"] == {"x_compile": 2.0, "first_step_x_compile": 1.2}
    assert s["per_model"]["b"]["gemc"]["first_step_x_compile"] is None
    assert "c" not in s["per_model"]
    assert math.isclose(s["geomean_x_compile"]["gemc"], 1.0)


def test_table_adds_first_step_and_loss_deviation() -> None:
    zoo = load_benchmark("zoo")
    rows = [_row("compile", 100.0, 10.0), {**_row("gemc", 150.0, 12.5),
                                           "max_rel_loss_diff_vs_eager": 3e-3}]
    lines = zoo._table(rows).splitlines()
    assert "1st step s" in lines[0] and "loss dev" in lines[0]
    assert lines[2].split()[-2:] == ["12.5", "3.00e-03"]
    assert lines[1].split()[-1] == "-"


def test_unknown_models_and_variants_are_refused_before_any_work(tmp_path: Path,
                                                                 capsys) -> None:
    zoo = load_benchmark("zoo")
    assert zoo.main(["--out", str(tmp_path), "--models", "gem,nope"]) == 2
    assert "unknown model(s) nope" in capsys.readouterr().err
    assert zoo.main(["--out", str(tmp_path), "--variants", "gemc,turbo"]) == 2
    assert "unknown variant(s) turbo" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def test_a_time_limit_skips_what_it_leaves_and_says_so(tmp_path: Path) -> None:
    """Past ``--time-limit`` no variant starts; zoo.json names the skipped ones and the
    exit code says the run is incomplete."""
    import json

    zoo = load_benchmark("zoo")
    assert zoo.main(["--out", str(tmp_path), "--models", "gem,dlrm", "--device", "cpu",
                     "--time-limit", "0"]) == 1
    result = json.loads((tmp_path / "zoo.json").read_text())
    assert result["skipped"] == [f"{m}/{v}" for m in ("gem", "dlrm")
                                 for v in ("eager", "compile", "gemc")]
    assert result["variants"] == {}


def test_profile_reaches_every_child_and_e2e_profiler(tmp_path: Path) -> None:
    """``--profile N`` is passed to each variant's child, where e2e.py's profiler reads it
    (N profiled steps after the timed ones); without it the children run unprofiled."""
    zoo = load_benchmark("zoo")
    args = zoo._args(["--out", str(tmp_path), "--profile", "2", "--steps", "6"])
    assert args.profile == 2 and args.profile_stack is False
    passed = zoo.child_args(args, tmp_path)
    assert passed[passed.index("--profile") + 1] == "2"
    child = zoo._args([*passed, "--child", "hstu", "gemc", str(tmp_path / "p.json")])
    assert child.profile == 2 and zoo.e2e.steps_run(child) == 6 + 2 + 2
    plain = zoo._args(["--out", str(tmp_path)])
    assert plain.profile == 0 and "--profile" not in zoo.child_args(plain, tmp_path)


def test_cold_gives_each_child_empty_caches_of_its_own(tmp_path: Path, monkeypatch) -> None:
    """``--cold``: each variant's process compiles into fresh Inductor and Triton cache
    directories (removed after it), so its first step is cold; without it the children
    inherit the caller's environment."""
    import json
    import os

    zoo = load_benchmark("zoo")
    seen: list[dict | None] = []

    class Done:
        returncode = 0

    def fake_run(cmd, check, timeout, env):
        seen.append(env)
        if env is not None:  # nothing in them yet: the child starts from empty caches
            assert not any(os.path.exists(env[v]) for v in zoo.COLD_VARS)
            assert os.path.isdir(os.path.dirname(env["TRITON_CACHE_DIR"]))
        name, variant = cmd[-3], cmd[-2]
        (tmp_path / f"{name}.{variant}.json").write_text(json.dumps({"variant": variant}))
        return Done()

    monkeypatch.setattr(zoo.subprocess, "run", fake_run)
    rows = [zoo._run_child("gem", v, tmp_path, [], 10.0, cold=True) for v in ("compile", "gemc")]
    assert [r["cold_caches"] for r in rows] == [True, True]
    dirs = [{v: env[v] for v in zoo.COLD_VARS} for env in seen]
    assert dirs[0] != dirs[1] and not any(os.path.exists(d) for e in dirs for d in e.values())
    assert all(os.path.dirname(e["TRITON_CACHE_DIR"]) == os.path.dirname(
        e["TORCHINDUCTOR_CACHE_DIR"]) for e in dirs)
    assert "cold_caches" not in zoo._run_child("gem", "gemc", tmp_path, [], 10.0)
    assert seen[-1] is None
    assert zoo._args(["--out", str(tmp_path), "--cold"]).cold
    # --child-prefix: the variant's process runs under that command, names filled in
    commands: list[list[str]] = []
    monkeypatch.setattr(zoo.subprocess, "run",
                        lambda cmd, **kw: commands.append(cmd) or fake_run(cmd, **kw))
    zoo._run_child("gem", "gemc", tmp_path, [], 10.0, prefix="py-spy record -o p/{name}.{variant} --")
    assert commands[-1][:5] == ["py-spy", "record", "-o", "p/gem.gemc", "--"]
    assert commands[-1][5] == zoo.sys.executable
    assert "gemc-autotune" in zoo.VARIANTS and zoo.GEMC_OPTIONS["gemc-autotune"]["autotune"]
