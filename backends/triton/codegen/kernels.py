"""Kernel emitters: the forward and backward Triton source of each group kind.

Each emitter writes whole ``@triton.jit`` functions around the shared :class:`.emit.Tile`
body; what differs between kinds is the walk over tiles:

``pointwise``  a 2-D grid of ``[BLOCK_M, BLOCK_N]`` tiles, forward and backward alike.
``norm``       one program owns ``BLOCK_M`` whole rows (``BLOCK_N >= N``), so the row
               statistics stay in registers; the backward also emits per-program column sums
               for the affine weight and bias.
``reduction``  a sum/mean over dim -2 (``[A, R, N] -> [A, N]``): one program per
               ``(a, column block)`` loops over R; the backward is a pointwise pass that
               reads the reduced gradient broadcast over R.
``gemm_epilogue``
               ``x @ w.T (+ b)`` with the epilogue applied to the fp32 accumulator before the
               one store (forward); the backward is two GEMMs whose *input* is the epilogue's
               derivative, recomputed per tile from the output gradients and the saved
               pre-epilogue value ``z`` (prologue fusion): dgrad ``dx = dz @ w`` (which also
               stores the epilogue operands' gradients, once per row block) and a split-M
               wgrad ``dw = dz.T @ x`` with the bias gradient ``sum(dz)`` on the side. ``dz``
               itself never reaches memory.

Autotuning spaces are short lists written for Hopper (bf16); under the interpreter each
kernel gets one small config (see ``runtime.autotune_configs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import ops as oprules
from .emit import (
    Code,
    Tile,
    classes_params,
    grad_params,
    slot_grad_params,
    slot_params,
    strided_params,
)
from .spec import canonical, grad_mode, validate


def _signature(code: Code, name: str, params: list[str]) -> None:
    code("@triton.jit")
    code(f"def {name}(")
    for i in range(0, len(params), 6):
        code("    " + ", ".join(params[i : i + 6]) + ",")
    code("):")


def _configs(code: Code, name: str, gpu: list[str], interp: str) -> None:
    code(f"{name} = autotune_configs(")
    code("    [")
    for cfg in gpu:
        code(f"        {cfg},")
    code("    ],")
    code(f"    {interp},")
    code(")")


def _tile_prologue(code: Code, rows: str, cols: str) -> None:
    # int64 indices: no overflow on large tensors, and the interpreter's int32 overflow
    # checks (milliseconds per op) are skipped
    code(f"rows = ({rows}).to(tl.int64)")
    code(f"cols = ({cols}).to(tl.int64)")
    code("rmask = rows < M")
    code("cmask = cols < N")
    code("mask = rmask[:, None] & cmask[None, :]")


def reached_slots(structure: dict[str, Any]) -> list[int]:
    """Slots a gradient reaches from the outputs (differentiable path), statically."""
    ops = structure["ops"]
    live = set(structure["outputs"])
    reached: set[int] = set()
    for k in range(len(ops) - 1, -1, -1):
        if k not in live:
            continue
        op = ops[k]
        name = op["op"]
        for i, ref in enumerate(op["args"]):
            if ref is None or (name == "where" and i == 0):
                continue
            if name == "linear":
                continue
            tag, idx = ref
            if tag == "v":
                live.add(idx)
            elif tag == "s":
                reached.add(idx)
    return sorted(reached)


def saves_z(structure: dict[str, Any]) -> bool:
    """A GEMM epilogue needs ``z`` in the backward unless it is affine in ``z`` (adds,
    casts, scales by constants): then no derivative reads a forward value."""
    for op in structure["ops"][1:]:
        name = op["op"]
        args = op["args"]
        if name in oprules.AFFINE:
            continue
        if name == "mul" and sum(r[0] == "v" for r in args) == 1 and \
                all(r[0] in ("v", "c") for r in args):
            continue
        if name == "div" and args[0][0] == "v" and args[1][0] == "c":
            continue
        return True
    return False


def _row_loop(code: Code, st: dict[str, Any], cols: str,
              body: Callable[[Tile], dict[tuple[str, int], str]], pid_cols: str) -> None:
    """A backward pass that walks ``ITERS`` consecutive row blocks per program.

    Why a loop: the tile stays small (the backward keeps the forward's values, the
    adjoints and the operands live: ~1024 elements a tile keep it near 64 registers a
    thread, where a 4096-element tile needs 220 and starves the SM of warps), while the
    column sums of per-column operands accumulate in registers and reach memory once per
    program, not once per tile. ``body`` emits the loads, forward and reverse sweep of one
    tile and returns the adjoints. Per-column operands are loaded in the tile's layout
    (``Tile(tile_loads=True)``: no shared-memory conversion per row block).

    The column sums accumulate tile-shaped (``cacc<j>`` is ``[BLOCK_M, BLOCK_N]``) and are
    reduced over rows once, after the loop: a per-iteration ``tl.sum(..., 0)`` crosses warps
    through shared memory behind a barrier, which serialises the loop. ``STAGES`` is the
    loop's software-pipelining depth: Triton pipelines loads that feed no ``tl.dot`` only in
    a loop that names its stages, so ``STAGES > 1`` prefetches the next row blocks' operands
    into shared memory while this one computes (1: no pipelining, plain loads)."""
    code(f"cols = ({cols}).to(tl.int64)")
    code("cmask = cols < N")
    probe = Tile(code, st)
    for j in probe.col_slots():
        code(f"cacc{j} = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
    with code.block("for it in tl.range(0, ITERS, num_stages=STAGES):"):
        code("rows = ((tl.program_id(0) * ITERS + it) * BLOCK_M"
             " + tl.arange(0, BLOCK_M)).to(tl.int64)")
        code("rmask = rows < M")
        code("mask = rmask[:, None] & cmask[None, :]")
        tile = Tile(code, st, tile_loads=True)
        adj = body(tile)
        tile.store_slot_grads(adj, None, pid_cols)
    probe.store_col_sums("tl.program_id(0)")


def _reverse_all(tile: Tile) -> dict[tuple[str, int], str]:
    tile.forward()
    seeds = {k: tile.output_grad(j) for j, k in enumerate(tile.st["outputs"])}
    return tile.reverse(seeds)


def _reverse_reloading(reloaded: list[int]) -> Callable[[Tile], dict[tuple[str, int], str]]:
    """The backward body of a kind that reads the outputs ``reloaded`` from memory."""
    def body(tile: Tile) -> dict[tuple[str, int], str]:
        for j in reloaded:
            tile.reload_output(j)
        return _reverse_all(tile)
    return body


RELOADING_KINDS = ("pointwise", "norm")
_NOT_RELOADED = ("layer_norm", "linear", "sum", "mean")  # their reverse needs their forward


def _probe(structure: dict[str, Any], reloaded: list[int]) -> Tile:
    """The backward tile of ``structure`` emitted into scratch code (what it loads)."""
    tile = Tile(Code(), structure)
    _reverse_reloading(reloaded)(tile)
    return tile


def _full_loads(structure: dict[str, Any], reloaded: list[int]) -> int:
    """Whole-tile operands the backward reads: unbroadcast slots and reloaded outputs."""
    tile = _probe(structure, reloaded)
    return len(reloaded) + sum(1 for j in tile.slots
                               if not any(structure["slots"][j]["bcast"]))


def reloaded_outputs(structure: dict[str, Any]) -> list[int]:
    """Outputs the backward reads back instead of recomputing, where that reads fewer
    whole tiles. Why: the residual + LayerNorm group ``h = x + r; y = LN(h) * m``
    recomputes ``h`` from ``x`` and ``r`` (two reads of an activation) where the stored
    ``h`` is one; the backward is bound by memory. Only outputs of the tile's own shape,
    and not values whose reverse needs their forward's intermediates (LayerNorm)."""
    if structure["kind"] not in RELOADING_KINDS:
        return []
    outputs = structure["outputs"]
    tile_class = structure["classes"][outputs[0]]
    chosen: list[int] = []
    for j, k in enumerate(outputs):
        if structure["ops"][k]["op"] in _NOT_RELOADED or structure["classes"][k] != tile_class:
            continue
        if _full_loads(structure, [*chosen, j]) < _full_loads(structure, chosen):
            chosen.append(j)
    return chosen


def grad_aliases(structure: dict[str, Any]) -> dict[int, int]:
    """``{j2: j1}``: unbroadcast slots whose gradient is, term for term, an earlier slot's
    (both operands of ``x + r`` get the sum's gradient). The host stores it once and hands
    the same tensor to both inputs when their shapes and dtypes agree, as eager's add
    does; otherwise the kernel stores both."""
    if structure["kind"] not in RELOADING_KINDS:
        return {}
    tile = _probe(structure, reloaded_outputs(structure))
    first: dict[str, int] = {}
    aliases: dict[int, int] = {}
    for j, slot in enumerate(structure["slots"]):
        src = tile.copies.get(("s", j))
        if src is None or any(slot["bcast"]):
            continue
        if src in first:
            aliases[j] = first[src]
        else:
            first[src] = j
    return aliases


def saved_output_params(structure: dict[str, Any]) -> list[str]:
    """Pointers and strides of the outputs the backward reads back (``y<j>``)."""
    out: list[str] = []
    for j in reloaded_outputs(structure):
        q = structure["classes"][structure["outputs"][j]]
        out += strided_params(f"y{j}", structure["ranks"][q] - 1)
    return out


def _looped_bwd(code: Code, st: dict[str, Any], configs: str, key: list[str],
                sizes: list[str], cols: str, pid_cols: str,
                body: Callable[[Tile], dict[tuple[str, int], str]] | None = None) -> None:
    """The ``bwd`` kernel of a kind whose backward is one :func:`_row_loop` pass; the host
    launches it through ``host._Impl.looped_backward`` (``BLOCK_M``, ``ITERS`` and
    ``STAGES`` are the host's: the first two lay out the partial sums)."""
    code("\n")
    code(f"@triton.autotune(configs={configs}, key={key!r})")
    _signature(code, "bwd", [*slot_params(st), *saved_output_params(st), *grad_params(st),
                             *slot_grad_params(st), *classes_params(st, backward=True), *sizes,
                             "ITERS",
                             "STAGES: tl.constexpr", "BLOCK_M: tl.constexpr",
                             "BLOCK_N: tl.constexpr"])
    with code.block(""):
        _row_loop(code, st, cols, body or _reverse_reloading(reloaded_outputs(st)), pid_cols)


_WARPS = ["triton.Config({}, num_warps=4)", "triton.Config({}, num_warps=8)",
          "triton.Config({}, num_warps=2)"]
"""Configs of kernels whose block shape the host fixes (partial sums are laid out by it)."""


def passes_gradient_through(structure: dict[str, Any]) -> bool:
    """A GEMM epilogue that only adds operands to ``z`` (``r + x @ w.T + b``): one output,
    each op an ``add`` (alpha 1) of the previous value and a slot. Then ``dz`` *is* the
    output's gradient, and so is every added operand's (summed to its shape): the library
    path's backward needs no elementwise kernel at all."""
    ops = structure["ops"]
    if structure["kind"] != "gemm_epilogue" or structure["outputs"] != [len(ops) - 1]:
        return False
    for k, op in enumerate(ops[1:], start=1):
        if op["op"] != "add" or float(op.get("attrs", {}).get("alpha", 1.0)) != 1.0:
            return False
        tags = sorted(tuple(r) if r is not None else ("?", -1) for r in op["args"])
        if len(tags) != 2 or tags[1] != ("v", k - 1) or tags[0][0] != "s":
            return False
    return len(ops) > 1


# ---- pointwise -------------------------------------------------------------------------------


def _pointwise(code: Code, st: dict[str, Any]) -> None:
    _configs(code, "_FWD_CONFIGS", [
        'triton.Config({"BLOCK_M": 8}, num_warps=4)',
        'triton.Config({"BLOCK_M": 16}, num_warps=4)',
        'triton.Config({"BLOCK_M": 32}, num_warps=8)',
        'triton.Config({"BLOCK_M": 4}, num_warps=4)',
    ], 'triton.Config({"BLOCK_M": 128}, num_warps=1)')
    _configs(code, "_BWD_CONFIGS", _WARPS, "triton.Config({}, num_warps=1)")
    outs = [f"o{j}" for j in range(len(st["outputs"]))]
    code("\n")
    code('@triton.autotune(configs=_FWD_CONFIGS, key=["M", "N"])')
    _signature(code, "fwd", [*slot_params(st), *outs, *classes_params(st, backward=False), "M",
                             "N", "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"])
    with code.block(""):
        _tile_prologue(code, "tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)",
                       "tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)")
        tile = Tile(code, st)
        tile.forward()
        tile.store_outputs()
    _looped_bwd(code, st, "_BWD_CONFIGS", ["M", "N"], ["M", "N"],
                "tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)", "tl.program_id(1)")


# ---- norm ------------------------------------------------------------------------------------


def _norm(code: Code, st: dict[str, Any]) -> None:
    _configs(code, "_CONFIGS", _WARPS, "triton.Config({}, num_warps=1)")
    outs = [f"o{j}" for j in range(len(st["outputs"]))]
    rows = "tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)"
    code("\n")
    code('@triton.autotune(configs=_CONFIGS, key=["M", "N"])')
    _signature(code, "fwd", [*slot_params(st), *outs, *classes_params(st, backward=False), "M",
                             "N", "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"])
    with code.block(""):
        _tile_prologue(code, rows, "tl.arange(0, BLOCK_N)")
        tile = Tile(code, st)
        tile.forward()
        tile.store_outputs()
    _looped_bwd(code, st, "_CONFIGS", ["M", "N"], ["M", "N"], "tl.arange(0, BLOCK_N)", "0")


# ---- reduction -------------------------------------------------------------------------------


def _reduction(code: Code, st: dict[str, Any]) -> None:
    red = len(st["ops"]) - 1
    arg = st["ops"][red]["args"][0][1]
    q_arg = st["classes"][arg]
    lead = st["ranks"][q_arg] - 1
    _configs(code, "_FWD_CONFIGS", [
        'triton.Config({"BLOCK_R": 16}, num_warps=4)',
        'triton.Config({"BLOCK_R": 32}, num_warps=4)',
        'triton.Config({"BLOCK_R": 64}, num_warps=8)',
        'triton.Config({"BLOCK_R": 8}, num_warps=2)',
    ], 'triton.Config({"BLOCK_R": 64}, num_warps=1)')
    _configs(code, "_BWD_CONFIGS", _WARPS, "triton.Config({}, num_warps=1)")
    outs = [f"o{j}" for j in range(len(st["outputs"]))]
    side = [j for j, k in enumerate(st["outputs"]) if k != red]
    main = st["outputs"].index(red)
    code("\n")
    code('@triton.autotune(configs=_FWD_CONFIGS, key=["M", "N", "R"])')
    _signature(code, "fwd", [*slot_params(st), *outs, *classes_params(st, backward=False), "R",
                             "M", "N", "BLOCK_R: tl.constexpr", "BLOCK_N: tl.constexpr"])
    with code.block(""):
        code("a = tl.program_id(0).to(tl.int64)")
        code("cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)")
        code("cmask = cols < N")
        # a tile-shaped accumulator, reduced once after the loop: a cross-thread sum per
        # iteration would serialize the loop on shared memory
        code("acc2 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)")
        with code.block("for r0 in range(0, R, BLOCK_R):"):
            code("r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)")
            code("rows = a * R + r")
            code("rmask = r < R")
            code("mask = rmask[:, None] & cmask[None, :]")
            tile = Tile(code, st, shape="[BLOCK_R, BLOCK_N]")
            tile.forward(upto=red)
            for j in side:
                tile.store_rows(f"o{j}", tile.values[st["outputs"][j]])
            code(f"acc2 += tl.where(mask, {tile.values[arg]}, 0.0)")
        code("acc = tl.sum(acc2, 0)")
        if st["ops"][red]["op"] == "mean":
            code("acc = acc / R")
        code(f"tl.store(o{main} + a * N + cols, acc.to(o{main}.dtype.element_ty), mask=cmask)")
    # backward: a pointwise pass over [A*R, N]; the reduced gradient g<main> comes expanded
    # over R (host), so it is addressed as an operand broadcast along dim -2.
    def body(tile: Tile) -> dict[tuple[str, int], str]:
        tile.forward(upto=red)
        seeds: dict[int, str] = {}
        for j, k in enumerate(st["outputs"]):
            if k == red:
                bcast = [False] * (lead - 1) + [True, False]
                g = tile.strided_load(f"g{j}", q_arg, bcast, f"gy{j}")
                if st["ops"][red]["op"] == "mean":
                    g = tile.tmp(f"{g} / R")
                seeds[arg] = g if arg not in seeds else tile.tmp(f"{seeds[arg]} + {g}")
            else:
                g = tile.output_grad(j)
                seeds[k] = g if k not in seeds else tile.tmp(f"{seeds[k]} + {g}")
        return tile.reverse(seeds)

    _looped_bwd(code, st, "_BWD_CONFIGS", ["M", "N", "R"], ["R", "M", "N"],
                "tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)", "tl.program_id(1)", body)


# ---- GEMM + epilogue -------------------------------------------------------------------------


def _dot(acc: str, a: str, b: str) -> str:
    """``acc += a @ b`` in fp32. IEEE products for fp32 inputs; under the interpreter always
    fp32 (its bf16 dot is wrong, see ``runtime.mma``; exact in fp32). Written inline, not as
    a call of ``runtime.mma``: the interpreter pays milliseconds per nested jit call."""
    return (f"if IEEE or INTERP:\n"
            f"    {acc} += tl.dot(({a}).to(tl.float32), ({b}).to(tl.float32), "
            f"input_precision=\"ieee\")\n"
            f"else:\n"
            f"    {acc} += tl.dot({a}, {b})")


def _gemm(code: Code, st: dict[str, Any]) -> None:
    lin = st["ops"][0]
    has_bias = lin["args"][2] is not None
    save_z = saves_z(st)
    z_out = 0 in st["outputs"]
    outs = [f"o{j}" for j in range(len(st["outputs"]))]
    zsave = [] if (not save_z or z_out) else ["zs"]
    _configs(code, "_FWD_CONFIGS", [
        'triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, '
        'num_stages=3)',
        'triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, '
        'num_stages=4)',
        'triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, '
        'num_stages=4)',
        'triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, '
        'num_stages=3)',
        'triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, '
        'num_stages=4)',
    ], 'triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=1)')
    _configs(code, "_DGRAD_CONFIGS", [
        'triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=8, '
        'num_stages=3)',
        'triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, '
        'num_stages=3)',
        'triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, '
        'num_stages=4)',
        'triton.Config({"BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_K": 256}, num_warps=8, '
        'num_stages=3)',
    ], 'triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=1)')
    _configs(code, "_WGRAD_CONFIGS", [
        'triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, '
        'num_stages=3)',
        'triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, '
        'num_stages=3)',
        'triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, '
        'num_stages=4)',
        'triton.Config({"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, '
        'num_stages=4)',
    ], 'triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=1)')
    blocks = ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr"]

    # forward
    code("\n")
    code('@triton.autotune(configs=_FWD_CONFIGS, key=["M", "N", "K"])')
    _signature(code, "fwd", ["x", "w", "b", *slot_params(st), *outs, *zsave,
                             *classes_params(st, backward=False), "M", "N", "K", "sxm", "sxk",
                             "swn", "swk", "IEEE: tl.constexpr", "INTERP: tl.constexpr", *blocks,
                             "GROUP_M: tl.constexpr"])
    with code.block(""):
        code("pid = tl.program_id(0)")
        code("num_m = tl.cdiv(M, BLOCK_M)")
        code("num_n = tl.cdiv(N, BLOCK_N)")
        code("per_group = GROUP_M * num_n")
        code("first_m = (pid // per_group) * GROUP_M")
        code("group_rows = tl.minimum(num_m - first_m, GROUP_M)")
        code("pid_m = first_m + (pid % per_group) % group_rows")
        code("pid_n = (pid % per_group) // group_rows")
        _tile_prologue(code, "pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
                       "pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
        code("ks = tl.arange(0, BLOCK_K).to(tl.int64)")
        code("xp = x + rows[:, None] * sxm + ks[None, :] * sxk")
        code("wp = w + cols[None, :] * swn + ks[:, None] * swk")
        code("acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
        with code.block("for k0 in range(0, K, BLOCK_K):"):
            code("kmask = ks < K - k0")
            code("xt = tl.load(xp, mask=rmask[:, None] & kmask[None, :], other=0.0)")
            code("wt = tl.load(wp, mask=cmask[None, :] & kmask[:, None], other=0.0)")
            code(_dot("acc", "xt", "wt"))
            code("xp += BLOCK_K * sxk")
            code("wp += BLOCK_K * swk")
        if has_bias:
            code("acc += tl.load(b + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]")
        tile = Tile(code, st)
        tile.values[0] = "acc"
        tile.forward()
        tile.store_outputs()
        if zsave:
            tile.store_rows("zs", "acc")

    def z_tile(tile: Tile) -> None:
        if save_z:
            zptr = f"o{st['outputs'].index(0)}" if z_out else "zs"
            code(f"z = tl.load({zptr} + rows[:, None] * N + cols[None, :], "
                 "mask=mask, other=0.0).to(tl.float32)")
            tile.values[0] = "z"
        else:
            tile.values[0] = "0.0"  # affine epilogue: no derivative reads z

    zparam = ([f"o{st['outputs'].index(0)}"] if z_out else ["zs"]) if save_z else []

    # dgrad (+ the epilogue operands' gradients)
    code("\n")
    code('@triton.autotune(configs=_DGRAD_CONFIGS, key=["M", "N", "K"])')
    _signature(code, "dgrad", ["w", *zparam, *slot_params(st), *grad_params(st),
                               *slot_grad_params(st), "dx", *classes_params(st, backward=True),
                               "M", "N", "K", "swn", "swk", "COMPUTE_DX: tl.constexpr",
                               "IEEE: tl.constexpr", "INTERP: tl.constexpr", *blocks])
    with code.block(""):
        code("pid_m = tl.program_id(0)")
        code("pid_k = tl.program_id(1)")
        code("ks = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)")
        code("kmask = ks < K")
        code("ns = tl.arange(0, BLOCK_N).to(tl.int64)")
        code("wp = w + ns[:, None] * swn + ks[None, :] * swk")
        code("acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)")
        with code.block("for n0 in range(0, N, BLOCK_N):"):
            _tile_prologue(code, "pid_m * BLOCK_M + tl.arange(0, BLOCK_M)", "n0 + ns")
            tile = Tile(code, st)
            z_tile(tile)
            tile.forward()
            seeds = {k: tile.output_grad(j) for j, k in enumerate(st["outputs"])}
            adj = tile.reverse(seeds)
            code(f"dz = tl.where(mask, {adj[('v', 0)]}, 0.0)")
            with code.block("if pid_k == 0:"):
                tile.store_slot_grads(adj, "pid_m")
            with code.block("if COMPUTE_DX:"):
                code("wt = tl.load(wp, mask=cmask[:, None] & kmask[None, :], other=0.0)")
                code(_dot("acc", "dz.to(wt.dtype)", "wt"))
                code("wp += BLOCK_N * swn")
        with code.block("if COMPUTE_DX:"):
            code("rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)")
            code("tl.store(dx + rows[:, None] * K + ks[None, :], "
                 "acc.to(dx.dtype.element_ty), mask=(rows < M)[:, None] & kmask[None, :])")

    # the library-GEMM path (host.GemmPath.LIBRARY): cuBLAS computes z = x @ w.T + b; these
    # two kernels are the epilogue as a pass over z (forward) and the epilogue's derivative
    # dz, with the operands' gradients and per-program bias column sums (backward)
    _configs(code, "_EPI_CONFIGS", [
        'triton.Config({"BLOCK_M": 8}, num_warps=4)',
        'triton.Config({"BLOCK_M": 16}, num_warps=4)',
        'triton.Config({"BLOCK_M": 32}, num_warps=8)',
        'triton.Config({"BLOCK_M": 4}, num_warps=4)',
    ], 'triton.Config({"BLOCK_M": 128}, num_warps=1)')
    _configs(code, "_DZ_CONFIGS", _WARPS, "triton.Config({}, num_warps=1)")
    code("\n")
    code('@triton.autotune(configs=_EPI_CONFIGS, key=["M", "N"])')
    _signature(code, "epi", ["zin", *slot_params(st), *outs, *classes_params(st, backward=False),
                             "M", "N", "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"])
    with code.block(""):
        _tile_prologue(code, "tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)",
                       "tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)")
        code("z = tl.load(zin + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)"
             ".to(tl.float32)")
        tile = Tile(code, st)
        tile.values[0] = "z"
        tile.forward()
        tile.store_outputs()
    code("\n")
    code('@triton.autotune(configs=_DZ_CONFIGS, key=["M", "N"])')
    _signature(code, "dz", [*zparam, *slot_params(st), *grad_params(st), *slot_grad_params(st),
                            "dzo", "dbp", *classes_params(st, backward=True), "M", "N", "ITERS",
                            "HAS_DB: tl.constexpr", "STAGES: tl.constexpr",
                            "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"])

    def dz_body(tile: Tile) -> dict[tuple[str, int], str]:
        z_tile(tile)
        adj = _reverse_all(tile)
        code(f"dzv = tl.where(mask, {adj[('v', 0)]}, 0.0)")
        tile.store_rows("dzo", "dzv")
        with code.block("if HAS_DB:"):
            code("dbacc += dzv")
        return adj

    with code.block(""):
        # tile-shaped bias sums, reduced once after the loop (see _row_loop)
        code("dbacc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
        _row_loop(code, st, "tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)", dz_body,
                  "tl.program_id(1)")
        with code.block("if HAS_DB:"):
            code("tl.store(dbp + tl.program_id(0) * N + cols, tl.sum(dbacc, 0), mask=cmask)")

    # wgrad (+ bias gradient), split over M into fp32 partial sums
    code("\n")
    code('@triton.autotune(configs=_WGRAD_CONFIGS, key=["M", "N", "K"])')
    _signature(code, "wgrad", ["x", *zparam, *slot_params(st), *grad_params(st), "dw", "db",
                               *classes_params(st, backward=True), "M", "N", "K", "sxm", "sxk",
                               "ROWS_PER_SPLIT", "IEEE: tl.constexpr", "INTERP: tl.constexpr", *blocks])
    with code.block(""):
        code("pid_n = tl.program_id(0)")
        code("pid_k = tl.program_id(1)")
        code("split = tl.program_id(2)")
        code("cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)")
        code("cmask = cols < N")
        code("ks = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)")
        code("kmask = ks < K")
        code("ms = tl.arange(0, BLOCK_M).to(tl.int64)")
        code("acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)")
        if has_bias:
            code("accb = tl.zeros([BLOCK_N], dtype=tl.float32)")
        code("m_lo = split.to(tl.int64) * ROWS_PER_SPLIT")
        code("m_hi = tl.minimum(M, m_lo + ROWS_PER_SPLIT)")
        with code.block("for m0 in range(m_lo, m_hi, BLOCK_M):"):
            code("rows = m0 + ms")
            code("rmask = rows < m_hi")
            code("mask = rmask[:, None] & cmask[None, :]")
            tile = Tile(code, st)
            z_tile(tile)
            tile.forward()
            seeds = {k: tile.output_grad(j) for j, k in enumerate(st["outputs"])}
            adj = tile.reverse(seeds)
            code(f"dz = tl.where(mask, {adj[('v', 0)]}, 0.0)")
            code("xt = tl.load(x + rows[:, None] * sxm + ks[None, :] * sxk, "
                 "mask=rmask[:, None] & kmask[None, :], other=0.0)")
            code(_dot("acc", "tl.trans(dz.to(xt.dtype))", "xt"))
            if has_bias:
                code("accb += tl.sum(dz, 0)")
        code("base = split.to(tl.int64) * N * K")
        code("tl.store(dw + base + cols.to(tl.int64)[:, None] * K + ks[None, :], acc, "
             "mask=cmask[:, None] & kmask[None, :])")
        if has_bias:
            with code.block("if pid_k == 0:"):
                code("tl.store(db + split.to(tl.int64) * N + cols, accb, mask=cmask)")


_EMITTERS = {"pointwise": _pointwise, "norm": _norm, "reduction": _reduction,
             "gemm_epilogue": _gemm}


def generate(structure: dict[str, Any]) -> str:
    """The complete Python module (Triton kernels + metadata) of one group structure."""
    validate(structure)
    code = Code()
    kind = structure["kind"]
    code(f'"""gemc generated kernel: {kind} (forward and backward).')
    code("")
    code("Generated from STRUCTURE by gemc.backends.triton.codegen; do not edit. The host side")
    code("(launch, autograd) is gemc.backends.triton.codegen.host.")
    code('"""')
    code("")
    code("import triton")
    code("import triton.language as tl")
    code("")
    code("from gemc.backends.triton.runtime import autotune_configs")
    code("")
    code(f"STRUCTURE = {canonical(structure)!r}")
    code(f"KIND = {kind!r}")
    code(f"REACHED = {tuple(reached_slots(structure))!r}")
    code(f"GRAD_MODES = {tuple(grad_mode(kind, s['bcast']) for s in structure['slots'])!r}")
    code(f"RELOADED = {tuple(reloaded_outputs(structure))!r}")
    code(f"GRAD_ALIASES = {grad_aliases(structure)!r}")
    if kind == "gemm_epilogue":
        code(f"SAVE_Z = {saves_z(structure)!r}")
    code("")
    _EMITTERS[kind](code, structure)
    return code.text()
