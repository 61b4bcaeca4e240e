"""The probes' synthetic histories (imported by path-loaded probe files: the repository
root is on ``sys.path`` wherever the tests load them)."""

from __future__ import annotations

import torch
from torch import nn

from gemc.spec import ModelSpec


def padded_history(step: int, seed: int, batch: int, length: int, items: int,
                   first: tuple[int, int]) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """The step's generator, the real-position mask ``[batch, length]`` and right-padded
    ids in ``[1, items)`` (0 = padding); lengths uniform in ``[0, length]``, the first two
    rows' set to ``first`` (an empty or short history, a full one). Made on the CPU."""
    with torch.device("cpu"):
        g = torch.Generator().manual_seed(1000 * seed + step)
        lengths = torch.randint(0, length + 1, (batch,), generator=g)
        lengths[0], lengths[1] = first
        real = torch.arange(length)[None, :] < lengths[:, None]
        return g, real, torch.randint(1, items, (batch, length), generator=g) * real


def target_and_label(g: torch.Generator, batch: int, items: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A candidate item per row and a click label (40% positive)."""
    with torch.device("cpu"):
        target = torch.randint(1, items, (batch,), generator=g)
        return target, (torch.rand(batch, generator=g) < 0.4).float()


def history_spec(model: nn.Module, seed: int, batch: int, length: int, items: int,
                 first: tuple[int, int]) -> ModelSpec:
    """A spec whose batches are ``(hist, target, label)`` (:func:`padded_history`)."""

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        g, _, hist = padded_history(step, seed, batch, length, items, first)
        target, label = target_and_label(g, batch, items)
        return tuple(t.to(device) for t in (hist, target, label))

    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=batch)
