"""Shared emitters: a small code builder and the tile body every generated kernel contains.

A tile is ``[rows, cols]`` of the group's ``[M, N]`` iteration space (rows flatten the
leading dims). :class:`Tile` emits, for one tile:

* operand loads at any strides: a slot (or an output's gradient) is addressed through its
  consumer's leading dims, decomposed from the row index, times the operand's runtime
  strides (stride-0 dims of a broadcast operand are skipped at generation time). A
  ``<name>_FLAT`` constexpr picks the one-multiply row address when the host finds the
  operand's leading dims collapsible, so contiguous operands pay no div/mod;
* the forward values of the group's ops (``v<k>``), LayerNorm included (a whole row is in
  the tile);
* the reverse sweep: adjoints ``a<tag><idx>`` of every value and slot, from the output
  gradients back, by the rules in :mod:`.ops`;
* stores of outputs and of slot gradients (see :func:`.spec.grad_mode`).

Kernels differ only in how they walk tiles (grid, loops) and in their root op (GEMM
accumulator, reduction), which :mod:`.kernels` writes around these pieces.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import ops as oprules
from .spec import grad_mode, kernel_classes, lead_rank, reduced_value


class Code:
    """Indented source lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, text: str) -> None:
        for line in text.splitlines():
            self.lines.append(("    " * self.depth + line) if line else "")

    @contextmanager
    def block(self, header: str) -> Iterator[None]:
        """An indented block under ``header``; ``pass`` if nothing was written into it."""
        if header:
            self(header)
        start = len(self.lines)
        self.depth += 1
        try:
            yield
        finally:
            if len(self.lines) == start:
                self("pass")
            self.depth -= 1

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# ---- parameter names (the host passes these by keyword) ------------------------------------


def strided_params(prefix: str, lead: int) -> list[str]:
    """Pointer, flat row stride, column stride, one stride per leading dim, FLAT flag."""
    return [prefix, f"{prefix}_sm", f"{prefix}_sn", *[f"{prefix}_l{d}" for d in range(lead)],
            f"{prefix}_FLAT: tl.constexpr"]


def class_params(q: int, lead: int) -> list[str]:
    """Sizes of a shape class's leading dims but the outermost (which the row index bounds)."""
    return [f"c{q}_d{d}" for d in range(1, lead)]


def slot_params(structure: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for j, slot in enumerate(structure["slots"]):
        out += strided_params(f"s{j}", lead_rank(slot))
    return out


def grad_params(structure: dict[str, Any]) -> list[str]:
    """Gradients of the outputs (any strides: autograd hands over expanded views). A
    reduction's gradient comes expanded to the reduced argument's shape."""
    out: list[str] = []
    red = reduced_value(structure)
    for j, k in enumerate(structure["outputs"]):
        q = structure["classes"][structure["ops"][k]["args"][0][1] if k == red else k]
        out += strided_params(f"g{j}", structure["ranks"][q] - 1)
    return out


def slot_grad_params(structure: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for j in range(len(structure["slots"])):
        out += [f"d{j}", f"NEED{j}: tl.constexpr"]
    return out


def classes_params(structure: dict[str, Any], *, backward: bool) -> list[str]:
    out: list[str] = []
    for q in kernel_classes(structure, backward=backward):
        out += class_params(q, structure["ranks"][q] - 1)
    return out


# ---- the tile body --------------------------------------------------------------------------


class _LazyArgs:
    """An op's argument expressions, each emitted (a slot: loaded) when first indexed."""

    def __init__(self, tile: Tile, refs: list[Any]) -> None:
        self.tile, self.refs = tile, refs

    def __getitem__(self, i: int) -> str:
        return self.tile.ref(self.refs[i])

    def __len__(self) -> int:
        return len(self.refs)


class Tile:
    """Emits loads, forward values, reverse sweep and stores for one tile.

    ``rows``/``cols`` name int64 vectors of the tile's row and column indices, ``rmask``/
    ``cmask`` their validity and ``mask`` the 2-D validity; ``shape`` is the tile's
    ``[R, C]`` block shape as source text.

    ``tile_loads``: load an operand broadcast along every leading dim (a bias, a LayerNorm
    weight) through a pointer broadcast to the tile's shape, so it arrives in the tile's
    own layout. Why: loaded as ``[1, C]``, Triton spreads it over all threads and converts
    it to the tile's layout through shared memory, behind barriers; in a loop over row
    blocks (Triton hoists neither the load nor the conversion) that left 4 barriers a block
    in the pointwise backward and 14 in the LayerNorm one at 4 warps (the conversion dragged
    whole tiles with it), 0 and 2 this way (sm_90 PTX at the h200 sizes). The repeated loads
    hit L1; the operand holds no registers across the loop, as a hoisted one would (the
    LayerNorm backward went to 104 registers a thread hoisting its weight and bias, 93
    this way).
    """

    def __init__(self, code: Code, structure: dict[str, Any], *, rows: str = "rows",
                 cols: str = "cols", rmask: str = "rmask", cmask: str = "cmask",
                 mask: str = "mask", shape: str = "[BLOCK_M, BLOCK_N]", kind: str = "",
                 tile_loads: bool = False) -> None:
        self.code = code
        self.st = structure
        self.rows, self.cols, self.rmask, self.cmask, self.mask = rows, cols, rmask, cmask, mask
        self.shape = shape
        self.kind = kind or structure["kind"]
        self.tile_loads = tile_loads
        self.values: dict[int, str] = {}
        self.slots: dict[int, str] = {}
        self.decomposed: set[int] = set()
        self.ntmp = 0
        self.copies: dict[tuple[str, int], str] = {}
        """After :meth:`reverse`: adjoints that are a plain copy of another variable (a
        slot of ``x + r`` gets ``av<k>`` itself); slots copying the same one have the same
        gradient."""

    # -- addressing ---------------------------------------------------------------------------

    def decompose(self, q: int) -> None:
        """``c<q>_i<d>``: the leading-dim indices of each row, for shape class q."""
        if q in self.decomposed:
            return
        self.decomposed.add(q)
        lead = self.st["ranks"][q] - 1
        self.code(f"rem = {self.rows}")
        for d in range(lead - 1, 0, -1):
            self.code(f"c{q}_i{d} = rem % c{q}_d{d}")
            self.code(f"rem = rem // c{q}_d{d}")
        if lead >= 1:
            self.code(f"c{q}_i0 = rem")

    def strided_load(self, prefix: str, q: int, bcast: list[bool], var: str) -> str:
        """Load operand ``prefix`` (consumer shape class q, broadcast flags) as fp32."""
        lead = len(bcast) - 1
        parts: list[str] = []
        masks: list[str] = []
        if lead > 0 and not all(bcast[:-1]):
            self.decompose(q)
            terms = [f"c{q}_i{d} * {prefix}_l{d}" for d in range(lead) if not bcast[d]]
            with self.code.block(f"if {prefix}_FLAT:"):
                self.code(f"{prefix}_r = {self.rows} * {prefix}_sm")
            with self.code.block("else:"):
                self.code(f"{prefix}_r = {' + '.join(terms)}")
            parts.append(f"{prefix}_r[:, None]")
            masks.append(f"{self.rmask}[:, None]")
        if not bcast[-1]:
            parts.append(f"{self.cols}[None, :] * {prefix}_sn")
            masks.append(f"{self.cmask}[None, :]")
        if self.tile_loads and len(parts) == 1 and not bcast[-1]:
            self.code(f"{var} = tl.load(tl.broadcast_to({prefix} + {parts[0]}, {self.shape}), "
                      f"mask={self.mask}, other=0).to(tl.float32)")
        elif not parts:
            self.code(f"{var} = tl.load({prefix}).to(tl.float32)")
        else:
            self.code(f"{var} = tl.load({prefix} + {' + '.join(parts)}, "
                      f"mask={' & '.join(masks)}, other=0).to(tl.float32)")
        return var

    def slot(self, j: int) -> str:
        if j not in self.slots:
            slot = self.st["slots"][j]
            q = self.st["classes"][slot["consumer"]]
            self.slots[j] = self.strided_load(f"s{j}", q, slot["bcast"], f"x{j}")
        return self.slots[j]

    def reload_output(self, j: int) -> None:
        """Read output ``j``'s value from the stored output (``y<j>``) instead of
        recomputing it: a backward that needs ``h = x + r`` reads ``h`` once, not ``x``
        and ``r`` (see :func:`.kernels.reloaded_outputs`)."""
        k = self.st["outputs"][j]
        q = self.st["classes"][k]
        self.values[k] = self.strided_load(f"y{j}", q, [False] * self.st["ranks"][q], f"v{k}")

    def output_grad(self, j: int) -> str:
        k = self.st["outputs"][j]
        q = self.st["classes"][k]
        return self.strided_load(f"g{j}", q, [False] * self.st["ranks"][q], f"gy{j}")

    def ref(self, ref: list[Any] | None) -> str:
        if ref is None:
            raise ValueError("an absent argument has no expression")
        tag, idx = ref
        if tag == "v":
            return self.values[idx]
        if tag == "s":
            return self.slot(idx)
        if tag == "c":
            return oprules.lit(idx)
        raise ValueError(f"reference {ref!r} cannot be read inside a tile")

    def tmp(self, expr: str) -> str:
        self.ntmp += 1
        name = f"t{self.ntmp}"
        self.code(f"{name} = {expr}")
        return name

    # -- forward ------------------------------------------------------------------------------

    def forward(self, upto: int | None = None) -> None:
        """Emit ``v<k>`` for every op not already given (roots are given by the kernel)."""
        for k, op in enumerate(self.st["ops"]):
            if upto is not None and k >= upto:
                break
            if k in self.values:
                continue
            name = op["op"]
            if name == "layer_norm":
                self._layer_norm(k, op)
            elif name in ("linear", "sum", "mean"):
                raise ValueError(f"root op {name} must be provided by the kernel emitter")
            else:
                args = [self.ref(r) for r in op["args"]]
                self.code(f"v{k} = {oprules.forward(name, args, op.get('attrs', {}))}")
                self.values[k] = f"v{k}"

    def _layer_norm(self, k: int, op: dict[str, Any]) -> None:
        x_ref, w_ref, b_ref = op["args"]
        x = self.ref(x_ref)
        eps = oprules.lit(op["attrs"]["eps"])
        self.code(f"mean{k} = tl.sum(tl.where({self.mask}, {x}, 0.0), 1) / N")
        self.code(f"xc{k} = tl.where({self.mask}, {x} - mean{k}[:, None], 0.0)")
        self.code(f"rstd{k} = tl.rsqrt(tl.sum(xc{k} * xc{k}, 1) / N + {eps})")
        self.code(f"xhat{k} = xc{k} * rstd{k}[:, None]")
        expr = f"xhat{k}"
        if w_ref is not None:
            expr = f"{expr} * {self.ref(w_ref)}"
        if b_ref is not None:
            expr = f"{expr} + {self.ref(b_ref)}"
        self.code(f"v{k} = {expr}")
        self.values[k] = f"v{k}"

    # -- reverse ------------------------------------------------------------------------------

    def reverse(self, seeds: dict[int, str]) -> dict[tuple[str, int], str]:
        """Adjoints of every value and slot reached from the seeded values' gradients."""
        adj: dict[tuple[str, int], str] = {}
        self.copies = {}

        def acc(ref: list[Any] | None, expr: str) -> None:
            if ref is None or ref[0] in ("c", "i"):
                return
            key = (ref[0], int(ref[1]))
            name = f"a{key[0]}{key[1]}"
            if key in adj:
                self.code(f"{name} = {name} + ({expr})")
                self.copies.pop(key, None)
            else:
                self.code(f"{name} = {expr}")
                adj[key] = name
                if expr.isidentifier():
                    self.copies[key] = expr

        for k, g in seeds.items():
            acc(["v", k], g)
        for k in range(len(self.st["ops"]) - 1, -1, -1):
            if ("v", k) not in adj:
                continue
            op = self.st["ops"][k]
            name = op["op"]
            g = adj[("v", k)]
            if name in ("linear", "sum", "mean"):
                continue  # the kernel emitter takes the root's adjoint from here
            if name == "layer_norm":
                self._layer_norm_reverse(k, op, g, acc)
                continue
            args = _LazyArgs(self, op["args"])
            for i, expr in oprules.backward(name, args, self.values[k], g,
                                            op.get("attrs", {}), self.tmp):
                acc(op["args"][i], expr)
        return adj

    def _layer_norm_reverse(self, k: int, op: dict[str, Any], g: str, acc: Any) -> None:
        x_ref, w_ref, b_ref = op["args"]
        dyw = f"{g} * {self.ref(w_ref)}" if w_ref is not None else g
        self.code(f"dxh{k} = tl.where({self.mask}, {dyw}, 0.0)")
        self.code(f"c1_{k} = tl.sum(dxh{k} * xhat{k}, 1) / N")
        self.code(f"c2_{k} = tl.sum(dxh{k}, 1) / N")
        acc(x_ref, f"(dxh{k} - xhat{k} * c1_{k}[:, None] - c2_{k}[:, None]) * rstd{k}[:, None]")
        if w_ref is not None:
            acc(w_ref, f"{g} * xhat{k}")
        if b_ref is not None:
            acc(b_ref, g)

    # -- stores -------------------------------------------------------------------------------

    def full(self, expr: str) -> str:
        return f"tl.broadcast_to({expr}, {self.shape})"

    def store_rows(self, ptr: str, expr: str) -> None:
        """Store a full tile into a contiguous ``[M, N]`` tensor."""
        self.code(f"tl.store({ptr} + {self.rows}[:, None] * N + "
                  f"{self.cols}[None, :], {self.full(expr)}.to({ptr}.dtype.element_ty), "
                  f"mask={self.mask})")

    def store_outputs(self, names: list[str] | None = None) -> None:
        for j, k in enumerate(self.st["outputs"]):
            self.store_rows(names[j] if names else f"o{j}", self.values[k])

    def col_slots(self) -> list[int]:
        """Slots whose gradient is a per-column sum (``col`` mode)."""
        return [j for j, slot in enumerate(self.st["slots"])
                if grad_mode(self.kind, slot["bcast"]) == "col"]

    def store_slot_grads(self, adj: dict[tuple[str, int], str], pid_rows: str | None,
                         pid_cols: str = "0") -> None:
        """``d<j>`` for every slot reached, by its gradient mode (``pid_rows``: the partial
        row of a ``col`` slot, ``pid_cols``: the partial column of a ``row`` slot). With
        ``pid_rows=None`` a ``col`` slot's masked tile is added to the tile-shaped
        ``cacc<j>`` instead (a program looping over row blocks reduces and stores it once,
        :meth:`store_col_sums`)."""
        for j, slot in enumerate(self.st["slots"]):
            a = adj.get(("s", j))
            if a is None:
                continue
            mode = grad_mode(self.kind, slot["bcast"])
            with self.code.block(f"if NEED{j}:"):
                if mode == "col" and pid_rows is None:
                    self.code(f"cacc{j} += tl.where({self.mask}, {a}, 0.0)")
                elif mode == "col":
                    self.code(f"tl.store(d{j} + {pid_rows} * N + {self.cols}, "
                              f"tl.sum(tl.where({self.mask}, {a}, 0.0), 0), mask={self.cmask})")
                elif mode == "row":
                    self.code(f"tl.store(d{j} + {pid_cols} * M + {self.rows}, "
                              f"tl.sum(tl.where({self.mask}, {a}, 0.0), 1), mask={self.rmask})")
                else:
                    self.store_rows(f"d{j}", a)

    def store_col_sums(self, pid_rows: str) -> None:
        """After a row loop: each ``col`` slot's accumulated tile, summed over its rows (the
        one cross-warp reduction of the program), as one partial row."""
        for j in self.col_slots():
            with self.code.block(f"if NEED{j}:"):
                self.code(f"tl.store(d{j} + {pid_rows} * N + {self.cols}, "
                          f"tl.sum(cacc{j}, 0), mask={self.cmask})")

    def reached_slots(self, adj: dict[tuple[str, int], str]) -> list[int]:
        return sorted(idx for tag, idx in adj if tag == "s")
