"""The plan file: a versioned, self-contained JSON document, validated on write and read.

The runner needs nothing but this file (and the model entrypoint it names), so the plan
carries the topology, the mesh, every region's strategy, every table's shards, every
kernel and precision choice, and the predictions. It holds no timestamps and is written
with sorted keys: the same inputs give the same bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gemc.dump import write_atomic
from gemc.errors import PlanError
from gemc.exchange_precision import EXCHANGE_PRECISIONS
from gemc.kernel_kinds import KINDS
from gemc.sharding import DENSE_STRATEGIES, SHARDINGS
from gemc.table_precision import TABLE_PRECISIONS

SCHEMA_VERSION = 1
PLANNERS = ("default", "cpsat", "greedy", "naive")
# the optional "solver" block (written by the parallelize pass): CP-SAT's status, or
# "heuristic" for greedy / naive, "crashed" when its child process died (the plan is a heuristic's)
# optimizers of embedding tables the runner executes (backends/torch/sparse_optim.py): the
# compile's --table-optimizer offers these (plus "auto"), the plan records the one priced in
# ``optimizer.embedding.kind``, the runner runs it
TABLE_OPTIMIZERS = ("rowwise_adagrad", "adam")
FP32_MATMUL = ("ieee", "tf32")
"""How a plan runs fp32 GEMMs (its ``"*"`` precision entry's ``fp32_matmul``)."""
SOLVER_STATUSES = ("optimal", "feasible", "unknown", "infeasible", "heuristic", "crashed")
KERNEL_CHOICES = ("gemc", "inductor")
"""A kernel entry's optional ``choice`` (``{"use": ..., "gemc_ms", "inductor_ms",
"measured_on"}``): which code runs the group, gemc's kernel or Inductor's for the same
nodes, as measured by ``gemc run --measure-kernels`` and folded into the plan by ``gemc
record-choices``. Optional: a plan without it runs each group's default."""
_TOP_LEVEL = {
    "schema_version": int,
    "gemc_version": str,
    "model": dict,
    "topology": dict,
    "mesh": dict,
    "regions": list,
    "tables": list,
    "kernels": list,
    "precision": list,
    "predicted": dict,
    "planner": str,
    "warnings": list,
}


def dumps(plan: dict[str, Any]) -> str:
    """Canonical text: one top-level key per line, one list element (a table, a region)
    per line, keys sorted. Readable with grep and diff, and fast: a 4096-rank GEM plan
    holds 10^5 shards, too many for Python's indenting encoder."""

    def compact(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(", ", ": "), allow_nan=False)

    lines = []
    for key in sorted(plan):
        value = plan[key]
        if isinstance(value, list) and value:
            items = ",\n".join(f"  {compact(v)}" for v in value)
            lines.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {compact(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_plan(path: str | Path, plan: dict[str, Any]) -> None:
    """Validate, then write atomically: a bad plan is never written, a good one never half.

    The plan's model is located from ``path`` first (:func:`locate_model`, in place), so a
    plan on disk finds its model file from any working directory."""
    locate_model(plan, Path(path))
    validate_plan(plan, source="the plan being written")
    write_atomic(Path(path), dumps(plan))


def locate_model(plan: dict[str, Any], plan_path: Path) -> dict[str, Any]:
    """Record where a ``FILE.py:FUNC`` entrypoint's file is, for a run from elsewhere.

    ``model.entrypoint`` stays as typed (relative to the compile's working directory).
    ``model.entrypoint_from_plan`` names the file relative to the plan's folder (a plan
    and a repository moved together, or a run from another directory) and
    ``model.entrypoint_absolute`` where it was (another host with the same checkout path).
    A ``package.module:FUNC`` entrypoint keeps its module form and gets neither. The file
    is found as typed from the current directory, else from a stored absolute path; when
    neither exists (a plan re-written elsewhere) the stored fields are kept. Paths depend
    on where the repository and the plan are, never on time: the same compile in the same
    place gives the same bytes.
    """
    model = plan.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("entrypoint"), str):
        return plan
    target, sep, func = model["entrypoint"].rpartition(":")
    if not sep or not target.endswith(".py"):
        return plan
    stored = model.get("entrypoint_absolute")
    stored_file = stored.rpartition(":")[0] if isinstance(stored, str) else None
    if Path(target).is_file():
        file = Path(target).resolve()
    elif stored_file and Path(stored_file).is_file():
        file = Path(stored_file)
    else:
        return plan
    plan_dir = plan_path.resolve().parent
    model["entrypoint_absolute"] = f"{file.as_posix()}:{func}"
    model["entrypoint_from_plan"] = f"{Path(os.path.relpath(file, plan_dir)).as_posix()}:{func}"
    return plan


def load_plan(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise PlanError(
            f"plan file '{path}' does not exist",
            where=str(path),
            fix="give the path gemc compile --out wrote",
        )
    try:
        plan = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise PlanError(
            f"plan file '{path}' is not valid JSON: {exc}",
            where=str(path),
            fix="the file is corrupt or truncated; compile the plan again with gemc compile",
        ) from exc
    if isinstance(plan, dict) and "schema_version" not in plan and "losses" in plan:
        raise PlanError(
            f"'{path}' is a run report (written by gemc run), not a plan",
            where=str(path),
            fix=f"`gemc report DUMP_DIR --run {path}` reads it; commands that take a plan "
            "want the file gemc compile --out wrote",
        )
    validate_plan(plan, source=str(path))
    return plan


def _fail(source: str, field: str, what: str, fix: str) -> None:
    raise PlanError(f"invalid plan: {field} {what}", where=f"{source}: {field}", fix=fix)


def validate_plan(plan: Any, *, source: str = "plan") -> None:
    """Check structure and consistency; raise one PlanError naming the field at fault."""
    recompile = "compile the plan again with this gemc (gemc compile ... --out plan.json)"
    if not isinstance(plan, dict):
        _fail(source, "(top level)", f"is a {type(plan).__name__}, not an object", recompile)
    version = plan.get("schema_version")
    if version != SCHEMA_VERSION:
        _fail(
            source,
            "schema_version",
            f"is {version!r}; this gemc reads version {SCHEMA_VERSION}",
            recompile,
        )
    for key, typ in _TOP_LEVEL.items():
        if key not in plan:
            _fail(source, key, "is missing", recompile)
        if not isinstance(plan[key], typ):
            _fail(
                source, key, f"is a {type(plan[key]).__name__}, expected {typ.__name__}", recompile
            )
    if plan["planner"] not in PLANNERS:
        _fail(source, "planner", f"is {plan['planner']!r}, not one of {PLANNERS}", recompile)
    model = plan["model"]
    for key in ("entrypoint", "args", "fingerprint"):
        if key not in model:
            _fail(source, f"model.{key}", "is missing", recompile)
    size = model.get("batch_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
        _fail(source, "model.batch_size", f"is {size!r}, not a positive integer or null",
              recompile)
    for key in ("entrypoint_from_plan", "entrypoint_absolute"):
        value = model.get(key)
        if value is not None and (not isinstance(value, str) or ":" not in value):
            _fail(source, f"model.{key}", f"is {value!r}, not FILE.py:FUNC", recompile)
    mesh = plan["mesh"]
    world = mesh.get("world_size")
    if not isinstance(world, int) or world < 1:
        _fail(source, "mesh.world_size", f"is {world!r}, expected a positive integer", recompile)
    shape = mesh.get("shape")
    if not isinstance(shape, list) or not shape or _prod(shape) != world:
        _fail(
            source,
            "mesh.shape",
            f"is {shape!r}; its product must equal world_size {world}",
            recompile,
        )
    for i, region in enumerate(plan["regions"]):
        where = f"regions[{i}]"
        if not isinstance(region, dict) or "name" not in region:
            _fail(source, where, "has no name", recompile)
        if region.get("strategy") not in DENSE_STRATEGIES:
            _fail(
                source,
                f"{where}.strategy",
                f"is {region.get('strategy')!r}, not one of {DENSE_STRATEGIES}",
                recompile,
            )
    for i, table in enumerate(plan["tables"]):
        _validate_table(table, f"tables[{i}]", world, source, recompile)
    for i, entry in enumerate(plan["kernels"]):
        _validate_kernel(entry, f"kernels[{i}]", source, recompile)
        if "choice" in entry:
            _validate_choice(entry, f"kernels[{i}].choice", source)
    predicted = plan["predicted"]
    for key in ("step_ms", "mfu", "per_rank"):
        if key not in predicted:
            _fail(source, f"predicted.{key}", "is missing (null is allowed)", recompile)
    exchange = plan.get("exchange")
    if exchange is not None:  # optional: the pooled exchange's wire precision (fp32 without)
        if not isinstance(exchange, dict):
            _fail(source, "exchange", f"is a {type(exchange).__name__}, not an object",
                  recompile)
        for key in ("forward", "backward"):
            if exchange.get(key, "fp32") not in EXCHANGE_PRECISIONS:
                _fail(source, f"exchange.{key}", f"is {exchange.get(key)!r}, not one of "
                      f"{EXCHANGE_PRECISIONS}", recompile)
    solver = plan.get("solver")
    if solver is not None:
        if not isinstance(solver, dict) or solver.get("planner") not in PLANNERS:
            _fail(source, "solver.planner", f"is not one of {PLANNERS}", recompile)
        if solver.get("status") not in SOLVER_STATUSES:
            _fail(source, "solver.status", f"is {solver.get('status')!r}, not one of "
                  f"{SOLVER_STATUSES}", recompile)


def _validate_choice(kernel: dict[str, Any], where: str, source: str) -> None:
    """A recorded choice (see KERNEL_CHOICES): which code, and the times it was chosen by;
    only a generated group (one with a ``structure``) has an Inductor alternative."""
    choice = kernel["choice"]
    fix = ("record the choices again (gemc record-choices PLAN RUN.json), or delete the "
           f"field {where} (the group then runs its default)")
    if "structure" not in kernel:
        _fail(source, where, f"is set on a {kernel.get('kind')!r} kernel, which has no "
              "Inductor alternative (only generated groups do)", fix)
    if not isinstance(choice, dict) or choice.get("use") not in KERNEL_CHOICES:
        use = choice.get("use") if isinstance(choice, dict) else choice
        _fail(source, f"{where}.use", f"is {use!r}, not one of {KERNEL_CHOICES}", fix)
    for key in ("gemc_ms", "inductor_ms"):
        value = choice.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value >= 0):
            _fail(source, f"{where}.{key}", f"is {value!r}, not a time in ms >= 0 or null", fix)
def _validate_kernel(entry: Any, where: str, source: str, fix: str) -> None:
    """An entry of a declared kind (gemc.kernel_kinds) has the fields its runtime reads. A
    kind no declaration names is a module-mode kernel of a backend the runner imports with
    ``--kernel-module``; the runner refuses it by name when none registers it."""
    if not isinstance(entry, dict):
        _fail(source, where, "is not an object", fix)
    if not isinstance(entry.get("kind"), str):
        _fail(source, f"{where}.kind", f"is {entry.get('kind')!r}, not a kernel kind", fix)
    kind = KINDS.get(entry["kind"])
    missing = kind.missing(entry) if kind is not None else []
    if missing:
        _fail(source, f"{where}.{missing[0]}",
              f"is missing (a {kind.name} entry needs {', '.join(missing)})", fix)


def _validate_table(table: Any, where: str, world: int, source: str, fix: str) -> None:
    if not isinstance(table, dict):
        _fail(source, where, "is not an object", fix)
    for key in ("fqn", "rows", "dim", "sharding", "shards"):
        if key not in table:
            _fail(source, f"{where}.{key}", "is missing", fix)
    if table["sharding"] not in SHARDINGS:
        _fail(
            source,
            f"{where}.sharding",
            f"is {table['sharding']!r}, not one of {tuple(SHARDINGS)}",
            fix,
        )
    if table.get("precision", "fp32") not in TABLE_PRECISIONS:
        _fail(source, f"{where}.precision",
              f"is {table.get('precision')!r}, not one of {TABLE_PRECISIONS}", fix)
    rows, dim = table["rows"], table["dim"]
    ranks = [s.get("rank") for s in table["shards"] if isinstance(s, dict)]
    twice = sorted({r for r in ranks if ranks.count(r) > 1 and isinstance(r, int)})
    if twice:
        # the runner keeps one local shard per table, and the cost model would have priced
        # such a rank's two shards as what they are: refuse rather than run another plan
        _fail(source, f"{where}.shards", f"give rank {twice[0]} {ranks.count(twice[0])} shards "
              "of one table (at most one per rank)", fix)
    covered = 0
    for j, shard in enumerate(table["shards"]):
        sw = f"{where}.shards[{j}]"
        rank = shard.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < world:
            _fail(source, f"{sw}.rank", f"is {rank!r}, outside the mesh of {world} ranks", fix)
        r0, nr, c0, nc = (shard.get(k) for k in ("row_offset", "rows", "col_offset", "cols"))
        if not all(isinstance(v, int) and v >= 0 for v in (r0, nr, c0, nc)):
            _fail(source, sw, "needs non-negative integers row_offset, rows, col_offset, cols", fix)
        if r0 + nr > rows or c0 + nc > dim:
            _fail(source, sw, f"reaches past the table ({rows} x {dim})", fix)
        covered += nr * nc
    replicas = len(table["shards"]) if SHARDINGS[table["sharding"]].replicated else 1
    if covered != rows * dim * replicas:
        _fail(
            source, f"{where}.shards", f"cover {covered} of {rows * dim * replicas} elements", fix
        )


def _prod(values: list[Any]) -> int:
    p = 1
    for v in values:
        if not isinstance(v, int):
            return -1
        p *= v
    return p
