"""Dense regions: each gets the data-parallel strategy the plan chose.

``plan["regions"]`` names module paths (``""`` is the root) and a strategy each:

``fsdp``  FSDP2 ``fully_shard`` of the region's module over all ranks (1-D mesh).
``hsdp``  FSDP2 ``fully_shard`` over the plan's 2-D mesh (``host`` x ``local``): parameters
          sharded inside a host, replicated across hosts.
``ddp``   parameters replicated; gradients averaged over all ranks with bucketed
          all-reduces (:class:`GradientAverager`, DDP's algorithm). Written here rather than
          by wrapping the model in ``DistributedDataParallel`` because regions of one model
          mix strategies, and DDP wraps a whole module tree.
``tp``    not supported yet: a named error, never a silent fallback.

A parameter belongs to the innermost region whose module contains it; parameters outside
every named region follow the root region (``""``), or DDP when the plan has none.
Embedding tables are never part of a dense region (FSDP is told to ignore them).
FSDP regions are wrapped innermost first so nested regions each keep their own
strategy. With one rank every strategy is the identity and nothing is wrapped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemc.errors import GemcUserError, PlanError
from gemc.plan import Region
from gemc.sharding import DENSE_DECLARED, REPLICATED_DENSE, dense_strategy

BUCKET_BYTES = 25 * 1024 * 1024


class TensorParallelNotSupported(GemcUserError):
    """The plan asks for tensor parallelism, which the runner cannot execute yet."""


@dataclass
class DenseLayout:
    """What :func:`apply_strategies` did: parameters per strategy, for the report."""

    strategy_of_region: dict[str, str] = field(default_factory=dict)
    params: dict[str, list[str]] = field(default_factory=dict)  # strategy -> param fqns
    averager: GradientAverager | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "regions": dict(sorted(self.strategy_of_region.items())),
            "params_per_strategy": {k: len(v) for k, v in sorted(self.params.items())},
        }


class GradientAverager:
    """DDP's gradient averaging for a set of replicated parameters.

    Gradients are packed into buckets of about ``BUCKET_BYTES`` (in reverse parameter order,
    the order backward produces them) and all-reduced; a bucket is launched asynchronously as
    soon as all its gradients have been accumulated (``register_post_accumulate_grad_hook``),
    buckets always in the same order on every rank, so communication overlaps the rest of
    the backward. ``finish()`` launches what is left (parameters unused this step count as
    zero gradients), waits, divides by the world size and writes the averages back.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup | None,
        world_size: int,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.world_size = world_size
        self.group = group
        self.buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _reset(self) -> None:
        self._pending = [len(b) for b in self.buckets]
        self._launched: list[tuple[torch.Tensor, Any] | None] = [None] * len(self.buckets)
        self._next = 0

    def _on_grad(self, p: torch.Tensor) -> None:
        i = self._bucket_of[id(p)]
        self._pending[i] -= 1
        # Launch in bucket order only, so every rank issues the same sequence.
        while self._next < len(self.buckets) and self._pending[self._next] <= 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, i: int) -> None:
        grads = [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]
        ]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._launched[i] = (flat, work)

    def finish(self) -> None:
        """Complete every bucket's all-reduce and install the averaged gradients."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        for bucket, launched in zip(self.buckets, self._launched):
            assert launched is not None
            flat, work = launched
            work.wait()
            flat.div_(self.world_size)
            offset = 0
            for p in bucket:
                n = p.numel()
                avg = flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)
                offset += n
        self._reset()


def _region_modules(model: nn.Module, regions: list[dict[str, Any]]) -> dict[str, nn.Module]:
    out = {}
    for region in regions:
        name = region["name"]
        try:
            out[name] = model.get_submodule(name) if name else model
        except AttributeError as exc:
            raise PlanError(
                f"the plan's region '{name}' is not a module of the model",
                where=f"plan regions: {name}",
                fix="compile the plan again for this model",
            ) from exc
    return out


def _owner(fqn: str, names: Iterable[str]) -> str:
    """The innermost region containing parameter ``fqn`` ("" when only the root does)."""
    best = ""
    for name in names:
        if name and (fqn.startswith(name + ".")) and len(name) > len(best):
            best = name
    return best


def check_strategies(regions: Sequence[Region | Mapping[str, Any]]) -> None:
    """Refuse what the runner cannot execute, before any process group work starts.
    ``regions``: the typed plan's (``Plan.regions``) or the document's."""
    pairs = [(r.name, r.strategy) if isinstance(r, Region) else (r["name"], r["strategy"])
             for r in regions]
    for strategy in DENSE_DECLARED:
        if strategy.runner:
            continue
        asked = [name or "(root)" for name, kind in pairs if kind == strategy.name]
        if asked:
            runs = [s.name for s in DENSE_DECLARED if s.runner and s.name != REPLICATED_DENSE]
            raise TensorParallelNotSupported(
                f"{strategy.title} not yet supported by the runner: the plan asks for it in "
                f"region(s) {', '.join(asked)}",
                where="plan regions[].strategy",
                fix=f"compile a plan without {strategy.name} regions (set those regions to "
                f"{' or '.join(runs[:1] + [REPLICATED_DENSE])})",
            )


def apply_strategies(
    model: nn.Module,
    regions: list[dict[str, Any]],
    *,
    world_size: int,
    table_params: set[nn.Parameter],
    mesh_1d: Any = None,
    mesh_2d: Any = None,
    ddp_group: dist.ProcessGroup | None = None,
) -> DenseLayout:
    """Wrap/prepare every dense region; returns who handles which parameters."""
    check_strategies(regions)
    modules = _region_modules(model, regions)
    strategy = {r["name"]: r["strategy"] for r in regions}
    strategy.setdefault("", REPLICATED_DENSE)
    layout = DenseLayout(strategy_of_region=dict(strategy))
    owner_of: dict[str, str] = {}
    for fqn, p in model.named_parameters():
        if p in table_params:
            continue
        owner_of[fqn] = _owner(fqn, strategy)
        layout.params.setdefault(strategy[owner_of[fqn]], []).append(fqn)
    if world_size == 1:
        return layout
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - only when sharding

    params = dict(model.named_parameters())
    modules.setdefault("", model)
    # innermost first: a region's own fully_shard must precede its parent's
    for name in sorted(strategy, key=lambda n: (-(n.count(".") + 1) if n else 0, n)):
        how = dense_strategy(strategy[name])
        if not how.sharded:
            continue
        module = modules[name]
        prefix = f"{name}." if name else ""
        inside = {fqn for fqn in params if fqn.startswith(prefix)}
        if not any(owner_of.get(f) == name for f in inside):
            continue  # nothing of its own to shard (e.g. a region that is only a table)
        ignored = {params[f] for f in inside if f not in owner_of}  # tables
        # parameters inside this module owned by a nested non-FSDP region stay out of it
        ignored |= {
            params[f]
            for f in inside
            if f in owner_of and owner_of[f] != name
            and dense_strategy(strategy[owner_of[f]]).replicated
        }
        mesh = mesh_2d if how.group == "host" else mesh_1d
        fully_shard(module, mesh=mesh, ignored_params=ignored or None)
    ddp_params = [params[f] for f in owner_of
                  if dense_strategy(strategy[owner_of[f]]).replicated]
    ddp_params = [p for p in ddp_params if p.requires_grad]
    if ddp_params:
        layout.averager = GradientAverager(ddp_params, ddp_group, world_size)
    return layout
