"""Pass timeline: one bar per pass, length by seconds, from ``manifest.json``.

Where compile time goes is the first question about a slow compile; the bars make the
expensive pass obvious, and the colors say which passes changed the graph and which failed.
"""

from __future__ import annotations

from gemc.report import svg
from gemc.report.inputs import ReportInputs
from gemc.report.template import Section

CHANGED, UNCHANGED, FAILED = "#3b6fd8", "#b7c4e0", "#d64545"


def render(inp: ReportInputs) -> Section:
    passes = [p for p in inp.manifest.get("passes") or [] if isinstance(p, dict)]
    status = inp.manifest.get("status", "?")
    if not passes:
        return Section(
            "timeline", "Pass timeline", '<p class="empty">no passes in manifest.json</p>'
        )
    total = sum(float(p.get("seconds") or 0.0) for p in passes)
    longest = max(float(p.get("seconds") or 0.0) for p in passes) or 1.0
    label_w, bar_w, row_h = 230, 760, 20
    body = []
    for i, p in enumerate(passes):
        secs = float(p.get("seconds") or 0.0)
        ok = str(p.get("verifier", "ok")) == "ok"
        color = FAILED if not ok else (CHANGED if p.get("changed") else UNCHANGED)
        y = i * row_h
        name = f"{int(p.get('index', i)):03d} {p.get('name', '?')}"
        tip = (
            f"{name}: {secs:.4f} s, changed={p.get('changed')}, nodes={p.get('nodes')}, "
            f"kernels={p.get('kernels')}, verifier={p.get('verifier')}"
        )
        body.append(svg.text(0, y + 14, name))
        body.append(
            svg.rect(label_w, y + 3, max(bar_w * secs / longest, 1.5), row_h - 6, color, tip)
        )
        body.append(
            svg.text(
                label_w + max(bar_w * secs / longest, 1.5) + 6,
                y + 14,
                f"{secs:.3f} s",
                class_="muted",
            )
        )
    height = len(passes) * row_h + 4
    picture = svg.svg(label_w + bar_w + 80, height, body, "pass timeline")
    legend = svg.legend(
        [("changed the graph", CHANGED), ("no change", UNCHANGED), ("failed", FAILED)]
    )
    rows = [
        [
            p.get("index"),
            p.get("name"),
            p.get("seconds"),
            p.get("changed"),
            p.get("nodes"),
            p.get("kernels"),
            p.get("verifier"),
        ]
        for p in passes
    ]
    table = svg.table(["#", "pass", "seconds", "changed", "nodes", "kernels", "verifier"], rows)
    lead = (
        f"{len(passes)} passes, {total:.2f} s in all (capture included); status {status}; "
        f"dump mode {inp.manifest.get('dump_mode', '?')}"
    )
    return Section("timeline", "Pass timeline", legend + picture + table, lead)
