"""``gemc report DUMP_DIR -o report.html``: one static HTML page about a compile.

Sections (each a module in ``gemc.report.sections``, anchored by its id): the pass
timeline (``timeline``), the graph with its fusion groups (``graph``), per-rank memory and
time (``ranks``), the table-placement map (``tables``), the precision map
(``precision``), measured vs predicted from a run report (``measured``) and the MLIR
export status (``mlir``). Pictures are inline SVG, styles one inline stylesheet: no
server, no script, nothing fetched, so the file opens anywhere. The page holds no
timestamp: the same dump gives the same bytes.

What it reads is in ``gemc.report.inputs``; only ``manifest.json`` is required.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from gemc.atomic_write import write_atomic
from gemc.report.inputs import ReportInputs, load_inputs
from gemc.report.sections import SECTION_IDS, SECTIONS
from gemc.report.svg import esc
from gemc.report.template import Section, page

__all__ = ["SECTION_IDS", "render_report", "write_report"]


def _facts(inp: ReportInputs) -> list[tuple[str, str]]:
    facts = [("dump", str(inp.dump_dir))]
    plan = inp.plan
    if plan is None:
        return facts
    model, topo, pred = plan.get("model", {}), plan.get("topology", {}), plan.get("predicted", {})
    step = pred.get("step_ms")
    facts += [
        ("model", f"{model.get('entrypoint')} {model.get('args', {})}"),
        ("topology", f"{topo.get('gpu')}:{topo.get('hosts')}x{topo.get('gpus_per_host')}"),
        ("world", str(plan.get("mesh", {}).get("world_size"))),
        ("planner", str(plan.get("planner"))),
        ("predicted step", f"{step:.4g} ms" if isinstance(step, (int, float)) else "-"),
        ("regions", str(len(plan.get("regions", [])))),
        ("tables", str(len(plan.get("tables", [])))),
        ("kernels", str(len(plan.get("kernels", [])))),
    ]
    return facts


def _safe(module: object, inp: ReportInputs) -> Section:
    """A section that fails to render shows the error in its place; the page still renders
    (its inputs are files written by other versions and other engineers' passes)."""
    sid = SECTION_IDS[SECTIONS.index(module)]  # type: ignore[arg-type]
    try:
        return module.render(inp)  # type: ignore[attr-defined]
    except Exception:
        detail = traceback.format_exc(limit=4)
        return Section(
            sid, sid, f'<p class="empty">this section failed to render:</p><pre>{esc(detail)}</pre>'
        )


def render_report(
    dump_dir: str | Path, plan: str | Path | None = None, runs: list[str | Path] | None = None
) -> str:
    inp = load_inputs(dump_dir, plan, runs)
    sections = [_safe(m, inp) for m in SECTIONS]
    model = (inp.plan or {}).get("model", {}).get("entrypoint") or Path(dump_dir).name
    import gemc

    return page(
        f"gemc compile report: {model}",
        _facts(inp),
        sections,
        inp.notes,
        f"gemc {gemc.__version__} report of {inp.dump_dir}",
    )


def write_report(
    dump_dir: str | Path,
    out: str | Path,
    plan: str | Path | None = None,
    runs: list[str | Path] | None = None,
) -> Path:
    html = render_report(dump_dir, plan, runs)
    write_atomic(Path(out), html)
    return Path(out)
