"""Table placement: a tables x ranks heatmap of where every embedding table's shards live.

Each cell is the share of the table's elements a rank holds, in the color of the table's
sharding (a replicated, data-parallel table is full on every rank). Read across a row for
how one table is split, down a column for what one rank carries; the bar under each column
is the rank's embedding bytes. Largest tables first; above ``MAX_TABLES`` rows or
``MAX_COLS`` ranks the picture keeps the largest tables and sums ranks per host.
"""

from __future__ import annotations

from typing import Any

from gemc.report import svg
from gemc.report.inputs import ReportInputs
from gemc.report.template import Section
from gemc.sharding import SHARDINGS
from gemc.table_format import human_count

MAX_TABLES = 64
MAX_COLS = 64


def _columns(plan: dict[str, Any]) -> tuple[list[str], int]:
    """Column labels and how many ranks each column sums (1, or a host's GPUs)."""
    world = int(plan["mesh"]["world_size"])
    if world <= MAX_COLS:
        return [str(r) for r in range(world)], 1
    per = int((plan.get("topology") or {}).get("gpus_per_host") or 8)
    while -(-world // per) > MAX_COLS:
        per *= 2
    return [f"{r}-{min(r + per, world) - 1}" for r in range(0, world, per)], per


def shares(table: dict[str, Any], ncols: int, per: int) -> list[float]:
    """Fraction of the table's elements in each column (data parallel: 1 on every rank)."""
    total = max(int(table["rows"]) * int(table["dim"]), 1)
    out = [0.0] * ncols
    for shard in table.get("shards") or []:
        col = int(shard["rank"]) // per
        if 0 <= col < ncols:
            out[col] += int(shard["rows"]) * int(shard["cols"]) / total
    if table.get("sharding") in SHARDINGS and SHARDINGS[table["sharding"]].replicated \
            and per > 1:
        out = [min(v / per, 1.0) for v in out]
    return out


def render(inp: ReportInputs) -> Section:
    title = "Table placement"
    plan = inp.plan
    if plan is None or not plan.get("tables"):
        why = "no plan" if plan is None else "the model has no embedding tables"
        return Section("tables", title, f'<p class="empty">{svg.esc(why)}</p>')
    tables = sorted(plan["tables"], key=lambda t: (-int(t["rows"]) * int(t["dim"]), t["fqn"]))
    shown = tables[:MAX_TABLES]
    cols, per = _columns(plan)
    cell_w = max(min(36, 900 / len(cols)), 10)
    cell_h, label_w, top = 16, 300, 26
    body = []
    for j, c in enumerate(cols):
        body.append(
            svg.text(
                label_w + j * cell_w + cell_w / 2, top - 8, c, text_anchor="middle", font_size="10"
            )
        )
    held = [0.0] * len(cols)  # fp32 bytes of table rows per column: one unit for every table
    for t in tables:
        for shard in t.get("shards") or []:
            col = int(shard["rank"]) // per
            if 0 <= col < len(cols):
                held[col] += 4.0 * int(shard["rows"]) * int(shard["cols"])
    for i, t in enumerate(shown):
        y = top + i * cell_h
        color = svg.SHARDING_COLORS.get(t.get("sharding"), "#8c939d")
        body.append(svg.text(4, y + 12, f"{t['fqn'][:30]}", font_size="10.5"))
        body.append(
            svg.text(
                label_w - 6,
                y + 12,
                f"{human_count(int(t['rows']))}x{t['dim']} {t.get('sharding')}",
                text_anchor="end",
                class_="muted",
                font_size="10",
            )
        )
        for j, s in enumerate(shares(t, len(cols), per)):
            fill = svg.color_mix(color, 0.15 + 0.85 * s) if s > 0 else "#ffffff"
            body.append(
                svg.rect(
                    label_w + j * cell_w,
                    y,
                    cell_w - 1,
                    cell_h - 1,
                    fill,
                    f"{t['fqn']} on {'rank' if per == 1 else 'ranks'} {cols[j]}: "
                    f"{100 * s:.1f}% of {t['rows']}x{t['dim']} ({t.get('sharding')})",
                    stroke="#e3e6eb",
                    stroke_width="0.5",
                    class_="cell",
                )
            )
    y = top + len(shown) * cell_h + 6
    most = max(held) or 1.0
    for j, b in enumerate(held):
        h = 40 * b / most
        body.append(
            svg.rect(
                label_w + j * cell_w,
                y + 40 - h,
                cell_w - 1,
                h,
                "#687082",
                f"ranks {cols[j]}: {b / 1e6:.3g} MB of embedding rows (fp32)",
            )
        )
    body.append(
        svg.text(label_w - 6, y + 30, "embedding MB held", text_anchor="end", class_="muted")
    )
    width = label_w + len(cols) * cell_w + 10
    picture = svg.svg(width, y + 48, body, "table placement heatmap")
    used = sorted({t.get("sharding") for t in tables})
    legend = svg.legend([(s, svg.SHARDING_COLORS.get(s, "#8c939d")) for s in used])
    more = (
        f'<p class="lead">... {len(tables) - len(shown)} smaller tables not drawn</p>'
        if len(tables) > len(shown)
        else ""
    )
    lead = (
        f"{len(tables)} tables on {plan['mesh']['world_size']} ranks"
        + (f" (columns are groups of {per} ranks)" if per > 1 else "")
        + "; cell shade = share of the table's elements held"
    )
    return Section("tables", title, legend + f'<div class="scroll">{picture}</div>' + more, lead)
