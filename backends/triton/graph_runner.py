"""Run a compiled graph with the plan's kernels in place, forward and backward.

Until the distributed runner substitutes kernels itself, this is how a test (or a person)
checks that the kernels a plan lists compute what the model computes: take the exported
``GraphModule`` the compiler annotated, real weights (e.g. from the ModelSpec built on
CPU), and the plan's kernel entries; :class:`GraphRunner` interprets the graph eagerly,
running

* each fused group as one call of its generated autograd function (from the entry's
  source, checked against its sha256, or regenerated from its structure),
* each ``jagged_attention`` entry as ``padded_to_jagged`` -> ``jagged_attention`` ->
  ``jagged_to_padded`` over the lengths the model's mask uses,
* each ``key_padding_attention`` entry as one call of
  :func:`.key_padding_attention.key_padding_attention` (it checks at run time that the mask
  is a prefix, and falls back to the padded attention when it is not); each
  ``jagged_silu_attention`` entry (HSTU's formula, all its nodes) likewise, as one call of
  :func:`.key_padding_attention.key_padding_silu_attention`; each
  ``jagged_query_attention`` entry (padded history queries over dense keys) as the custom
  op over the real query rows (these three guarded attentions' calls are their kind's
  ``run``, in ``kinds/attention.py``); a silu attention inside a packed token region runs
  on the region's tokens in place,
* a row lookup a packed region lists (its ``lookups``: ``aten.embedding`` of a padded
  ``[B, L]`` id grid the region starts at) on a packed call as the same lookup of the ids
  gathered to the region's layout (its tokens' rows only; the padded call looks up all of
  them, as the model does),
* each ``batched_embedding_bag`` entry as one :class:`BatchedEmbeddingBag` lookup whose
  backward updates the tables in place (the optimizer is fused: no table gradient exists),

and every other node as its ATen op. Groups are placed in a topological order of the
condensed graph, so a group whose nodes were interleaved with others in the capture still
sees all its inputs. The runner needs only the graph and the entries, nothing of the
compiler's state.

Under autocast (dtype D on the inputs' device), a fused group's output whose only uses are
as the input ``x`` of GEMMs (a ``gemm_epilogue`` group's linear, or a plain
``aten.linear``) is written directly in D: those GEMMs cast it to D anyway, so this is the
rounding eager autocast does, minus a pass over memory (e.g. a LayerNorm's fp32 output
under CUDA autocast, read back and written in bf16 by the cast). The gradient reaching the
group is then D, as eager's is before the cast's backward widens it; the group's inputs'
gradients still come back in their own dtypes. An output with any other use (a residual
operand, a view, the graph's output) keeps eager's dtype.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from gemc import ir
from gemc.guard_sample import (
    guard_inputs,
    mask_rows,
    padding_reps,
    reader_positions,
    source_reps,
)

from . import kinds as registry
from . import packed_tokens as packed
from .codegen import generated
from .codegen.host import make_runner
from .codegen.spec import sha256
from .packed_tokens import TokenLayout
from .runtime import host_values

__all__ = ["GraphRunner"]


def gemm_operand_in_epilogue(structure: dict[str, Any]) -> bool:
    """Whether a GEMM group's epilogue reads one of its GEMM's own operands."""
    if structure["kind"] != "gemm_epilogue":
        return False
    operands = {ref[1] for ref in structure["ops"][0]["args"] if ref is not None}
    return any(slot["input"] in operands for slot in structure["slots"])


def _autocast_dtype(inputs: Sequence[Any]) -> torch.dtype | None:
    """The autocast dtype active on the inputs' device, or None."""
    dev = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), None)
    if dev is None or not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


_SKIP = {torch.ops.aten._assert_tensor_metadata.default}
_LINEAR = torch.ops.aten.linear.default


def _rank(node: fx.Node) -> int:
    """The rank of a node's captured (padded) value; a tuple node: its first element's."""
    return len(ir.shape_of(node) or ())


def on_run_device(args: Any, kwargs: dict[str, Any], device: torch.device
                  ) -> tuple[Any, dict[str, Any]]:
    """A node's arguments with the capture's device replaced by the run's: the graph was
    captured on meta, so a ``device=`` keyword (``torch.arange(n, device=x.device)``) or a
    positional meta device (``x.new_tensor(data)``'s ``aten.to.device(t, meta)``) means
    where the inputs are."""
    args = tuple(device if isinstance(a, torch.device) and a.type == "meta" else a
                 for a in args)
    if "device" in kwargs:
        kwargs = {**kwargs, "device": device}
    return args, kwargs


def _param_fqn(node: fx.Node) -> str | None:
    return node.meta.get("gemc.param")



class GraphRunner:
    """``runner(*inputs) -> loss`` of ``gm`` with ``entries`` substituted.

    ``params``: tensors by FQN for the graph's parameter and buffer placeholders (pass the
    model's own parameters to have gradients land on them). ``kinds``: restrict which
    entry kinds are substituted (the rest run as the ATen ops they replace).
    ``narrow``: under autocast, write outputs only GEMMs read in the autocast dtype (see
    the module doc); False keeps eager's dtypes everywhere. ``release``: drop each value
    from the environment after its last reader (False keeps all until the loss returns);
    ``peak_live`` records the most values held at once in the last call. ``calls``: by node
    name, a callable given the node's evaluated arguments that computes it instead of its
    op (the runner's sharded embedding lookups on several ranks).
    """

    def __init__(self, gm: fx.GraphModule, entries: Sequence[dict[str, Any]],
                 params: Mapping[str, torch.Tensor], *, device: torch.device | str = "cpu",
                 kinds: Sequence[str] | None = None, narrow: bool = True,
                 release: bool = True,
                 calls: Mapping[str, Callable[..., Any]] | None = None) -> None:
        self.gm = gm
        self.calls = dict(calls or {})  # node name -> what computes it instead of its op
        self.release = release  # drop each value after its last reader (see _last_reads)
        self.device = torch.device(device)
        self.params = params
        self.nodes = list(gm.graph.nodes)
        self.entries = [e for e in entries if kinds is None or e["kind"] in kinds]
        sources = {e["sha256"]: e["code"] for e in entries if e.get("code") is not None}
        self.by_name = by_name = {n.name: n for n in self.nodes}
        self.unit_of: dict[fx.Node, int] = {}
        self.units: list[dict[str, Any]] = []
        self.tables: dict[str, Any] = {}  # entry name -> BatchedEmbeddingBag
        layouts = registry.layouts()
        for layout in layouts:
            layout.layout_setup(self, [e for e in self.entries if e["kind"] == layout.kind.name])
        for entry in self.entries:
            if entry["kind"] in {layout.kind.name for layout in layouts}:
                continue
            runtime = registry.unit(entry["kind"])
            if runtime is None:
                raise ValueError(f"unknown kernel kind {entry['kind']!r}")
            index = len(self.units)
            unit = {"entry": entry, "nodes": [by_name[n] for n in entry["nodes"]]}
            # runs packed (a guarded region's units: when its check passes, per call)
            unit["packed"] = all(n in self.packed for n in unit["nodes"])
            unit["guarded"] = next((self.region_of[n] for n in unit["nodes"]
                                    if n in self.guarded_nodes), None)
            if runtime.setup is not None:
                runtime.setup(self, unit, sources)
            self.units.append(unit)
            for n in unit["nodes"]:
                self.unit_of[n] = index
        for unit in self.units:  # needs every unit known: the uses may be later groups
            if "run" in unit:
                unit["narrow"] = [narrow and self._only_gemm_input(by_name[name])
                                  for name in unit["entry"]["binding"]["outputs"]]
        self.order = self._schedule()
        self.free_after = self._last_reads()

    # -- setup ------------------------------------------------------------------------------

    def _setup_packed(self, regions: list[dict[str, Any]]) -> None:
        """Region node -> (batch dim, sequence dim) and its region's facts; the region's
        ``zeros`` node is never computed when the packed source is its only reader."""
        self.packed: dict[fx.Node, tuple[int, int]] = {}
        self.region_of: dict[fx.Node, dict[str, Any]] = {}
        self.packed_sources: dict[fx.Node, dict[str, Any]] = {}
        self.skipped: set[fx.Node] = set()
        # regions guarded by a run-time mask check: packed only on a call whose mask is a
        # prefix on every row (decided before the region's first node runs), else padded
        self.guarded_nodes: dict[fx.Node, tuple[int, int]] = {}
        # gathers at a region's jagged positions, read from its tokens (the pass's exits)
        self.exits: dict[fx.Node, dict[str, Any]] = {}
        # readers of one token per row of a region (its ``reads``: a guarded region's
        # checked with its mask, an offset-proven region's proven): on a packed call, read
        # from the tokens
        self.row_reads: dict[fx.Node, dict[str, Any]] = {}
        # reductions over the token axis of a region with padding representatives: on a
        # packed call, weighted by the layout's weights (``packed_tokens.weighted_reduce``)
        self.weighted: dict[fx.Node, dict[str, Any]] = {}
        # row lookups that look up the region's tokens' ids only on a packed call (the
        # region's ``lookups``, gemc.packed_rules.gathered_lookup): lookup -> its ids
        self.gathered: dict[fx.Node, fx.Node] = {}
        for region in regions:
            guarded = region.get("guard") is not None
            for name in region.get("lookups") or ():
                node = self.by_name[name]
                why = self._padded_ids_why(node)
                if why is None:
                    self.gathered[node] = node.args[1]
                    continue
                fqn = _param_fqn(node.args[0]) if isinstance(node.args[0], fx.Node) else None
                warnings.warn(
                    f"gemc: packed region {region['name']}: the lookup {name} of table "
                    f"'{fqn or node.args[0]}' keeps looking up every padded id and gathering "
                    f"the rows (the padding's rows and gradient scatter stay): {why}",
                    stacklevel=3)
            for spec in region.get("weighted") or ():
                self.weighted[self.by_name[spec["node"]]] = spec
            for name, dims in region["dims"].items():
                node = self.by_name[name]
                (self.guarded_nodes if guarded else self.packed)[node] = (int(dims[0]),
                                                                          int(dims[1]))
                self.region_of[node] = region
            for spec in region.get("reads") or ():
                self.row_reads[self.by_name[spec["reader"]]] = spec
            if guarded:
                continue
            for name in region.get("exits", ()):
                self.exits[self.by_name[name]] = region
            for facts in region.get("sources") or [region]:  # HSTU's q, k, v: three
                src = self.by_name[facts["padded_from"]]
                self.packed_sources[src] = {**region, **facts}
                zeros = self.by_name.get(facts.get("zeros") or "")
                if zeros is not None and list(zeros.users) == [src]:
                    self.skipped.add(zeros)

    def _padded_ids_why(self, node: fx.Node) -> str | None:
        """Why lookup ``node`` cannot take its region's gathered ids, or None. The graph's
        own op takes any id shape; a lookup answered by a table module (``calls``) only
        where that call says so (``padded_ids_why`` None: one rank's local lookup), since
        a sharded table on several ranks is prefetched ahead of the forward from the
        batch's own id tensors, its exchange run in step on every rank."""
        call = self.calls.get(node.name)
        if call is None:
            return None
        if not hasattr(call, "padded_ids_why"):
            return ("its lookup is answered by a callable that does not declare that it "
                    "takes ids of another shape (padded_ids_why)")
        return call.padded_ids_why

    @staticmethod
    def _source(entry: dict[str, Any], sources: dict[str, str]) -> str:
        code = sources.get(entry["sha256"])
        if code is None:  # not embedded: regenerate it from the structure
            code, _ = generated(entry["structure"])
        if sha256(code) != entry["sha256"]:
            raise ValueError(f"kernel {entry['name']}: source does not match its sha256")
        return code

    def _embedding_module(self, entry: dict[str, Any]) -> Any:
        from .embedding_bag import BatchedEmbeddingBag

        opt = entry["optimizer"]
        precisions = {t.get("precision", "fp32") for t in entry["tables"]}
        if len(precisions) != 1:
            raise ValueError(f"kernel {entry['name']}: its tables are stored at different "
                             f"precisions {sorted(precisions)}; one batched lookup has one")
        # the stored values (bf16 / fp8 bits) are copied as they are; fp8's row scales are
        # the caller's to hand over (split_row_scales)
        module = BatchedEmbeddingBag(
            [(t["rows"], t["dim"]) for t in entry["tables"]], pooling="sum",
            optimizer=opt["optimizer"], lr=opt["lr"], eps=opt["eps"],
            weight_decay=opt["weight_decay"], device=self.device,
            precision=precisions.pop(), seed=int(entry.get("rounding_seed", 0)))
        with torch.no_grad():
            for dst, table in zip(module.split_weights(), entry["tables"]):
                dst.copy_(self.params[table["fqn"]].detach())
        return module

    def _only_gemm_input(self, node: fx.Node) -> bool:
        """Whether every use of ``node`` is as a GEMM's input ``x`` and nothing else there
        (not its weight or bias, not an epilogue operand of its group)."""
        if not node.users:
            return False
        for user in node.users:
            if user in self.unit_of:
                entry = self.units[self.unit_of[user]]["entry"]
                if entry["kind"] != "gemm_epilogue" or "structure" not in entry:
                    return False
                st = entry["structure"]
                linear = st["ops"][0]
                if linear["op"] != "linear":
                    return False
                ix = linear["args"][0][1]
                if [i for i, n in enumerate(entry["binding"]["inputs"]) if n == node.name] \
                        != [ix]:
                    return False
                refs = [ref for op in st["ops"] for ref in op["args"]
                        if ref is not None and list(ref) == ["i", ix]]
                if len(refs) != 1 or any(slot["input"] == ix for slot in st["slots"]):
                    return False
            elif user.op == "call_function" and user.target is _LINEAR:
                if user.args[0] is not node or node in (*user.args[1:], *user.kwargs.values()):
                    return False
            else:
                return False
        return True

    def _schedule(self) -> list[Any]:
        """Nodes and units in a topological order of the condensed graph (stable)."""
        position = {n: i for i, n in enumerate(self.nodes)}
        key_of = {n: ("u", self.unit_of[n]) if n in self.unit_of else ("n", n)
                  for n in self.nodes}
        members: dict[Any, list[fx.Node]] = {}
        for n in self.nodes:
            members.setdefault(key_of[n], []).append(n)
        deps: dict[Any, set[Any]] = {k: set() for k in members}
        for key, nodes in members.items():
            for n in nodes:
                reads = list(n.all_input_nodes) + self._extra_reads(n)
                for a in reads:
                    if key_of[a] != key:
                        deps[key].add(key_of[a])
        done: set[Any] = set()
        order: list[Any] = []
        pending = sorted(members, key=lambda k: position[members[k][0]])
        while pending:
            for i, key in enumerate(pending):
                if deps[key] <= done:
                    order.append(key)
                    done.add(key)
                    del pending[i]
                    break
            else:
                raise ValueError("kernel groups form a cycle in the graph")
        return order

    def _extra_reads(self, node: fx.Node) -> list[fx.Node]:
        """What ``node``'s step reads beyond its arguments: a guarded region's check (its
        mask and its one-token readers' positions, before the region's first node), and a
        one-token reader's positions (it reads them, not the expanded index, from the
        tokens)."""
        out = []
        if node in self.guarded_nodes:
            out += [self.by_name[n] for n in guard_inputs(self.region_of[node])]
        spec = self.row_reads.get(node)
        if spec is not None and spec.get("index"):
            out.append(self.by_name[spec["index"]])
        return out

    def _reads(self, key: Any) -> set[fx.Node]:
        """Nodes whose values the step at ``key`` reads from the environment."""
        if key[0] == "n":
            reads = set(key[1].all_input_nodes) | set(self._extra_reads(key[1]))
            region = self.packed_sources.get(key[1])
            if region is not None:  # the region's layout is built here, from the offsets
                reads.add(self.by_name[region["offsets"]])
            return reads
        unit = self.units[key[1]]
        members = set(unit["nodes"])
        reads = {a for n in members for a in n.all_input_nodes if a not in members}
        if unit.get("guarded") is not None:
            reads |= {self.by_name[n] for n in guard_inputs(unit["guarded"])}
        entry = unit["entry"]
        names = registry.unit(entry["kind"]).reads(entry)
        return reads | {self.by_name[name] for name in names}

    def _last_reads(self) -> list[list[fx.Node]]:
        """Per step, the nodes whose last reader it is: their values leave the environment
        after it. Why: the environment would otherwise hold every intermediate of the
        forward until the loss returns, on top of what autograd saves; values autograd
        needs stay alive through autograd's own references."""
        last: dict[fx.Node, int] = {}
        for i, key in enumerate(self.order):
            produced = [key[1]] if key[0] == "n" else self.units[key[1]]["nodes"]
            for n in produced:
                last.setdefault(n, i)
            for n in self._reads(key):
                last[n] = max(last.get(n, i), i)
        free: list[list[fx.Node]] = [[] for _ in self.order]
        for n, i in last.items():
            free[i].append(n)
        return free

    # -- execution --------------------------------------------------------------------------

    def __call__(self, *inputs: torch.Tensor) -> Any:
        env: dict[fx.Node, Any] = {}
        # token layouts by (offsets, clamp, max_len): the attention layers and the packed
        # region of one forward share one, so the host reads the total length (a sync)
        # once, not once per layer
        self._layouts: dict[tuple[str, int, int, str | None], TokenLayout] = {}
        self._unpacked: dict[fx.Node, torch.Tensor] = {}  # region values read outside it
        self._guards: dict[str, bool] = {}  # guarded region -> packed on this call
        for node in self.guarded_nodes:
            self.packed.pop(node, None)
        user = iter(inputs)
        self.peak_live = 0
        for i, key in enumerate(self.order):
            if i and self.release:
                for n in self.free_after[i - 1]:
                    env.pop(n, None)
                    self._unpacked.pop(n, None)
            self.peak_live = max(self.peak_live, len(env))
            if key[0] == "u":
                unit = self.units[key[1]]
                if unit["guarded"] is not None:
                    self._guard(unit["guarded"], env)
                    unit["packed"] = all(n in self.packed for n in unit["nodes"])
                self._run_unit(unit, env)
                continue
            node = key[1]
            if node in self.guarded_nodes:
                self._guard(self.region_of[node], env)
            if node.op == "placeholder":
                fqn = _param_fqn(node)
                env[node] = self.params[fqn] if fqn is not None else next(user)
            elif node.op == "output":
                result = fx.node.map_arg(node.args[0], env.__getitem__)
                return result[0] if isinstance(result, (list, tuple)) and len(result) == 1 \
                    else result
            elif node.op == "call_function":
                env[node] = None if node.target in _SKIP or node in self.skipped \
                    else self._compute(node, env)
            else:
                raise ValueError(f"cannot run node {node.name} ({node.op})")
        raise ValueError("graph has no output")

    def _call(self, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        """The node's ATen op on padded values (a region input is scattered back; a sum
        over positions of a region value adds up its tokens instead)."""
        summed = self._segment_sum(node, env)
        if summed is not None:
            return summed
        def padded(n: fx.Node) -> Any:
            value = self._padded(n, env)
            # a random op draws in its input's memory order: eager's layout (see in_eager_order)
            return packed.in_eager_order(value, ir.stride_of(n)) \
                if n in self.packed and packed.draws(node) else value

        args = fx.node.map_arg(node.args, padded)
        kwargs = fx.node.map_arg(node.kwargs, padded)
        args, kwargs = on_run_device(args, kwargs, self.device)
        return node.target(*args, **kwargs)

    def _segment_sum(self, node: fx.Node, env: dict[fx.Node, Any]) -> torch.Tensor | None:
        if node.target is not torch.ops.aten.sum.dim_IntList or node.kwargs:
            return None
        src = node.args[0]
        if not (isinstance(src, fx.Node) and src in self.packed):
            return None
        rank = _rank(src)
        reduced = [int(d) % rank for d in node.args[1]]
        keep = len(node.args) > 2 and node.args[2]
        if reduced != [self.packed[src][1]] or keep:
            return None
        return packed.segment_sum(env[src], self.packed[src], self._region_layout(src, env))

    def _compute(self, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        if node in self.exits and node.args[0] in self.packed:
            x, (row, col) = node.args[0], node.args[1]
            return packed.exit_tokens(env[x], self.packed[x], self._region_layout(x, env),
                                      env[row], env[col])
        if node in self.weighted and node.args[0] in self.packed:  # a packed call
            x, spec = node.args[0], self.weighted[node]
            return packed.weighted_reduce(env[x], self.packed[x], self._region_layout(x, env),
                                          spec["op"], spec["dims"], bool(spec["keepdim"]),
                                          float(spec["correction"]))
        if node in self.row_reads and node.args[0] in self.packed:  # a packed call
            x, spec = node.args[0], self.row_reads[node]
            layout = self._region_layout(x, env)
            (pos,) = reader_positions([spec], {n.name: env[n] for n in self._extra_reads(node)},
                                      layout.batch, layout.max_len, self.device)
            return packed.read_rows(env[x], self.packed[x], layout, pos, bool(spec["keepdim"]))
        if node in self.gathered and node in self.packed:  # a packed call: its tokens' ids
            return self._lookup_tokens(node, env)
        call = self.calls.get(node.name)
        if call is not None:  # e.g. a table lookup answered by its table module: padded out
            out = call(*fx.node.map_arg(node.args, lambda n: self._padded(n, env)),
                       **fx.node.map_arg(node.kwargs, lambda n: self._padded(n, env)))
            if node in self.packed:  # inside a packed region: its tokens
                out = packed.gather(out, self.packed[node], _rank(node),
                                    self._region_layout(node, env))
            return out
        return self._call_packed(node, env) if node in self.packed else self._call(node, env)

    # -- packed token regions -----------------------------------------------------------------

    def _lookup_tokens(self, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        """A region's row lookup on a packed call: its ids gathered to the region's layout
        (``[1, T]`` for ``[B, L]`` ids), then the lookup (the graph's op, or the table
        module answering it) of those only; its output is the region value, ``[1, T, d]``."""
        ids = self.gathered[node]
        tokens = packed.gather(env[ids], self.packed[node], _rank(ids),
                               self._region_layout(node, env))
        weight = fx.node.map_arg(node.args[0], lambda n: self._padded(n, env))
        args = [weight, tokens, *node.args[2:]]
        call = self.calls.get(node.name)
        if call is not None:
            return call(*args, **node.kwargs)
        args, kwargs = on_run_device(tuple(args), dict(node.kwargs), self.device)
        return node.target(*args, **kwargs)

    def _layout(self, offsets: str, clamp_min: int, max_len: int,
                env: dict[fx.Node, Any]) -> TokenLayout:
        """The exact layout (a padded attention outside a region converts through it)."""
        key = (offsets, int(clamp_min), int(max_len), None)
        if key not in self._layouts:
            self._layouts[key] = TokenLayout.of(env[self.by_name[offsets]], key[1], key[2])
        return self._layouts[key]

    def _guard(self, region: dict[str, Any], env: dict[fx.Node, Any]) -> None:
        """Once per call, before a guarded region's first node: check its mask (one small
        kernel and one host read, as the guarded attention's) and run the region packed
        when every row keeps a prefix (its layout: those lengths; or any kept positions, in
        order, in a ``compact`` region) and some row keeps a token, else padded: the model's
        own computation. A region with padding representatives (``pad_rep``) also needs each
        row's padded source entries equal (``guard_sample.padding_reps``, in the same host
        read) and is laid out over ``min(len + 1, L)`` with its weights. Counted in
        ``packed_tokens.GUARD_STATS``."""
        name = str(region["name"])
        if name in self._guards:
            return
        if region.get("rep_layout") == "sources":  # the layout from the sources' runs
            sources = [env[self.by_name[n]] for n in region["rep_sources"]]
            batch, length = int(sources[0].shape[0]), int(region["max_len"])
            lengths, check = source_reps(sources, batch, length)
            mask = sources[0]
            reps, offsets = True, packed.rep_offsets(lengths, length)
        else:
            mask = mask_rows(env[self.by_name[region["mask"]]])
            additive = bool(region.get("additive", False))
            reads = reader_positions(region.get("reads") or (),
                                     {n: env[self.by_name[n]]
                                      for n in guard_inputs(region)[1:]},
                                     int(mask.shape[0]), int(mask.shape[1]), mask.device)
            offsets, check = packed.region_check(mask, additive, reads)
            reps = bool(region.get("pad_rep"))
        if reps and region.get("rep_layout") != "sources":
            # padded entries equal within each row: one weighted token stands for them
            sources = [env[self.by_name[n]] for n in region["rep_sources"]]
            check = torch.cat([check, padding_reps(offsets[1:] - offsets[:-1], sources,
                                                   int(mask.shape[1]))])
            offsets = packed.rep_offsets(offsets[1:] - offsets[:-1], int(region["max_len"]))
        flags = check.tolist()  # the sync
        compact = bool(region.get("compact", False))
        # a source that needs its own gradient per position: run padded (GuardStats)
        grad = region.get("rep_layout") == "sources" and any(
            s.requires_grad for s in sources)
        # a layout from the sources as large as the padded tensor (no trailing run longer
        # than one position): the padded computation, without the conversions
        whole = region.get("rep_layout") == "sources" and \
            int(flags[2]) + int(flags[6]) >= int(sources[0].shape[0]) * int(region["max_len"])
        ok = packed.packs(flags, bool(region.get("every_row", False)), compact) \
            and not grad and not whole
        packed.GUARD_STATS.count(ok, flags, grad)
        self._guards[name] = ok
        if not ok:
            return
        key = (region["mask"], 0, int(region["max_len"]), name)
        if reps:
            self._layouts[key] = packed.with_rep_weights(TokenLayout(
                offsets, int(flags[2]) + int(flags[6]), int(mask.shape[0]),
                int(region["max_len"])))
        else:
            positions = packed.kept_positions(mask, additive, int(flags[2])) \
                if compact and flags[0] else None
            self._layouts[key] = TokenLayout(offsets, int(flags[2]), int(mask.shape[0]),
                                             int(region["max_len"]), positions)
        for n in self.guarded_nodes:
            if self.region_of[n] is region:
                self.packed[n] = self.guarded_nodes[n]

    def _region_layout(self, node: fx.Node, env: dict[fx.Node, Any]) -> TokenLayout:
        """The region's layout, sized from the jagged values' count (first asked for by the
        region's source, which reads those values: every region node comes after it); a
        guarded region's, from its mask (made by :meth:`_guard`)."""
        r = self.region_of[node]
        if r.get("guard") is not None:
            return self._layouts[(r["mask"], 0, int(r["max_len"]), str(r["name"]))]
        key = (r["offsets"], int(r["clamp_min"]), int(r["max_len"]), r["name"])
        if key not in self._layouts:
            values = env[self.by_name[r["values"]]].shape[0]
            offsets = env[self.by_name[r["offsets"]]]
            layout = TokenLayout.bounded(offsets, key[1], key[2], values)
            # an empty row's slot at position L - 1 (its reader: the unclamped lengths - 1)
            self._layouts[key] = packed.with_empty_last(layout, offsets) \
                if r.get("empty_last") else layout
        return self._layouts[key]

    def _padded(self, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        """``node``'s value at its padded shape (scattered once per step if packed)."""
        if node not in self.packed:
            return env[node]
        if node not in self._unpacked:
            value = env[node]
            layout = self._region_layout(node, env)
            dims = self.packed[node]
            if isinstance(value, (tuple, list)):  # its getitems are region nodes themselves
                raise ValueError(f"packed region: {node.name} (a tuple) is read outside it")
            self._unpacked[node] = packed.scatter(value, dims, layout)
        return self._unpacked[node]

    def _entering(self, arg: Any, dims: tuple[int, int], rank: int,
                  env: dict[fx.Node, Any], layout: TokenLayout) -> Any:
        """An argument of a packed op: a region value as it is, another tensor gathered to
        the packed layout (broadcast against a rank-``rank`` value at ``dims``)."""
        if isinstance(arg, fx.Node):
            if arg in self.packed:
                return env[arg]
            return packed.gather(env[arg], dims, rank, layout)
        if isinstance(arg, (list, tuple)):
            return type(arg)(self._entering(a, dims, rank, env, layout) for a in arg)
        return arg

    def _call_packed(self, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        """A region node on packed values; an op without a packed rule runs padded (its
        inputs scattered, its output gathered back: correct, as the region's padding rows
        are never read, but it pays the padded work)."""
        layout = self._region_layout(node, env)
        dims = self.packed[node]
        t = node.target
        if node in self.packed_sources:
            r = self.packed_sources[node]
            acc = bool(node.args[3]) if len(node.args) > 3 else False
            return packed.source(env[self.by_name[r["values"]]], env[self.by_name[r["row"]]],
                                 env[self.by_name[r["pos"]]], layout, acc,
                                 bool(r.get("in_order")))
        rank = _rank(node)
        if packed.is_pointwise(node):
            args = [self._entering(a, dims, rank, env, layout) for a in node.args]
            kwargs = {k: self._entering(v, dims, rank, env, layout)
                      for k, v in node.kwargs.items()}
            return t(*args, **kwargs)
        if packed.causal_self_attention(node) and layout.positions is None:
            operands = packed.attention_operands(node)
            if all(x in self.packed for x in operands):
                return packed.attention(*(env[x] for x in operands),
                                        tuple(self.packed[x] for x in (*operands, node)),
                                        layout, ir.sdpa_args(node)["scale"], True)
        first = node.args[0]
        if packed.per_token(node):
            if not (isinstance(first, fx.Node) and first in self.packed):
                return self._padded_then_packed(node, env, layout, dims)
            args = list(fx.node.map_arg(node.args, env.__getitem__))
            if t in packed.SIZED:
                args[1] = packed.resize(list(args[1]), dims, layout.total, layout.batch)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            return t(*args, **kwargs)
        return self._padded_then_packed(node, env, layout, dims)

    def _padded_then_packed(self, node: fx.Node, env: dict[fx.Node, Any],
                            layout: TokenLayout, dims: tuple[int, int]) -> Any:
        out = self._call(node, env)
        if isinstance(out, (tuple, list)):
            raise ValueError(f"packed region: {node.name} ({node.target}) returns a tuple and "
                             "has no packed rule")
        return packed.gather(out, dims, _rank(node), layout)

    def _run_unit(self, unit: dict[str, Any], env: dict[fx.Node, Any]) -> None:
        registry.unit(unit["entry"]["kind"]).run(self, unit, env)

    def _setup_group(self, unit: dict[str, Any], sources: dict[str, str]) -> None:
        entry = unit["entry"]
        unit["run"] = make_runner(self._source(entry, sources), entry["binding"])
        unit["shared_operand"] = gemm_operand_in_epilogue(entry["structure"])

    def _setup_embeddings(self, unit: dict[str, Any], sources: dict[str, str]) -> None:
        self.tables[unit["entry"]["name"]] = self._embedding_module(unit["entry"])

    def _run_group(self, unit: dict[str, Any], env: dict[fx.Node, Any]) -> None:
        entry = unit["entry"]
        by_name = self.by_name
        binding = entry["binding"]
        if unit["packed"]:
            run, inputs = self._packed_group(unit, env)
        else:
            run = unit["run"]
            inputs = [self._padded(by_name[n], env) for n in binding["inputs"]]
        if unit.get("shared_operand") and _autocast_dtype(inputs) is not None:
            self._run_as_aten(unit, env)
            return
        dtypes = self._narrowed(unit["narrow"], inputs)
        outs = run(*inputs, out_dtypes=dtypes)
        for name, value in zip(binding["outputs"], outs):
            self._store(by_name[name], value, env, unit["packed"])

    def _run_jagged_attention(self, unit: dict[str, Any], env: dict[fx.Node, Any]) -> None:
        value, is_packed = self._jagged_attention(unit["entry"], env, self.by_name)
        self._store(unit["nodes"][0], value, env, is_packed)

    def _run_embeddings(self, unit: dict[str, Any], env: dict[fx.Node, Any]) -> None:
        self._embeddings(unit["entry"], env, self.by_name)

    def _run_as_aten(self, unit: dict[str, Any], env: dict[fx.Node, Any]) -> None:
        """The loud fallback of a GEMM group that reads its GEMM's operand in the epilogue
        too (``n + linear(n)``): under autocast the kernel's GEMM needs the operand cast to
        the autocast dtype, the epilogue needs it uncast (eager adds the fp32 value), and
        the kernel takes one tensor per input. The group's own ATen ops run instead."""
        name = unit["entry"].get("name", "gemm_epilogue")
        if not unit.get("warned"):
            unit["warned"] = True
            warnings.warn(
                f"gemc: kernel {name} runs as its ATen ops under autocast: its epilogue reads "
                "the GEMM's own operand, which the kernel would see rounded to the autocast "
                "dtype (eager reads it unrounded)", RuntimeWarning, stacklevel=3)
        for node in unit["nodes"]:
            env[node] = self._compute(node, env)

    def operand(self, name: str, env: dict[fx.Node, Any]) -> Any:
        """The value of graph node ``name`` at its padded shape: what a kind's ``run`` reads
        (gemc.backends.triton.kinds)."""
        return self._padded(self.by_name[name], env)

    def packed_operands(self, names: Sequence[str], env: dict[fx.Node, Any]
                        ) -> tuple[list[Any], TokenLayout] | None:
        """The values of graph nodes ``names`` as they are, in the packed layout, and the
        layout of the last one's region (the kind's output), when every one of them is in
        a region packed on this call; else None. What a kind that runs on a region's tokens
        in place reads (``kinds/attention.py``'s silu attention)."""
        nodes = [self.by_name[n] for n in names]
        if not all(n in self.packed for n in nodes):
            return None
        layout = self._region_layout(nodes[-1], env)
        if layout.positions is not None and not layout.empty_last:  # kept positions that
            return None  # are not a prefix (an empty row's slot at L - 1 is one: it gives 0)
        return [env[n] for n in nodes[:-1]], layout

    def packed_rep_attention(self, entry: dict[str, Any], env: dict[fx.Node, Any]) -> bool:
        """A ``key_padding_attention`` entry of a region with padding representatives
        (its ``rep_attentions``) on a packed call: on the region's tokens, each key biased
        by its mask entry and each representative by the entries it stands for
        (``packed_tokens.rep_attention``), its output stored packed. Returns whether it
        applied (else the caller runs it padded: scattered, eager's values)."""
        out = self.by_name[str(entry.get("output", entry["nodes"][0]))]
        region = self.region_of.get(out)
        nodes = [self.by_name[entry[x]] for x in ("q", "k", "v")]
        if region is None or out.name not in region.get("rep_attentions", ()) \
                or not all(n in self.packed for n in (*nodes, out)):
            return False
        mask = self._padded(self.by_name[str(entry["mask"])], env)
        dims = tuple(self.packed[n] for n in (*nodes, out))
        env[out] = packed.rep_attention(*(env[n] for n in nodes), dims,
                                        self._region_layout(out, env), mask,
                                        bool(entry["additive"]), entry["scale"])
        return True

    def packed_output(self, name: str, value: Any, env: dict[fx.Node, Any]) -> None:
        """A kind's result for region node ``name``, already in the packed layout."""
        self._store(self.by_name[name], value, env, True)

    def output(self, name: str, value: Any, env: dict[fx.Node, Any]) -> None:
        """A kind's padded result for graph node ``name`` (gathered if the node is packed)."""
        self._store(self.by_name[name], value, env, False)

    def _store(self, node: fx.Node, value: Any, env: dict[fx.Node, Any],
               is_packed: bool) -> None:
        """A unit's output into the environment, gathered to the packed layout if it is a
        region node whose unit answered padded (``is_packed``: the value already is)."""
        if node in self.packed and not is_packed:
            value = packed.gather(value, self.packed[node], _rank(node),
                                  self._region_layout(node, env))
        env[node] = value

    def _packed_group(self, unit: dict[str, Any], env: dict[fx.Node, Any]
                      ) -> tuple[Any, list[Any]]:
        """A fused group over packed values: its inputs in the packed layout and its
        launcher for the packed shapes (one per token count: the host sizes grids and
        buffers from the binding's shapes)."""
        entry = unit["entry"]
        binding = entry["binding"]
        st = entry["structure"]
        out_node = self.by_name[binding["outputs"][0]]
        dims = self.packed[out_node]
        layout = self._region_layout(out_node, env)
        rank = _rank(out_node)
        runs = unit.setdefault("packed_runs", {})
        if layout.total not in runs:
            shapes = [packed.packed_shape(sh, dims, rank, layout.total, layout.batch)
                      for sh in binding["shapes"]]
            runs[layout.total] = make_runner(unit["run"].impl.m, {**binding, "shapes": shapes})
        token_inputs = {slot["input"] for slot in st["slots"]}
        if st["ops"][0]["op"] == "linear":
            token_inputs.add(st["ops"][0]["args"][0][1])
        inputs = []
        for i, name in enumerate(binding["inputs"]):
            node = self.by_name[name]
            if node in self.packed:
                inputs.append(env[node])
            elif i in token_inputs:
                inputs.append(packed.gather(env[node], dims, rank, layout))
            else:
                inputs.append(env[node])
        return runs[layout.total], inputs

    @staticmethod
    def _narrowed(narrow: list[bool], inputs: Sequence[Any]) -> list[torch.dtype | None] | None:
        """Per output, the autocast dtype where the output may be written in it, else None."""
        dt = _autocast_dtype(inputs) if any(narrow) else None
        return None if dt is None else [dt if f else None for f in narrow]

    def _jagged_attention(self, entry: dict[str, Any], env: dict[fx.Node, Any],
                          by_name: dict[str, fx.Node]) -> tuple[torch.Tensor, bool]:
        """The attention's output, and whether it is in the packed layout (its inputs and
        itself region nodes: no conversion at all) or padded."""
        from .jagged import jagged_to_padded, padded_to_jagged
        from .jagged_attention import jagged_attention

        nodes = [by_name[entry[x]] for x in ("q", "k", "v")]
        length = int(entry["max_len"])
        node = self.by_name[entry["nodes"][0]]
        scale = entry["scale"]
        if node in self.packed and all(n in self.packed for n in nodes):
            layout = self._region_layout(node, env)
            # already packed: [1, H, T, D] at the region's dims -> [T, H, D] and back
            qj, kj, vj = (env[n].movedim(self.packed[n], (0, 1)).flatten(0, 1) for n in nodes)
            if scale is None:
                scale = 1.0 / math.sqrt(qj.shape[-1])
            out = jagged_attention(qj, kj, vj, layout.offsets, length, scale=scale)
            return out.unsqueeze(0).movedim((0, 1), self.packed[node]), True
        layout = self._layout(entry["offsets"], entry["clamp_min"], length, env)
        q, k, v = (self._padded(n, env) for n in nodes)
        qj, kj, vj = (padded_to_jagged(x.transpose(1, 2), layout.offsets, layout.total)
                      for x in (q, k, v))
        if scale is None:
            scale = 1.0 / math.sqrt(q.shape[-1])
        out = jagged_attention(qj, kj, vj, layout.offsets, length, scale=scale)
        return jagged_to_padded(out, layout.offsets, length).transpose(1, 2), False

    def _embeddings(self, entry: dict[str, Any], env: dict[fx.Node, Any],
                    by_name: dict[str, fx.Node]) -> None:
        module = self.tables[entry["name"]]
        tables = entry["tables"]
        ids = [env[by_name[t["ids"]]] for t in tables]
        offsets = [env[by_name[t["offsets"]]] for t in tables]
        last = [bool(t["include_last_offset"]) for t in tables]
        batches = {o.numel() - int(x) for o, x in zip(offsets, last)}
        if len(batches) != 1:  # group-embeddings groups one batch size
            raise ValueError(f"kernel {entry['name']}: its tables' batches differ "
                             f"({sorted(batches)})")
        out = module(*self.bag_inputs(ids, offsets, last,
                                      [t["pooling"] == "mean" for t in tables]))
        for t, part in zip(tables, module.split_output(out)):
            env[by_name[t["output"]]] = part

    @staticmethod
    def bag_inputs(ids: list[torch.Tensor], offsets: list[torch.Tensor],
                   include_last: list[bool], mean: list[bool]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The batched lookup's flat ids, flat offsets and per-id weights (None without a
        mean-pooled table) from each table's ids and offsets (start offsets, or with the
        last): the interpreter's, and the compiled graph's through ``gemc::bag_inputs``."""
        ids = [t.to(torch.int64) for t in ids]
        offs = []
        for tid, off, last in zip(ids, offsets, include_last):
            off = off.to(torch.int64)
            offs.append(off if last else torch.cat([off, off.new_full((1,), tid.numel())]))
        nnz = [tid.numel() for tid in ids]  # shapes: known on the host, no sync
        flat_offsets, psw = GraphRunner._bag_layout(offs, nnz, list(mean))
        return torch.cat(ids), flat_offsets, psw

    @staticmethod
    def _bag_layout(offs: list[torch.Tensor], nnz: list[int], mean: list[bool]
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batched lookup's flat offsets (each table's shifted by the ids before it)
        and, with mean-pooled tables, per-id weights (1/length there, 1 for sum tables),
        for tables of one batch size: a few launches for all tables. Why: one small op per
        table (100 tables, ~10 ops each) kept the GPU idle for ~20 ms per step while
        Python launched them (``benchmarks/results/e2e_h200_8db3053_gemc.gaps.txt``)."""
        dev = offs[0].device
        stacked = torch.stack(offs)  # [tables, B + 1]
        starts = [0]
        for n in nnz[:-1]:
            starts.append(starts[-1] + n)
        base = host_values(starts, torch.int64, dev)
        flat = (stacked[:, :-1] + base[:, None]).flatten()
        total = sum(nnz)
        flat_offsets = torch.cat([flat, flat.new_full((1,), total)])
        if not any(mean):
            return flat_offsets, None
        lengths = (stacked[:, 1:] - stacked[:, :-1]).flatten()
        is_mean = host_values(mean, torch.bool, dev)
        per_bag = torch.where(is_mean.repeat_interleave(stacked.shape[1] - 1),
                              1.0 / lengths.clamp(min=1).to(torch.float32), 1.0)
        return flat_offsets, torch.repeat_interleave(per_bag, lengths, output_size=total)

    def table_weights(self, fqn: str) -> torch.Tensor:
        """The current (optimizer-updated) weights of an embedding table the runner owns."""
        for entry in self.entries:
            if entry["kind"] != "batched_embedding_bag":
                continue
            for t, w in zip(entry["tables"], self.tables[entry["name"]].split_weights()):
                if t["fqn"] == fqn:
                    return w
        raise KeyError(fqn)
