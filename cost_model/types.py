"""Small frozen inputs and outputs of the step model, shared with the solver.

No torch.fx here: the solver builds these once from the annotated graph and then calls
``predict_step`` many times, so everything is plain numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gemc.exchange_precision import FP32_WIRE, WirePrecision
from gemc.sharding import DENSE_STRATEGIES, REPLICATED_DENSE, SHARDINGS  # defined in the core
from gemc.table_lookup import BATCHED, LOOKUP_PATHS
from gemc.table_precision import TABLE_PRECISIONS, weight_bytes

from .kernels import hottest_row_ids


@dataclass(frozen=True)
class RegionCost:
    """A dense region (the unit that gets a parallel strategy), for one rank's local batch.

    ``compute_s`` is the region's forward+backward time on one GPU for the local batch,
    unsharded (the sum of its nodes' gemc.predicted_ms). ``shard_group`` is the FSDP group
    (0 = the whole world), the HSDP shard group inside a host, or the TP degree.
    """

    name: str
    params: int
    fwd_flops: float
    compute_s: float
    strategy: str = REPLICATED_DENSE
    shard_group: int = 0
    param_bytes: int = 4          # bytes per parameter element (compute copy)
    grad_bytes: int = 4           # bytes per gradient element (reduced in this dtype)
    activation_bytes: int = 0     # saved for backward, local batch, no checkpointing
    boundary_bytes: int = 0       # the region's input activation (checkpoint, TP comm)
    checkpoint: bool = False      # activation checkpointing: recompute the forward
    fwd_fraction: float = 1 / 3   # share of compute_s spent in the forward

    def __post_init__(self) -> None:
        if self.strategy not in DENSE_STRATEGIES:
            raise ValueError(f"region {self.name}: strategy {self.strategy!r} not in "
                             f"{DENSE_STRATEGIES}")
        if self.params < 0 or self.compute_s < 0 or self.shard_group < 0:
            raise ValueError(f"region {self.name}: params, compute_s, shard_group must be >= 0")


@dataclass(frozen=True)
class TableCost:
    """An embedding table and its sharding. ``nnz`` and ``batch`` are one rank's local
    batch (lookups and bags); ``ranks`` hold the shards (in shard order)."""

    fqn: str
    rows: int
    dim: int
    nnz: int
    batch: int
    sharding: str = "table_wise"
    ranks: tuple[int, ...] = (0,)
    dtype_bytes: int = 4
    # False for plain lookups (nn.Embedding over a sequence): each id's row goes back to
    # the rank that asked for it alone, so a row shard returns only its share of the rows,
    # not a partial sum for every bag.
    pooled: bool = True
    # the weights' storage (gemc.table_precision): "fp32" keeps the model's own dtype
    # (``dtype_bytes``); "bf16" / "fp8" shrink the stored rows (fp8: + an fp32 scale per
    # row). Lookups still produce, exchange and back-propagate ``dtype_bytes`` elements.
    precision: str = "fp32"
    # the code that runs its lookups (gemc.table_lookup): inside the batched kernel with
    # the optimizer fused, or eager with a sparse / table-sized gradient and the sparse
    # optimizer after it; and how many lookup ops read it (each has its own gradient)
    lookup: str = BATCHED
    lookups: int = 1
    # of ``nnz``, the ids read from padded [batch, length] grids (unpooled lookups of a
    # 2-D or wider id tensor): their padding repeats one id (kernels.hottest_row_ids)
    padded_nnz: int = 0
    # padding ids its lookups of packed regions' gathered ids still read (one per row with
    # padding: the padding representatives, counted on the sample batch); those lookups'
    # ids are their regions' tokens, in ``nnz``, not in ``padded_nnz``
    pad_ids: float = 0.0
    # its lookups are called out of the compiled graph (graph mode, gemc.table_lookup's
    # SPARSE): each splits the graph (op_cost.ROUTED_LOOKUP_S)
    routed: bool = False
    # a lookup of it names a padding row (``padding_idx``): on several ranks, or stored
    # narrower, its lookups drop that row's ids by a boolean mask, a host sync each
    # lookup; a local fp32 lookup keeps them in its gradient, where the optimizer skips
    # them one key each (no duplicates: kernels.hottest_row_ids leaves them out)
    padding_row: bool = False
    # per lookup, the saved activations still live when its backward runs
    # (activations.ActivationProfile.alive_at_lookup): where a table-sized gradient lands
    lookup_alive: tuple[int, ...] = ()
    # only a whole replica on every rank runs it right (passes/collect_tables: the model
    # reads the weight outside its lookups, e.g. an L2 penalty, or max-pools it)
    replicated_only: bool = False
    # looked up once a step with the batch's own tensors (ids, offsets, per-sample weights
    # each a graph input): a replica group's member is then looked up by its group ahead
    # of the compiled graph (backends/torch/replica_ahead.py); otherwise it stays inside
    # the graph (launches.REPLICA_IN_GRAPH_MEMBER_LAUNCHES)
    batch_fed: bool = True

    @property
    def hot_ids(self) -> float:
        """Lookups of the most looked-up row in one rank's step (kernels.hottest_row_ids);
        a padding row's ids are not summed (the exchange drops them, the optimizer skips
        them), so its padded grids add none."""
        if self.padding_row:
            return hottest_row_ids(self.rows, self.nnz, 0)
        return hottest_row_ids(self.rows, self.nnz, self.padded_nnz, self.pad_ids)

    @property
    def storage_bytes(self) -> float:
        """Bytes one stored element of a row takes (fp8: its share of the row scale)."""
        if self.precision == "fp32":
            return float(self.dtype_bytes)
        return weight_bytes(self.precision, 1, self.dim) / self.dim

    @property
    def replicated(self) -> bool:
        """Whether the table is whole on every rank (gemc.sharding: data parallel), its
        gradient in the step's one all-reduce of the replicas instead of exchanged."""
        return SHARDINGS[self.sharding].replicated

    def output_share(self, shard_rows: float) -> float:
        """Fraction of the world's bags a shard of ``shard_rows`` rows returns rows for."""
        if self.pooled or not SHARDINGS[self.sharding].row_split:
            return 1.0
        return shard_rows / self.rows

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"table {self.fqn}: sharding {self.sharding!r} not in "
                             f"{tuple(SHARDINGS)}")
        if not self.ranks:
            raise ValueError(f"table {self.fqn}: needs at least one rank")
        if self.precision not in TABLE_PRECISIONS:
            raise ValueError(f"table {self.fqn}: precision {self.precision!r} not in "
                             f"{TABLE_PRECISIONS}")
        if self.lookup not in LOOKUP_PATHS:
            raise ValueError(f"table {self.fqn}: lookup {self.lookup!r} not in {LOOKUP_PATHS}")
        if self.rows <= 0 or self.dim <= 0 or self.nnz < 0 or self.batch < 0:
            raise ValueError(f"table {self.fqn}: rows and dim must be > 0, nnz/batch >= 0")


@dataclass(frozen=True)
class StepOptions:
    """Knobs of the step model; defaults are what gemc's runner does.

    overlap: fraction of the backward (forward) compute that can hide gradient
    (parameter) communication — NCCL kernels take SMs and HBM bandwidth from compute, so
    it is below 1 (measured 0.7-0.9 for DDP on Hopper, PyTorch DDP paper, Li et al. 2020).
    """

    optimizer: str = "adamw"
    # the runner's default sparse optimizer (backends/torch/sparse_optim.py); was "adamw",
    # which priced GEM's tables with 12 GB of optimizer state the run never allocates
    table_optimizer: str = "rowwise_adagrad"
    fused_optimizer: bool = True
    master_weights: bool = False   # fp32 master copy when params are bf16
    state_bytes: int = 4           # optimizer state element size
    overlap: float = 0.8
    ddp_bucket_bytes: int = 25 * 1024 * 1024
    # input dist of batch i+1 hidden behind batch i (TorchRec's TrainPipelineSparseDist).
    # gemc's runner exchanges the ids inside the step (embedding_exchange.py), so False.
    pipeline_sparse: bool = False
    workspace_bytes: int = 1 << 30  # cuBLAS, NCCL buffers, allocator slack
    dense_dtype: str = "bf16"
    # Host syncs the runner makes a step (reading the loss, ...) and the exchange adds
    # (2 when tables are sharded over ranks: its sizes and headers come to the host); each
    # drains the GPU queue, which the host then refills late: ~1.3 ms a sync on the GEM
    # h200 run (3 syncs, 3.9 ms host-late GPU idle, BENCHMARKS.md run C).
    host_syncs: int = 3
    exchange_host_syncs: int = 2
    host_sync_s: float = 1.3e-3
    # the pooled all-to-all's wire precision, forward and backward (gemc.exchange_precision):
    # its bytes, and the casts to and from it, are priced at this
    exchange: WirePrecision = FP32_WIRE


@dataclass(frozen=True)
class RankStats:
    rank: int
    memory_bytes: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    sparse_compute_s: float
    dense_compute_s: float
    optimizer_s: float
    memory: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "memory_gb": self.memory_bytes / 1e9,
            "compute_ms": 1e3 * self.compute_s,
            "comm_ms": 1e3 * self.comm_s,
            "exposed_comm_ms": 1e3 * self.exposed_comm_s,
            "sparse_compute_ms": 1e3 * self.sparse_compute_s,
            "dense_compute_ms": 1e3 * self.dense_compute_s,
            "optimizer_ms": 1e3 * self.optimizer_s,
            "memory": {k: v / 1e9 for k, v in self.memory.items()},  # GB
        }


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    mfu: float
    model_flops: float
    per_rank: tuple[RankStats, ...]
    cost_model: str                 # "calibrated" or "roofline"
    breakdown: dict[str, float]     # seconds of each part of the critical path
    world_size: int

    @property
    def step_ms(self) -> float:
        return 1e3 * self.step_s

    @property
    def max_memory_bytes(self) -> float:
        return max(r.memory_bytes for r in self.per_rank)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_ms": self.step_ms,
            "mfu": self.mfu,
            "model_flops_per_step": self.model_flops,
            "world_size": self.world_size,
            "cost_model": self.cost_model,
            "max_memory_gb": self.max_memory_bytes / 1e9,
            "breakdown_ms": {k: 1e3 * v for k, v in self.breakdown.items()},
            "per_rank": [r.to_dict() for r in self.per_rank],
        }


def as_plain(obj: Any) -> Any:
    """dataclasses -> dicts (for dumps)."""
    return asdict(obj)
