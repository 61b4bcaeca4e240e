"""The masked tower's fill presets (``benchmarks/masked_tower.py``), the sweep that tells
whether a packed history tower's time follows its real tokens (issue 17): each preset's
batches have the mean fill it names, every row a prefix of at least one token, and a fill
outside (0, 1] is refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.benchmark_module import load_benchmark

tower = load_benchmark("masked_tower")


@pytest.mark.parametrize("preset, fill", [("h200", 0.5), ("h200-fill25", 0.25),
                                          ("h200-fill75", 0.75), ("h200-fill100", 1.0)])
def test_each_preset_draws_its_mean_fill(preset: str, fill: float) -> None:
    cfg = dataclasses.replace(tower.PRESETS[preset], batch_size=4096, items=100)
    history, mask, _ = tower._batch(cfg, step=3, seed=0, device="cpu")
    lengths = mask.sum(1)
    assert abs(float(lengths.float().mean()) / cfg.max_len - fill) < 0.02
    assert int(lengths.min()) >= 1
    assert torch.equal(mask, torch.arange(cfg.max_len)[None, :] < lengths[:, None])
    assert torch.equal(history != 0, mask)


def test_a_fill_out_of_range_is_refused() -> None:
    cfg = dataclasses.replace(tower.PRESETS["tiny"], fill=1.5)
    with pytest.raises(ValueError, match="fill must be in"):
        tower._batch(cfg, step=0, seed=0, device="cpu")
