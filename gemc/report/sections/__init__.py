"""One module per report section, each ``render(ReportInputs) -> Section``, in page order."""

from __future__ import annotations

from gemc.report.sections import graph, measured, mlir, precision, ranks, tables, timeline

SECTIONS = [timeline, graph, ranks, tables, precision, measured, mlir]
SECTION_IDS = ["timeline", "graph", "ranks", "tables", "precision", "measured", "mlir"]
