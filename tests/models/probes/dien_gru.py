"""DIEN-like interest extractor (Zhou et al., AAAI 2019): ``nn.GRU(batch_first=True)`` over
a padded behaviour history, the final state with the target item into an MLP.

``packed=False`` runs the GRU on the padded tensor and picks the state at ``length - 1``;
``packed=True`` packs it the way most DIEN ports do,
``pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)``, and
takes ``h_n``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from gemc.spec import ModelSpec

B, L, ITEMS, D, HID = 8, 6, 40, 8, 12


class InterestExtractor(nn.Module):
    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.packed = packed
        self.item_emb = nn.Embedding(ITEMS, D, padding_idx=0)
        self.gru = nn.GRU(D, HID, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(HID + D, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, hist: torch.Tensor, lengths: torch.Tensor, target: torch.Tensor,
                label: torch.Tensor) -> torch.Tensor:
        x = self.item_emb(hist)
        if self.packed:
            packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True,
                                          enforce_sorted=False)
            _, h_n = self.gru(packed)
            interest = h_n[-1]
        else:
            out, _ = self.gru(x)
            idx = (lengths - 1).view(-1, 1, 1).expand(-1, 1, out.size(-1))
            interest = out.gather(1, idx).squeeze(1)
        logit = self.mlp(torch.cat([interest, self.item_emb(target)], dim=-1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logit, label)


def build(packed: bool = False, seed: int = 0) -> ModelSpec:
    torch.manual_seed(seed)
    model = InterestExtractor(packed)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1000 * seed + step)
        lengths = torch.randint(1, L + 1, (B,), generator=g)
        real = torch.arange(L)[None, :] < lengths[:, None]
        hist = torch.randint(1, ITEMS, (B, L), generator=g) * real
        target = torch.randint(1, ITEMS, (B,), generator=g)
        label = (torch.rand(B, generator=g) < 0.4).float()
        return tuple(t.to(device) for t in (hist, lengths, target, label))

    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=B)
