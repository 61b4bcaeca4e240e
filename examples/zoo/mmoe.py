"""MMoE multi-task ranking over a causal-transformer user history, fed a dataclass batch.

Follows "Modeling Task Relationships in Multi-task Learning with Multi-gate
Mixture-of-Experts" (Ma et al., KDD 2018): shared experts, one softmax gate and one tower
per task, here click / like / finish (three BCE labels, summed). The user's history is
encoded as in SASRec (Kang & McAuley, ICDM 2018) with pre-LN Transformer blocks written
with ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``: the history is
right-padded, so under a causal mask no real position ever sees a pad. The candidate item
then attends over the encoded history with a BERT-style **additive float mask**
``(1.0 - mask) * -10000.0`` (finite, so an empty history gives a uniform, not a NaN, row), as
DIN/BST-style target attention is commonly written with SDPA.

The model takes its batch the way training loops pass one: a ``@dataclass RankingBatch``
whose ``labels`` field is a ``dict[str, Tensor]`` of task labels. ``build`` wraps it in
``FlatBatch``, whose ``forward(*tensors)`` rebuilds the dataclass from a flat tuple (the
order is ``RankingBatch.flatten``'s), because gemc's contract is a flat tuple of tensors.

Idioms carried (issue #15): a dataclass batch with a dict of labels flattened by the
entrypoint; labels for several tasks; ``F.scaled_dot_product_attention(is_causal=True)``;
an additive float mask; lengths as the jagged input; parameters created in ``__init__``
(``nn.Parameter`` position table and the candidate query projection, ``nn.init.*``) without
``reset_parameters``; example inputs built with ``device="cpu"``.

Input layout (``RankingBatch.flatten``): ``user_id`` int64 [B]; ``item_id`` int64 [B];
``context`` int64 [B, C]; ``history`` int64 [B, L] (0 past the length); ``history_len`` int64
[B]; then one f32 [B] label per task in ``TASKS`` order.

Presets
-------
``tiny``: B=8, L=8, d=16, 2 heads, 1 block, 4 experts of 16, towers 8.
``h200``: B=2048, L=256 (50% mean fill), d=256, 4 heads, 2 blocks (MLP 4x), users 4,000,000 x
    64, items 2,000,000 x 256, 8 context fields of 100,000 x 32, 8 experts 832-1024-512, towers
    512-256-1: 806,748,443 parameters. Measured (``torch.utils.flop_counter`` on meta, matmuls
    and attention only): 1.972 TFLOP forward, 5.915 TFLOP forward + backward. FLOP/step (fwd+bwd
    = 3 x fwd): the history blocks 2 x 2 x 524,288 tokens x 786k MACs + 4 x B x L^2 x d
    attention = 1.8 TFLOP fwd, experts and towers ~0.05 TFLOP -> ~5.5 TFLOP per step, ~11 ms at
    500 TFLOP/s. Memory: 0.8e9 x 16 B = 13 GB; activations ~10 GB (the [B, L, 4d] MLP
    activations dominate).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

TASKS = ("click", "like", "finish")


@dataclass
class RankingBatch:
    user_id: torch.Tensor
    item_id: torch.Tensor
    context: torch.Tensor
    history: torch.Tensor
    history_len: torch.Tensor
    labels: dict[str, torch.Tensor]

    def flatten(self) -> tuple[torch.Tensor, ...]:
        head = tuple(getattr(self, f.name) for f in fields(self) if f.name != "labels")
        return head + tuple(self.labels[t] for t in TASKS)

    @classmethod
    def unflatten(cls, flat: tuple[torch.Tensor, ...]) -> RankingBatch:
        head = flat[:5]
        return cls(*head, labels=dict(zip(TASKS, flat[5:], strict=True)))

    def to(self, device: torch.device | str) -> RankingBatch:
        return RankingBatch(self.user_id.to(device), self.item_id.to(device),
                            self.context.to(device), self.history.to(device),
                            self.history_len.to(device),
                            {k: v.to(device) for k, v in self.labels.items()})


@dataclass(frozen=True)
class Config:
    batch_size: int
    max_len: int
    d: int
    num_heads: int
    num_blocks: int
    num_users: int
    user_dim: int
    num_items: int
    context_fields: int
    context_rows: int
    context_dim: int
    num_experts: int
    expert_hidden: tuple[int, ...]
    tower_hidden: int


PRESETS = {
    "tiny": Config(8, 8, 16, 2, 1, 50, 8, 100, 3, 20, 4, 4, (16,), 8),
    "h200": Config(2048, 256, 256, 4, 2, 4_000_000, 64, 2_000_000, 8, 100_000, 32, 8,
                   (1024, 512), 256),
}


class CausalBlock(nn.Module):
    """Pre-LN Transformer block, causal self-attention through SDPA."""

    def __init__(self, d: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape  # noqa: N806
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q = q.view(B, L, self.num_heads, D // self.num_heads).transpose(1, 2)
        k = k.view(B, L, self.num_heads, D // self.num_heads).transpose(1, 2)
        v = v.view(B, L, self.num_heads, D // self.num_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, L, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MMoE(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d
        self.user_emb = nn.Embedding(cfg.num_users, cfg.user_dim)
        self.item_emb = nn.Embedding(cfg.num_items + 1, d)
        self.context_emb = nn.ModuleList(
            nn.Embedding(cfg.context_rows, cfg.context_dim) for _ in range(cfg.context_fields))
        for table in [self.user_emb, self.item_emb, *self.context_emb]:
            nn.init.normal_(table.weight, std=0.02)
        self.pos = nn.Parameter(torch.zeros(1, cfg.max_len, d))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(CausalBlock(d, cfg.num_heads) for _ in range(cfg.num_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.target_q = nn.Parameter(torch.empty(d, d))
        nn.init.xavier_uniform_(self.target_q)

        in_dim = cfg.user_dim + 2 * d + cfg.context_fields * cfg.context_dim
        self.experts = nn.ModuleList()
        for _ in range(cfg.num_experts):
            dims = [in_dim, *cfg.expert_hidden]
            layers: list[nn.Module] = []
            for a, b in zip(dims, dims[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            self.experts.append(nn.Sequential(*layers))
        self.gates = nn.ModuleDict({t: nn.Linear(in_dim, cfg.num_experts) for t in TASKS})
        self.towers = nn.ModuleDict({
            t: nn.Sequential(nn.Linear(cfg.expert_hidden[-1], cfg.tower_hidden), nn.ReLU(),
                             nn.Linear(cfg.tower_hidden, 1))
            for t in TASKS
        })

    def encode_history(self, batch: RankingBatch, target: torch.Tensor) -> torch.Tensor:
        x = self.item_emb(batch.history) + self.pos
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        L = batch.history.size(1)  # noqa: N806
        mask = (torch.arange(L, device=x.device)[None, :] < batch.history_len[:, None]).float()
        attn_mask = ((1.0 - mask) * -10000.0)[:, None, None, :]  # [B, 1, 1, L]
        q = (target @ self.target_q)[:, None, None, :]  # one query head over the full width
        pooled = F.scaled_dot_product_attention(q, x.unsqueeze(1), x.unsqueeze(1),
                                                attn_mask=attn_mask)
        return pooled.view(x.size(0), -1)

    def forward(self, batch: RankingBatch) -> torch.Tensor:
        target = self.item_emb(batch.item_id)
        features = torch.cat(
            [self.user_emb(batch.user_id), target, self.encode_history(batch, target)]
            + [emb(batch.context[:, i]) for i, emb in enumerate(self.context_emb)],
            dim=-1,
        )
        expert_out = torch.stack([e(features) for e in self.experts], dim=1)  # [B, E, H]
        loss = features.new_zeros(())
        for task in TASKS:
            gate = F.softmax(self.gates[task](features), dim=-1)  # [B, E]
            mixed = torch.einsum("be,beh->bh", gate, expert_out)
            logit = self.towers[task](mixed).squeeze(-1)
            loss = loss + F.binary_cross_entropy_with_logits(logit, batch.labels[task])
        return loss


class FlatBatch(nn.Module):
    """gemc's flat-tuple contract around a model that takes a ``RankingBatch``."""

    def __init__(self, model: MMoE) -> None:
        super().__init__()
        self.model = model

    def forward(self, *flat: torch.Tensor) -> torch.Tensor:
        return self.model(RankingBatch.unflatten(flat))


def synthetic_batch(cfg: Config, step: int, seed: int = 0) -> RankingBatch:
    """A ``RankingBatch`` on the CPU: 50% history fill (one empty and one full row)."""
    g = torch.Generator(device="cpu").manual_seed(1_000_003 * seed + step)
    b, length = cfg.batch_size, cfg.max_len

    def ids(high: int, shape: tuple[int, ...], low: int = 0) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=g, device="cpu")

    history_len = ids(length + 1, (b,))
    history_len[0], history_len[1] = 0, length
    valid = torch.arange(length, device="cpu")[None, :] < history_len[:, None]
    click = torch.rand(b, generator=g, device="cpu") < 0.3
    like = click & (torch.rand(b, generator=g, device="cpu") < 0.3)
    finish = torch.rand(b, generator=g, device="cpu") < 0.5
    return RankingBatch(
        user_id=ids(cfg.num_users, (b,)),
        item_id=ids(cfg.num_items + 1, (b,), low=1),
        context=ids(cfg.context_rows, (b, cfg.context_fields)),
        history=ids(cfg.num_items + 1, (b, length), low=1) * valid,
        history_len=history_len,
        labels={"click": click.float(), "like": like.float(), "finish": finish.float()},
    )


def build(preset: str = "tiny", batch_size: int | None = None, seed: int = 0) -> ModelSpec:
    """MMoE over a causal-transformer history at ``preset`` ("tiny" or "h200")."""
    cfg = PRESETS[preset]
    if batch_size is not None:
        cfg = replace(cfg, batch_size=batch_size)
    torch.manual_seed(seed)
    model = FlatBatch(MMoE(cfg))

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        return synthetic_batch(cfg, step, seed).to(device).flatten()

    info = {"preset": preset, "model": "mmoe", "batch_size": cfg.batch_size,
            "tasks": list(TASKS), "max_len": cfg.max_len}
    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=cfg.batch_size, info=info)
