"""SASRec / BERT4Rec in the RecBole style (Kang & McAuley 2018; Sun et al. 2019).

``item_seq`` is left-aligned, 0 = padding, with ``item_seq_len``. An item embedding
(``padding_idx=0``) plus a position embedding, LayerNorm, then
``nn.TransformerEncoder(nn.TransformerEncoderLayer(norm_first=True, batch_first=True,
activation="gelu"))``. ``mask``:

* ``"pad"`` (BERT4Rec, bidirectional): ``src_key_padding_mask = item_seq == 0``;
  ``"pad_left"`` the same with the history left-padded (pmixer/SASRec.pytorch's layout),
  the last position read;
* ``"causal"`` (SASRec): ``mask=nn.Transformer.generate_square_subsequent_mask(L)`` and the
  padding mask;
* ``"causal_hinted"``: the same with ``is_causal=False`` given; ``"causal_only"``: the
  causal mask, ``is_causal=False``, no padding mask;
* ``"is_causal"``: the causal mask with ``is_causal=True`` and no padding mask.

``readout="last"`` (RecBole): the last real position is gathered with ``gather_indexes(output,
item_seq_len - 1)``; the loss is CE over all items (``logits = seq_output @ item_emb.weight.T``).
``readout="positions"`` (SASRec's own objective, as in Kang & McAuley's code): the padded
positions' outputs zeroed (``out * ~pad``), every position scores its next item, and the BCE
is averaged over the real positions only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, L, ITEMS, H, HEADS, LAYERS = 8, 6, 50, 16, 2, 2


class SeqRec(nn.Module):
    def __init__(self, mask: str, dropout: float = 0.0, readout: str = "last") -> None:
        super().__init__()
        self.mask, self.readout = mask, readout
        self.dropout = nn.Dropout(dropout)
        self.item_embedding = nn.Embedding(ITEMS, H, padding_idx=0)
        self.position_embedding = nn.Embedding(L, H)
        self.layer_norm = nn.LayerNorm(H, eps=1e-12)
        layer = nn.TransformerEncoderLayer(H, HEADS, dim_feedforward=2 * H, dropout=dropout,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)

    @staticmethod
    def gather_indexes(output: torch.Tensor, gather_index: torch.Tensor) -> torch.Tensor:
        gather_index = gather_index.view(-1, 1, 1).expand(-1, -1, output.shape[-1])
        output_tensor = output.gather(dim=1, index=gather_index)
        return output_tensor.squeeze(1)

    def forward(self, item_seq: torch.Tensor, item_seq_len: torch.Tensor,
                pos_items: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(item_seq.size(1), dtype=torch.long, device=item_seq.device)
        position_ids = position_ids.unsqueeze(0).expand_as(item_seq)
        x = self.item_embedding(item_seq) + self.position_embedding(position_ids)
        x = self.dropout(self.layer_norm(x))
        pad = item_seq == 0
        seq_len = item_seq.size(1)
        if self.mask in ("pad", "pad_left"):
            out = self.encoder(x, src_key_padding_mask=pad)
        elif self.mask == "causal":
            causal = nn.Transformer.generate_square_subsequent_mask(seq_len, device=x.device)
            out = self.encoder(x, mask=causal, src_key_padding_mask=pad)
        elif self.mask == "causal_hinted":  # the hint given: no mask comparison
            causal = nn.Transformer.generate_square_subsequent_mask(seq_len, device=x.device)
            out = self.encoder(x, mask=causal, src_key_padding_mask=pad, is_causal=False)
        elif self.mask == "causal_only":
            causal = nn.Transformer.generate_square_subsequent_mask(seq_len, device=x.device)
            out = self.encoder(x, mask=causal, is_causal=False)
        else:
            causal = nn.Transformer.generate_square_subsequent_mask(seq_len, device=x.device)
            out = self.encoder(x, mask=causal, is_causal=True)
        if self.readout == "positions":  # pos_items: [B, L], each position's next item
            out = out * (~pad).unsqueeze(-1)
            logits = (out * self.item_embedding(pos_items)).sum(-1)
            loss = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits),
                                                      reduction="none")
            real = (~pad).float()
            return (loss * real).sum() / real.sum()
        last = item_seq_len - 1 if self.mask != "pad_left" else torch.full_like(
            item_seq_len, seq_len - 1)
        seq_output = self.gather_indexes(out, last)
        logits = torch.matmul(seq_output, self.item_embedding.weight.transpose(0, 1))
        return F.cross_entropy(logits, pos_items)


def build(mask: str = "causal", seed: int = 0, dropout: float = 0.0,
          readout: str = "last", left_padded: bool = False,
          overcount_step: int = -1) -> ModelSpec:
    """``dropout``: RecBole's hidden and attention dropout (its default 0.5; 0 here so the
    losses compare with eager exactly). ``left_padded``: the history at the end of the row
    whatever the mask (``"pad_left"`` always is). ``overcount_step``: at that step the
    loader reports the first history's length one too long (it counted an item it then
    dropped), so ``gather_indexes`` reads a padding position there, as RecBole would."""
    torch.manual_seed(seed)
    model = SeqRec(mask, dropout, readout)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1000 * seed + step)
        lengths = torch.randint(1, L + 1, (B,), generator=g)
        lengths[0], lengths[1] = 1, L
        real = torch.arange(L)[None, :] < lengths[:, None]
        if mask == "pad_left" or left_padded:  # pmixer/SASRec.pytorch's layout: at the end
            real = real.flip(1)
        seq = torch.randint(1, ITEMS, (B, L), generator=g) * real
        pos = torch.randint(1, ITEMS, (B,) if readout == "last" else (B, L), generator=g)
        if step == overcount_step:
            lengths[0] += 1  # the history itself (seq) keeps one item
        return seq.to(device), lengths.to(device), pos.to(device)

    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=B)
