"""``gemc diff a.json b.json``: what changed between two plans, and why the costs differ.

Reads only the two plans (typed, :class:`gemc.plan.Plan`). The "why" is the predicted step's breakdown (sparse
compute, all-to-all, dense compute, exposed communication, optimizer) part by part, with
the parts that moved most first, then the decisions behind them: dense strategies, table
shardings and the ranks holding them, and where per-rank memory moved.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gemc.plan import Plan, Region, Table
from gemc.table_format import ranks_str, render_table

MAX_LISTED = 20


def _f(v: Any, unit: str = "", digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def _delta(a: float | None, b: float | None, unit: str = " ms") -> str:
    if a is None or b is None:
        return "-"
    d = b - a
    pct = f" ({100 * d / a:+.1f}%)" if a else ""
    return f"{d:+.3f}{unit}{pct}"


def _header(a: Plan, b: Plan, names: tuple[str, str]) -> list[str]:
    out = [f"a: {names[0]}", f"b: {names[1]}"]
    if a.model.fingerprint != b.model.fingerprint:
        out.append("model: DIFFERENT graphs or parameter shapes (fingerprints differ)")
    else:
        out.append("model: same graph and parameter shapes")
    if a.model.args != b.model.args:
        out.append(f"model args: {a.model.args} -> {b.model.args}")
    ta, tb = a.topology, b.topology
    topo = lambda t: f"{t.get('gpu')}:{t.get('hosts')}x{t.get('gpus_per_host')}"  # noqa: E731
    out.append(f"topology: {topo(ta)}" if ta == tb else f"topology: {topo(ta)} -> {topo(tb)}")
    out.append(f"planner: {a.planner}" if a.planner == b.planner
               else f"planner: {a.planner} -> {b.planner}")

    def wire(plan: Plan) -> str:
        return f"{plan.wire.forward}/{plan.wire.backward}"

    out.append(f"table exchange (forward/backward): {wire(a)}" if wire(a) == wire(b)
               else f"table exchange (forward/backward): {wire(a)} -> {wire(b)}")
    for name, plan in (("a", a), ("b", b)):
        s = plan.solver
        if s is not None and s.status != "heuristic":
            got = s.extra.get
            out.append(f"solver {name}: {s.status}, objective {_f(got('objective_ms'))} "
                       f"ms, bound {_f(got('bound_ms'))} ms, gap {_f(got('gap'))}")
    return out


def _costs(a: Plan, b: Plan) -> list[str]:
    pa, pb = a.predicted, b.predicted
    out = [f"predicted step: {_f(pa.step_ms)} ms -> {_f(pb.step_ms)} ms  "
           f"{_delta(pa.step_ms, pb.step_ms)}",
           f"max memory per rank: {_f(pa.extra.get('max_memory_gb'), ' GB', 2)} -> "
           f"{_f(pb.extra.get('max_memory_gb'), ' GB', 2)}"]
    ba, bb = pa.extra.get("breakdown_ms") or {}, pb.extra.get("breakdown_ms") or {}
    parts = sorted(set(ba) | set(bb),
                   key=lambda k: (-abs((bb.get(k) or 0) - (ba.get(k) or 0)), k))
    rows = [[k, ba.get(k), bb.get(k), _delta(ba.get(k, 0.0), bb.get(k, 0.0), "")]
            for k in parts if (ba.get(k) or 0) != (bb.get(k) or 0)]
    if rows:
        out += ["", render_table(["part of the step (ms)", "a", "b", "b - a"], rows,
                                 title="why the predicted step differs (largest change first)")]
    return out


def _regions(a: Plan, b: Plan) -> list[str]:
    ra = {r.name: r for r in a.regions}
    rb = {r.name: r for r in b.regions}

    def label(r: Region | None) -> str:
        if r is None:
            return "(absent)"
        group = r.extra.get("shard_group")
        s = r.strategy + (f"/{group}" if group else "")
        return s + ("+ckpt" if r.extra.get("checkpoint") else "")

    rows = [[n or "(root)", label(ra.get(n)), label(rb.get(n))]
            for n in sorted(set(ra) | set(rb)) if label(ra.get(n)) != label(rb.get(n))]
    if not rows:
        return ["dense strategies: unchanged"]
    return [render_table(["region", "a", "b"], rows, title=f"dense strategies ({len(rows)} changed)")]


def _placement_label(t: Table | None) -> str:
    """A table's sharding, with its storage precision when not fp32 (a change of either
    is a change of the table's placement)."""
    if t is None:
        return "(absent)"
    precision = t.precision or "fp32"
    return t.sharding + ("" if precision == "fp32" else f" {precision}")


def _size(t: Table | None) -> int:
    return t.rows * t.dim if t is not None else 0


def _tables(a: Plan, b: Plan) -> list[str]:
    ta = {t.fqn: t for t in a.tables}
    tb = {t.fqn: t for t in b.tables}
    moves: Counter = Counter()
    rows = []
    same = 0
    for fqn in sorted(set(ta) | set(tb),
                      key=lambda f: (-max(_size(ta.get(f)), _size(tb.get(f))), f)):
        x, y = ta.get(fqn), tb.get(fqn)
        sx, sy = _placement_label(x), _placement_label(y)
        rx = [s.rank for s in x.shards] if x else []
        ry = [s.rank for s in y.shards] if y else []
        if sx == sy and rx == ry:
            same += 1
            continue
        moves[(sx, sy)] += 1
        if len(rows) < MAX_LISTED:
            rows.append([fqn, sx, ranks_str(rx), sy, ranks_str(ry)])
    if not moves:
        return [f"tables: unchanged ({same})"]
    out = [f"tables: {sum(moves.values())} changed, {same} unchanged"]
    out += [f"  {n:5d}  {sx} -> {sy}" for (sx, sy), n in sorted(moves.items(),
                                                                key=lambda kv: (-kv[1], kv[0]))]
    out += ["", render_table(["table", "a sharding", "a ranks", "b sharding", "b ranks"], rows,
                             title=f"largest changed tables (up to {MAX_LISTED})")]
    return out


def _ranks(a: Plan, b: Plan) -> list[str]:
    pa, pb = a.predicted.per_rank, b.predicted.per_rank
    if not pa or not pb or len(pa) != len(pb):
        return []
    keys = ("memory_gb", "sparse_compute_ms", "comm_ms")
    rows = []
    for k in keys:
        da = [r.get(k) or 0.0 for r in pa]
        db = [r.get(k) or 0.0 for r in pb]
        i = max(range(len(da)), key=lambda j: (abs(db[j] - da[j]), -j))
        rows.append([k, max(da), max(db), i, da[i], db[i]])
    return ["", render_table(["per rank", "max a", "max b", "most changed rank", "a", "b"], rows,
                             title="per-rank extremes")]


def diff(a: Plan, b: Plan, *, names: tuple[str, str] = ("a", "b")) -> str:
    """The report ``gemc diff`` prints (both plans typed, so validated as they were read)."""
    out = _header(a, b, names)
    out += [""] + _costs(a, b)
    out += [""] + _regions(a, b)
    out += [""] + _tables(a, b)
    out += _ranks(a, b)
    return "\n".join(out)
