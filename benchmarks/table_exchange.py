"""Sharded-table lookups: one exchange per table against one exchange for all tables.

    python benchmarks/table_exchange.py [--world 2] [--tables 8,64,256] [--device cpu|cuda]
                                        [--sharding row_wise] [--out results.json]
    python benchmarks/table_exchange.py --smoke        # 2 CPU processes, tiny, a few steps

Starts ``--world`` processes (gloo on CPU, NCCL on CUDA, one GPU each), builds ``T``
``nn.EmbeddingBag`` tables sharded as ``--sharding`` over all ranks, and times a training
step's lookups (forward, a sum loss, backward into the owners' sparse gradients) two ways
on the same batch: ``per_table`` calls each ``ShardedEmbedding`` (what a table whose ids the
model computes does: 4 ``all_to_all_single`` and 2 host syncs each), ``batched`` looks them
all up with one ``exchange_lookups`` (what the runner's prefetch does for tables called with
the batch's own tensors). Both must give the same outputs and gradients (checked each run).
Rank 0 prints the median ms per step, the collectives per step and the ratio.

``--exchange-precision fp32,bf16,fp8`` also times the batched step with the pooled rows
sent at each wire precision (gemc.exchange_precision; fp8 forward, bf16 backward) and
prints the ms, the bytes the pooled exchanges sent (forward + backward, rank 0) and the
SQNR of the outputs and gradients against fp32's: what the cost model's
``StepOptions.exchange`` pricing predicts.

``--gpus-per-host N`` (below ``--world``) makes the ranks ``world / N`` hosts: row shards
sharing a host then sum their partials there before crossing hosts
(backends/torch/host_reduce.py), and the batched step is also timed with that off
(``GEMC_ROW_SHARD_HOST_REDUCE=0``, the direct path), printing both ms and the pooled bytes
rank 0 exchanged with other hosts (sent + received, forward + backward). On one machine
the "hosts" share its links: the bytes are the point, the ms only a sanity check.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

REPO = Path(__file__).resolve().parents[1]
BYTES = {"float32": 4, "bfloat16": 2, "uint8": 1, "float16": 2, "float64": 8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tables(model: nn.Module, n: int, rows: int, dim: int, sharding: str, world: int
            ) -> list[dict[str, Any]]:
    from gemc.sharding import make_shards

    ranks = list(range(world))
    out = []
    for i in range(n):
        kind = sharding
        use = [i % world] if kind == "table_wise" else ranks
        out.append({"fqn": f"bags.{i}.weight", "rows": rows, "dim": dim, "sharding": kind,
                    "shards": make_shards(kind, use, rows, dim)})
    return out


def _batch(n: int, rows: int, batch: int, pooling: int, rank: int, device: torch.device
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 2 * pooling + 1, (batch,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        ids = torch.randint(0, rows, (int(offsets[-1]),), generator=g)
        out.append((ids.to(device), offsets.to(device)))
    return out


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world)
    from gemc.backends.torch.comm import count_all_to_all, count_calls
    from gemc.backends.torch.embedding import shard_tables
    from gemc.backends.torch.embedding_exchange import exchange_lookups
    from gemc.backends.torch.host_reduce import ENV

    from gemc.exchange_precision import WirePrecision
    from gemc.probe_types import sqnr_db

    sent: list[tuple[str, int]] = []
    calls = count_all_to_all(sent)
    per_host = args.gpus_per_host or args.world
    far = [0]  # float bytes rank `rank` exchanged with ranks of other hosts

    def cross_host(output, data, out_splits, in_splits, **_: Any) -> None:  # noqa: ANN001
        if data.dtype != torch.int64:
            far[0] += data.element_size() * sum(
                out_splits[d] + in_splits[d] for d in range(args.world)
                if d // per_host != rank // per_host)

    count_calls("all_to_all_single", cross_host)
    rows: list[dict[str, Any]] = []
    try:
        for n in args.tables:
            model = nn.Module()
            model.bags = nn.ModuleList(
                nn.EmbeddingBag(args.rows, args.dim, mode="sum", include_last_offset=True,
                                device="meta") for _ in range(n))
            tables = shard_tables(model, _tables(model, n, args.rows, args.dim, args.sharding,
                                                 args.world),
                                  rank=rank, world_size=args.world, seed=0,
                                  gpus_per_host=args.gpus_per_host)
            mods = list(tables.values())
            for m in mods:
                if m.weight is not None:
                    m.weight = nn.Parameter(torch.empty_like(m.weight, device=device))
                    m.reset_parameters()
            batch = _batch(n, args.rows, args.batch, args.pooling, rank, device)

            def per_table(mods: list = mods, batch: list = batch) -> list[torch.Tensor]:
                return [m(ids, offs) for m, (ids, offs) in zip(mods, batch)]

            def batched(mods: list = mods, batch: list = batch) -> list[torch.Tensor]:
                bags = []
                for m, (ids, offs) in zip(mods, batch):
                    i, o, w, _ = m.as_bags(ids, offs, None)
                    bags.append(m.routed_bags(i, o, w))
                return exchange_lookups(mods, bags, world=args.world)

            def timed(fn: Any, mods: list = mods) -> dict[str, Any]:
                times = []
                for step in range(args.warmup + args.steps):
                    for m in mods:
                        if m.weight is not None:
                            m.weight.grad = None
                    if cuda:
                        torch.cuda.synchronize()
                    dist.barrier()
                    calls[0] = 0
                    far[0] = 0
                    sent.clear()
                    t0 = time.perf_counter()
                    outs = fn()
                    # a loss whose gradient differs per element (a sum's is all ones, which
                    # every wire carries exactly)
                    torch.stack([(o * o).sum() for o in outs]).sum().backward()
                    if cuda:
                        torch.cuda.synchronize()
                    if step >= args.warmup:
                        times.append((time.perf_counter() - t0) * 1e3)
                return {
                    "ms": statistics.median(times), "all_to_all": calls[0],
                    "pooled_bytes": sum(n * BYTES[d] for d, n in sent if d != "int64"),
                    "cross_host_bytes": far[0],
                    "outs": [o.detach().cpu() for o in outs],
                    "grads": [m.weight.grad.coalesce().to_dense().cpu()
                              if m.weight is not None and m.weight.grad is not None else None
                              for m in mods]}

            results = {name: timed(fn) for name, fn in (("per_table", per_table),
                                                          ("batched", batched))}
            wires: dict[str, Any] = {}
            for precision in args.exchange_precision:
                for m in mods:
                    m.exchange = WirePrecision.of(precision)
                got = timed(batched)
                ref = results["batched"]
                pairs = [(a, b) for a, b in zip(ref["outs"] + ref["grads"],
                                                got["outs"] + got["grads"]) if a is not None]
                db = sqnr_db(torch.cat([a.reshape(-1) for a, _ in pairs]),
                             torch.cat([b.reshape(-1) for _, b in pairs]))
                wires[precision] = {"ms": got["ms"], "pooled_bytes": got["pooled_bytes"],
                                    "sqnr_db": db if math.isfinite(db) else None}  # exact
            for m in mods:
                m.exchange = WirePrecision()
            host_reduce: dict[str, Any] = {}
            if per_host < args.world:  # the same step with the direct path
                before = os.environ.get(ENV)
                os.environ[ENV] = "0"
                try:
                    direct = timed(batched)
                finally:
                    if before is None:
                        os.environ.pop(ENV)
                    else:
                        os.environ[ENV] = before
                ref = results["batched"]
                for a, b in zip(ref["outs"] + ref["grads"], direct["outs"] + direct["grads"]):
                    if a is not None or b is not None:
                        torch.testing.assert_close(a, b)
                host_reduce = {k: {"ms": r["ms"], "cross_host_bytes": r["cross_host_bytes"],
                                   "all_to_all": r["all_to_all"]}
                               for k, r in (("on", ref), ("off", direct))}
            for a, b in zip(results["per_table"]["outs"], results["batched"]["outs"]):
                torch.testing.assert_close(a, b)
            for a, b in zip(results["per_table"]["grads"], results["batched"]["grads"]):
                if a is not None or b is not None:
                    torch.testing.assert_close(a, b)
            # every rank's slowest is the step's time
            ms = torch.tensor([results[k]["ms"] for k in ("per_table", "batched")]
                              + [wires[p]["ms"] for p in args.exchange_precision])
            dist.all_reduce(ms, dist.ReduceOp.MAX)
            for p, v in zip(args.exchange_precision, ms[2:].tolist()):
                wires[p]["ms"] = v
            rows.append({"tables": n, "per_table_ms": float(ms[0]), "batched_ms": float(ms[1]),
                         "per_table_all_to_all": results["per_table"]["all_to_all"],
                         "batched_all_to_all": results["batched"]["all_to_all"],
                         "speedup": float(ms[0] / ms[1]), "exchange": wires,
                         "host_reduce": host_reduce})
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
        dist.destroy_process_group()
    from gemc.backends.torch.comm import exit_skipping_finalization

    exit_skipping_finalization(0)  # gloo can abort in finalization (see its docstring)


def _spawnable_worker() -> Any:
    """``spawn`` pickles the worker by its module's name: run as a script that is
    ``__main__`` (the children re-run the file); loaded under another name (the tests load
    benchmarks by path) the children could not import it, so use the file's own name."""
    if __name__ == "__main__":
        return _worker
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    return importlib.import_module("table_exchange")._worker


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tables", default="8,64,256")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512, help="bags per table and rank")
    ap.add_argument("--pooling", type=int, default=8, help="mean ids per bag")
    ap.add_argument("--sharding", default="row_wise",
                    choices=["row_wise", "table_wise", "column_wise"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--exchange-precision", default="",
                    help="also time the batched step with the pooled rows sent at these wire "
                    "precisions, comma-separated (fp32,bf16,fp8)")
    ap.add_argument("--gpus-per-host", type=int, default=None,
                    help="ranks per host (default: all on one host); below --world, row "
                    "shards sum inside each host first, timed against the direct path")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (CPU)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        args.tables, args.rows, args.batch, args.steps, args.warmup = "2,6", 50, 4, 2, 1
    try:
        args.tables = [int(t) for t in str(args.tables).split(",")]
    except ValueError:
        ap.error(f"--tables {args.tables!r}: expected comma-separated integers, e.g. 8,64")
    from gemc.exchange_precision import EXCHANGE_PRECISIONS

    args.exchange_precision = [p for p in args.exchange_precision.split(",") if p]
    bad = [p for p in args.exchange_precision if p not in EXCHANGE_PRECISIONS]
    if bad:
        ap.error(f"--exchange-precision {','.join(bad)}: expected some of "
                 f"{','.join(EXCHANGE_PRECISIONS)}, comma-separated")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        ap.error(f"--device cuda --world {args.world}: this machine has "
                 f"{torch.cuda.device_count()} GPU(s); pass --world <= that, or --device cpu")
    if args.gpus_per_host is not None and not (
            0 < args.gpus_per_host <= args.world and args.world % args.gpus_per_host == 0):
        ap.error(f"--gpus-per-host {args.gpus_per_host}: expected a divisor of --world "
                 f"{args.world}")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"table_exchange.{os.getpid()}.json"
    mp.start_processes(_spawnable_worker(), args=(args, _free_port(), str(tmp)), nprocs=args.world,
                       join=True, start_method="spawn")
    rows = json.loads(tmp.read_text())
    tmp.unlink()
    print(f"{args.world} ranks, {args.device}, {args.sharding}, {args.batch} bags x "
          f"~{args.pooling} ids per table and rank, dim {args.dim}")
    print(f"{'tables':>7} {'per-table ms':>13} {'batched ms':>11} {'x':>6} "
          f"{'all_to_all per-table/batched':>29}")
    for r in rows:
        print(f"{r['tables']:>7} {r['per_table_ms']:>13.2f} {r['batched_ms']:>11.2f} "
              f"{r['speedup']:>6.2f} {r['per_table_all_to_all']:>16}/{r['batched_all_to_all']}")
    if args.exchange_precision:
        print(f"{'tables':>7} {'wire':>5} {'batched ms':>11} {'pooled MB (rank 0)':>19} "
              f"{'SQNR dB vs fp32':>16}")
        for r in rows:
            for p, w in r["exchange"].items():
                db = "exact" if w["sqnr_db"] is None else f"{w['sqnr_db']:.1f}"
                print(f"{r['tables']:>7} {p:>5} {w['ms']:>11.2f} "
                      f"{w['pooled_bytes'] / 1e6:>19.3f} {db:>16}")
    if any(r["host_reduce"] for r in rows):
        print(f"{'tables':>7} {'host reduce':>11} {'batched ms':>11} "
              f"{'cross-host MB (rank 0)':>23} {'all_to_all':>11}")
        for r in rows:
            for k, h in r["host_reduce"].items():
                print(f"{r['tables']:>7} {k:>11} {h['ms']:>11.2f} "
                      f"{h['cross_host_bytes'] / 1e6:>23.3f} {h['all_to_all']:>11}")
    if args.out:
        from gemc.atomic_write import write_atomic

        env = {"torch": torch.__version__, "python": platform.python_version(),
               "machine": platform.machine(), "cpus": os.cpu_count(),
               "argv": sys.argv[1:]}
        write_atomic(args.out, json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
