"""TiSASRec (Li, Wang & McAuley, WSDM 2020) in the style of its PyTorch port
(pmixer/TiSASRec.pytorch).

The history ``log_seqs`` is LEFT-padded (0 = padding, the newest item last); the loader
computes the time-interval relation matrix: each user's timestamps are rescaled by their
smallest gap, and ``|t_i - t_j|`` is clamped at ``time_span`` (``relation="input"``: an int
``[B, L, L]`` batch tensor). ``relation="forward"`` computes the same clamped pairwise matrix
inside the forward from the ``[B, L]`` timestamps.

Each layer's ``TimeAwareMultiHeadAttention`` splits heads with
``torch.cat(torch.split(Q, head_size, dim=2), dim=0)`` (HEAD-major ``[H*B, L, d]``, as
SASRec's TF code), adds three score terms -- ``Q K^T``, ``Q absK^T`` (absolute position
keys) and the time-interval keys ``time_K @ Q`` (``[B, L, L, d]`` x ``[B, L, d, 1]``) --
scales by ``sqrt(d)``, blanks padding keys and future keys with ``torch.where(mask,
-2**32 + 1, w)``, softmax, and reads values the same three ways. The loss is the per-position
BCE over positive / negative next items, masked where ``pos == 0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec
from tests.models.probes.data import padded_history

B, L, ITEMS, H, HEADS, BLOCKS, SPAN = 6, 5, 30, 8, 2, 1, 4


class TimeAwareMultiHeadAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.Q_w = nn.Linear(hidden, hidden)
        self.K_w = nn.Linear(hidden, hidden)
        self.V_w = nn.Linear(hidden, hidden)
        self.head_num = heads
        self.head_size = hidden // heads

    def forward(self, queries, keys, time_mask, attn_mask, time_matrix_K, time_matrix_V,
                abs_pos_K, abs_pos_V):
        Q, K, V = self.Q_w(queries), self.K_w(keys), self.V_w(keys)
        Q_ = torch.cat(torch.split(Q, self.head_size, dim=2), dim=0)
        K_ = torch.cat(torch.split(K, self.head_size, dim=2), dim=0)
        V_ = torch.cat(torch.split(V, self.head_size, dim=2), dim=0)
        time_matrix_K_ = torch.cat(torch.split(time_matrix_K, self.head_size, dim=3), dim=0)
        time_matrix_V_ = torch.cat(torch.split(time_matrix_V, self.head_size, dim=3), dim=0)
        abs_pos_K_ = torch.cat(torch.split(abs_pos_K, self.head_size, dim=2), dim=0)
        abs_pos_V_ = torch.cat(torch.split(abs_pos_V, self.head_size, dim=2), dim=0)

        attn_weights = Q_.matmul(torch.transpose(K_, 1, 2))
        attn_weights += Q_.matmul(torch.transpose(abs_pos_K_, 1, 2))
        attn_weights += time_matrix_K_.matmul(Q_.unsqueeze(-1)).squeeze(-1)
        attn_weights = attn_weights / (K_.shape[-1] ** 0.5)

        time_mask = time_mask.unsqueeze(-1).repeat(self.head_num, 1, 1)
        time_mask = time_mask.expand(-1, -1, attn_weights.shape[-1])
        attn_mask = attn_mask.unsqueeze(0).expand(attn_weights.shape[0], -1, -1)
        paddings = torch.ones(attn_weights.shape, device=attn_weights.device) * (-2**32 + 1)
        attn_weights = torch.where(time_mask, paddings, attn_weights)
        attn_weights = torch.where(attn_mask, paddings, attn_weights)
        attn_weights = F.softmax(attn_weights, dim=-1)

        outputs = attn_weights.matmul(V_)
        outputs += attn_weights.matmul(abs_pos_V_)
        outputs += attn_weights.unsqueeze(2).matmul(time_matrix_V_).reshape(
            outputs.shape).squeeze(2)
        outputs = torch.cat(torch.split(outputs, Q.shape[0], dim=0), dim=2)
        return outputs


class TiSASRec(nn.Module):
    def __init__(self, relation: str) -> None:
        super().__init__()
        self.relation = relation
        self.item_emb = nn.Embedding(ITEMS + 1, H, padding_idx=0)
        self.abs_pos_K_emb = nn.Embedding(L, H)
        self.abs_pos_V_emb = nn.Embedding(L, H)
        self.time_matrix_K_emb = nn.Embedding(SPAN + 1, H)
        self.time_matrix_V_emb = nn.Embedding(SPAN + 1, H)
        self.attention_layernorms = nn.ModuleList()
        self.attention_layers = nn.ModuleList()
        self.forward_layernorms = nn.ModuleList()
        self.forward_layers = nn.ModuleList()
        for _ in range(BLOCKS):
            self.attention_layernorms.append(nn.LayerNorm(H, eps=1e-8))
            self.attention_layers.append(TimeAwareMultiHeadAttention(H, HEADS))
            self.forward_layernorms.append(nn.LayerNorm(H, eps=1e-8))
            self.forward_layers.append(nn.Sequential(nn.Conv1d(H, H, 1), nn.ReLU(),
                                                     nn.Conv1d(H, H, 1)))
        self.last_layernorm = nn.LayerNorm(H, eps=1e-8)

    def seq2feats(self, log_seqs, time_matrices):
        seqs = self.item_emb(log_seqs) * self.item_emb.embedding_dim ** 0.5
        positions = torch.arange(log_seqs.shape[1], device=log_seqs.device)
        positions = positions.unsqueeze(0).expand(log_seqs.shape[0], -1)
        abs_pos_K = self.abs_pos_K_emb(positions)
        abs_pos_V = self.abs_pos_V_emb(positions)
        time_matrix_K = self.time_matrix_K_emb(time_matrices)
        time_matrix_V = self.time_matrix_V_emb(time_matrices)

        timeline_mask = log_seqs == 0
        seqs = seqs * ~timeline_mask.unsqueeze(-1)
        tl = seqs.shape[1]
        attention_mask = ~torch.tril(torch.ones((tl, tl), dtype=torch.bool,
                                                device=seqs.device))
        for i in range(len(self.attention_layers)):
            Q = self.attention_layernorms[i](seqs)
            mha_outputs = self.attention_layers[i](Q, seqs, timeline_mask, attention_mask,
                                                   time_matrix_K, time_matrix_V,
                                                   abs_pos_K, abs_pos_V)
            seqs = Q + mha_outputs
            seqs = self.forward_layernorms[i](seqs)
            seqs = seqs + self.forward_layers[i](seqs.transpose(-1, -2)).transpose(-1, -2)
            seqs = seqs * ~timeline_mask.unsqueeze(-1)
        return self.last_layernorm(seqs)

    def forward(self, log_seqs, time_seqs, pos_seqs, neg_seqs):
        if self.relation == "forward":  # the loader's clamped |t_i - t_j|, in the model
            gaps = (time_seqs[:, :, None] - time_seqs[:, None, :]).abs()
            time_matrices = torch.clamp(gaps, max=SPAN)
        else:
            time_matrices = time_seqs
        feats = self.seq2feats(log_seqs, time_matrices)
        pos_logits = (feats * self.item_emb(pos_seqs)).sum(dim=-1)
        neg_logits = (feats * self.item_emb(neg_seqs)).sum(dim=-1)
        istarget = (pos_seqs != 0).float()
        loss = (F.binary_cross_entropy_with_logits(pos_logits, torch.ones_like(pos_logits),
                                                   reduction="none")
                + F.binary_cross_entropy_with_logits(neg_logits, torch.zeros_like(neg_logits),
                                                     reduction="none"))
        return (loss * istarget).sum() / istarget.sum()


def build(relation: str = "input", seed: int = 0) -> ModelSpec:
    torch.manual_seed(seed)
    model = TiSASRec(relation)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        g, real, seq = padded_history(step, seed, B, L, ITEMS + 1, first=(1, L))
        real, seq = real.flip(1), seq.flip(1)  # left-padded: the newest item last
        with torch.device("cpu"):
            pos = torch.randint(1, ITEMS + 1, (B, L), generator=g) * real
            neg = torch.randint(1, ITEMS + 1, (B, L), generator=g) * real
            stamps = torch.cumsum(torch.randint(0, 3, (B, L), generator=g), 1) * real
            if relation == "forward":
                time = stamps
            else:
                time = (stamps[:, :, None] - stamps[:, None, :]).abs().clamp(max=SPAN)
        return tuple(t.to(device) for t in (seq, time, pos, neg))

    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=B)
