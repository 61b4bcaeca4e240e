"""A model written the way its author would, not in gemc's preferred spelling.

* the root module creates its own ``nn.Parameter``s (and a buffer) in ``__init__`` with
  its own recipe and has no ``reset_parameters()``;
* the example batch is real, built with ``device="cpu"`` written out;
* with ``params_on_cpu=True`` the author moves modules with ``.to("cpu")`` / ``.cpu()``
  and creates a parameter with ``device="cpu"``; with ``gpu_style=True`` one with
  ``device="cuda"`` and calls ``.cuda()`` (gemc must build it on a host without a GPU);
* the first input is the flat jagged ids of a bag table (``N_IDS`` values for ``B``
  samples, with start offsets: ``include_last_offset=False``), so a batch size guessed from
  the first input's first dimension is wrong; ``batch_size`` is stated in the spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, N_IDS, HIST, ROWS, DIM = 4, 12, 5, 40, 8


class AuthoredModel(nn.Module):
    """A bag table, a history table with a learned position bias and query, a tower."""

    def __init__(self, hidden: int = 16, params_on_cpu: bool = False,
                 gpu_style: bool = False) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.items = nn.Embedding(ROWS, DIM)
        # the author's own recipe, no reset_parameters(): small random positions, a query
        # drawn at another scale, a constant temperature
        dev = "cpu" if params_on_cpu else None
        self.pos = nn.Parameter(torch.randn(HIST, DIM, device=dev) * 0.02)
        self.query = nn.Parameter(torch.randn(DIM) * 0.5 + 1.0)
        self.register_buffer("temperature", torch.full((1,), DIM**-0.5))
        tower = nn.Sequential(nn.Linear(2 * DIM, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.tower = tower.to("cpu") if params_on_cpu else tower
        if params_on_cpu:
            self.items = self.items.cpu()
        # written for a GPU host: explicit device="cuda" and .cuda() (gemc builds it on any)
        self.bias = nn.Parameter(torch.full((1,), 0.5, device="cuda")) if gpu_style else None
        if gpu_style:
            self.tower = self.tower.cuda()

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        hist_ids: torch.Tensor,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        pooled = self.bag(ids, offsets)  # [B, DIM]
        hist = self.items(hist_ids) + self.pos  # [B, HIST, DIM]
        scores = (hist @ self.query) * self.temperature  # [B, HIST]
        seq = (torch.softmax(scores, dim=-1).unsqueeze(-1) * hist).sum(dim=1)
        logits = self.tower(torch.cat([pooled, seq], dim=1)).squeeze(1)
        if self.bias is not None:
            logits = logits + self.bias
        return F.binary_cross_entropy_with_logits(logits, labels)


def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """A real batch, deterministic in ``step``: ``B`` bags of varying length over ``N_IDS``."""
    g = torch.Generator().manual_seed(1000 + step)
    cpu = "cpu"  # written out, as a data pipeline does: the batch is real
    cuts = torch.sort(torch.randint(0, N_IDS + 1, (B - 1,), generator=g, device=cpu)).values
    offsets = torch.cat([torch.tensor([0], device=cpu), cuts])  # start offsets, one per bag
    batch = (
        torch.randint(0, ROWS, (N_IDS,), generator=g, device=cpu),
        offsets,
        torch.randint(0, ROWS, (B, HIST), generator=g, device=cpu),
        torch.randint(0, 2, (B,), generator=g, device=cpu).float(),
    )
    return tuple(t.to(device) for t in batch)


def build(
    hidden: int = 16,
    params_on_cpu: bool = False,
    state_batch: bool = True,
    info_batch: bool = False,
    batch_size: int | None = None,
    gpu_style: bool = False,
) -> ModelSpec:
    """``state_batch=False`` leaves ``ModelSpec.batch_size`` unset (``info_batch`` then
    gives the old ``info["batch_size"]``); ``batch_size`` is the value the author states
    (the data always has ``B`` samples: another value is a mistaken statement)."""
    model = AuthoredModel(hidden, params_on_cpu=params_on_cpu, gpu_style=gpu_style)
    example = make_batch(0, torch.device("cpu"))  # a real batch, on the CPU explicitly
    return ModelSpec(
        model=model,
        example_inputs=example,
        make_batch=make_batch,
        info={"batch_size": B} if info_batch else {},
        batch_size=(batch_size if batch_size is not None else B) if state_batch else None,
    )


class CpuConstant(AuthoredModel):
    """A forward that makes a tensor on an explicit device: gemc cannot move it."""

    def forward(self, ids, offsets, hist_ids, labels):  # noqa: ANN001, ANN201
        pooled = self.bag(ids, offsets) + torch.ones(B, DIM, device="cpu")
        return pooled.sum() + labels.sum()


def build_cpu_constant() -> ModelSpec:
    return ModelSpec(
        model=CpuConstant(),
        example_inputs=make_batch(0, "cpu"),
        make_batch=make_batch,
        batch_size=B,
    )
