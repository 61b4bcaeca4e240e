"""Measured against predicted, when a run report exists (``*.run.json``).

``gemc run plan.json`` writes ``plan.run.json`` next to the plan. The runner owns that
format, so this section reads it tolerantly and documents what it looks for:

- measured step: ``step_ms`` (a number, or ``{"median"|"mean": ms}``), else
  ``vs_predicted.step_ms.measured``, else ``measured.step_ms``;
- per rank: ``per_rank`` (or ``measured.per_rank``), each with ``rank``, a step time as
  above, and memory as ``memory.peak_bytes`` | ``peak_memory_bytes`` | ``memory_bytes``
  (bytes) or ``memory_gb`` | ``peak_memory_gb`` (GB); ``memory.kind`` says what was
  measured (``cpu_peak_rss`` is a CPU process, not comparable with a GPU prediction);
- ``model.fingerprint``: if it is not the plan's, the run was of another model or plan
  and the section says so.

Predicted values come from the plan: ``predicted.step_ms`` and, per rank,
``compute_ms + exposed_comm_ms`` and ``memory_gb``. Anything missing shows as "-".
"""

from __future__ import annotations

from typing import Any

from gemc.report import svg
from gemc.report.inputs import ReportInputs, RunReport
from gemc.report.template import Section

MAX_RANKS = 64
PRED, MEAS = "#b7c4e0", "#3b6fd8"


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _ms(value: Any) -> float | None:
    if isinstance(value, dict):
        return _num(value.get("median")) or _num(value.get("mean"))
    return _num(value)


def measured_step(run: dict[str, Any]) -> float | None:
    vs = (
        ((run.get("vs_predicted") or {}).get("step_ms") or {})
        if isinstance(run.get("vs_predicted"), dict)
        else {}
    )
    measured = run.get("measured") if isinstance(run.get("measured"), dict) else {}
    return _ms(run.get("step_ms")) or _num(vs.get("measured")) or _ms(measured.get("step_ms"))


def _memory_gb(entry: dict[str, Any]) -> tuple[float | None, str | None]:
    mem = entry.get("memory") if isinstance(entry.get("memory"), dict) else {}
    kind = mem.get("kind") if isinstance(mem.get("kind"), str) else None
    for source, key in ((mem, "peak_bytes"), (entry, "peak_memory_bytes"), (entry, "memory_bytes")):
        if _num(source.get(key)) is not None:
            return float(source[key]) / 1e9, kind
    for key in ("memory_gb", "peak_memory_gb"):
        if _num(entry.get(key)) is not None:
            return float(entry[key]), kind
    return None, kind


def measured_per_rank(run: dict[str, Any]) -> dict[int, dict[str, Any]]:
    measured = run.get("measured") if isinstance(run.get("measured"), dict) else {}
    entries = run.get("per_rank") or measured.get("per_rank") or []
    out: dict[int, dict[str, Any]] = {}
    for i, e in enumerate(entries if isinstance(entries, list) else []):
        if not isinstance(e, dict):
            continue
        gb, kind = _memory_gb(e)
        rank = e.get("rank", i)
        out[int(rank) if isinstance(rank, int) else i] = {
            "step_ms": _ms(e.get("step_ms")),
            "memory_gb": gb,
            "kind": kind,
        }
    return out


def _grouped(
    labels: list[str], pred: list[float | None], meas: list[float | None], unit: str, what: str
) -> str:
    top = max([v for v in pred + meas if v is not None] + [1e-12])
    left, plot_h = 56, 160
    step = max(min(56, 900 / max(len(labels), 1)), 8)
    width = left + step * len(labels) + 20
    body = [svg.line(left, 10, left, 10 + plot_h, stroke="#9aa3b2")]
    for frac in (0, 0.5, 1.0):
        y = 10 + plot_h * (1 - frac)
        body.append(svg.line(left - 4, y, width - 10, y, stroke="#e6e9ee"))
        body.append(
            svg.text(left - 6, y + 4, f"{top * frac:.3g}", text_anchor="end", class_="muted")
        )
    for i, lab in enumerate(labels):
        x = left + i * step + step * 0.1
        for k, (vals, color, name) in enumerate(
            ((pred, PRED, "predicted"), (meas, MEAS, "measured"))
        ):
            v = vals[i]
            if v is None:
                continue
            h = plot_h * v / top
            body.append(
                svg.rect(
                    x + k * step * 0.4,
                    10 + plot_h - h,
                    step * 0.38,
                    h,
                    color,
                    f"rank {lab} {what} {name}: {v:.4g} {unit}",
                    class_="bar",
                )
            )
        body.append(
            svg.text(x + step * 0.4, 10 + plot_h + 14, lab, text_anchor="middle", font_size="10")
        )
    body.append(svg.text(left, 10 + plot_h + 30, f"{what} ({unit}) per rank", class_="muted"))
    return svg.svg(width, plot_h + 46, body, f"{what} measured vs predicted")


def _one(run: RunReport, plan: dict[str, Any] | None) -> str:
    data = run.data
    pred = (plan or {}).get("predicted") or {}
    p_step, m_step = _num(pred.get("step_ms")), measured_step(data)
    ratio = f"{m_step / p_step:.2f}x" if (p_step and m_step) else "-"
    notes = []
    fp_run = (
        (data.get("model") or {}).get("fingerprint")
        if isinstance(data.get("model"), dict)
        else None
    )
    fp_plan = ((plan or {}).get("model") or {}).get("fingerprint")
    if fp_run and fp_plan and fp_run != fp_plan:
        notes.append(
            "this run's model fingerprint differs from the plan's: it ran another model or plan"
        )
    measured = measured_per_rank(data)
    predicted = {
        int(e["rank"]): e
        for e in pred.get("per_rank") or []
        if isinstance(e, dict) and isinstance(e.get("rank"), int)
    }
    ranks = sorted(set(measured) | set(predicted))[:MAX_RANKS]
    kinds = {m["kind"] for m in measured.values() if m.get("kind")}
    if "cpu_peak_rss" in kinds:
        notes.append(
            "memory measured as CPU process RSS (a CPU run): not comparable with the GPU prediction"
        )
    facts = svg.table(
        ["", "predicted", "measured", "measured / predicted"],
        [["step ms (slowest rank)", p_step, m_step, ratio]],
    )
    head = (
        f'<p class="lead"><b>{svg.esc(run.path.name)}</b>: device {svg.esc(data.get("device", "-"))}, '
        f"world {svg.esc(data.get('world_size', '-'))}, steps {svg.esc((data.get('steps') or {}).get('run', '-') if isinstance(data.get('steps'), dict) else data.get('steps', '-'))}</p>"
    )
    charts = ""
    if ranks:
        labels = [str(r) for r in ranks]

        def p_time(r: int) -> float | None:
            e = predicted.get(r) or {}
            c = _num(e.get("compute_ms"))
            return None if c is None else c + (_num(e.get("exposed_comm_ms")) or 0.0)

        charts = (
            '<div class="two"><div>'
            + _grouped(
                labels,
                [p_time(r) for r in ranks],
                [(measured.get(r) or {}).get("step_ms") for r in ranks],
                "ms",
                "step time",
            )
            + "</div><div>"
            + _grouped(
                labels,
                [_num((predicted.get(r) or {}).get("memory_gb")) for r in ranks],
                [(measured.get(r) or {}).get("memory_gb") for r in ranks],
                "GB",
                "memory",
            )
            + "</div></div>"
        )
    note_html = "".join(f'<p class="lead">note: {svg.esc(n)}</p>' for n in notes)
    return head + facts + note_html + charts


def render(inp: ReportInputs) -> Section:
    title = "Measured vs predicted"
    if not inp.runs:
        where = inp.plan_path.parent if inp.plan_path else inp.dump_dir
        return Section(
            "measured",
            title,
            f'<p class="empty">no run report: no *.run.json in {svg.esc(where)}. '
            "Run the plan (gemc run PLAN, which writes PLAN.run.json next to it) or pass --run.</p>",
        )
    legend = svg.legend([("predicted", PRED), ("measured", MEAS)])
    body = legend + "".join(_one(r, inp.plan) for r in inp.runs)
    return Section("measured", title, body, f"{len(inp.runs)} run report(s)")
