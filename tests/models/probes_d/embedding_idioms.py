"""nn.Embedding / nn.EmbeddingBag options as a Criteo-style CTR model sets them per field.

One small model (a few categorical fields, their embeddings concatenated into an MLP,
``F.binary_cross_entropy_with_logits``) whose tables take one option at a time (``variant``):

* ``max_norm``: ``nn.Embedding(rows, dim, max_norm=1.0)``: eager renormalises the looked-up
  rows of the weight *in place* during forward (``torch.embedding_renorm_``);
* ``freq``: ``scale_grad_by_freq=True`` on a multi-hot field with repeated ids in a batch;
* ``pad_middle``: ``padding_idx`` in the middle of the table (an "unknown" id that is not 0);
* ``mixed_dims``: a different embedding dim per field (8, 6, 3), concatenated;
* ``hash``: raw int64 ids (up to 2**40) hashed into buckets by ``ids % num_buckets`` in
  forward (the hashing trick, a bucket count per field);
* ``init_pad``: RecBole's ``self.apply(self._init_weights)`` (``weight.data.normal_(0,
  0.02)`` on every ``nn.Embedding``, padding row included) on tables with ``padding_idx=0``,
  and a padded multi-hot field summed without a mask (the drawn padding row is in the sum);
* ``psw2d``: ``nn.EmbeddingBag(mode="sum")`` over a 2-D ``[B, L]`` id matrix (no offsets) with
  per-sample weights from the batch (a weighted multi-hot field, e.g. tag scores).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, L = 8, 4
FIELDS = {"user": 30, "item": 40, "cate": 12}
DIMS = {"user": 8, "item": 6, "cate": 3}
VARIANTS = ("max_norm", "freq", "pad_middle", "mixed_dims", "hash", "psw2d", "init_pad")
BIG = 2 ** 40


class CriteoStyle(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        dims = DIMS if variant == "mixed_dims" else dict.fromkeys(FIELDS, 4)
        self.buckets = {f: rows for f, rows in FIELDS.items()}
        kw: dict = {}
        if variant == "max_norm":
            kw["max_norm"] = 1.0
        self.emb = nn.ModuleDict()
        for f, rows in FIELDS.items():
            if variant == "pad_middle":
                self.emb[f] = nn.Embedding(rows, dims[f], padding_idx=rows // 2)
            elif variant == "init_pad":
                self.emb[f] = nn.Embedding(rows, dims[f], padding_idx=0)
            else:
                self.emb[f] = nn.Embedding(rows, dims[f], **kw)
        width = sum(dims.values())
        if variant == "freq":
            self.tags = nn.Embedding(20, 4, scale_grad_by_freq=True)
            width += 4
        if variant == "init_pad":
            self.tags = nn.Embedding(20, 4, padding_idx=0)
            width += 4
        if variant == "psw2d":
            self.tags = nn.EmbeddingBag(20, 4, mode="sum")
            width += 4
        self.mlp = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))
        if variant == "init_pad":
            self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)

    def forward(self, ids: torch.Tensor, tags: torch.Tensor, tag_w: torch.Tensor,
                label: torch.Tensor) -> torch.Tensor:
        embs = []
        for i, (f, table) in enumerate(self.emb.items()):
            col = ids[:, i]
            if self.variant == "hash":
                col = col % self.buckets[f]
            embs.append(table(col))
        if self.variant in ("freq", "init_pad"):
            embs.append(self.tags(tags).sum(1))
        if self.variant == "psw2d":
            embs.append(self.tags(tags, per_sample_weights=tag_w))
        logit = self.mlp(torch.cat(embs, dim=-1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logit, label)


def make_batch_for(variant: str):  # noqa: ANN201
    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(700 + step)
        with torch.device("cpu"):
            if variant == "hash":
                ids = torch.randint(0, BIG, (B, len(FIELDS)), generator=g)
            else:
                ids = torch.stack([torch.randint(0, r, (B,), generator=g)
                                   for r in FIELDS.values()], 1)
            if variant == "pad_middle":  # a quarter of the values are "unknown"
                pads = torch.tensor([r // 2 for r in FIELDS.values()])
                ids = torch.where(torch.rand(ids.shape, generator=g) < 0.25, pads, ids)
            tags = torch.randint(0, 5, (B, L), generator=g)  # few ids: repeats in a batch
            tag_w = torch.rand(B, L, generator=g)
            label = (torch.rand(B, generator=g) < 0.4).float()
        return tuple(t.to(device) for t in (ids, tags, tag_w, label))
    return make_batch


def build(variant: str = "max_norm") -> ModelSpec:
    assert variant in VARIANTS, variant
    torch.manual_seed(0)
    mb = make_batch_for(variant)
    return ModelSpec(model=CriteoStyle(variant), example_inputs=mb(0, "cpu"), make_batch=mb,
                     batch_size=B)
