"""Graph mode: run the captured graph with the plan's generated kernels in place.

The compiler's kernels replace *graph nodes*, not modules: a fused GEMM epilogue spans a
``Linear`` and the activation after it, a batched embedding lookup spans many tables the
model calls one by one, a jagged attention replaces a masked SDPA and its padding. Eager
module calls cannot be rewired to those, so when a plan lists kernels the runner executes
the ``torch.export`` graph it captured for the fingerprint check, with the runner's own
(deterministically initialized) parameters fed to the graph's parameter placeholders, so
AdamW and the sparse optimizer see the same parameters as in module mode. By default the
graph is rewritten with each kernel group as a call of its ``torch.library`` custom op
(:mod:`gemc.backends.triton.inductor_graph`) and trained through ``torch.compile``, so
Inductor compiles every op gemc does not specialise (why: run op by op, those ops made gemc
0.6-0.8x of torch.compile on models it had not been tuned for, issue 16). The op-by-op
interpreter (:class:`gemc.backends.triton.graph_runner.GraphRunner`) remains behind
``--graph-executor interpreter``, with a warning.

A ``batched_embedding_bag`` entry owns its tables: one flat buffer, the optimizer fused
into its backward (the same row-wise Adagrad / lazy Adam formulas as :mod:`.sparse_optim`,
with the run's embedding optimizer settings). The runner aliases each table's parameter
and optimizer-state tensors to views of that buffer, so checkpoints save and load them
like any other table, and the sparse optimizer skips those tables.

A table no applied batched entry owns takes gemc.table_lookup's path (the rule the cost
model prices by). On one rank an fp32 table captured ``sparse=False`` runs the graph's own
lookup op (``DENSE_GRAD``: a table-sized gradient the sparse optimizer reads once,
updating the touched rows in the same pass — measured 8x faster on the H200 than the
sparse route for DIN, see that module) unless the plan chose ``SPARSE`` for it by price (``priced_sparse``: the plan's
tables whose ``lookup`` is ``sparse``);
every other such table (captured ``sparse=True``, stored bf16/fp8, several ranks) has its
lookups call its :class:`ShardedEmbedding` (``SPARSE``: a lookup with ``sparse=True`` and
the sparse optimizer's row update, as in module mode; on one rank through
``gemc::table_lookup``, which compiles inside the graph, on several an eager island). A
read of a routed table other than as its module's lookup (a tied projection) runs as
captured on one rank, with a warning.

On several ranks the dense parameters are replicas (every region ``ddp``: their gradients
are averaged by the same post-accumulate hooks as in module mode, which the graph's
backward fires like the modules' would) and every table's lookup node calls its
:class:`ShardedEmbedding` (the exchange, the batched prefetch, and the owners' lookup on the
route gemc.table_lookup.sharded_route gives it: fused with the optimizer in its backward,
:mod:`.owner_lookup`, or sparse with the sparse optimizer after it). A
``batched_embedding_bag`` kernel entry is not applied there, with a warning: it updates
whole local tables inside its backward, before any gradient could be exchanged; the owners'
fused lookup runs after the exchange instead. The data-parallel replicas that share a
group's storage and that the graph looks up with batch inputs are looked up ahead of the
compiled graph, one lookup a group, their rows inputs of the graph (:mod:`.replica_ahead`).

Refused with a named error (``--no-kernels`` runs the ops the kernels replace instead):
``fsdp``/``hsdp``/``tp`` regions next to kernels on several ranks (they shard parameters
through module hooks that the captured graph never calls), and a table weight that the
graph reads other than through its module's lookup, on several ranks or stored bf16/fp8.
Per-module autocast sites are applied node by node (:mod:`.graph_precision`), fp8 linear
sites likewise (:mod:`.graph_fp8`: their linear nodes call the fp8 linear, whose
quantisation Inductor fuses into the producers).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import torch
from gemc.backends.torch.contended_gathers import route_contended_gathers
from gemc.backends.torch.embedding import ShardedEmbedding
from gemc.backends.torch.init import derive_seed
from gemc.backends.torch.replica_ahead import ReplicaAhead, ahead_lookups
from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer
from torch import nn

from gemc import ir
from gemc.data_dependent import source_line
from gemc.errors import PlanError
from gemc.kernel_kinds import graph_kinds
from gemc.sharding import dense_strategy, runner_executes
from gemc.table_lookup import (
    DENSE_GRAD,
    SPARSE,
    batched_applied,
    captured_sparse,
    lookup_paths,
    owned_by_batched,
)

NO_KERNELS_FIX = "pass --no-kernels to run the ops the kernels replace, or compile without them"


EMBEDDING_OPS = {
    torch.ops.aten.embedding_bag.padding_idx,
    torch.ops.aten.embedding_bag.default,
    torch.ops.aten._embedding_bag.default,
    torch.ops.aten.embedding.default,
}


def check_graph_mode(
    kernels: list[dict[str, Any]], *, world_size: int,
    regions: list[dict[str, Any]] | None = None,
) -> None:
    """Refuse kernels the runner cannot execute as the plan says (see the module doc)."""
    for i, entry in enumerate(kernels):
        kind = entry.get("kind") if isinstance(entry, dict) else None
        if kind not in graph_kinds():
            raise PlanError(
                f"plan kernels[{i}] ({entry.get('name', '?') if isinstance(entry, dict) else entry}) "
                f"has kind {kind!r}, which the runner cannot execute",
                where=f"plan kernels[{i}]",
                fix=f"known kinds: {', '.join(graph_kinds())}; {NO_KERNELS_FIX}",
            )
    if not kernels:
        return
    sharded = [r["name"] or "<root>" for r in regions or []
               if not runner_executes(dense_strategy(r["strategy"]), world_size=world_size,
                                      graph_mode=True)]
    if sharded:
        raise PlanError(
            f"the plan lists {len(kernels)} generated kernel(s) for {world_size} ranks, and "
            f"region(s) {', '.join(sharded[:4])} are not ddp; the captured graph never calls "
            "the module hooks through which fsdp/hsdp/tp shard parameters",
            where="plan regions / plan kernels",
            fix="plan those regions ddp (every region), or " + NO_KERNELS_FIX,
        )


def _interpreted_triton() -> None:
    """On the CPU, Triton kernels run in its interpreter, which must be chosen before Triton
    is imported (``triton.language`` decorates its helpers at import)."""
    if "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return
    import triton.language as tl

    if type(tl.cdiv).__name__ != "InterpretedFunction":
        raise PlanError(
            "the plan's kernels would run on the CPU, but Triton was imported in this process "
            "before TRITON_INTERPRET=1 was set, so its interpreter cannot run them",
            where="the environment of this process",
            fix="start Python with TRITON_INTERPRET=1, or " + NO_KERNELS_FIX,
        )


EXECUTORS = ("inductor", "interpreter")
def _erase_dead_code(gm: torch.fx.GraphModule, keep: set[str]) -> None:
    """Erase pure nodes nobody reads, except those the plan's kernels name.

    The compile's passes erase dead code they leave behind (e.g. the unused average of
    nn.MultiheadAttention's weights around a matched softmax attention, which reads an
    intermediate the kernel no longer produces); this fresh capture still has it. Nodes a
    kernel names (an embedding bag's unused tuple items) stay: the kernel replaces them."""
    for node in reversed(list(gm.graph.nodes)):
        if (node.op == "call_function" and not node.users and node.name not in keep
                and not node.is_impure()):
            gm.graph.erase_node(node)


def _lifted_values(gm: torch.fx.GraphModule, constants: Mapping[str, torch.Tensor],
                   device: torch.device, model: nn.Module | None = None,
                   fqns: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The graph's lifted tensor constants (gemc.capture.Captured.constants) by placeholder
    name, where the graph expects them: on the CPU where the capture made them there (the
    graph moves them itself, ``x.new_tensor(data)``), else (made on the inputs' device,
    meta in the capture) on ``device``. One whose value the capture could not recover is
    a named error. A plain tensor attribute of the model (``self.li = torch.tensor(...)``,
    lifted under its FQN in ``fqns``) is read from ``model``, which the runner has
    materialized with the author's values."""
    out = {}
    for name, value in constants.items():
        if value.is_meta and model is not None and (fqns or {}).get(name):
            held = _attribute(model, str((fqns or {})[name]))
            value = held if held is not None and not held.is_meta else value
        node = next((n for n in gm.graph.nodes if n.name == name), None)
        val = node.meta.get("val") if node is not None else None
        if value.is_meta:
            line = next((source_line(u) for u in (node.users if node else ())
                         if source_line(u)), None)
            raise PlanError(
                f"the graph takes a tensor the forward builds from Python data ('{name}', "
                f"{list(value.shape)}), whose values the capture on meta did not keep",
                where=line or f"graph placeholder {name}",
                fix="make it a buffer of its module (self.register_buffer(name, "
                    "torch.tensor(...), persistent=False)) and read that in forward, or "
                    + NO_KERNELS_FIX)
        on_cpu = isinstance(val, torch.Tensor) and val.device.type == "cpu"
        out[name] = value if on_cpu else value.to(device)
    return out


def _attribute(model: nn.Module, fqn: str) -> torch.Tensor | None:
    owner, _, attr = fqn.rpartition(".")
    try:
        value = getattr(model.get_submodule(owner) if owner else model, attr, None)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None


class GraphExecutor:
    """``executor(*batch) -> loss``: the captured graph with the kernels substituted.

    ``executor="inductor"`` (the default): the rewritten graph, its kernels custom ops
    (:mod:`gemc.backends.triton.ops`), is built on the first call (for the autocast dtype
    active then) and trained through ``torch.compile``: Inductor compiles everything gemc
    does not specialise, and the backward comes from the ops' autograd formulas through
    AOTAutograd. ``"interpreter"``: the old op-by-op interpreter
    (:class:`~gemc.backends.triton.graph_runner.GraphRunner`), kept as a fallback, with a
    warning that says it runs unfused. ``measured``: per kernel name, a recorded
    measurement whose ``choice`` (gemc / inductor) decides a generated group (from
    ``--kernel-choices``); ``recorded``: the plan's own choices, below those; ``measure``:
    measure every generated group against Inductor's code for it on the first call (see
    :func:`~gemc.backends.triton.inductor_graph.measure_groups`) and keep the winners
    (above both). ``sources``: where each entry's choice came from
    (:mod:`gemc.backends.torch.kernel_choices`).
    ``compile_mode``: ``torch.compile``'s mode (e.g. ``reduce-overhead`` for CUDA graphs);
    ``pointwise_autotune``: see :func:`inductor_options`.
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        param_fqns: dict[str, str],
        model: nn.Module,
        kernels: list[dict[str, Any]],
        *,
        tables: dict[str, ShardedEmbedding],
        emb_opt: EmbeddingOptimizer,
        device: torch.device,
        world_size: int = 1,
        executor: str = "inductor",
        measured: dict[str, Any] | None = None,
        compile_mode: str | None = None,
        pointwise_autotune: bool = False,
        measure: bool = False,
        recorded: dict[str, Any] | None = None,
        priced_sparse: frozenset[str] = frozenset(),
        warm: Any = None,
        varying_inputs: Collection[str] = (),
        fixed_shapes: str = "",
        constants: Mapping[str, torch.Tensor] | None = None,
        constant_fqns: Mapping[str, str] | None = None,
    ) -> None:
        # the batch inputs the compile found may change shape by step (the plan's
        # model.varying_inputs, gemc.shape_stability), and why none may where it said so
        self.varying_inputs = frozenset(varying_inputs)
        self.fixed_shapes = fixed_shapes
        if executor not in EXECUTORS:
            raise PlanError(f"graph executor {executor!r} is not known",
                            where="--graph-executor", fix=f"use one of {', '.join(EXECUTORS)}")
        self.executor = executor
        self.measured = {n: {**r, "source": "file"} for n, r in (measured or {}).items()}
        self.recorded = dict(recorded or {})
        self.compile_mode = compile_mode
        self.inductor_options = inductor_options(compile_mode, pointwise_autotune) \
            if executor == "inductor" and compile_backend(device) == "inductor" else None
        self.measure = measure and executor == "inductor"
        self.choices: dict[str, str] = {}
        self.sources: dict[str, str] = {}
        # one compiled graph per (autocast dtype, guarded regions' outcome): see __call__
        self._compiled: dict[tuple[torch.dtype | None, tuple[int | None, ...]], Any] = {}
        self._measured_for: set[torch.dtype | None] = set()
        # host seconds gemc spends before torch.compile sees a graph (the first step's
        # "running" part would otherwise hide them): building each rewritten graph, and
        # the guarded regions' mask checks
        self.host_s = {"build": 0.0, "guard_checks": 0.0}
        self.variants: list[dict[str, Any]] = []  # what each compiled graph was built for
        # per packed guarded region, the bucketed token counts its steps ran at (one graph)
        self.token_counts: dict[str, set[int]] = {}
        self.guard: Any = None  # RegionGuard of the guarded packed regions (inductor only)
        # gemc's kernels compiled ahead in worker processes (gemc.backends.triton.warm)
        self.warm = warm if executor == "inductor" else None
        self.unwarmed_ops: dict[str, int] = {}
        if executor == "inductor":
            _set_up_torch_compile(device)
        if device.type == "cpu" and kernels:  # no kernel of the plan: the ATen fallbacks do
            _interpreted_triton()
        try:
            from gemc.backends.triton.graph_runner import GraphRunner
        except ImportError as exc:
            raise PlanError(
                f"the plan's generated kernels need Triton, which does not import here: {exc}",
                where="plan kernels",
                fix=NO_KERNELS_FIX,
            ) from exc
        constants = dict(constants or {})
        for node in gm.graph.nodes:
            if node.op == "placeholder" and node.name in param_fqns:
                node.meta[ir.PARAM] = param_fqns[node.name]
            elif node.op == "placeholder" and node.name in constants:
                node.meta[ir.PARAM] = node.name  # fed like a buffer (see below)
        lifted = _lifted_values(gm, constants, device, model, constant_fqns or {})
        param_fqns = {**param_fqns, **{name: name for name in lifted}}
        # the batch's inputs as captured: (name, shape), in the batch's order
        self.input_shapes = [(n.name, tuple(n.meta["val"].shape)) for n in gm.graph.nodes
                             if n.op == "placeholder" and n.name not in param_fqns
                             and isinstance(n.meta.get("val"), torch.Tensor)]
        _erase_dead_code(gm, {n for e in kernels for n in e.get("nodes", [])})
        # small tables gathered by many ids: a backward without per-id atomics (the report's
        # ``contended_gathers``)
        self.gathers = route_contended_gathers(
            gm, tables, {n for e in kernels for n in e.get("nodes", [])})
        names = {n.name for n in gm.graph.nodes}
        for entry in kernels:
            missing = [n for n in entry.get("nodes", []) if n not in names]
            if missing:
                raise PlanError(
                    f"kernel {entry.get('name')} replaces node(s) {', '.join(missing[:4])} "
                    "that the captured graph does not have",
                    where=f"plan kernels: {entry.get('name')}",
                    fix="compile the plan again with this gemc and torch",
                )
        entries = [self._with_table_storage(self._with_optimizer(e, emb_opt.cfg), tables)
                   for e in kernels]
        # every name of a tied tensor: the graph has a placeholder for each
        params = {**dict(model.named_parameters(remove_duplicate=False)),
                  **dict(model.named_buffers(remove_duplicate=False)), **lifted}
        self.not_applied: list[str] = []
        # the rule the cost model prices by (gemc.table_lookup): one place for both
        precision = {f: m.precision for f, m in tables.items()}
        batched = [[t["fqn"] for t in e["tables"]] for e in entries
                   if e.get("kind") == "batched_embedding_bag"]
        fused = owned_by_batched(batched, precision)
        if batched and not batched_applied(fused, precision, world_size=world_size):
            low = sorted(f for f, p in precision.items() if p != "fp32" and f not in fused)
            why = (f"on {world_size} ranks: they update whole local tables in the backward, "
                   "before gradients are exchanged" if world_size > 1 else
                   f"here: table(s) {', '.join(low[:4])}{' ...' if len(low) > 4 else ''} "
                   "are stored bf16/fp8 by the plan outside a batched lookup of one "
                   "precision, and the graph's own lookups would read the stored values "
                   "as they are")
            entries = self._drop_batched(entries, why)
        # fqn -> gemc.table_lookup path, as run (the report's ``table_lookups``)
        sparse_read = {f: True for f in tables}
        lookups = dict.fromkeys(tables, 0)  # lookup ops per table (the plan's ``lookups``)
        for node in gm.graph.nodes:  # a table whose every lookup was captured sparse=True
            if node.target in EMBEDDING_OPS and isinstance(node.args[0], torch.fx.Node):
                fqn = node.args[0].meta.get(ir.PARAM)
                if fqn in sparse_read:
                    sparse_read[fqn] = sparse_read[fqn] and captured_sparse(node)
                    lookups[fqn] += 1
        self.lookup_paths = lookup_paths(precision, batched, world_size=world_size,
                                         graph_mode=True,
                                         captured_sparse={f for f, s in sparse_read.items() if s},
                                         priced_sparse=priced_sparse,
                                         shardings={f: m.sharding for f, m in tables.items()},
                                         optimizer=emb_opt.cfg.kind, lookups=lookups,
                                         not_fp32={f for f, m in tables.items()
                                                   if m.dtype != torch.float32})
        # on several ranks every table is called as its module (an eager island): its
        # owners' lookup is fused or sparse as the module's own route says
        sharded = {f: tables[f] for f, path in self.lookup_paths.items()
                   if path == SPARSE or world_size > 1}
        calls = _sharded_lookups(gm, sharded, world_size=world_size)
        for fqn in sharded:  # its lookups call the table; a rank without a shard has no weight
            params.setdefault(fqn, torch.empty(0, device=device))
        try:
            if executor == "inductor":
                from gemc.backends.triton.inductor_graph import in_join_order, runner_for
                from gemc.backends.triton.region_guard import RegionGuard

                entries = [in_join_order(gm, e) for e in entries]
                self.runner, left = runner_for(gm, entries, params, device=device, calls=calls)
                self.not_applied += left
                self.guard = RegionGuard.of(self.runner)
                if self.warm is not None and self.guard is not None:
                    self.warm.derive("the region guard's mask checks",
                                     lambda: self.guard.warm(self.runner.gm))
            else:
                warnings.warn(
                    "gemc: graph mode runs through the op-by-op interpreter "
                    "(--graph-executor interpreter): every op outside gemc's kernels runs "
                    "unfused, one launch each; the default compiles the graph with Inductor",
                    stacklevel=3)
                self.runner = GraphRunner(gm, entries, params, device=device, calls=calls)
        except ValueError as exc:  # a source whose sha256 does not match, a cycle
            raise PlanError(
                f"the plan's kernels cannot be set up: {exc}",
                where="plan kernels",
                fix="compile the plan again",
            ) from exc
        self.fused_tables: list[str] = []
        for entry in entries:
            if entry["kind"] != "batched_embedding_bag":
                continue
            module = self.runner.tables[entry["name"]]
            states = module.split_optimizer_state()
            for t, view, state, scale in zip(entry["tables"], module.split_weights(), states,
                                             module.split_row_scales()):
                owner = tables[t["fqn"]]
                owner.weight.data = view  # checkpoints read and write the fused buffer
                if scale is not None:  # fp8: the row scales move in with the values
                    scale.copy_(owner.row_scale)
                    owner.row_scale = scale
                emb_opt.adopt_fused(t["fqn"], state, module)
                self.fused_tables.append(t["fqn"])
        # the replica groups' members fed from the batch: looked up ahead of the compiled
        # graph, one lookup a group, their rows its inputs (replica_ahead)
        self.replicas_ahead: ReplicaAhead | None = ahead_lookups(
            gm, calls, emb_opt.groups, [n for n, _ in self.input_shapes]) \
            if executor == "inductor" and emb_opt.groups else None
        if self.warm is not None:  # the optimizer's masked row update of table-sized grads
            dense = [f for f, path in self.lookup_paths.items() if path == DENSE_GRAD]
            self.warm.derive("the sparse optimizer's dense-gradient tables",
                             lambda: emb_opt.warm_dense(dense))

    def _drop_batched(self, entries: list[dict[str, Any]], why: str) -> list[dict[str, Any]]:
        """The entries still applied when no batched lookup is (on several ranks, or with
        bf16 / fp8 tables outside them): every lookup then goes through the sharded tables."""
        for entry in entries:
            if entry["kind"] == "batched_embedding_bag":
                self.not_applied.append(str(entry.get("name")))
        warnings.warn(
            f"kernel(s) {', '.join(self.not_applied)} (batched embedding lookup with the "
            f"optimizer fused into its backward) not applied {why}; those lookups run "
            "through the sharded tables and the sparse optimizer instead",
            stacklevel=3,
        )
        return [e for e in entries if e["kind"] != "batched_embedding_bag"]

    @staticmethod
    def _with_optimizer(entry: dict[str, Any], cfg: EmbeddingOptimConfig) -> dict[str, Any]:
        """A batched entry runs the run's embedding optimizer, whatever the plan assumed."""
        if entry.get("kind") != "batched_embedding_bag":
            return entry
        return {
            **entry,
            "optimizer": {
                "optimizer": cfg.kind,
                "lr": cfg.lr,
                "eps": cfg.eps,
                "weight_decay": cfg.weight_decay,
            },
        }

    @staticmethod
    def _with_table_storage(entry: dict[str, Any],
                            tables: dict[str, ShardedEmbedding]) -> dict[str, Any]:
        """A batched entry's tables carry their storage precision, and the entry the seed of
        its stochastic rounding (from the run's seed, like the sharded tables')."""
        if entry.get("kind") != "batched_embedding_bag":
            return entry
        owners = [tables[t["fqn"]] for t in entry["tables"]]
        seed = derive_seed(owners[0].seed, "table-rounding", entry.get("name")) % (2**31 - 1)
        return {**entry, "rounding_seed": seed,
                "tables": [{**t, "precision": m.precision}
                           for t, m in zip(entry["tables"], owners)]}

    def _check_shapes(self, batch: tuple[torch.Tensor, ...]) -> None:
        """Refuse a batch whose shapes differ from the captured example's. The graph is
        torch.export's at the example's shapes: a size the forward reads from an input
        (``values.numel()``, ``output_size=N``, ``torch.arange(n)``) is a constant in it,
        so a batch of another shape (a jagged history whose total length varies from step
        to step) would run with the example's sizes: a crash deep in the compiled
        backward, or, where the constant only scales or slices, wrong numbers silently.
        The model's own forward (module mode) reads each batch's sizes afresh. An input
        the compile found free to vary (``varying_inputs``: its graph on another batch
        was the same up to shapes, gemc.shape_stability) passes.

        The batch's inputs are the graph's last placeholders (torch.export lifts the
        parameters and buffers ahead of the user's inputs): a graph given without every
        parameter's name still pairs each batch tensor with its own placeholder."""
        shapes = self.input_shapes[-len(batch):] if batch else []
        for (name, shape), t in zip(shapes, batch):
            if tuple(t.shape) != shape and name not in self.varying_inputs:
                raise PlanError(
                    f"batch input '{name}' is {list(t.shape)} at this step, but the plan's "
                    f"graph was captured with {list(shape)} (the example batch): the "
                    "graph's sizes are the example's, so it cannot run a batch of another "
                    "shape" + (f" ({self.fixed_shapes})" if self.fixed_shapes else ""),
                    where=f"make_batch's '{name}'",
                    fix="give every batch the example's shapes (pad a jagged input's values "
                    "to a fixed total per batch, as examples/zoo/hstu.py's synthetic data "
                    "does), or " + NO_KERNELS_FIX,
                )

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        """One step's loss. With guarded packed regions, their masks are checked on the
        batch first (one host read for all of them, :mod:`~gemc.backends.triton.region_guard`)
        and the graph compiled for that outcome runs: each region packed (at its bucketed
        token count, a dynamic size of the graph's inputs) or padded; a new outcome compiles
        a new graph (at most two per region: packed and padded); of the packed one, a
        second count recompiles it once with the count a dynamic size (see
        ``inductor_graph.token_count_input``), later counts do not."""
        self._check_shapes(batch)
        if self.executor == "interpreter":
            return self.runner(*batch)
        dev = self.runner.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        t0 = time.perf_counter()
        decision = self.guard.check(batch) if self.guard is not None else None
        t1 = time.perf_counter()
        self.host_s["guard_checks"] += t1 - t0
        key = decision.key if decision is not None else ()
        # one graph per outcome (which regions pack, each attention's outcome), not per
        # token count: the counts are sizes of the graph's inputs (token_count_input)
        outcome = tuple(PACKED if isinstance(k, int) else k for k in key)
        # the replica lookups made ahead of the graph this step (replica_ahead): their rows
        # are inputs of the graph, after the leading ones and before the batch
        ahead = self.replicas_ahead.now(batch) if self.replicas_ahead is not None else ()
        fn = self._compiled.get((dt, outcome, ahead))
        if fn is None:
            fn = self._compiled[(dt, outcome, ahead)] = self._compile(dt, key, ahead)
            self.host_s["build"] += time.perf_counter() - t1
        if ahead:
            assert self.replicas_ahead is not None
            batch = (*self.replicas_ahead.rows(batch, ahead), *batch)
        if decision is None:
            return fn(*batch)
        from gemc.backends.triton.inductor_graph import token_count_input

        packed = [(n, k) for n, k in zip(self.guard.names, key) if isinstance(k, int)]
        for name, total in packed:
            self.token_counts.setdefault(name, set()).add(total)
        return fn(*decision.offsets,
                  *(token_count_input(total, self.runner.device) for _, total in packed), *batch)

    def set_fp8_recipes(self, recipes: Mapping[str, Any], nodes: Mapping[str, str]) -> None:
        """Run fp8 sites with new recipes from the next call (the fp8 audit's switch of a
        GEMM to bf16): their nodes (``nodes``: node name -> site, from
        :func:`~gemc.backends.torch.graph_fp8.apply_fp8_sites`) are re-targeted, and every
        compiled graph is dropped, since each holds the old recipe as a constant (a
        compiled graph is a new module, so Dynamo traces it afresh; ``compiled_variants``
        in the report counts the rebuild). The interpreter reads the nodes as they are."""
        from gemc.backends.torch.graph_fp8 import retarget_fp8_sites

        if retarget_fp8_sites(self.runner.gm, nodes, recipes, self.runner.device):
            self._compiled.clear()

    def _compile(self, dt: torch.dtype | None, key: tuple[int | None, ...],
                 ahead: tuple[str, ...] = ()) -> Any:
        """The rewritten graph for autocast ``dt``, the guarded regions' outcome ``key``
        and the replica lookups made ahead of it (``ahead``: node names, their rows its
        inputs), through ``torch.compile`` (lazily: it compiles on its first call)."""
        from gemc.backends.triton.inductor_graph import build, measure_groups

        if self.measure and dt not in self._measured_for:  # the first step pays it
            self._measured_for.add(dt)
            self.measured.update({n: {**r, "source": "measured"} for n, r in
                                  measure_groups(self.runner, autocast=dt).items()})
        guards = self.guard.guards(key) if self.guard is not None else {}
        attention_guards = self.guard.attention_guards(key) if self.guard is not None else {}
        built = build(self.runner, autocast=dt, measured={**self.recorded, **self.measured},
                      guards=guards, attention_guards=attention_guards, ahead=ahead)
        self.choices, self.sources = built.choices, built.sources
        self.module = built.module
        self.variants.append({"autocast": str(dt).removeprefix("torch.") if dt else None,
                              "packed_regions": guards,
                              **({"checked_attentions": attention_guards}
                                 if attention_guards else {})})
        backend = compile_backend(self.runner.device)
        if self.warm is not None:
            return torch.compile(built.module, dynamic=None,
                                 backend=_WarmingBackend(backend, self.compile_mode, self,
                                                         self.inductor_options))
        if self.inductor_options is not None:  # mode's options are in it: torch takes one
            return torch.compile(built.module, dynamic=None, backend=backend,
                                 options=self.inductor_options)
        return torch.compile(built.module, dynamic=None, mode=self.compile_mode,
                             backend=backend)


class _WarmingBackend:
    """``torch.compile``'s backend (``name``, with ``mode``) that first hands each graph
    Dynamo captured to the warm-up: its gemc op nodes and their fake values say which of
    gemc's kernels the step will launch (``ops.warm_graph``), and the workers compile them
    while Inductor compiles the graph. A failure there is the warm-up's warning, never the
    compile's."""

    def __init__(self, name: str, mode: str | None, executor: GraphExecutor,
                 options: dict[str, Any] | None = None) -> None:
        self.executor = executor
        self.__name__ = name  # the compiler's name in Dynamo's logs and guards
        if name == "inductor":
            self.inner: Any = torch._TorchCompileInductorWrapper(
                None if options is not None else mode, options, None)
        else:
            from torch._dynamo.backends.registry import lookup_backend

            self.inner = lookup_backend(name)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        from gemc.backends.triton.ops import warm_graph

        try:
            for name, n in warm_graph(gm, self.executor.warm).items():
                self.executor.unwarmed_ops[name] = self.executor.unwarmed_ops.get(name, 0) + n
        except Exception as exc:  # noqa: BLE001 - the warm-up must not break the compile
            warnings.warn(f"gemc warm-up: reading the compiled graph's gemc ops failed "
                          f"({type(exc).__name__}: {exc}); their kernels compile at their "
                          "first launch", stacklevel=2)
        return self.inner(gm, example_inputs, **kwargs)

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()


POINTWISE_AUTOTUNE = "triton.autotune_pointwise"


def inductor_options(mode: str | None, pointwise_autotune: bool) -> dict[str, Any] | None:
    """Inductor's options for gemc's graph (``mode``'s own, then gemc's); None: its defaults.

    Why pointwise autotuning is off: Inductor gives each 1-D pointwise kernel two configs
    and times both at its first launch. gemc's graph holds more pointwise kernels than
    torch.compile's (the dense-gradient tables' lookups and their table-sized backward,
    the packed regions' gathers: MMoE h200, 77 against 16 on the H200 at 9f27354), and the
    timing was most of the runtime autotuning on its cold first step (MMoE 76 timed kernels,
    2.7 s; DLRM 45, 1.6 s), which issue 16 holds to 1.5x torch.compile's. The configs
    (torch's ``triton_heuristics.pointwise``) differ in block size and warps over a
    memory-bound loop; with it off Inductor launches the first (its default block, 256
    elements a warp). Step time measured equal either way on MMoE and DLRM (BENCHMARKS.md,
    fifteenth session). ``--pointwise-autotune`` restores Inductor's default."""
    from torch._inductor import list_mode_options

    if pointwise_autotune:
        return None if mode is None else dict(list_mode_options(mode))
    return {**(list_mode_options(mode) if mode else {}),
            POINTWISE_AUTOTUNE: False}


def _set_up_torch_compile(device: torch.device) -> None:
    """What ``torch.compile(model)`` does when a user calls it at set-up: import Dynamo and
    the backend, and (Inductor) start its compile-worker pool.

    Why here: gemc calls ``torch.compile`` only once the first batch has decided which
    graph to build (the guarded regions' outcome, the autocast dtype), so that work landed
    in gemc's first step (``graph_executor.host_s.build``: 2.04 s of DLRM's first step on
    the H200, 0.04 s on the CPU where it was already imported) while torch.compile's users,
    the baseline included, pay it at set-up. The same work, at the same point of a run."""
    torch.compile(nn.Identity(), dynamic=False, backend=compile_backend(device))


PACKED = "packed"
"""A packed guarded region in a compiled graph's outcome key (its token count is an input's
size, not part of the key)."""

CPU_BACKEND_ENV = "GEMC_CPU_COMPILE_BACKEND"


def compile_backend(device: torch.device) -> str:
    """Inductor on a GPU. On the CPU the graph runs to be checked, not timed (its kernels
    run in Triton's interpreter), and Inductor's C++ compile of a whole training graph costs
    minutes on a small machine: AOTAutograd alone (``aot_eager``) traces the same graph,
    custom ops and backward, so CPU tests check the same graph in seconds.
    ``GEMC_CPU_COMPILE_BACKEND=inductor`` compiles it for real."""
    if device.type != "cpu":
        return "inductor"
    return os.environ.get(CPU_BACKEND_ENV, "aot_eager")


def _sharded_lookups(gm: torch.fx.GraphModule, tables: dict[str, ShardedEmbedding], *,
                     world_size: int) -> dict[str, Any]:
    """By node name, the sharded table module that answers each lookup of ``tables``.

    Every table outside an applied batched kernel is looked up this way (gemc.table_lookup's
    ``SPARSE`` path): ``F.embedding_bag`` / ``F.embedding`` with ``sparse=True``, a sparse
    gradient of the looked-up rows, the sparse optimizer's row update. The graph's own op
    (captured ``sparse=False``) zero-fills a table-sized gradient every step and makes the
    optimizer read it (DIN h200: 18 tables, most of a 39 ms step): ``DENSE_GRAD``, where
    the plan prices it cheaper.

    A node that reads a table other than as its module's lookup (a tied output projection,
    an L2 penalty on the table, a functional lookup of another form) cannot be routed: a
    table sharded over several ranks has only its shard here, and a bf16 / fp8 table is
    stored narrow, so that is an error; where the rank holds the whole fp32 table (one
    rank, or a data_parallel replica: gemc places such tables so), its weight is the
    graph's parameter, so the node runs as captured on it, as in module mode, with a
    warning (its gradient is table-sized)."""
    calls: dict[str, Any] = {}
    for node in gm.graph.nodes:
        fqn = node.meta.get(ir.PARAM) if node.op == "placeholder" else None
        if fqn not in tables:
            continue
        table = tables[fqn]
        for user in node.users:
            other = _captured_form_differs(table, user, node)
            if other is None:
                calls[user.name] = lookup_call(table, user.target, world_size)
                continue
            if (world_size > 1 and not table.replicated) or table.precision != "fp32":
                raise PlanError(
                    f"the captured graph reads table '{fqn}' in node {user.name} "
                    f"({user.target}) {other}; "
                    + ("on several ranks a table is sharded" if world_size > 1 else
                       f"the table is stored {table.precision}")
                    + " and only its module's lookup can run",
                    where=f"plan kernels / table {fqn}",
                    fix=NO_KERNELS_FIX,
                )
            warnings.warn(
                f"gemc: node {user.name} ({user.target}) reads table '{fqn}' {other}: it "
                "runs as captured on the whole table, and its gradient is table-sized "
                "(dense); the table's own lookups still run sparse", stacklevel=4)
    return calls


# the lookup ops' arguments a sharded table answers from its own module (ATen's defaults)
_BAG_MODES = {"sum": 0, "mean": 1, "max": 2}


def _captured_form_differs(table: ShardedEmbedding, user: torch.fx.Node,
                           weight: torch.fx.Node) -> str | None:
    """None when ``user`` is a lookup the table's module would make (the same op family,
    pooling, ``include_last_offset`` and padding row, the weight as its weight); else what
    differs, in words. ``sparse`` is not compared: the sharded lookup is always sparse."""
    if user.target not in EMBEDDING_OPS or user.args[0] is not weight:
        return "other than through its lookup"
    args = _arguments(user)
    if args.get("scale_grad_by_freq"):
        return "with scale_grad_by_freq"
    if args.get("max_norm") is not None:
        return "with max_norm"
    pad = args.get("padding_idx")
    pad = None if pad is None or pad < 0 else int(pad)
    want = table.padding_idx
    want = None if want is None or want < 0 else int(want)
    is_bag = user.target is not torch.ops.aten.embedding.default
    if is_bag != table.is_bag:
        return "as an " + ("embedding_bag" if is_bag else "embedding") + " lookup"
    if pad != want:
        return f"with padding_idx {pad} (its module's: {want})"
    if not is_bag:
        return None
    mode = args.get("mode", 0)
    if mode != _BAG_MODES.get(table.mode):
        return f"with pooling mode {mode} (its module's: {table.mode})"
    if bool(args.get("include_last_offset")) != bool(table.include_last_offset):
        return "with another include_last_offset than its module's"
    return None


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    """A call node's arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def lookup_call(table: ShardedEmbedding, op: Any, world_size: int = 1) -> Any:
    """A lookup node's ATen signature answered by the sharded table (its own mode,
    ``include_last_offset`` and ``padding_idx``, which :func:`_captured_form_differs` found
    equal to the node's).

    A table whose lookups stay on this rank (one rank, or a replicated table) is looked
    up through ``gemc::table_lookup``, which the compiled graph traces (marked
    ``in_graph``); a sharded table on several ranks is called as the module itself, an
    eager island (the exchange's collectives and their host-side bookkeeping).

    ``padded_ids_why`` (read by the runners for a lookup a packed token region lists in its
    ``lookups``): None where the call takes ids of any shape, so the region's gathered ids
    (one rank: a local lookup); else why not (on several ranks a table may be looked up
    ahead of the forward from the batch's own id tensors, ``table_prefetch`` /
    ``replica_groups``, its exchange run in step on every rank: gathered ids, a new tensor
    of a per-rank size, would be refused there or break that step)."""
    lookup: Any = table
    if table.local_only:
        from gemc.backends.triton.ops import register_lookup

        register_lookup(table.fqn, table)
        anchor = torch.zeros((), device=_device_of(table), requires_grad=True)

        def lookup(indices: torch.Tensor, offsets: torch.Tensor | None = None,
                   per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
            return torch.ops.gemc.table_lookup(table.fqn, indices, offsets,
                                               per_sample_weights, anchor)

    if op is torch.ops.aten.embedding.default:
        def embedding(weight: Any, indices: torch.Tensor, *rest: Any, **named: Any
                      ) -> torch.Tensor:
            return lookup(indices)

        embedding.in_graph = table.local_only  # type: ignore[attr-defined]
        embedding.padded_ids_why = None if world_size == 1 else (  # type: ignore[attr-defined]
            f"on {world_size} ranks the table's lookup may be prefetched ahead of the forward "
            "from the batch's own id tensors, in step on every rank, so it cannot take the "
            "region's gathered ids")
        return embedding

    def embedding_bag(weight: Any, indices: torch.Tensor, offsets: torch.Tensor,
                      scale_grad_by_freq: bool = False, mode: int = 0, sparse: bool = False,
                      per_sample_weights: torch.Tensor | None = None,
                      include_last_offset: bool = False, *rest: Any, **named: Any) -> tuple:
        out = lookup(indices, offsets, per_sample_weights)
        return (out, None, None, None)  # the graph reads [0]; the rest feed eager's backward

    embedding_bag.in_graph = table.local_only  # type: ignore[attr-defined]
    return embedding_bag


def _device_of(table: ShardedEmbedding) -> torch.device:
    weight = table.weight
    return weight.device if weight is not None else torch.device("cpu")
