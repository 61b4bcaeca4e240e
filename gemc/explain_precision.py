"""The precision section of ``gemc explain``: one row per GEMM site, fp8 first.

A reader should see at a glance what runs in what precision, what it costs in accuracy
(SQNR of each GEMM against fp32, as the probe measured it), what it buys (the cost model's
gain over bf16), and for every site left in bf16 the reason fp8 was not taken.
"""

from __future__ import annotations

from typing import Any

from gemc.table_format import render_table

MAX_ROWS = 40
_GEMMS = ("fwd", "dgrad", "wgrad")
_RANK = {"fp8": 0, "fp32": 1, "bf16": 2}


def _sites(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for e in plan.get("precision", []) for s in e.get("sites", [])]


def _db(g: dict[str, Any]) -> str:
    return "-" if g.get("sqnr_db") is None else f"{g['sqnr_db']:.1f}"


def _row(site: dict[str, Any]) -> list[Any]:
    gemms = site["gemms"]
    shape = site["shape"]
    mnk = f"{shape['m']}x{shape['n']}x{shape['k']}" + (
        f" (x{shape['batch']})" if shape.get("batch", 1) > 1 else "")
    chosen = [gemms[g]["pred_ms"][gemms[g]["dtype"]] for g in _GEMMS if gemms[g]["pred_ms"]]
    gains = [gemms[g]["gain_ms"] or 0.0 for g in _GEMMS]
    why = next((gemms[g]["rejected"].get("fp8") for g in _GEMMS
                if gemms[g]["dtype"] != "fp8" and gemms[g]["rejected"].get("fp8")), "")
    return [
        site["node"], site["module"] or "(root)", mnk,
        *(site[g] for g in _GEMMS),
        "/".join(_db(gemms[g]) for g in _GEMMS),
        round(sum(chosen), 4) if chosen else None,
        round(sum(gains), 4),
        why[:60],
    ]


def _key(site: dict[str, Any]) -> tuple[int, float]:
    dtypes = {site["gemms"][g]["dtype"] for g in _GEMMS}
    rank = min(_RANK[d] for d in dtypes)
    bf16 = sum((site["gemms"][g]["pred_ms"] or {}).get("bf16", 0.0) for g in _GEMMS)
    return rank, -bf16


def precision_section(plan: dict[str, Any]) -> list[str]:
    """Lines for explain: the rule and probe, the per-site table, the blocks checked."""
    entries = plan.get("precision") or []
    star = next((e for e in entries if e.get("target") == "*" and "rule" in e), None)
    if star is None:
        return [f"precision  {len(entries)} entries (not chosen by choose-precision)"]
    rule, probe = star["rule"], star.get("probe") or {}
    sites = _sites(plan)
    counts = {d: sum(1 for s in sites for g in _GEMMS if s["gemms"][g]["dtype"] == d)
              for d in ("fp8", "bf16", "fp32")}
    gain = sum(s["gemms"][g]["gain_ms"] or 0.0 for s in sites for g in _GEMMS)
    probe_text = (f"skipped: {probe['skipped']}" if "skipped" in probe else
                  f"batch {probe.get('probe_batch')} of {probe.get('batch')}, "
                  f"{probe.get('steps')} steps, {probe.get('sites')} sites measured, "
                  f"{probe.get('folded_tables', 0)} tables folded")
    out = [
        f"precision  baseline {star['dtype']} (mode {star['mode']}); bounds "
        f"{rule['min_sqnr_db']:g} dB per GEMM, {rule['min_block_sqnr_db']:g} dB per block; "
        f"fp8 must save {100 * rule['min_gain']:.0f}% incl. quantization",
        f"           probe: {probe_text}",
        f"           GEMMs (3 per site): fp8 {counts['fp8']}, bf16 {counts['bf16']}, "
        f"fp32 {counts['fp32']}; predicted gain vs bf16 {gain:.3f} ms/step",
    ]
    shown = sorted(sites, key=_key)[:MAX_ROWS]
    if shown:
        out += ["", render_table(
            ["site", "module", "MxNxK", "fwd", "dgrad", "wgrad", "SQNR dB", "pred ms",
             "gain ms", "why not fp8"],
            [_row(s) for s in shown],
            title=f"precision by GEMM site ({len(sites)}, fp8 first, then by bf16 time)",
        )]
        if len(sites) > len(shown):
            out.append(f"... {len(sites) - len(shown)} more sites")
    checked = [b for b in star.get("blocks", []) if b.get("checked")]
    if checked:
        out.append("blocks     " + ", ".join(
            f"{b['region']} {b['sqnr_db']:.1f} dB" + (f" ({'; '.join(b['changes'])})"
                                                     if b.get("changes") else "")
            for b in checked))
    return out
