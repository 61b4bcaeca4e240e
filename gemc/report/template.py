"""The page: one template and one stylesheet, both inline, so the report is one file that
opens anywhere (mailed, attached to a ticket, opened from a CI artifact) with no server
and nothing fetched from the network."""

from __future__ import annotations

from dataclasses import dataclass

from gemc.report.svg import esc

CSS = """
:root { --fg:#1d2330; --muted:#687082; --line:#dde1e8; --bg:#ffffff; --panel:#f6f7f9; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 "DejaVu Sans", system-ui, sans-serif; color: var(--fg);
       background: var(--bg); }
header { padding: 18px 28px 10px; border-bottom: 1px solid var(--line); background: var(--panel); }
header h1 { margin: 0 0 6px; font-size: 20px; }
header .facts { display: flex; flex-wrap: wrap; gap: 6px 22px; color: var(--muted); }
header .facts b { color: var(--fg); font-weight: 600; }
nav { padding: 8px 28px; border-bottom: 1px solid var(--line); font-size: 13px; }
nav a { margin-right: 16px; color: #3b6fd8; text-decoration: none; }
main { padding: 4px 28px 40px; }
section { margin: 22px 0 30px; }
section h2 { font-size: 17px; margin: 0 0 4px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
p.lead { margin: 4px 0 10px; color: var(--muted); }
p.empty { padding: 14px; background: var(--panel); border: 1px dashed var(--line);
          color: var(--muted); }
.notes { margin: 12px 0 0; padding: 8px 12px; background: #fff8e5; border: 1px solid #f0dca0; }
.scroll { overflow-x: auto; }
svg.pic { display: block; margin: 6px 0; }
svg.pic text { font-family: "DejaVu Sans", sans-serif; font-size: 11px; fill: var(--fg); }
svg.pic text.muted { fill: var(--muted); }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; margin: 6px 0; font-size: 12px; }
.chip { display: inline-flex; align-items: center; gap: 5px; white-space: nowrap; }
.sw { display: inline-block; width: 11px; height: 11px; border-radius: 2px;
      border: 1px solid rgba(0,0,0,.15); }
table { border-collapse: collapse; margin: 8px 0; font-size: 12.5px; }
th, td { border: 1px solid var(--line); padding: 3px 8px; text-align: right; }
th { background: var(--panel); font-weight: 600; }
td:first-child, th:first-child { text-align: left; }
.two { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 8px 28px; }
footer { padding: 10px 28px; color: var(--muted); border-top: 1px solid var(--line); font-size: 12px; }
"""


@dataclass
class Section:
    """One section of the report: ``id`` is its anchor and what tests look for."""

    id: str
    title: str
    body: str
    lead: str = ""

    def html(self) -> str:
        lead = f'<p class="lead">{esc(self.lead)}</p>' if self.lead else ""
        return (
            f'<section id="{esc(self.id)}" data-section="{esc(self.id)}">'
            f"<h2>{esc(self.title)}</h2>{lead}{self.body}</section>"
        )


def page(
    title: str, facts: list[tuple[str, str]], sections: list[Section], notes: list[str], footer: str
) -> str:
    fact_html = "".join(f"<span>{esc(k)} <b>{esc(v)}</b></span>" for k, v in facts)
    nav = "".join(f'<a href="#{esc(s.id)}">{esc(s.title)}</a>' for s in sections)
    note_html = (
        '<div class="notes">' + "<br>".join(esc(n) for n in notes) + "</div>" if notes else ""
    )
    body = "".join(s.html() for s in sections)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        f'<header><h1>{esc(title)}</h1><div class="facts">{fact_html}</div>{note_html}</header>'
        f"<nav>{nav}</nav><main>{body}</main><footer>{esc(footer)}</footer></body></html>\n"
    )
