"""HSTU as Meta's generative-recommenders code lays it out (Zhai et al., ICML 2024), with
FBGEMM's ``jagged_to_padded_dense`` / ``dense_to_jagged`` written as flat ``index_copy`` /
``index_select`` over ``row * n + col`` (torch's ``aten._jagged_to_padded_dense_forward``
has no derivative).

The batch is jagged: ``seq_ids`` [N] and ``seq_timestamps`` [N] with ``x_offsets`` [B + 1]
(N fixed, lengths varying, an empty row and a full one), the next item of each token in
``target_ids`` [N] (0 at a row's last token: unsupervised) and ``negatives`` [R]. Each
``SequentialTransductionUnitJagged``:

* ``silu(layer_norm(x) @ _uvqk)`` (a raw ``nn.Parameter``), split into u, v, q, k;
* q, k, v padded with ``jagged_to_padded_dense(x, x_offsets, n)`` (zeros, ``index_copy``);
* ``qk = einsum("bnhd,bmhd->bhnm", q, k)``, plus the relative bias
  ``RelativeBucketedTimeAndPositionBasedBias``: position terms by the authors' pad-repeat-
  reshape trick over ``_pos_w [2n - 1]`` and time terms ``index_select(_ts_w, 0,
  buckets.view(-1))`` with the buckets of ``t_{i+1} - t_j`` from
  ``(log(|dt|.clamp(min=1)) / 0.301).long()`` (``bucket="log"``) or
  ``torch.bucketize(|dt|, boundaries)`` (``"bucketize"``), clamped to ``[0, buckets]``;
* ``silu(qk + bias) / n * tril(ones(n, n))`` (a float buffer; or see ``build``'s
  ``mask``), ``einsum("bhnm,bmhd->bnhd",
  a, v)``, back to jagged with ``dense_to_jagged`` (``index_select``), ``u *
  layer_norm(attn)``, ``_o``, residual.

Loss: each token's l2-normalised output against its next item and the shared negatives,
CE / 0.05 with the target in column 0, weighted by ``target_ids != 0``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, MAX_LEN, ITEMS, D, HEADS, DQK, DV, BLOCKS, BUCKETS, NEG = 4, 6, 40, 8, 2, 4, 4, 1, 8, 5
FILL = 12  # N, the batch's total tokens


def _flat_index(x_offsets: torch.Tensor, total: int, n: int) -> torch.Tensor:
    """``row * n + col`` of each jagged token in the padded ``[B, n]`` layout."""
    lengths = x_offsets[1:] - x_offsets[:-1]
    row = torch.repeat_interleave(torch.arange(lengths.numel(), device=x_offsets.device),
                                  lengths, output_size=total)
    col = torch.arange(total, device=x_offsets.device) - x_offsets[row]
    return row * n + col


def jagged_to_padded_dense(values: torch.Tensor, x_offsets: torch.Tensor, n: int
                           ) -> torch.Tensor:
    bsz = x_offsets.numel() - 1
    flat = values.new_zeros(bsz * n, *values.shape[1:])
    flat = flat.index_copy(0, _flat_index(x_offsets, values.shape[0], n), values)
    return flat.view(bsz, n, *values.shape[1:])


def jagged_to_padded_by_index_put(values: torch.Tensor, x_offsets: torch.Tensor, n: int
                                  ) -> torch.Tensor:
    """The same padding as a 2-D ``index_put`` at (row, col): how code that never had
    FBGEMM writes it."""
    total, bsz = values.shape[0], x_offsets.numel() - 1
    lengths = x_offsets[1:] - x_offsets[:-1]
    row = torch.repeat_interleave(torch.arange(bsz, device=x_offsets.device), lengths,
                                  output_size=total)
    col = torch.arange(total, device=x_offsets.device) - x_offsets[row]
    return values.new_zeros(bsz, n, *values.shape[1:]).index_put((row, col), values)


def dense_to_jagged(dense: torch.Tensor, x_offsets: torch.Tensor, total: int) -> torch.Tensor:
    flat = dense.reshape(dense.shape[0] * dense.shape[1], *dense.shape[2:])
    return flat.index_select(0, _flat_index(x_offsets, total, dense.shape[1]))


def fbgemm_jagged_to_padded(values: torch.Tensor, x_offsets: torch.Tensor, n: int
                            ) -> torch.Tensor:
    """generative-recommenders' own call: FBGEMM's op (``pad="fbgemm"``)."""
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    return torch.ops.fbgemm.jagged_to_padded_dense(values, [x_offsets], [n], 0.0)


def fbgemm_dense_to_jagged(dense: torch.Tensor, x_offsets: torch.Tensor, total: int
                           ) -> torch.Tensor:
    """FBGEMM's unpadding, with the total given (as the authors do when they know it: on
    ``meta`` an unknown total would be a data-dependent size)."""
    import fbgemm_gpu  # noqa: F401

    return torch.ops.fbgemm.dense_to_jagged(dense, [x_offsets], total)[0]


def _log_buckets(x: torch.Tensor) -> torch.Tensor:
    return (torch.log(torch.abs(x).clamp(min=1)) / 0.301).long()


class RelativeBucketedTimeAndPositionBasedBias(nn.Module):
    def __init__(self, max_seq_len: int, num_buckets: int, bucket: str) -> None:
        super().__init__()
        self._max_seq_len = max_seq_len
        self._num_buckets = num_buckets
        self._bucket = bucket
        self._ts_w = nn.Parameter(torch.empty(num_buckets + 1).normal_(mean=0, std=0.02))
        self._pos_w = nn.Parameter(torch.empty(2 * max_seq_len - 1).normal_(mean=0, std=0.02))
        self.register_buffer("boundaries", torch.tensor([1, 2, 4, 8, 16, 32, 64]),
                             persistent=False)

    def forward(self, all_timestamps: torch.Tensor) -> torch.Tensor:
        Bsz = all_timestamps.size(0)
        N = self._max_seq_len
        t = F.pad(self._pos_w[: 2 * N - 1], [0, N]).repeat(N)
        t = t[..., :-N].reshape(1, N, 3 * N - 2)
        r = (2 * N - 1) // 2
        ext_timestamps = torch.cat([all_timestamps, all_timestamps[:, N - 1: N]], dim=1)
        dt = ext_timestamps[:, 1:].unsqueeze(2) - ext_timestamps[:, :-1].unsqueeze(1)
        if self._bucket == "log":
            buckets = _log_buckets(dt)
        else:
            buckets = torch.bucketize(dt.abs(), self.boundaries)
        bucketed = torch.clamp(buckets, min=0, max=self._num_buckets).detach()
        rel_pos_bias = t[:, :, r:-r]
        rel_ts_bias = torch.index_select(self._ts_w, dim=0,
                                         index=bucketed.view(-1)).view(Bsz, N, N)
        return rel_pos_bias + rel_ts_bias


class SequentialTransductionUnitJagged(nn.Module):
    def __init__(self, bucket: str, pad: str = "index_copy", mask: str = "buffer") -> None:
        super().__init__()
        self._pad = {"index_copy": jagged_to_padded_dense, "index_put":
                     jagged_to_padded_by_index_put, "fbgemm": fbgemm_jagged_to_padded}[pad]
        self._unpad = fbgemm_dense_to_jagged if pad == "fbgemm" else dense_to_jagged
        self._mask = mask
        self._uvqk = nn.Parameter(torch.empty(D, (DV * 2 + DQK * 2) * HEADS).normal_(
            mean=0, std=0.02))
        self._o = nn.Linear(DV * HEADS, D)
        self._rel_attn_bias = RelativeBucketedTimeAndPositionBasedBias(MAX_LEN, BUCKETS,
                                                                        bucket)
        if mask == "gr":  # generative-recommenders' own: the invalid (future) keys, bool,
            # sized for the history plus the targets to predict, sliced to the batch's n
            self.register_buffer("_attn_mask", torch.triu(torch.ones(
                MAX_LEN + 2, MAX_LEN + 2, dtype=torch.bool), diagonal=1), persistent=False)
        elif mask == "where":  # the visible keys, bool, larger than n: where(mask, a, 0)
            self.register_buffer("_attn_mask", torch.tril(torch.ones(
                MAX_LEN + 2, MAX_LEN + 2, dtype=torch.bool)), persistent=False)
        elif mask == "masked_fill_buffer":  # a float tril of n + 2, masked_fill(m == 0, 0)
            self.register_buffer("_attn_mask", torch.tril(torch.ones(MAX_LEN + 2, MAX_LEN + 2)),
                                 persistent=False)
        elif mask == "constant":  # a plain tensor attribute (torch.export lifts it)
            self._attn_mask = torch.tril(torch.ones(MAX_LEN + 2, MAX_LEN + 2))
        else:
            self.register_buffer("_attn_mask", torch.tril(torch.ones(MAX_LEN, MAX_LEN)),
                                 persistent=False)

    def forward(self, x: torch.Tensor, x_offsets: torch.Tensor,
                all_timestamps: torch.Tensor) -> torch.Tensor:
        n = MAX_LEN
        normed_x = F.layer_norm(x, normalized_shape=[D], eps=1e-6)
        batched_mm_output = F.silu(torch.mm(normed_x, self._uvqk))
        u, v, q, k = torch.split(batched_mm_output,
                                 [DV * HEADS, DV * HEADS, DQK * HEADS, DQK * HEADS], dim=1)
        Bsz = x_offsets.size(0) - 1
        padded_q = self._pad(q, x_offsets, n).view(Bsz, n, HEADS, DQK)
        padded_k = self._pad(k, x_offsets, n).view(Bsz, n, HEADS, DQK)
        padded_v = self._pad(v, x_offsets, n).view(Bsz, n, HEADS, DV)
        qk_attn = torch.einsum("bnhd,bmhd->bhnm", padded_q, padded_k)
        qk_attn = qk_attn + self._rel_attn_bias(all_timestamps).unsqueeze(1)
        qk_attn = F.silu(qk_attn) / n
        if self._mask == "where":
            qk_attn = torch.where(self._attn_mask[:n, :n].unsqueeze(0).unsqueeze(0), qk_attn,
                                  0.0)
        elif self._mask in ("masked_fill", "masked_fill_buffer"):  # the dropped scores
            causal = torch.tril(torch.ones(n, n, device=x.device)) \
                if self._mask == "masked_fill" else self._attn_mask[:n, :n]
            qk_attn = qk_attn.masked_fill(causal.unsqueeze(0).unsqueeze(0) == 0, 0.0)
        else:
            if self._mask == "forward":
                causal = torch.tril(torch.ones(n, n, device=x.device))
            elif self._mask == "gr":
                causal = 1.0 - self._attn_mask[:n, :n].to(qk_attn.dtype)
            elif self._mask == "constant":
                causal = self._attn_mask[:n, :n]
            else:
                causal = self._attn_mask
            qk_attn = qk_attn * causal.unsqueeze(0).unsqueeze(0)
        attn = torch.einsum("bhnm,bmhd->bnhd", qk_attn, padded_v).reshape(Bsz, n, HEADS * DV)
        attn_output = self._unpad(attn, x_offsets, x.size(0))
        o_input = u * F.layer_norm(attn_output, normalized_shape=[HEADS * DV], eps=1e-6)
        return self._o(o_input) + x


class HSTU(nn.Module):
    def __init__(self, bucket: str, cpu_positions: bool = False, pad: str = "index_copy",
                 mask: str = "buffer") -> None:
        super().__init__()
        self.cpu_positions = cpu_positions
        self.item_emb = nn.Embedding(ITEMS, D, padding_idx=0)
        self.pos_emb = nn.Embedding(MAX_LEN, D)
        self.layers = nn.ModuleList(SequentialTransductionUnitJagged(bucket, pad, mask)
                                    for _ in range(BLOCKS))

    def forward(self, seq_ids, x_offsets, seq_timestamps, target_ids, negatives):
        if self.cpu_positions:  # as code only ever run on the CPU writes it
            col = torch.arange(seq_ids.numel()) - x_offsets[:-1].repeat_interleave(
                x_offsets[1:] - x_offsets[:-1], output_size=seq_ids.numel())
        else:
            col = _flat_index(x_offsets, seq_ids.numel(), MAX_LEN) % MAX_LEN  # position in row
        x = self.item_emb(seq_ids) * math.sqrt(D) + self.pos_emb(col)
        all_timestamps = jagged_to_padded_dense(seq_timestamps, x_offsets, MAX_LEN)
        for layer in self.layers:
            x = layer(x, x_offsets, all_timestamps)
        out = F.normalize(x, dim=-1)
        pos = F.normalize(self.item_emb(target_ids), dim=-1)
        neg = F.normalize(self.item_emb(negatives), dim=-1)
        logits = torch.cat([(out * pos).sum(-1, keepdim=True), out @ neg.T], dim=1) / 0.05
        w = (target_ids != 0).float()
        ce = F.cross_entropy(logits, torch.zeros_like(target_ids), reduction="none")
        return (ce * w).sum() / w.sum().clamp(min=1)


def build(bucket: str = "log", seed: int = 0, int32: bool = False,
          cpu_positions: bool = False, pad: str = "index_copy",
          mask: str = "buffer", mask_ones: bool = False) -> ModelSpec:
    """``int32``: ids, offsets and timestamps int32, as a TorchRec loader's
    KeyedJaggedTensor hands them over; ``cpu_positions``: the positions from
    ``torch.arange(n)`` with no device (made on the CPU); ``pad``: q, k, v padded by
    ``index_copy`` over flat positions (FBGEMM's op written out), ``index_put``, or FBGEMM's
    own ``jagged_to_padded_dense`` / ``dense_to_jagged`` (``"fbgemm"``);
    ``mask``: the causal mask a registered float ``tril`` buffer multiplied in
    (``"buffer"``), a ``tril`` made in the forward (``"forward"``), generative-recommenders'
    bool ``triu(ones(n + 2), 1)`` buffer as ``1.0 - mask[:n, :n].to(dtype)`` (``"gr"``), or
    a bool ``tril`` buffer of ``n + 2`` sliced and read by ``where(mask, a, 0)``
    (``"where"``), or a float ``tril`` of ``n + 2`` held as a plain tensor attribute, not
    registered, sliced (``"constant"``: a lifted constant of the export), or the scores
    zeroed by ``masked_fill(tril == 0, 0)`` with the ``tril`` made in the forward
    (``"masked_fill"``) or a float buffer of ``n + 2`` sliced (``"masked_fill_buffer"``). ``mask_ones``: the buffer filled with ones after it is registered (every
    key visible: a mask that is no causal one, as a user may set it)."""
    torch.manual_seed(seed)
    model = HSTU(bucket, cpu_positions, pad, mask)
    if mask_ones:
        for layer in model.layers:
            layer._attn_mask.fill_(1)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        with torch.device("cpu"):
            g = torch.Generator().manual_seed(1000 * seed + step)
            lengths = torch.tensor([0, MAX_LEN, 0, 0])
            rest = FILL - MAX_LEN  # spread over rows 2.. (each at most MAX_LEN)
            cut = int(torch.randint(rest - MAX_LEN + 1 if rest > MAX_LEN else 0, min(rest, MAX_LEN) + 1, (1,), generator=g))
            lengths[2], lengths[3] = cut, rest - cut
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
            ids = torch.randint(1, ITEMS, (FILL,), generator=g)
            stamps = torch.cat([torch.cumsum(torch.randint(0, 40, (int(n),), generator=g), 0)
                                for n in lengths])
            nxt = torch.cat([torch.cat([ids[int(s) + 1:int(e)], torch.zeros(1, dtype=torch.long)])
                             if e > s else ids[:0] for s, e in zip(offsets[:-1], offsets[1:])])
            neg = torch.randint(1, ITEMS, (NEG,), generator=g)
        batch = (ids, offsets, stamps, nxt, neg)
        if int32:
            batch = tuple(t.to(torch.int32) for t in batch[:3]) + batch[3:]
        return tuple(t.to(device) for t in batch)

    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=B)
