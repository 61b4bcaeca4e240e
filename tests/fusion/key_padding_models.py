"""Small padded-history models, one per way real code writes a key-padding mask: a boolean
mask input, an additive float mask input, lengths, offsets, ``nn.MultiheadAttention`` with
``key_padding_mask``, and a causal mask and-ed with the padding mask. Each pools the
attention output under the same mask (so padding query rows are never read) and returns a
scalar loss. Batches: ``batch(form, lengths, gen, scramble)`` gives the inputs; with
``scramble`` the masks keep the same counts but not as prefixes (the op must fall back)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, L, E, H = 4, 6, 8, 2
FORMS = ("bool", "additive", "lengths", "offsets", "mha", "causal", "target", "summary",
         "mha_weights", "formula")
"""``target``: one candidate item attends over the history (bool mask; DIN / target
attention); ``summary``: two learned queries attend over it (mask from lengths);
``mha_weights``: MultiheadAttention with its default ``need_weights=True`` (exports as
baddbmm / softmax / bmm); ``formula``: softmax attention written by hand
(``masked_fill(q k^T / sqrt(d), ~mask, -inf).softmax(-1) @ v``)."""
PACKED_FORMS = ("bool", "additive", "lengths", "offsets", "causal", "summary", "mha",
                "mha_weights", "formula")
"""The forms whose history tower pack-jagged-tokens packs (a region guarded by the mask;
MultiheadAttention's through its ``[L, B * heads, d]`` views, a written-out softmax as the
attention it is matched as); ``target``'s query sliced off the history (``q[:, :, -1:]``)
is a reader of one token per row, checked at run time (its tower packs where position
``L - 1`` is kept on every row: tests/fusion/test_key_padding_attention.py). Every one of these regions is ``compact`` (no
attention in it relies on the padding being a suffix), so a mask that is not a prefix packs
too, its kept positions in order. ``mha_weights`` and ``formula`` are NaN on a row with no
kept key, so their regions also need a token on every row (:data:`EVERY_ROW_FORMS`)."""
EVERY_ROW_FORMS = ("mha_weights", "formula")


class History(nn.Module):
    """One attention block over a padded history, its mask built as ``form`` says."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        mha = form in ("mha", "mha_weights")
        self.mha = nn.MultiheadAttention(E, H, batch_first=True) if mha else None
        self.qkv = nn.Linear(E, 3 * E) if not mha else None
        self.out = nn.Linear(E, E) if not mha else None
        self.norm = nn.LayerNorm(E)
        self.head = nn.Linear(E, 1)
        self.summary = nn.Parameter(torch.randn(1, H, 2, E // H)) if form == "summary" \
            else None

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        if self.form in ("lengths", "summary"):
            keep = torch.arange(L, device=x.device)[None, :] < m[:, None]
        elif self.form == "offsets":
            keep = torch.arange(L, device=x.device)[None, :] < (m[1:] - m[:-1])[:, None]
        elif self.form == "additive":
            keep = m == 0
        else:
            keep = m
        h = self.norm(x)
        if self.mha is not None:
            o, _ = self.mha(h, h, h, key_padding_mask=~keep,
                            need_weights=self.form == "mha_weights")
        else:
            assert self.qkv is not None and self.out is not None
            q, k, v = self.qkv(h).view(x.shape[0], L, 3, H, E // H).permute(2, 0, 3, 1, 4)
            if self.form in ("target", "summary"):
                return self._cross(x, q, k, v, keep)
            if self.form == "additive":
                mask = m[:, None, None, :]
            elif self.form == "causal":
                tril = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
                mask = keep[:, None, None, :] & tril
            else:
                mask = keep[:, None, None, :]
            if self.form == "formula":
                s = (q @ k.transpose(-1, -2)) / (E // H) ** 0.5
                o = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            o = self.out(o.transpose(1, 2).reshape(x.shape[0], L, E))
        y = (x + F.gelu(o)) * keep.unsqueeze(-1).to(x.dtype)
        pooled = y.sum(1) / keep.sum(1, keepdim=True).clamp(min=1)
        return self.head(pooled).square().mean()


    def _cross(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               keep: torch.Tensor) -> torch.Tensor:
        """Dense queries over the padded history: the last position's query for every row
        (a candidate item stand-in), or the learned summary queries."""
        if self.summary is not None:
            q = self.summary.expand(x.shape[0], -1, -1, -1)
        else:
            q = q[:, :, -1:]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        assert self.out is not None
        return self.head(self.out(o.transpose(1, 2).flatten(2))).square().mean()


def keep_masks(lengths: list[int], gen: torch.Generator, scramble: bool) -> torch.Tensor:
    """``[B, L]`` keep-masks with these counts: prefixes, or (``scramble``) a random
    permutation of each row's positions (a non-prefix wherever 0 < len < L moves)."""
    keep = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    if scramble:
        keep = torch.stack([row[torch.randperm(L, generator=gen)] for row in keep])
    return keep


def batch(form: str, lengths: list[int], gen: torch.Generator, scramble: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(len(lengths), L, E, generator=gen)
    keep = keep_masks(lengths, gen, scramble)
    if form == "additive":
        m: torch.Tensor = torch.zeros(len(lengths), L).masked_fill(~keep, float("-inf"))
    elif form in ("lengths", "summary"):
        m = torch.tensor(lengths)
    elif form == "offsets":
        m = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    else:
        m = keep
    return x, m


def build(form: str = "bool") -> ModelSpec:
    lengths = [2, 0, 6, 3]

    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in batch(form, lengths,
                                                 torch.Generator().manual_seed(step)))

    x, m = batch(form, lengths, torch.Generator().manual_seed(0))
    example = (torch.zeros(x.shape), torch.zeros(m.shape, dtype=m.dtype))
    return ModelSpec(model=History(form), example_inputs=example, make_batch=make)


class Hstu(nn.Module):
    """One HSTU block written out (the formula, on padded tensors): ``u, v, q, k`` from one
    projection, ``silu(q k^T [+ relative bias]) / n`` (``div``) or ``* (1 / n)`` (``mul``),
    ``n = divisor``,
    masked by ``causal & key-valid [& query-valid]`` (a float multiply or ``where``; with
    ``causal=False`` and no query mask, the bare key mask ``valid[:, None, None, :]``),
    ``@ v``, gated by ``u``, pooled under the mask. The mask comes from lengths or is a bool
    input (``mask_input``)."""

    def __init__(self, bias: bool = False, query_mask: bool = True, norm: str = "div",
                 where: bool = False, mask_input: bool = False, divisor: int = L,
                 einsum: bool = False, causal: bool = True) -> None:
        super().__init__()
        self.divisor, self.einsum, self.causal = divisor, einsum, causal
        self.uvqk = nn.Linear(E, 4 * E)
        self.rel = nn.Parameter(torch.randn(2 * L - 1)) if bias else None
        self.head = nn.Linear(E, 1)
        self.query_mask, self.norm, self.where, self.mask_input = query_mask, norm, where, \
            mask_input

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        u, v, q, k = self.uvqk(x).split(E, -1)
        q, k, v = (t.view(b, L, H, E // H).transpose(1, 2) for t in (q, k, v))
        pos = torch.arange(L, device=x.device)
        valid = m if self.mask_input else pos[None, :] < m[:, None]
        visible = valid[:, None, :]
        if self.causal:
            visible = (pos[:, None] >= pos[None, :])[None] & visible
        if self.query_mask:
            visible = visible & valid[:, :, None]
        s = torch.einsum("bhnd,bhmd->bhnm", q, k) if self.einsum else q @ k.transpose(-1, -2)
        if self.rel is not None:
            s = s + self.rel[pos[:, None] - pos[None, :] + L - 1]
        n = self.divisor
        a = F.silu(s) / n if self.norm == "div" else F.silu(s) * (1.0 / n)
        if self.where:
            a = torch.where(visible[:, None], a, 0.0)
        else:
            a = a * visible[:, None].to(a.dtype)
        o = torch.einsum("bhnm,bhmd->bhnd", a, v) if self.einsum else a @ v
        o = o.transpose(1, 2).reshape(b, L, E) * u
        pooled = (o * valid[..., None].to(o.dtype)).sum(1)
        return self.head(pooled).square().mean()


def build_hstu(bias: bool = False, query_mask: bool = True, norm: str = "div",
               where: bool = False, mask_input: bool = False, divisor: int = L,
               einsum: bool = False, causal: bool = True) -> ModelSpec:
    lengths = [2, 0, 6, 3]
    form = "bool" if mask_input else "lengths"

    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in batch(form, lengths,
                                                 torch.Generator().manual_seed(step)))

    x, m = batch(form, lengths, torch.Generator().manual_seed(0))
    return ModelSpec(model=Hstu(bias, query_mask, norm, where, mask_input, divisor, einsum,
                                causal),
                     example_inputs=(torch.zeros(x.shape), torch.zeros(m.shape, dtype=m.dtype)),
                     make_batch=make)


class JaggedHstu(nn.Module):
    """One HSTU block over a *jagged* history (values ``[N, E]`` + ``offsets``), its
    attention written with einsum on tensors padded by ``index_put`` into zeros: the key
    padding is implicit (zero values), the causal mask a float ``tril`` of ones, the output
    gathered back at the jagged positions. Variants: ``layout`` of the padded q, k, v
    (``"blhd"``, as HSTU's authors, or ``"bhld"``); ``pad="ones"`` pads v with ones (the
    keys then matter: refused); ``read="mean"`` pools the padded output over every position
    (padding rows read: refused); ``bias``: a relative-position bias per (query, key)."""

    def __init__(self, layout: str = "blhd", pad: str = "zeros", read: str = "gather",
                 bias: bool = True) -> None:
        super().__init__()
        self.layout, self.pad, self.read = layout, pad, read
        self.uvqk = nn.Linear(E, 4 * E)
        self.rel = nn.Parameter(torch.randn(2 * L - 1) * 0.1) if bias else None
        self.head = nn.Linear(E, 1)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        b, n = offsets.numel() - 1, values.shape[0]
        lengths = offsets[1:] - offsets[:-1]
        row = torch.repeat_interleave(torch.arange(b), lengths, output_size=n)
        col = torch.arange(n) - offsets[:-1][row]
        u, v, q, k = F.silu(self.uvqk(values)).split(E, -1)

        def padded(t: torch.Tensor, fill: str = "zeros") -> torch.Tensor:
            base = t.new_zeros(b, L, E) if fill == "zeros" else t.new_ones(b, L, E)
            p = base.index_put((row, col), t).view(b, L, H, E // H)
            return p if self.layout == "blhd" else p.transpose(1, 2)

        pq, pk, pv = padded(q), padded(k), padded(v, self.pad)
        spec = "bnhd,bmhd->bhnm" if self.layout == "blhd" else "bhnd,bhmd->bhnm"
        s = torch.einsum(spec, pq, pk)
        if self.rel is not None:
            pos = torch.arange(L)
            s = s + self.rel[pos[None, :] - pos[:, None] + L - 1]
        a = F.silu(s) / L * torch.tril(torch.ones(L, L))[None, None]
        out_spec = "bhnm,bmhd->bnhd" if self.layout == "blhd" else "bhnm,bhmd->bnhd"
        o = torch.einsum(out_spec, a, pv).reshape(b, L, E)
        if self.read == "mean":
            return self.head(o.mean(1)).square().mean()
        y = u * o[row, col]
        return self.head(y).square().mean()


def jagged_batch(lengths: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Values ``[sum(lengths), E]`` and offsets ``[B + 1]``."""
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return torch.randn(int(offsets[-1]), E, generator=gen), offsets


def build_jagged_hstu(layout: str = "blhd", pad: str = "zeros", read: str = "gather",
                      bias: bool = True) -> ModelSpec:
    lengths = [2, 0, 6, 3]

    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in jagged_batch(lengths,
                                                        torch.Generator().manual_seed(step)))

    return ModelSpec(model=JaggedHstu(layout, pad, read, bias), example_inputs=make(0),
                     make_batch=make)
