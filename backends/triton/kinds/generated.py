"""The generated groups (``fuse``'s kinds): one implementation serves every generated kind.

A group's plan entry is its spec (``structure``; ``binding``: the nodes it reads and
writes, shapes, dtypes), the sha256 of its generated source and the source text (``code``;
the plan builder keeps it on the first entry with that hash only); ``file`` is where
``--dump-dir`` puts it. The interpreter launches the source (checked against the hash, or
regenerated from the structure); the emitter calls it through ``gemc::fused_group`` where
the group's choice is gemc's, and writes its ATen nodes for Inductor otherwise.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from gemc import fusion_spec
from gemc.kernel_kinds import KINDS, generated_kinds

from ..codegen import generated, source_file_name
from .implementation import KindImplementation


def group_entry(facts: dict[str, Any], nodes: list[fx.Node]) -> dict[str, Any]:
    """A generated group's entry fields: its spec and its source."""
    inside = set(nodes)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    structure, binding = fusion_spec.build(facts["kind"], nodes, outputs)
    source, digest = generated(structure)
    return dict(structure=structure, binding=binding, sha256=digest,
                file=source_file_name(digest), code=source)


def _implementation(name: str) -> KindImplementation:
    # the interpreter's group launcher and its packed variant are GraphRunner's: they share
    # its packed-region state with the other units
    return KindImplementation(
        KINDS[name], entry=group_entry,
        reads=lambda entry: list(entry["binding"]["inputs"]),
        setup=lambda runner, unit, sources: runner._setup_group(unit, sources),
        run=lambda runner, unit, env: runner._run_group(unit, env),
        emit=lambda emitter, unit: emitter.group(unit))


IMPLEMENTATIONS = tuple(_implementation(name) for name in generated_kinds())
