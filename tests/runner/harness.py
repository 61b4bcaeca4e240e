"""Launch helpers for the runner's multi-process tests (CPU, gloo).

Process start-up (importing torch) dominates on a small CI machine, so one launch of ``W``
workers runs a list of *scenarios* back to back on one process group: each scenario is a
plan file plus run options, and rank 0 writes every scenario's losses to a JSON file.
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from gemc.sharding import make_shards

REPO = Path(__file__).resolve().parents[2]
MODEL = f"{REPO / 'tests' / 'runner' / 'models.py'}:build"


def dense_grad(m: Any) -> Any:
    """A table shard's gradient as a dense tensor, without taking it from the optimizer
    (fp32 storage: its weight's; lower precisions: the working rows' gradients summed)."""
    import torch

    if m.precision == "fp32":
        return m.weight.grad.to_dense().clone()
    out = torch.zeros(m.local.rows, m.local.cols)
    for rows, work in m.working:
        out.index_add_(0, rows, work.grad.to_dense() if work.grad.is_sparse else work.grad)
    return out


def step_and_record(out: dict[str, Any], outs: list[Any], tables: dict[str, Any], opt: Any,
                    with_grads: bool) -> None:
    """After a step's backward: record its outputs and (``with_grads``: the gradients are
    not fused into the update) each shard's dense gradient, step the optimizer, then record
    each shard's updated rows. What the exchange tests compare path against path."""
    import torch

    out["outputs"].append([o.detach().clone() for o in outs])
    if with_grads:
        for fqn, m in tables.items():
            if m.local is not None:
                out["grads"].setdefault(fqn, []).append(dense_grad(m))
    opt.step()
    opt.zero_grad()
    for fqn, m in tables.items():
        if m.local is not None:
            out["weights"].setdefault(fqn, []).append(
                m.stored_rows(0).read(torch.arange(m.local.rows)).clone())


@contextmanager
def gloo_process(rank: int, world: int, port: int, per_host: int | None = None
                 ) -> Iterator[None]:
    """A spawned test worker's gloo process group (one thread, localhost; ``per_host``: the
    torchrun variables of ``world / per_host`` hosts, for code that reads its host from
    them). Leaving it normally destroys the group and ends the process without interpreter
    finalization (``comm.exit_skipping_finalization``: with torch 2.13's gloo a process
    that used a group sometimes aborts there, "terminate called without an active
    exception", which a worker that returned normally turned into a failed fixture under
    load); so write every result inside it. An exception destroys the group and
    propagates (the spawner reports it)."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    if per_host:
        env.update({"RANK": str(rank), "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(rank % per_host), "LOCAL_WORLD_SIZE": str(per_host)})
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
    from gemc.backends.torch.comm import exit_skipping_finalization

    exit_skipping_finalization(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def variant(
    plan: dict[str, Any],
    tables: dict[str, tuple[str, list[int]] | tuple[str, list[int], list[int]]] | None = None,
    regions: dict[str, str] | None = None,
    optimizer: dict[str, Any] | None = None,
    precision: list[dict[str, Any]] | None = None,
    kernels: bool = False,
) -> dict[str, Any]:
    """A copy of ``plan`` with tables re-sharded and regions re-strategized (by hand).

    Precision sites are replaced by ``precision`` (default none: fp32), because these tests
    compare distributed and single-process fp32 training to rtol 1e-4; the compiler's bf16
    choice would make both sides round differently. Generated kernels are dropped unless
    ``kernels`` is true (graph mode; on several ranks it needs every region ddp).
    """
    out = copy.deepcopy(plan)
    out["precision"] = list(precision or [])
    if not kernels:
        out["kernels"] = []
    for t in out["tables"]:
        spec = (tables or {}).get(t["fqn"])
        if spec is None:
            continue
        sharding, ranks = spec[0], spec[1]
        grid = spec[2] if len(spec) > 2 else None
        t["sharding"] = sharding
        t["shards"] = make_shards(sharding, list(ranks), t["rows"], t["dim"], grid)
    names = {r["name"] for r in out["regions"]}
    for name, strategy in (regions or {}).items():
        if name not in names:
            out["regions"].append({**out["regions"][0], "name": name, "strategy": strategy})
            continue
        for r in out["regions"]:
            if r["name"] == name:
                r["strategy"] = strategy
    if optimizer is not None:
        out["optimizer"] = optimizer
    return out


class ProbeCases:
    """A set of probe models (``root/<module>.py:build``) and named cases ``name ->
    (module, args)``, each compiled once per topology: what the probe tests share."""

    def __init__(self, root: Path, cases: dict[str, tuple[str, dict[str, Any]]]) -> None:
        self.root, self.cases = root, cases
        self._plans: dict[tuple[str, str], dict[str, Any]] = {}

    def entry(self, module: str) -> str:
        return f"{self.root / module}.py:build"

    def compiled(self, name: str, topology: str) -> dict[str, Any]:
        from gemc.api import compile as gemc_compile

        if (name, topology) not in self._plans:
            module, args = self.cases[name]
            self._plans[name, topology] = gemc_compile(self.entry(module), args,
                                                       topology=topology)
        return self._plans[name, topology]


def assert_losses_match(name: str, got: list[float], ref: list[float], steps: int,
                        rtol: float = 1e-4) -> None:
    """``steps`` losses equal to eager's to ``rtol``, NaN where eager's is NaN (a model that
    goes NaN must do so on the same step under gemc)."""
    assert len(got) == len(ref) == steps
    bad = [(i + 1, g, r) for i, (g, r) in enumerate(zip(got, ref))
           if not (abs(g - r) <= rtol * abs(r) or (math.isnan(g) and math.isnan(r)))]
    assert not bad, f"{name}: (step, gemc run, eager) off by more than rtol {rtol}: {bad}"


def _worker(rank: int, world: int, port: int, scenarios: list[dict[str, Any]], out: str) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from gemc.backends.torch.runner import RunOptions, run

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from gemc.backends.torch.comm import count_all_to_all, count_calls
    from gemc.backends.torch.sparse_optim import EmbeddingOptimizer

    sent: list[tuple[str, int]] = []
    calls = count_all_to_all(sent)
    # all-reduces issued inside the embedding optimizer's step, one entry a step
    reduces, emb_reduces = count_calls("all_reduce"), []
    emb_step = EmbeddingOptimizer.step

    def counted_step(self: EmbeddingOptimizer) -> None:
        before = reduces[0]
        emb_step(self)
        emb_reduces.append(reduces[0] - before)

    EmbeddingOptimizer.step = counted_step
    results: dict[str, Any] = {"_meta": {}}
    try:
        for sc in scenarios:
            losses, meta = [], []
            for phase in sc["phases"]:
                phase = dict(phase)
                plan = phase.pop("plan", sc["plan"])  # a phase may resume under another plan
                per_step: list[int] = []
                calls[0] = 0
                sent.clear()
                emb_reduces.clear()

                def on_step(done: int, per_step: list[int] = per_step) -> None:
                    per_step.append(calls[0])
                    calls[0] = 0

                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    res = run(plan, RunOptions(device="cpu", progress=False, on_step=on_step,
                                               **phase))
                losses.append(res.losses)
                meta.append({"all_to_all_per_step": per_step,
                             "all_to_all_sent": list(sent),
                             "embedding_all_reduce_per_step": list(emb_reduces),
                             "embedding_exchange": res.report.get("embedding_exchange"),
                             "replica_batch": res.report.get("replica_batch"),
                             "exchange_precision": res.report.get("exchange_precision"),
                             "warnings": [str(w.message) for w in caught]})
            results[sc["name"]] = losses
            results["_meta"][sc["name"]] = meta
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        dist.destroy_process_group()
    from gemc.backends.torch.comm import exit_skipping_finalization

    exit_skipping_finalization(0)  # gloo can abort in finalization (see its docstring)


def run_scenarios(world: int, scenarios: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """Run ``scenarios`` (``{"name", "plan": path, "phases": [RunOptions kwargs, ...]}``).

    Returns rank 0's per-phase losses under each name, and under ``"_meta"`` per name and
    phase: ``all_to_all_single`` calls per step, each call's input (dtype, elements) in
    order, all-reduces per step inside the embedding optimizer's step, the run report's
    ``embedding_exchange`` and ``exchange_precision``, and the
    warnings the run raised."""
    start_ranks(_worker, (world, free_port(), scenarios, str(out)), world)
    return json.loads(out.read_text())


# What a rank imports before it runs anything: imported once, by multiprocessing's fork
# server (one per pytest process, started at its first launch, ~3 s of CPU), instead of
# by every rank (measured: ~3 s of CPU less a rank; the suite starts ~44 ranks). What
# these modules read from the environment at import (TRITON_INTERPRET, chosen by
# tests/conftest.py before any test) is the server's: the same for every test.
RANK_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint",
                "torch.distributed.fsdp", "torch.export", "torch._dynamo", "gemc.capture",
                "gemc.backends.torch.runner", "tests.runner.harness")


def start_ranks(fn: Any, args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` new processes, joined (an exception in one is
    raised here). Each is a process of its own that ran nothing before ``fn``, as
    ``spawn``'s are, but forked from a server that has imported :data:`RANK_PRELOAD`
    (``forkserver``) rather than started from a bare interpreter; it gets this process's
    environment, working directory and ``sys.path`` at the call, as a spawned one does."""
    mp.set_forkserver_preload(list(RANK_PRELOAD))
    mp.start_processes(_in_environment, args=(fn, dict(os.environ), args), nprocs=nprocs,
                       join=True, start_method="forkserver")


def _in_environment(rank: int, fn: Any, env: dict[str, str], args: tuple[Any, ...]) -> None:
    """A forked rank: the launching process's environment (the fork server keeps the one
    it started with), then ``fn``."""
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def torchrun(
    world: int, plan: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 240
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=world -m gemc.run plan args...`` as a user would run it."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        "-m",
        "gemc.run",
        str(plan),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )
