"""MLIR export status: how far the graph and each fusion group lowered through torch-mlir,
and which ops did not (from ``mlir/index.json``, written by gemc.backends.mlir.export)."""

from __future__ import annotations

from gemc.report import svg
from gemc.report.inputs import ReportInputs
from gemc.report.template import Section


def render(inp: ReportInputs) -> Section:
    title = "MLIR export"
    mdir = inp.dump_dir / "mlir"
    index = inp.mlir
    if index is None:
        for name, why in (
            ("unavailable.txt", "torch-mlir was not installed when this was compiled"),
            ("error.txt", "the MLIR export failed (a gemc bug): see mlir/error.txt"),
        ):
            if (mdir / name).is_file():
                return Section("mlir", title, f'<p class="empty">{svg.esc(why)}</p>')
        return Section("mlir", title, '<p class="empty">no MLIR in this dump directory</p>')
    graph = index.get("graph") or {}
    groups = [g for g in index.get("groups") or [] if isinstance(g, dict)]
    unsupported = [u for u in index.get("unsupported") or [] if isinstance(u, dict)]
    reached = sum(1 for g in groups if g.get("reached") == "linalg")
    lead = (
        f"torch-mlir {index.get('torch_mlir', '?')}: the graph reached {graph.get('reached') or 'nothing'}"
        + (f" with {len(graph.get('cut') or [])} ops cut" if graph.get("cut") else "")
        + f"; {reached} of {len(groups)} fusion groups reached linalg; "
        f"{len(unsupported)} ops do not lower (listed in mlir/unsupported.txt)"
    )
    files = sorted({f for fn in [graph, *groups] for f in (fn.get("files") or {}).values() if f})
    body = ""
    if unsupported:
        body += svg.table(
            ["op", "does not reach", "nodes", "reason"],
            [
                [u.get("op"), u.get("stage"), len(u.get("nodes") or []), u.get("reason")]
                for u in unsupported
            ],
        )
    failed = [g for g in groups if g.get("error")]
    if failed:
        body += svg.table(
            ["group", "error"], [[g.get("name"), g.get("error")] for g in failed[:40]]
        )
    body += (
        f'<p class="lead">files in mlir/: {svg.esc(", ".join(files[:24]))}'
        + (f" ... ({len(files)} in all)" if len(files) > 24 else "")
        + "</p>"
    )
    return Section("mlir", title, body, lead)
