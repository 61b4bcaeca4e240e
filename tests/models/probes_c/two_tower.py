"""Two-tower retrieval with in-batch negatives (Yi et al., RecSys 2019, "Sampling-Bias-
Corrected Neural Modeling"; the YouTube / TorchRec two-tower examples' layout).

The loader hands a dict: ``user_id`` int32 [B], ``hist`` int32 [B, L] (0 = padding),
``user_dense`` float16 [B, F], ``item_id`` int32 [B] (the clicked item), ``item_logq``
float16 [B] (the streaming log-frequency estimate of the item's sampling probability).
The user tower mean-pools its history (masked), concatenates the user's embedding and
dense features, an MLP, l2-normalised; the item tower an embedding and an MLP,
l2-normalised. ``logits = u @ v.T / temperature``; ``logq=True`` subtracts each column's
log-probability (the sampling-bias correction), the labels are ``arange(B)`` (the diagonal).
``dedup=True`` also masks in-batch collisions (the same item clicked by two rows) with
``torch.finfo(logits.dtype).min`` off the diagonal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, L, USERS, ITEMS, D, FEATS = 8, 4, 20, 12, 8, 3


class TwoTower(nn.Module):
    def __init__(self, logq: bool, dedup: bool, temperature: float) -> None:
        super().__init__()
        self.logq, self.dedup, self.temperature = logq, dedup, temperature
        self.user_emb = nn.Embedding(USERS, D)
        self.item_emb = nn.Embedding(ITEMS, D, padding_idx=0)
        self.hist_emb = nn.Embedding(ITEMS, D, padding_idx=0)
        self.user_mlp = nn.Sequential(nn.Linear(2 * D + FEATS, 16), nn.ReLU(), nn.Linear(16, D))
        self.item_mlp = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, D))

    def user_tower(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hist = batch["hist"]
        mask = (hist > 0).unsqueeze(-1).float()
        pooled = (self.hist_emb(hist) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        x = torch.cat([self.user_emb(batch["user_id"]), pooled,
                       batch["user_dense"].float()], dim=-1)
        return F.normalize(self.user_mlp(x), dim=-1)

    def item_tower(self, item_id: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.item_mlp(self.item_emb(item_id)), dim=-1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        u = self.user_tower(batch)
        v = self.item_tower(batch["item_id"])
        logits = torch.matmul(u, v.T) / self.temperature
        if self.logq:
            logits = logits - batch["item_logq"].float().unsqueeze(0)
        if self.dedup:
            ids = batch["item_id"]
            same = (ids[:, None] == ids[None, :]) & ~torch.eye(ids.shape[0], dtype=torch.bool,
                                                                device=ids.device)
            logits = logits.masked_fill(same, torch.finfo(logits.dtype).min)
        labels = torch.arange(logits.shape[0], device=logits.device)
        return F.cross_entropy(logits, labels)


def build(logq: bool = True, dedup: bool = False, temperature: float = 0.05,
          seed: int = 0) -> ModelSpec:
    torch.manual_seed(seed)
    model = TwoTower(logq, dedup, temperature)

    def make_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        with torch.device("cpu"):
            g = torch.Generator().manual_seed(1000 * seed + step)
            lengths = torch.randint(0, L + 1, (B,), generator=g)
            real = torch.arange(L)[None, :] < lengths[:, None]
            hist = torch.randint(1, ITEMS, (B, L), generator=g) * real
            item = torch.randint(1, ITEMS, (B,), generator=g)
            item[1] = item[0]  # a collision: two users clicked the same item
            batch = {"user_id": torch.randint(0, USERS, (B,), generator=g).to(torch.int32),
                     "hist": hist.to(torch.int32),
                     "user_dense": torch.randn(B, FEATS, generator=g).to(torch.float16),
                     "item_id": item.to(torch.int32),
                     "item_logq": torch.log(torch.rand(B, generator=g) * 0.1 + 1e-3)
                     .to(torch.float16)}
        return {k: t.to(device) for k, t in batch.items()}

    return ModelSpec(model=model, example_inputs=(make_batch(0, "cpu"),),
                     make_batch=lambda step, device: (make_batch(step, device),),
                     batch_size=B)
