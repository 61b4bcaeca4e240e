"""Compile a model's graph through the kernel passes and run it with the kernels in place."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from gemc.cost_model.topology import parse_topology
from gemc.passes.predict_time import PredictTime
from torch import fx, nn

from examples.zoo import din
from gemc.api import load_model, pass_context
from gemc.capture import capture
from gemc.dump import format_graph
from gemc.pass_manager import PassManager
from gemc.pipeline import annotation_passes, kernel_passes
from gemc.plan_builder import kernel_entries
from gemc.spec import ModelSpec


def compiled(entry: str, args: dict[str, Any] | None = None, *, priced: bool = True,
             upto: str | None = None, device: str = "cpu"
             ) -> tuple[fx.GraphModule, Any, ModelSpec]:
    """The model built on CPU (real weights), its graph after the kernel passes (or up to
    and including ``upto``), and the pass context. ``priced``: run predict-time on an H200
    topology first (the golden dumps leave it out, so they do not move with the cost model).
    ``device="meta"``: built as ``gemc compile`` builds it, no weight allocated (an h200
    preset's billion parameters took 16 s and 6.6 GB to initialise on the CPU).
    """
    spec = load_model(entry, dict(args or {}), device=device)
    captured = capture(spec, entrypoint=entry)
    ctx = pass_context(entry, dict(args or {}), captured, parse_topology("h200:1x1") if priced
                   else None)
    passes = [*annotation_passes(), *([PredictTime()] if priced else [])]
    for p in kernel_passes():
        passes.append(p)
        if p.name == upto:
            break
    return PassManager(passes).run(captured.gm, ctx), ctx, spec


def dump_after(entry: str, pass_name: str) -> str:
    gm, _, _ = compiled(entry, priced=False, upto=pass_name)
    return format_graph(gm, f"after {pass_name}")


def entries_of(gm: fx.GraphModule, ctx: Any, kinds: Sequence[str] | None = None
               ) -> list[dict[str, Any]]:
    return [e for e in kernel_entries(gm, ctx) if kinds is None or e["kind"] in kinds]


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def fresh_seed() -> int:
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed: {seed}")
    return seed


def eager_step(model: torch.nn.Module, batch: Sequence[torch.Tensor],
               autocast: torch.dtype | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eager's loss and gradients (by name) on ``batch`` (under CPU autocast to ``autocast``
    if given); the model's gradients are zeroed again, ready for the graph's run."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        ref = model(*batch)
    ref.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return ref, grads


def run_against_eager(gm: fx.GraphModule, entries: list[dict[str, Any]],
                      model: torch.nn.Module, batch: Sequence[torch.Tensor], *,
                      release: bool = True) -> Any:
    """Run the graph with ``entries`` in place and check loss and every parameter's
    gradient against eager on the same batch; returns the runner (for what it recorded;
    ``release=False`` keeps its record of the nodes it ran unpacked)."""
    from gemc.backends.triton.graph_runner import GraphRunner

    ref, expected = eager_step(model, batch)
    runner = GraphRunner(gm, entries, params_of(model), release=release)
    loss = runner(*batch)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[k], atol=1e-5, rtol=1e-4, msg=k)
    return runner


def guarded_step_against_eager(gm: fx.GraphModule, entries: list[dict[str, Any]],
                               model: torch.nn.Module, batch: Sequence[torch.Tensor],
                               packs: bool) -> Any:
    """One step of a guarded region with a checked readout against eager
    (:func:`run_against_eager`), the guard's counters reset first: packed once where
    ``packs``, else run padded once with the readout counted as missed. Returns the
    runner; the model's gradients are zeroed."""
    from gemc.backends.triton import key_padding_attention as kpa
    from gemc.backends.triton import packed_tokens as pt

    pt.GUARD_STATS.reset()
    kpa.STATS.reset()
    runner = run_against_eager(gm, entries, model, batch, release=False)
    model.zero_grad()
    assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": int(packs),
                                        "padded": int(not packs),
                                        "missed_reads": int(not packs)}
    return runner


def cpu_graph_executor(gm: fx.GraphModule, model: torch.nn.Module,
                       entries: list[dict[str, Any]]) -> Any:
    """The runner's graph-mode executor of ``gm`` with ``entries`` on the CPU, for a
    model without sharded tables (an empty sparse optimizer, one rank)."""
    from gemc.backends.torch.graph_mode import GraphExecutor
    from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer

    return GraphExecutor(gm, {}, model, entries, tables={},
                         emb_opt=EmbeddingOptimizer({}, EmbeddingOptimConfig(), world_size=1),
                         device=torch.device("cpu"))


def packs_on_hits_against_eager(gm: fx.GraphModule, entries: list[dict[str, Any]],
                                model: torch.nn.Module,
                                steps: Sequence[tuple[bool, Sequence[torch.Tensor]]],
                                causal: bool) -> None:
    """Each ``(packs, batch)`` of ``steps`` through :func:`guarded_step_against_eager`;
    a packed step reads its readout from the region's tokens (the reader's source is
    never scattered back to the padded layout), and only a causal attention on a padded
    step falls back."""
    from gemc.backends.triton import key_padding_attention as kpa

    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    source = region["reads"][0]["source"]
    for packs, batch in steps:
        runner = guarded_step_against_eager(gm, entries, model, batch, packs)
        assert source not in {n.name for n in runner._unpacked}
        assert kpa.STATS.fallback == int(causal and not packs), kpa.STATS


def train_against_eager(executor: Any, model: torch.nn.Module,
                        batches: list[tuple[torch.Tensor, ...]]) -> None:
    """Steps of plain SGD through the compiled graph, each step's loss and every gradient
    checked against eager's on the same parameters (the two share them)."""
    for i, batch in enumerate(batches):
        ref, grads = eager_step(model, batch)
        loss = executor(*batch)
        loss.backward()
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5, msg=f"step {i}")
        with torch.no_grad():
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad, grads[k], atol=1e-5, rtol=1e-4,
                                           msg=f"step {i}: {k}")
                p -= 0.1 * p.grad
                p.grad = None


def item_history(lengths: Sequence[int], gen: torch.Generator, length: int, items: int,
                 layout: str = "end") -> tuple[torch.Tensor, torch.Tensor]:
    """Item ids ``[B, length]`` (0 = padding, real ids in ``1 .. items - 1``) of these
    lengths and BCE targets ``[B]``: the items padded at the end (``"end"``: a prefix), at
    the front (``"front"``: the latest item at ``length - 1``, as many sequential
    recommenders pad), or at position 0 with holes after it (``"holes"``: every other
    position up to ``2 * count - 1``; no prefix, yet every causal query sees key 0)."""
    count = torch.tensor(list(lengths))[:, None]
    pos = torch.arange(length)[None, :]
    real = {"end": lambda: pos < count,
            "front": lambda: pos >= length - count,
            "holes": lambda: (pos == 0) | ((pos % 2 == 0) & (pos < 2 * count - 1))}[layout]()
    return torch.randint(1, items, (len(lengths), length), generator=gen) * real, \
        torch.rand(len(lengths), generator=gen)


def values_batch(lengths: Sequence[int], width: int, gen: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A jagged batch as values + offsets: ``[sum(lengths), width]`` values, the
    ``[B + 1]`` offsets of these lengths, and BCE targets ``[B]``."""
    offsets = torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()])
    return (torch.randn(int(offsets[-1]), width, generator=gen), offsets,
            torch.randn(len(lengths), generator=gen))


def lengths_of_total(gen: torch.Generator, rows: int, length: int, total: int, empty: bool
                     ) -> list[int]:
    """Fresh random lengths of ``rows`` histories padded to ``length`` that sum to
    ``total`` (a captured graph's token count), with a full row, and an empty one exactly
    where ``empty``."""
    while True:
        out = torch.randint(0, length + 1, (rows,), generator=gen).tolist()
        if sum(out) == total and length in out and (0 in out) == empty:
            return out


class MaxDice(din.Dice):
    """Dice scaled by the largest magnitude over the B*L rows: not weighed. Its value would
    be exact without weights, but its gradient is split evenly among tied elements, and a
    row's padded copies are ties: eager splits among ``L - len`` copies (and any token they
    tie with), the packed layout among one representative, so a tie of a representative
    with another token would get another share."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.reshape(-1, x.size(-1)).abs().amax(dim=0)
        p = torch.sigmoid(x / (scale + self.eps))
        return p * x + (1 - p) * self.alpha * x


class RowDice(din.Dice):
    """Dice over each row's positions (a per-row statistic): not weighed here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=1, keepdim=True)
        p = torch.sigmoid(x - mean)
        return p * x + (1 - p) * self.alpha * x


def din_with(dice: type) -> nn.Module:
    """The zoo's DIN at its tiny preset with every Dice of its activation unit replaced."""
    model = din.build("tiny").model
    for i, layer in enumerate(model.attention.dnn):
        if isinstance(layer, din.Dice):
            model.attention.dnn[i] = dice(layer.alpha.numel())
    return model
