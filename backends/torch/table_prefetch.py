"""Look up, before the forward, every sharded table the model calls with its own inputs.

Why: a routed table looked up when the model calls it exchanges on its own (a sizes
exchange with a host sync, ids, pooled rows, and their gradients in the backward). With
hundreds of tables those latency-bound collectives add up per step. Most recommendation
models hand each table a slice of the batch as it came (GEM's bags take ``inputs[1 + 2t]``
and ``inputs[2 + 2t]``), so the runner can look all of those up in one exchange
(:func:`.embedding_exchange.exchange_lookups`) before calling the model, as TorchRec's
input distribution does, and each table's forward then hands out its share.

Which tables: the first step runs every table on its own and records, per routed table,
where its arguments sit in the batch (the very tensor objects the runner passed in). After
that step the ranks agree (a min and a max all-reduce, once) on the tables whose arguments
were batch entries at the same positions on every rank and that were called exactly once.
The others keep exchanging when called; a warning names them and why, and the run report
lists them. From then on a prefetched table called with other tensors than those batch
entries is an error: its lookup already took part in collectives that every rank ran in
the same order, so it cannot quietly run another.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from gemc.backends.torch.embedding import ShardedEmbedding
from gemc.backends.torch.embedding_exchange import exchange_lookups

from gemc.errors import GemcUserError

ABSENT = -2  # the argument was None
NOT_IN_BATCH = -1  # a tensor that is not one of the batch's entries


def _position(batch: Sequence[Any], value: Any) -> int:
    if value is None:
        return ABSENT
    return next((k for k, entry in enumerate(batch) if entry is value), NOT_IN_BATCH)


@dataclass
class Recording:
    """Where one table's arguments sat in the batch at the first step, and its calls."""

    batch: Sequence[Any]
    positions: tuple[int, int, int] = (NOT_IN_BATCH, NOT_IN_BATCH, NOT_IN_BATCH)
    calls: int = 0

    def note(self, input: Any, offsets: Any, per_sample_weights: Any) -> None:  # noqa: A002
        self.calls += 1
        self.positions = (_position(self.batch, input), _position(self.batch, offsets),
                          _position(self.batch, per_sample_weights))


@dataclass
class Prefetched:
    """A table's output for this step, looked up from these batch entries."""

    args: tuple[Any, Any, Any]
    out: torch.Tensor

    def take(self, fqn: str, input: Any, offsets: Any,  # noqa: A002
             per_sample_weights: Any) -> torch.Tensor:
        if any(a is not b for a, b in zip(self.args, (input, offsets, per_sample_weights))):
            raise GemcUserError(
                f"table '{fqn}' was called with other tensors than the batch entries it "
                "took at the first step; its lookup for this step already ran with every "
                "other prefetched table",
                where=f"model forward, call of {fqn.removesuffix('.weight')}",
                fix="pass the table the batch's own tensors at every step, or compute its "
                "ids inside the model at every step (then it is looked up when called)",
            )
        return self.out


@dataclass
class TablePrefetch:
    """The runner's per-step hook: ``begin_step(batch)`` before the forward, ``end_step()``
    after the backward."""

    tables: dict[str, ShardedEmbedding]
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None
    agreed: list[tuple[ShardedEmbedding, tuple[int, int, int]]] | None = None
    on_call: dict[str, str] = field(default_factory=dict)  # fqn -> why it is not prefetched

    routed: list[ShardedEmbedding] = field(init=False)  # the tables that exchange

    def __post_init__(self) -> None:
        self.routed = [m for m in self.tables.values() if not m.local_only]

    def begin_step(self, batch: Sequence[Any]) -> None:
        if self.agreed is None:
            for m in self.routed:
                m.recording = Recording(batch)
            return
        if not self.agreed:
            return
        tables = [m for m, _ in self.agreed]
        bags, shapes, args = [], [], []
        for m, positions in self.agreed:
            call = tuple(None if p == ABSENT else batch[p] for p in positions)
            ids, offsets, weights, shape = m.as_bags(*call)
            bags.append(m.routed_bags(ids, offsets, weights))
            shapes.append(shape)
            args.append(call)
        outs = exchange_lookups(tables, bags, world=self.world_size, group=self.group)
        for m, call, out, shape in zip(tables, args, outs, shapes):
            m.prefetched = Prefetched(call, out.view(shape))

    def end_step(self) -> None:
        for m in self.routed:
            m.prefetched = None  # a table the model skipped this step
        if self.agreed is not None:
            return
        routed = self.routed
        rows = []
        for m in routed:  # begin_step gave each a recording
            rows.append([*m.recording.positions, m.recording.calls])
            m.recording = None
        self.agreed = []
        if not routed:
            return
        sig = torch.tensor(rows, dtype=torch.int64, device=self.device)
        low, high = sig.clone(), sig.clone()
        dist.all_reduce(low, dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(high, dist.ReduceOp.MAX, group=self.group)
        for m, lo, hi in zip(routed, low.tolist(), high.tolist()):
            why = why_not_prefetched(lo, hi)
            if why is None:
                self.agreed.append((m, (lo[0], lo[1], lo[2])))
            else:
                self.on_call[m.fqn] = why
        if self.on_call and dist.get_rank(self.group) == 0:
            names = sorted(self.on_call)
            shown = ", ".join(f"'{n}' ({self.on_call[n]})" for n in names[:5])
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            warnings.warn(
                f"{len(names)} sharded table(s) are looked up when the model calls them, "
                f"each with its own exchange, not in the step's one batched exchange: "
                f"{shown}{more}. Pass a table the batch's own tensors (the runner's "
                "batch entries, unchanged) to have it batched.",
                stacklevel=2,
            )

    def report(self) -> dict[str, Any]:
        return {"batched": sorted(m.fqn for m, _ in self.agreed or []),
                "on_call": dict(sorted(self.on_call.items()))}


def why_not_prefetched(low: list[int], high: list[int]) -> str | None:
    """Why a table recorded (positions, calls) from min/max over ranks is not batched."""
    if low != high:
        return "ranks called it differently"
    if low[3] != 1:
        return f"called {low[3]} times in a step"
    names = ("ids", "offsets", "per-sample weights")
    computed = [n for n, p in zip(names, low[:3]) if p == NOT_IN_BATCH]
    if computed:
        return f"its {' and '.join(computed)} are computed in the model"
    if low[0] == ABSENT:
        return "called without ids"
    return None
