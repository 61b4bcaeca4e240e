"""The default pass pipeline, in order (see ARCHITECTURE.md's typical order)."""

from __future__ import annotations

from gemc.pass_manager import Pass
from gemc.passes.assign_regions import AssignRegions
from gemc.passes.classify_ops import ClassifyOps
from gemc.passes.collect_tables import CollectTables
from gemc.passes.count_flops_bytes import CountFlopsBytes
from gemc.passes.fold_transposed_linear import FoldTransposedLinear
from gemc.passes.fuse import Fuse
from gemc.passes.group_embeddings import GroupEmbeddings
from gemc.passes.match_jagged_attention import MatchJaggedAttention
from gemc.passes.match_silu_attention import MatchSiluAttention
from gemc.passes.match_softmax_attention import MatchSoftmaxAttention
from gemc.passes.pack_jagged_tokens import PackJaggedTokens
from gemc.passes.parallelize import Parallelize
from gemc.passes.place_default import PlaceDefault
from gemc.passes.precision import ChoosePrecision, PrecisionOptions
from gemc.passes.predict_time import PredictTime
from gemc.plan_builder import EmitPlan
from gemc.solver.problem import SolverSettings


def annotation_passes() -> list[Pass]:
    """The passes that turn a captured graph into an annotated one (no decisions yet)."""
    return [ClassifyOps(), CollectTables(), CountFlopsBytes(), AssignRegions()]


def placement_pass(planner: str, solver: SolverSettings | None = None,
                   table_optimizer: str | None = None, table_precision: str | None = None,
                   exchange_precision: str | None = None) -> Pass:
    """``default``: the place-default placeholder; ``cpsat`` / ``greedy`` / ``naive``: the
    parallelize pass with that planner and those options (its fields; place-default has
    none: the table optimizer and exchange precision a plan without a planner records are
    emit-plan's fields, ``gemc.plan_builder.EmitPlan``)."""
    if planner == "default":
        return PlaceDefault()
    return Parallelize(planner, solver or SolverSettings(), table_optimizer, table_precision,
                       exchange_precision)


def default_pipeline(planner: str = "default", precision: PrecisionOptions | None = None,
                     placement: Pass | None = None,
                     emission: EmitPlan | None = None) -> list[Pass]:
    """Every pass of a compile; ``precision``: choose-precision's options (None: defaults);
    ``placement``: the placement pass with its options (None: ``placement_pass(planner)``);
    ``emission``: the last pass, emit-plan, with the options the plan records (None:
    ``EmitPlan(planner)``)."""
    return [*planning_passes(planner, precision, placement),
            emission or EmitPlan(planner)]


def planning_passes(planner: str = "default", precision: PrecisionOptions | None = None,
                    placement: Pass | None = None) -> list[Pass]:
    """The default pipeline up to and including the placement (without emit-plan)."""
    return [*annotation_passes(), PredictTime(), *kernel_passes(), ChoosePrecision(precision),
            placement or placement_pass(planner)]


def kernel_passes() -> list[Pass]:
    """Kernel selection, after predict-time (they price groups with its per-node times):
    recommendation kernels first, so generic fusion does not take their nodes; the packed
    token region last (it spans the groups and attentions that run inside it)."""
    return [MatchJaggedAttention(), MatchSoftmaxAttention(), MatchSiluAttention(),
            GroupEmbeddings(), FoldTransposedLinear(), Fuse(),
            PackJaggedTokens()]


def pipeline_from_spec(spec: str, planner: str = "default",
                       precision: PrecisionOptions | None = None,
                       placement: Pass | None = None,
                       emission: EmitPlan | None = None) -> list[Pass]:
    """The pipeline a pass-spec string names: ``"name{option=value,...},name,..."`` (as
    xDSL's ``-p``), each pass one of :func:`default_pipeline`'s with its dataclass fields
    set from the options. Why the default order is kept (the spec may leave passes out and
    set their options, not reorder them): every pass reads what the annotation passes
    before it wrote, and the placement pass decides last; a reordered pipeline would fail
    far from its cause. The annotation passes and the placement pass are required for the
    same reason. emit-plan, which turns the graph into the plan, is appended where the spec
    leaves it out. Tuple options take ``|``-separated values (``fuse{kinds=norm|pointwise}``).
    Bad input is one :class:`~gemc.errors.GemcUserError` naming the item and the fix."""
    from gemc.errors import GemcUserError

    passes = default_pipeline(planner, precision, placement, emission)
    by_name = {p.name: p for p in passes}
    order = {p.name: i for i, p in enumerate(passes)}
    where = f"--passes {spec!r}"
    chosen: list[Pass] = []
    for name, options in _spec_items(spec, where):
        if name not in by_name:
            raise GemcUserError(f"unknown pass {name!r} in the pass spec", where=where,
                                fix=f"use the passes of this pipeline (planner {planner!r}): "
                                    f"{', '.join(by_name)}")
        if chosen and order[name] <= order[chosen[-1].name]:
            raise GemcUserError(
                f"pass {name!r} comes after {chosen[-1].name!r} in the spec but before it "
                "in the pipeline", where=where,
                fix=f"keep the pipeline's order: {', '.join(by_name)}")
        chosen.append(_with_options(by_name[name], options, where))
    names = [p.name for p in chosen]
    required = [p.name for p in (*annotation_passes(), placement_pass(planner))]
    missing = [n for n in required if n not in names]
    if missing:
        raise GemcUserError(f"the pass spec leaves out {', '.join(missing)}", where=where,
                            fix="the annotation passes and the placement pass are needed by "
                                "every later step; add them (or use --disable-pass to skip "
                                "an optional pass)")
    if names[-1] != EmitPlan.name:
        chosen.append(passes[-1])
    return chosen


def _spec_items(spec: str, where: str) -> list[tuple[str, dict[str, str]]]:
    """``"a{x=1,y=2},b"`` -> ``[("a", {"x": "1", "y": "2"}), ("b", {})]``."""
    from gemc.errors import GemcUserError

    items: list[tuple[str, dict[str, str]]] = []
    i, n = 0, len(spec)
    while i < n:
        j = i
        while j < n and spec[j] not in "{,":
            j += 1
        name = spec[i:j].strip()
        options: dict[str, str] = {}
        if j < n and spec[j] == "{":
            end = spec.find("}", j)
            if end < 0:
                raise GemcUserError(f"unclosed '{{' after {name!r} in the pass spec",
                                    where=where, fix="close the options: name{key=value}")
            for part in filter(None, (p.strip() for p in spec[j + 1:end].split(","))):
                key, eq, value = part.partition("=")
                if not eq or not key.strip():
                    raise GemcUserError(f"option {part!r} of pass {name!r} is not key=value",
                                        where=where, fix="write options as name{key=value}")
                options[key.strip()] = value.strip()
            j = end + 1
        if not name:
            raise GemcUserError("an empty pass name in the pass spec", where=where,
                                fix="separate pass names by single commas: a,b{x=1},c")
        items.append((name, options))
        while j < n and spec[j] in " ":
            j += 1
        if j < n and spec[j] != ",":
            raise GemcUserError(f"unexpected {spec[j:]!r} after pass {name!r}", where=where,
                                fix="separate passes by commas: a,b{x=1},c")
        i = j + 1
    return items


_PARSERS = {"int": int, "float": float, "str": str,
            "bool": lambda v: {"true": True, "1": True, "false": False, "0": False}[v.lower()],
            "tuple[str, ...]": lambda v: tuple(x.strip() for x in v.split("|") if x.strip())}


def _with_options(p: Pass, options: dict[str, str], where: str) -> Pass:
    """``p`` with its dataclass fields set from the spec's strings, by the field's type."""
    import dataclasses

    from gemc.errors import GemcUserError

    fields = {f.name: f for f in dataclasses.fields(p)}  # type: ignore[arg-type]
    values: dict[str, object] = {}
    for key, raw in options.items():
        f = fields.get(key)
        if f is None:
            raise GemcUserError(f"pass {p.name!r} has no option {key!r}", where=where,
                                fix=f"its options: {', '.join(fields) or 'none'}")
        parse = _PARSERS.get(str(f.type))
        if parse is None:
            raise GemcUserError(f"option {key!r} of pass {p.name!r} ({f.type}) cannot be set "
                                "from a pass spec", where=where,
                                fix="set it through its own flag (e.g. --precision for "
                                    "choose-precision) or the Python API")
        try:
            values[key] = parse(raw)
        except (ValueError, KeyError):
            raise GemcUserError(f"option {key}={raw!r} of pass {p.name!r} is not a {f.type}",
                                where=where, fix=f"give {key} a {f.type} value") from None
    return dataclasses.replace(p, **values) if values else p  # type: ignore[type-var]
