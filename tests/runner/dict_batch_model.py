"""The runner's test model written as a data pipeline hands it a batch: one dict.

Same tables, layers and data as :mod:`tests.runner.models` (so its losses are that model's,
step for step), but ``forward(self, batch)`` reads a nested dict of features (a table's ids
and offsets as a tuple, a weighted table's as a dict, a list of 2-D id tensors), as
TorchRec-style pipelines write it.
"""

from __future__ import annotations

from typing import Any

import torch

from gemc.spec import ModelSpec
from tests.runner import models


class DictBatchMultiTable(models.MultiTable):
    def forward(self, batch: dict[str, Any]) -> torch.Tensor:  # type: ignore[override]
        s = batch["sparse"]
        seq, ids4 = s["dense_ids"]
        return super().forward(
            batch["dense"], *s["t0"], *s["t1"], s["t2"]["ids"], s["t2"]["offsets"],
            s["t2"]["weights"], seq, ids4, *s["t5"], batch["labels"])


def as_dict(flat: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """The flat test batch (models.make_batch's order) as the dict the forward reads."""
    dense, ids0, off0, ids1, off1, ids2, off2, w2, seq, ids4, ids5, off5, labels = flat
    return {"dense": dense,
            "sparse": {"t0": (ids0, off0), "t1": (ids1, off1),
                       "t2": {"ids": ids2, "offsets": off2, "weights": w2},
                       "dense_ids": [seq, ids4], "t5": (ids5, off5)},
            "labels": labels}


def make_batch(step: int, device: torch.device | str = "cpu") -> tuple[dict[str, Any]]:
    return (as_dict(models.make_batch(step, device)),)


def build(computed_ids: bool = False) -> ModelSpec:
    return ModelSpec(model=DictBatchMultiTable(computed_ids), example_inputs=(
        as_dict(models._example()),), make_batch=make_batch, batch_size=models.B)
