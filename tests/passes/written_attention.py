"""The frame of an attention written out by hand over ``[B, H, L, D]`` (the matcher tests'
models): q, k and v from one projection of ``x`` (``[B, L, H * D]``), the weights from a
subclass's :meth:`WrittenAttention.weights`, ``weights @ v``, and the output pooled under
the boolean keep-mask ``[B, L]`` (so nothing reads its padding rows)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

B, H, L, D = 2, 2, 4, 4


class WrittenAttention(nn.Module, ABC):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.qkv = nn.Linear(H * D, 3 * H * D)

    @abstractmethod
    def weights(self, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The attention weights ``[B, H, L, L]``: the formula each matcher's test writes."""

    def extra(self, weights: torch.Tensor) -> torch.Tensor | None:
        """What else reads the weights (added to the loss when not None)."""
        return None

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        p = self.weights(q, k, keep)
        out = ((p @ v).transpose(1, 2).reshape(B, L, H * D) * keep[:, :, None]).sum()
        extra = self.extra(p)
        return out if extra is None else out + extra


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and a keep-mask of lengths 1 and 3."""
    return torch.randn(B, L, H * D), torch.arange(L)[None, :] < torch.tensor([1, 3])[:, None]
