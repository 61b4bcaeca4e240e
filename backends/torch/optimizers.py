"""Optimizer choices, shared by the runner and the single-process reference.

Dense parameters: AdamW. Embedding tables: a sparse optimizer (see :mod:`.sparse_optim`).
The plan may carry an ``"optimizer"`` object (``{"dense": {...}, "embedding": {...}}``);
command-line flags override it. One function builds both configurations so the runner and
the reference cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from gemc.backends.torch.sparse_optim import EMBEDDING_OPTIMIZERS, EmbeddingOptimConfig

from gemc.errors import GemcUserError


@dataclass(frozen=True)
class DenseOptimConfig:
    """AdamW's hyperparameters (torch defaults except the learning rate)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01


def make_dense_optimizer(
    params: list[torch.nn.Parameter], cfg: DenseOptimConfig, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW; the fused CUDA kernel on GPU (one launch for all parameters)."""
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **kwargs
    )


def resolve_optimizers(
    plan_section: dict[str, Any] | None,
    *,
    lr: float | None = None,
    embedding_optimizer: str | None = None,
    embedding_lr: float | None = None,
) -> tuple[DenseOptimConfig, EmbeddingOptimConfig]:
    """Plan's ``optimizer`` section, then the flags, over the defaults."""
    section = plan_section or {}
    dense = dict(section.get("dense") or {})
    emb = dict(section.get("embedding") or {})
    dense_cfg = DenseOptimConfig(
        lr=float(lr if lr is not None else dense.get("lr", DenseOptimConfig.lr)),
        weight_decay=float(dense.get("weight_decay", DenseOptimConfig.weight_decay)),
    )
    kind = embedding_optimizer or emb.get("kind", "rowwise_adagrad")
    if kind not in EMBEDDING_OPTIMIZERS:
        raise GemcUserError(
            f"embedding optimizer {kind!r} is not supported",
            where="--embedding-optimizer / plan optimizer.embedding.kind",
            fix=f"use one of {', '.join(EMBEDDING_OPTIMIZERS)}",
        )
    emb_cfg = EmbeddingOptimConfig.default_for(
        kind, embedding_lr if embedding_lr is not None else emb.get("lr")
    )
    if "weight_decay" in emb:
        emb_cfg = EmbeddingOptimConfig(
            kind=emb_cfg.kind,
            lr=emb_cfg.lr,
            eps=emb_cfg.eps,
            betas=emb_cfg.betas,
            weight_decay=float(emb["weight_decay"]),
        )
    return dense_cfg, emb_cfg
