"""The plan file: a versioned, self-contained JSON document, validated on write and read.

The plan is a typed object, :class:`Plan` (frozen dataclasses per section: model, mesh,
regions, tables and their shards, kernels, predictions, exchange, solver), with one reader,
:meth:`Plan.from_json`, which validates while it builds, and one writer,
:meth:`Plan.to_json`. ``load_plan``/``validate_plan``/``write_plan`` take and give the
plain dict for the code that still reads the document by key.

The runner needs nothing but this file (and the model entrypoint it names), so the plan
carries the topology, the mesh, every region's strategy, every table's shards, every
kernel and precision choice, and the predictions. It holds no timestamps and is written
with sorted keys: the same inputs give the same bytes.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from gemc.atomic_write import write_atomic
from gemc.errors import PlanError
from gemc.exchange_precision import EXCHANGE_PRECISIONS, WirePrecision
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


def write_plan(path: str | Path, plan: Plan | dict[str, Any]) -> None:
    """Validate, then write atomically: a bad plan is never written, a good one never half.

    The plan's model is located from ``path`` first (:func:`locate_model`, in place for a
    dict), so a plan on disk finds its model file from any working directory."""
    data = plan.to_dict() if isinstance(plan, Plan) else plan
    locate_model(data, Path(path))
    # built without Plan.from_json's copy of a dict: this plan is written and dropped
    write_atomic(Path(path), _build(data, "the plan being written").to_json())


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


def read_plan(path: str | Path) -> Plan:
    """The plan file at ``path`` as a :class:`Plan` (one PlanError naming the file and the
    field when it is missing, not JSON, a run report, or invalid)."""
    return _read(Path(path))[1]


def load_plan(path: str | Path) -> dict[str, Any]:
    """The plan file at ``path`` as a validated plain dict (see :func:`read_plan`): the
    parsed document itself, which the validated :class:`Plan` was built from."""
    return _read(Path(path))[0]


def _read(path: Path) -> tuple[dict[str, Any], Plan]:
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
    return plan, _build(plan, str(path))  # parsed here: the plan's own, no copy needed


def validate_plan(plan: Any, *, source: str = "plan") -> Plan:
    """Check structure and consistency; raise one PlanError naming the field at fault.
    Returns the typed plan (:meth:`Plan.from_json`)."""
    return Plan.from_json(plan, source=source)


_MISSING = object()


def _copy(value: Any) -> Any:
    """A JSON value's own copy: a plan owns its data, and what ``to_dict`` gives is the
    caller's (a faster ``deepcopy`` for dicts, lists and scalars)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def _rest(raw: dict[str, Any], typed: tuple[str, ...]) -> dict[str, Any]:
    """The keys a section's dataclass does not type: kept verbatim, written back as read."""
    return {k: v for k, v in raw.items() if k not in typed}


def _emit(extra: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
    """A section's JSON object: its untyped keys, then its typed fields; an optional field
    that is None was absent and stays absent (``_MISSING`` marks those). Shares the
    plan's values: ``to_dict`` copies, ``to_json`` only reads."""
    out = dict(extra)
    for key, value in fields.items():
        if value is not _MISSING:
            out[key] = value
    return out


def _opt(value: Any) -> Any:
    return _MISSING if value is None else value


class _Section:
    """What every section (and the plan) offers: its JSON object as the caller's own copy.
    Copies are made at the two edges only (``Plan.from_json`` of a dict, ``to_dict``), so
    reading a plan file and writing a plan copy nothing: a 10^5-shard plan stays cheap."""

    _TYPED: tuple[str, ...] = ()

    def _document(self) -> dict[str, Any]:
        """The JSON object: ``extra``, then the typed fields (a section as its object, a
        tuple as a list, None as absent)."""
        fields = {}
        for name in self._TYPED:
            value = getattr(self, name)
            if isinstance(value, _Section):
                value = value._document()
            elif isinstance(value, tuple):
                value = [v._document() if isinstance(v, _Section) else v for v in value]
            fields[name] = _opt(value)
        return _emit(self.extra, **fields)

    def to_dict(self) -> dict[str, Any]:
        """The section as plain JSON values (the caller's own copy)."""
        return _copy(self._document())


@dataclass(frozen=True)
class Shard(_Section):
    """One rank's block of a table: rows ``[row_offset, row_offset + rows)`` by columns
    ``[col_offset, col_offset + cols)``."""

    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int
    extra: Mapping[str, Any] = field(default_factory=dict)

    _TYPED = ("rank", "row_offset", "rows", "col_offset", "cols")

    def _document(self) -> dict[str, Any]:
        out = {"rank": self.rank, "row_offset": self.row_offset, "rows": self.rows,
               "col_offset": self.col_offset, "cols": self.cols}
        return {**self.extra, **out} if self.extra else out


@dataclass(frozen=True)
class Table(_Section):
    """An embedding table: its size, sharding type and shards. ``precision`` is None when
    the plan does not state it (the table is stored in fp32); ``extra`` holds the graph
    facts and prices (lookup, pooling, predicted_ms, route_ms, ...) the runner and the
    tools read by name."""

    fqn: str
    rows: int
    dim: int
    sharding: str
    shards: tuple[Shard, ...]
    precision: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _TYPED = ("fqn", "rows", "dim", "sharding", "shards", "precision")


@dataclass(frozen=True)
class Region(_Section):
    """A dense region and its strategy (one of ``gemc.sharding.DENSE_STRATEGIES``);
    ``extra``: its size, FLOPs, ops, predicted time, shard group, checkpointing."""

    name: str
    strategy: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    _TYPED = ("name", "strategy")


@dataclass(frozen=True)
class KernelChoice(_Section):
    """A recorded choice (see ``KERNEL_CHOICES``): which code runs a generated group, and
    the measured times (``gemc_ms``, ``inductor_ms``, ``measured_on`` in ``extra``)."""

    use: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    _TYPED = ("use",)


@dataclass(frozen=True)
class Kernel(_Section):
    """A kernel entry: its kind (``gemc.kernel_kinds``) and the fields its runtime reads
    (``extra``: name, nodes, structure, sha256, ...), and an optional recorded choice."""

    kind: str
    choice: KernelChoice | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _TYPED = ("kind", "choice")

    @property
    def name(self) -> str | None:
        return self.extra.get("name")


@dataclass(frozen=True)
class Model(_Section):
    """What the runner rebuilds: the entrypoint and its arguments, the capture's
    fingerprint; where the entrypoint's file is (see :func:`locate_model`; None when not
    stated); ``extra``: sizes, FLOPs and the stated ``batch_size``."""

    entrypoint: str
    args: Mapping[str, Any]
    fingerprint: Any
    entrypoint_from_plan: str | None = None
    entrypoint_absolute: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _TYPED = ("entrypoint", "args", "fingerprint", "entrypoint_from_plan", "entrypoint_absolute")

    @property
    def batch_size(self) -> int | None:
        """The samples per batch the model states; None when it states none."""
        return self.extra.get("batch_size")


@dataclass(frozen=True)
class Mesh(_Section):
    """The device mesh: ``world_size`` ranks as ``shape`` (hosts x GPUs per host)."""

    world_size: int
    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _TYPED = ("world_size", "shape", "dim_names")


@dataclass(frozen=True)
class Predicted(_Section):
    """The cost model's prediction; null (None) fields when no cost model ran."""

    step_ms: float | None
    mfu: float | None
    per_rank: list[Any] | None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _TYPED = ("step_ms", "mfu", "per_rank")

    def _document(self) -> dict[str, Any]:
        return _emit(self.extra, step_ms=self.step_ms, mfu=self.mfu,
                     per_rank=self.per_rank)


@dataclass(frozen=True)
class Exchange(_Section):
    """The pooled exchange's wire precisions (None: not stated, fp32)."""

    forward: str | None = None
    backward: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _TYPED = ("forward", "backward")


@dataclass(frozen=True)
class SolverReport(_Section):
    """The parallelize pass's report: the planner asked for, CP-SAT's status (or
    ``heuristic``/``crashed``), and its figures in ``extra``."""

    _TYPED = ("planner", "status")

    planner: str  # one of PLANNERS
    status: str  # one of SOLVER_STATUSES
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan(_Section):
    """The plan as a typed object: ``Plan.from_json`` validates while it builds (one
    PlanError naming the field, the plan file and the fix), ``to_json`` writes the
    canonical bytes. Keys no section types (``extra``: e.g. ``optimizer``) are kept and
    written back verbatim, so reading and writing a plan never changes it."""

    schema_version: int
    gemc_version: str
    model: Model
    topology: Mapping[str, Any]
    mesh: Mesh
    regions: tuple[Region, ...]
    tables: tuple[Table, ...]
    kernels: tuple[Kernel, ...]
    precision: tuple[Mapping[str, Any], ...]
    predicted: Predicted
    planner: str
    warnings: tuple[Any, ...]
    exchange: Exchange | None = None
    solver: SolverReport | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _TYPED = tuple(_TOP_LEVEL) + ("exchange", "solver")

    @property
    def optimizer(self) -> Mapping[str, Any] | None:
        """The optimizers priced (``optimizer.embedding.kind``); None in older plans."""
        return self.extra.get("optimizer")

    @property
    def wire(self) -> WirePrecision:
        """The pooled exchange's precision (fp32 where the plan states none)."""
        block = self.exchange or Exchange()
        return WirePrecision(block.forward or "fp32", block.backward or "fp32")

    @classmethod
    def from_json(cls, text_or_dict: str | Mapping[str, Any], *, source: str = "plan") -> Plan:
        """Parse (text) and validate while building; ``source`` names the plan in errors."""
        data: Any = text_or_dict
        if isinstance(text_or_dict, Mapping):
            data = _copy(dict(text_or_dict))  # the plan owns its data; parsed text it owns
        if isinstance(text_or_dict, str):
            try:
                data = json.loads(text_or_dict)
            except ValueError as exc:
                raise PlanError(
                    f"plan '{source}' is not valid JSON: {exc}", where=source,
                    fix="the file is corrupt or truncated; compile the plan again with "
                    "gemc compile") from exc
        return _build(data, source)

    def to_json(self) -> str:
        """The canonical text (:func:`dumps`): the same plan gives the same bytes."""
        return dumps(self._document())


def _fail(source: str, field: str, what: str, fix: str) -> NoReturn:
    raise PlanError(f"invalid plan: {field} {what}", where=f"{source}: {field}", fix=fix)


_RECOMPILE = "compile the plan again with this gemc (gemc compile ... --out plan.json)"


def _build(plan: Any, source: str) -> Plan:
    """The one reader: check structure and consistency while building the sections;
    raise one PlanError naming the field at fault."""
    recompile = _RECOMPILE
    if not isinstance(plan, Mapping):
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
    model = _model(plan["model"], source)
    mesh = _mesh(plan["mesh"], source)
    regions = tuple(_region(r, f"regions[{i}]", source) for i, r in enumerate(plan["regions"]))
    tables = tuple(_table(t, f"tables[{i}]", mesh.world_size, source, recompile)
                   for i, t in enumerate(plan["tables"]))
    kernels = tuple(_kernel(k, f"kernels[{i}]", source, recompile)
                    for i, k in enumerate(plan["kernels"]))
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
    return Plan(
        schema_version=version,
        gemc_version=plan["gemc_version"],
        model=model,
        topology=plan["topology"],
        mesh=mesh,
        regions=regions,
        tables=tables,
        kernels=kernels,
        precision=tuple(plan["precision"]),
        predicted=Predicted(predicted["step_ms"], predicted["mfu"], predicted["per_rank"],
                            _rest(predicted, Predicted._TYPED)),
        planner=plan["planner"],
        warnings=tuple(plan["warnings"]),
        exchange=None if exchange is None else Exchange(
            exchange.get("forward"), exchange.get("backward"), _rest(exchange, Exchange._TYPED)),
        solver=None if solver is None else SolverReport(
            solver["planner"], solver["status"], _rest(solver, SolverReport._TYPED)),
        extra=_rest(plan, Plan._TYPED),
    )


def _model(model: dict[str, Any], source: str) -> Model:
    for key in ("entrypoint", "args", "fingerprint"):
        if key not in model:
            _fail(source, f"model.{key}", "is missing", _RECOMPILE)
    size = model.get("batch_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
        _fail(source, "model.batch_size", f"is {size!r}, not a positive integer or null",
              _RECOMPILE)
    for key in ("entrypoint_from_plan", "entrypoint_absolute"):
        value = model.get(key)
        if value is not None and (not isinstance(value, str) or ":" not in value):
            _fail(source, f"model.{key}", f"is {value!r}, not FILE.py:FUNC", _RECOMPILE)
    return Model(model["entrypoint"], model["args"], model["fingerprint"],
                 model.get("entrypoint_from_plan"), model.get("entrypoint_absolute"),
                 _rest(model, Model._TYPED))


def _mesh(mesh: dict[str, Any], source: str) -> Mesh:
    world = mesh.get("world_size")
    if not isinstance(world, int) or world < 1:
        _fail(source, "mesh.world_size", f"is {world!r}, expected a positive integer",
              _RECOMPILE)
    shape = mesh.get("shape")
    if not isinstance(shape, list) or not shape or _prod(shape) != world:
        _fail(
            source,
            "mesh.shape",
            f"is {shape!r}; its product must equal world_size {world}",
            _RECOMPILE,
        )
    names = mesh.get("dim_names")
    return Mesh(world, tuple(shape), tuple(names) if names is not None else None,
                _rest(mesh, Mesh._TYPED))


def _region(region: Any, where: str, source: str) -> Region:
    if not isinstance(region, dict) or "name" not in region:
        _fail(source, where, "has no name", _RECOMPILE)
    if region.get("strategy") not in DENSE_STRATEGIES:
        _fail(
            source,
            f"{where}.strategy",
            f"is {region.get('strategy')!r}, not one of {DENSE_STRATEGIES}",
            _RECOMPILE,
        )
    return Region(region["name"], region["strategy"], _rest(region, Region._TYPED))


def _choice(kernel: dict[str, Any], where: str, source: str) -> KernelChoice:
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
    return KernelChoice(choice["use"], _rest(choice, KernelChoice._TYPED))


def _kernel(entry: Any, where: str, source: str, fix: str) -> Kernel:
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
    choice = _choice(entry, f"{where}.choice", source) if "choice" in entry else None
    return Kernel(entry["kind"], choice, _rest(entry, Kernel._TYPED))


def _table(table: Any, where: str, world: int, source: str, fix: str) -> Table:
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
    ranks = [r for s in table["shards"] if isinstance(s, dict)
             and isinstance(r := s.get("rank"), int)]
    counts = Counter(ranks) if len(set(ranks)) != len(ranks) else Counter()
    twice = sorted(r for r, n in counts.items() if n > 1)
    if twice:
        # the runner keeps one local shard per table, and the cost model would have priced
        # such a rank's two shards as what they are: refuse rather than run another plan
        _fail(source, f"{where}.shards", f"give rank {twice[0]} {counts[twice[0]]} shards "
              "of one table (at most one per rank)", fix)
    covered = 0
    shards = []
    for j, shard in enumerate(table["shards"]):
        sw = f"{where}.shards[{j}]"
        rank = shard.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < world:
            _fail(source, f"{sw}.rank", f"is {rank!r}, outside the mesh of {world} ranks", fix)
        r0, nr = shard.get("row_offset"), shard.get("rows")
        c0, nc = shard.get("col_offset"), shard.get("cols")
        if not (isinstance(r0, int) and isinstance(nr, int) and isinstance(c0, int)
                and isinstance(nc, int) and min(r0, nr, c0, nc) >= 0):
            _fail(source, sw, "needs non-negative integers row_offset, rows, col_offset, cols", fix)
        if r0 + nr > rows or c0 + nc > dim:
            _fail(source, sw, f"reaches past the table ({rows} x {dim})", fix)
        covered += nr * nc
        # a 10^5-shard plan: no dict of untyped keys where there are none (the usual case)
        extra = _rest(shard, Shard._TYPED) if len(shard) > len(Shard._TYPED) else {}
        shards.append(Shard(rank, r0, nr, c0, nc, extra))
    replicas = len(table["shards"]) if SHARDINGS[table["sharding"]].replicated else 1
    if covered != rows * dim * replicas:
        _fail(
            source, f"{where}.shards", f"cover {covered} of {rows * dim * replicas} elements", fix
        )
    return Table(table["fqn"], rows, dim, table["sharding"], tuple(shards),
                 table.get("precision"), _rest(table, Table._TYPED))


def _prod(values: list[Any]) -> int:
    p = 1
    for v in values:
        if not isinstance(v, int):
            return -1
        p *= v
    return p
