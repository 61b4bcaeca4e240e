"""A batch that is a dict of features with a jagged history, in torch.nested's idiom.

``form="pairs"``: the dict holds ``(values, offsets)`` and the forward makes
``torch.nested.nested_tensor_from_jagged(emb(values), offsets)``, pools each sequence
(``to_padded_tensor`` and a masked mean). ``form="nested"``: the dict holds the
``torch.nested.nested_tensor(..., layout=torch.jagged)`` of ids itself. ``"bag"`` and
``"index_put"``: the rewrites gemc's error names, on the same ``(values, offsets)``;
``"numel"`` divides by ``values.numel()``, a size the captured graph holds as a constant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, MAXLEN, ITEMS, D = 4, 5, 30, 8


class JaggedPool(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.item_emb = nn.Embedding(ITEMS, D)
        self.item_bag = nn.EmbeddingBag(ITEMS, D, mode="mean", include_last_offset=True)
        self.user_emb = nn.Embedding(ITEMS, D)
        self.tower = nn.Sequential(nn.Linear(2 * D, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.form == "numel":  # a size read from the input: the batch's mean item
            values = batch["hist_values"]
            pooled = (self.item_emb(values).sum(0) / values.numel()).expand(B, -1)
        elif self.form == "bag":  # the rewrite gemc's error names: a mean-pooled bag
            pooled = self.item_bag(batch["hist_values"], batch["hist_offsets"])
        elif self.form == "index_put":  # or padded by index_put, as hstu.py does
            values, offsets = batch["hist_values"], batch["hist_offsets"]
            lengths = offsets[1:] - offsets[:-1]
            row = torch.repeat_interleave(torch.arange(B, device=values.device), lengths,
                                          output_size=values.numel())
            col = torch.arange(values.numel(), device=values.device) - offsets[:-1][row]
            padded = self.item_emb(values).new_zeros(B, MAXLEN, D).index_put(
                (row, col), self.item_emb(values))
            pooled = padded.sum(1) / lengths.clamp(min=1).unsqueeze(-1)
        else:
            if self.form == "pairs":
                offsets = batch["hist_offsets"]
                nt = torch.nested.nested_tensor_from_jagged(
                    self.item_emb(batch["hist_values"]), offsets)
            else:
                nt = self.item_emb(batch["hist"])  # embedding of a jagged nested tensor
                offsets = nt.offsets()
            padded = nt.to_padded_tensor(0.0)  # [B, max_len, D]
            lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).unsqueeze(-1)
            pooled = padded.sum(1) / lengths
        x = torch.cat([pooled, self.user_emb(batch["user"])], dim=-1)
        logit = self.tower(x).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logit, batch["label"])


def build(form: str = "pairs", seed: int = 0, cpu_batch: bool = True) -> ModelSpec:
    """``cpu_batch=False``: the batch is made under the caller's default device, which is
    meta while gemc compiles (its ``int(offsets[-1])`` then has no value to read)."""
    torch.manual_seed(seed)
    model = JaggedPool(form)

    def make_batch(step: int, device: torch.device | str) -> tuple[dict[str, torch.Tensor]]:
        if not cpu_batch:
            return _batch(form, step, seed, device)
        with torch.device("cpu"):
            return _batch(form, step, seed, device)

    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=B)


def _batch(form: str, step: int, seed: int,
       device: torch.device | str) -> tuple[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * seed + step)
    lengths = torch.randint(1, MAXLEN + 1, (B,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    values = torch.randint(0, ITEMS, (int(offsets[-1]),), generator=g)
    batch = {"user": torch.randint(0, ITEMS, (B,), generator=g),
             "label": (torch.rand(B, generator=g) < 0.4).float()}
    if form != "nested":
        batch.update(hist_values=values, hist_offsets=offsets)
    else:
        batch["hist"] = torch.nested.nested_tensor_from_jagged(values, offsets)
    return ({k: v.to(device) for k, v in batch.items()},)
