"""Small helpers to write inline SVG and HTML by hand: no plotting library, no JavaScript.

Every picture is a static ``<svg>`` with ``<title>`` children, which browsers show as
tooltips, so details stay one hover away without any script.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

# One color per op kind (gemc.ir.OpKind values); used by the graph and its legend.
KIND_COLORS = {
    "gemm": "#3b6fd8",
    "attention": "#8a4fd0",
    "embedding": "#2e9e5b",
    "norm": "#e08a2c",
    "pointwise": "#e8c547",
    "reduction": "#a0673a",
    "view": "#c9ccd1",
    "index": "#d64545",
    "loss": "#222222",
    "comm": "#e05fa8",
    "other": "#8c939d",
    "input": "#eeeeee",
    "param": "#eeeeee",
    "output": "#eeeeee",
}
SHARDING_COLORS = {
    "data_parallel": "#8c939d",
    "table_wise": "#3b6fd8",
    "row_wise": "#2e9e5b",
    "column_wise": "#e08a2c",
    "table_row_wise": "#8a4fd0",
    "grid": "#d64545",
}
DTYPE_COLORS = {
    "fp32": "#3b6fd8",
    "float32": "#3b6fd8",
    "tf32": "#5aa0e0",
    "bf16": "#2e9e5b",
    "bfloat16": "#2e9e5b",
    "fp16": "#8bc34a",
    "float16": "#8bc34a",
    "fp8": "#e08a2c",
    "float8_e4m3fn": "#e08a2c",
    "float8_e5m2": "#d64545",
}
SERIES = ["#3b6fd8", "#2e9e5b", "#e08a2c", "#8a4fd0", "#d64545", "#e8c547", "#8c939d"]


def esc(value: Any) -> str:
    return escape(str(value), quote=True)


def attrs(**kw: Any) -> str:
    return " ".join(
        f'{k.rstrip("_").replace("_", "-")}="{esc(v)}"' for k, v in kw.items() if v is not None
    )


def rect(
    x: float, y: float, w: float, h: float, fill: str, title: str | None = None, **kw: Any
) -> str:
    a = attrs(
        x=f"{x:.1f}",
        y=f"{y:.1f}",
        width=f"{max(w, 0):.1f}",
        height=f"{max(h, 0):.1f}",
        fill=fill,
        **kw,
    )
    if title:
        return f"<rect {a}><title>{esc(title)}</title></rect>"
    return f"<rect {a}/>"


def text(x: float, y: float, s: Any, **kw: Any) -> str:
    return f"<text {attrs(x=f'{x:.1f}', y=f'{y:.1f}', **kw)}>{esc(s)}</text>"


def line(x1: float, y1: float, x2: float, y2: float, **kw: Any) -> str:
    return f"<line {attrs(x1=f'{x1:.1f}', y1=f'{y1:.1f}', x2=f'{x2:.1f}', y2=f'{y2:.1f}', **kw)}/>"


def svg(width: float, height: float, body: Iterable[str], label: str, fit: bool = False) -> str:
    """An SVG element; ``fit`` scales it to the page width (wide graphs) keeping its ratio."""
    size = (
        f'viewBox="0 0 {width:.0f} {height:.0f}" width="100%" preserveAspectRatio="xMinYMin meet"'
        if fit
        else f'viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" height="{height:.0f}"'
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" {size} role="img" aria-label="{esc(label)}" '
        f'class="pic">' + "".join(body) + "</svg>"
    )


def legend(items: Sequence[tuple[str, str]]) -> str:
    chips = "".join(
        f'<span class="chip"><span class="sw" style="background:{esc(c)}"></span>{esc(k)}</span>'
        for k, c in items
    )
    return f'<div class="legend">{chips}</div>'


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    """An HTML table; cells are escaped unless they are ``Raw``."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f"<td>{c if isinstance(c, Raw) else esc(fmt(c))}</td>" for c in row)
        + "</tr>"
        for row in rows
    )
    return f'<table class="{esc(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


class Raw(str):
    """HTML that is already safe (a chip, a link) inside ``table`` cells."""


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def chip(label: str, color: str) -> Raw:
    return Raw(
        f'<span class="chip"><span class="sw" style="background:{esc(color)}"></span>{esc(label)}</span>'
    )


def color_mix(color: str, fraction: float) -> str:
    """``color`` faded toward white: fraction 1 is the color, 0 is white (heatmaps)."""
    fraction = min(max(fraction, 0.0), 1.0)
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    mix = [round(255 - (255 - c) * fraction) for c in (r, g, b)]
    return "#" + "".join(f"{c:02x}" for c in mix)
