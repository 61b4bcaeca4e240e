"""``packed_tokens``: a layout, not a call: the values of a region ``pack-jagged-tokens``
found are kept as ``[1, T, ...]`` over the real tokens instead of ``[B, L, ...]``.

One entry per region; its nodes overlap the fused groups and the jagged attention that
run inside it. The interpreter sets all regions up before the units (the emitter reads
the same state); the packed execution itself is the interpreter's and the emitter's, as it
touches every node of the region.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from gemc import ir
from gemc.kernel_kinds import KINDS

from .implementation import KindImplementation


def packed_entries(gm: fx.GraphModule) -> list[dict[str, Any]]:
    """One ``packed_tokens`` entry per region the graph's annotations mark."""
    out = []
    for node in gm.graph.nodes:
        f = node.meta.get(ir.PACKED_REGION)
        if f is None:
            continue
        members = [n for n in gm.graph.nodes if (n.meta.get(ir.PACKED) or {}).get("id") == f["id"]]
        facts = {k: v for k, v in f.items() if k not in ("id", "before_ms", "after_ms")}
        out.append({"name": f["id"], "replaces": [], "region": node.meta.get(ir.REGION, ""),
                    "library": KINDS["packed_tokens"].library,
                    "nodes": [n.name for n in members],
                    "dims": {n.name: n.meta[ir.PACKED]["dims"] for n in members},
                    "zeroed": [n.name for n in members if n.meta[ir.PACKED]["zeroed"]],
                    "predicted": {"before_ms": f["before_ms"], "after_ms": f["after_ms"]},
                    **facts})
    return out


IMPLEMENTATIONS = (
    KindImplementation(
        KINDS["packed_tokens"], layout_entries=packed_entries,
        # called with no entries too: the runner always asks where values are packed
        layout_setup=lambda runner, entries: runner._setup_packed(entries)),
)
