"""Precision map: which GEMM runs in which dtype (forward, dgrad, wgrad) and at what error.

Reads ``plan["precision"]`` tolerantly (the format belongs to the precision pass): each
entry has a ``target`` ("*" for the global default, else a module or region), a ``dtype``,
optionally ``sqnr_db``/``gain_ms`` and ``sites`` with per-GEMM ``fwd``/``dgrad``/``wgrad``
dtypes. Each site is a row of three colored cells plus its measured SQNR as a bar, so a
dtype that differs from its neighbours, or an SQNR near the bound, stands out.
"""

from __future__ import annotations

from typing import Any

from gemc.report import svg
from gemc.report.inputs import ReportInputs
from gemc.report.template import Section

PHASES = ("fwd", "dgrad", "wgrad")
MAX_ROWS = 120
SQNR_FULL_DB = 60.0  # bar length scale


def _rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for e in entries:
        if e.get("target") == "*":
            continue
        sites = [s for s in e.get("sites") or [] if isinstance(s, dict)] or [{}]
        for s in sites:
            label = str(e.get("target", "?"))
            if s.get("node"):
                label += f" ({s['node']})"
            rows.append(
                {
                    "label": label,
                    "dtypes": {p: str(s.get(p) or e.get("dtype") or "?") for p in PHASES},
                    "sqnr": s.get("sqnr_db", e.get("sqnr_db")),
                    "gain": e.get("gain_ms"),
                }
            )
    return rows


def render(inp: ReportInputs) -> Section:
    title = "Precision map"
    entries = [e for e in (inp.plan or {}).get("precision") or [] if isinstance(e, dict)]
    if not entries:
        why = (
            "no plan"
            if inp.plan is None
            else "no precision choices in this plan (every op at the model's dtype)"
        )
        return Section("precision", title, f'<p class="empty">{svg.esc(why)}</p>')
    defaults = [e for e in entries if e.get("target") == "*"]
    rows = _rows(entries)
    lead = (
        "; ".join(
            f"default {e.get('dtype', '?')} (mode {e.get('mode', '-')}, by {e.get('source', '-')})"
            for e in defaults
        )
        or "no global default"
    )
    lead += f"; {len(rows)} sites with their own choice"
    blocks = _blocks_table(defaults)
    if not rows:
        return Section(
            "precision",
            title,
            '<p class="empty">only a global default: no per-site choices</p>' + blocks,
            lead,
        )
    shown = rows[:MAX_ROWS]
    label_w, cell_w, cell_h, bar_w = 300, 52, 16, 220
    body = [
        svg.text(label_w + i * cell_w + cell_w / 2, 12, p, text_anchor="middle")
        for i, p in enumerate(PHASES)
    ]
    x_bar = label_w + len(PHASES) * cell_w + 14
    body.append(svg.text(x_bar, 12, f"SQNR dB (bar full at {SQNR_FULL_DB:.0f})"))
    for i, r in enumerate(shown):
        y = 18 + i * cell_h
        body.append(svg.text(4, y + 12, r["label"][:44], font_size="10.5"))
        for j, p in enumerate(PHASES):
            dt = r["dtypes"][p]
            color = svg.DTYPE_COLORS.get(dt, "#8c939d")
            body.append(
                svg.rect(
                    label_w + j * cell_w,
                    y,
                    cell_w - 2,
                    cell_h - 2,
                    color,
                    f"{r['label']} {p}: {dt}",
                    class_="cell",
                )
            )
            body.append(
                svg.text(
                    label_w + j * cell_w + cell_w / 2 - 1,
                    y + 11,
                    dt,
                    text_anchor="middle",
                    font_size="9.5",
                    fill="#ffffff",
                )
            )
        sqnr = r["sqnr"]
        if isinstance(sqnr, (int, float)):
            body.append(
                svg.rect(
                    x_bar,
                    y + 2,
                    bar_w * min(float(sqnr) / SQNR_FULL_DB, 1.0),
                    cell_h - 6,
                    "#687082",
                    f"{r['label']}: SQNR {float(sqnr):.1f} dB",
                )
            )
            body.append(svg.text(x_bar + bar_w + 6, y + 12, f"{float(sqnr):.1f}", class_="muted"))
    picture = svg.svg(x_bar + bar_w + 50, 22 + len(shown) * cell_h, body, "precision map")
    used = sorted({d for r in rows for d in r["dtypes"].values()})
    legend = svg.legend([(d, svg.DTYPE_COLORS.get(d, "#8c939d")) for d in used])
    more = (
        f'<p class="lead">... {len(rows) - len(shown)} more sites</p>'
        if len(rows) > len(shown)
        else ""
    )
    return Section("precision", title, legend + picture + more + blocks, lead)


def _blocks_table(defaults: list[dict[str, Any]]) -> str:
    """The default entry's per-block verdicts (region, checked, why), when it has them."""
    rows = [
        [b.get("region"), b.get("checked"), b.get("block_sqnr_db", b.get("sqnr_db")), b.get("why")]
        for e in defaults
        for b in e.get("blocks") or []
        if isinstance(b, dict)
    ]
    return svg.table(["block", "checked", "SQNR dB", "why"], rows) if rows else ""
