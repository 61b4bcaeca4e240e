"""A gather's backward into few rows: contended scatter-add, eager and under Inductor.

Why: HSTU's relative time bias gathers ``ts_w`` (129 rows) at every position of a
``[B, L, L]`` bucket map, 33.5M ids a layer at its h200 preset; the backward scatter-adds
33.5M fp32 gradients into those 129 rows. The cost model prices a gather's backward as the
stream of its bytes (``op_cost``: 2x the forward's), which a scatter whose atomics collide
on a few addresses need not reach. The zoo's HSTU run measured 117 ms where the plan of that
same program predicts ~40 ms (BENCHMARKS.md, issue 18); this measures whether this term
is the gap, and at which row counts the stream rule holds.

For each (ids, rows) of the grid: forward + backward of ``torch.index_select(w, 0, ids)``
(fp32 ``w`` of ``rows`` x ``dim``, ids uniform in ``[0, rows)``), eager and with
``torch.compile``, and gemc's ``gemc::gather_rows`` (the op graph mode routes such gathers
to, ``backends/triton/small_table_gather.py``) for tables of <= 4,096 rows; the median ms,
and the ms its bytes stream at the GPU's HBM bandwidth (gemc.cost_model.hardware), so
``x_stream`` says how far contention is from the rule. ``--hstu`` adds HSTU's own two
gathers at its h200 preset (B 128, L 512): relative positions ``j - i`` into 1,023 rows
and log time buckets into 129 rows with half the pairs padding (bucket 0). ``--sweep``
times gemc's backward alone (``row_sums``) at HSTU's gathers for a few launches (ids per
program, ids per tile, warps): what ``RowSumsLaunch``'s default is chosen from.

    python3 benchmarks/scatter_add_contention.py --out contention.json      # on the H200
    python3 benchmarks/scatter_add_contention.py --smoke --out /tmp/c.json  # CPU crash check
    python3 benchmarks/scatter_add_contention.py --no-grid --sparse-rows --out rows.json

``--sparse-rows`` times the runner's sparse-gradient row sum (``sparse_optim.summed_rows``)
at DLRMv2's small tables against the cost model's price of their duplicates.

``--smoke``: tiny sizes on the CPU, eager only (CPU times say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

GRID_IDS = (1 << 20, 1 << 25)
GRID_ROWS = (129, 1023, 1 << 16, 1 << 20)
SMOKE_IDS = (4096,)
SMOKE_ROWS = (4, 64)


def _timed(fn: Callable[[], None], device: torch.device, iters: int) -> float:
    """Median ms of ``fn`` after two warm-up calls (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def stream_ms(ids: int, rows: int, dim: int, bandwidth: float) -> float:
    """ms the forward and backward bytes take streamed at ``bandwidth`` (B/s): the forward
    reads the ids and the gathered rows and writes the output; the backward reads the
    output's gradient and the ids and adds into the rows' gradient (zero-filled)."""
    fwd = ids * 8 + 2 * ids * dim * 4
    bwd = ids * 8 + ids * dim * 4 + 2 * rows * dim * 4
    return 1e3 * (fwd + bwd) / bandwidth


def hstu_ids(kind: str, batch: int = 128, n: int = 512) -> tuple[torch.Tensor, int]:
    """(ids, rows) of HSTU's relative-bias gathers: ``pos`` (``j - i + n - 1``, 2n-1 rows)
    or ``ts`` (log2-ish time buckets of |t_i - t_j|, 129 rows, the second half of every
    history padding with time 0)."""
    gen = torch.Generator().manual_seed(7)
    if kind == "pos":
        i = torch.arange(n)
        return (i[None, :] - i[:, None] + n - 1).expand(batch, n, n).flatten(), 2 * n - 1
    t = torch.cumsum(torch.randint(0, 3600, (batch, n), generator=gen), 1)
    t[:, n // 2:] = 0
    dt = (t[:, :, None] - t[:, None, :]).abs().clamp(min=1).float()
    return (torch.log(dt) / 0.301).long().clamp(0, 128).flatten(), 129


def measure(ids: int, rows: int, dim: int, device: torch.device, variant: str,
            iters: int, index: torch.Tensor | None = None) -> float:
    """Median ms of one forward + backward of the gather (``variant``: eager, compile or
    gemc)."""
    gen = torch.Generator().manual_seed(ids + rows)
    if index is None:
        index = torch.randint(0, rows, (ids,), generator=gen)
    index = index.to(device)
    weight = torch.randn(rows, dim, generator=gen).to(device).requires_grad_()
    grad = torch.ones(ids, dim, device=device)

    def gather(w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.index_select(w, 0, i)

    if variant == "gemc":
        from gemc.backends.triton import small_table_gather  # noqa: F401 (registers the op)
        fn = torch.ops.gemc.gather_rows
    else:
        fn = torch.compile(gather) if variant == "compile" else gather

    def step() -> None:
        weight.grad = None
        fn(weight, index).backward(grad)

    return _timed(step, device, iters)


SWEEP = ((2048, 128, 4), (2048, 256, 8), (8192, 128, 4), (8192, 256, 8), (8192, 512, 8),
         (4096, 256, 4))


def sweep(device: torch.device, iters: int, small: bool = False) -> list[dict[str, Any]]:
    """Median ms of ``row_sums`` alone per launch (chunk, block, warps) at HSTU's gathers,
    and its largest error relative to ``index_add_``'s largest sum."""
    from gemc.backends.triton.small_table_gather import RowSumsLaunch, row_sums

    out = []
    for kind in ("pos", "ts"):
        index, rows = hstu_ids(kind, *((2, 64) if small else ()))
        index = index.to(device)
        grad = torch.randn(index.numel(), device=device)
        want = torch.zeros(rows, device=device).index_add_(0, index, grad)
        for chunk, block, warps in SWEEP[:2] if small else SWEEP:
            launch = RowSumsLaunch(chunk=chunk, block=block, warps=warps)
            err = (row_sums(index, grad, rows, launch) - want).abs().max().item() / \
                max(want.abs().max().item(), 1e-30)
            ms = _timed(lambda i=index, g=grad, r=rows, lc=launch: row_sums(i, g, r, lc),
                        device, iters)
            out.append({"case": f"hstu_{kind}", "ids": index.numel(), "rows": rows,
                        "variant": f"row_sums chunk={chunk} block={block} warps={warps}",
                        "ms": ms, "max_rel_err_vs_index_add": err})
            print(f"hstu_{kind:<3} rows {rows:>5} row_sums chunk {chunk:>5} block {block:>4} "
                  f"warps {warps}  {ms:8.3f} ms  rel err {err:.1e}", flush=True)
    return out


# DLRMv2's smallest tables (rows) and the ids a table-wise shard of one takes a step at
# global batch 65,536, one id a bag: the duplicates the runner's sparse optimizer sums
SPARSE_ROWS = (3, 4, 10, 14, 36, 63, 155, 976, 17295)
SPARSE_IDS = 65536


def sparse_rows(device: torch.device, iters: int, small: bool = False
                ) -> list[dict[str, Any]]:
    """Median ms of the runner's sparse-gradient row sum (``sparse_optim.summed_rows``: a
    sort, then ``index_add_`` of every id's gradient row into its run's slot, so one row's
    duplicates contend on atomics) at DLRMv2's small tables, 128 wide, against what the
    cost model charges for those duplicates (``op_cost.eager_table_time``: the hottest
    row's ids x ``kernels.COALESCE_DUPLICATE_S``, fitted on the ``coalesce`` the runner no
    longer runs) and what the measured atomic chain of a dense-gradient scatter would
    charge (x ``kernels.DENSE_GRAD_HOT_ADD_S``). Why: on DLRMv2 at 16 ranks the 3-row
    table's shard is priced 5.96 ms, the plan's slowest rank (BENCHMARKS.md, issue 19)."""
    from gemc.backends.torch.sparse_optim import summed_rows
    from gemc.cost_model import kernels

    ids_n, dim = (4096, 8) if small else (SPARSE_IDS, 128)
    out = []
    for rows in (SPARSE_ROWS[:2] if small else SPARSE_ROWS):
        gen = torch.Generator().manual_seed(rows)
        ids = torch.randint(0, rows, (ids_n,), generator=gen).to(device)
        values = torch.randn(ids_n, dim, generator=gen).to(device)
        got = summed_rows(ids, values, rows)
        want = torch.zeros(rows, dim, device=device).index_add_(0, ids, values)
        # slots past the distinct rows repeat the last one with its sum: copy, never add
        summed = torch.zeros(rows, dim, device=device).index_copy_(0, got.rows, got.grads)
        err = ((summed - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
        ms = _timed(lambda i=ids, v=values, r=rows: summed_rows(i, v, r), device, iters)
        hot = kernels.hottest_row_ids(rows, ids_n, 0)
        out.append({"case": "sparse_rows", "ids": ids_n, "rows": rows, "dim": dim,
                    "variant": "summed_rows", "ms": ms, "hottest_row_ids": hot,
                    "priced_ms": 1e3 * hot * kernels.COALESCE_DUPLICATE_S,
                    "atomic_chain_ms": 1e3 * hot * kernels.DENSE_GRAD_HOT_ADD_S,
                    "max_rel_err_vs_index_add": err})
        print(f"sparse_rows ids {ids_n:>6} rows {rows:>6} summed_rows {ms:8.3f} ms  priced "
              f"{out[-1]['priced_ms']:8.3f} ms  atomic chain {out[-1]['atomic_chain_ms']:7.3f} ms",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON results")
    p.add_argument("--dim", type=int, default=1, help="row width (HSTU's bias tables: 1)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, eager only")
    p.add_argument("--hstu", action="store_true", help="add HSTU's own two gathers")
    p.add_argument("--sweep", action="store_true",
                   help="time gemc's backward at HSTU's gathers per launch choice")
    p.add_argument("--sparse-rows", action="store_true",
                   help="time the runner's sparse-gradient row sum at DLRMv2's small tables")
    p.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True,
                   help="the uniform-ids grid (--no-grid: HSTU's gathers only)")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("scatter_add_contention: needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    from gemc.cost_model.hardware import get_gpu

    device = torch.device("cpu" if args.smoke else "cuda")
    bandwidth = get_gpu("h200").hbm_bandwidth
    variants = ("eager", "gemc") if args.smoke else ("eager", "compile", "gemc")
    cases: list[tuple[str, int, int, torch.Tensor | None]] = []
    if args.grid:
        cases += [("uniform", ids, rows, None)
                  for ids in (SMOKE_IDS if args.smoke else GRID_IDS)
                  for rows in (SMOKE_ROWS if args.smoke else GRID_ROWS)]
    if args.hstu:
        for kind in ("pos", "ts"):
            index, rows = hstu_ids(kind, *((2, 64) if args.smoke else ()))
            cases.append((f"hstu_{kind}", index.numel(), rows, index))
    rows_out: list[dict[str, Any]] = []
    for case, ids, rows, index in cases:
        stream = stream_ms(ids, rows, args.dim, bandwidth)
        for variant in variants:
            if variant == "gemc" and rows > 4096:  # graph mode routes only small tables
                continue
            ms = measure(ids, rows, args.dim, device, variant, args.iters, index)
            rows_out.append({"case": case, "ids": ids, "rows": rows, "dim": args.dim,
                             "variant": variant, "ms": ms, "stream_ms": stream,
                             "x_stream": ms / stream})
            print(f"{case:<8} ids {ids:>9} rows {rows:>8} {variant:<8} {ms:9.3f} ms  "
                  f"stream {stream:8.3f} ms  x{ms / stream:8.1f}", flush=True)
    if args.sweep:
        rows_out += sweep(device, args.iters, small=args.smoke)
    if args.sparse_rows:
        rows_out += sparse_rows(device, args.iters, small=args.smoke)
    doc = {"benchmark": "scatter_add_contention", "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "torch": torch.__version__, "results": rows_out}
    out = Path(args.out)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
