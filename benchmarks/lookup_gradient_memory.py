"""The sparse route's gradient memory on several ranks, counted, against the memory model
(CPU, gloo; issue 19 / 21).

    .venv/bin/python benchmarks/lookup_gradient_memory.py                 # 4 ranks
    .venv/bin/python benchmarks/lookup_gradient_memory.py --world 2 --json out.json

``memory.table_grad_bytes`` says what a shard's lookup gradient holds at the end of the
backward (one gradient row and index per id the shard looked up, over every rank's batch)
and what the sparse optimizer's step of it adds for a moment (``summed_rows``' per-id
sums, the rows gathered into slots, the sort buffers); ``memory.lookup_gradient_extra``
adds both to a rank where they exceed its activations' room. Here each rank runs the
runner's own table (:class:`~gemc.backends.torch.embedding.ShardedEmbedding`: the id
exchange, the owner's ``embedding_bag(sparse=True)``, the pooled exchange back) and its
sparse optimizer (:class:`~gemc.backends.torch.sparse_optim.EmbeddingOptimizer`) on
uniform random ids, and counts: the bytes of ``weight.grad`` after the backward, and the
most bytes the optimizer's step holds at once beyond what was there before it (every
tensor an ATen op returns, by its storage, until it is freed: a CPU stand-in for the
CUDA allocator's peak). Printed per sharding and rank beside the model's figures.

``--routes sparse,fused`` (the default) runs each sharding on both owner routes side by
side: ``fused`` is the owners' batched kernel with the optimizer in its backward
(:mod:`gemc.backends.torch.owner_lookup`, issue 21; the kernel runs under
``TRITON_INTERPRET=1`` on a CPU), whose gradient holds nothing and whose update's buffers
(the sort of the received ids) live inside the backward: the ``backward peak`` column, every
byte the backward allocates (the pooled gradients' exchange included, on both routes). A
column split under row-wise Adagrad stays on the sparse route (gemc.table_lookup) and is
not run fused.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _live_bytes_mode():  # noqa: ANN202 (torch imported in the worker)
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        """The bytes of the storages the ops under it return, while they live, and
        their peak (storages seen before the mode began are not counted)."""

        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.seen: set[int] = set()

        def _free(self, ptr: int, nbytes: int) -> None:
            self.live -= nbytes
            self.seen.discard(ptr)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            known = set()
            for t in tree_leaves((args, kwargs or {})):
                if not isinstance(t, torch.Tensor):
                    continue
                # a sparse input's values and indices are its storages (``_values()``
                # returns them, not new ones)
                parts = (t._values(), t._indices()) if t.is_sparse else (t,)
                known.update(p.untyped_storage().data_ptr() for p in parts)
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor) or t.is_sparse:
                    continue
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr in known or ptr in self.seen or st.nbytes() == 0:
                    continue
                self.seen.add(ptr)
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._free, ptr, st.nbytes())
            return out

    return LiveBytes()


def _uncounted_interpreter() -> None:
    """Triton's interpreter copies every tensor argument of a launch to the host and back
    (the whole flat weight buffer each backward): an artifact of running the kernel on a
    CPU, not a buffer the GPU's launch allocates (it writes the rows in place). The fused
    update's launch is therefore run outside the byte count; its torch ops (the ids'
    sort, runs and coefficients) are counted."""
    from gemc.backends.triton import embedding_bag as eb
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    kernel = eb._fused_update_kernel
    if not isinstance(kernel, InterpretedFunction):
        return

    class Uncounted:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            launch = kernel[grid]

            def run(*a, **kw):  # noqa: ANN002, ANN003, ANN202
                with _disable_current_modes():
                    return launch(*a, **kw)
            return run

    eb._fused_update_kernel = Uncounted()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist
    from gemc.backends.torch.embedding import ShardedEmbedding
    from gemc.backends.torch.owner_lookup import OwnerLookup
    from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer
    from gemc.cost_model.memory import table_grad_bytes
    from gemc.cost_model.types import TableCost
    from torch import nn

    from gemc.sharding import SHARDINGS, make_shards
    from gemc.table_lookup import BATCHED, SPARSE, sharded_route

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if os.environ.get("TRITON_INTERPRET") == "1":
        _uncounted_interpreter()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    rows, dim, batch, pool = args.rows, args.dim, args.batch, args.pool
    results = []
    for name, route in itertools.product(args.shardings.split(","), args.routes.split(",")):
        ranks = [0] if name == "table_wise" else list(range(world))
        shards = make_shards(name, ranks, rows, dim)
        plan_table = {"fqn": "t.weight", "rows": rows, "dim": dim, "sharding": name,
                      "shards": shards}
        if route == "fused" and sharded_route(name, world_size=world,
                                              optimizer=args.optimizer) != BATCHED:
            continue  # the rule keeps it on the sparse route (column split, Adagrad)
        source = nn.EmbeddingBag(rows, dim, mode="sum")
        table = ShardedEmbedding(source, plan_table, rank=rank, world_size=world, seed=0)
        table.to_empty(device="cpu")
        table.reset_parameters()
        groups = {"t.weight": dist.group.WORLD} if SHARDINGS[name].split == "columns" \
            else {}
        opt = EmbeddingOptimizer({"t.weight": table},
                                 EmbeddingOptimConfig.default_for(args.optimizer),
                                 world_size=world, column_groups=groups)
        if route == "fused" and table.local is not None:
            OwnerLookup({"t.weight": table}, ["t.weight"], opt, world_size=world, seed=0)
        gen = torch.Generator().manual_seed(1 + rank)
        ids = torch.randint(0, rows, (batch * pool,), generator=gen)
        offsets = torch.arange(0, batch * pool, pool)
        out_grad = torch.randn(batch, dim, generator=gen)
        loss = (table(ids, offsets) * out_grad).sum()
        backward = _live_bytes_mode()
        with backward:  # the fused route's update runs here (its sort buffers)
            loss.backward()
        w = table.weight
        grad = None if w is None else w.grad
        held = 0 if grad is None else (grad._values().nbytes + grad._indices().nbytes)
        looked_up = 0 if grad is None else grad._indices().shape[1]
        mode = _live_bytes_mode()
        with mode:
            opt.step()
        shard = next((s for s in shards if s["rank"] == rank), None)
        model_held = model_moment = 0.0
        if shard is not None:
            t = TableCost("t.weight", rows=rows, dim=dim, nnz=batch * pool, batch=batch,
                          sharding=name, ranks=tuple(ranks),
                          lookup=BATCHED if route == "fused" else SPARSE)
            model_held, model_moment = table_grad_bytes(t, shard["rows"], shard["cols"],
                                                        world, args.optimizer)
        results.append({"sharding": name, "route": route, "rank": rank,
                        "ids_looked_up": looked_up, "held_bytes": held,
                        "model_held_bytes": model_held, "backward_peak_bytes": backward.peak,
                        "step_peak_bytes": mode.peak, "model_moment_bytes": model_moment})
        opt.zero_grad()
        dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps([r for rs in gathered for r in rs], indent=1))
    dist.destroy_process_group()


def main() -> int:
    import socket

    import torch
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512, help="local batch (bags a rank)")
    ap.add_argument("--pool", type=int, default=20, help="ids a bag")
    ap.add_argument("--shardings", default="table_wise,row_wise,column_wise")
    ap.add_argument("--optimizer", default="rowwise_adagrad", choices=("rowwise_adagrad", "adam"))
    ap.add_argument("--routes", default="sparse,fused",
                    help="the owners' routes side by side: sparse (embedding_bag with a "
                         "sparse gradient, the sparse optimizer) and fused (owner_lookup)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    if not torch.cuda.is_available():  # the fused route's Triton kernels, interpreted
        os.environ.setdefault("TRITON_INTERPRET", "1")
    out = args.json or str(Path(os.environ.get("TMPDIR", "/tmp")) / "lookup_grad_mem.json")
    mp.spawn(_worker, args=(args.world, port, args, out), nprocs=args.world, join=True)
    rows = json.loads(Path(out).read_text())
    print(f"{args.world} ranks, {args.rows} x {args.dim} table, local batch {args.batch} x "
          f"pooling {args.pool}, uniform ids, {args.optimizer} (CPU, gloo)")
    print("sharding     route  rank  ids    held MB (model)  backward peak MB  "
          "step peak MB (model moment)")
    for r in rows:
        print(f"{r['sharding']:12s} {r['route']:6s} {r['rank']:4d} {r['ids_looked_up']:6d} "
              f"{r['held_bytes'] / 1e6:8.3f} ({r['model_held_bytes'] / 1e6:8.3f})  "
              f"{r['backward_peak_bytes'] / 1e6:8.3f}  "
              f"{r['step_peak_bytes'] / 1e6:8.3f} ({r['model_moment_bytes'] / 1e6:8.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
