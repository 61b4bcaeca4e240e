"""Which code runs a table's lookup in the runner, decided once for the runner and the cost model.

A table's step costs what the path that runs it costs, and the paths differ by an order of
magnitude (DIN h200: 18 tables outside any batched kernel, priced as if the fused kernel
ran them, 18.6 ms predicted against 39.0 ms measured). Three paths:

``BATCHED``
    inside a ``batched_embedding_bag`` kernel: one fused forward, and a backward that
    applies the embedding optimizer to the touched rows (no gradient tensor exists).
``SPARSE``
    through the runner's sharded table module: ``F.embedding_bag(..., sparse=True)`` (or
    the exchange, which ends in one), a sparse gradient of one row per looked-up id, which
    the sparse optimizer sums by row (sort and segment, one slot per id: no host sync on
    one rank) and applies to the touched rows.
``DENSE_GRAD``
    the captured graph's own lookup op (graph mode on one rank, a table no batched kernel
    took), captured with ``sparse=False``: its backward zero-fills a gradient the size of
    the table and scatters into it; the sparse optimizer then reads that whole gradient
    once, updating the rows whose gradient is not zero in the same pass (no host sync).
    A lookup captured ``sparse=True`` yields a sparse gradient: ``SPARSE``.

Why graph mode keeps ``DENSE_GRAD`` on one rank rather than routing those lookups to the
sharded tables (``SPARSE``): measured on the H200 (DIN h200, 18 such tables of up to 1M
rows), the dense path trained at 39-44 ms a step and the sparse one at 318 ms — on a GPU a
table-sized zero-fill and scan streams at HBM speed, while the sparse gradient's coalesce
(then: sort, unique, a host sync, a padding row's duplicates summed in sequence) and the
graph breaks around each routed lookup do not (BENCHMARKS.md, "The zoo on one H200").

On several ranks (:func:`sharded_route`, the rule for every mode): a table's shards run
``BATCHED`` on their owners — the exchange's received ids (every requester's bags) looked up
by the rank's fused module (:mod:`gemc.backends.torch.owner_lookup`: one
``BatchedEmbeddingBag`` launch per storage precision and bag count, whose backward applies
the optimizer to the touched rows; no gradient of one row per id over the world's batch,
issue 21) — except a data-parallel replica (its gradient is all-reduced, ``SPARSE``), a
table the graph looks up more than once a step (the fused backward would update its rows
once per lookup, the reference once per step), and a table the model holds in a dtype
other than fp32. A column-split table (``column_wise``, ``grid``) under row-wise Adagrad
runs there too: its row accumulator needs the row's squares over every column shard before
any column moves, so the fused backward computes its shard's squares and the optimizer's
step all-reduces them over the column group before it applies the update (two phases,
``BatchedEmbeddingBag.split_rows``; until the seventeenth session it took the sparse route,
whose per-shard eager launches made the balance searches' column splits host-bound).

Why not the plan's batched entries there: they would update whole local tables inside
the graph's backward, before any gradient is exchanged; the owners' lookup runs after the
exchange. Why the route is per sharding: the cost model prices each candidate sharding on
the route it runs (:func:`routed_as_sharded`), so a column split under row-wise Adagrad
pays its sparse gradient where the planner weighs it.

The rule on one rank (backends/torch/graph_mode.py calls this module for it): without
graph kernels (module mode) every table runs ``SPARSE``. With them, a batched entry owns
its tables when its tables share one storage precision; but when any table stored
bf16/fp8 is left outside such an entry, no batched entry is applied and every lookup goes
through the sharded tables (``SPARSE``). Otherwise an owned table is ``BATCHED`` and any other runs as
captured (``DENSE_GRAD``, or ``SPARSE`` when captured sparse) — unless the cost model prices
that table cheaper on ``SPARSE`` (both routes priced per table from what they execute,
``cheaper_route``; the plan records the choice and both prices, the runner follows the
plan): a table of few rows looked up by many ids pays a table-sized scan for little, one
whose padded ids repeat one row pays the sparse coalesce's serial sum of its duplicates.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from gemc.sharding import SHARDINGS

BATCHED = "batched"
SPARSE = "sparse"
DENSE_GRAD = "dense_grad"
LOOKUP_PATHS = (BATCHED, SPARSE, DENSE_GRAD)


def owned_by_batched(entries: Iterable[Collection[str]],
                     precision: Mapping[str, str]) -> set[str]:
    """Tables a batched entry owns: every table of an entry (its tables' fqns) whose tables
    share one storage precision (``precision``: fqn -> "fp32" / "bf16" / "fp8"; missing is
    fp32). A mixed entry is not applied as one kernel."""
    owned: set[str] = set()
    for fqns in entries:
        if len({precision.get(f, "fp32") for f in fqns}) == 1:
            owned.update(fqns)
    return owned


def batched_applied(owned: Collection[str], precision: Mapping[str, str], *,
                    world_size: int) -> bool:
    """Whether the runner applies the plan's batched entries at all (on several ranks the
    owners' fused lookups, :func:`sharded_route`, take their place): one rank, and no table stored
    narrower than fp32 outside them (the graph's own lookup would read stored bf16/fp8
    values as they are, so every lookup then goes through the sharded tables)."""
    if world_size > 1:
        return False
    return not any(p != "fp32" and f not in owned for f, p in precision.items())


def sharded_route(sharding: str, *, world_size: int, optimizer: str,
                  lookups: int = 1, fp32: bool = True) -> str:
    """The route of a table's shards on ``world_size`` > 1 ranks (see the module doc):
    ``BATCHED`` (the owner's fused lookup) unless the table is replicated, looked up
    ``lookups`` > 1 times a step, or held by the model in a dtype other than fp32
    (``fp32`` False: the fused kernel's buffer and update are fp32 rows, or bf16 / fp8
    storage of them), which stay ``SPARSE``. ``optimizer`` (the plan's table optimizer)
    does not change the route today: both optimizers run every sharding in the fused
    kernel (row-wise Adagrad's column shards in two phases); it stays an input of the rule
    because a route is a property of the sharding *and* the update it must make. One
    rank: see :func:`lookup_paths`."""
    kind = SHARDINGS[sharding]
    if world_size <= 1:
        raise ValueError("sharded_route is the several-rank rule; one rank: lookup_paths")
    if kind.replicated or lookups > 1 or not fp32:
        return SPARSE
    return BATCHED


def routed_as_sharded(path: str, sharding: str, *, world_size: int, optimizer: str,
                      lookups: int = 1, fp32: bool = True) -> str:
    """``path`` (a table's route, as :func:`lookup_paths` gave it) for the table sharded
    ``sharding``: on several ranks :func:`sharded_route`, on one ``path`` unchanged. The
    cost model prices each candidate sharding through this, so a table is priced on the
    route its sharding runs."""
    if world_size <= 1:
        return path
    return sharded_route(sharding, world_size=world_size, optimizer=optimizer,
                         lookups=lookups, fp32=fp32)


def lookup_paths(precision: Mapping[str, str], batched_entries: Iterable[Collection[str]], *,
                 world_size: int, graph_mode: bool,
                 captured_sparse: Collection[str] = (),
                 priced_sparse: Collection[str] = (),
                 shardings: Mapping[str, str] | None = None,
                 optimizer: str = "rowwise_adagrad",
                 lookups: Mapping[str, int] | None = None,
                 not_fp32: Collection[str] = ()) -> dict[str, str]:
    """Each table's path (fqn -> one of ``LOOKUP_PATHS``; see the module doc).

    ``precision``: every table of the plan, fqn -> storage precision. ``batched_entries``:
    the fqns of each ``batched_embedding_bag`` entry. ``graph_mode``: the plan has kernels
    the runner executes in the captured graph (and they are not switched off).
    ``captured_sparse``: tables whose every captured lookup has ``sparse=True``.
    ``priced_sparse``: tables the cost model priced cheaper on ``SPARSE`` than on
    ``DENSE_GRAD`` (:func:`cheaper_route`; the plan records the choice, the runner
    follows it); they run ``SPARSE`` where they would otherwise run ``DENSE_GRAD``.
    ``shardings`` (fqn -> sharding; missing: table-wise), ``optimizer`` and ``lookups``
    (fqn -> lookup ops; missing: 1), ``not_fp32`` (tables the model holds in another
    dtype): on several ranks, :func:`sharded_route`'s inputs."""
    if world_size > 1:
        return {f: sharded_route((shardings or {}).get(f, "table_wise"),
                                 world_size=world_size, optimizer=optimizer,
                                 lookups=(lookups or {}).get(f, 1), fp32=f not in not_fp32)
                for f in precision}
    if not graph_mode:
        return dict.fromkeys(precision, SPARSE)
    owned = owned_by_batched(batched_entries, precision)
    if not batched_applied(owned, precision, world_size=world_size):
        return dict.fromkeys(precision, SPARSE)
    sparse = set(captured_sparse) | set(priced_sparse)
    return {f: BATCHED if f in owned else SPARSE if f in sparse else DENSE_GRAD
            for f in precision}


def cheaper_route(prices_ms: Mapping[str, float]) -> str:
    """The route a table outside the batched kernel takes on one rank, given both routes'
    prices (``{SPARSE: ms, DENSE_GRAD: ms}``): the cheaper; a tie keeps ``DENSE_GRAD``
    (the route measured on the most models). Why priced per table: DIN's padded history
    lookups ran 8x slower on ``SPARSE`` (318 against 41 ms a step), GEM's two unowned
    tables 10% faster (56.4 against 62.7 ms): neither route wins everywhere."""
    return SPARSE if prices_ms[SPARSE] < prices_ms[DENSE_GRAD] else DENSE_GRAD


def captured_sparse(node: Any) -> bool:
    """A captured lookup op (an ``fx.Node``) with ``sparse=True`` (its backward makes a
    sparse gradient): ``aten.embedding``'s 5th argument, ``aten.embedding_bag``'s 6th."""
    index = 5 if "embedding_bag" in str(node.target) else 4
    value = node.args[index] if len(node.args) > index else node.kwargs.get("sparse", False)
    return bool(value)
