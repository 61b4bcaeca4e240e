"""Execute a plan: the training loop and the setup that puts each piece in place.

Order of setup (each step is one module of this package):

1. the plan (validated) and the world: ``WORLD_SIZE`` must equal the plan's mesh;
2. the process group (gloo on CPU, NCCL on GPU), when there is more than one rank;
3. the model on meta, its fingerprint checked against the plan (:mod:`.materialize`);
4. tables replaced by sharded modules (:mod:`.embedding`), everything materialized and
   initialized deterministically (:mod:`.init`);
5. precision sites and generated kernels (:mod:`.precision`, :mod:`.kernels`);
6. dense regions wrapped per strategy (:mod:`.dense`);
7. optimizers (:mod:`.optimizers`, :mod:`.sparse_optim`), then ``--resume``
   (:mod:`.checkpoint`, :mod:`.state`).

Each step, the tables the model calls with the batch's own tensors are looked up before the
forward, in one exchange for all of them (:mod:`.table_prefetch`; from the second step on),
and the data-parallel replicas in one lookup per group of them (:mod:`.replica_groups`).

Data: rank ``r`` of ``W`` trains step ``s`` on ``make_batch(s * W + r)``; the logged loss is
the mean of the ranks' losses, the quantity :mod:`.reference` computes in one process.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gemc.backends.torch import checkpoint as ckpt
from gemc.backends.torch import kernels as kernel_registry
from gemc.backends.torch import precision as precision_mod
from gemc.backends.torch.compile_cache import CompileCache, compile_cache
from gemc.backends.torch.cuda_graphs_choice import AUTO, CUDA_GRAPHS, resolve_compile_mode
from gemc.backends.torch.dense import apply_strategies, check_strategies
from gemc.backends.torch.divergence import DivergenceGuard, load_reference, low_precision_sites
from gemc.backends.torch.embedding import shard_tables
from gemc.backends.torch.first_step import (
    FirstStepAccount,
    warm_compile_workers,
    warm_kernels,
)
from gemc.backends.torch.fp8_audit import (
    DEFAULT_EVERY,
    SHADOW,
    STEP,
    Fp8Audit,
    check_every,
    fp8_sites,
    plan_bound,
)
from gemc.backends.torch.graph_fp8 import apply_fp8_sites
from gemc.backends.torch.graph_mode import GraphExecutor, check_graph_mode, compile_backend
from gemc.backends.torch.graph_precision import scope_module_precision
from gemc.backends.torch.init import derive_seed
from gemc.backends.torch.kernel_choices import check_choices, plan_choices
from gemc.backends.torch.materialize import (
    check_fingerprint,
    load_plan_model,
    materialize_,
    table_module_names,
)
from gemc.backends.torch.metrics import Metrics, Progress, StepRecord, sync
from gemc.backends.torch.optimizers import make_dense_optimizer, resolve_optimizers
from gemc.backends.torch.owner_lookup import OwnerLookup, fused_owner_tables, owner_routes
from gemc.backends.torch.replica_groups import ReplicaLookups
from gemc.backends.torch.report import build_report
from gemc.backends.torch.sparse_optim import EmbeddingOptimizer
from gemc.backends.torch.state import restore_after_load, training_state
from gemc.backends.torch.table_prefetch import TablePrefetch

from gemc.errors import GemcUserError, PlanError
from gemc.exchange_precision import wire_of_plan
from gemc.kernel_kinds import graph_kinds
from gemc.plan import Plan, read_plan
from gemc.sharding import SHARDINGS, dense_strategy
from gemc.spec import BATCH_SIZE_MISSING, BatchSizeWarning, batch_size_of
from gemc.table_lookup import SPARSE

EXIT_AFTER_STEP_ENV = "GEMC_RUN_EXIT_AFTER_STEP"
"""Test hook: ``os._exit`` right after this completed-step count (a killed run)."""


@dataclass(frozen=True)
class Trainables:
    """The model and optimizers of a run, for :attr:`RunOptions.on_ready`."""

    model: torch.nn.Module
    dense_opt: torch.optim.Optimizer
    emb_opt: EmbeddingOptimizer


@dataclass
class RunOptions:
    """Everything ``gemc run`` can be told; the defaults are the CLI's."""

    steps: int = 20
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only at the end (when a directory is given)
    keep_checkpoints: int = 2
    resume: bool = False
    device: str | None = None  # "cpu" | "cuda" | None (cuda when available)
    report: str | None = None
    seed: int = 0
    lr: float | None = None
    embedding_optimizer: str | None = None
    embedding_lr: float | None = None
    precision: str | None = None  # adds a whole-model autocast site: bf16 | fp16 | fp32
    # --fp8-linears: row-wise fp8 forced on every nn.Linear with in and out features >= this
    # (precision.forced_fp8_entries; a measurement switch, the plan's choice otherwise)
    fp8_min_features: int | None = None
    kernel_modules: list[str] = field(default_factory=list)
    kernels: bool = True  # False: run the ops the plan's kernels replace (--no-kernels)
    # kernel names or kinds whose replaced ops run instead (--skip-kernels: bisecting)
    skip_kernels: tuple[str, ...] = ()
    progress: bool = True
    warmup_steps: int = 2
    # graph mode: "inductor" (torch.compile over the rewritten graph) or "interpreter"
    graph_executor: str = "inductor"
    # torch.compile mode of graph mode; "auto": CUDA graphs ("reduce-overhead") where the
    # plan predicts the host bounds the step (cuda_graphs_choice), "default": never
    compile_mode: str | None = AUTO
    # per kernel name {"choice": "gemc"|"inductor", ...}: measured choices for fused groups,
    # above the plan's recorded ones (.kernel_choices)
    kernel_choices: dict[str, Any] | None = None
    measure_kernels: bool = False  # measure each fused group against Inductor's code first
    # autotune gemc's hand-written kernels (--autotune); off: a recorded or heuristic config
    autotune: bool = False
    # compile gemc's kernels the first step launches in worker processes ahead of their
    # first launch (gemc.backends.triton.warm); False: each compiles at its first launch
    warm_kernels: bool = True
    # Inductor's runtime autotuning of its 1-D pointwise kernels (two configs each, timed at
    # the first launch): off by default in graph mode (graph_mode.inductor_options says why)
    pointwise_autotune: bool = False
    # read the loss (a host sync) every N steps, 1: every step (each step timed alone);
    # N > 1: the losses stay on the device in between and a step's time is its block's mean
    loss_every: int = 1
    # module mode (a plan without graph kernels): torch.compile the model, each table's
    # lookup left eager. "auto": on CUDA with one rank (Inductor's CPU compile would cost
    # the CPU tests minutes for nothing); "on" / "off" force it.
    compile_modules: str = "auto"
    # loss safeguard (.divergence): off | warn | stop, against the run's own recent losses
    # and, when given, a reference run's (a run report or a JSON list of losses)
    divergence: str = "warn"
    reference_losses: str | None = None
    # every N steps, each fp8 site's GEMMs against fp32 on the step's operands; a GEMM under
    # the precision pass's bound runs bf16 after (.fp8_audit); 0: off
    fp8_audit_every: int = DEFAULT_EVERY
    # called after every step with the number of steps done (benchmarks hang a profiler on it)
    on_step: Callable[[int], None] | None = None
    # called once, set up and before the first step, with what the run trains (a benchmark
    # tells the run's own tensors from the rest by identity: memory_attribution.py)
    on_ready: Callable[[Trainables], None] | None = None
    # where Inductor's and Triton's caches persist (.compile_cache): None -> GEMC_COMPILE_CACHE,
    # else gemc-cache/ next to the plan; "none": a cold compile in a temporary directory
    cache_dir: str | None = None


def _compile_module_mode(opts: RunOptions, device: torch.device, wsize: int) -> bool:
    """Whether module mode runs under torch.compile: a plan where gemc has no kernel to
    offer must still train at least as fast as torch.compile would (never slower than the
    tool users have). Several ranks stay eager for now: their regions are wrapped by DDP /
    FSDP hooks this path has not been checked with."""
    if opts.compile_modules == "on":
        return True
    if opts.compile_modules == "off" or opts.graph_executor != "inductor":
        return False
    return device.type == "cuda" and wsize == 1


def _compiled_module(model: torch.nn.Module, tables: dict[str, torch.nn.Module],
                     device: torch.device) -> Any:
    """``model`` under torch.compile with each table's forward excluded (its sparse
    exchange and row gradients are gemc's eager code; Dynamo breaks the graph there)."""
    for table in tables.values():
        table.forward = torch._dynamo.disable(table.forward)
    return torch.compile(model, dynamic=False, backend=compile_backend(device))


@dataclass
class RunResult:
    """What a finished run hands back (the report is also written on rank 0)."""

    losses: list[tuple[int, float]]
    report: dict[str, Any]
    report_path: Path | None


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world: int

    @classmethod
    def from_env(cls) -> World:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        return cls(rank, world, local_rank, local_world)


def check_world(plan: Plan, world: World, source: str = "plan") -> None:
    """The process count must be the plan's mesh; say how to launch it otherwise."""
    want = plan.mesh.world_size
    if world.world_size != want:
        mesh_shape = plan.mesh.shape
        shape = "x".join(str(s) for s in mesh_shape)
        hosts, per_host = (mesh_shape[0], mesh_shape[-1]) if len(mesh_shape) > 1 else (1, want)
        raise PlanError(
            f"world size mismatch: the plan was compiled for {want} ranks (mesh {shape}) "
            f"but this run has {world.world_size} process(es)",
            where=f"{source}: mesh.world_size vs WORLD_SIZE={world.world_size}",
            fix=(
                f"launch {want} processes (torchrun --nnodes={hosts} "
                f"--nproc_per_node={per_host} -m gemc.run PLAN), or compile a plan for "
                f"{world.world_size} GPUs (gemc compile ... --topology "
                f"{plan.topology.get('gpu', 'h200')}:1x{world.world_size})"
            ),
        )


def gpus_per_host(plan: dict[str, Any]) -> int:
    """The ranks a host holds, from the plan's topology (its mesh's last side where a
    hand-written plan's topology omits it): rank r is on host r // gpus_per_host, as
    torchrun numbers them. The embedding exchange reduces row shards per host by it."""
    given = plan.get("topology", {}).get("gpus_per_host")
    if given is None:
        given = plan["mesh"]["shape"][-1]
    return int(given)


def _device(requested: str | None, world: World) -> torch.device:
    kind = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in ("cpu", "cuda"):
        raise GemcUserError(
            f"--device {kind!r} is not supported", where="--device", fix="use cpu or cuda"
        )
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise GemcUserError(
                "--device cuda but CUDA is not available on this host",
                where="--device",
                fix="use --device cpu, or run on a GPU host",
            )
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def _column_groups(
    tables: list[dict[str, Any]], rank: int, world_size: int
) -> dict[str, dist.ProcessGroup | None]:
    """Process groups of ranks holding the columns of the same rows (see sparse_optim).

    ``new_group`` is collective over all ranks, so every rank walks every table in plan
    order and creates the same groups, keeping those it belongs to.
    """
    out: dict[str, dist.ProcessGroup | None] = {}
    if world_size == 1:
        return out
    cache: dict[tuple[int, ...], Any] = {}
    for table in tables:
        if SHARDINGS[table["sharding"]].replicated:
            continue
        blocks: dict[tuple[int, int], list[int]] = {}
        for s in table["shards"]:
            blocks.setdefault((s["row_offset"], s["rows"]), []).append(s["rank"])
        for ranks in blocks.values():
            key = tuple(sorted(ranks))
            if len(key) < 2:
                continue
            if key not in cache:
                cache[key] = dist.new_group(list(key))
            if rank in key:
                out[table["fqn"]] = cache[key]
    return out


def local_batch_size(spec: Any, rank: int) -> tuple[int | None, str | None]:
    """The samples per batch the model states (see :func:`gemc.spec.batch_size_of`).

    Never guessed from a tensor: unstated, it is None, samples/s are null, and a
    :class:`~gemc.spec.BatchSizeWarning` says so."""
    size, source = batch_size_of(spec)
    if size is None and rank == 0:
        warnings.warn(BATCH_SIZE_MISSING, BatchSizeWarning, stacklevel=2)
    return size, source


def run(plan_or_path: str | Path | Plan | dict[str, Any],
        options: RunOptions | None = None) -> RunResult:
    """Train the plan's model for ``options.steps`` steps on this process's rank.

    The plan is read once into a :class:`gemc.plan.Plan` (validated as it is built); the
    checks before any process group starts read its typed sections, the run itself its
    plain document (``Plan.to_dict``: the layers below still read entries by key)."""
    opts = options or RunOptions()
    check_every(opts.fp8_audit_every)  # before any work: a bad interval fails here
    if isinstance(plan_or_path, Plan):
        typed, plan_path = plan_or_path, None
    elif isinstance(plan_or_path, dict):
        typed, plan_path = Plan.from_json(plan_or_path, source="plan"), None
    else:
        plan_path = Path(plan_or_path)
        typed = read_plan(plan_path)
    plan_dir = plan_path.parent if plan_path is not None else None
    world = World.from_env()
    check_world(typed, world, str(plan_path or "plan"))
    check_strategies(typed.regions)
    device = _device(opts.device, world)
    created_pg = False
    if world.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            device_id=device if device.type == "cuda" else None,
        )
        created_pg = True
    try:
        # before the capture, which imports gemc's kernels (their autotuners read the env)
        compiles = _compiles(typed, opts, device, world)
        with (compile_cache(opts.cache_dir, plan_dir) if compiles
              else nullcontext()) as cache, _autotuning(opts.autotune):
            workers = warm_compile_workers(device) if compiles and \
                opts.graph_executor == "inductor" else None
            warm = warm_kernels(device) if compiles and opts.warm_kernels and \
                opts.graph_executor == "inductor" else None
            try:
                return _run(typed, plan_path, plan_dir, opts, world, device, cache, workers,
                            warm)
            finally:
                if warm is not None:
                    warm.close()
    finally:
        if created_pg and dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def _autotuning(on: bool) -> Iterator[None]:
    """``--autotune``: gemc's kernels autotune in this run (config_choice reads the variable
    at each launch; imported only when asked, after the compile cache's variables are set)."""
    if not on:
        yield
        return
    from gemc.backends.triton.config_choice import AUTOTUNE_ENV

    before = os.environ.get(AUTOTUNE_ENV)
    os.environ[AUTOTUNE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(AUTOTUNE_ENV, None)
        else:
            os.environ[AUTOTUNE_ENV] = before


def _kernel_tuning(rank: int) -> dict[str, Any] | None:
    """The run report's ``kernel_tuning`` (see config_choice.report), after recording what
    this run autotuned; None when no gemc kernel with several configs was imported. A
    heuristic config is said on stderr too: it is not a measured one."""
    import sys

    if "gemc.backends.triton.config_choice" not in sys.modules:
        return None
    from gemc.backends.triton import config_choice

    config_choice.record_tuned()
    tuning = config_choice.report()
    guessed = sorted(n for n, keys in tuning.items()
                     if any(v["source"] == "heuristic" for v in keys.values()))
    if guessed and rank == 0:
        print(f"gemc: {len(guessed)} kernel(s) ran a heuristic launch config, not an "
              f"autotuned one ({', '.join(guessed)}); gemc run --autotune tunes them and "
              "records the winners for later runs", file=sys.stderr)
    return tuning


def _compiles(plan: Plan, opts: RunOptions, device: torch.device, world: World) -> bool:
    """Whether the run compiles anything (so it wants the compile cache): graph mode, whose
    kernels autotune even under the interpreter executor, or module mode compiled."""
    kernels = plan.kernels if opts.kernels else ()
    if any(k.kind in graph_kinds() for k in kernels):
        return True
    return _compile_module_mode(opts, device, world.world_size)


def kept_kernels(plan: dict[str, Any], skip: tuple[str, ...]) -> list[Any]:
    """The plan's kernels less those named in ``skip`` (a kernel's name or a kind), whose
    replaced ops then run as captured: bisecting a numeric difference one kernel or kind at
    a time. A name that matches nothing is refused (a typo would bisect nothing)."""
    kernels = list(plan["kernels"])
    known = {str(k.get(key)) for k in kernels if isinstance(k, dict) for key in ("name", "kind")}
    unknown = sorted(set(skip) - known)
    if unknown:
        raise GemcUserError(
            f"--skip-kernels {','.join(unknown)}: no kernel of the plan has that name or kind",
            "gemc run --skip-kernels",
            f"use names or kinds the plan has: {', '.join(sorted(known)) or '(none)'}")
    return [k for k in kernels if not (isinstance(k, dict)
                                       and ({str(k.get("name")), str(k.get("kind"))} & set(skip)))]


def _run(
    typed: Plan,
    plan_path: Path | None,
    plan_dir: Path | None,
    opts: RunOptions,
    world: World,
    device: torch.device,
    cache: CompileCache | None = None,
    workers: str | None = None,
    warm: Any = None,
) -> RunResult:
    """One run (see :func:`run`); ``workers``: what was done about Inductor's compile
    workers before it (:func:`~gemc.backends.torch.first_step.warm_compile_workers`).
    The model is rebuilt and checked from the typed plan's ``Model``; the rest reads the
    plan's document (``Plan.to_dict``) by key."""
    rank, wsize = world.rank, world.world_size
    t_setup = time.perf_counter()
    plan = typed.to_dict()
    # before any work: a mode not torch.compile's is refused here, not after the model is built
    compile_mode, compile_mode_why = resolve_compile_mode(
        opts.compile_mode, device_type=device.type, executor=opts.graph_executor,
        world_size=wsize, predicted=plan.get("predicted"))
    spec = load_plan_model(typed.model, plan_dir)
    kernels = kept_kernels(plan, opts.skip_kernels) if opts.kernels else []
    if opts.kernel_choices:
        check_choices(opts.kernel_choices, plan["kernels"], "gemc run --kernel-choices")
    graph_kernels = [k for k in kernels if isinstance(k, dict) and k.get("kind") in graph_kinds()]
    captured = check_fingerprint(typed.model, spec, rank=rank, world_size=wsize,
                                 every_rank=bool(graph_kernels))
    model = spec.model
    wire = wire_of_plan(plan)
    tables = shard_tables(model, plan["tables"], rank=rank, world_size=wsize, seed=opts.seed,
                          exchange=wire, gpus_per_host=gpus_per_host(plan))
    init_report = materialize_(model, device, opts.seed, table_module_names(plan),
                               origin=spec.origin, recipes=spec.init_recipes)
    model.train()

    prec_entries = list(plan["precision"])
    if opts.precision:
        prec_entries.append({"target": "*", "dtype": opts.precision, "source": "--precision"})
    forced_fp8 = [] if opts.fp8_min_features is None else \
        precision_mod.forced_fp8_entries(model, opts.fp8_min_features, prec_entries)
    prec_entries += forced_fp8
    prec = precision_mod.resolve(prec_entries, model)
    precision_mod.install(model, prec, device.type)
    check_graph_mode(graph_kernels, world_size=wsize, regions=plan["regions"])
    fp8_nodes: dict[str, str] = {}  # graph mode: node name -> the fp8 site it runs
    if graph_kernels and prec.fp8_linears:  # fp8 sites' linear nodes call the fp8 linear
        graph_kernels, fp8_nodes = apply_fp8_sites(captured.gm, prec.fp8_linears,
                                                   graph_kernels, device)
    if graph_kernels and prec.per_module:  # the sites' autocast scopes, node by node
        graph_kernels, _ = scope_module_precision(captured.gm, prec.per_module, graph_kernels,
                                                  device.type)
    kernel_registry.import_modules(opts.kernel_modules)
    applied_kernels = kernel_registry.apply(
        model,
        [k for k in kernels if not (isinstance(k, dict) and k.get("kind") in graph_kinds())],
        kernel_registry.KernelContext(
            device=device.type,
            rank=rank,
            world_size=wsize,
            plan_dir=plan_dir or Path("."),
            plan=plan,
        ),
    )

    table_params = {m.weight for m in tables.values() if m.weight is not None}
    mesh_1d = mesh_2d = ddp_group = None
    held = [dense_strategy(r["strategy"]) for r in plan["regions"]]
    groups = {d.group for d in held if d.sharded}
    if wsize > 1:
        from torch.distributed.device_mesh import init_device_mesh

        if "world" in groups:
            mesh_1d = init_device_mesh(device.type, (wsize,), mesh_dim_names=("dp",))
        if "host" in groups:
            mesh_2d = init_device_mesh(
                device.type,
                tuple(plan["mesh"]["shape"]),
                mesh_dim_names=tuple(plan["mesh"].get("dim_names") or ("replicate", "shard")),
            )
        ddp_group = dist.new_group(list(range(wsize)))
    column_groups = _column_groups(plan["tables"], rank, wsize)
    layout = apply_strategies(
        model,
        plan["regions"],
        world_size=wsize,
        table_params=table_params,
        mesh_1d=mesh_1d,
        mesh_2d=mesh_2d,
        ddp_group=ddp_group,
    )

    dense_cfg, emb_cfg = resolve_optimizers(
        plan.get("optimizer"),
        lr=opts.lr,
        embedding_optimizer=opts.embedding_optimizer,
        embedding_lr=opts.embedding_lr,
    )
    dense_params = [
        p for p in model.parameters() if p.requires_grad and not _is_table_param(p, table_params)
    ]
    dense_opt = make_dense_optimizer(dense_params, dense_cfg, device)
    emb_opt = EmbeddingOptimizer(
        tables, emb_cfg, world_size=wsize, column_groups=column_groups
    )
    # the shards this rank owns on the fused route (gemc.table_lookup.sharded_route): in
    # one batched kernel whose backward applies the optimizer; before any resume, which
    # loads into the fused buffers through the shards' aliased tensors
    fused_owned = fused_owner_tables(tables, plan["tables"], world_size=wsize,
                                     optimizer=emb_cfg.kind)
    if fused_owned:
        OwnerLookup(tables, fused_owned, emb_opt, world_size=wsize, seed=opts.seed)

    forward: Any = model
    if graph_kernels and compile_mode == CUDA_GRAPHS and opts.compile_mode in (None, AUTO) \
            and opts.progress and rank == 0:
        print(f"gemc run: CUDA graphs on ({compile_mode_why}); --compile-mode default "
              "turns them off", flush=True)
    if graph_kernels:
        forward = GraphExecutor(
            captured.gm,
            captured.param_fqns,
            model,
            graph_kernels,
            tables=tables,
            emb_opt=emb_opt,
            device=device,
            world_size=wsize,
            executor=opts.graph_executor,
            measured=opts.kernel_choices,
            compile_mode=compile_mode,
            pointwise_autotune=opts.pointwise_autotune,
            measure=opts.measure_kernels,
            recorded=plan_choices(graph_kernels),
            priced_sparse=frozenset(str(t["fqn"]) for t in plan["tables"]
                                    if t.get("lookup") == SPARSE),
            warm=warm,
            varying_inputs=plan["model"].get("varying_inputs") or (),
            fixed_shapes=str(plan["model"].get("fixed_shapes") or ""),
            constants=captured.constants,
            constant_fqns=captured.constant_fqns,
        )
        applied_kernels += [str(k.get("name", k["kind"])) for k in graph_kernels
                            if str(k.get("name")) not in forward.not_applied]
    module_compiled = not graph_kernels and _compile_module_mode(opts, device, wsize)
    if module_compiled:
        forward = _compiled_module(model, tables, device)
    audit = _fp8_audit(opts, model, forward, fp8_nodes, prec_entries, wsize, rank,
                       compiled=module_compiled or bool(graph_kernels))

    start = 0
    resumed_from = None
    if opts.resume:
        if not opts.checkpoint_dir:
            raise GemcUserError(
                "--resume needs --checkpoint-dir", where="--resume", fix="add --checkpoint-dir D"
            )
        _, path = ckpt.require_latest(opts.checkpoint_dir)
        _check_checkpoint_optimizer(path, emb_cfg.kind)
        state = training_state(
            model, dense_opt, tables, emb_opt, step=0, rank=rank, device=device,
            local_world=world.local_world,
        )
        ckpt.load(path, state)
        start = restore_after_load(state, model, dense_opt, emb_opt)
        resumed_from = str(path)
    setup_s = time.perf_counter() - t_setup

    prefetch = TablePrefetch(tables, world_size=wsize, device=device)
    # the replica groups' lookups ahead of the forward (module mode; graph mode's executor
    # looks them up ahead of its compiled graph itself: replica_ahead)
    replica_lookups = ReplicaLookups(
        emb_opt.groups, emb_opt.not_grouped,
        off="graph mode: the graph executor looks the groups up ahead of the compiled graph "
        "(graph_ahead)" if graph_kernels and emb_opt.groups else None)
    metrics = Metrics()
    progress = Progress(opts.steps, start, enabled=opts.progress and rank == 0)
    exit_after = os.environ.get(EXIT_AFTER_STEP_ENV)
    saved: list[str] = []
    local_batch, batch_source = local_batch_size(spec, rank)
    if opts.on_ready is not None:
        opts.on_ready(Trainables(model, dense_opt, emb_opt))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    every = max(1, int(opts.loss_every))
    pending: list[tuple[int, torch.Tensor, float]] = []  # (step, loss on device, data ms)
    guard = DivergenceGuard(
        low_precision_sites({**plan, "precision": prec_entries}), action=opts.divergence,
        quiet=rank != 0,
        reference=load_reference(opts.reference_losses) if opts.reference_losses else None)
    # what the first step is made of (torch's compile timers, Triton's compiles): the report
    account = FirstStepAccount().start() if start == 0 else None

    def wait() -> None:
        sync(device)
    first_step: dict[str, Any] | None = None
    block_t0 = time.perf_counter()

    def flush() -> None:
        """Read the pending steps' losses (one host sync for all) and record them."""
        nonlocal block_t0
        if not pending:
            return
        losses = torch.stack([loss for _, loss, _ in pending]).float().cpu().tolist()
        sync(device)
        now = time.perf_counter()
        elapsed = (now - block_t0) * 1e3
        if every > 1:  # the block's batches were made inside it: not step time
            elapsed -= sum(d for _, _, d in pending)
        ms = max(0.0, elapsed) / len(pending)
        for (done, _, data_ms), value in zip(pending, losses):
            rec = StepRecord(step=done, loss=float(value), ms=ms, data_ms=data_ms)
            metrics.records.append(rec)
            guard.observe(done, float(value))  # the mean over ranks: all ranks agree
            progress.update(rec, local_batch * wsize / ((ms or 1e-6) / 1e3) if local_batch else None)
        pending.clear()
        block_t0 = time.perf_counter()

    for step in range(start, opts.steps):
        t0 = time.perf_counter()
        # RNG (dropout, ...) is a function of (seed, rank, step): a resumed run draws the
        # same numbers as an uninterrupted one without storing generator state.
        torch.manual_seed(derive_seed(opts.seed, "rng", rank, step))
        batch = spec.make_batch(step * wsize + rank, device)
        if every == 1:
            sync(device)
        t1 = time.perf_counter()
        if every == 1:
            block_t0 = t1
        if account is not None:  # the first step only: its phases, each ended by a sync
            account.mark("batch", wait)
        if audit.mode == SHADOW:  # the step compiled: its sites measured on an eager twin
            audit.shadow(step + 1, model, batch, lambda: prec.autocast(device.type))
        else:
            audit.begin(step + 1)  # the hooks measure this step's own operands
        with prec.autocast(device.type):
            replica_lookups.begin_step(batch)
            prefetch.begin_step(batch)
            loss = forward(*batch)
        if account is not None:
            account.mark("forward", wait)
        loss.backward()
        if layout.averager is not None:
            layout.averager.finish()
        prefetch.end_step()
        replica_lookups.end_step()
        audit.finish(step + 1)  # before the update; a switched GEMM runs bf16 from the next step
        if account is not None:
            account.mark("backward", wait)
        dense_opt.step()
        emb_opt.step()
        dense_opt.zero_grad(set_to_none=True)
        emb_opt.zero_grad()
        if account is not None:
            account.mark("optimizers", wait)
        mean_loss = loss.detach().float().clone()
        if wsize > 1:
            dist.all_reduce(mean_loss)
            mean_loss /= wsize
        done = step + 1
        pending.append((done, mean_loss, (t1 - t0) * 1e3))
        if every == 1 or done % every == 0 or done == opts.steps or done == start + 1:
            flush()
        if account is not None and metrics.records:
            account.mark("loss_read")
            first_step = {**account.finish(metrics.records[0].ms / 1e3),
                          "compile_workers": workers}
            if warm is not None:  # what was compiled ahead, and whether launches found it
                first_step["kernel_warmup"] = {
                    **warm.report(account.triton.gemc_hits, account.triton.gemc_misses),
                    "ops_not_derived": dict(getattr(forward, "unwarmed_ops", {}))}
            account = None
        if opts.on_step is not None:
            opts.on_step(done)
        if opts.checkpoint_dir and opts.checkpoint_every > 0 and done % opts.checkpoint_every == 0:
            flush()
            saved.append(_save(opts, model, dense_opt, tables, emb_opt, done, world, device))
        if exit_after is not None and int(exit_after) == done:
            flush()
            progress.close()
            os._exit(17)  # test hook: a run killed right after this step
    flush()
    progress.close()
    final_step = max(start, opts.steps)
    if opts.checkpoint_dir and (not saved or not saved[-1].endswith(ckpt.step_dir_name(final_step))):
        if final_step > start:
            saved.append(_save(opts, model, dense_opt, tables, emb_opt, final_step, world, device))

    report = build_report(
        plan, plan_path, opts, world, device, metrics, prec, layout, tables, applied_kernels,
        local_batch, start, setup_s, saved, resumed_from, emb_cfg, dense_cfg,
    )
    report["execution"] = (
        f"graph: the captured graph with the plan's kernels (graph_mode.py, "
        f"{opts.graph_executor})"
        if graph_kernels
        else "module: the model's forward with sharded tables and wrapped regions"
        + (" under torch.compile (table lookups eager)" if module_compiled else "")
    )
    report["embedding_exchange"] = prefetch.report()
    # data-parallel replicas on several ranks: their groups (one storage, lookup and
    # update each), those on their own and why (replica_groups)
    report["replica_batch"] = replica_lookups.report()
    ahead = getattr(forward, "replicas_ahead", None)
    if ahead is not None:  # graph mode: the members looked up ahead, those left in the graph
        report["replica_batch"]["graph_ahead"] = ahead.report()
    # fqn -> the owners' route on several ranks (gemc.table_lookup.sharded_route: "batched"
    # is the fused owner lookup), as the plan's cost model priced it
    report["owner_routes"] = owner_routes(plan["tables"], world_size=wsize,
                                          optimizer=emb_cfg.kind)
    report["exchange_precision"] = {"forward": wire.forward, "backward": wire.backward}
    report["divergence"] = guard.report()
    report["fp8_audit"] = audit.report()
    audit.close()
    report["forced_fp8_linears"] = [e["target"] for e in forced_fp8]
    report["fp32_matmul"] = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    report["batch_size_source"] = batch_source
    report["initialization"] = init_report.summary()
    if local_batch is None:
        report["batch_size_note"] = BATCH_SIZE_MISSING
    # the first step alone (compile and autotuning included): it is always read by itself
    report["first_step_s"] = (metrics.records[0].ms / 1e3 if metrics.records and start == 0
                              else None)
    report["first_step"] = first_step
    report["compile_cache"] = cache.report() if cache is not None else None
    # per hand-written kernel and key: the launch config and whether it was autotuned
    report["kernel_tuning"] = _kernel_tuning(rank)
    if isinstance(forward, GraphExecutor):
        report["graph_executor"] = {
            "executor": forward.executor,
            "compile_mode": forward.compile_mode,
            "compile_mode_reason": compile_mode_why,
            "inductor_options": forward.inductor_options,
            "backend": compile_backend(device) if forward.executor == "inductor" else None,
            "kernel_choices": dict(sorted(forward.choices.items())),
            # measured (this run), file (--kernel-choices), plan (recorded), default,
            # forced (GEMC_GROUP_CHOICE), required (an epilogue reading its GEMM operand)
            "choice_sources": dict(sorted(forward.sources.items())),
            "measured": forward.measured,
            "host_s": {k: round(v, 3) for k, v in forward.host_s.items()},
            "not_applied": list(forward.not_applied),
            # fqn -> "batched" / "sparse" (gemc.table_lookup): the code each table ran on
            "table_lookups": dict(sorted(forward.lookup_paths.items())),
            # fqn -> both routes' predicted ms, where the plan chose by price
            # (gemc.table_lookup.cheaper_route): set a measured run against them
            "table_route_ms": {str(t["fqn"]): t["route_ms"] for t in plan["tables"]
                               if isinstance(t.get("route_ms"), dict)},
            # gathers from small tables whose backward adds up per block (no per-id atomics)
            "contended_gathers": forward.gathers,
            # one compiled graph per guarded regions' outcome (packed, or padded; its
            # packed_regions: the token count it was first compiled at): how many were
            # compiled, and for what; then the bucketed counts each region ran at
            "compiled_variants": list(forward.variants),
            "packed_token_counts": {n: sorted(c) for n, c in forward.token_counts.items()},
        }
    report_path = None
    if rank == 0:
        report_path = Path(opts.report) if opts.report else (
            plan_path.with_name(plan_path.name.removesuffix(".json") + ".run.json")
            if plan_path is not None
            else None
        )
        if report_path is not None:
            report_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = report_path.with_name(report_path.name + ".tmp")
            tmp.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, report_path)
    losses = [(r.step, r.loss) for r in metrics.records]
    return RunResult(losses=losses, report=report, report_path=report_path)


def _fp8_audit(opts: RunOptions, model: torch.nn.Module, forward: Any,
              fp8_nodes: dict[str, str], entries: list[dict[str, Any]], wsize: int, rank: int,
              *, compiled: bool) -> Fp8Audit:
    """The run's fp8 audit (:mod:`.fp8_audit`): on the step itself where the model runs
    eagerly, on an eager twin of it where the step is compiled (one rank only); sites whose
    weight a region shards (fsdp / hsdp / tp: a DTensor outside the forward) are left out,
    said so in the report."""
    from torch.distributed.tensor import DTensor

    every = check_every(opts.fp8_audit_every)
    bound, source = plan_bound(entries)
    sites = fp8_sites(model)
    not_audited = {n: "its weight is sharded (fsdp / hsdp / tp): the hooks would not see it "
                   "whole" for n, m in sites.items() if isinstance(m.weight, DTensor)}
    sites = {n: m for n, m in sites.items() if n not in not_audited}
    off = None
    if compiled and wsize > 1 and sites and every:
        off = ("the step is compiled on several ranks: the eager twin the audit measures "
               "on would run the tables' exchange and the regions' wrappers outside the step")
        if rank == 0:
            warnings.warn(f"gemc: the fp8 audit is off: {off}", stacklevel=3)
    on_switch = None
    if isinstance(forward, GraphExecutor):
        def on_switch(recipes: dict[str, Any]) -> None:
            forward.set_fp8_recipes(recipes, fp8_nodes)
    return Fp8Audit(sites, every=every, bound_db=bound, bound_source=source,
                    mode=SHADOW if compiled else STEP, off=off, on_switch=on_switch,
                    world_size=wsize, quiet=rank != 0, not_audited=not_audited)


def _check_checkpoint_optimizer(path: Path, kind: str) -> None:
    """A checkpoint's sparse optimizer state only loads into the same optimizer."""
    stored = {
        "rowwise_adagrad" if key.endswith(".sum") else "adam"
        for key in ckpt.stored_keys(path)
        if key.startswith("table_optim.")
    }
    if stored and kind not in stored:
        (other,) = stored
        raise GemcUserError(
            f"checkpoint {path} holds {other} state for the tables, but this run uses {kind}",
            where=f"{path} / --embedding-optimizer",
            fix=f"resume with --embedding-optimizer {other} (or start without --resume)",
        )


def _is_table_param(p: torch.Tensor, table_params: set[torch.Tensor]) -> bool:
    return any(p is t for t in table_params)


def _save(opts, model, dense_opt, tables, emb_opt, done, world, device) -> str:  # noqa: ANN001
    state = training_state(
        model, dense_opt, tables, emb_opt, step=done, rank=world.rank, device=device,
        local_world=world.local_world,
    )
    path = ckpt.save(
        opts.checkpoint_dir, done, state, rank=world.rank, keep=opts.keep_checkpoints
    )
    return str(path)
