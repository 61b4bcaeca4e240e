"""The rewritten graph as an ordinary ``GraphModule`` whose kernel nodes call gemc's custom
ops, for ``torch.compile`` (Inductor) to compile around them.

:class:`~.graph_runner.GraphRunner` interprets the captured graph node by node in Python,
so every op gemc does not specialise runs unfused and pays a launch each. Here the same
units (the runner's schedule, launchers and embedding modules are reused, so both paths
execute one plan identically) are *emitted* into a new FX graph instead:

* a generated group whose per-group choice is ``gemc`` -> one ``gemc::fused_group`` call
  (its operands cast to the autocast dtype first, as the interpreter's launcher does) and a
  ``getitem`` per output; a group whose choice is ``inductor`` -> its own ATen nodes,
  which Inductor fuses with their neighbours;
* ``jagged_attention`` -> ``gemc::jagged_attention`` on the padded q, k, v (then the
  transpose back to the graph's ``[B, H, L, D]``, a view), or on the packed values inside
  a packed region;
* ``jagged_query_attention`` -> ``gemc::jagged_query_attention`` on the padded q and the
  dense k, v, its query lengths from offsets (ATen ops) or ``gemc::query_prefix_lengths``
  of the mask (the per-row guard, on the device: no host read, so no graph break);
  ``key_padding_attention`` and ``jagged_silu_attention`` -> one eager island each
  (:meth:`Emitter.eager`: their check reads the host), or, for a key-padding attention
  under the mask of a guarded region this graph runs packed, the packed attention, or,
  for a key-padding cross-attention decided by the check ahead of the graph
  (``build(attention_guards=...)``), ``gemc::key_lengths_attention`` on the lengths it
  found (or the padded attention), in the graph (these are their kind's ``emit``, in
  ``kinds/attention.py``);
* ``batched_embedding_bag`` -> its flat ids and offsets (``gemc::bag_inputs``) and one
  ``gemc::embedding_bag``, each table's output a column view of its output; a ``cat`` or
  ``stack`` of adjacent columns reads them as one view (:func:`merge_columns`; the tables
  laid out in the order the graph joins them, :func:`in_join_order`), not one copy kernel
  per table forward and backward;
* ``transposed_linear`` -> its ATen formulation (a batched GEMM reading ``x`` in place);
* every other node -> its op (``device=`` arguments captured on meta point at the run's
  device; ``_assert_tensor_metadata`` nodes are dropped);
* a row lookup a region this graph runs packed lists (its ``lookups``) -> its ids
  gathered to the region's tokens (``gemc::gather_tokens``), then the lookup (its op or
  its ``call``) of those only (``GraphRunner._lookup_tokens``);
* a node with a ``call`` (a table lookup answered by its sharded table) -> that callable:
  on one rank it calls ``gemc::table_lookup`` (marked ``in_graph``: traced like any op, its
  sparse gradient left to the sparse optimizer by the op's backward); on several ranks it
  is behind ``torch._dynamo.disable``: the exchange stays gemc's eager code and Dynamo
  splits the graph around it.

A ``packed_tokens`` region runs on packed values as the interpreter runs it: its source
builds the ``[1, T, ...]`` values, operands entering it are gathered to its tokens
(``gemc::gather_tokens``), values read outside it are scattered back, sums over positions
add each row's tokens (``gemc::segment_sum``), its groups launch at ``T`` tokens and its
attention reads the values in place (``gemc::jagged_attention_values``; HSTU's SiLU
attention ``gemc::jagged_silu_attention_values``), and a gather at the region's jagged
positions (its ``exits``) reads the tokens (``_p_exit``). ``T`` is the
bounded count (``TokenLayout.bounded``): the jagged values' count plus the clamp's slots,
known from the capture's shapes, so the compiled graph has static shapes and no host read.
A region guarded by a run-time mask check is packed in the graph built for a check that
passed (``build(guards=...)``: its offsets and bucketed token count come from the check,
made ahead of the graph by :mod:`.region_guard`), and padded in the graph built for one that
did not. A guarded region with padding representatives (``pad_rep``) takes the offsets of
its layout with representatives; its weights follow from them
(``packed_tokens.with_rep_weights``), and its weighted reductions are ``_p_weighted``.
"""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from gemc import ir
from gemc.guard_sample import guard_inputs, read_positions, why_not_ahead_all
from gemc.kernel_kinds import KINDS

from . import kinds as registry
from . import ops as gemc_ops
from . import packed_tokens
from .codegen.host import make_runner
from .graph_runner import _SKIP, GraphRunner, _rank, on_run_device
from .packed_tokens import TokenLayout

__all__ = ["CHOICE_ENV", "Built", "Column", "Emitter", "build", "choice_and_source",
           "default_choice", "in_join_order", "measure_groups", "merge_columns", "runner_for"]

CHOICE_ENV = "GEMC_GROUP_CHOICE"
"""``gemc`` / ``inductor`` forces every generated group's choice (A/B runs); unset or
``auto``: the measured choice where there is one, else Inductor."""


def default_choice(entry: dict[str, Any], measured: Mapping[str, Any] | None = None) -> str:
    """``gemc`` or ``inductor`` for one plan entry. Every kind but the generated groups is
    gemc's: Inductor has nothing equivalent (attention over values + offsets, one lookup
    for many tables with the optimizer fused, packed token regions) or it is an ATen
    rewrite Inductor compiles anyway (``transposed_linear``). A generated
    group is gemc's only where a measurement recorded a win (``measured[name]["choice"]``),
    because without one Inductor's fused code is the safe default (it never loses to the
    op-by-op graph, and it fuses across the group's border); the kind's declaration
    (gemc.kernel_kinds) says which kinds compete and what each runs without a measurement."""
    return choice_and_source(entry, measured)[0]


def choice_and_source(entry: dict[str, Any], measured: Mapping[str, Any] | None = None
                      ) -> tuple[str, str]:
    """:func:`default_choice` and where it came from: ``forced`` (``GEMC_GROUP_CHOICE``),
    the record's ``source`` (``recorded`` when it names none) or ``default``."""
    kind = KINDS.get(entry["kind"])
    if kind is None or not kind.generated:
        return "gemc", "default"
    forced = os.environ.get(CHOICE_ENV, "auto")
    if forced in ("gemc", "inductor"):
        return forced, "forced"
    rec = (measured or {}).get(str(entry.get("name")))
    if isinstance(rec, Mapping) and rec.get("choice") in ("gemc", "inductor"):
        return str(rec["choice"]), str(rec.get("source", "recorded"))
    return kind.default_choice, "default"


_ISLANDS: dict[Callable[..., Any], Callable[..., Any]] = {}
"""A kind's eager-island call -> its ``torch._dynamo.disable`` wrapper (one per function)."""


@dataclass
class Built:
    """What :func:`build` made: the module to compile and what it did with each entry."""

    module: fx.GraphModule
    choices: dict[str, str]  # entry name -> "gemc" | "inductor"
    runner: GraphRunner  # owns the launchers and the embedding modules
    sources: dict[str, str]  # entry name -> where its choice came from (choice_and_source)


def _attr_name(fqn: str) -> str:
    return "p_" + fqn.replace(".", "__")


def _embedding_inputs(entry: dict[str, Any], ids: list[torch.Tensor],
                      offsets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor | None]:
    """The batched lookup's flat ids, offsets and per-id weights, from each table's ids and
    offsets: one ``gemc::bag_inputs`` (see there why not its ATen ops)."""
    tables = entry["tables"]
    mean = [t["pooling"] == "mean" for t in tables]
    flat_ids, flat_offsets, psw = torch.ops.gemc.bag_inputs(
        ids, offsets, [bool(t["include_last_offset"]) for t in tables], mean)
    return flat_ids, flat_offsets, psw if any(mean) else None


def _call_group(kernel: str, autocast: str, gemm_operands: Sequence[int],
                inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A generated group through its custom op; under autocast the GEMM's operands are cast
    first (outside the op, so autograd casts their gradients back), as F.linear's are."""
    if autocast and gemm_operands:
        dt = getattr(torch, autocast)
        inputs = [t.to(dt) if i in gemm_operands and t.is_floating_point() else t
                  for i, t in enumerate(inputs)]
    return torch.ops.gemc.fused_group(kernel, inputs, autocast)


def _call_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                    clamp_min: int, max_len: int, scale: float | None) -> torch.Tensor:
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out, _ = torch.ops.gemc.jagged_attention(q, k, v, offsets, clamp_min, max_len, scale)
    return out.transpose(1, 2)


def _call_embeddings(name: str, module: nn.Module, entry: dict[str, Any],
                     ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
    """The batched lookup's whole ``[B, sum(dims)]`` output; each table's pooled value is a
    column view of it (:meth:`Emitter.embeddings`)."""
    flat_ids, flat_offsets, psw = _embedding_inputs(entry, ids, offsets)
    return torch.ops.gemc.embedding_bag(name, module.weights, module.momentum1,
                                        module.momentum2, flat_ids, flat_offsets, psw,
                                        module._anchor)


@dataclass(frozen=True)
class Column:
    """Columns ``[first, first + width)`` of a batched lookup's whole output in the new
    graph (``whole``: its width): a table's pooled value, or a run of adjacent ones."""

    base: fx.Node
    first: int
    width: int
    whole: int


def merge_columns(values: Sequence[Any], columns: Mapping[fx.Node, Column]) -> list[Any]:
    """``values`` (a ``cat`` along dim 1) with each run of two or more adjacent column views
    of one batched lookup's output, in column order, replaced by the :class:`Column` it
    spans (the caller emits it as one view); other values as they are.

    Why: a model concatenating its pooled features (DLRM's ``cat([bottom, *pooled], 1)``,
    26 tables on the H200) makes Inductor write one copy kernel per table in the forward,
    and in the backward the split's gradient is a ``cat`` of those columns again, one more
    copy kernel per table, each autotuned on the first step; a merged run is one slice of
    the output both ways."""
    out: list[Any] = []
    run: list[Column] = []

    def flush() -> None:
        if len(run) > 1:
            out.append(Column(run[0].base, run[0].first,
                              run[-1].first + run[-1].width - run[0].first, run[0].whole))
        else:
            out.extend(run_values)
        run.clear()
        run_values.clear()

    run_values: list[Any] = []
    for v in values:
        col = columns.get(v) if isinstance(v, fx.Node) else None
        if col is None or not run or col.base is not run[-1].base or \
                col.first != run[-1].first + run[-1].width:
            flush()
        if col is None:
            out.append(v)
        else:
            run.append(col)
            run_values.append(v)
    flush()
    return out


def in_join_order(gm: fx.GraphModule, entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with a batched lookup's tables in the order the graph joins their outputs
    (its ``cat`` / ``stack`` nodes in graph order, each's operands in order; tables no join
    reads keep the plan's order, after those): its output's columns then lie in that order,
    so each join reads one view of them (:func:`merge_columns`). Other entries as they are.

    Why: GEM stacks its 100 tables in groups of one dim (60 of dim 64, 20 of 96, 20 of
    128, interleaved in table order), which left few adjacent columns to merge; a copy
    kernel per table in the forward and again in the backward stayed (GEM's first step on
    the H200 ran Inductor's runtime autotuning 288 times, 7.3 s). The order is the runner's
    layout of the fused buffer, not the plan's: each table's weights and optimizer state
    are still views the runner hands to its table (checkpoints are per table), and the
    lookups, the update and the loss are the same; a bf16 / fp8 table's stochastic
    rounding draws by its place in the buffer, so those bits move, not their law."""
    if entry.get("kind") != "batched_embedding_bag":
        return entry
    position = {t["output"]: i for i, t in enumerate(entry["tables"])}
    order: list[int] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (torch.ops.aten.cat.default,
                                                          torch.ops.aten.stack.default):
            order += [position.pop(a.name) for a in node.args[0]
                      if isinstance(a, fx.Node) and a.name in position]
    order += sorted(position.values())
    return {**entry, "tables": [entry["tables"][i] for i in order]}


def runner_for(gm: fx.GraphModule, entries: Sequence[dict[str, Any]],
               params: Mapping[str, torch.Tensor], *, device: torch.device | str = "cpu",
               calls: Mapping[str, Callable[..., Any]] | None = None, packed: bool = True
               ) -> tuple[GraphRunner, list[str]]:
    """The interpreter set up for the plan's entries (its schedule, launchers, embedding
    modules and packed regions are what :func:`build` emits), and the names of the entries
    left out: ``packed_tokens`` regions when ``packed`` is False (their ops then run
    padded), and guarded regions whose mask cannot be computed from the batch ahead of the
    graph (:mod:`.region_guard` checks it there), with a warning saying why."""
    reasons = {str(e.get("name")): why_not_ahead_all(gm, guard_inputs(e), calls or {})
               for e in entries if e["kind"] == "packed_tokens" and e.get("guard") is not None}
    blocked = {name: why for name, why in reasons.items() if why is not None}
    if packed and blocked:
        warnings.warn(
            "gemc: packed region(s) guarded by a run-time mask check not applied in the "
            "compiled graph, as the check runs ahead of it on the batch: "
            + "; ".join(f"{name}: {why}" for name, why in blocked.items())
            + "; their token-wise ops run padded (the interpreter, --graph-executor "
            "interpreter, runs them packed)", stacklevel=2)

    def left_out(e: dict[str, Any]) -> bool:
        return e["kind"] == "packed_tokens" and (not packed or str(e.get("name")) in blocked)

    not_applied = [str(e.get("name")) for e in entries if left_out(e)]
    kept = [e for e in entries if not left_out(e)]
    return GraphRunner(gm, kept, params, device=device, calls=calls, narrow=False), not_applied


def build(runner: GraphRunner, *, autocast: torch.dtype | None = None,
          measured: Mapping[str, Any] | None = None,
          guards: Mapping[str, int] | None = None,
          attention_guards: Mapping[str, str] | None = None,
          ahead: Sequence[str] = ()) -> Built:
    """The rewritten graph of ``runner.gm`` with ``runner.entries`` as custom-op calls (see
    the module doc). The runner's ``params`` feed the graph's parameter placeholders (the
    same tensors: their gradients land on them). ``autocast``: the dtype of the autocast
    the module will run under (None: none); it is baked into the group calls, because
    compiled code does not see the ambient autocast state at run time. ``measured``: per
    entry name, a recorded measurement (see :func:`default_choice`). ``guards``: the
    guarded regions to run packed (a check ahead of the graph found their masks prefixes:
    :class:`.region_guard.RegionGuard`), by name (a mapping's values, the counts the check
    found, are not read); the module then takes their offsets first, in this order, then
    the inputs named below, then the batch. Guarded regions not named run
    padded, the model's own computation. ``attention_guards``: key-padding attentions the
    same check decided (:func:`.region_guard.guarded_attentions`), each ``"prefix"``,
    ``"compact"`` or ``"padded"``; the first two take their keys' lengths as leading inputs
    after the regions' offsets, in this order. Attentions not named stay eager islands.
    Each packed region's token count is not a constant of the graph but the size of one
    more leading input per region (``<name>_tokens``, after the key lengths, in the
    regions' order; :func:`token_count_input` makes it), so a compile that traces that
    size as dynamic (after a second count) serves every token count. ``ahead``: table
    lookup nodes (of ``runner.calls``) whose rows the caller looked up ahead of the graph
    (gemc.backends.torch.replica_ahead): each is one more leading input (``<node>_rows``,
    after the token counts, in this order) in place of its lookup."""
    return Emitter(runner, autocast, measured, guards or {}, attention_guards or {},
                   ahead).run()


def ahead_output(rows: torch.Tensor, is_bag: bool) -> Any:
    """What a lookup node answered ahead of the graph returned: its rows, or for a bag
    ATen's tuple (the graph reads item 0, as of the sharded table's lookup call)."""
    return (rows, None, None, None) if is_bag else rows


# ---- packed token regions, as traceable helpers (shapes from shapes: no host read) --------


Region = tuple[Any, int, int, int, Any]  # (offsets, clamp_min, max_len, total, positions)


def _layout(offsets: torch.Tensor, clamp_min: int, max_len: int, total: int,
            positions: torch.Tensor | None = None) -> TokenLayout:
    """The region's layout, room for ``total`` tokens (``TokenLayout.bounded``'s count,
    computed from the capture's shapes when the graph is built); ``positions``: a compact
    guarded region's kept positions (``packed_tokens.kept_positions``), ``packed_tokens.REPS``
    for a region with padding representatives (its offsets are ``rep_offsets``: the
    weights follow from them), ``packed_tokens.EMPTY_LAST`` for an offset-proven region
    whose empty rows' slots stand for position ``L - 1`` (the positions follow from the
    offsets), else None."""
    reps = isinstance(positions, str) and positions == packed_tokens.REPS
    last = isinstance(positions, str) and positions == packed_tokens.EMPTY_LAST
    layout = TokenLayout(TokenLayout._offsets(offsets, clamp_min, max_len), total,
                         offsets.shape[0] - 1, max_len,
                         None if isinstance(positions, str) else positions)
    if last:  # an offset-proven region's empty rows at position L - 1 (its ``empty_last``)
        return packed_tokens.with_empty_last(layout, offsets)
    return packed_tokens.with_rep_weights(layout) if reps else layout


def _p_gather(x: Any, dims: tuple[int, int], rank: int, offsets: torch.Tensor,
              clamp_min: int, max_len: int, total: int, positions: Any = None) -> Any:
    """``packed_tokens.gather`` through ``gemc::gather_tokens``."""
    return packed_tokens.gather(x, dims, rank,
                                _layout(offsets, clamp_min, max_len, total, positions),
                                take=torch.ops.gemc.gather_tokens)


def _p_scatter(x: torch.Tensor, dims: tuple[int, int], offsets: torch.Tensor, clamp_min: int,
               max_len: int, total: int, positions: Any = None) -> torch.Tensor:
    return packed_tokens.scatter(x, dims, _layout(offsets, clamp_min, max_len, total,
                                                  positions))


def _p_segment_sum(x: torch.Tensor, dims: tuple[int, int], offsets: torch.Tensor,
                   clamp_min: int, max_len: int, total: int, positions: Any = None
                   ) -> torch.Tensor:
    """``packed_tokens.segment_sum`` through ``gemc::segment_sum``."""
    layout = _layout(offsets, clamp_min, max_len, total, positions)
    bd, ld = dims
    moved = x.movedim(dims, (0, 1))
    tokens = moved.reshape(total, *moved.shape[2:])
    acc = torch.ops.gemc.segment_sum(tokens, layout.offsets, layout.index("row_out"))
    return acc.movedim(0, bd - (bd > ld))


def _p_source(values: torch.Tensor, row: torch.Tensor, pos: torch.Tensor,
              offsets: torch.Tensor, clamp_min: int, max_len: int, total: int,
              positions: Any, accumulate: bool, in_order: bool = False) -> torch.Tensor:
    return packed_tokens.source(values, row, pos,
                                _layout(offsets, clamp_min, max_len, total, positions),
                                accumulate, in_order)


def _p_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dims: tuple[tuple[int, int], ...], offsets: torch.Tensor, clamp_min: int,
                 max_len: int, total: int, positions: Any, scale: float | None,
                 causal: bool = False) -> torch.Tensor:
    """``packed_tokens.attention`` on region values: no conversion (over a compact region's
    kept tokens too: their order in each row is kept, so the causal rule over ranks is the
    rule over positions)."""
    return packed_tokens.attention(q, k, v, dims,
                                   _layout(offsets, clamp_min, max_len, total, positions),
                                   scale, causal)


def _p_rep_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     dims: tuple[tuple[int, int], ...], mask: torch.Tensor, additive: bool,
                     scale: float | None, offsets: torch.Tensor, clamp_min: int,
                     max_len: int, total: int, positions: Any = None) -> torch.Tensor:
    """``packed_tokens.rep_attention``: an attention over a layout with padding
    representatives, each representative key biased by the mask entries it stands for."""
    return packed_tokens.rep_attention(q, k, v, dims,
                                       _layout(offsets, clamp_min, max_len, total, positions),
                                       mask, additive, scale)


def _p_exit(x: torch.Tensor, dims: tuple[int, int], row: torch.Tensor, col: torch.Tensor,
            offsets: torch.Tensor, clamp_min: int, max_len: int, total: int,
            positions: Any = None) -> torch.Tensor:
    """``packed_tokens.exit_tokens``: a gather at the region's jagged positions, from its
    tokens."""
    return packed_tokens.exit_tokens(x, dims, _layout(offsets, clamp_min, max_len, total,
                                                      positions), row, col)


def _p_read_rows(x: torch.Tensor, dims: tuple[int, int], index: torch.Tensor | None,
                 spec: dict[str, Any], offsets: torch.Tensor, clamp_min: int, max_len: int,
                 total: int, positions: Any = None) -> torch.Tensor:
    """``packed_tokens.read_rows``: a one-token-per-row reader of a region this graph runs
    packed (a guarded one's check, ahead of the graph, found every position kept; an
    offset-proven one's reader is ``proven``), from its tokens."""
    layout = _layout(offsets, clamp_min, max_len, total, positions)
    pos = read_positions(index, spec.get("at"), layout.batch, max_len, bool(spec["wrap"]),
                         offsets.device, spec.get("stride"))
    return packed_tokens.read_rows(x, dims, layout, pos, bool(spec["keepdim"]))


def _p_weighted(x: torch.Tensor, dims: tuple[int, int], spec: dict[str, Any],
                offsets: torch.Tensor, clamp_min: int, max_len: int, total: int,
                positions: Any = None) -> torch.Tensor:
    """``packed_tokens.weighted_reduce``: a reduction over the token axis of a region with
    padding representatives, each slot weighted by the padded tokens it stands for."""
    layout = _layout(offsets, clamp_min, max_len, total, positions)
    return packed_tokens.weighted_reduce(x, dims, layout, spec["op"], spec["dims"],
                                         bool(spec["keepdim"]), float(spec["correction"]))


def _p_offsets(offsets: torch.Tensor, clamp_min: int, max_len: int, total: int,
               positions: Any = None) -> torch.Tensor:
    """A region's layout offsets (its lengths, clamped as the region clamps them)."""
    return _layout(offsets, clamp_min, max_len, total, positions).offsets


class Emitter:
    """Walks the runner's schedule and writes the new graph (one method per case, mirroring
    ``GraphRunner``'s execution of the same node)."""

    def __init__(self, runner: GraphRunner, autocast: torch.dtype | None,
                 measured: Mapping[str, Any] | None, guards: Collection[str],
                 attention_guards: Mapping[str, str] | None = None,
                 ahead: Sequence[str] = ()) -> None:
        self.r = runner
        self.autocast = autocast
        self.auto = gemc_ops.dtype_name(autocast)
        self.measured = measured
        self.device = runner.device
        self.calls = dict(runner.calls)
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.attrs: dict[str, fx.Node] = {}
        self.unpacked: dict[fx.Node, fx.Node] = {}
        self.columns: dict[fx.Node, Column] = {}  # batched lookups' table outputs
        self.choices: dict[str, str] = {}
        self.sources: dict[str, str] = {}
        for name, module in runner.tables.items():
            gemc_ops.register_table(name, module)
        # where values are packed: the plan's regions, and the guarded ones named in
        # ``guards`` (their offsets: leading inputs, from the check ahead of the graph)
        self.packed = {n: d for n, d in runner.packed.items() if n not in runner.guarded_nodes}
        self.guarded: dict[str, tuple[fx.Node, fx.Node | None]] = {}
        regions = {str(r["name"]): r for r in runner.region_of.values()
                   if r.get("guard") is not None}
        for name in guards:
            if name not in regions:
                raise ValueError(f"guards: {name} is not a guarded region of this graph")
            offsets = self.graph.placeholder(f"{name}_offsets")
            # each after its offsets; padding representatives: the offsets say it all
            positions = self.graph.placeholder(f"{name}_positions") \
                if regions[name].get("compact") else \
                packed_tokens.REPS if regions[name].get("pad_rep") else None
            self.guarded[name] = (offsets, positions)
            self.packed.update({n: d for n, d in runner.guarded_nodes.items()
                                if runner.region_of[n] is regions[name]})
        # attention name -> (its outcome, its key lengths placeholder or None: padded)
        self.attention_guards: dict[str, tuple[str, fx.Node | None]] = {}
        for name, outcome in (attention_guards or {}).items():
            lengths = self.graph.placeholder(f"{name}_key_lengths") \
                if outcome != "padded" else None
            self.attention_guards[name] = (outcome, lengths)
        # each packed guarded region's token count, as the size of a leading input of its
        # own (after the key lengths): traced as a size, not a constant, so one compiled
        # graph serves every bucket; read once, lazily (``region``)
        self.token_counts = {name: self.graph.placeholder(f"{name}_tokens")
                             for name in self.guarded}
        self.token_sizes: dict[str, fx.Node] = {}
        # table lookups made ahead of the graph: their rows, inputs after the token counts
        self.ahead = {name: self.graph.placeholder(f"{name}_rows") for name in ahead}

    # -- helpers ------------------------------------------------------------------------------

    def call(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
             ) -> fx.Node:
        return self.graph.call_function(fn, args, kwargs or {})

    def attr(self, name: str, value: torch.Tensor | nn.Module) -> fx.Node:
        if name not in self.attrs:
            if isinstance(value, nn.Parameter):
                self.root.register_parameter(name, value)
            elif isinstance(value, nn.Module):
                self.root.add_module(name, value)
            else:
                self.root.register_buffer(name, value)
            self.attrs[name] = self.graph.get_attr(name)
        return self.attrs[name]

    def region(self, node: fx.Node) -> Region:
        """A region node's layout arguments: its offsets (in the new graph), the clamp, the
        length and the room for tokens (the values' count plus the clamp's slots)."""
        r = self.r.region_of[node]
        if r.get("guard") is not None:
            name = str(r["name"])
            offsets, positions = self.guarded[name]
            if name not in self.token_sizes:
                self.token_sizes[name] = self.graph.call_method(
                    "size", (self.token_counts[name], 0))
            return (offsets, 0, int(r["max_len"]), self.token_sizes[name], positions)
        by_name = self.r.by_name
        values = int(by_name[r["values"]].meta["val"].shape[0])
        batch = int(by_name[r["offsets"]].meta["val"].shape[0]) - 1
        clamp = int(r["clamp_min"])
        return (self.env[by_name[r["offsets"]]], clamp, int(r["max_len"]),
                values + batch * max(0, clamp),
                packed_tokens.EMPTY_LAST if r.get("empty_last") else None)

    def padded(self, node: Any) -> Any:
        """``node``'s value at its padded shape (a region value scattered, once)."""
        if not isinstance(node, fx.Node) or node not in self.packed:
            return self.env[node] if isinstance(node, fx.Node) else node
        if node not in self.unpacked:
            self.unpacked[node] = self.call(_p_scatter, (self.env[node], self.packed[node],
                                                         *self.region(node)))
        return self.unpacked[node]

    def operand(self, name: str) -> Any:
        """The value of graph node ``name`` at its padded shape, in the new graph: what a
        kind's ``emit`` reads (gemc.backends.triton.kinds)."""
        return self.padded(self.r.by_name[name])

    def output(self, name: str, value: Any) -> None:
        """A kind's padded result for graph node ``name`` (gathered if the node is packed)."""
        self.store(self.r.by_name[name], value, False)

    def eager(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> fx.Node:
        """A call of ``fn`` that Dynamo leaves to eager code (``torch._dynamo.disable``): a
        kind's call whose run-time check reads the host (a guarded attention) would break
        the graph inside it anyway; as one eager island the rest compiles whole."""
        island = _ISLANDS.get(fn)
        if island is None:
            island = _ISLANDS[fn] = torch._dynamo.disable(fn)
        return self.call(island, args)

    def packed_guarded_region(self, name: str) -> dict[str, Any] | None:
        """The guarded region graph node ``name`` is in, when this graph runs that region
        packed (its check, ahead of the graph, passed: ``build(guards=...)``); else None."""
        region = self.r.region_of.get(self.r.by_name[name])
        if region is None or str(region.get("name")) not in self.guarded:
            return None
        return region

    def packed_attention(self, qkv: Sequence[str], out: str, scale: float | None,
                         causal: bool | None = None) -> bool:
        """Jagged attention on packed region values in place (``gemc::jagged_attention_values``,
        no conversion) when q, k, v and the output ``out`` (graph node names) all are in a
        region this graph runs packed; returns whether it applied (nothing is emitted
        otherwise)."""
        nodes = [self.r.by_name[name] for name in (*qkv, out)]
        if not all(n in self.packed for n in nodes):
            return False
        *inputs, node = nodes
        dims = tuple(self.packed[n] for n in nodes)
        args = (*(self.env[n] for n in inputs), dims, *self.region(node), scale)
        self.env[node] = self.call(_p_attention, args if causal is None else (*args, causal))
        return True

    def packed_rep_attention(self, entry: dict[str, Any]) -> bool:
        """``GraphRunner.packed_rep_attention`` in the new graph: a region with padding
        representatives' attention on its tokens (``_p_rep_attention``), its key mask read
        in the graph; returns whether it applied (nothing is emitted otherwise)."""
        out = str(entry.get("output", entry["nodes"][0]))
        nodes = [self.r.by_name[name] for name in (entry["q"], entry["k"], entry["v"], out)]
        if not all(n in self.packed for n in nodes):
            return False
        *inputs, node = nodes
        dims = tuple(self.packed[n] for n in nodes)
        mask = self.operand(str(entry["mask"]))
        self.env[node] = self.call(_p_rep_attention, (
            *(self.env[n] for n in inputs), dims, mask, bool(entry["additive"]),
            entry["scale"], *self.region(node)))
        return True

    def packed_operands(self, names: Sequence[str]) -> tuple[list[Any], fx.Node] | None:
        """``GraphRunner.packed_operands`` in the new graph: the packed values of ``names``
        but the last (the kind's output) and the layout offsets of the last one's region,
        when all are in regions this graph runs packed; else None (nothing emitted)."""
        nodes = [self.r.by_name[n] for n in names]
        if not all(n in self.packed for n in nodes):
            return None
        region = self.region(nodes[-1])
        if region[4] is not None and not (isinstance(region[4], str)
                                          and region[4] == packed_tokens.EMPTY_LAST):
            return None  # kept positions that are not a prefix: no offsets (an empty
            # row's slot at L - 1 is one: the attention over the offsets gives it 0)
        return [self.env[n] for n in nodes[:-1]], self.call(_p_offsets, region)

    def packed_output(self, name: str, value: Any) -> None:
        """A kind's result for region node ``name``, already in the packed layout."""
        self.store(self.r.by_name[name], value, True)

    def store(self, node: fx.Node, value: Any, is_packed: bool) -> None:
        if node in self.packed and not is_packed:
            value = self.call(_p_gather, (value, self.packed[node], _rank(node),
                                          *self.region(node)))
        self.env[node] = value

    def entering(self, arg: Any, dims: tuple[int, int], rank: int, region: Region) -> Any:
        if isinstance(arg, fx.Node):
            if arg in self.packed:
                return self.env[arg]
            return self.call(_p_gather, (self.env[arg], dims, rank, *region))
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.entering(a, dims, rank, region) for a in arg)
        return arg

    def on_device(self, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return on_run_device(args, kwargs, self.device)

    # -- nodes --------------------------------------------------------------------------------

    def node(self, node: fx.Node) -> None:
        r = self.r
        if node.op == "placeholder":
            fqn = node.meta.get(ir.PARAM)
            if fqn is None:
                self.env[node] = self.graph.placeholder(node.name)
            elif fqn in r.params:
                self.env[node] = self.attr(_attr_name(fqn), r.params[fqn])
            else:
                self.env[node] = self.call(_missing_param, (fqn,))
            return
        if node.target in _SKIP or node in r.skipped:
            return
        if node in r.gathered and node in self.packed:  # its tokens' ids, looked up
            ids, region = r.gathered[node], self.region(node)
            tokens = self.call(_p_gather, (self.env[ids], self.packed[node], _rank(ids),
                                           *region))
            args = (fx.node.map_arg(node.args[0], self.padded), tokens, *node.args[2:])
            if node.name in self.calls:
                self.env[node] = self.call(self.lookup_fn(node), args, dict(node.kwargs))
            else:
                args, kwargs = self.on_device(args, dict(node.kwargs))
                self.env[node] = self.call(node.target, args, kwargs)
        elif node.name in self.calls:  # e.g. a table lookup answered by its table module
            if node.name in self.ahead:  # a replica's rows, looked up ahead of the graph
                out = self.call(ahead_output, (
                    self.ahead[node.name], node.target is not torch.ops.aten.embedding.default))
            else:
                out = self.call(self.lookup_fn(node), fx.node.map_arg(node.args, self.padded),
                                fx.node.map_arg(node.kwargs, self.padded))
            self.env[node] = out if node not in self.packed else \
                self.call(_p_gather, (out, self.packed[node], _rank(node), *self.region(node)))
        elif node in r.packed_sources:
            reg = r.packed_sources[node]
            acc = bool(node.args[3]) if len(node.args) > 3 else False
            by_name = r.by_name
            self.env[node] = self.call(_p_source, (
                self.env[by_name[reg["values"]]], self.env[by_name[reg["row"]]],
                self.env[by_name[reg["pos"]]], *self.region(node), acc,
                bool(reg.get("in_order"))))
        elif node in r.exits and node.args[0] in self.packed:
            x, (row, col) = node.args[0], node.args[1]
            self.env[node] = self.call(_p_exit, (self.env[x], self.packed[x], self.env[row],
                                                 self.env[col], *self.region(x)))
        elif node in r.weighted and node.args[0] in self.packed:
            x = node.args[0]
            self.env[node] = self.call(_p_weighted, (self.env[x], self.packed[x],
                                                     r.weighted[node], *self.region(x)))
        elif node in r.row_reads and node.args[0] in self.packed:
            x, spec = node.args[0], r.row_reads[node]
            index = self.env[r.by_name[spec["index"]]] if spec.get("index") else None
            self.env[node] = self.call(_p_read_rows, (self.env[x], self.packed[x], index,
                                                      spec, *self.region(x)))
        elif node in self.packed:
            self.packed_node(node)
        elif self.segment_sum(node) or self.cat(node):
            pass
        else:
            args, kwargs = self.on_device(fx.node.map_arg(node.args, self.padded),
                                          dict(fx.node.map_arg(node.kwargs, self.padded)))
            self.env[node] = self.call(node.target, args, kwargs)

    def lookup_fn(self, node: fx.Node) -> Callable[..., Any]:
        """The callable answering ``node`` (a table lookup's ``call``): an eager island
        unless it says it traces (``in_graph``)."""
        fn = self.calls[node.name]
        return fn if getattr(fn, "in_graph", False) else torch._dynamo.disable(fn)

    def segment_sum(self, node: fx.Node) -> bool:
        """A sum over positions of a region value adds its tokens (``GraphRunner``'s rule)."""
        if node.target is not torch.ops.aten.sum.dim_IntList or node.kwargs:
            return False
        src = node.args[0]
        if not (isinstance(src, fx.Node) and src in self.packed):
            return False
        rank = _rank(src)
        reduced = [int(d) % rank for d in node.args[1]]
        keep = len(node.args) > 2 and node.args[2]
        if reduced != [self.packed[src][1]] or keep:
            return False
        self.env[node] = self.call(_p_segment_sum, (self.env[src], self.packed[src],
                                                    *self.region(src)))
        return True

    def packed_node(self, node: fx.Node) -> None:
        """A region node on packed values (``GraphRunner._call_packed``)."""
        dims = self.packed[node]
        region = self.region(node)
        rank = _rank(node)
        t = node.target
        if packed_tokens.is_pointwise(node):
            args = tuple(self.entering(a, dims, rank, region) for a in node.args)
            kwargs = {k: self.entering(v, dims, rank, region) for k, v in node.kwargs.items()}
            self.env[node] = self.call(t, args, kwargs)
            return
        if packed_tokens.causal_self_attention(node) and region[4] is None and \
                self.packed_attention([x.name for x in packed_tokens.attention_operands(node)],
                                      node.name, ir.sdpa_args(node)["scale"], True):
            return
        first = node.args[0]
        if packed_tokens.per_token(node) and isinstance(first, fx.Node) \
                and first in self.packed:
            args = list(fx.node.map_arg(node.args, self.env.__getitem__))
            if t in packed_tokens.SIZED:
                args[1] = packed_tokens.resize(list(args[1]), dims, region[3],
                                                int(self.r.region_of[node]["batch"]))
            kwargs = dict(fx.node.map_arg(node.kwargs, self.env.__getitem__))
            self.env[node] = self.call(t, tuple(args), kwargs)
            return
        def padded(n: fx.Node) -> Any:
            # a random op draws in its input's memory order: eager's layout (in_eager_order)
            return self.call(packed_tokens.in_eager_order, (self.padded(n), ir.stride_of(n))) \
                if n in self.packed and packed_tokens.draws(node) else self.padded(n)

        args, kwargs = self.on_device(fx.node.map_arg(node.args, padded),
                                      dict(fx.node.map_arg(node.kwargs, padded)))
        out = self.call(t, args, kwargs)
        self.env[node] = self.call(_p_gather, (out, dims, rank, *region))

    # -- units --------------------------------------------------------------------------------

    def unit(self, unit: dict[str, Any]) -> None:
        entry = unit["entry"]
        name = str(entry.get("name"))
        kind = entry["kind"]
        choice, source = choice_and_source(entry, self.measured)
        if "structure" in entry and unit.get("shared_operand") and self.autocast is not None:
            # its epilogue reads the GEMM operand unrounded (see runner)
            choice, source = "inductor", "required"
        self.choices[name] = choice
        self.sources[name] = source
        if choice == "inductor":
            for node in unit["nodes"]:
                self.node(node)
            return
        implementation = registry.unit(kind)
        if implementation is None:
            raise ValueError(f"unknown kernel kind {kind!r}")
        implementation.emit(self, unit)

    def embeddings(self, unit: dict[str, Any]) -> None:
        entry = unit["entry"]
        name = str(entry.get("name"))
        by_name = self.r.by_name
        module = self.r.tables[entry["name"]]
        mod = self.attr("t_" + name.replace(".", "__"), module)
        ids = [self.padded(by_name[t["ids"]]) for t in entry["tables"]]
        offs = [self.padded(by_name[t["offsets"]]) for t in entry["tables"]]
        out = self.call(_call_embeddings, (name, mod, entry, ids, offs))
        first = 0
        for t, width in zip(entry["tables"], module.dims):
            view = self.call(torch.narrow, (out, 1, first, width))
            self.columns[view] = Column(out, first, width, module.total_dim)
            self.store(by_name[t["output"]], view, False)
            first += width

    def cat(self, node: fx.Node) -> bool:
        """A ``cat`` or ``stack`` along dim 1 of 2-d values with adjacent columns of a
        batched lookup among them reads each run as one view (:func:`merge_columns`): for
        ``cat`` the run's columns, for ``stack`` (equal widths) the same columns as
        ``[B, n, width]``."""
        stack = node.target is torch.ops.aten.stack.default
        if not self.columns or not (stack or node.target is torch.ops.aten.cat.default):
            return False
        values = [self.padded(a) for a in node.args[0]]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        rank = node.meta["val"].dim()
        if rank != (3 if stack else 2) or dim % rank != 1:
            return False
        parts = merge_columns(values, self.columns)
        if not any(isinstance(p, Column) for p in parts):
            return False
        width = int(node.meta["val"].shape[2]) if stack else 0
        pieces = []
        for p in parts:
            if not isinstance(p, Column):
                pieces.append(self.call(torch.unsqueeze, (p, 1)) if stack else p)
                continue
            view = p.base if p.width == p.whole else \
                self.call(torch.narrow, (p.base, 1, p.first, p.width))
            pieces.append(self.call(torch.unflatten, (view, 1, (p.width // width, width)))
                          if stack else view)
        self.env[node] = pieces[0] if stack and len(pieces) == 1 else \
            self.call(torch.ops.aten.cat.default, (pieces, 1))
        return True

    def group(self, unit: dict[str, Any]) -> None:
        """A generated group through ``gemc::fused_group``; inside a packed region at the
        region's token count (its own launcher, registered under its packed binding)."""
        entry = unit["entry"]
        by_name = self.r.by_name
        binding = entry["binding"]
        impl = unit["run"].impl
        key_entry = entry
        packed = all(n in self.packed for n in unit["nodes"])
        if packed:
            out_node = by_name[binding["outputs"][0]]
            dims, rank = self.packed[out_node], _rank(out_node)
            region = self.region(out_node)
            shapes = [packed_tokens.packed_shape(sh, dims, rank, region[3],
                                                  int(self.r.region_of[out_node]["batch"]))
                      for sh in binding["shapes"]]
            key_entry = {**entry, "binding": {**binding, "shapes": shapes}}
            impl = make_runner(impl.m, key_entry["binding"]).impl
            st = entry["structure"]
            token = {slot["input"] for slot in st["slots"]}
            if st["ops"][0]["op"] == "linear":
                token.add(st["ops"][0]["args"][0][1])
            inputs = []
            for i, name in enumerate(binding["inputs"]):
                node = by_name[name]
                if node in self.packed or i not in token:
                    inputs.append(self.env[node])
                else:
                    inputs.append(self.call(_p_gather, (self.env[node], dims, rank, *region)))
        else:
            inputs = [self.padded(by_name[n]) for n in binding["inputs"]]
        kernel = gemc_ops.register_group(key_entry, impl)
        gemm = tuple(getattr(impl, a) for a in ("ix", "iw", "ib")) if hasattr(impl, "ix") else ()
        call = self.call(_call_group, (kernel, self.auto, gemm, inputs))
        for j, out_name in enumerate(binding["outputs"]):
            self.store(by_name[out_name], self.call(operator.getitem, (call, j)), packed)

    def attention(self, unit: dict[str, Any]) -> None:
        entry = unit["entry"]
        by_name = self.r.by_name
        node = unit["nodes"][0]
        if self.packed_attention([entry[x] for x in ("q", "k", "v")], node.name,
                                 entry["scale"]):
            return
        q, k, v = (self.padded(by_name[entry[x]]) for x in ("q", "k", "v"))
        value = self.call(_call_attention, (q, k, v, self.env[by_name[entry["offsets"]]],
                                            int(entry["clamp_min"]), int(entry["max_len"]),
                                            entry["scale"]))
        self.store(node, value, False)

    def run(self) -> Built:
        output: fx.Node | None = None
        for key in self.r.order:
            if key[0] == "u":
                self.unit(self.r.units[key[1]])
            elif key[1].op == "output":
                output = key[1]
            else:
                self.node(key[1])
        if output is None:
            raise ValueError("graph has no output")
        result = fx.node.map_arg(output.args[0], self.padded)
        if isinstance(result, (list, tuple)) and len(result) == 1:
            result = result[0]
        self.graph.output(result)
        self.graph.eliminate_dead_code()
        module = fx.GraphModule(self.root, self.graph, class_name="GemcRewritten")
        return Built(module=module, choices=self.choices, runner=self.r, sources=self.sources)


def token_count_input(total: int, device: torch.device) -> torch.Tensor:
    """:func:`build`'s token-count input for a region packed at ``total`` tokens: an
    empty ``[total, 0]`` tensor (no storage). Not marked dynamic: the first count compiles a
    static graph, and Dynamo's automatic dynamic shapes (``torch.compile(dynamic=None)``)
    recompiles once, with the count symbolic, when a second count arrives. Why not dynamic
    from the start: on the H200 SASRec/BST's packed graph ran 25.93 ms a step with its
    count symbolic against 24.00 static (8% slower), and it meets one bucket in 30 steps;
    MMoE's meets two, where one dynamic graph serves every later count."""
    return torch.empty((int(total), 0), device=device)


def _missing_param(fqn: str) -> torch.Tensor:
    raise KeyError(f"no tensor given for parameter placeholder {fqn}")


# ---- measuring a group: gemc's kernel against Inductor's code for the same subgraph ----------


MARGIN = 0.97
"""A generated group is gemc's only when its kernel is at least 3% faster than Inductor's
code for the same nodes: on a tie Inductor wins, as it also fuses across the group's border
(which a per-group measurement cannot see)."""


def _subgraph(runner: GraphRunner, unit: dict[str, Any], device: torch.device
              ) -> fx.GraphModule:
    """The group's own ATen nodes as a module of its binding's inputs and outputs."""
    entry = unit["entry"]
    by_name = runner.by_name
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in entry["binding"]["inputs"]:
        env[by_name[name]] = graph.placeholder(name)
    for node in unit["nodes"]:
        new = graph.node_copy(node, env.__getitem__)
        if "device" in new.kwargs:
            new.kwargs = {**new.kwargs, "device": device}
        env[node] = new
    graph.output(tuple(env[by_name[n]] for n in entry["binding"]["outputs"]))
    return fx.GraphModule(nn.Module(), graph)


def _example(node: fx.Node, device: torch.device, autocast: torch.dtype | None
             ) -> torch.Tensor:
    val = node.meta["val"]
    if not val.dtype.is_floating_point:
        return torch.zeros(val.shape, dtype=val.dtype, device=device)
    dtype = val.dtype
    if autocast is not None and node.meta.get(ir.PARAM) is None:
        dtype = autocast  # activations arrive in the autocast dtype; parameters stay fp32
    return torch.randn(val.shape, dtype=dtype, device=device).requires_grad_()


def _time_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median ms of ``fn`` (forward and backward) after two warm-up calls."""
    import statistics
    import time

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_groups(runner: GraphRunner, *, autocast: torch.dtype | None = None,
                   repeats: int = 20, names: Sequence[str] | None = None,
                   timer: Callable[[Callable[[], Any], torch.device, int], float] | None = None
                   ) -> dict[str, dict[str, Any]]:
    """Per generated group (or those in ``names``): forward + backward of gemc's kernel
    (the custom op) and of Inductor's code for the same nodes, at the group's captured
    shapes on the runner's device, and the choice (see MARGIN). A group that fails to run
    either way is recorded with its error and left to Inductor. Meaningful on a GPU only;
    on the CPU the kernels run in Triton's interpreter. A group inside a packed token region
    is measured at its padded (captured) shapes, not at the region's token count: an
    approximation that favours neither side."""
    out: dict[str, dict[str, Any]] = {}
    for unit in runner.units:
        entry = unit["entry"]
        name = str(entry.get("name"))
        if "structure" not in entry or (names is not None and name not in names):
            continue
        rec: dict[str, Any] = {"kind": entry["kind"]}
        try:
            rec.update(_measure_one(runner, unit, autocast, repeats, timer or _time_ms))
            rec["choice"] = "gemc" if rec["gemc_ms"] < MARGIN * rec["inductor_ms"] \
                else "inductor"
        except Exception as exc:  # noqa: BLE001 - recorded, and the group stays Inductor's
            rec.update(choice="inductor", error=f"{type(exc).__name__}: {exc}")
        out[name] = rec
    return out


def _measure_one(runner: GraphRunner, unit: dict[str, Any], autocast: torch.dtype | None,
                 repeats: int, timer: Callable[[Callable[[], Any], torch.device, int], float]
                 ) -> dict[str, float]:
    entry = unit["entry"]
    device = runner.device
    auto = gemc_ops.dtype_name(autocast)
    impl = unit["run"].impl
    kernel = gemc_ops.register_group(entry, impl)
    gemm = tuple(getattr(impl, a) for a in ("ix", "iw", "ib")) if hasattr(impl, "ix") else ()
    inputs = [_example(runner.by_name[n], device, autocast) for n in entry["binding"]["inputs"]]
    floats = [t for t in inputs if t.requires_grad]
    n_out = len(entry["binding"]["outputs"])
    compiled = torch.compile(_subgraph(runner, unit, device), dynamic=False)

    def step(f: Callable[[], Sequence[torch.Tensor]]) -> Callable[[], None]:
        def run() -> None:
            with torch.autocast(device.type, dtype=autocast or torch.bfloat16,
                                enabled=autocast is not None):
                outs = [o for o in f()[:n_out] if o.is_floating_point()]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            for t in floats:
                t.grad = None
        return run

    return {"gemc_ms": timer(step(lambda: _call_group(kernel, auto, gemm, inputs)), device,
                             repeats),
            "inductor_ms": timer(step(lambda: compiled(*inputs)), device, repeats)}
