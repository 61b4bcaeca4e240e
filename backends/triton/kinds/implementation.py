"""One object per kernel kind: what the plan builder, the interpreter and the emitter do with it.

A kind's declaration (``gemc.kernel_kinds.KernelKind``, core) holds the facts every layer
reads: its name, the fields its entry must have, its kernel's library, whether Inductor
compiles its nodes (the cost model's fact). A :class:`KindImplementation` adds what differs
per layer, in one place instead of one table per layer:

* ``entry``: the plan entry's own fields, from the pass's facts (``gemc.kernel`` meta) and
  the group's nodes (the plan builder calls it; the fields are what ``run`` and ``emit``
  read, so the entry format is defined next to its readers);
* ``reads``: the graph values the entry names beyond its nodes' own inputs (the
  interpreter keeps them alive until the unit ran);
* ``setup`` (optional): what the interpreter builds once per unit (a launcher, an
  embedding module); the emitter reuses it;
* ``run``: the interpreter's call computing the unit's outputs
  (:class:`~gemc.backends.triton.graph_runner.GraphRunner`);
* ``emit``: the same computation written into the graph ``torch.compile`` compiles
  (``inductor_graph``'s emitter).

A layout kind (``packed_tokens``: values kept in another layout, not a call replacing its
nodes) has ``layout_entries`` (its plan entries, from the graph's annotations) and
``layout_setup`` (the interpreter's setup of all its entries at once) instead.

Why here, in the Triton backend: the runtime and the emitter are backend code, which the
compiler's core may not import; the plan builder (the driver) may. The declaration stays
in the core because the plan validator and the cost model read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import fx

from gemc.kernel_kinds import KernelKind

if TYPE_CHECKING:
    from ..graph_runner import GraphRunner
    from ..inductor_graph import Emitter

Entry = dict[str, Any]
Unit = dict[str, Any]
Env = dict[fx.Node, Any]
EntryBuilder = Callable[[dict[str, Any], list[fx.Node]], Entry]


@dataclass(frozen=True)
class KindImplementation:
    """A graph-mode kernel kind's implementation (see the module doc for each field)."""

    kind: KernelKind
    entry: EntryBuilder | None = None
    reads: Callable[[Entry], list[str]] | None = None
    run: Callable[[GraphRunner, Unit, Env], None] | None = None
    emit: Callable[[Emitter, Unit], None] | None = None
    setup: Callable[[GraphRunner, Unit, dict[str, str]], None] | None = None
    layout_entries: Callable[[fx.GraphModule], list[Entry]] | None = None
    layout_setup: Callable[[GraphRunner, list[Entry]], None] | None = None

    def __post_init__(self) -> None:
        name = self.kind.name
        if self.kind.mode != "graph":
            raise ValueError(f"kernel kind {name}: a module-mode kind is implemented by an "
                             "applier (gemc.backends.torch.kernels.register), not here")
        unit = {"entry": self.entry, "reads": self.reads, "run": self.run, "emit": self.emit}
        layout = {"layout_entries": self.layout_entries, "layout_setup": self.layout_setup}
        needed, refused = (layout, {**unit, "setup": self.setup}) if self.kind.layout \
            else (unit, layout)
        missing = [k for k, v in needed.items() if v is None]
        extra = [k for k, v in refused.items() if v is not None]
        what = "a layout" if self.kind.layout else "a unit kind"
        if missing:
            raise ValueError(f"kernel kind {name}: {what} needs {', '.join(missing)}")
        if extra:
            raise ValueError(f"kernel kind {name}: {what} has no {', '.join(extra)}")


def named(*fields: str) -> Callable[[Entry], list[str]]:
    """The reads of an entry that names its operands in ``fields`` (absent or null: none)."""
    return lambda entry: [entry[x] for x in fields if entry.get(x)]
