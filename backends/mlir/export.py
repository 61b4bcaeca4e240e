"""Write the graph and its fusion groups as MLIR into a dump directory.

Layout (under ``DUMP/mlir/``):

- ``graph.raw.mlir``: the whole graph as imported (torch dialect before any torch-mlir
  pass; an op the dialect does not know is a ``torch.operator "..."``). Always complete.
- ``graph.torch.mlir`` / ``graph.linalg.mlir``: the graph at torch-mlir's backend contract
  and in linalg-on-tensors. When some ops cannot be lowered, these hold the graph *minus*
  those ops: their results become function arguments and their operands function
  results, and the header says which nodes were cut. That keeps the rest inspectable
  instead of losing the whole graph to one op.
- ``group_<id>.torch.mlir`` / ``group_<id>.linalg.mlir``: each fusion group
  (``gemc.group`` on nodes) as a standalone function, inputs = values flowing in.
- ``unsupported.txt``: every op that does not reach linalg, with the stage and MLIR's
  reason, plus any graph or group that did not lower. Never a crash.
- ``index.json``: what was written, each function's arguments and results by source node
  name, and the stage each reached (what ``gemc report`` and tests read).

Every ``.mlir`` file opens with ``// gemc:`` comment lines and parses back with
``ir.Module.parse``.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from gemc.backends.mlir.extract import Extracted, extract_subgraph
from gemc.backends.mlir.lower import LINALG, RAW, TORCH, Lowered, available, lower_graph
from gemc.backends.mlir.probe import Unsupported, describe, find_unsupported
from torch import fx

from gemc import ir
from gemc.atomic_write import write_atomic, write_json_atomic

MLIR_DIR = "mlir"
_STAGE_TITLES = {
    RAW: "torch dialect as imported from FX, before torch-mlir passes",
    TORCH: "torch dialect at torch-mlir's backend contract",
    LINALG: "linalg-on-tensors",
}


@dataclass
class FunctionExport:
    """One exported function: where its files are and how far it lowered."""

    name: str
    args: list[str]
    results: list[str]
    files: dict[str, str] = field(default_factory=dict)  # stage -> file name
    reached: str | None = None
    error: str | None = None
    cut: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "args": self.args,
            "results": self.results,
            "files": self.files,
            "reached": self.reached,
            "error": self.error,
            "cut": self.cut,
        }


def torch_mlir_version() -> str:
    try:
        return metadata.version("torch-mlir")
    except metadata.PackageNotFoundError:
        return "unknown"


def group_ids(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Fusion groups by id (as a string), nodes in graph order, groups in first-seen order."""
    groups: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if ir.GROUP in node.meta and node.meta[ir.GROUP] is not None:
            groups.setdefault(str(node.meta[ir.GROUP]), []).append(node)
    return groups


def file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _header(title: str, stage: str, args: list[str], results: list[str], cut: list[str]) -> str:
    lines = [
        f"// gemc: {title}",
        f"// gemc: stage {stage}: {_STAGE_TITLES[stage]} (torch-mlir {torch_mlir_version()})",
        f"// gemc: args (in order): {', '.join(args) or '-'}",
        f"// gemc: results (in order): {', '.join(results) or '-'}",
    ]
    if cut:
        lines.append(
            f"// gemc: cut (ops that do not lower; their results are args, their operands "
            f"results): {', '.join(cut)}"
        )
    return "\n".join(lines) + "\n"


def write_function(
    out_dir: Path,
    stem: str,
    title: str,
    lowered: Lowered,
    args: list[str],
    results: list[str],
    cut: Iterable[str] = (),
    stages: Iterable[str] = (TORCH, LINALG),
) -> FunctionExport:
    """Write each reached stage of ``lowered`` as ``<stem>.<stage>.mlir``."""
    cut = list(cut)
    fn = FunctionExport(name=stem, args=args, results=results, cut=cut)
    for stage in stages:
        text = lowered.texts.get(stage)
        if text is None:
            continue
        fname = f"{stem}.{stage}.mlir"
        write_atomic(out_dir / fname, _header(title, stage, args, results, cut) + text)
        fn.files[stage] = fname
    fn.reached = lowered.reached
    if lowered.error is not None:
        fn.error = f"{lowered.error.stage}: {describe(lowered.error)}"
    return fn


def export_subgraph(
    gm: fx.GraphModule, nodes: Iterable[fx.Node], out_dir: Path, stem: str, title: str
) -> tuple[FunctionExport, Extracted]:
    """Extract ``nodes`` into a function and write its torch and linalg modules."""
    sub = extract_subgraph(gm, nodes)
    lowered = lower_graph(sub.gm, func_name="main")
    fn = write_function(
        out_dir,
        stem,
        title,
        lowered,
        [n.name for n in sub.inputs],
        [n.name for n in sub.outputs],
    )
    return fn, sub


def export_graph(
    gm: fx.GraphModule, out_dir: Path, unsupported: list[Unsupported]
) -> FunctionExport:
    """The whole graph as imported, and its lowerable part at the torch and linalg stages."""
    args = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    results = [n.name for n in out_node.all_input_nodes]
    title = "the captured graph"
    whole = lower_graph(gm, until=RAW if unsupported else LINALG)
    fn = write_function(out_dir, "graph", title, whole, args, results, stages=(RAW, TORCH, LINALG))
    if not unsupported:
        return fn
    cut = {name for u in unsupported for name in u.nodes}
    keep = [n for n in gm.graph.nodes if n.op == "call_function" and n.name not in cut]
    sub = extract_subgraph(gm, keep)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    part = write_function(
        out_dir,
        "graph",
        f"{title}, minus the ops that do not lower (see unsupported.txt)",
        lower_graph(sub.gm),
        [n.name for n in sub.inputs],
        [n.name for n in sub.outputs],
        cut=sorted(cut, key=order.__getitem__),
    )
    part.files = {**fn.files, **part.files}
    return part


def export_groups(
    gm: fx.GraphModule, out_dir: Path, progress: Callable[[str], None] | None = None
) -> list[FunctionExport]:
    """Each fusion group as ``group_<id>.{torch,linalg}.mlir``."""
    exports = []
    for gid, nodes in group_ids(gm).items():
        if progress:
            progress(f"mlir group {gid}")
        stem = f"group_{file_stem(gid)}"
        try:
            fn, _ = export_subgraph(gm, nodes, out_dir, stem, f"fusion group {gid}")
        except ValueError as exc:  # a set that cannot stand alone (e.g. reads a whole tuple)
            fn = FunctionExport(name=stem, args=[], results=[], error=f"extract: {exc}")
        exports.append(fn)
    return exports


def unsupported_text(unsupported: list[Unsupported], functions: list[FunctionExport]) -> str:
    lines = [
        "# gemc: ops torch-mlir cannot lower to linalg-on-tensors, each probed alone",
        "# op<TAB>stage it does not reach<TAB>nodes<TAB>MLIR's reason",
    ]
    lines += [u.line() for u in unsupported] or ["# (none: every op lowers)"]
    failed = [f for f in functions if f.error]
    if failed:
        lines.append("# functions that did not reach linalg: name<TAB>stage: reason")
        lines += [f"{f.name}\t{f.error}" for f in failed]
    return "\n".join(lines) + "\n"


def export_to_dump(
    gm: fx.GraphModule, dump_dir: Path, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Write ``dump_dir/mlir/``; return the index. Raises only on gemc bugs: an op that does
    not lower is reported in ``unsupported.txt``; see ``dump_mlir`` for the guarded entry."""
    out_dir = Path(dump_dir) / MLIR_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    if progress:
        progress("mlir: probe ops")
    unsupported = find_unsupported(gm)
    if progress:
        progress("mlir: graph")
    graph = export_graph(gm, out_dir, unsupported)
    groups = export_groups(gm, out_dir, progress)
    write_atomic(out_dir / "unsupported.txt", unsupported_text(unsupported, [graph, *groups]))
    index = {
        "torch_mlir": torch_mlir_version(),
        "graph": graph.to_json(),
        "groups": [g.to_json() for g in groups],
        "unsupported": [
            {"op": u.op, "stage": u.stage, "reason": u.reason, "nodes": list(u.nodes)}
            for u in unsupported
        ],
    }
    write_json_atomic(out_dir / "index.json", index)
    return index


def dump_mlir(
    gm: fx.GraphModule, dump_dir: Path, progress: Callable[[str], None] | None = None
) -> str:
    """The compile's entry: write the MLIR dump and never fail the compile over it.

    torch-mlir is optional (GPU machines lack it): without it a note says so. A failure
    inside the export is a gemc bug; its traceback goes to ``mlir/error.txt`` and the
    compile goes on, because the plan does not depend on the MLIR.
    Returns a one-line status for the progress display.
    """
    out_dir = Path(dump_dir) / MLIR_DIR
    if not available():
        write_atomic(
            out_dir / "unavailable.txt",
            "torch-mlir is not installed in this environment, so no MLIR was written.\n"
            "Install it (pip install torch-mlir, a nightly wheel matching torch) and compile "
            "again with --dump-dir to get mlir/graph.*.mlir and mlir/group_*.mlir.\n",
        )
        return "mlir: torch-mlir not installed (see mlir/unavailable.txt)"
    try:
        index = export_to_dump(gm, dump_dir, progress)
    except Exception:
        write_atomic(out_dir / "error.txt", traceback.format_exc())
        return "mlir: export failed (a gemc bug; traceback in mlir/error.txt)"
    return (
        f"mlir: graph reached {index['graph']['reached']}, {len(index['groups'])} groups, "
        f"{len(index['unsupported'])} unsupported ops"
    )
