"""Per-group kernel choices: measured once, recorded in the plan, used by every later run.

Where a gemc kernel and Inductor's code compete for the same fused group (a GEMM
epilogue, a norm, a pointwise or reduction group), ``gemc run --measure-kernels`` times
both on the first step and writes the winners to the run report
(``graph_executor.measured``). ``gemc record-choices PLAN RUN.json`` folds them into the
plan, one ``choice`` per kernel entry (``{"use", "gemc_ms", "inductor_ms",
"measured_on"}``, validated by :mod:`gemc.plan`), so the plan alone says which code runs
each group and a plain ``gemc run PLAN`` uses it. Why a command of its own rather than a
flag of ``gemc compile``: the measurement is of *this* plan's groups, by name; folding it
into the same plan costs a second and cannot pair it with a recompiled plan whose groups
were named differently (a changed model, another gemc).

Precedence in a run (each group's source is in the run report's
``graph_executor.choice_sources``): this run's measurement, then ``--kernel-choices FILE``,
then the plan's recorded choice, then the default (Inductor's code for a generated group,
gemc's kernel where Inductor has nothing equivalent).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from gemc.checks import read_json
from gemc.errors import GemcUserError
from gemc.plan import KERNEL_CHOICES, KernelChoice, Plan

CHOICES_FORMAT = '{kernel name: {"choice": "gemc"|"inductor", ...}}'


def read_choices(path: str | None) -> dict[str, Any] | None:
    """A choices file: a JSON object of per-kernel records, or a whole run report (whose
    ``graph_executor.measured`` is taken). The records are checked against a plan by
    :func:`check_choices`."""
    if path is None:
        return None
    return _read(path)[0]


def _read(path: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the records, the run report they came from or None)."""
    data = read_json(path, "kernel choices", path,
                     "pass a JSON file, e.g. the run report of gemc run --measure-kernels")
    report = None
    if isinstance(data, dict) and isinstance(data.get("graph_executor"), dict):
        report = data
        data = data["graph_executor"].get("measured") or {}
    if not isinstance(data, dict):
        raise GemcUserError(f"kernel choices {path} is not a JSON object", where=path,
                            fix=f"pass {CHOICES_FORMAT}, or a run report of gemc run "
                            "--measure-kernels")
    return data, report


def check_choices(choices: dict[str, Any], kernels: list[Any], where: str
                  ) -> dict[str, dict[str, Any]]:
    """Each record names a fused group of the plan and says ``gemc`` or ``inductor``; one
    that does not is refused (a typo or another plan's names would silently change
    nothing). Returns the records as given."""
    groups = {str(k.get("name")): k for k in kernels if isinstance(k, dict)}
    choosable = sorted(n for n, k in groups.items() if "structure" in k)
    for name, rec in choices.items():
        entry = groups.get(name)
        if entry is None or "structure" not in entry:
            what = ("is not a kernel of the plan" if entry is None else
                    f"is a {entry.get('kind')} kernel, which has no Inductor alternative")
            raise GemcUserError(
                f"kernel choice for {name!r}: {what}", where=f"{where}: {name}",
                fix="measure this plan (gemc run PLAN --measure-kernels) and use its run "
                "report; the plan's fused groups are: " + (", ".join(choosable) or "(none)"))
        choice = rec.get("choice") if isinstance(rec, dict) else None
        if choice not in KERNEL_CHOICES:
            raise GemcUserError(
                f"kernel choice for {name!r} is {choice!r}, not one of "
                f"{', '.join(KERNEL_CHOICES)}", where=f"{where}: {name}.choice",
                fix=f"write {CHOICES_FORMAT}")
    return choices


def plan_choices(kernels: list[Any]) -> dict[str, dict[str, Any]]:
    """The plan's recorded choices as run records (``{"choice", "source": "plan"}``)."""
    return {str(k.get("name")): {"choice": k["choice"]["use"], "source": "plan"}
            for k in kernels if isinstance(k, dict) and isinstance(k.get("choice"), dict)}


def record_choices(plan: Plan, choices: dict[str, Any], measured_on: str | None) -> Plan:
    """The plan with each record stored as its kernel's ``choice`` (a new plan: ``Plan``
    is frozen; ``write_plan`` validates the choices as it writes)."""
    kernels = []
    for kernel in plan.kernels:
        rec = choices.get(str(kernel.name))
        if rec is not None:
            stored: dict[str, Any] = {"measured_on": measured_on}
            for key in ("gemc_ms", "inductor_ms"):
                stored[key] = rec.get(key)
            if rec.get("error"):
                stored["error"] = str(rec["error"])
            kernel = replace(kernel, choice=KernelChoice(rec["choice"], stored))
        kernels.append(kernel)
    return replace(plan, kernels=tuple(kernels))


def add_record_choices_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``record-choices`` on ``gemc``'s subparsers."""
    r = subparsers.add_parser(
        "record-choices",
        help="fold a run's measured kernel choices (gemc run --measure-kernels) into the plan")
    r.add_argument("plan", help="the plan the run measured")
    r.add_argument("choices", metavar="RUN_JSON",
                   help=f"its run report, or a JSON file {CHOICES_FORMAT}")
    r.add_argument("--out", help="write the plan here (default: the plan, replaced "
                   "atomically)")
    return r


def cmd_record_choices(args: argparse.Namespace) -> int:
    """``gemc record-choices PLAN RUN_JSON [--out FILE]``."""
    import sys

    from gemc import checks
    from gemc.exits import EXIT_OK
    from gemc.plan import read_plan, write_plan

    checks.input_file(args.plan, "gemc record-choices", what="plan file",
                      fix="give the plan file gemc compile --out wrote")
    checks.input_file(args.choices, "gemc record-choices", what="run report",
                      fix="give the PLAN.run.json of gemc run PLAN --measure-kernels")
    out = args.out or args.plan
    checks.output_file(out, "--out")
    plan = read_plan(args.plan)
    choices, report = _read(args.choices)
    if not choices:
        raise GemcUserError(f"{args.choices} holds no measured kernel choices",
                            where=f"{args.choices}: graph_executor.measured",
                            fix="run gemc run PLAN --measure-kernels and give its report")
    if report is not None:
        mine = plan.model.fingerprint
        theirs = (report.get("model") or {}).get("fingerprint")
        if theirs is not None and theirs != mine:
            raise GemcUserError(
                f"{args.choices} measured another model (fingerprint {theirs}, the plan's "
                f"is {mine})", where=f"{args.choices}: model.fingerprint",
                fix="measure this plan: gemc run PLAN --measure-kernels")
    check_choices(choices, [k.to_dict() for k in plan.kernels], args.choices)
    measured_on = report.get("device") if report is not None else None
    write_plan(out, record_choices(plan, choices, measured_on))
    names = sorted(choices)
    if measured_on == "cpu":
        print("gemc: warning: these choices were measured on the CPU (gemc's kernels in "
              "Triton's interpreter): their times say nothing about a GPU", file=sys.stderr)
    won = [n for n in names if choices[n]["choice"] == "gemc"]
    print(f"wrote {out}: {len(names)} kernel choice(s) recorded, gemc's kernel for "
          f"{', '.join(won) or 'none'}, Inductor's code for the rest")
    return EXIT_OK
