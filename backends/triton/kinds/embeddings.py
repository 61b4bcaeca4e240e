"""``batched_embedding_bag``: many pooled table lookups as one lookup whose backward updates
the tables in place (the optimizer is fused: no table gradient exists).

Its entry lists each table's lookup facts (``gemc.batched_lookup``, the rule the
group-embeddings pass grouped them by), the batch and the optimizer with its settings. The
interpreter builds one :class:`~gemc.backends.triton.embedding_bag.BatchedEmbeddingBag` per
entry and runs it; the emitter calls ``gemc::embedding_bag`` on the same module.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from gemc.batched_lookup import lookup_facts
from gemc.kernel_kinds import KINDS

from .implementation import KindImplementation


def embedding_entry(facts: dict[str, Any], nodes: list[fx.Node]) -> dict[str, Any]:
    """The batched lookup's entry fields: its tables' facts, batch and optimizer."""
    tables = [t for t in (lookup_facts(n) for n in nodes) if t is not None]
    return dict(batch=facts["batch"], tables=tables,
                optimizer={key: facts[key] for key in ("optimizer", "lr", "eps",
                                                        "weight_decay")})


IMPLEMENTATIONS = (
    KindImplementation(
        KINDS["batched_embedding_bag"], entry=embedding_entry,
        reads=lambda entry: [t[x] for t in entry["tables"] for x in ("ids", "offsets")],
        # the module is the interpreter's: the runner reads its updated weights back
        setup=lambda runner, unit, sources: runner._setup_embeddings(unit, sources),
        run=lambda runner, unit, env: runner._run_embeddings(unit, env),
        emit=lambda emitter, unit: emitter.embeddings(unit)),
)
