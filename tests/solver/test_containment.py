"""CP-SAT runs in a child process: a native abort there ends in the heuristic plan (loudly)
or a named error, never in a dead compile; Ctrl-C raises KeyboardInterrupt at once."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import replace

import pytest

from gemc.solver import cpsat
from gemc.solver.infeasible import SolverCrashError
from gemc.solver.planners import run_planner
from gemc.solver.problem import SolverSettings
from tests.solver.synth import make_problem

FAST = SolverSettings(time_limit_s=0.3, wall_limit_factor=200)

# a worker that aborts like OR-Tools 9.15 does (google/or-tools#5025); with FILL_ONLY it
# aborts only in the hint-completing solve and otherwise runs the real worker
_FAKE = """
import json, os, sys, runpy
d = sys.argv[1]
req = json.load(open(os.path.join(d, "request.json")))
if {fill_only} and req["fill"] is None:
    sys.argv = [{real!r}, d]
    runpy.run_path({real!r}, run_name="__main__")
open(os.path.join(d, "stage"), "w").write("fill" if req["fill"] else "main")
sys.stderr.write("F0000 cp_model_search.cc:1] Check failed: heuristics.fixed_search != nullptr\\n")
sys.stderr.flush()
os.abort()
"""


def _fake_worker(tmp_path, fill_only: bool):
    path = tmp_path / "worker.py"
    path.write_text(_FAKE.format(fill_only=fill_only, real=str(cpsat.WORKER)))
    return path


def test_abort_in_every_solve_gives_the_heuristic_plan_with_a_warning(tmp_path, monkeypatch):
    p = make_problem("h200:1x8", n_tables=12, seed=0, settings=FAST)
    greedy = run_planner(p, "greedy")
    monkeypatch.setattr(cpsat, "WORKER", _fake_worker(tmp_path, fill_only=False))
    r = run_planner(p, "cpsat")
    assert r.report["status"] == "crashed" and r.report["crashed"] is True
    assert r.report["kept"] in ("greedy", "naive", "greedy+search", "naive+search")
    assert r.evaluation.step_s <= greedy.evaluation.step_s
    warning = " ".join(r.notes)
    assert "SIGABRT" in warning and "fixed_search" in warning and "WARNING" in warning
    assert "again without completing the hint" in warning  # it was retried once


def test_abort_in_the_hint_completion_only_is_retried_without_it(tmp_path, monkeypatch):
    p = make_problem("h200:1x8", n_tables=12, seed=0, settings=FAST)
    clean = run_planner(p, "cpsat")
    monkeypatch.setattr(cpsat, "WORKER", _fake_worker(tmp_path, fill_only=True))
    r = run_planner(p, "cpsat")
    assert r.report["status"] in ("optimal", "feasible")
    assert r.report["crashed"] is True and "fill solve" in " ".join(r.notes)
    assert r.evaluation.step_s <= clean.report["greedy_step_ms"] / 1e3 + 1e-12


def test_abort_without_any_fitting_plan_is_a_named_error(tmp_path, monkeypatch):
    """Memory under the naive plan's fullest rank, greedy replaced by naive and the local
    search off: no heuristic fits, so the crash is the error (not a false "infeasible")."""
    from gemc.solver import planners
    from gemc.solver.evaluate import evaluate
    from gemc.solver.naive import naive

    loose = make_problem("h200:1x8", n_tables=10, seed=0, big=8.0, settings=FAST)
    cap = 0.9 * evaluate(loose, naive(loose)).memory.max()
    gpu = loose.topology.gpu
    p = replace(loose, settings=replace(FAST, memory_reserve=(gpu.usable_hbm_bytes - cap)
                                        / gpu.hbm_bytes))
    monkeypatch.setattr(planners, "greedy", lambda problem, pricer: naive(problem))
    monkeypatch.setattr(planners, "improve", lambda problem, pricer, a: a)  # no search either
    monkeypatch.setattr(cpsat, "WORKER", _fake_worker(tmp_path, fill_only=False))
    with pytest.raises(SolverCrashError) as exc:
        run_planner(p, "cpsat")
    text = exc.value.render()
    assert "SIGABRT" in text and "where:" in text and "fix:" in text


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_during_the_solve_raises_keyboard_interrupt_and_kills_the_child():
    """A search with a long budget, SIGINT after a second: KeyboardInterrupt in the
    caller within a few seconds (before, CP-SAT swallowed it and a plan came back)."""
    # Python's own Ctrl-C handler, whatever the process inherited (a job started with &
    # inherits SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    settings = SolverSettings(time_limit_s=120, gap_limit=0.0, wall_limit_factor=10)
    p = make_problem("h200:4x8", n_tables=60, seed=5, settings=settings)
    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    start = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_planner(p, "cpsat")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - start < 15
