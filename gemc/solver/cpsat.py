"""The CP-SAT planner: one model of the whole plan, solved by OR-Tools.

Decisions (integers; see ``candidates`` for the options and ``expand.Layout`` for bins)

    nd[g, i]    members of dense region class g taking strategy option i   (sum_i = |g|)
    y[c, j]     members of table class c taking sharding option j          (sum_j = |c|)
    v[c, j, s]  pieces of those tables in slot s      (sum_s = pieces_j * y, v <= per_slot * y)
    used / u    "option taken by some member" (booleans for the maxima)

Per bin b (a rank, or a group of hosts where the model is fluid) the same sums as the
step model, in integer units (10 ns, 1 KiB):

    sparse_b  = uniform + sum v * compute * weight           S   >= sparse_b / |b|
    memory_b  = dense + uniform + sum v * memory * weight    memory_b / |b| <= cap
    out_b     (pooled all-to-all bytes)                      A   >= each all-to-all form

and the step the step model predicts, linear once the maxima are variables:

    step = S + 2 (a2a_const + A) + dense fwd + dense bwd + EF + EB + TP + optimizer
    EF >= max fwd tail,  EF >= fwd comm - overlap * fwd compute
    EB >= max bwd tail,  EB >= bwd comm + DP all-reduce - overlap * (bwd compute + S)

A fluid bin adds "the largest piece" bounds (S and A >= any piece it holds; every piece
fits on one rank beside the dense and uniform parts) and keeps ``packing_slack`` of its
memory free for ``expand`` to pack pieces onto ranks; the expanded plan is checked exactly.
``memory`` is a rank's steady state: the eager lookups' gradients, which land in the room
the activations leave at the end of the backward (``memory.lookup_gradient_extra``: a
maximum, not a sum), are not in the model; the exact check (``evaluate``) and the local
search after it price them, and the greedy hint places by them. Symmetry between ranks of a host, between
hosts and between bins is broken by ordering their sparse loads; identical tables and
regions are one class with counts. The best heuristic plan after the local search,
relabelled to obey that order, is the hint. CP-SAT runs with ``interleave_search`` and a deterministic time limit, so the
same inputs give the same plan on any machine, and in a child process (``cpsat_worker``),
so a native abort or Ctrl-C never takes the compile down with it.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemc.cost_model.op_cost import optimizer_time
from gemc.cost_model.step_model import (
    batched_kernel_floor_s,
    exchange_cast_launch_s,
    replica_all_reduce_s,
)

from .candidates import RegionClass, TableClass
from .evaluate import Pricer
from .expand import Layout, ModelSolution
from .problem import Assignment, DenseChoice, Problem

WORKER = Path(__file__).with_name("cpsat_worker.py")  # run as a script: imports only OR-Tools
TIME_UNIT_S = 1e-8
MEM_UNIT_B = 1024


def _t(seconds: float) -> int:
    return int(round(seconds / TIME_UNIT_S))


def _m(nbytes: float) -> int:
    return int(math.ceil(nbytes / MEM_UNIT_B))


@dataclass
class CpSatResult:
    solution: ModelSolution | None
    status: str                 # optimal | feasible | infeasible | unknown | crashed
    objective_s: float | None   # the model's step time of the solution
    bound_s: float | None       # the model's proven lower bound
    deterministic_s: float
    wall_s: float
    build_s: float
    wall_stopped: bool
    variables: int
    constraints: int
    crash: str | None = None    # the child process died (status "crashed"): how
    balanced: list[int] | None = None  # fullest rank's KiB before / after the second solve


class _Builder:
    """Builds the model top to bottom: dense, tables, per-bin loads, objective."""

    def __init__(self, problem: Problem, layout: Layout, regions: list[RegionClass],
                 tables: list[TableClass], pricer: Pricer) -> None:
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.m = cp_model.CpModel()
        self.p, self.layout, self.regions, self.tables = problem, layout, regions, tables
        self.a2a = pricer.a2a
        self.nd: list[list] = []
        self.used: list[list] = []
        self.y: list[list] = []
        self.u: list[list] = []
        self.v: dict[tuple[int, int], list] = {}
        self.upper: dict[int, int] = {}  # variable index -> upper bound (booleans: 1)
        self.T = self._horizon()

    # ---- helpers -----------------------------------------------------------------------
    def _int(self, lo: int, hi: int, name: str):
        x = self.m.NewIntVar(lo, hi, name)
        self.upper[x.Index()] = hi
        return x

    def _expr(self, terms: list) -> object:
        lin = self.cp.LinearExpr.WeightedSum
        return lin([t[0] for t in terms], [t[1] for t in terms]) if terms else 0

    def _ub(self, terms: list) -> int:
        return sum(max(0, c) * self.upper.get(v.Index(), 1) for v, c in terms)

    def _total(self, name: str, terms: list) -> object:
        """A variable equal to a long sum, so constraints that repeat it stay short."""
        if not terms:
            return 0
        x = self._int(0, self._ub(terms), name)
        self.m.Add(x == self._expr(terms))
        return x

    def _horizon(self) -> int:
        """An upper bound of every time variable: all work of every option, summed.
        (Tight bounds keep the linear constraints far from int64 overflow.)"""
        a2a = self.a2a
        total = 0
        for tc in self.tables:
            total += len(tc.members) * max(
                o.ranks * (_t(o.compute_s) + _t(o.out_bytes * (a2a.intra_out + a2a.intra_in
                                                               + a2a.host_out + a2a.host_in)))
                for o in tc.options)
        for rc in self.regions:
            total += len(rc.members) * max(
                _t(o.fwd_s + o.bwd_s + o.comm_fwd + o.comm_bwd + o.comm_tp + o.fwd_tail
                   + o.bwd_tail) for o in rc.options)
        return 2 * total + _t(1.0)

    def _count_vars(self, prefix: str, count: int, n_options: int) -> tuple[list, list]:
        xs = [self._int(0, count, f"{prefix}_{i}") for i in range(n_options)]
        bs = [self.m.NewBoolVar(f"{prefix}_used_{i}") for i in range(n_options)]
        self.m.Add(sum(xs) == count)
        for x, b in zip(xs, bs):
            self.m.Add(x <= count * b)
            self.m.Add(x >= 1).OnlyEnforceIf(b)
        return xs, bs

    # ---- dense regions ------------------------------------------------------------------
    def dense(self) -> None:
        m = self.m
        self.fwd, self.bwd, self.c_fwd, self.c_bwd, self.c_tp = [], [], [], [], []
        self.dense_mem, self.numel = [], []
        self.f_tail = self._int(0, self.T, "fwd_tail")
        self.b_tail = self._int(0, self.T, "bwd_tail")
        mem_ub = max([1] + [_m(max(o.transient, o.ckpt_peak)) for rc in self.regions
                            for o in rc.options])
        self.transient = self._int(0, mem_ub, "transient")
        self.ckpt = self._int(0, mem_ub, "ckpt_peak")
        for g, rc in enumerate(self.regions):
            xs, bs = self._count_vars(f"nd{g}", len(rc.members), len(rc.options))
            self.nd.append(xs)
            self.used.append(bs)
            for o, x, b in zip(rc.options, xs, bs):
                self.fwd.append((x, _t(o.fwd_s)))
                self.bwd.append((x, _t(o.bwd_s)))
                self.c_fwd.append((x, _t(o.comm_fwd)))
                self.c_bwd.append((x, _t(o.comm_bwd)))
                self.c_tp.append((x, _t(o.comm_tp)))
                self.dense_mem.append((x, _m(o.memory)))
                self.numel.append((x, o.numel))
                for var, value in ((self.f_tail, _t(o.fwd_tail)), (self.b_tail, _t(o.bwd_tail)),
                                   (self.transient, _m(o.transient)),
                                   (self.ckpt, _m(o.ckpt_peak))):
                    if value:
                        m.Add(var >= value * b)

    # ---- tables -------------------------------------------------------------------------
    def tables_(self) -> None:
        m, L = self.m, self.layout
        self.unif = {k: [] for k in ("compute", "memory", "io", "ii", "ho", "hi")}
        self.bins = {k: [[] for _ in range(L.bins)] for k in ("compute", "memory", "io", "ii",
                                                                "ho", "hi")}
        self.total_hi = []      # every rank's host-in term, summed (fluid host-in bound)
        self.dp_bytes, self.ids = [], []
        self.any_a2a = m.NewBoolVar("any_all_to_all")
        self.any_dp = m.NewBoolVar("any_data_parallel")
        self.any_kernel = m.NewBoolVar("any_batched_kernel")
        self.piece_bounds = []  # (u, compute, memory, io, ho) of fluid pieces
        a2a = self.a2a
        for c, tc in enumerate(self.tables):
            count = len(tc.members)
            ys, us = self._count_vars(f"y{c}", count, len(tc.options))
            self.y.append(ys)
            self.u.append(us)
            for j, (o, y, u) in enumerate(zip(tc.options, ys, us)):
                k = {"compute": _t(o.compute_s), "memory": _m(o.memory),
                     "io": _t(o.out_bytes * a2a.intra_out), "ii": _t(o.out_bytes * a2a.intra_in),
                     "ho": _t(o.out_bytes * a2a.host_out), "hi": _t(o.out_bytes * a2a.host_in)}
                if o.replicated:
                    self.dp_bytes.append((y, o.dp_grad_bytes, o.dp_numel))
                    m.AddImplication(u, self.any_dp)
                else:
                    self.ids.append((y, o.ids_bytes))
                    m.AddImplication(u, self.any_a2a)
                if o.in_kernel:
                    m.AddImplication(u, self.any_kernel)
                if o.uniform:
                    for key, val in k.items():
                        self.unif[key].append((y, val))
                    continue
                self.total_hi.append((y, o.pieces * o.width * k["hi"]))
                per, slots = L.per_slot(o), L.slots(o)
                vs = [self._int(0, count * per, f"v{c}_{j}_{s}") for s in range(slots)]
                self.v[(c, j)] = vs
                m.Add(sum(vs) == o.pieces * y)
                if per < count * per:
                    for v in vs:
                        m.Add(v <= per * y)
                w = L.weight(o)
                for s, v in enumerate(vs):
                    for b in L.bins_of_slot(o, s):
                        for key, val in k.items():
                            if val:
                                self.bins[key][b].append((v, val * w))
                if L.fluid(o):
                    self.piece_bounds.append((u, k["compute"], k["memory"], k["io"],
                                              min(o.width, L.local) * k["ho"]))

    # ---- per-bin loads and the all-to-all -------------------------------------------------
    def loads(self) -> None:
        m, L, p = self.m, self.layout, self.p
        n = L.bin_size
        expr = self._expr
        self.uni = {k: self._total(f"uniform_{k}", v) for k, v in self.unif.items()}
        uc, um = self.uni["compute"], self.uni["memory"]
        dense_mem = (_m(p.options.workspace_bytes) + self._total("dense_memory", self.dense_mem)
                     + self.transient + self.ckpt)
        cap = int(p.cap_bytes // MEM_UNIT_B)
        self.S = self._int(0, self.T, "sparse_max")
        self.A = self._int(0, self.T, "all_to_all_bw")
        # a fluid bin keeps a little room for packing its pieces onto ranks (expand)
        bin_cap = cap if n == 1 else int(cap * (1 - p.settings.packing_slack))
        sparse = []
        self.cap = cap
        self.bin_memory = []  # (n x a bin's memory) per bin: the balance solve's terms
        for b in range(L.bins):
            sb = self._int(0, self.T, f"sparse_{b}")
            m.Add(sb == expr(self.bins["compute"][b]))
            sparse.append(sb)
            m.Add(n * self.S >= sb + n * uc)
            m.Add(expr(self.bins["memory"][b]) + n * (um + dense_mem) <= n * bin_cap)
            self.bin_memory.append(expr(self.bins["memory"][b]) + n * (um + dense_mem))
        # a rank's batched kernel costs at least its floor (step_model.batched_floor_s):
        # S >= the floor wherever some rank runs one (what else that rank computes outside
        # the kernel, exchange casts or eager tables, is left out: a bound, and the
        # expanded plan is priced exactly)
        floor = _t(batched_kernel_floor_s(p.world))
        if floor:
            m.Add(self.S >= floor * self.any_kernel)
        for u, comp, mem, io, ho in self.piece_bounds:
            m.Add(self.S >= uc + comp * u)
            m.Add(um + dense_mem + mem * u <= cap)  # the piece fits on one rank
            m.Add(self.A >= io * u)
            if L.hosts > 1:
                m.Add(self.A >= ho * u)
        self._all_to_all()
        self._symmetry(sparse)

    def _all_to_all(self) -> None:
        m, L, expr = self.m, self.layout, self._expr
        n, local = L.bin_size, L.local
        u = self.uni
        if n == 1:  # exact: the four forms of AllToAll.time, rank by rank, host by host
            ii = []
            for r in range(L.bins):
                m.Add(self.A >= expr(self.bins["io"][r]) + u["io"])
                x = self._int(0, self.T, f"in_{r}")
                m.Add(x == expr(self.bins["ii"][r]) + u["ii"])
                ii.append(x)
            ho_h, hi_h = [], []
            for h in range(L.hosts):
                ranks = range(h * local, (h + 1) * local)
                host_in = sum(ii[r] for r in ranks)
                for r in ranks:
                    m.Add(self.A >= host_in - ii[r])
                if L.hosts > 1:
                    ho = self._int(0, self.T, f"host_out_{h}")
                    hi = self._int(0, self.T, f"host_in_{h}")
                    m.Add(ho == sum(expr(self.bins["ho"][r]) for r in ranks) + local * u["ho"])
                    m.Add(hi == sum(expr(self.bins["hi"][r]) for r in ranks) + local * u["hi"])
                    ho_h.append(ho)
                    hi_h.append(hi)
            if L.hosts > 1:
                total = sum(hi_h)
                for ho, hi in zip(ho_h, hi_h):
                    m.Add(self.A >= ho)
                    m.Add(self.A >= total - hi)
            return
        # fluid: every rank of a bin sends its average; a bin holds whole hosts
        total_hi = self._total("total_host_in", self.total_hi) + L.world * u["hi"]
        for b in range(L.bins):
            m.Add(n * self.A >= expr(self.bins["io"][b]) + n * u["io"])
            if L.hosts > 1:
                m.Add(n * self.A >= local * (expr(self.bins["ho"][b]) + n * u["ho"]))
                m.Add(n * self.A >= n * total_hi - local * (expr(self.bins["hi"][b])
                                                            + n * u["hi"]))

    def _symmetry(self, sparse: list) -> None:
        """Ranks of a host, hosts, and bins are interchangeable: order their sparse loads."""
        m, L = self.m, self.layout
        if L.bin_size == 1 and L.hosts > 1:
            local = L.local
            for h in range(L.hosts):
                for r in range(h * local, (h + 1) * local - 1):
                    m.Add(sparse[r] >= sparse[r + 1])
            host = [sum(sparse[h * local:(h + 1) * local]) for h in range(L.hosts)]
            for h in range(L.hosts - 1):
                m.Add(host[h] >= host[h + 1])
        else:
            for b in range(L.bins - 1):
                m.Add(sparse[b] >= sparse[b + 1])

    # ---- the step -----------------------------------------------------------------------
    def objective(self) -> None:
        m, p, a2a = self.m, self.p, self.a2a
        opts, world = p.options, p.world
        lin, expr = self.cp.LinearExpr.WeightedSum, self._expr

        fwd, bwd = expr(self.fwd), expr(self.bwd)
        # data-parallel tables: their gradients join the step's one all-reduce of the
        # replicas' bucket (alpha + beta * bytes), exposed whole
        # (step_model.replica_all_reduce_s)
        dp_ar = 0
        dp_total = sum(b * len(self.tables[c].members) for c, tc in enumerate(self.tables)
                       for o in tc.options if o.replicated
                       for b in [o.dp_grad_bytes])
        if self.dp_bytes and world > 1 and dp_total > 0:
            alpha = replica_all_reduce_s(1.0, p.topology, p.calibration)
            top = replica_all_reduce_s(dp_total, p.topology, p.calibration)
            beta = (top - alpha) / dp_total
            dp_ar = _t(alpha) * self.any_dp + lin([y for y, _, _ in self.dp_bytes],
                                                  [_t(beta * b) for _, b, _ in self.dp_bytes])
        ov = int(round(100 * opts.overlap))
        ef = self._int(0, self.T, "exposed_fwd")
        eb = self._int(0, self.T, "exposed_bwd")
        m.Add(ef >= self.f_tail)
        m.Add(100 * ef >= 100 * expr(self.c_fwd) - ov * fwd)
        m.Add(eb >= self.b_tail)
        m.Add(100 * eb >= 100 * expr(self.c_bwd) - ov * (bwd + self.S))
        # optimizer: the secant of optimizer_time over the elements a plan can leave per rank
        lo = sum(len(rc.members) * min(o.numel for o in rc.options) for rc in self.regions)
        hi = sum(len(rc.members) * max(o.numel for o in rc.options) for rc in self.regions)
        hi += sum(len(self.tables[c].members) * o.dp_numel for c, tc in enumerate(self.tables)
                  for o in tc.options if o.replicated)

        def opt_s(numel: float) -> float:
            return optimizer_time(opts.optimizer, numel, opts.dense_dtype, p.topology.gpu,
                                  p.calibration, fused=opts.fused_optimizer,
                                  tensors=max(1, 2 * len(p.regions)))[0]

        slope = (opt_s(hi) - opt_s(lo)) / (hi - lo) if hi > lo else 0.0
        opt_terms = ([(x, _t(slope * n)) for x, n in self.numel]
                     + [(y, _t(slope * n)) for y, _, n in self.dp_bytes])
        optimizer = _t(opt_s(lo) - slope * lo) + expr(opt_terms)
        ids = 0
        if not opts.pipeline_sparse and self.ids:
            per_byte = (a2a.even(1e9) - a2a.const_s) / 1e9
            ids = _t(a2a.const_s) * self.any_a2a + expr([(y, _t(b * per_byte))
                                                         for y, b in self.ids])
        a2a_const = _t(a2a.const_s) if world > 1 else 0
        # the exchange's cast kernels launch once a step whenever it runs (evaluate's
        # "exchange_cast"); their bytes are in the holders' compute
        cast = _t(exchange_cast_launch_s(opts.exchange, p.calibration)) if world > 1 else 0
        step = (self.S + (2 * a2a_const + cast) * self.any_a2a + 2 * self.A + ids + fwd + bwd
                + ef + eb + expr(self.c_tp) + dp_ar + optimizer)
        self.step = step
        m.Minimize(step)

    def balance(self) -> tuple[int, int]:
        """The second objective's variables, appended after the step model was written
        (so the first solve searches the same model as without balancing; adding them
        before changed its search path and cost 34% of step at 16 ranks on DLRMv2):
        (index of the step, index of the fullest rank's memory, a bin's mean)."""
        n = self.layout.bin_size
        step_var = self._int(0, 20 * self.T, "step")
        self.m.Add(step_var == self.step)
        mem = self._int(0, self.cap, "memory_max")
        for term in self.bin_memory:
            self.m.Add(n * mem >= term)
        return step_var.Index(), mem.Index()

    # ---- hint ---------------------------------------------------------------------------
    def hint(self, sol: ModelSolution) -> None:
        for g, xs in enumerate(self.nd):
            for i, x in enumerate(xs):
                self.m.AddHint(x, sol.dense[g][i])
                self.m.AddHint(self.used[g][i], int(sol.dense[g][i] > 0))
        for c, ys in enumerate(self.y):
            for j, y in enumerate(ys):
                self.m.AddHint(y, sol.counts[c][j])
                self.m.AddHint(self.u[c][j], int(sol.counts[c][j] > 0))
                for v, val in zip(self.v.get((c, j), []), sol.slots.get((c, j), [])):
                    self.m.AddHint(v, val)

    def solution(self, values: list[int]) -> ModelSolution:
        """The decisions, read from the child's values (indexed by proto variable)."""
        def val(x) -> int:
            return int(values[x.Index()])

        dense = [[val(x) for x in xs] for xs in self.nd]
        counts = [[val(y) for y in ys] for ys in self.y]
        slots = {key: [val(v) for v in vs] for key, vs in self.v.items()}
        return ModelSolution(dense, counts, slots)


def to_model_solution(problem: Problem, layout: Layout, regions: list[RegionClass],
                      tables: list[TableClass], a: Assignment, pricer: Pricer
                      ) -> ModelSolution | None:
    """An assignment (greedy's) in the model's terms, ranks relabelled so the model's
    symmetry-breaking order holds; None if it uses an option the model does not offer."""
    dense = []
    for rc in regions:
        row = [0] * len(rc.options)
        for name in rc.members:
            choice = a.dense.get(name, DenseChoice())
            idx = [i for i, o in enumerate(rc.options) if o.choice == choice]
            if not idx:
                return None
            row[idx[0]] += 1
        dense.append(row)
    perm = _canonical_ranks(problem, layout, tables, a)
    counts, slots = [], {}
    for c, tc in enumerate(tables):
        row = [0] * len(tc.options)
        for fqn in tc.members:
            choice = a.tables[fqn]
            idx = [j for j, o in enumerate(tc.options)
                   if (o.sharding, o.ranks, o.grid) == (choice.sharding, len(choice.ranks),
                                                        choice.grid)]
            if not idx:
                return None
            j = idx[0]
            row[j] += 1
            o = tc.options[j]
            if o.uniform:
                continue
            vs = slots.setdefault((c, j), [0] * layout.slots(o))
            for start in sorted({perm[r] for r in choice.ranks})[:: o.width]:
                vs[start // layout.slot_size(o)] += 1
        counts.append(row)
    return ModelSolution(dense, counts, slots)


def _canonical_ranks(problem: Problem, layout: Layout, tables: list[TableClass],
                     a: Assignment) -> dict[int, int]:
    """old rank -> new rank: hosts (or bins) by sparse load, ranks of a host by load."""
    world, local = problem.world, layout.local
    load = [0] * world
    for tc in tables:
        for fqn in tc.members:
            choice = a.tables[fqn]
            o = next((o for o in tc.options if (o.sharding, o.ranks, o.grid)
                      == (choice.sharding, len(choice.ranks), choice.grid)), None)
            if o is None or o.uniform:
                continue
            for r in choice.ranks:
                load[r] += _t(o.compute_s)
    block = local if layout.bin_size == 1 else layout.bin_size
    groups = sorted(range(world // block),
                    key=lambda g: (-sum(load[g * block:(g + 1) * block]), g))
    perm = {}
    for new_g, g in enumerate(groups):
        members = range(g * block, (g + 1) * block)
        if layout.bin_size == 1:
            members = sorted(members, key=lambda r: (-load[r], r))
        for i, r in enumerate(members):
            perm[r] = new_g * block + i
    return perm


def _params(s, **fields: Any) -> str:
    """SatParameters as protobuf text (what the child process parses)."""
    from ortools.sat.python import cp_model

    params = cp_model.CpSolver().parameters
    for key, value in fields.items():
        setattr(params, key, value)
    params.random_seed = s.seed
    return str(params)


def _wall(s, deterministic_s: float) -> float:
    """The wall-clock safety net of a solve of ``deterministic_s``: never what stops a
    healthy search, even a short one on a loaded machine (0.25 deterministic s took 14 s
    of wall on two cores shared by ten processes)."""
    return max(deterministic_s * s.wall_limit_factor, s.wall_limit_min_s)


def _interleaved(s) -> dict[str, Any]:
    """Workers and interleaving. A batch of one task per worker: the deterministic limit
    is checked between batches, and OR-Tools' default batch (6 tasks at 2 workers) ran
    0.9 deterministic s before its first check, whatever the budget (DLRMv2, 16 ranks)."""
    if s.workers <= 1:
        return {"num_workers": 1}
    return {"num_workers": s.workers, "interleave_search": True,
            "interleave_batch_size": s.workers}


def _run_child(model_text: str, fill: str | None, main: str, budget: float,
               timeout_s: float, balance: dict[str, Any] | None = None
               ) -> tuple[dict[str, Any] | None, str, str]:
    """Run ``cpsat_worker`` on the model: (its result, or None if it died before the main
    solve's result; the stage it reached; the last lines of its stderr). If it dies while
    balancing, the main solve's result is kept. KeyboardInterrupt kills it and propagates."""
    with tempfile.TemporaryDirectory(prefix="gemc-cpsat-") as tmp:
        d = Path(tmp)
        (d / "model.txt").write_text(model_text)
        (d / "request.json").write_text(json.dumps({"fill": fill, "main": main,
                                                    "budget": budget, "balance": balance}))
        try:
            # its own session: the terminal's Ctrl-C reaches only this process, which
            # then kills the child (subprocess.run does on any exception) and re-raises
            proc = subprocess.run([sys.executable, str(WORKER), str(d)], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout_s,
                start_new_session=True, check=False)
            err, code = proc.stderr.decode(errors="replace"), proc.returncode
        except subprocess.TimeoutExpired:
            err, code = f"no answer after {timeout_s:.0f} s wall (killed)", None
        stage = (d / "stage").read_text() if (d / "stage").exists() else "start"
        tail = " | ".join(line.strip() for line in err.strip().splitlines()[-3:])
        if (code == 0 or stage == "balance") and (d / "result.json").exists():
            return json.loads((d / "result.json").read_text()), stage, tail
        if code is not None and code < 0:
            try:
                why = signal.Signals(-code).name
            except ValueError:
                why = f"signal {-code}"
        else:
            why = f"exit code {code}" if code is not None else "timeout"
        return None, stage, f"{why}: {tail}" if tail else why


def solve(problem: Problem, layout: Layout, regions: list[RegionClass],
          tables: list[TableClass], pricer: Pricer, hint: ModelSolution | None = None,
          time_limit_s: float | None = None) -> CpSatResult:
    """Build the model here, solve it in a child process (``cpsat_worker``).

    With a hint, the child first completes it (the decisions fixed, every derived
    variable found by a short solve); if the child aborts there (google/or-tools#5025 hits
    that solve), it is run again with the partial hint only. If it aborts again, the
    result has status ``crashed`` and no solution: the caller keeps the heuristic plan
    and says so."""
    start = time.perf_counter()
    b = _Builder(problem, layout, regions, tables, pricer)
    b.dense()
    b.tables_()
    b.loads()
    b.objective()
    s = problem.settings
    budget = problem.budget_s if time_limit_s is None else time_limit_s
    fill = None
    if hint is not None:
        b.hint(hint)
        fill_det = min(1.0, 0.2 * budget)
        fill = _params(s, num_workers=1, fix_variables_to_their_hinted_value=True,
                       max_deterministic_time=fill_det,
                       max_time_in_seconds=_wall(s, fill_det),
                       probing_deterministic_time_limit=0.0,
                       presolve_probing_deterministic_time_limit=0.0,
                       find_big_linear_overlap=False, max_presolve_iterations=1)
    main = _params(
        s, **_interleaved(s),
        max_time_in_seconds=_wall(s, budget), relative_gap_limit=s.gap_limit,
        # presolve spends deterministic time too: on thousands of tables its default
        # probing and overlap detection alone take the whole budget (1 s each)
        probing_deterministic_time_limit=min(1.0, 0.02 * budget),
        presolve_probing_deterministic_time_limit=min(1.0, 0.02 * budget),
        find_big_linear_overlap=False, max_presolve_iterations=1)
    model_text = str(b.m.Proto())
    proto = b.m.Proto()
    n_vars, n_cons = len(proto.variables), len(proto.constraints)
    balance = None
    if s.balance_share > 0:
        # lexicographic: the step first (its whole budget: taking this share from it cost
        # 34% of step at 16 ranks on DLRMv2, where the search is budget-bound), then the
        # fullest rank's memory with the step held at the first solution's, on top
        share = s.balance_share * budget
        step_index, mem_index = b.balance()
        balance = {"step": step_index, "memory": mem_index, "model": str(b.m.Proto()),
                   "params": _params(
            s, **_interleaved(s),
            max_deterministic_time=share, max_time_in_seconds=_wall(s, share),
            probing_deterministic_time_limit=min(1.0, 0.02 * share),
            presolve_probing_deterministic_time_limit=min(1.0, 0.02 * share),
            find_big_linear_overlap=False, max_presolve_iterations=1)}
    build = time.perf_counter() - start
    start = time.perf_counter()
    # the child's own limits stop it; this only catches a hung one
    timeout = (_wall(s, budget) + _wall(s, s.balance_share * budget)) * (2 if fill else 1) + 60.0
    res, stage, why = _run_child(model_text, fill, main, budget, timeout, balance)
    crash = None
    if res is None:
        crash = f"CP-SAT's process died in its {stage} solve ({why})"
        if fill is not None and stage == "fill":
            res, stage, why2 = _run_child(model_text, None, main, budget, timeout, balance)
            if res is None:
                crash += f"; again without completing the hint ({why2})"
    wall = time.perf_counter() - start
    if res is None:
        return CpSatResult(None, "crashed", None, None, 0.0, wall, build, False, n_vars,
                           n_cons, crash=crash)
    found = res["values"] is not None
    wall_stopped = (res["status"] != "optimal" and res["wall_s"] >= res["max_time_s"] * 0.98
                    and res["deterministic_s"] < budget)
    return CpSatResult(
        solution=b.solution(res["values"]) if found else None,
        status=res["status"],
        objective_s=res["objective"] * TIME_UNIT_S if found else None,
        bound_s=res["bound"] * TIME_UNIT_S if found else None,
        deterministic_s=res["deterministic_s"],
        wall_s=wall,
        build_s=build,
        wall_stopped=wall_stopped,
        variables=n_vars,
        constraints=n_cons,
        crash=crash,
        balanced=res.get("balanced"),
    )
