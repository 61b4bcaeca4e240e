"""The graph with its fusion groups, drawn from the last pass dump.

Layout: one horizontal lane per region (the unit that gets a parallel strategy), x = the
op's depth (longest path from the inputs), so data flows left to right and a region's ops
sit together. Ops are colored by kind; each fusion group is outlined. Up to ``MAX_OPS``
compute ops every op is drawn; above that (GEM-scale graphs) each region collapses to one
bar showing its mix of kinds, and regions that differ only by an index (``bags.0``,
``bags.1``, ...) share a lane, so a 1000-table model still fits on a page.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from gemc.report import svg
from gemc.report.dumpgraph import DumpGraph, DumpNode, depths
from gemc.report.inputs import ReportInputs
from gemc.report.template import Section

MAX_OPS = 700
MAX_LANES = 40
LABEL_W = 170
MAX_GROUP_ROWS = 60


def _drawn(graph: DumpGraph) -> list[DumpNode]:
    """The ops to draw: ``getitem`` only unpacks a multi-result op, so it is folded into
    its producer (edges from it start at the producer instead)."""
    source = {n.name: n.args[0] for n in graph.nodes if n.op == "getitem" and n.args}
    drawn = []
    for n in graph.compute_nodes():
        if n.name in source:
            continue
        args = [source.get(a, a) for a in n.args]
        drawn.append(DumpNode(n.name, n.op, n.type, args, n.notes))
    return drawn


def _lane_name(region: str) -> str:
    return region or "(root)"


def render(inp: ReportInputs) -> Section:
    title = "Graph and fusion groups"
    graph = inp.graph
    if graph is None:
        return Section("graph", title, '<p class="empty">no pass dump to draw the graph from</p>')
    compute = _drawn(graph)
    depth = depths(compute)
    groups: dict[str, list[DumpNode]] = defaultdict(list)
    for n in compute:
        if n.group is not None:
            groups[n.group].append(n)
    kinds = Counter(n.kind for n in compute)
    if len(compute) <= MAX_OPS and len({n.region for n in compute}) <= 2 * MAX_LANES:
        picture = _ops_picture(compute, depth, groups)
        mode = "every op drawn"
    else:
        picture = _regions_picture(compute, depth, groups)
        mode = "too many ops or regions to draw each: regions collapsed to bars of their op kinds"
    legend = svg.legend(
        [(k, svg.KIND_COLORS.get(k, svg.KIND_COLORS["other"])) for k, _ in kinds.most_common()]
        + [("fusion group (outline)", "#ffffff")]
    )
    lead = (
        f"{len(compute)} ops in {len({n.region for n in compute})} regions, {len(groups)} fusion "
        f"groups, from {inp.graph_file} ({mode}); hover an op for its details"
    )
    body = legend + f'<div class="scroll">{picture}</div>' + _groups_table(groups, inp)
    return Section("graph", title, body, lead)


def _ops_picture(
    compute: list[DumpNode], depth: dict[str, int], groups: dict[str, list[DumpNode]]
) -> str:
    col_w, node_w, row_h, node_h, lane_gap = 12, 9, 11, 8, 8
    lanes: dict[str, dict[int, int]] = {}
    slot: dict[str, int] = {}
    for n in compute:
        used = lanes.setdefault(_lane_name(n.region), {})
        slot[n.name] = used.get(depth[n.name], 0)
        used[depth[n.name]] = slot[n.name] + 1
    lane_y: dict[str, float] = {}
    y = 4.0
    for name, used in lanes.items():
        lane_y[name] = y
        y += max(used.values()) * row_h + lane_gap
    width = LABEL_W + (max(depth.values(), default=0) + 1) * col_w + 10
    pos = {
        n.name: (
            LABEL_W + depth[n.name] * col_w,
            lane_y[_lane_name(n.region)] + slot[n.name] * row_h,
        )
        for n in compute
    }
    body = []
    for i, (name, used) in enumerate(lanes.items()):
        h = max(used.values()) * row_h + lane_gap
        if i % 2 == 0:
            body.append(svg.rect(0, lane_y[name] - lane_gap / 2, width, h, "#f4f6f9"))
        body.append(svg.text(4, lane_y[name] + 8, name[:26], class_="muted"))
    for n in compute:
        x, yy = pos[n.name]
        for a in n.args:
            if a in pos:
                ax, ay = pos[a]
                body.append(
                    svg.line(
                        ax + node_w,
                        ay + node_h / 2,
                        x,
                        yy + node_h / 2,
                        stroke="#8d96a6",
                        stroke_width="0.6",
                        stroke_opacity="0.55",
                    )
                )
    for gid, members in groups.items():
        tip = f"fusion group {gid}: {len(members)} ops ({', '.join(m.name for m in members[:8])})"
        by_lane: dict[str, list[DumpNode]] = {}
        for m in members:
            by_lane.setdefault(_lane_name(m.region), []).append(m)
        boxes = []
        for lane_members in by_lane.values():  # one outline per lane: no box over other lanes
            xs = [pos[m.name][0] for m in lane_members]
            ys = [pos[m.name][1] for m in lane_members]
            boxes.append(
                (
                    min(xs) - 2.5,
                    min(ys) - 2.5,
                    max(xs) - min(xs) + node_w + 5,
                    max(ys) - min(ys) + node_h + 5,
                )
            )
        for (x0, y0, w0, h0), (x1, y1, w1, _) in zip(boxes, boxes[1:]):
            body.append(
                svg.line(
                    x0 + w0 / 2,
                    y0 + h0,
                    x1 + w1 / 2,
                    y1,
                    stroke="#1d2330",
                    stroke_width="0.8",
                    stroke_dasharray="2,2",
                )
            )
        for x0, y0, w0, h0 in boxes:
            body.append(
                svg.rect(
                    x0,
                    y0,
                    w0,
                    h0,
                    "rgba(0,0,0,0.04)",
                    tip,
                    stroke="#1d2330",
                    stroke_width="1.1",
                    stroke_dasharray="3,2",
                    rx="2",
                    class_="group",
                )
            )
    for n in compute:
        x, yy = pos[n.name]
        tip = f"{n.name} = {n.op} :: {n.type}  kind={n.kind} region={n.region or '(root)'}" + (
            f" group={n.group}" if n.group else ""
        )
        body.append(
            svg.rect(
                x,
                yy,
                node_w,
                node_h,
                svg.KIND_COLORS.get(n.kind, svg.KIND_COLORS["other"]),
                tip,
                class_="op",
                data_kind=n.kind,
            )
        )
    return svg.svg(width, y + 4, body, "graph of ops by region", fit=width > 1340)


def _family(region: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", region)


def _regions_picture(
    compute: list[DumpNode], depth: dict[str, int], groups: dict[str, list[DumpNode]]
) -> str:
    lane_of = {n.name: _lane_name(n.region) for n in compute}
    if len(set(lane_of.values())) > MAX_LANES:
        lane_of = {k: _family(v) for k, v in lane_of.items()}
    counts = Counter(lane_of.values())
    if len(counts) > MAX_LANES:
        keep = {name for name, _ in counts.most_common(MAX_LANES - 1)}
        lane_of = {k: v if v in keep else "(other regions)" for k, v in lane_of.items()}
    members: dict[str, list[DumpNode]] = {}
    for n in compute:
        members.setdefault(lane_of[n.name], []).append(n)
    group_lanes = Counter(lane_of[m[0].name] for m in groups.values())
    plot_w, row_h, bar_h = 1120, 24, 14
    max_depth = max(depth.values(), default=0) or 1

    def x_of(d: int) -> float:
        return LABEL_W + plot_w * d / max_depth

    lane_y = {name: 6 + i * row_h for i, name in enumerate(members)}
    body = []
    seen_pairs: set[tuple[str, str]] = set()
    for n in compute:
        for a in n.args:
            if a in lane_of and lane_of[a] != lane_of[n.name]:
                pair = (lane_of[a], lane_of[n.name])
                if pair in seen_pairs:
                    continue
                seen_pairs.add(pair)
                body.append(
                    svg.line(
                        x_of(depth[a]),
                        lane_y[pair[0]] + bar_h / 2,
                        x_of(depth[n.name]),
                        lane_y[pair[1]] + bar_h / 2,
                        stroke="#8d96a6",
                        stroke_width="0.7",
                        stroke_opacity="0.6",
                    )
                )
    for name, nodes in members.items():
        y = lane_y[name]
        d0 = min(depth[n.name] for n in nodes)
        d1 = max(depth[n.name] for n in nodes)
        x0, w = x_of(d0), max(x_of(d1) - x_of(d0), 8.0)
        kinds = Counter(n.kind for n in nodes)
        body.append(svg.text(4, y + 11, name[:26], class_="muted"))
        cx = x0
        for kind, c in kinds.most_common():
            seg = w * c / len(nodes)
            body.append(
                svg.rect(
                    cx,
                    y,
                    seg,
                    bar_h,
                    svg.KIND_COLORS.get(kind, svg.KIND_COLORS["other"]),
                    f"{name}: {c} {kind} ops",
                    class_="op",
                    data_kind=kind,
                )
            )
            cx += seg
        ng = group_lanes.get(name, 0)
        body.append(
            svg.rect(
                x0,
                y,
                w,
                bar_h,
                "none",
                f"{name}: {len(nodes)} ops, {ng} fusion groups",
                stroke="#1d2330" if ng else "#9aa3b2",
                stroke_width="1.1" if ng else "0.6",
                stroke_dasharray="3,2" if ng else None,
                class_="group" if ng else "region",
            )
        )
        body.append(
            svg.text(
                x0 + w + 5,
                y + 11,
                f"{len(nodes)} ops" + (f", {ng} groups" if ng else ""),
                class_="muted",
            )
        )
    return svg.svg(
        LABEL_W + plot_w + 110, 12 + len(members) * row_h, body, "graph of regions", fit=True
    )


def _groups_table(groups: dict[str, list[DumpNode]], inp: ReportInputs) -> str:
    if not groups:
        return (
            '<p class="empty">no fusion groups in this graph (no pass set gemc.group): '
            "ops are drawn unoutlined</p>"
        )
    mlir = {g.get("name"): g for g in (inp.mlir or {}).get("groups", []) if isinstance(g, dict)}
    rows = []
    for gid, nodes in list(groups.items())[:MAX_GROUP_ROWS]:
        kinds = Counter(n.kind for n in nodes)
        stage = mlir.get(f"group_{re.sub(r'[^A-Za-z0-9_.-]', '_', gid)}", {}).get("reached")
        rows.append(
            [
                gid,
                len(nodes),
                ", ".join(sorted({n.region or "(root)" for n in nodes})),
                " ".join(f"{k}:{c}" for k, c in kinds.most_common()),
                " ".join(
                    n.op.split(".")[1] if n.op.startswith("aten.") else n.op for n in nodes[:6]
                )
                + (" ..." if len(nodes) > 6 else ""),
                stage or "-",
            ]
        )
    more = (
        f'<p class="lead">... and {len(groups) - MAX_GROUP_ROWS} more groups</p>'
        if len(groups) > MAX_GROUP_ROWS
        else ""
    )
    return (
        svg.table(["group", "ops", "regions", "kinds", "ops (first 6)", "MLIR reached"], rows)
        + more
    )
