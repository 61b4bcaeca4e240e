"""A TorchRec-style sparse arch, hand-written without TorchRec (tiny sizes).

Idioms of ``torchrec.sparse.jagged_tensor`` and ``torchrec.modules.embedding_modules``:
a ``KeyedJaggedTensor``-like batch (``keys``, flat ``values``, ``lengths`` key-major: the
first ``B`` lengths are the first key's); its per-key split is ``torch.split(values,
length_per_key)`` with ``length_per_key`` from ``lengths.view(len(keys), -1).sum(1)``
(``split="tolist"``: ``.tolist()`` as TorchRec computes it, data-dependent sizes;
``split="fixed"``: the lengths padded to a fixed ``L`` per sample, so the per-key totals are
``B * L`` as a static Python list); an ``EmbeddingBagCollection``-like ``nn.ModuleDict`` of
``nn.EmbeddingBag`` keyed by *table* name, a feature -> table map in which two features
(``"hist_item"`` and ``"item"``) share one table, the pooled outputs concatenated in key order
(a ``KeyedTensor``'s ``values()``), then a dense arch and an over-arch (DLRM without the
interaction). ``batch="object"``: the batch is TorchRec's ``Batch`` dataclass (``dense_features``,
``sparse_features`` a KeyedJaggedTensor, ``labels``), both registered with
``torch.utils._pytree`` as TorchRec registers them, and ``forward(self, batch)`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from gemc.spec import ModelSpec

B, L, DIM = 6, 3, 4
TABLES = {"t_item": 40, "t_cate": 12}
FEATURE_TABLE = {"hist_item": "t_item", "item": "t_item", "cate": "t_cate"}


class KeyedJaggedTensor:
    """keys, values, lengths (key-major), as TorchRec's constructor takes them."""

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor) -> None:
        self._keys, self._values, self._lengths = keys, values, lengths

    def keys(self) -> list[str]:
        return self._keys

    def stride(self) -> int:
        return self._lengths.numel() // len(self._keys)

    def length_per_key(self) -> list[int]:
        return torch.sum(self._lengths.view(len(self._keys), -1), dim=1).tolist()

    def split_by_key(self, length_per_key: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        values = torch.split(self._values, length_per_key)
        lengths = torch.split(self._lengths, [self.stride()] * len(self._keys))
        return {k: (v, n) for k, v, n in zip(self._keys, values, lengths)}


def _kjt_flatten(kjt: KeyedJaggedTensor) -> tuple[list[torch.Tensor], list[str]]:
    return [kjt._values, kjt._lengths], kjt._keys


def _kjt_unflatten(values: list[torch.Tensor], keys: list[str]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys, *values)


pytree.register_pytree_node(
    KeyedJaggedTensor, _kjt_flatten, _kjt_unflatten,
    flatten_with_keys_fn=lambda kjt: ([(pytree.MappingKey(n), t) for n, t in
                                       zip(("values", "lengths"), _kjt_flatten(kjt)[0])],
                                      kjt._keys))


@dataclass
class Batch:
    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor


pytree.register_dataclass(Batch)


class EmbeddingBagCollection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding_bags = nn.ModuleDict(
            {name: nn.EmbeddingBag(rows, DIM, mode="sum") for name, rows in TABLES.items()})

    def forward(self, kjt: KeyedJaggedTensor, fixed: bool) -> torch.Tensor:
        per_key = ([kjt.stride() * L] * len(kjt.keys()) if fixed else kjt.length_per_key())
        pooled = []
        for key, (values, lengths) in kjt.split_by_key(per_key).items():
            offsets = torch.ops.aten.cumsum(lengths, 0) - lengths  # complete_cumsum[:-1]
            pooled.append(self.embedding_bags[FEATURE_TABLE[key]](values, offsets))
        return torch.cat(pooled, dim=1)  # KeyedTensor.values(): keys in order


class SparseNN(nn.Module):
    def __init__(self, split: str) -> None:
        super().__init__()
        self.fixed = split == "fixed"
        self.keys = list(FEATURE_TABLE)
        self.sparse_arch = EmbeddingBagCollection()
        self.dense_arch = nn.Sequential(nn.Linear(2, DIM), nn.ReLU())
        self.over_arch = nn.Sequential(nn.Linear(DIM * (len(self.keys) + 1), 8), nn.ReLU(),
                                       nn.Linear(8, 1))

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                label: torch.Tensor) -> torch.Tensor:
        kjt = KeyedJaggedTensor(self.keys, values, lengths)
        x = torch.cat([self.dense_arch(dense), self.sparse_arch(kjt, self.fixed)], dim=1)
        return F.binary_cross_entropy_with_logits(self.over_arch(x).squeeze(1), label)


class BatchSparseNN(SparseNN):
    def forward(self, batch: Batch) -> torch.Tensor:  # type: ignore[override]
        x = torch.cat([self.dense_arch(batch.dense_features),
                       self.sparse_arch(batch.sparse_features, self.fixed)], dim=1)
        return F.binary_cross_entropy_with_logits(self.over_arch(x).squeeze(1), batch.labels)


def make_batch_for(split: str, batch: str = "tensors"):  # noqa: ANN201
    def make_batch(step: int, device: torch.device | str) -> tuple:
        dense, values, lengths, label = make_tensors(step, device)
        if batch == "object":
            keys = list(FEATURE_TABLE)
            return (Batch(dense, KeyedJaggedTensor(keys, values, lengths), label),)
        return dense, values, lengths, label

    def make_tensors(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(300 + step)
        with torch.device("cpu"):
            values, lengths = [], []
            for key in FEATURE_TABLE:
                rows = TABLES[FEATURE_TABLE[key]]
                n = torch.randint(0, L + 1, (B,), generator=g) if key == "hist_item" \
                    else torch.ones(B, dtype=torch.long)
                ids = torch.randint(0, rows, (B, L), generator=g)
                if split == "fixed":  # padded to L ids a sample: a bag of L, id 0 = none
                    ids = ids * (torch.arange(L)[None, :] < n[:, None])
                    n = torch.full((B,), L)
                    values.append(ids.reshape(-1))
                else:
                    values.append(ids[torch.arange(L)[None, :] < n[:, None]])
                lengths.append(n)
            batch = (torch.randn(B, 2, generator=g), torch.cat(values), torch.cat(lengths),
                     (torch.rand(B, generator=g) < 0.5).float())
        return tuple(t.to(device) for t in batch)
    return make_batch


def build(split: str = "tolist", batch: str = "tensors") -> ModelSpec:
    torch.manual_seed(0)
    mb = make_batch_for(split, batch)
    model = BatchSparseNN(split) if batch == "object" else SparseNN(split)
    return ModelSpec(model=model, example_inputs=mb(0, "cpu"), make_batch=mb,
                     batch_size=B)
