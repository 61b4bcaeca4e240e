"""Read a pass dump (``NNN_<pass>.txt``) back into nodes and edges for the graph picture.

The report reads the dump directory only, never gemc's live objects: a dump from another
machine or an older compile renders the same. The text format (gemc/dump.py) is one line
per node::

    %name = aten.op.overload(%a, %b, 3) :: f32[4,16]  {kind=gemm region=tower group=7}
    %p_w = input :: f32[16,8]  {kind=param region=tower}
    return [%loss] :: none

Annotation values may nest (``placement={sharding:row_wise,ranks:[0, 1]}``), so they are
split on spaces outside brackets only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_REF = re.compile(r"%([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class DumpNode:
    name: str
    op: str  # "input" for placeholders, the target otherwise
    type: str
    args: list[str]
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.notes.get("kind", "other")

    @property
    def region(self) -> str:
        return self.notes.get("region", "")

    @property
    def group(self) -> str | None:
        value = self.notes.get("group")
        return value if value not in (None, "", "None") else None

    @property
    def is_compute(self) -> bool:
        return self.op != "input"


@dataclass
class DumpGraph:
    header: str
    nodes: list[DumpNode]

    def compute_nodes(self) -> list[DumpNode]:
        return [n for n in self.nodes if n.is_compute]


def split_notes(text: str) -> dict[str, str]:
    """``kind=gemm placement={a:1,b:[0, 1]}`` -> {"kind": "gemm", "placement": "{...}"}."""
    out: dict[str, str] = {}
    depth, start = 0, 0
    parts = []
    for i, ch in enumerate(text):
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == " " and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    for part in parts:
        if "=" in part:
            key, value = part.split("=", 1)
            out[key] = value
    return out


def parse_line(line: str) -> DumpNode | None:
    line = line.rstrip("\n")
    if not line.startswith("%"):
        return None  # the header, the return line, blank lines
    notes: dict[str, str] = {}
    body = line
    if line.endswith("}") and "  {" in line:
        body, raw = line.rsplit("  {", 1)
        notes = split_notes(raw[:-1])
    head, _, typ = body.partition(" :: ")
    name, _, rhs = head.partition(" = ")
    name = name.lstrip("%")
    if rhs == "input":
        return DumpNode(name, "input", typ, [], notes)
    op, _, args = rhs.partition("(")
    return DumpNode(name, op, typ, _REF.findall(args), notes)


def read_dump(path: Path) -> DumpGraph:
    lines = Path(path).read_text().splitlines()
    header = lines[0].lstrip("# ") if lines and lines[0].startswith("#") else ""
    nodes = [n for n in (parse_line(ln) for ln in lines) if n is not None]
    return DumpGraph(header, nodes)


def depths(nodes: list[DumpNode]) -> dict[str, int]:
    """Longest path from any input over ``nodes`` (in topological order, as dumps are):
    the x axis of the graph picture. Arguments outside ``nodes`` (inputs) count as depth -1."""
    depth: dict[str, int] = {}
    for node in nodes:
        depth[node.name] = 1 + max((depth[a] for a in node.args if a in depth), default=-1)
    return depth
