"""BERT4Rec's cloze training in the RecBole style (Sun et al., CIKM 2019).

A share of each history's real items is replaced by a ``[mask]`` token in the forward
(``item_seq.masked_fill(masked, mask_token)``: ids the model computes), a bidirectional
``nn.TransformerEncoder`` under ``src_key_padding_mask = item_seq == 0`` reads them, and
the loss is a full softmax over the real items at every position,
``logits = out @ item_embedding.weight[:n_items].T`` (the tied table *sliced*: the mask
token's row is no item), with ``F.cross_entropy(..., ignore_index=-100)`` on the positions
that were not masked.

The padding row (``padding_idx=0``) gets no gradient from the lookups but does from the
projection, as every row of the softmax does: eager PyTorch updates it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, L, ITEMS, H, HEADS = 8, 6, 40, 16, 2
MASK_TOKEN = ITEMS  # the table has ITEMS + 1 rows


class BERT4Rec(nn.Module):
    def __init__(self, targets: str) -> None:
        super().__init__()
        self.targets = targets
        self.n_items = ITEMS
        self.item_embedding = nn.Embedding(ITEMS + 1, H, padding_idx=0)
        self.position_embedding = nn.Embedding(L, H)
        self.layer_norm = nn.LayerNorm(H, eps=1e-12)
        layer = nn.TransformerEncoderLayer(H, HEADS, 2 * H, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.trm_encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.output_bias = nn.Parameter(torch.zeros(ITEMS))

    def forward(self, item_seq: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        labels = item_seq.masked_fill(~masked, -100) if self.targets == "masked" else item_seq
        inputs = item_seq.masked_fill(masked, MASK_TOKEN)
        positions = torch.arange(item_seq.size(1), device=item_seq.device).unsqueeze(0)
        x = self.layer_norm(self.item_embedding(inputs) + self.position_embedding(positions))
        out = self.trm_encoder(x, src_key_padding_mask=item_seq == 0)
        test_item_emb = self.item_embedding.weight[: self.n_items]
        logits = out @ test_item_emb.transpose(0, 1) + self.output_bias
        return F.cross_entropy(logits.view(-1, self.n_items), labels.view(-1),
                               ignore_index=-100)


def build(seed: int = 0, targets: str = "masked") -> ModelSpec:
    """``targets="all"``: every position predicts its own item, padding included (the
    padding id 0 a class of the softmax, as ports without ``ignore_index`` have it): the
    tied table's padding row then gets a large gradient from the projection."""
    torch.manual_seed(seed)
    model = BERT4Rec(targets)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        with torch.device("cpu"):
            g = torch.Generator().manual_seed(1000 * seed + step)
            lengths = torch.randint(1, L + 1, (B,), generator=g)
            real = torch.arange(L)[None, :] < lengths[:, None]
            seq = torch.randint(1, ITEMS, (B, L), generator=g) * real
            masked = (torch.rand(B, L, generator=g) < 0.3) & real
            masked[torch.arange(B), lengths - 1] = True  # the last item is always a target
            return seq.to(device), masked.to(device)

    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=B)
