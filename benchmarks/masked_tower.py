"""A history tower whose padding is given as a boolean mask input: the benchmark of guarded
packed-token regions in graph mode (issue 17).

Why this model: the padding mask of most data pipelines arrives as a ``[B, L]`` bool
tensor, so nothing in the graph proves it is a prefix; ``pack-jagged-tokens`` then builds a
region guarded by a run-time check. The zoo has no model where that check passes on its
batches (MMoE's empty rows carry a finite additive mask, so it falls back, correctly; BST's
padding reaches its MLP), so the packed path of the compiled graph is measured here.

The model, as user code writes it: item embeddings plus learned positions over a
right-padded history, pre-LN Transformer blocks with ``scaled_dot_product_attention`` under
``attn_mask=mask[:, None, None, :]``, a GELU MLP, the masked mean over the history, a
linear head and BCE. Batches: lengths uniform in ``[1, L]`` (about 50% fill, no empty row),
a prefix on every row; the ``h200-fill25`` / ``-fill75`` / ``-fill100`` presets draw them
around another mean fill (issue 17: the packed tower's time against its real tokens).

    GEMC_ZOO_EXTRA=masked_tower=benchmarks/masked_tower.py:build \\
        bash benchmarks/zoo_h200.sh --models masked_tower --variants eager,compile,gemc,gemc-interp
    # the fill sweep, one preset a call:
    GEMC_ZOO_EXTRA=masked_tower=benchmarks/masked_tower.py:build python3 benchmarks/zoo.py \\
        --out $OUT/fill25 --models masked_tower --variants compile,gemc --preset h200-fill25
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec


@dataclass(frozen=True)
class Config:
    batch_size: int
    max_len: int
    items: int
    dim: int
    heads: int
    blocks: int
    fill: float = 0.5  # mean history length / max_len (see _lengths)


PRESETS = {
    "tiny": Config(4, 8, 50, 16, 2, 2),
    "h200": Config(1024, 256, 500_000, 256, 4, 4),
    # the same tower at other fills: is the packed tower's time proportional to its tokens?
    "h200-fill25": Config(1024, 256, 500_000, 256, 4, 4, 0.25),
    "h200-fill75": Config(1024, 256, 500_000, 256, 4, 4, 0.75),
    "h200-fill100": Config(1024, 256, 500_000, 256, 4, 4, 1.0),
}


def _lengths(cfg: Config, g: torch.Generator) -> torch.Tensor:
    """Lengths uniform over a range whose mean is ``fill * max_len``: ``[1, 2 fill L]`` up
    to half full, ``[(2 fill - 1) L, L]`` above (every row full at 1.0)."""
    L = cfg.max_len
    if not 0.0 < cfg.fill <= 1.0:
        raise ValueError(f"masked_tower: fill must be in (0, 1], got {cfg.fill}")
    lo, hi = (1, max(1, round(2 * cfg.fill * L))) if cfg.fill <= 0.5 else \
        (max(1, round((2 * cfg.fill - 1) * L)), L)
    return torch.randint(lo, hi + 1, (cfg.batch_size,), generator=g)


class Block(nn.Module):
    """Pre-LN self-attention and MLP over ``[B, L, d]``, the padding keys masked out."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, length, 3, self.heads, -1).permute(
            2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        x = x + self.proj(o.transpose(1, 2).reshape(b, length, dim))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class MaskedTower(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.items = nn.Embedding(cfg.items, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.max_len, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.blocks))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, 1)

    def forward(self, history: torch.Tensor, mask: torch.Tensor, label: torch.Tensor
                ) -> torch.Tensor:
        x = self.items(history) + self.pos
        for block in self.blocks:
            x = block(x, mask)
        keep = mask.unsqueeze(-1).to(x.dtype)
        pooled = (self.norm(x) * keep).sum(1) / keep.sum(1)
        return F.binary_cross_entropy_with_logits(self.head(pooled).squeeze(-1), label)


def _batch(cfg: Config, step: int, seed: int, device: torch.device | str
           ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1_000_003 * seed + step)
    lengths = _lengths(cfg, g)
    mask = torch.arange(cfg.max_len)[None, :] < lengths[:, None]
    history = torch.randint(1, cfg.items, (cfg.batch_size, cfg.max_len), generator=g) * mask
    label = (torch.rand(cfg.batch_size, generator=g) < 0.3).float()
    return tuple(t.to(device) for t in (history, mask, label))


def build(preset: str = "tiny", batch_size: int | None = None, seed: int = 0) -> ModelSpec:
    """The tower at ``preset`` ("tiny" or "h200")."""
    cfg = PRESETS[preset]
    if batch_size is not None:
        cfg = replace(cfg, batch_size=batch_size)
    torch.manual_seed(seed)
    model = MaskedTower(cfg)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        with torch.device("cpu"):
            return _batch(cfg, step, seed, device)

    info = {"preset": preset, "model": "masked_tower", "batch_size": cfg.batch_size,
            "max_len": cfg.max_len}
    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=cfg.batch_size, info=info)
