"""CP-SAT in a child process: the solve that may abort runs apart from the compile.

OR-Tools is native code with ``CHECK`` assertions; when one fails (9.15's
``CHECK failed: heuristics.fixed_search != nullptr``, google/or-tools#5025, on the
hint-completing solve with ``fix_variables_to_their_hinted_value``) it calls ``abort()``
and takes the whole Python process down, with no message and no traceback file. CP-SAT
also installs its own SIGINT handler while it solves, so Ctrl-C stopped the search "as if
a time limit was reached" and the compile wrote a different plan with exit 0.

So the parent (``cpsat.solve``) builds the model, writes it as protobuf text and runs this
file as a script (``python cpsat_worker.py DIR``: it imports only OR-Tools, not gemc or
torch, so it starts in a fraction of a second). The child runs in its own session with
``catch_sigint_signal`` off: Ctrl-C reaches only the parent, which kills the child and
raises ``KeyboardInterrupt``; an abort becomes a return code the parent names. The
parameters are the parent's, so the solution is the same as an in-process solve's: the
result stays reproducible.

Files in DIR: ``model.txt`` (CpModelProto text), ``request.json`` (``fill``: the
hint-completion parameters as text or null, ``main``: the search parameters as text,
``budget``: deterministic seconds shared by both, ``balance``: null or the step and memory
variables' indices and the parameters of a lexicographic second solve), and the child
writes ``result.json`` (status, every variable's value, objective, bound, deterministic and
wall seconds; after the main solve, then again after balancing) and ``stage`` (``fill``,
``main`` or ``balance``: how far it got, for the parent's message).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def _parse(target: Any, text: str) -> None:
    """Text format into a proto, on OR-Tools 9.15 (C++ protos) and older (protobuf)."""
    if hasattr(target, "parse_text_format"):
        target.parse_text_format(text)
    else:
        from google.protobuf import text_format

        text_format.Parse(text, target)


def _solver(params_text: str) -> Any:
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    _parse(solver.parameters, params_text)
    solver.parameters.catch_sigint_signal = False  # the parent owns Ctrl-C
    return solver


def run(directory: Path) -> dict[str, Any]:
    from ortools.sat.python import cp_model

    request = json.loads((directory / "request.json").read_text())
    model = cp_model.CpModel()
    _parse(model.Proto(), (directory / "model.txt").read_text())
    stage = directory / "stage"
    fill_det = 0.0
    filled = False
    if request["fill"] is not None:
        stage.write_text("fill")
        fixer = _solver(request["fill"])
        status = fixer.solve(model)
        fill_det = fixer.deterministic_time
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            # every variable hinted: CP-SAT completing a partial hint by search took most
            # of the budget at 1,000 tables
            model.clear_hints()
            for i in range(len(model.Proto().variables)):
                var = model.get_int_var_from_proto_index(i)
                model.add_hint(var, fixer.value(var))
            filled = True
    stage.write_text("main")
    solver = _solver(request["main"])
    solver.parameters.max_deterministic_time = max(0.01, request["budget"] - fill_det)
    start = time.perf_counter()
    status = solver.solve(model)
    wall = time.perf_counter() - start
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    names = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible",
             cp_model.INFEASIBLE: "infeasible"}
    result = {
        "status": names.get(status, "unknown"),
        "values": list(solver.response_proto.solution) if found else None,
        "objective": solver.objective_value if found else None,
        "bound": solver.best_objective_bound if found else None,
        "deterministic_s": solver.deterministic_time + fill_det,
        "wall_s": wall,
        "max_time_s": solver.parameters.max_time_in_seconds,
        "hint_completed": filled,
        "balanced": None,
    }
    balance = request.get("balance")
    if found and balance:
        _write(directory, result)  # kept if the balancing solve dies
        stage.write_text("balance")
        result = _balance(result, balance)
    return result


def _balance(result: dict[str, Any], balance: dict[str, Any]) -> dict[str, Any]:
    """Lexicographic second objective: the step may not grow past the first solve's
    solution; the fullest rank's memory is minimised from that solution, in a share of
    the budget. The first solve's objective and bound stay the report's."""
    from ortools.sat.python import cp_model

    values = result["values"]
    # the step model plus the balance variables, appended (indices of the first unchanged)
    model = cp_model.CpModel()
    _parse(model.Proto(), balance["model"])
    model.clear_hints()
    step = model.get_int_var_from_proto_index(balance["step"])
    memory = model.get_int_var_from_proto_index(balance["memory"])
    model.add(step <= int(round(result["objective"])))
    for i, value in enumerate(values):
        model.add_hint(model.get_int_var_from_proto_index(i), value)
    model.minimize(memory)
    solver = _solver(balance["params"])
    status = solver.solve(model)
    result = dict(result, deterministic_s=result["deterministic_s"] + solver.deterministic_time)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        new = list(solver.response_proto.solution)
        result.update(values=new[:len(values)], balanced=[None, new[balance["memory"]]])
    return result


def _write(directory: Path, result: dict[str, Any]) -> None:
    tmp = directory / "result.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(directory / "result.json")


def main(argv: list[str]) -> int:
    directory = Path(argv[1])
    _write(directory, run(directory))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
