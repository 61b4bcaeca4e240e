"""Everything the report reads, found and loaded in one place, tolerant of what is missing.

From the dump directory: ``manifest.json`` (required: it is what makes a directory a
dump), the last pass dump (the annotated graph), ``plan.json`` (written by ``gemc compile
--dump-dir``; or ``--plan``), ``mlir/index.json`` and any ``*.run.json`` run reports in
the dump directory or next to the plan (or ``--run``). A missing optional piece becomes
a note in the report and an empty section, never an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemc.errors import GemcUserError
from gemc.report.dumpgraph import DumpGraph, read_dump


@dataclass
class RunReport:
    path: Path
    data: dict[str, Any]


@dataclass
class ReportInputs:
    dump_dir: Path
    manifest: dict[str, Any]
    plan: dict[str, Any] | None = None
    plan_path: Path | None = None
    graph: DumpGraph | None = None
    graph_file: str | None = None
    runs: list[RunReport] = field(default_factory=list)
    mlir: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise GemcUserError(
            f"{what} '{path}' is not readable JSON: {exc}",
            where=str(path),
            fix="the file is corrupt or truncated; compile again with --dump-dir",
        ) from exc


def _last_dump(dump_dir: Path, manifest: dict[str, Any]) -> str | None:
    for entry in reversed(manifest.get("passes") or []):
        name = entry.get("dump") if isinstance(entry, dict) else None
        if (
            isinstance(name, str)
            and name.endswith(".txt")
            and not name.endswith((".failure.txt", ".input.txt"))
            and (dump_dir / name).is_file()
        ):
            return name
    return None


def load_inputs(
    dump_dir: str | Path, plan: str | Path | None = None, runs: list[str | Path] | None = None
) -> ReportInputs:
    from gemc.plan import load_plan

    dump_dir = Path(dump_dir)
    manifest_path = dump_dir / "manifest.json"
    if not manifest_path.is_file():
        raise GemcUserError(
            f"'{dump_dir}' is not a gemc dump directory (no manifest.json)",
            where=str(dump_dir),
            fix="give the directory passed to gemc compile --dump-dir",
        )
    inp = ReportInputs(dump_dir=dump_dir, manifest=_read_json(manifest_path, "manifest"))

    plan_path = Path(plan) if plan is not None else dump_dir / "plan.json"
    if plan_path.is_file():
        inp.plan, inp.plan_path = load_plan(plan_path), plan_path
    elif plan is not None:
        load_plan(plan_path)  # raises the standard "plan file does not exist" error
    else:
        inp.notes.append(
            "no plan.json in the dump directory (compiles by this gemc write one); "
            "pass --plan PLAN to show placement, per-rank and precision sections"
        )

    inp.graph_file = _last_dump(dump_dir, inp.manifest)
    if inp.graph_file is not None:
        inp.graph = read_dump(dump_dir / inp.graph_file)
    else:
        inp.notes.append("no pass dump in the directory (--dump-mode failure?): no graph picture")

    index = dump_dir / "mlir" / "index.json"
    if index.is_file():
        inp.mlir = _read_json(index, "MLIR index")

    run_paths = [Path(r) for r in runs or []]
    if not run_paths:
        places = {dump_dir} | ({inp.plan_path.parent} if inp.plan_path else set())
        run_paths = sorted({p for d in places for p in d.glob("*.run.json")})
    for path in run_paths:
        data = _read_json(path, "run report")
        if isinstance(data, dict):
            inp.runs.append(RunReport(path, data))
        else:
            inp.notes.append(f"{path} is not a run report (a JSON object): skipped")
    return inp
