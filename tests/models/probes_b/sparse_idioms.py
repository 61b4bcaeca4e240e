"""Sparse-input idioms one at a time, each feeding the same small tower (``variant``).

* ``bag_max`` / ``bag_mean``: ``nn.EmbeddingBag(mode="max" | "mean")`` over start offsets;
* ``psw``: ``mode="sum"`` with ``per_sample_weights`` from the batch;
* ``lengths_cumsum`` / ``lengths_pad``: offsets computed inside forward from lengths
  (``torch.cat([zeros, cumsum[:-1]])`` / ``F.pad(cumsum, (1, 0))`` with
  ``include_last_offset=True``);
* ``padding_mean``: ``nn.Embedding(padding_idx=0)`` on padded ids, masked mean pooling;
* ``raw_param``: ``F.embedding`` on an ``nn.Parameter`` table (no embedding module);
* ``int32``: int32 ids and offsets;
* ``kjt``: a dict batch ``{feature: (values, lengths)}``, TorchRec KeyedJaggedTensor-like;
* ``shared``: one table looked up by two features (history bag and candidate item);
* ``unpad``: padded ids made jagged in forward (``ids[ids != 0]``, a data-dependent count)
  with offsets from the mask's row sums, then a sum bag.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, ROWS, DIM, L = 6, 50, 8, 5
VARIANTS = ("bag_max", "bag_mean", "psw", "lengths_cumsum", "lengths_pad", "padding_mean",
            "raw_param", "int32", "kjt", "shared", "unpad")


class SparseModel(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        mode = {"bag_max": "max", "bag_mean": "mean"}.get(variant, "sum")
        self.last = variant == "lengths_pad"
        if variant == "padding_mean":
            self.table = nn.Embedding(ROWS, DIM, padding_idx=0)
        elif variant == "raw_param":
            self.table = nn.Parameter(torch.randn(ROWS, DIM) * 0.1)
        elif variant == "kjt":
            self.tables = nn.ModuleDict({f: nn.EmbeddingBag(ROWS, DIM, mode="sum")
                                         for f in ("clicks", "tags")})
        else:
            self.table = nn.EmbeddingBag(ROWS, DIM, mode=mode, include_last_offset=self.last)
        self.item = nn.Embedding(ROWS, DIM)
        width = 3 * DIM if variant == "kjt" else 2 * DIM
        self.tower = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))

    def pooled(self, ids: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor
               ) -> torch.Tensor:
        v = self.variant
        if v == "padding_mean":  # ids [B, L], 0 = pad
            mask = (ids != 0).unsqueeze(-1).float()
            return (self.table(ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        if v == "unpad":
            keep = ids != 0
            offsets = F.pad(torch.cumsum(keep.sum(1), 0)[:-1], (1, 0))
            return self.table(ids[keep], offsets)
        if v == "raw_param":
            mask = (ids != 0).unsqueeze(-1).float()
            return (F.embedding(ids, self.table) * mask).sum(1)
        if v == "lengths_pad":
            offsets = F.pad(torch.cumsum(lengths, dim=0), (1, 0))
            return self.table(ids, offsets)
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)[:-1]])
        if v == "psw":
            return self.table(ids, offsets, per_sample_weights=weights)
        return self.table(ids, offsets)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor,
                item: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if self.variant == "shared":
            x = torch.cat([self.pooled(ids, lengths, weights), self.table(item.view(-1, 1))], 1)
        else:
            x = torch.cat([self.pooled(ids, lengths, weights), self.item(item)], 1)
        return F.binary_cross_entropy_with_logits(self.tower(x).squeeze(-1), label)


class KJTModel(SparseModel):
    """The batch is ``{feature: (values, lengths)}`` as a KeyedJaggedTensor hands it over."""

    def forward(self, features: dict[str, tuple[torch.Tensor, torch.Tensor]],  # type: ignore[override]
                item: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        pooled = []
        for name, (values, lengths) in features.items():
            offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
            pooled.append(self.tables[name](values, offsets))
        x = torch.cat([*pooled, self.item(item)], 1)
        return F.binary_cross_entropy_with_logits(self.tower(x).squeeze(-1), label)


def _jagged(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    lengths[0] = 0  # an empty bag
    return torch.randint(1, ROWS, (int(lengths.sum()),), generator=g), lengths


def make_batch_for(variant: str, cpu_batch: bool = True):  # noqa: ANN201
    """``cpu_batch=False``: the batch is made under whatever default device is current (gemc
    builds under ``torch.device("meta")``, where ``int(lengths.sum())`` has no value)."""
    def make_batch(step: int, device: torch.device | str) -> tuple:
        if not cpu_batch:
            return _make(step, device)
        with torch.device("cpu"):  # a data pipeline's batch is real (gemc builds on meta)
            return _make(step, device)

    def _make(step: int, device: torch.device | str) -> tuple:
        g = torch.Generator().manual_seed(31 + step)
        item = torch.randint(0, ROWS, (B,), generator=g)
        label = (torch.rand(B, generator=g) < 0.4).float()
        if variant == "kjt":
            feats = {f: tuple(t.to(device) for t in _jagged(g)) for f in ("clicks", "tags")}
            return feats, item.to(device), label.to(device)
        ids, lengths = _jagged(g)
        if variant in ("padding_mean", "raw_param", "unpad"):
            ids = torch.randint(1, ROWS, (B, L), generator=g)
            ids = ids * (torch.arange(L)[None, :] < lengths[:, None])
        # fixed shapes across steps: pad the flat ids to B * L with an extra last bag
        weights = torch.rand(ids.shape, generator=g)
        out = (ids, lengths, weights, item, label)
        if variant == "int32":
            out = (ids.int(), lengths.int(), weights, item.int(), label)
        return tuple(t.to(device) for t in out)
    return make_batch


def build(variant: str = "bag_mean", cpu_batch: bool = True) -> ModelSpec:
    assert variant in VARIANTS, variant
    torch.manual_seed(0)
    model = KJTModel(variant) if variant == "kjt" else SparseModel(variant)
    mb = make_batch_for(variant, cpu_batch)
    return ModelSpec(model=model, example_inputs=mb(0, "cpu"), make_batch=mb, batch_size=B)
