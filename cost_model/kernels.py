"""How much work a kernel does: FLOPs and bytes of forward and backward, by op kind.

One place for these formulas so that calibration (turning a measured time into an
efficiency) and op costing (turning an efficiency back into a time) agree exactly.
Conventions: a multiply-add is 2 FLOPs; bytes are what the kernel reads plus writes in HBM.
"""

from __future__ import annotations

import math

INDEX_BYTES = 8          # int64 indices, as torch.nn.EmbeddingBag takes them
SECTOR_BYTES = 32        # the smallest piece of HBM a GPU load moves (an L2 sector)
ATTENTION_BWD_FLOPS = 2.5  # FlashAttention-2 backward ~2.5x forward FLOPs (5 GEMMs vs 2,
#                            recomputing P), Dao 2023, section 3.1


def gemm_flops(batch: int, m: int, n: int, k: int) -> float:
    return 2.0 * batch * m * n * k


def gemm_bytes(batch: int, m: int, n: int, k: int, elt: int) -> float:
    return float(batch) * (m * k + k * n + m * n) * elt


def gemm_backward_problems(batch: int, m: int, n: int, k: int) -> list[tuple[int, int, int, int]]:
    """The two backward GEMMs of out[m,n] = x[m,k] @ w[k,n] as (batch, M, N, K):
    dgrad dx[m,k] = dout[m,n] @ w^T, wgrad dw[k,n] = x^T @ dout[m,n] (2x forward FLOPs)."""
    return [(batch, m, k, n), (batch, k, n, m)]


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    causal: bool) -> float:
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim
    return flops / 2 if causal else flops


def attention_bytes(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    elt: int) -> float:
    """Flash attention reads Q, K, V and writes O (+ the row log-sum-exp)."""
    return float(batch) * heads * (2 * q_len * head_dim + 2 * kv_len * head_dim) * elt


def embedding_fwd_bytes(nnz: int, dim: int, bags: int, elt: int) -> float:
    """Gather nnz rows, write one pooled row per bag, read the indices."""
    return float(nnz) * dim * elt + float(bags) * dim * elt + float(nnz) * INDEX_BYTES


def row_sector_waste(dim: int, elt: float) -> float:
    """Bytes a randomly gathered row of ``dim`` elements of ``elt`` bytes moves beyond its
    own: a gather reads whole 32-byte sectors, so a row narrower than a sector (an 8-wide
    bf16 column shard: 16 bytes) or not a whole number of them still costs the rounded-up
    sectors. Rows of a contiguous shard start on their own stride, so a row of whole
    sectors wastes nothing."""
    row = dim * elt
    return math.ceil(row / SECTOR_BYTES) * SECTOR_BYTES - row if row > 0 else 0.0


def expected_unique_rows(rows: int, nnz: int) -> float:
    """Distinct rows touched by nnz uniform lookups: rows * (1 - (1 - 1/rows)^nnz)."""
    if rows <= 0 or nnz <= 0:
        return 0.0
    return rows * -math.expm1(nnz * math.log1p(-1.0 / rows)) if rows > 1 else 1.0


def embedding_bwd_bytes(nnz: int, dim: int, bags: int, rows: int, elt: int, *,
                        dense_grad: bool) -> float:
    """Gradient of a lookup: read the pooled gradient, sort the indices, accumulate nnz
    gradient rows into the touched rows. Eager PyTorch (``sparse=False``) also zero-fills
    a dense gradient of the whole table first."""
    touched = expected_unique_rows(rows, nnz)
    work = float(bags) * dim * elt + 3.0 * nnz * INDEX_BYTES + float(nnz) * dim * elt \
        + 2.0 * touched * dim * elt
    if dense_grad:
        work += float(rows) * dim * elt
    return work


# Optimizer state per parameter element (in units of the parameter's element size),
# and HBM passes of one step over (param, grad, states).
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adagrad": 1, "rowwise_adagrad": 0,
                    "adam": 2, "adamw": 2}
# Fused (one kernel): read p, g, states; write p, states. torch's foreach AdamW
# (the eager default on CUDA) makes 8 passes: weight decay 2, lerp 3, mul 2, addcmul 3,
# sqrt 2, div 2, add 2, addcdiv 4 = 20 element-reads/writes per parameter.
_FUSED_PASSES = {name: 3 + 2 * s for name, s in OPTIMIZER_STATES.items()}
_FOREACH_PASSES = {"sgd": 3, "momentum": 6, "adagrad": 10, "rowwise_adagrad": 4, "adam": 18,
                   "adamw": 20}


def optimizer_bytes(optimizer: str, numel: float, elt: int, *, fused: bool = True) -> float:
    """HBM bytes of one optimizer step over ``numel`` parameters of ``elt`` bytes."""
    name = optimizer.lower()
    if name not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATES)}")
    passes = (_FUSED_PASSES if fused else _FOREACH_PASSES)[name]
    return passes * float(numel) * elt


# ---- a table outside the batched kernel (gemc.table_lookup SPARSE / DENSE_GRAD) ---------
# The sparse optimizer's row update, eager (backends/torch/sparse_optim.py): HBM passes over
# the touched rows' fp32 values (a pass = one [rows, dim] tensor read or written) and the
# kernels it launches. rowwise_adagrad: / world 2, read rows 2, pow 2, sum 1, lr * g 2,
# / denominator 2, w - 3, write rows 2, plus 5 kernels on the per-row accumulator;
# adam (lazy): 2 gathers of the moments, their two updates (5 + 5), 2 scatters, read rows,
# sqrt, + eps, step * m, /, w -, write rows.
EAGER_ROW_UPDATE = {"rowwise_adagrad": (16.0, 13), "adam": (44.0, 19)}
# a sort of nnz int64 ids with their int64 positions (coalesce, unique): radix passes, each
# reading and writing key and value
_SORT_PASSES = 4


# The sparse gradient's coalesce (torch's ``coalesceValuesKernel``) sums each distinct
# id's gradient rows in one warp, one duplicate after another: a row looked up k times a
# step costs k dependent gathers in sequence, however wide the GPU. Seconds per
# duplicate on the H200, fitted on one measurement: DIN h200's 18 tables on the sparse
# route trained at 318.4 ms a step against 41.3 ms on the dense gradient (BENCHMARKS.md),
# ~277 ms over the 2 x 524,288 padding ids of its two history lookups (one id each).
# Cross-check, not fitted: GEM's eager profile spends 25.3 ms in that kernel over 102
# tables whose skewed ids put ~88k duplicates on their hottest rows (this prices 23 ms).
# The runner no longer coalesces (sparse_optim.summed_rows adds the duplicates with
# index_add, contended atomics on one row): the price is kept until that is measured.
COALESCE_DUPLICATE_S = 2.65e-7
# An unpooled lookup's table-sized gradient, as the runner computes it inside the compiled
# graph (gemc.table_lookup's DENSE_GRAD: Inductor's ``embedding_dense_backward``, one
# atomic add per id and column): the adds on one row serialise. Seconds per id of the
# hottest row, measured on DIN's sync-free H200 step (e05fd50, rows_e05fd50.tar.gz): its
# two history tables' backwards, 1,048,576 ids each with 524,288 padding ids on one row,
# took 2.605 and 2.586 ms, the same on 100k rows (cate) and 4M rows (goods): set by the
# pad row, not by the 0.3 GB of rows the kernel moves (~0.15 ms at the rows' rate).
DENSE_GRAD_HOT_ADD_S = 0.5 * (2.605e-3 + 2.586e-3) / 524288
# gemc::gather_rows' backward (backends/triton/small_table_gather.py ``_row_sums_kernel``):
# seconds per id and row element. The kernel compares each block of ids with a tile of the
# rows its chunk spans and sums in registers: bound by that compare, not by HBM (its ids and
# values stream in ~0.2 ms, the kernel takes ~6x that). Measured in HSTU's step on the H200
# (the Kineto traces of rows_e05fd50.tar.gz and hstu_c1d6b51.tar.gz under
# benchmarks/results/zoo_h200_session7/): each layer's time-bucket gather, 33,554,432 ids of
# one element into 129 rows, 1.253-1.260 ms at both commits (8,192 ids a program), 37.5 ps
# an id. Alone, on synthetic buckets, the same kernel took 0.99 ms (2,048 ids a program, now
# the default: 0.90 ms; gathers_sweep_c1d6b51.json): the step's figure is kept, what runs.
ROW_SUMS_S_PER_ID = 1.258e-3 / 33554432
# A shard's step in gemc's batched lookup (forward, backward, fused row-wise Adagrad) has a
# floor: one 40M-row fp32 shard at local batch 4,096 took 0.61-0.99 ms at every width 8-128
# and at pooling 12 and 100 (49,152 and 409,600 ids) on the H200, where its bytes are priced
# 0.007-0.77 ms (benchmarks/results/zoo_h200_session9/narrow_7e2449b.json, "narrow":
# "gemc triton fwd+bwd+opt"; `python3 benchmarks/kernels.py --cases narrow`, 7e2449b). The
# mean of those ten steps, 0.855 ms, is the floor that fits max(bytes, floor) best (least
# squares: the mean of the points under it; residuals -0.24..+0.14 ms). Measured at one
# batch only (the floor does not move with ids there, so it is not scaled by them).
# Charged once per rank's batched kernel, on several ranks (step_model.batched_floor_s).
SHARD_STEP_FLOOR_S = 0.855e-3
# Share of a padded [batch, length] id grid that is padding (one id, repeated): the
# family's history presets are half full on average (uniform lengths), the fill the
# activation model assumes for padded histories too. The graph cannot tell the data.
PADDED_SHARE = 0.5


def hottest_row_ids(rows: float, nnz: float, padded_nnz: float, pad_ids: float = 0.0
                    ) -> float:
    """Lookups of the most looked-up row in a step: the mean duplicates of uniform ids
    (``nnz / rows``, when the table is smaller than the batch), or the padding of
    ``padded_nnz`` ids read from padded [batch, length] grids, all on one pad id, or
    ``pad_ids`` padding ids the sample batch counted (a lookup of a packed region's
    gathered ids reads one per row with padding, its padding representative, and no
    other: gemc.packed_rules.gathered_lookup). Skewed ids (a hot head) are data the graph
    does not show: not priced."""
    if rows <= 0 or nnz <= 0:
        return 0.0
    return max(float(nnz) / rows, PADDED_SHARE * float(padded_nnz), float(pad_ids))


def sort_bytes(nnz: float) -> float:
    """HBM bytes of sorting ``nnz`` int64 ids with their positions (coalesce, unique)."""
    return _SORT_PASSES * 2.0 * 2 * INDEX_BYTES * float(nnz)


def eager_lookup_bytes(path: str, rows: float, dim: float, nnz: float, bags: float,
                       lookups: int, elt: int) -> dict[str, float]:
    """HBM bytes of a table's lookups and gradient as the runner runs them outside the
    batched kernel, split by access: ``stream`` (zero-fills, whole-gradient adds,
    contiguous reads) and ``rows`` (gathers and scatters of rows at the ids).

    Forward (either path): gather nnz rows, write the bags, read the ids. Backward:
    ``dense_grad`` zero-fills a table-sized gradient per lookup, scatter-adds each id's
    gradient row into it, and adds the lookups' gradients up (read 2, write 1 each);
    ``sparse`` writes one gradient row per id (and its index) and, with several lookups,
    concatenates them."""
    table = float(rows) * dim * elt
    ids = float(nnz) * dim * elt
    out = float(bags) * dim * elt
    fwd_rows = ids + out + float(nnz) * INDEX_BYTES
    if path == "dense_grad":
        bwd_stream = lookups * table + 3.0 * table * max(0, lookups - 1)
        bwd_rows = out + 2.0 * ids + float(nnz) * INDEX_BYTES
    else:
        bwd_stream = 2.0 * (ids + 2 * INDEX_BYTES * nnz) * max(0, lookups - 1)
        bwd_rows = out + ids + 3.0 * INDEX_BYTES * nnz
    return {"fwd_rows": fwd_rows, "bwd_stream": bwd_stream, "bwd_rows": bwd_rows}


def eager_update_bytes(path: str, rows: float, dim: float, nnz: float, optimizer: str | None,
                       elt: int, storage_elt: float | None = None) -> dict[str, float]:
    """HBM bytes of the sparse optimizer's step of one table (its ``step`` per table).

    ``dense_grad`` (one rank): one masked pass (backends/triton/masked_row_update.py)
    reads the table-sized gradient once and reads and writes only the used rows' weights
    and state. ``sparse``: the gradient's rows summed without a host sync
    (sparse_optim.summed_rows: sort the nnz ids, add their rows into one zeroed sum per
    id, gather the sums back into the update's slots), then the row update (``EAGER_ROW_UPDATE``)
    over ``min(nnz, rows)`` slots (the slots past the distinct rows repeat the last one). A table
    stored narrower (``storage_elt`` bytes an element) instead sorts its ids once more to
    dequantise the used rows, sums their gradients into the distinct rows and writes them
    rounded; its update runs over the distinct rows. A data-parallel replica on several
    ranks is priced by :func:`replica_update_bytes`."""
    table = float(rows) * dim * elt
    touched = expected_unique_rows(int(rows), int(nnz))
    if path == "dense_grad":
        state = 2.0 * (4.0 if (optimizer or "").lower() != "adam" else 2.0 * dim * 4.0)
        return {"stream": table, "rows": touched * (2.0 * dim * elt + state)}
    narrow = storage_elt is not None and storage_elt < elt
    stream = sort_bytes(nnz)
    if narrow:
        row_bytes = 2.0 * float(nnz) * dim * elt + touched * dim * elt
        slots = touched
    else:
        slots = float(min(nnz, rows))  # the update's slots: one per id, at most one a row
        stream += float(nnz) * dim * 4.0  # the zeroed sums
        row_bytes = 3.0 * float(nnz) * dim * elt + 2.0 * slots * dim * elt
    passes = EAGER_ROW_UPDATE.get((optimizer or "").lower(), (0.0, 0))[0]
    stream += passes * slots * dim * 4.0
    if narrow:
        stream += sort_bytes(nnz)
        row_bytes += 2.0 * touched * dim * storage_elt
    return {"stream": stream, "rows": row_bytes}


# ---- a data-parallel replica on several ranks (sparse_optim.ReplicaBucket) ---------------
# Kernels a replica's step issues on its own: its gradient rows added into its segment of
# the step's bucket, its used-row flags set, and its masked update pass (fp32); a replica
# stored narrower instead issues the narrow rows' kernels (the unique and sum of its rows'
# gradients), their copy into the segment, and the row update over every row with the
# keep-mask's selects (two more).
REPLICA_KERNELS = 3
REPLICA_NARROW_EXTRA_KERNELS = 2
# Kernels the bucket issues once a step whatever the replicas: its zero-fill and the
# division by the world after the all-reduce (the all-reduce is priced as a collective).
REPLICA_BUCKET_KERNELS = 2


def replica_bucket_bytes(rows: float, dim: float) -> float:
    """Bytes one replica of ``rows`` x ``dim`` adds to the step's bucket (and to the one
    all-reduce of it): its fp32 gradient rows and one fp32 used-row flag a row, whatever
    the table's storage precision (sparse_optim.ReplicaBucket)."""
    return float(rows) * (float(dim) + 1.0) * 4.0


def replica_update_bytes(rows: float, dim: float, nnz: float, optimizer: str | None,
                         elt: int, replicas: int,
                         storage_elt: float | None = None) -> dict[str, float]:
    """HBM bytes of one data-parallel replica's part of the sparse optimizer's step, split
    as :func:`eager_update_bytes`: ``stream`` (its share of the bucket's zero-fill and
    division, three passes over its segment; the masked pass's read of its gradient and
    flags) and ``rows`` (the add of its ``nnz`` local gradient rows into the segment,
    read and written at the ids; the masked pass's read and write of the rows some of the
    ``replicas`` used, weights and optimizer state). A replica stored narrower sums its
    rows' gradients first (its ids sorted twice: the lookup's unique and the rows' sum)
    and updates every row in ATen (``EAGER_ROW_UPDATE``'s passes over the table, the
    stored rows read and written)."""
    segment = replica_bucket_bytes(rows, dim)
    stream = 3.0 * segment
    narrow = storage_elt is not None and storage_elt < elt
    if narrow:
        touched = expected_unique_rows(int(rows), int(nnz))
        stream += 2.0 * sort_bytes(nnz)
        row_bytes = 2.0 * float(nnz) * dim * elt + touched * dim * (elt + 2.0 * 4.0)
        passes = EAGER_ROW_UPDATE.get((optimizer or "").lower(), (0.0, 0))[0]
        stream += passes * float(rows) * dim * 4.0 + 2.0 * float(rows) * dim * storage_elt
        return {"stream": stream, "rows": row_bytes}
    used = expected_unique_rows(int(rows), int(nnz * replicas))
    state = 2.0 * (4.0 if (optimizer or "").lower() != "adam" else 2.0 * dim * 4.0)
    stream += segment  # the masked pass reads the reduced gradient and flags once
    row_bytes = float(nnz) * (dim * (elt + 2.0 * 4.0) + INDEX_BYTES) \
        + used * (2.0 * dim * 4.0 + state)
    return {"stream": stream, "rows": row_bytes}
