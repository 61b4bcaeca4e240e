"""The single-process reference a distributed run must reproduce.

For each step ``s`` and a world of ``W`` ranks::

    loss = mean over r in 0..W-1 of model(*make_batch(s * W + r))
    loss.backward(); AdamW step on dense parameters; sparse step on the tables

with the runner's deterministic init (:mod:`.init`), the same optimizer configurations
(:mod:`.optimizers`), the same precision sites when given a plan's (:mod:`.precision`) and
the same sparse row updates (:mod:`.sparse_optim`), on plain
``nn.Embedding``/``nn.EmbeddingBag`` modules with ``sparse=True`` gradients (whose indices
are exactly the rows the step used). The tests compare loss trajectories against it, and
``benchmarks/e2e.py`` uses it as the eager and ``torch.compile`` baselines, so all three
train the same thing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from gemc.backends.torch.init import derive_seed
from gemc.backends.torch.materialize import materialize_
from gemc.backends.torch.optimizers import DenseOptimConfig, make_dense_optimizer
from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, RowState, coalesced_rows
from torch import nn

from gemc.spec import ModelSpec


def find_tables(model: nn.Module, names: list[str] | None = None) -> list[str]:
    """Module paths of the embedding tables (all Embedding/EmbeddingBag when not given)."""
    if names is not None:
        return list(names)
    return [
        n for n, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
    ]


@dataclass
class ReferenceTrainer:
    """One process training ``spec``'s model exactly as the runner does across ``W`` ranks."""

    spec: ModelSpec
    world_size: int = 1
    seed: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dense_cfg: DenseOptimConfig = field(default_factory=DenseOptimConfig)
    emb_cfg: EmbeddingOptimConfig = field(default_factory=EmbeddingOptimConfig)
    table_modules: list[str] | None = None
    autocast_dtype: torch.dtype | None = None
    precision_entries: list[dict[str, Any]] | None = None  # a plan's sites, applied as-is
    compile_fn: Callable[[nn.Module], Any] | None = None  # e.g. torch.compile
    # with compile_fn: compile these submodules (e.g. the plan's dense regions); None
    # compiles the whole model with each table's lookup left to eager
    compile_modules: list[str] | None = None

    def __post_init__(self) -> None:
        model = self.spec.model
        self.table_modules = find_tables(model, self.table_modules)
        self.init_report = materialize_(
            model, self.device, self.seed, self.table_modules, origin=self.spec.origin,
            recipes=self.spec.init_recipes,
        )
        model.train()
        if self.precision_entries:
            from gemc.backends.torch import precision

            sites = precision.resolve(list(self.precision_entries), model)
            precision.install(model, sites, self.device.type)
            if self.autocast_dtype is None:
                self.autocast_dtype = sites.global_dtype
        self.tables: dict[str, nn.Module] = {}
        table_weights = set()
        for name in self.table_modules:
            module = model.get_submodule(name)
            # torch has no sparse gradient of a max pool: its rows are read from a dense one
            module.sparse = getattr(module, "mode", "sum") != "max"
            self.tables[name] = module
            table_weights.add(id(module.weight))
        dense = [p for p in model.parameters() if p.requires_grad and id(p) not in table_weights]
        self.dense_opt = make_dense_optimizer(dense, self.dense_cfg, self.device)
        self.row_state = {
            name: RowState(m.weight.data, self.emb_cfg.kind) for name, m in self.tables.items()
        }
        self.sparse_steps = 0
        self.forward = model
        if self.compile_fn is not None and self.compile_modules is None:
            # The whole model, as a user would compile it, except the tables: torch.compile
            # cannot differentiate sparse embedding gradients, so each table's forward is
            # left to eager (graph breaks there, as around TorchRec's sharded tables).
            for module in self.tables.values():
                module.forward = torch.compiler.disable(module.forward)
            self.forward = self.compile_fn(model)
        elif self.compile_fn is not None:
            for name in self.compile_modules or []:
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, self.compile_fn(model.get_submodule(name)))

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None or self.autocast_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        """The ``W`` batches of global step ``step`` (rank r's is ``make_batch(step*W + r)``)."""
        w = self.world_size
        return [self.spec.make_batch(step * w + r, self.device) for r in range(w)]

    def step(self, step: int) -> float:
        """One training step over the ``W`` batches of global step ``step``; returns the loss."""
        return self.train_step(self.batches(step), step)

    def train_step(self, batches: list[tuple[torch.Tensor, ...]],
                   step: int | None = None) -> float:
        """Forward and backward of the mean loss over ``batches``, then both optimizers.
        With ``step``, rank r's forward draws its random numbers (a dropout mask, TransAct's
        time window) from the generator seeded as the runner seeds rank r at that step
        (``derive_seed(seed, "rng", r, step)``), so eager and gemc draw alike."""
        total = None
        for r, batch in enumerate(batches):
            if step is not None:
                torch.manual_seed(derive_seed(self.seed, "rng", r, step))
            with self._autocast():
                loss = self.forward(*batch)
            total = loss if total is None else total + loss
        assert total is not None
        loss = total / len(batches)
        loss.backward()
        self.dense_opt.step()
        self.sparse_steps += 1
        with torch.no_grad():
            for name, module in self.tables.items():
                got = coalesced_rows(module.weight.grad)
                if got is not None and got[0].numel():
                    rows, g = got
                    self.row_state[name].apply(
                        module.weight.data, rows, g, self.emb_cfg, self.sparse_steps,
                        module.weight.shape[1],
                    )
                module.weight.grad = None
        self.dense_opt.zero_grad(set_to_none=True)
        return float(loss.detach().float())


def reference_losses(
    spec: ModelSpec,
    *,
    steps: int,
    world_size: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dense_cfg: DenseOptimConfig | None = None,
    emb_cfg: EmbeddingOptimConfig | None = None,
    table_modules: list[str] | None = None,
    autocast_dtype: torch.dtype | None = None,
    precision_entries: list[dict[str, Any]] | None = None,
) -> list[float]:
    """Loss of each of ``steps`` steps (``spec`` built on meta, e.g. by ``load_model``)."""
    trainer = ReferenceTrainer(
        spec,
        world_size=world_size,
        seed=seed,
        device=torch.device(device),
        dense_cfg=dense_cfg or DenseOptimConfig(),
        emb_cfg=emb_cfg or EmbeddingOptimConfig(),
        table_modules=table_modules,
        autocast_dtype=autocast_dtype,
        precision_entries=precision_entries,
    )
    return [trainer.step(s) for s in range(steps)]
