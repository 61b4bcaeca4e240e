"""Small models with the patterns the kernel passes look for (CPU-sized)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

D, HEADS, L = 16, 2, 8


class JaggedSequence(nn.Module):
    """A jagged history padded by index_put, a pre-LN block (self-attention under a
    key-padding mask built from lengths, GELU MLP, residuals), a masked mean and a has_hist
    multiply: the GEM example's pattern, small.
    ``clamp``: the mask uses ``lengths.clamp(min=1)`` (empty histories allowed). ``leak``: the
    cross-attention query reads an unmasked mean over all positions, padding included (so
    jagged attention, which leaves padding rows zero, would change the result)."""

    def __init__(self, clamp: bool = True, leak: bool = False) -> None:
        super().__init__()
        self.clamp, self.leak = clamp, leak
        self.proj = nn.Linear(D, D)
        self.pos = nn.Parameter(torch.randn(L, D) * 0.1)
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.norm2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.q_ns = nn.Linear(D, D)
        self.head = nn.Linear(2 * D, 1)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
        b, n = offsets.shape[0] - 1, values.shape[0]
        lengths = offsets[1:] - offsets[:-1]
        row = torch.repeat_interleave(torch.arange(b, device=values.device), lengths,
                                      output_size=n)
        pos = torch.arange(n, device=values.device) - offsets[row]
        seq = values.new_zeros(b, L, D).index_put((row, pos), self.proj(values))
        attn_len = lengths.clamp(min=1) if self.clamp else lengths
        mask = torch.arange(L, device=values.device)[None, :] < attn_len[:, None]
        has = (lengths > 0).to(seq.dtype)[:, None, None]
        h = self.norm(seq + self.pos)
        q, k, v = self.qkv(h).view(b, L, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        seq = seq + self.out(a.transpose(1, 2).reshape(b, L, D))
        seq = seq + self.fc2(F.gelu(self.fc1(self.norm2(seq))))
        pooled = (seq * mask[:, :, None].to(seq.dtype)).sum(dim=1) / attn_len[:, None].to(
            seq.dtype) * has[:, :, 0]
        # cross-attention from a dense token: must stay SDPA
        summary = seq.mean(dim=1) if self.leak else pooled
        qn = self.q_ns(summary).view(b, 1, HEADS, D // HEADS).transpose(1, 2)
        c = F.scaled_dot_product_attention(qn, k, v, attn_mask=mask[:, None, None, :])
        ns = c.transpose(1, 2).reshape(b, D) * has[:, :, 0]
        out = self.head(torch.cat([pooled, ns], dim=1)).squeeze(-1)
        return F.mse_loss(out, labels)


def captured_lengths() -> Any:
    """Hypothesis strategy: history lengths (0 to L, so empty and full rows) of the
    captured batch's size and total, which the graph's static shapes hold."""
    from hypothesis import strategies as st

    return st.lists(st.integers(0, L), min_size=4, max_size=4).filter(lambda x: sum(x) == 12)


def jagged_batch(lengths: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)
    values = torch.randn(int(offsets[-1]), D, generator=gen)
    labels = torch.randn(len(lengths), generator=gen)
    return values, offsets, labels


def build_jagged(clamp: bool = True, leak: bool = False) -> ModelSpec:
    lengths = [3, 0, 8, 1]

    def batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in jagged_batch(lengths, torch.Generator().manual_seed(step)))

    example = (torch.zeros(sum(lengths), D), torch.tensor([0, 3, 3, 11, 12]), torch.zeros(4))
    return ModelSpec(model=JaggedSequence(clamp, leak), example_inputs=example,
                     make_batch=batch)


class MultiBag(nn.Module):
    """Three tables: sum and mean pooling, with and without the last offset, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(30, 8, mode="sum", include_last_offset=True)
        self.b = nn.EmbeddingBag(20, 4, mode="mean", include_last_offset=True)
        self.c = nn.EmbeddingBag(25, 8, mode="sum")  # offsets without the last one
        self.top = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ia: torch.Tensor, oa: torch.Tensor, ib: torch.Tensor, ob: torch.Tensor,
                ic: torch.Tensor, oc: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.a(ia, oa), self.b(ib, ob), self.c(ic, oc)], dim=1)
        return F.binary_cross_entropy_with_logits(self.top(x).squeeze(-1), labels)


BAGS = 5


def bag_batch(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Jagged bags with an empty bag in every table."""
    out: list[torch.Tensor] = []
    for rows, lengths, last in ((30, [2, 0, 3, 1, 4], True), (20, [1, 2, 0, 5, 1], True),
                                (25, [0, 1, 1, 2, 3], False)):
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        ids = torch.randint(0, rows, (int(offsets[-1]),), generator=gen)
        out += [ids, offsets if last else offsets[:-1]]
    out.append(torch.randint(0, 2, (BAGS,), generator=gen).float())
    return tuple(out)


def build_bags() -> ModelSpec:
    def batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in bag_batch(torch.Generator().manual_seed(step)))

    return ModelSpec(model=MultiBag(), example_inputs=bag_batch(torch.Generator().manual_seed(0)),
                     make_batch=batch)


class PaddedBag(nn.Module):
    """A bag with a padding index (ids equal to it are skipped): not batchable."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(30, 8, mode="sum", include_last_offset=True, padding_idx=0)
        self.top = nn.Linear(8, 1)

    def forward(self, ia: torch.Tensor, oa: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.top(self.a(ia, oa)).squeeze(-1), labels)


def build_padded_bag() -> ModelSpec:
    example = (torch.tensor([1, 2, 0]), torch.tensor([0, 2, 3]), torch.zeros(2))
    return ModelSpec(model=PaddedBag(), example_inputs=example,
                     make_batch=lambda step, device="cpu": example)


class PreNorm(nn.Module):
    """Residual blocks whose residual adds go to the GEMMs' epilogues, leaving the
    LayerNorms alone: ``norm`` feeds only a GEMM group's input (its output may be written in
    the autocast dtype), ``norm0`` feeds a GEMM and another GEMM's residual add (it may
    not); the last GEMM group's output feeds only a plain ``linear`` (the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm0 = nn.LayerNorm(D)
        self.mix = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n0 = self.norm0(x)
        h = x + self.mix(n0)
        y = n0 + self.fc2(F.gelu(self.fc1(self.norm(h))))
        return F.mse_loss(self.head(y).squeeze(-1).float(), labels)


def build_prenorm() -> ModelSpec:
    def batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        return (torch.randn(4, L, D, generator=gen).to(device),
                torch.randn(4, L, generator=gen).to(device))

    return ModelSpec(model=PreNorm(), example_inputs=batch(0), make_batch=batch)


class SelfResidual(nn.Module):
    """``n + proj(n)``: the GEMM group's epilogue reads the GEMM's own input."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n = x * 0.5
        y = n + self.proj(n)
        return F.mse_loss(self.head(y).squeeze(-1).float(), labels)


def build_self_residual() -> ModelSpec:
    def batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        return (torch.randn(4, L, D, generator=gen).to(device),
                torch.randn(4, L, generator=gen).to(device))

    return ModelSpec(model=SelfResidual(), example_inputs=batch(0), make_batch=batch)


class TokenMix(nn.Module):
    """Linears over the token axis, as Wukong writes them: on ``x.transpose(1, 2)``, with and
    without bias, one read back through a transpose, one through a bmm with ``x``."""

    def __init__(self, n: int = 6, d: int = 8, m: int = 4) -> None:
        super().__init__()
        self.mix = nn.Linear(n, m)
        self.fm = nn.Linear(n, 3, bias=False)
        self.head = nn.Linear(m * d + n * 3, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        xt = x.transpose(1, 2)  # [B, d, n]
        mixed = self.mix(xt).transpose(1, 2)  # [B, m, d]
        fm = torch.bmm(x, self.fm(xt))  # [B, n, 3]
        out = self.head(torch.cat([mixed.flatten(1), fm.flatten(1)], dim=1)).squeeze(-1)
        return F.mse_loss(out, labels)


def build_token_mix() -> ModelSpec:
    def batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        return (torch.randn(5, 6, 8, generator=gen).to(device),
                torch.randn(5, generator=gen).to(device))

    return ModelSpec(model=TokenMix(), example_inputs=batch(0), make_batch=batch)
