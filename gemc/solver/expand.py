"""From the CP-SAT model's counts to concrete ranks, deterministically.

The model decides, per class, how many tables take each option and how many of their
pieces sit in each *slot* (a rank, a host, or a bin of several hosts; see ``Layout``).
Expansion hands the members of a class their options in name order, deals each option's
pieces to its tables round-robin (a table never gets two pieces in one slot beyond what
the slot can hold apart), and, where a slot is a bin wider than a piece, places pieces
on the bin's ranks largest first onto the least-loaded ranks with room (list scheduling,
within the packing slack the model left free). The planner checks the result exactly.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from gemc.cost_model.step_model import batched_floor_s

from .candidates import RegionClass, TableClass, TableOption
from .evaluate import Pricer, dense_bytes
from .problem import Assignment, Problem, TableChoice


@dataclass(frozen=True)
class Layout:
    """How the model sees the ranks: ``bin_size`` consecutive ranks per bin (1 = exact,
    else whole hosts), and for an option the slot its pieces are counted in."""

    world: int
    local: int
    bin_size: int

    @property
    def bins(self) -> int:
        return self.world // self.bin_size

    @property
    def hosts(self) -> int:
        return self.world // self.local

    def slot_size(self, o: TableOption) -> int:
        return max(o.width, self.bin_size)

    def slots(self, o: TableOption) -> int:
        return self.world // self.slot_size(o)

    def per_slot(self, o: TableOption) -> int:
        """Pieces of one table a slot can hold apart (distinct ranks / hosts)."""
        return min(o.pieces, self.slot_size(o) // o.width)

    def weight(self, o: TableOption) -> int:
        """Ranks of one bin a piece covers when spread evenly over its slot."""
        return min(o.width, self.bin_size)

    def fluid(self, o: TableOption) -> bool:
        """True when the model only knows the piece's bin, not its ranks."""
        return self.slot_size(o) > o.width

    def bins_of_slot(self, o: TableOption, slot: int) -> range:
        per = self.slot_size(o) // self.bin_size
        return range(slot * per, (slot + 1) * per)


def choose_layout(problem: Problem, tables: list[TableClass]) -> Layout:
    """The finest bins whose placement variables stay within the settings' budget: every
    rank up to a few dozen ranks, whole hosts beyond, groups of hosts at thousands."""
    world, local = problem.world, problem.topology.gpus_per_host
    sizes = [1] + [d for d in range(local, world + 1, local) if world % d == 0 and d > 1]
    placeable = [o for tc in tables for o in tc.options if not o.uniform]
    for size in sizes:
        layout = Layout(world, local, size)
        if sum(layout.slots(o) for o in placeable) <= problem.settings.max_placement_vars:
            return layout
    return Layout(world, local, world)


@dataclass
class ModelSolution:
    dense: list[list[int]]                       # region class -> members per option
    counts: list[list[int]]                      # table class -> members per option
    slots: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # pieces per slot


def expand(problem: Problem, layout: Layout, regions: list[RegionClass],
           tables: list[TableClass], sol: ModelSolution, pricer: Pricer) -> Assignment:
    world = problem.world
    a = Assignment()
    for g, rc in enumerate(regions):
        k = 0
        for i, n in enumerate(sol.dense[g]):
            for name in rc.members[k:k + n]:
                a.dense[name] = rc.options[i].choice
            k += n
    pack = Packer(problem, pricer, dense_bytes(problem, pricer, a.dense))
    deferred: dict[int, list[tuple[str, TableOption]]] = {}
    for c, tc in enumerate(tables):
        k = 0
        for j, n in enumerate(sol.counts[c]):
            chosen, o = tc.members[k:k + n], tc.options[j]
            k += n
            if not n:
                continue
            if o.uniform:
                for fqn in chosen:
                    a.tables[fqn] = TableChoice(o.sharding, tuple(range(world)), o.grid)
                pack.add_uniform(o, n)
                continue
            pieces = [s for s, cnt in enumerate(sol.slots[(c, j)]) for _ in range(cnt)]
            for i, fqn in enumerate(chosen):
                mine = pieces[i::n]
                if layout.fluid(o):
                    for slot in mine:
                        deferred.setdefault(slot, []).append((fqn, o))
                    continue
                starts = [s * o.width for s in sorted(mine)]
                for start in starts:
                    pack.add(o, start)
                a.tables[fqn] = TableChoice(o.sharding, _ranks(starts, o.width), o.grid)
    # fluid bins: first the pieces that weigh most on the step; if memory then runs out
    # somewhere, again with the pieces that weigh most on memory first
    for by_memory in (False, True):
        trial = copy.deepcopy(pack)
        blocks = _pack(trial, layout, deferred, by_memory)
        if not trial.overflow:
            break
    for fqn, (o, starts) in blocks.items():
        a.tables[fqn] = TableChoice(o.sharding, _ranks(sorted(starts), o.width), o.grid)
    return a


def _pack(pack: Packer, layout: Layout, deferred: dict[int, list[tuple[str, TableOption]]],
          by_memory: bool) -> dict[str, tuple[TableOption, list[int]]]:
    blocks: dict[str, tuple[TableOption, list[int]]] = {}
    for b in sorted(deferred):
        if by_memory:
            items = sorted(deferred[b], key=lambda x: (-x[1].memory * x[1].width,
                                                        -pack.size(x[1]), x[0]))
        else:
            items = sorted(deferred[b], key=lambda x: (-pack.size(x[1]), -x[1].memory, x[0]))
        lo, hi = b * layout.bin_size, (b + 1) * layout.bin_size
        for fqn, o in items:
            starts = blocks.setdefault(fqn, (o, []))[1]
            start = pack.best(o, lo, hi, starts)
            pack.add(o, start)
            starts.append(start)
    return blocks


def _ranks(starts: list[int], width: int) -> tuple[int, ...]:
    return tuple(r for s in starts for r in range(s, s + width))


class Packer:
    """Per-rank loads while pieces are placed, and the best place for the next piece:
    the one that raises the predicted step least (slowest rank's embedding compute, its
    batched kernel's floor in as the step prices it (step_model.batched_floor_s), plus
    twice the all-to-all's busiest rank or host), then the least-loaded, among the places
    with memory room. Vectorised over candidate places (thousands of ranks)."""

    def __init__(self, problem: Problem, pricer: Pricer, base_bytes: float) -> None:
        self.world, self.local = problem.world, problem.topology.gpus_per_host
        a2a = pricer.a2a
        self.io, self.ho, self.hi = a2a.intra_out, a2a.host_out, a2a.host_in
        self.free = problem.cap_bytes - base_bytes   # per rank, for table shards
        self.comp = np.zeros(self.world)
        # each rank's batched kernel: its shards' lookup seconds and count, for the
        # kernel's floor (step_model.batched_floor_s), which ``comp`` leaves out
        self.kern = np.zeros(self.world)
        self.kshards = np.zeros(self.world, dtype=np.int64)
        self.out = np.zeros(self.world)
        self.mem = np.zeros(self.world)
        self.host = np.zeros(self.world // self.local)
        self.overflow = False   # a piece found no place with room
        # what ``best`` with a slack fills first among the places the step allows: the
        # emptiest in memory ("memory", the balance searches) or the rank sending least
        # in the pooled all-to-all ("sends", ``local_search.spread_sends``)
        self.fill = "memory"
        self._places: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def size(self, o: TableOption) -> float:
        """A piece's own weight in the step: what it adds on an empty place."""
        return o.compute_s + 2 * o.out_bytes * max(self.io, min(o.width, self.local) * self.ho)

    def add_uniform(self, o: TableOption, n: int) -> None:
        self.free -= n * o.memory

    def add(self, o: TableOption, start: int, sign: int = 1) -> None:
        """Put a piece at ``start`` (sign -1: take it away again)."""
        if o.width == 1:  # one rank: scalar updates (the same sums, no slice's overhead)
            self.comp[start] += sign * o.compute_s
            self.kern[start] += sign * o.kernel_s
            self.kshards[start] += sign * int(o.in_kernel)
            self.out[start] += sign * o.out_bytes
            self.mem[start] += sign * o.memory
            self.host[start // self.local] += sign * o.out_bytes
            return
        sl = slice(start, start + o.width)
        self.comp[sl] += sign * o.compute_s
        self.kern[sl] += sign * o.kernel_s
        self.kshards[sl] += sign * int(o.in_kernel)
        self.out[sl] += sign * o.out_bytes
        self.mem[sl] += sign * o.memory
        for h in range(start // self.local, (start + o.width - 1) // self.local + 1):
            self.host[h] += sign * min(o.width, self.local) * o.out_bytes

    def _window_max(self, a: np.ndarray, lo: int, hi: int, w: int) -> np.ndarray:
        """Each candidate place's largest value (a piece spans ``w`` ranks)."""
        return a[lo:hi] if w == 1 else a[lo:hi].reshape(-1, w).max(axis=1)

    def best(self, o: TableOption, lo: int, hi: int, used: tuple[int, ...] | list[int],
             slack: float | None = None) -> int:
        """The start of the best place for a piece. With ``slack`` (seconds the step may
        still rise), the emptiest place among those rising at most that much (in memory,
        or in pooled bytes sent: ``fill``)."""
        w, local = o.width, self.local
        places = self._places.get((lo, hi, w))
        if places is None:  # the candidate starts and their hosts, made once per window
            starts = np.arange(lo, hi, w)
            places = self._places[(lo, hi, w)] = (starts, starts // local)
        starts, hosts = places
        # the ranks' embedding seconds as the step prices them (the kernel floor in), now
        # and with the piece added (a piece outside the batched kernel leaves the floor as
        # it is: the same arrays, not computed twice)
        floor_now = batched_floor_s(self.kern, self.kshards, self.world)
        floored = self.comp + floor_now
        if o.in_kernel or o.kernel_s:
            floor_new = batched_floor_s(self.kern + o.kernel_s, self.kshards + int(o.in_kernel),
                                        self.world)
        else:
            floor_new = floor_now
        comp = self._window_max(self.comp + o.compute_s + floor_new, lo, hi, w)
        out = self._window_max(self.out, lo, hi, w) + o.out_bytes
        mem = self._window_max(self.mem, lo, hi, w) + o.memory
        add = min(w, local) * o.out_bytes
        if w <= local:
            host = self.host[hosts] + add
        else:
            host = self.host[lo // local:hi // local].reshape(-1, w // local).max(axis=1) + add
        s_cur = float(floored.max())
        host_sum = float(self.host.sum())
        m1 = float(self.host.min())
        a_cur = max(float(self.out.max()) * self.io, float(self.host.max()) * self.ho,
                    (host_sum - m1) * self.hi)
        total = host_sum + w * o.out_bytes
        a_new = np.maximum(out * self.io, host * self.ho)
        np.maximum(a_new, max((total - m1) * self.hi, a_cur), out=a_new)
        rise = (np.maximum(comp, s_cur) - s_cur) + 2 * (a_new - a_cur)
        bad = mem > self.free
        taken = None
        if used:  # pieces of this table already placed: distinct places
            taken = np.zeros(len(starts), dtype=bool)
            for u in used:
                if lo <= u < hi and (u - lo) % w == 0:
                    taken[(u - lo) // w] = True
            bad |= taken
        if bad.all():  # no room anywhere: the least-full place; the planner refuses the plan
            self.overflow = True
            bad = taken if taken is not None else np.zeros(len(starts), dtype=bool)
            rise, balance = mem, mem
        else:
            if slack is not None:
                over = rise > slack
                if not (over | bad).all():
                    fill = mem if self.fill == "memory" else out
                    return int(starts[np.lexsort((starts, rise, fill, over, bad))[0]])
            balance = comp + 2 * (host * self.ho + out * self.io)
        order = np.lexsort((starts, balance, rise, bad))
        return int(starts[order[0]])
