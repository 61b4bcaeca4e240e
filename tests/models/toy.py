"""Small models for tests: a well-formed one and the ways a user's entrypoint goes wrong."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, N_IDS, ROWS, DIM = 4, 10, 50, 8


class Toy(nn.Module):
    """An embedding bag, a tower with a GEMM + GELU + LayerNorm, a BCE loss."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(ROWS, DIM, mode="sum", include_last_offset=True)
        self.tower = nn.Sequential(
            nn.Linear(DIM + 3, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, 1)
        )

    def forward(
        self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        pooled = self.table(ids, offsets)
        logits = self.tower(torch.cat([pooled, dense], dim=1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, labels)


def _batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    cuts = torch.sort(torch.randint(0, N_IDS + 1, (B - 1,), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([N_IDS])])
    batch = (
        torch.randn(B, 3, generator=g),
        torch.randint(0, ROWS, (N_IDS,), generator=g),
        offsets,
        torch.randint(0, 2, (B,), generator=g).float(),
    )
    return tuple(t.to(device) for t in batch)


def _example() -> tuple[torch.Tensor, ...]:
    return (
        torch.zeros(B, 3),
        torch.zeros(N_IDS, dtype=torch.long),
        torch.zeros(B + 1, dtype=torch.long),
        torch.zeros(B),
    )


def build(hidden: int = 16) -> ModelSpec:
    return ModelSpec(
        model=Toy(hidden), example_inputs=_example(), make_batch=_batch, info={"batch_size": B}
    )


def build_wrong_type() -> dict:
    return {"model": Toy()}


class _VectorLoss(Toy):
    def forward(self, dense, ids, offsets, labels):  # noqa: ANN001
        return self.tower(torch.cat([self.table(ids, offsets), dense], dim=1))


def build_not_scalar() -> ModelSpec:
    return ModelSpec(model=_VectorLoss(), example_inputs=_example(), make_batch=_batch)


class _DataDependent(Toy):
    def forward(self, dense, ids, offsets, labels):  # noqa: ANN001
        if dense.sum() > 0:  # Python branching on tensor data: not capturable
            dense = dense * 2
        return super().forward(dense, ids, offsets, labels)


def build_untraceable() -> ModelSpec:
    return ModelSpec(model=_DataDependent(), example_inputs=_example(), make_batch=_batch)


def build_raises() -> ModelSpec:
    raise RuntimeError("the model author's bug")


not_a_function = 3


class ToyAttention(nn.Module):
    """A padded sequence through SDPA with a key-padding mask built from lengths."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, seq: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        b, length, dim = seq.shape
        q, k, v = (
            self.qkv(seq).view(b, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        )
        mask = torch.arange(length, device=seq.device)[None, :] < lengths[:, None]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return self.out(attn.transpose(1, 2).reshape(b, length, dim)).mean()


def build_attention() -> ModelSpec:
    def batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(step)
        return (
            torch.randn(3, 6, 16, generator=g).to(device),
            torch.randint(1, 7, (3,), generator=g).to(device),
        )

    return ModelSpec(
        model=ToyAttention(),
        example_inputs=(torch.zeros(3, 6, 16), torch.zeros(3, dtype=torch.long)),
        make_batch=batch,
    )
