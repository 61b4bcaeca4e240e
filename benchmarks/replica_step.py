"""The bucketed step of data-parallel embedding replicas, measured beside its price (issue 19).

    # on one H200 (the numbers the cost model's replica price stands on):
    python3 benchmarks/replica_step.py --device cuda --out $OUT/replica_step.json
    # on the CPU, a check that it runs (not a measurement):
    .venv/bin/python benchmarks/replica_step.py --smoke

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

if not torch.cuda.is_available():  # before any kernel is decorated (gemc's runtime's rule)
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch.distributed as dist  # noqa: E402
from gemc.backends.torch.embedding import ShardedEmbedding  # noqa: E402
from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer  # noqa: E402
from gemc.cost_model.calibration import default_calibration  # noqa: E402
from gemc.cost_model.kernels import REPLICA_BUCKET_KERNELS, hottest_row_ids  # noqa: E402
from gemc.cost_model.op_cost import DEFAULT_KERNEL_LAUNCH_S, eager_table_time  # noqa: E402
from gemc.cost_model.topology import parse_topology  # noqa: E402
from torch import nn  # noqa: E402

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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    picked = [(r, p) for r, p in zip(ROWS, POOLING) if r < args.max_rows]
    batch = 65536 // args.world
    if args.smoke:
        picked, batch, args.steps, args.warmup = picked[:3], 64, 3, 1
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


def measure(args: argparse.Namespace, device: torch.device, picked: list[tuple[int, int]],
            batch: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    tables: dict[str, ShardedEmbedding] = {}
    for i, (rows, _) in enumerate(picked):
        source = nn.EmbeddingBag(rows, DIM, mode="sum", include_last_offset=True)
        plan_table = {"fqn": f"t{i}.weight", "rows": rows, "dim": DIM,
                      "sharding": "data_parallel",
                      "shards": make_shards("data_parallel", [0, 1], rows, DIM)}
        table = ShardedEmbedding(source, plan_table, rank=0, world_size=args.world, seed=0)
        table.to_empty(device=device)
        with torch.no_grad():
            table.weight.normal_(0, 0.01)
        tables[f"t{i}.weight"] = table
    cfg = EmbeddingOptimConfig.default_for(args.optimizer)
    opt = EmbeddingOptimizer(tables, cfg, world_size=args.world)
    inputs = []
    for rows, pooling in picked:
        ids = torch.randint(0, rows, (batch * pooling,), generator=gen).to(device)
        offsets = (torch.arange(batch + 1) * pooling).to(device)
        inputs.append((ids, offsets))
    probe = torch.randn(batch, DIM, generator=gen).to(device)
    lookups, steps, synced = [], [], False
    for step in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        loss = sum((t(ids, off) * probe).sum() for t, (ids, off) in zip(tables.values(), inputs))
        loss.backward()
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
        if step >= args.warmup:
            lookups.append(t1 - t0)
            steps.append(t2 - t1)
    gpu = parse_topology("h200:1x1").gpu
    cal = default_calibration(gpu.name)
    fwd_bwd = opt_s = 0.0
    for rows, pooling in picked:
        nnz = batch * pooling
        f, b, o = eager_table_time("sparse", rows, DIM, nnz, batch, 1, "fp32", gpu, cal,
                                   args.optimizer, None, args.world,
                                   hottest_row_ids(rows, nnz, 0))
        fwd_bwd, opt_s = fwd_bwd + f + b, opt_s + o
    launch = cal.kernel_s if cal is not None else DEFAULT_KERNEL_LAUNCH_S
    opt_s += REPLICA_BUCKET_KERNELS * launch
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world": args.world, "batch": batch, "optimizer": args.optimizer,
            "tables": [r for r, _ in picked], "steps": args.steps,
            "lookups_ms": 1e3 * statistics.median(lookups),
            "lookups_predicted_ms": 1e3 * fwd_bwd,
            "optimizer_step_ms": 1e3 * statistics.median(steps),
            "optimizer_step_predicted_ms": 1e3 * opt_s,
            "host_sync_in_step": synced,
            "all_reduces_per_step": 1}


if __name__ == "__main__":
    raise SystemExit(main())
