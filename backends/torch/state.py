"""The training state as one DCP state dict: what a checkpoint holds and how it reshards.

Keys (DCP flattens the nesting with dots)::

    model.<fqn>            dense parameters and buffers (plain tensors when replicated,
                           DTensors under FSDP2/HSDP)
    optim.*                the dense AdamW state (torch.distributed.checkpoint.state_dict)
    tables.<fqn>           each embedding table: a ShardedTensor whose global metadata is
                           the plan's shards, or a plain tensor for a data_parallel replica
    table_optim.<fqn>.<s>  its optimizer state: Adam's moments shaped like the table;
                           row-wise Adagrad's accumulator, one value per row
    progress.step          the last completed step; progress.table_step the sparse
                           optimizer's step count (Adam's bias correction)

No RNG state is stored: the runner reseeds every step from ``(seed, rank, step)``, so a
resumed run draws the same random numbers as an uninterrupted one, at any world size.
Every rank's state dict holds the same keys (a rank without a shard of a table still has
the table's ShardedTensor, with no local piece): DCP reads a key missing on some rank as
a sign of a pre-2.4 checkpoint and would mis-load.

Tables are ShardedTensors (not per-rank keys) so a checkpoint records *where* each shard
sits in the whole table: DCP can then load it into a different sharding (another plan or
world size) by reading the overlapping pieces (on one process without a process group
they are plain tensors, which DCP reads into any sharding as well). The row-wise accumulator of a row split
over column shards is the same on every column shard (see sparse_optim); in the saved
metadata each row block is placed on one holder, and at load every holder of the block
reads it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from gemc.backends.torch.embedding import Shard, ShardedEmbedding
from gemc.backends.torch.sparse_optim import EmbeddingOptimizer
from torch import nn


def _placement(rank: int, device: torch.device, local_world: int) -> str:
    if device.type == "cuda":
        return f"rank:{rank}/cuda:{rank % max(local_world, 1)}"
    return f"rank:{rank}/{device.type}"


def sharded_tensor(
    pieces: list[tuple[int, list[int], list[int]]],
    global_size: list[int],
    local: torch.Tensor | None,
    local_index: int | None,
    *,
    rank: int,
    device: torch.device,
    dtype: torch.dtype,
    local_world: int,
) -> Any:
    """A ShardedTensor from (rank, offsets, sizes) pieces; ``local`` is piece ``local_index``."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard as STShard
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import (
            ShardedTensorMetadata,
            TensorProperties,
        )

        metas = [
            ShardMetadata(
                shard_offsets=list(off),
                shard_sizes=list(size),
                placement=_placement(r, device, local_world),
            )
            for r, off, size in pieces
        ]
        props = TensorProperties(
            dtype=dtype,
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        )
        meta = ShardedTensorMetadata(
            shards_metadata=metas, size=torch.Size(global_size), tensor_properties=props
        )
        shards = []
        if local is not None and local_index is not None:
            shards = [STShard(local, metas[local_index])]
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


def _table_tensor(
    m: ShardedEmbedding, local: torch.Tensor | None, *, device: torch.device, local_world: int
) -> Any:
    """The table-shaped view (weights, Adam moments) of one table."""
    if m.replicated or not dist.is_initialized():  # a replica, or the whole table on one rank
        return local
    pieces = [(s.rank, [s.row_offset, s.col_offset], [s.rows, s.cols]) for s in m.shards]
    index = m.shards.index(m.local) if m.local is not None else None
    dtype = local.dtype if local is not None else _dtype(m)
    return sharded_tensor(
        pieces,
        [m.num_embeddings, m.embedding_dim],
        local.detach() if local is not None else None,
        index,
        rank=m.rank,
        device=device,
        dtype=dtype,
        local_world=local_world,
    )


def _dtype(m: ShardedEmbedding) -> torch.dtype:
    return m.storage_dtype


def _scale_tensor(m: ShardedEmbedding, *, device: torch.device, local_world: int) -> Any:
    """An fp8 table's row scales: one per row of each shard, so ``[rows, column blocks]``
    (a column-split row has one scale per block, each over its own columns)."""
    local = None if m.row_scale is None else m.row_scale.view(-1, 1)
    if m.replicated or not dist.is_initialized():
        return local
    blocks = sorted({s.col_offset for s in m.shards})
    pieces = [(s.rank, [s.row_offset, blocks.index(s.col_offset)], [s.rows, 1])
              for s in m.shards]
    index = m.shards.index(m.local) if m.local is not None else None
    return sharded_tensor(pieces, [m.num_embeddings, len(blocks)], local, index, rank=m.rank,
                          device=device, dtype=torch.float32, local_world=local_world)


def _row_tensor(
    m: ShardedEmbedding, local: torch.Tensor | None, *, device: torch.device, local_world: int
) -> Any:
    """The per-row view (row-wise Adagrad): one piece per row block, placed on one holder."""
    if m.replicated or not dist.is_initialized():
        return local
    blocks: dict[tuple[int, int], Shard] = {}
    for s in sorted(m.shards, key=lambda s: (s.row_offset, s.col_offset)):
        blocks.setdefault((s.row_offset, s.rows), s)
    mine = (m.local.row_offset, m.local.rows) if m.local is not None else None
    pieces, index = [], None
    for i, ((r0, nr), holder) in enumerate(sorted(blocks.items())):
        owner = m.rank if (r0, nr) == mine else holder.rank
        if (r0, nr) == mine:
            index = i
        pieces.append((owner, [r0], [nr]))
    return sharded_tensor(
        pieces,
        [m.num_embeddings],
        local,
        index,
        rank=m.rank,
        device=device,
        dtype=torch.float32,
        local_world=local_world,
    )


def training_state(
    model: nn.Module,
    dense_opt: torch.optim.Optimizer,
    tables: dict[str, ShardedEmbedding],
    emb_opt: EmbeddingOptimizer,
    *,
    step: int,
    rank: int,
    device: torch.device,
    local_world: int,
) -> dict[str, Any]:
    """The state dict to save, and the one DCP loads into in place (same keys)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    table_keys = {f"{fqn}" for fqn in tables}
    dense = {k: v for k, v in model.state_dict().items() if k not in table_keys}
    state: dict[str, Any] = {
        "model": dense,
        "optim": get_optimizer_state_dict(model, dense_opt),
        "tables": {},
        "table_optim": {},
        "progress": {"step": step, "table_step": emb_opt.step_count},
    }
    for fqn, m in tables.items():
        state["tables"][fqn] = _table_tensor(
            m, m.weight, device=device, local_world=local_world
        )
        if m.precision == "fp8":
            state["tables"][f"{fqn}.row_scale"] = _scale_tensor(
                m, device=device, local_world=local_world)
        opt_state = emb_opt.state.get(fqn)
        tensors = opt_state.tensors if opt_state is not None else {}
        if emb_opt.cfg.kind == "rowwise_adagrad":
            state["table_optim"][f"{fqn}.sum"] = _row_tensor(
                m, tensors.get("sum"), device=device, local_world=local_world
            )
        else:
            for key in ("exp_avg", "exp_avg_sq"):
                state["table_optim"][f"{fqn}.{key}"] = _table_tensor(
                    m, tensors.get(key), device=device, local_world=local_world
                )
    # drop replicated entries this rank does not hold (none today) so DCP never sees None
    state["tables"] = {k: v for k, v in state["tables"].items() if v is not None}
    state["table_optim"] = {k: v for k, v in state["table_optim"].items() if v is not None}
    return state


def restore_after_load(
    state: dict[str, Any],
    model: nn.Module,
    dense_opt: torch.optim.Optimizer,
    emb_opt: EmbeddingOptimizer,
) -> int:
    """Push what DCP loaded into the optimizers; returns the completed-step count."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, dense_opt, state["optim"])
    emb_opt.set_step_count(int(state["progress"]["table_step"]))
    return int(state["progress"]["step"])
