"""Per-rank memory and time: stacked bars from the plan's ``predicted.per_rank``.

The slowest rank sets the step and the fullest rank sets whether the plan fits, so the
two pictures show every rank side by side against the GPU's capacity and the predicted
step. Above ``MAX_BARS`` ranks, consecutive ranks are bucketed (max of each bucket), so a
4096-rank plan stays readable.
"""

from __future__ import annotations

from typing import Any

from gemc.report import svg
from gemc.report.inputs import ReportInputs
from gemc.report.template import Section

MAX_BARS = 128
MEMORY_PARTS = ["params", "grads", "optimizer", "activations", "workspace"]
TIME_PARTS = [
    ("dense_compute_ms", "dense compute"),
    ("sparse_compute_ms", "sparse compute"),
    ("optimizer_ms", "optimizer"),
    ("exposed_comm_ms", "exposed comm"),
]


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def memory_parts(entry: dict[str, Any]) -> list[tuple[str, float]]:
    """GB by component; whatever the total does not explain is 'other'."""
    mem = entry.get("memory") if isinstance(entry.get("memory"), dict) else {}
    total = _num(entry.get("memory_gb")) or _num(mem.get("total")) or 0.0
    parts = [(k, _num(mem.get(k)) or 0.0) for k in MEMORY_PARTS]
    rest = total - sum(v for _, v in parts)
    if rest > 1e-9 or not any(v for _, v in parts):
        parts.append(("other", max(rest, 0.0)))
    return parts


def time_parts(entry: dict[str, Any]) -> list[tuple[str, float]]:
    parts = [(label, _num(entry.get(k)) or 0.0) for k, label in TIME_PARTS]
    if not any(v for _, v in parts):  # an older or other cost model: one bar of compute
        parts = [
            ("compute", _num(entry.get("compute_ms")) or 0.0),
            ("exposed comm", _num(entry.get("exposed_comm_ms")) or 0.0),
        ]
    return parts


def _bucket(
    entries: list[dict[str, Any]], parts_of: Any
) -> list[tuple[str, list[tuple[str, float]]]]:
    """Label and parts per bar; buckets of ranks (the fullest of each) above MAX_BARS."""
    if len(entries) <= MAX_BARS:
        return [(str(e.get("rank", i)), parts_of(e)) for i, e in enumerate(entries)]
    size = -(-len(entries) // MAX_BARS)
    out = []
    for start in range(0, len(entries), size):
        chunk = entries[start : start + size]
        worst = max(chunk, key=lambda e: sum(v for _, v in parts_of(e)))
        out.append(
            (
                f"{chunk[0].get('rank', start)}-{chunk[-1].get('rank', start + len(chunk) - 1)}",
                parts_of(worst),
            )
        )
    return out


def bar_chart(
    bars: list[tuple[str, list[tuple[str, float]]]],
    unit: str,
    label: str,
    limit: tuple[float, str] | None = None,
) -> str:
    """Vertical stacked bars with a y axis; ``limit`` draws a labeled horizontal line."""
    names = list(dict.fromkeys(k for _, parts in bars for k, _ in parts))
    colors = {k: svg.SERIES[i % len(svg.SERIES)] for i, k in enumerate(names)}
    top = max(sum(v for _, v in parts) for _, parts in bars) * 1.1 or 1.0
    if limit and limit[0] <= 2 * top:  # a limit far above the data would flatten the bars
        top = max(top, limit[0] * 1.05)
    elif limit:
        label += f"; {limit[1]} is off scale"
        limit = None
    left, plot_h, bottom = 56, 200, 36
    step = max(min(48, 1000 / max(len(bars), 1)), 4)
    width = left + step * len(bars) + 20
    body = [svg.line(left, 10, left, 10 + plot_h, stroke="#9aa3b2")]
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        y = 10 + plot_h * (1 - frac)
        body.append(svg.line(left - 4, y, width - 10, y, stroke="#e6e9ee"))
        body.append(
            svg.text(left - 6, y + 4, f"{top * frac:.3g}", text_anchor="end", class_="muted")
        )
    for i, (name, parts) in enumerate(bars):
        x = left + i * step + step * 0.15
        y = 10 + plot_h
        for key, value in parts:
            h = plot_h * value / top
            y -= h
            body.append(
                svg.rect(
                    x,
                    y,
                    step * 0.7,
                    h,
                    colors[key],
                    f"rank {name}: {key} {value:.4g} {unit}",
                    class_="bar",
                )
            )
        if len(bars) <= 64 or i % max(len(bars) // 32, 1) == 0:
            body.append(
                svg.text(
                    x + step * 0.35, 10 + plot_h + 14, name, text_anchor="middle", font_size="10"
                )
            )
    caption = f"{label} ({unit}) per rank"
    if limit:
        y = 10 + plot_h * (1 - limit[0] / top)
        body.append(svg.line(left, y, width - 10, y, stroke="#d64545", stroke_dasharray="5,3"))
        caption += f"; dashed red line: {limit[1]}"
    body.append(svg.text(left, 10 + plot_h + 30, caption, class_="muted"))
    return svg.legend([(k, colors[k]) for k in names]) + svg.svg(
        width, 10 + plot_h + bottom, body, label
    )


def _capacity_gb(plan: dict[str, Any]) -> float | None:
    topo = plan.get("topology") or {}
    for key in ("memory_gb", "hbm_gb", "gpu_memory_gb"):
        if _num(topo.get(key)):
            return _num(topo.get(key))
    try:
        from gemc.cost_model.hardware import get_gpu

        spec = get_gpu(str(topo.get("gpu")))
    except Exception:  # unknown GPU or no cost model: no capacity line
        return None
    hbm = _num(getattr(spec, "hbm_bytes", None))
    return hbm / 1e9 if hbm else None


def render(inp: ReportInputs) -> Section:
    title = "Per-rank memory and time"
    pred = (inp.plan or {}).get("predicted") or {}
    per_rank = [e for e in pred.get("per_rank") or [] if isinstance(e, dict)]
    if not per_rank:
        why = (
            "no plan"
            if inp.plan is None
            else "the plan holds no per-rank prediction (no cost model ran)"
        )
        return Section("ranks", title, f'<p class="empty">{svg.esc(why)}</p>')
    cap = _capacity_gb(inp.plan or {})
    step = _num(pred.get("step_ms"))
    memory = bar_chart(
        _bucket(per_rank, memory_parts),
        "GB",
        "predicted memory",
        (cap, f"{cap:.0f} GB capacity") if cap else None,
    )
    times = bar_chart(
        _bucket(per_rank, time_parts),
        "ms",
        "predicted time",
        (step, f"step {step:.3g} ms") if step else None,
    )
    rows = [
        [
            e.get("rank"),
            _num(e.get("memory_gb")),
            _num(e.get("compute_ms")),
            _num(e.get("comm_ms")),
            _num(e.get("exposed_comm_ms")),
            e.get("tables"),
        ]
        for e in per_rank[:MAX_BARS]
    ]
    table = svg.table(
        ["rank", "memory GB", "compute ms", "comm ms", "exposed comm ms", "tables"], rows
    )
    lead = (
        f"{len(per_rank)} ranks; predicted step {step:.4g} ms, MFU "
        f"{100 * (_num(pred.get('mfu')) or 0):.3g}%, max memory "
        f"{max((_num(e.get('memory_gb')) or 0) for e in per_rank):.4g} GB"
        + (f" of {cap:.0f} GB" if cap else "")
        + f"; cost model {pred.get('cost_model') or '-'}"
        if step is not None
        else f"{len(per_rank)} ranks"
    )
    return Section(
        "ranks", title, f'<div class="two"><div>{memory}</div><div>{times}</div></div>{table}', lead
    )
