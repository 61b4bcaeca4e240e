"""The bucketed step of data-parallel embedding replicas, measured beside its price (issue 19).

    # on one H200 (the numbers the cost model's replica price stands on):
    python3 benchmarks/replica_step.py --device cuda --out $OUT/replica_step.json
    # on the CPU, a check that it runs (not a measurement):
    .venv/bin/python benchmarks/replica_step.py --smoke
    # on the CPU, the host-cost proxy: both paths, each in its own process, side by side
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/replica_step.py --compare --cpu-proxy
    # graph mode's step (the GraphExecutor), groups ahead of the graph / members inside it
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/replica_step.py --compare --cpu-proxy --graph
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/replica_step.py --compare --cpu-proxy \
        --graph --graph-ahead 0
    # on one GPU, graph mode (for the lead: the new path's H100/H200 timing)
    python3 benchmarks/replica_step.py --device cuda --compare --graph --out $OUT/rs_graph.json

DLRMv2's tables with fewer than ``--max-rows`` rows (its 18 smallest at the default: the
ones TorchRec's planner replicates at 16 ranks; dim 128, Criteo's pooling factors), each a
``data_parallel`` replica (``ShardedEmbedding``), looked up by one rank's batch (65,536 /
``--world``) as sum-pooled bags, then stepped by the sparse optimizer
(``EmbeddingOptimizer``: one bucket of every replica's gradient rows and used-row flags,
ONE all-reduce, one masked pass a table). The process is a group of one (gloo on the CPU,
NCCL on a GPU) told it is one of ``--world`` ranks: the all-reduce is a one-rank
collective, so what is timed is the replicas' own part of the step, the part the cost
model prices per replica (``op_cost.eager_table_time`` with ``replicas``: its optimizer
term; the bucket's zero-fill and division once, ``kernels.REPLICA_BUCKET_KERNELS``); the
collective itself is priced by ``collectives`` (measured by ``gemc calibrate``). Reported
per step, median after ``--warmup``: the lookups' forward + backward and the optimizer's
step, measured and predicted (H200 calibration), and whether the step synced with the
host (CUDA's sync debug mode set to error around it). Writes ``--out``.

``--batched 1`` (the default, ``GEMC_BATCHED_REPLICAS``'s) groups the replicas
(:mod:`gemc.backends.torch.replica_groups`: one storage, one lookup ahead of the forward,
one gradient add and one masked pass a group); ``--batched 0`` runs each on its own.
``--compare`` runs both, each in its own process, and prints them side by side with the
ATen ops each step dispatches (counted on an untimed step: on a GPU each is a kernel
launch or a host-side op, the unit ``cost_model.launches`` prices).

``--graph``: the lookups and the loss as graph mode runs them (gemc's ``GraphExecutor``
on the captured ``torch.export`` graph of a module of those tables, compiled by
``torch.compile``: ``aot_eager`` on the CPU, whose compiled graph runs its ATen ops one by
one, so the count is the graph's ops before Inductor fuses the pointwise ones): the groups
looked up ahead of the compiled graph (:mod:`gemc.backends.torch.replica_ahead`), or with
``--graph-ahead 0`` each member looked up inside it and replayed by its group at the
optimizer's step (the path before the twenty-fifth session). The ops a gemc custom op runs
inside it (``gemc::table_lookup`` and its backward) are counted, the op itself not.

``--cpu-proxy``: on the CPU, tables cut to ``--proxy-rows`` rows of width
``--proxy-dim`` and a batch of ``--proxy-batch``, so the arithmetic is small and what the
wall time measures is mostly the host's work per op (Python, dispatch), a proxy for the
host cost a GPU step pays per launch; the Triton kernels take their ATen fallback there
(the interpreter would time its own emulation). A proxy, not the GPU's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

if not torch.cuda.is_available() and "--cpu-proxy" not in sys.argv:
    # before any kernel is decorated (gemc's runtime's rule); the CPU proxy keeps the
    # ATen fallbacks instead (see the module doc)
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch.distributed as dist  # noqa: E402
from gemc.backends.torch.embedding import ShardedEmbedding  # noqa: E402
from gemc.backends.torch.replica_groups import ReplicaLookups  # noqa: E402
from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer  # noqa: E402
from gemc.cost_model.calibration import default_calibration  # noqa: E402
from gemc.cost_model.kernels import REPLICA_BUCKET_KERNELS, hottest_row_ids  # noqa: E402
from gemc.cost_model.op_cost import DEFAULT_KERNEL_LAUNCH_S, eager_table_time  # noqa: E402
from gemc.cost_model.topology import parse_topology  # noqa: E402
from torch import nn  # noqa: E402
from torch._library.custom_ops import _maybe_get_opdef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from gemc.sharding import make_shards  # noqa: E402

# DLRMv2's Criteo tables (examples/dlrm/model.py) and pooling factors
ROWS = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
        2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
POOLING = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
DIM = 128


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--world", type=int, default=16, help="the ranks the replicas stand for")
    ap.add_argument("--max-rows", type=int, default=100_000)
    ap.add_argument("--optimizer", default="rowwise_adagrad", choices=("rowwise_adagrad", "adam"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, 3 tables, a small batch")
    ap.add_argument("--batched", type=int, choices=(0, 1), default=1,
                    help="1: replicas grouped (replica_groups); 0: each on its own")
    ap.add_argument("--compare", action="store_true",
                    help="run --batched 0 and 1, each in its own process, side by side")
    ap.add_argument("--graph", action="store_true",
                    help="graph mode: the GraphExecutor's compiled step (see the module doc)")
    ap.add_argument("--graph-ahead", type=int, choices=(0, 1), default=1,
                    help="graph mode, grouped: 1 the groups looked up ahead of the graph; "
                    "0 each member inside it (the path before)")
    ap.add_argument("--cpu-proxy", action="store_true",
                    help="CPU host-cost proxy: small tables and batch (see the module doc)")
    ap.add_argument("--proxy-rows", type=int, default=64)
    ap.add_argument("--proxy-dim", type=int, default=16)
    ap.add_argument("--proxy-batch", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.compare:
        return compare(args)
    device = torch.device(args.device)
    picked = [(r, p) for r, p in zip(ROWS, POOLING) if r < args.max_rows]
    batch = 65536 // args.world
    if args.smoke:
        picked, batch, args.steps, args.warmup = picked[:3], 64, 3, 1
    if args.cpu_proxy:
        picked = [(min(r, args.proxy_rows), p) for r, p in picked]
        batch = args.proxy_batch
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            row = measure(args, device, picked, batch)
        finally:
            dist.destroy_process_group()
    print(json.dumps(row, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1))
    return 0


class OpCount(TorchDispatchMode):
    """ATen ops dispatched under it that compute (views left out: they launch nothing; on
    a GPU each counted op is a kernel launch or a host-side op such as a copy). A gemc
    custom op is not counted itself but the ops it runs are (a nested count: the mode is
    off inside its own handler)."""

    def __init__(self, parent: OpCount | None = None) -> None:
        super().__init__()
        self.ops = 0
        self.parent = parent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        top = self.parent or self
        opdef = _maybe_get_opdef(func) if func.namespace == "gemc" else None
        if opdef is not None:  # its Python body, under a count of its own ops
            with OpCount(top):
                return opdef._init_fn(*args, **(kwargs or {}))
        top.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def compare(args: argparse.Namespace) -> int:
    """Both paths, each in a process of its own (no state shared), and a table of them."""
    import subprocess

    rows = []
    for batched in (0, 1):
        cmd = [sys.executable, __file__, "--batched", str(batched), "--device", args.device,
               "--world", str(args.world), "--max-rows", str(args.max_rows),
               "--optimizer", args.optimizer, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--proxy-rows", str(args.proxy_rows),
               "--proxy-dim", str(args.proxy_dim), "--proxy-batch", str(args.proxy_batch)]
        cmd += ["--smoke"] if args.smoke else []
        cmd += ["--cpu-proxy"] if args.cpu_proxy else []
        cmd += ["--graph", "--graph-ahead", str(args.graph_ahead)] if args.graph else []
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([*cmd, "--out", f.name], check=True, stdout=subprocess.DEVNULL)
            rows.append(json.loads(Path(f.name).read_text()))
    n = len(rows[0]["tables"])
    print(f"{n} replicas, batch {rows[0]['batch']}, dim {rows[0]['dim']}, "
          f"{args.optimizer}, {rows[0]['device']}"
          + (" (CPU proxy: wall ~ host work per op)" if args.cpu_proxy else "")
          + (f", graph mode ({'groups ahead of the graph' if args.graph_ahead else 'members in the graph'})"
             if args.graph else ", module mode"))
    head = ("path", "groups", "lookups ms", "opt step ms", "total ms", "ms/replica",
            "ops/step", "ops/replica")
    print(" | ".join(head))
    for r in rows:
        total = r["lookups_ms"] + r["optimizer_step_ms"]
        print(" | ".join([
            "grouped" if r["batched"] else "per table", str(r["groups"]),
            f"{r['lookups_ms']:.3f}", f"{r['optimizer_step_ms']:.3f}", f"{total:.3f}",
            f"{total / n:.4f}", str(r["ops_per_step"]), f"{r['ops_per_step'] / n:.2f}"]))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


def measure(args: argparse.Namespace, device: torch.device, picked: list[tuple[int, int]],
            batch: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    dim = args.proxy_dim if args.cpu_proxy else DIM
    tables: dict[str, ShardedEmbedding] = {}
    for i, (rows, _) in enumerate(picked):
        source = nn.EmbeddingBag(rows, dim, mode="sum", include_last_offset=True)
        plan_table = {"fqn": f"t{i}.weight", "rows": rows, "dim": dim,
                      "sharding": "data_parallel",
                      "shards": make_shards("data_parallel", [0, 1], rows, dim)}
        table = ShardedEmbedding(source, plan_table, rank=0, world_size=args.world, seed=0)
        table.to_empty(device=device)
        with torch.no_grad():
            table.weight.normal_(0, 0.01)
        tables[f"t{i}.weight"] = table
    cfg = EmbeddingOptimConfig.default_for(args.optimizer)
    opt = EmbeddingOptimizer(tables, cfg, world_size=args.world,
                             batched_replicas=bool(args.batched))
    hook = ReplicaLookups(opt.groups, opt.not_grouped)  # the runner's, module mode
    inputs = []
    for rows, pooling in picked:
        ids = torch.randint(0, rows, (batch * pooling,), generator=gen).to(device)
        offsets = (torch.arange(batch + 1) * pooling).to(device)
        inputs += [ids, offsets]
    entries = tuple(inputs)  # the batch as the runner hands it: its entries, recorded once
    probe = torch.randn(batch, dim, generator=gen).to(device)
    executor = graph_executor(args, tables, opt, entries, probe, device) if args.graph \
        else None

    def lookups_and_backward() -> None:
        if executor is not None:
            executor(*entries, probe).backward()
            return
        hook.begin_step(entries)
        loss = sum((t(entries[2 * k], entries[2 * k + 1]) * probe).sum()
                   for k, t in enumerate(tables.values()))
        loss.backward()
        hook.end_step()

    lookups, steps, synced = [], [], False
    ops = None
    for step in range(args.warmup + args.steps + 1):
        if step == args.warmup:  # one untimed step: the ATen ops it dispatches
            with OpCount() as count:
                lookups_and_backward()
                opt.step()
            opt.zero_grad()
            ops = count.ops
            continue
        sync(device)
        t0 = time.perf_counter()
        lookups_and_backward()
        sync(device)
        t1 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        except RuntimeError as exc:  # a sync under the debug mode: note it, time without
            if "synchroniz" not in str(exc):
                raise
            synced = True
            torch.cuda.set_sync_debug_mode("default")
            opt.step()
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        sync(device)
        t2 = time.perf_counter()
        opt.zero_grad()
        if step > args.warmup:
            lookups.append(t1 - t0)
            steps.append(t2 - t1)
    gpu = parse_topology("h200:1x1").gpu
    cal = default_calibration(gpu.name)
    fwd_bwd = opt_s = 0.0
    for rows, pooling in picked:
        nnz = batch * pooling
        f, b, o = eager_table_time("sparse", rows, dim, nnz, batch, 1, "fp32", gpu, cal,
                                   args.optimizer, None, args.world,
                                   hottest_row_ids(rows, nnz, 0))
        fwd_bwd, opt_s = fwd_bwd + f + b, opt_s + o
    launch = cal.kernel_s if cal is not None else DEFAULT_KERNEL_LAUNCH_S
    opt_s += REPLICA_BUCKET_KERNELS * launch
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world": args.world, "batch": batch, "dim": dim, "optimizer": args.optimizer,
            "batched": bool(args.batched), "groups": len(opt.groups),
            "mode": ("graph, groups ahead" if args.graph_ahead else "graph, in graph")
            if args.graph else "module",
            "ops_per_step": ops, "cpu_proxy": bool(args.cpu_proxy),
            "tables": [r for r, _ in picked], "steps": args.steps,
            "lookups_ms": 1e3 * statistics.median(lookups),
            "lookups_predicted_ms": 1e3 * fwd_bwd,
            "optimizer_step_ms": 1e3 * statistics.median(steps),
            "optimizer_step_predicted_ms": 1e3 * opt_s,
            "host_sync_in_step": synced,
            "all_reduces_per_step": 1}


class _Lookups(nn.Module):
    """The replicas as a model: each table a sum bag of the batch's ids and offsets, the
    loss their outputs against one probe (what ``lookups_and_backward`` runs eagerly)."""

    def __init__(self, sources: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, src in sources.items():
            self.add_module(name, src)

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        *entries, probe = batch
        return sum((t(entries[2 * k], entries[2 * k + 1]) * probe).sum()
                   for k, t in enumerate(self.children()))


def graph_executor(args: argparse.Namespace, tables: dict[str, ShardedEmbedding],
                   opt: EmbeddingOptimizer, entries: tuple, probe: torch.Tensor,
                   device: torch.device):  # noqa: ANN201
    """Graph mode's step over ``tables``: the captured graph of :class:`_Lookups`, the
    sharded tables answering its lookups (the runner's GraphExecutor, compiled)."""
    from gemc.backends.torch.graph_mode import GraphExecutor

    from gemc.capture import capture
    from gemc.spec import ModelSpec

    sources = {fqn.removesuffix(".weight"): nn.EmbeddingBag(  # on the batch's device: a
        # CPU bag over CUDA ids is a device mismatch at capture
        t.num_embeddings, t.embedding_dim, mode="sum", include_last_offset=True,
        device=device) for fqn, t in tables.items()}
    model = _Lookups(sources)
    captured = capture(ModelSpec(model=model, example_inputs=(*entries, probe),
                                 make_batch=None))
    for name, t in tables.items():  # the sharded tables in the model (shard_tables' work)
        setattr(model, name.removesuffix(".weight"), t)
    executor = GraphExecutor(captured.gm, captured.param_fqns, model, [], tables=tables,
                             emb_opt=opt, device=device, world_size=args.world)
    if not args.graph_ahead:
        executor.replicas_ahead = None  # each member inside the graph, as before
    return executor


if __name__ == "__main__":
    raise SystemExit(main())
