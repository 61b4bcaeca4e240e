"""Host side of generated kernels: load a source, launch its kernels, wrap them for autograd.

A generated module holds only Triton kernels and metadata (``STRUCTURE``, ``REACHED``,
``GRAD_MODES``, ``SAVE_Z``). This module turns it, plus a group's ``binding`` (shapes and
output dtypes), into ``run(*inputs) -> tuple(outputs)`` whose backward is the generated
backward: :func:`make_runner`. Arguments are passed to kernels by keyword, under the names
:mod:`.emit` wrote into their signatures.

The backward of every kind saves the group's inputs (and a GEMM's pre-epilogue ``z`` when
its epilogue is not affine) and recomputes everything else in registers.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch

from ..runtime import INTERPRETED, cdiv, next_pow2
from .kernels import passes_gradient_through
from .spec import kernel_classes, reduced_value, sha256

_MODULES: dict[str, ModuleType] = {}
_D = TypeVar("_D", int, None)
WGRAD_PROGRAMS_PER_SM = 2  # the split-M wgrad's programs: two per SM keep every SM busy
PROGRAMS_PER_SM = 16  # a looping backward pass's row programs (ROW_PROGRAMS, below)
FALLBACK_SMS = 132  # an H200's, where no CUDA device is visible (launch shapes for reports)
WGRAD_PARTIAL_BYTES = 256 << 20  # cap of the split-M wgrad's fp32 partial sums


def cache_dir() -> Path:
    """Where sources are written to be imported (Triton reads a kernel's source file)."""
    env = os.environ.get("GEMC_KERNEL_CACHE")
    path = Path(env) if env else Path(tempfile.gettempdir()) / f"gemc-kernels-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_source(source: str) -> ModuleType:
    """Import a generated source (cached by its sha256); the same text imports once."""
    digest = sha256(source)
    if digest in _MODULES:
        return _MODULES[digest]
    name = f"gemc_kernel_{digest[:16]}"
    path = cache_dir() / f"{name}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _MODULES[digest] = module
    return module


# ---- argument building ------------------------------------------------------------------------


def _mn(shape: Sequence[int]) -> tuple[int, int]:
    n = int(shape[-1]) if len(shape) else 1
    lead = math.prod(int(s) for s in shape[:-1])
    return lead, n


def _flat(sizes: Sequence[int], strides: Sequence[int]) -> tuple[bool, int]:
    """Whether leading dims collapse into one row stride (ignoring size-1 dims), and it."""
    dims = [(s, st) for s, st in zip(sizes, strides) if s != 1]
    if not dims:
        return True, 0
    for (_, outer), (size, inner) in zip(dims, dims[1:]):
        if outer != inner * size:
            return False, 0
    return True, dims[-1][1]


def stride_args(prefix: str, t: torch.Tensor, shape: Sequence[int]) -> dict[str, Any]:
    """Strides and FLAT flag of ``t`` viewed (broadcast) at ``shape``. The pointer a kernel
    takes is ``t`` itself: a broadcast view shares its storage offset."""
    te = t.expand(*shape) if tuple(t.shape) != tuple(shape) else t
    strides = te.stride()
    flat, sm = _flat(shape[:-1], strides[:-1])
    args: dict[str, Any] = {f"{prefix}_sn": strides[-1], f"{prefix}_sm": sm,
                            f"{prefix}_FLAT": flat}
    for d in range(len(shape) - 1):
        args[f"{prefix}_l{d}"] = strides[d]
    return args


def _meta(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What a launch's integer arguments depend on: shape, strides, dtype."""
    return None if t is None else (t.shape, t.stride(), t.dtype)


MEMO_LIMIT = 256
"""Launch signatures one group remembers (a group sees one shape, or one per packed
length class); past it the memo starts over rather than grow without bound."""


class _Impl:
    """Shared state of one group's launcher: structure, binding, module.

    Why the memo: a group runs every step with the same shapes, and its Python (strides,
    flags, dtypes, class sizes: dicts rebuilt per launch) cost more host time than its
    kernels take on the GPU (``benchmarks/fusion.py``'s host column, 2026-12-03: ~1 ms a
    fwd+bwd call against 0.4-0.8 ms of kernels). Everything but the tensors themselves is a
    function of the inputs' shapes, strides and dtypes, computed once per signature.
    """

    def __init__(self, module: ModuleType, binding: dict[str, Any]) -> None:
        self.m = module
        self.st = json.loads(module.STRUCTURE)
        self.shapes = [tuple(int(s) for s in shape) for shape in binding["shapes"]]
        self.dtypes = [getattr(torch, d) for d in binding["dtypes"]]
        self.reached = set(module.REACHED)
        self.modes = list(module.GRAD_MODES)
        self.class_shape: dict[int, tuple[int, ...]] = {}
        for k, q in enumerate(self.st["classes"]):
            self.class_shape.setdefault(q, self.shapes[k])
        self.slot_inputs = [slot["input"] for slot in self.st["slots"]]
        # modules generated before these existed hold neither: nothing reloaded or aliased
        self.reloaded: list[int] = list(getattr(module, "RELOADED", ()))
        self.aliases: dict[int, int] = dict(getattr(module, "GRAD_ALIASES", {}))
        self._memo: dict[tuple[Any, ...], Any] = {}
        self._zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def memo(self, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key`` (a launch signature)."""
        value = self._memo.get(key)
        if value is None:
            if len(self._memo) >= MEMO_LIMIT:
                self._memo.clear()
            value = self._memo[key] = build()
        return value

    def consumer_shape(self, j: int) -> tuple[int, ...]:
        return self.shapes[self.st["slots"][j]["consumer"]]

    def strided_args(self, tag: str,
                     operands: Sequence[tuple[str, torch.Tensor, Sequence[int]]]
                     ) -> dict[str, Any]:
        """Each ``(prefix, tensor, shape)``'s pointer and its strides at ``shape``, the
        strides memoised per signature of the tensors."""
        key = (tag, *(_meta(t) for _, t, _ in operands))
        args = dict(self.memo(key, lambda: {
            k: v for prefix, t, shape in operands
            for k, v in stride_args(prefix, t, shape).items()}))
        for prefix, t, _ in operands:
            args[prefix] = t
        return args

    def slot_args(self, inputs: Sequence[torch.Tensor]) -> dict[str, Any]:
        return self.strided_args("slots", [(f"s{j}", inputs[i], self.consumer_shape(j))
                                           for j, i in enumerate(self.slot_inputs)])

    def class_args(self, backward: bool) -> dict[str, Any]:
        """The class sizes a kernel takes (read-only: callers merge it, never change it)."""
        return self.memo(("classes", backward), lambda: self._class_sizes(backward))

    def _class_sizes(self, backward: bool) -> dict[str, Any]:
        args: dict[str, Any] = {}
        for q in kernel_classes(self.st, backward=backward):
            shape = self.class_shape[q]
            for d in range(1, len(shape) - 1):
                args[f"c{q}_d{d}"] = shape[d]
        return args

    def out_dtypes(self, inputs: Sequence[torch.Tensor],
                   override: Sequence[torch.dtype | None] | None = None) -> list[torch.dtype]:
        """Output dtypes for these inputs, as eager PyTorch would give them.

        The binding holds the dtypes of the capture (fp32 inputs); under autocast the same
        group sees bf16 activations next to fp32 parameters, and an output must come out in
        the dtype eager gives it, or every later op reads twice the bytes (or a bf16 GEMM
        refuses an fp32 operand). So the dtypes flow through the ops: type promotion,
        ``linear`` in the autocast dtype, ``layer_norm`` as autocast runs it, ``cast``
        to its target. Non-float outputs keep their binding dtype.

        ``override``: per output, a dtype to write a float output in instead (None: as
        eager), e.g. the autocast dtype for an output only a GEMM reads, which would cast
        it to that dtype anyway (see :class:`~..graph_runner.GraphRunner`).
        """
        auto = _autocast_dtype(inputs[0])
        key = ("dtypes", inputs[0].device.type, auto, *(t.dtype for t in inputs),
               None if override is None else tuple(override))
        return self.memo(key, lambda: self._out_dtypes(inputs, auto, override))

    def _out_dtypes(self, inputs: Sequence[torch.Tensor], auto: torch.dtype | None,
                    override: Sequence[torch.dtype | None] | None) -> list[torch.dtype]:
        slot_dt = [inputs[i].dtype for i in self.slot_inputs]
        values: list[torch.dtype] = []
        for op in self.st["ops"]:
            args = op["args"][1:] if op["op"] == "where" else op["args"]
            dts = []
            for ref in args:
                if ref is None or ref[0] == "c":
                    continue
                tag, idx = ref
                dt = values[idx] if tag == "v" else slot_dt[idx] if tag == "s" \
                    else inputs[idx].dtype
                if dt.is_floating_point:
                    dts.append(dt)
            name = op["op"]
            if name == "cast":
                values.append(getattr(torch, op["attrs"].get("dtype", "float32")))
            elif name == "linear" and auto is not None:
                values.append(auto)
            elif name == "layer_norm":  # native_layer_norm answers in its input's dtype
                values.append(_layer_norm_dtype(inputs[0].device, auto, dts[0]))
            else:
                out = dts[0] if dts else torch.float32
                for dt in dts[1:]:
                    out = torch.promote_types(out, dt)
                values.append(out)
        out = [values[k] if self.dtypes[j].is_floating_point else self.dtypes[j]
               for j, k in enumerate(self.st["outputs"])]
        if override is not None:
            out = [o if o is not None and dt.is_floating_point else dt
                   for dt, o in zip(out, override, strict=True)]
        return out

    def alloc_outputs(self, inputs: Sequence[torch.Tensor],
                      override: Sequence[torch.dtype | None] | None = None
                      ) -> list[torch.Tensor]:
        dtypes = self.out_dtypes(inputs, override)
        return [torch.empty(self.shapes[k], dtype=dtypes[j], device=inputs[0].device)
                for j, k in enumerate(self.st["outputs"])]

    def grad_args(self, grads: Sequence[torch.Tensor | None], like: torch.Tensor,
                  shape_of: Callable[[int, int], tuple[int, ...]],
                  view: Callable[[int, torch.Tensor], torch.Tensor] | None = None
                  ) -> dict[str, Any]:
        """``g<j>`` and its strides at ``shape_of(j, k)`` (after ``view``). A kind passes
        the same ``shape_of``/``view`` at every call: the strides are memoised per grads
        signature. An output nobody used gets a zero scalar broadcast: no memory, no
        launch."""
        full = [g if g is not None else self._zero(like) for g in grads]
        key = ("grads", *(_meta(g) for g in full))

        def strides() -> dict[str, Any]:
            args: dict[str, Any] = {}
            for j, k in enumerate(self.st["outputs"]):
                g = full[j] if view is None else view(j, full[j])
                args.update(stride_args(f"g{j}", g, shape_of(j, k)))
            return args

        args = dict(self.memo(key, strides))
        for j, g in enumerate(full):
            args[f"g{j}"] = g
        return args

    def saved(self, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]
              ) -> list[torch.Tensor]:
        """What the backward keeps: the inputs, then the outputs it reads back."""
        return [*inputs, *(outs[j] for j in self.reloaded)]

    def reloaded_args(self, saved: Sequence[torch.Tensor]) -> dict[str, Any]:
        """``y<j>`` and its strides for each output the backward reads back."""
        if not self.reloaded:
            return {}
        ys = saved[self.st["inputs"]:]
        return self.strided_args("reloaded", [
            (f"y{j}", y, self.shapes[self.st["outputs"][j]])
            for j, y in zip(self.reloaded, ys)])

    def _zero(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.device)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros((), dtype=like.dtype, device=like.device)
        return self._zeros[key]

    def slot_grad_buffers(self, inputs: Sequence[torch.Tensor], needs: Sequence[bool],
                          partial_rows: int = 0, partial_cols: int = 1, written: bool = False
                          ) -> tuple[dict[str, Any], dict[int, torch.Tensor]]:
        """``d<j>``/``NEED<j>`` arguments and the buffers the kernel fills. ``written``: the
        kernel stores every element of the partial-sum buffers (a looping pass: each
        program stores its partial row), so they need no zero fill."""
        args: dict[str, Any] = {}
        buffers: dict[int, torch.Tensor] = {}
        fill = torch.empty if written else torch.zeros
        for j, slot in enumerate(self.st["slots"]):
            x = inputs[slot["input"]]
            need = (j in self.reached and needs[slot["input"]] and x.is_floating_point())
            src = self.aliases.get(j)
            if need and src is not None and src in buffers:
                y = inputs[self.slot_inputs[src]]
                if y.shape == x.shape and y.dtype == x.dtype:  # one store serves both
                    buffers[j] = buffers[src]
                    need = False
            args[f"NEED{j}"] = need
            if not need:
                args[f"d{j}"] = x
                continue
            shape = self.consumer_shape(j)
            if self.modes[j] == "full":
                buf = torch.empty(shape, dtype=x.dtype, device=x.device)
            elif self.modes[j] == "col":
                buf = fill((partial_rows, shape[-1]), dtype=torch.float32, device=x.device)
            elif self.modes[j] == "row":
                buf = fill((partial_cols, _mn(shape)[0]), dtype=torch.float32, device=x.device)
            else:
                buf = torch.empty(shape, dtype=torch.float32, device=x.device)
            args[f"d{j}"] = buf
            buffers[j] = buf
        return args, buffers

    def reduce_slot_grads(self, inputs: Sequence[torch.Tensor], buffers: dict[int, torch.Tensor],
                          grads_in: list[torch.Tensor | None]) -> None:
        made: dict[int, torch.Tensor] = {}
        for j, buf in buffers.items():
            i = self.st["slots"][j]["input"]
            x = inputs[i]
            src = self.aliases.get(j)
            if src in made and buf is buffers[src]:
                # the same tensor object for both inputs, as eager's add hands over: autograd
                # then never accumulates into it in place (two references)
                g = made[src]
            elif self.modes[j] == "full":
                g = buf.view(x.shape)
            elif self.modes[j] in ("col", "row"):
                part = buf[0] if buf.shape[0] == 1 else buf.sum(0)  # one partial: no sum
                g = part.reshape(x.shape).to(x.dtype)
            else:
                g = buf.sum_to_size(x.shape).to(x.dtype)
            made[j] = g
            grads_in[i] = g if grads_in[i] is None else grads_in[i] + g

    def looped_backward(self, inputs: Sequence[torch.Tensor],
                        grads: Sequence[torch.Tensor | None], needs: Sequence[bool], m: int,
                        n: int, bn: int, *,
                        shape_of: Callable[[int, int], tuple[int, ...]] | None = None,
                        view: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                        extra: dict[str, Any] | None = None) -> list[torch.Tensor | None]:
        """Launch a kind's ``bwd`` (emitted by ``kernels._looped_bwd``): ``ITERS`` row blocks
        of ``_loop_rows(bn)`` rows per program, column tiles of ``bn``; then sum the
        slots' partial gradients."""
        saved, inputs = inputs, inputs[:self.st["inputs"]]
        grads_in: list[torch.Tensor | None] = [None] * len(inputs)
        bm = _loop_rows(bn)
        programs, iters = _row_programs(m, bm)
        cols = cdiv(n, bn)
        launch = m * n > 0
        dargs, buffers = self.slot_grad_buffers(inputs, needs, partial_rows=programs,
                                                partial_cols=cols, written=launch)
        if buffers and launch:
            args = {**self.slot_args(inputs), **self.reloaded_args(saved), **dargs,
                    **self.class_args(True), **(extra or {}),
                    "M": m, "N": n, "ITERS": iters, "STAGES": LOOP_STAGES, "BLOCK_M": bm,
                    "BLOCK_N": bn,
                    **self.grad_args(grads, inputs[0],
                                     shape_of or (lambda j, k: self.shapes[k]), view)}
            self.m.bwd[(programs, cols)](**args)
        self.reduce_slot_grads(inputs, buffers, grads_in)
        return grads_in


# ---- kinds ------------------------------------------------------------------------------------


class _Pointwise(_Impl):
    def forward(self, inputs: Sequence[torch.Tensor],
                out_dtypes: Sequence[torch.dtype | None] | None = None
                ) -> tuple[list[torch.Tensor], list]:
        outs = self.alloc_outputs(inputs, out_dtypes)
        m, n = _mn(self.shapes[self.st["outputs"][0]])
        if m * n:
            bn = _tile_n(n)
            args = {**self.slot_args(inputs), **self.class_args(False), "M": m, "N": n,
                    "BLOCK_N": bn}
            args.update({f"o{j}": o for j, o in enumerate(outs)})
            self.m.fwd[lambda meta: (cdiv(m, meta["BLOCK_M"]), cdiv(n, bn))](
                **args)
        return outs, self.saved(inputs, outs)

    def backward(self, saved: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                 needs: Sequence[bool]) -> list[torch.Tensor | None]:
        m, n = _mn(self.shapes[self.st["outputs"][0]])
        return self.looped_backward(saved, grads, needs, m, n, _tile_n(n))


class _Norm(_Impl):
    @staticmethod
    def blocks(n: int) -> tuple[int, int]:
        """Whole rows per program: ~2048 elements a tile on a GPU (the LayerNorm keeps a
        handful of such tiles live in registers), more under the interpreter (fewer
        programs, each a numpy op)."""
        bn = next_pow2(n, 16)
        return max(1, min(64, (8192 if INTERPRETED else 2048) // bn)), bn

    def forward(self, inputs: Sequence[torch.Tensor],
                out_dtypes: Sequence[torch.dtype | None] | None = None
                ) -> tuple[list[torch.Tensor], list]:
        outs = self.alloc_outputs(inputs, out_dtypes)
        m, n = _mn(self.shapes[self.st["outputs"][0]])
        if m * n:
            bm, bn = self.blocks(n)
            args = {**self.slot_args(inputs), **self.class_args(False), "M": m, "N": n,
                    "BLOCK_M": bm, "BLOCK_N": bn}
            args.update({f"o{j}": o for j, o in enumerate(outs)})
            self.m.fwd[(cdiv(m, bm),)](**args)
        return outs, self.saved(inputs, outs)

    def backward(self, saved: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                 needs: Sequence[bool]) -> list[torch.Tensor | None]:
        m, n = _mn(self.shapes[self.st["outputs"][0]])
        return self.looped_backward(saved, grads, needs, m, n, next_pow2(n, 16))  # whole rows


class _Reduction(_Impl):
    def __init__(self, module: ModuleType, binding: dict[str, Any]) -> None:
        super().__init__(module, binding)
        self.red = reduced_value(self.st)
        self.arg = self.st["ops"][self.red]["args"][0][1]
        shape = self.shapes[self.arg]
        self.r, self.n = int(shape[-2]), int(shape[-1])
        self.a = math.prod(int(s) for s in shape[:-2])

    def forward(self, inputs: Sequence[torch.Tensor],
                out_dtypes: Sequence[torch.dtype | None] | None = None
                ) -> tuple[list[torch.Tensor], list]:
        outs = self.alloc_outputs(inputs, out_dtypes)
        if self.a * self.n:
            if self.r == 0:
                outs[self.st["outputs"].index(self.red)].zero_()
            else:
                bn = min(next_pow2(self.n, 16), 64 if INTERPRETED else 128)
                args = {**self.slot_args(inputs), **self.class_args(False), "R": self.r,
                        "M": self.a * self.r, "N": self.n, "BLOCK_N": bn}
                args.update({f"o{j}": o for j, o in enumerate(outs)})
                self.m.fwd[(self.a, cdiv(self.n, bn))](**args)
        return outs, list(inputs)

    def backward(self, saved: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                 needs: Sequence[bool]) -> list[torch.Tensor | None]:
        arg_shape = self.shapes[self.arg]

        def shape_of(j: int, k: int) -> tuple[int, ...]:
            return arg_shape if k == self.red else self.shapes[k]

        def view(j: int, g: torch.Tensor) -> torch.Tensor:
            if self.st["outputs"][j] != self.red:
                return g
            if g.dim() == len(arg_shape) - 1:
                g = g.unsqueeze(-2)
            return g.expand(arg_shape)

        return self.looped_backward(saved, grads, needs, self.a * self.r, self.n,
                                    _tile_n(self.n), shape_of=shape_of, view=view,
                                    extra={"R": self.r})


GEMM_PATH_ENV = "GEMC_GEMM_PATH"
GEMM_PATHS = ("auto", "fused", "library")
PICK_REPEATS = 3


def gemm_path_setting() -> str:
    """``GEMC_GEMM_PATH``: auto (measure both on the first call of each shape; the fused
    path under the interpreter), fused (generated GEMM with the epilogue in its tiles) or
    library (cuBLAS GEMMs around generated epilogue kernels)."""
    value = os.environ.get(GEMM_PATH_ENV, "auto")
    if value not in GEMM_PATHS:
        raise ValueError(f"{GEMM_PATH_ENV}={value!r}: expected one of {', '.join(GEMM_PATHS)}")
    return value


class _Gemm(_Impl):
    """A GEMM with its epilogue, by one of two paths chosen per shape and direction.

    ``fused``: one generated kernel computes ``x @ w.T + b`` and applies the epilogue to the
    accumulator; the backward's GEMMs recompute the epilogue's derivative from their input
    tiles. ``library``: cuBLAS computes ``z`` (bias included) and a generated kernel applies
    the epilogue in one pass; the backward's generated kernel writes ``dz`` (with the
    epilogue operands' gradients and the bias column sums in the same pass) and cuBLAS runs
    dgrad and wgrad. Why both: a generated Triton GEMM saves the round trip of ``z`` through
    memory but reaches a fraction of cuBLAS's throughput at some shapes (long reductions,
    few output tiles); which wins is measured, not assumed. ``chosen`` records the choice.
    """

    def __init__(self, module: ModuleType, binding: dict[str, Any]) -> None:
        super().__init__(module, binding)
        x_ref, w_ref, b_ref = self.st["ops"][0]["args"]
        self.ix, self.iw = x_ref[1], w_ref[1]
        self.ib = b_ref[1] if b_ref is not None else None
        self.save_z = bool(module.SAVE_Z)
        self.z_out = 0 in self.st["outputs"]
        self.pure = self.st["outputs"] == [0] and len(self.st["ops"]) == 1
        self.identity_dz = passes_gradient_through(self.st)
        self.chosen: dict[tuple[Any, ...], str] = {}

    def _operands(self, inputs: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """(x, w, b or None, x as [M, K], M, N, K) of this group's GEMM."""
        x, w = inputs[self.ix], inputs[self.iw]
        b = inputs[self.ib] if self.ib is not None else None
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        return x, w, b, x2, x2.shape[0], w.shape[0], k

    # -- path choice ----------------------------------------------------------------------

    def _pick(self, phase: str, key: tuple[Any, ...], fused: Callable[[], Any],
              library: Callable[[], Any]) -> Any:
        setting = gemm_path_setting()
        if setting == "auto" and INTERPRETED:
            setting = "fused"
        if setting != "auto":
            self.chosen[(phase, *key)] = setting
            return fused() if setting == "fused" else library()
        known = self.chosen.get((phase, *key))
        if known is not None:
            return fused() if known == "fused" else library()
        times: dict[str, float] = {}
        results: dict[str, Any] = {}
        for name, fn in (("fused", fused), ("library", library)):
            fn()  # the first call autotunes and compiles
            best_ms = math.inf
            for _ in range(PICK_REPEATS):  # the best of a few: one sample is noisy
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                results[name] = fn()
                end.record()
                end.synchronize()
                best_ms = min(best_ms, start.elapsed_time(end))
            times[name] = best_ms
        best = min(times, key=times.__getitem__)
        self.chosen[(phase, *key)] = best
        return results[best]

    # -- forward --------------------------------------------------------------------------

    def forward(self, inputs: Sequence[torch.Tensor],
                out_dtypes: Sequence[torch.dtype | None] | None = None
                ) -> tuple[list[torch.Tensor], list]:
        x, w = inputs[self.ix], inputs[self.iw]
        k = x.shape[-1]
        m, n = x.numel() // max(k, 1), w.shape[0]
        outs, z = self._pick("fwd", (m, n, k, x.dtype),
                             lambda: self._forward_fused(inputs, out_dtypes),
                             lambda: self._forward_library(inputs, out_dtypes))
        saved = list(inputs) + ([z] if self.save_z else [])
        return outs, saved

    def _zbuffer(self, outs: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor | None:
        if self.z_out:
            return outs[self.st["outputs"].index(0)]
        if self.save_z:
            return torch.empty(self.shapes[0], dtype=x.dtype, device=x.device)
        return None

    def _forward_fused(self, inputs: Sequence[torch.Tensor],
                       out_dtypes: Sequence[torch.dtype | None] | None = None
                       ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        x, w, b, x2, m, n, k = self._operands(inputs)
        outs = self.alloc_outputs(inputs, out_dtypes)
        zs = None if self.z_out else self._zbuffer(outs, x)
        if m * n:
            args = {"x": x2, "w": w, "b": b if b is not None else x2, **self.slot_args(inputs),
                    **self.class_args(False), "M": m, "N": n, "K": k,
                    "sxm": x2.stride(0), "sxk": x2.stride(1), "swn": w.stride(0),
                    "swk": w.stride(1), "IEEE": x.dtype == torch.float32, "INTERP": INTERPRETED,
                    "GROUP_M": 8}
            args.update({f"o{j}": o for j, o in enumerate(outs)})
            if zs is not None:
                args["zs"] = zs
            self.m.fwd[lambda meta: (cdiv(m, meta["BLOCK_M"])
                                     * cdiv(n, meta["BLOCK_N"]),)](**args)
        z = outs[self.st["outputs"].index(0)] if self.z_out else zs
        return outs, z

    def _forward_library(self, inputs: Sequence[torch.Tensor],
                         out_dtypes: Sequence[torch.dtype | None] | None = None
                         ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        x, w, b, x2, m, n, k = self._operands(inputs)
        outs = self.alloc_outputs(inputs, out_dtypes)
        z = self._zbuffer(outs, x)
        if z is None or z.dtype != x.dtype:  # affine epilogue: z lives only for this call
            z = torch.empty((m, n), dtype=x.dtype, device=x.device)
        z2 = z.view(m, n)
        if b is not None:
            torch.addmm(b, x2, w.t(), out=z2)
        else:
            torch.mm(x2, w.t(), out=z2)
        if m * n and not self.pure:
            bn = _tile_n(n)
            args = {"zin": z2, **self.slot_args(inputs), **self.class_args(False), "M": m,
                    "N": n, "BLOCK_N": bn}
            args.update({f"o{j}": o for j, o in enumerate(outs)})
            self.m.epi[lambda meta: (cdiv(m, meta["BLOCK_M"]), cdiv(n, bn))](
                **args)
        return outs, (z if self.save_z else None)

    # -- backward -------------------------------------------------------------------------

    def _zarg(self, saved: Sequence[torch.Tensor], n_in: int) -> dict[str, Any]:
        if not self.save_z:
            return {}
        name = f"o{self.st['outputs'].index(0)}" if self.z_out else "zs"
        return {name: saved[n_in]}

    def backward(self, saved: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                 needs: Sequence[bool]) -> list[torch.Tensor | None]:
        n_in = self.st["inputs"]
        x, w = saved[self.ix], saved[self.iw]
        k = x.shape[-1]
        m, n = x.numel() // max(k, 1), w.shape[0]
        if m * n * k == 0:
            return [None] * n_in
        return self._pick("bwd", (m, n, k, x.dtype, tuple(needs)),
                          lambda: self._backward_fused(saved, grads, needs),
                          lambda: self._backward_library(saved, grads, needs))

    def _common(self, saved: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                m: int, n: int, k: int) -> dict[str, Any]:
        n_in = self.st["inputs"]
        inputs = saved[:n_in]
        x = inputs[self.ix]
        return {**self._zarg(saved, n_in), **self.slot_args(inputs), **self.class_args(True),
                **self.grad_args(grads, x, lambda j, kk: self.shapes[kk]), "M": m, "N": n}

    def _backward_fused(self, saved: Sequence[torch.Tensor],
                        grads: Sequence[torch.Tensor | None],
                        needs: Sequence[bool]) -> list[torch.Tensor | None]:
        n_in = self.st["inputs"]
        inputs = saved[:n_in]
        grads_in: list[torch.Tensor | None] = [None] * n_in
        x, w, b, x2, m, n, k = self._operands(inputs)
        common = {**self._common(saved, grads, m, n, k), "K": k,
                  "IEEE": x.dtype == torch.float32, "INTERP": INTERPRETED}
        dargs, buffers = self.slot_grad_buffers(inputs, needs)
        need_dx = bool(needs[self.ix])
        if need_dx or buffers:
            dx = torch.empty((m, k), dtype=x.dtype, device=x.device) if need_dx else x2
            self.m.dgrad[lambda meta: (cdiv(m, meta["BLOCK_M"]),
                                       cdiv(k, meta["BLOCK_K"]) if need_dx else 1)](
                w=w, dx=dx, swn=w.stride(0), swk=w.stride(1), COMPUTE_DX=need_dx, **dargs,
                **common)
            if need_dx:
                grads_in[self.ix] = dx.view(x.shape)
        need_b = b is not None and bool(needs[self.ib])
        if needs[self.iw] or need_b:
            split = self._split(m, n, k)
            rows = cdiv(m, split)
            dw = torch.empty((split, n, k), dtype=torch.float32, device=x.device)
            db = torch.empty((split, n), dtype=torch.float32, device=x.device)
            self.m.wgrad[lambda meta: (cdiv(n, meta["BLOCK_N"]),
                                       cdiv(k, meta["BLOCK_K"]), split)](
                x=x2, dw=dw, db=db, sxm=x2.stride(0), sxk=x2.stride(1), ROWS_PER_SPLIT=rows,
                **common)
            if needs[self.iw]:
                grads_in[self.iw] = _add(grads_in[self.iw], dw.sum(0).to(w.dtype))
            if need_b:
                grads_in[self.ib] = _add(grads_in[self.ib], db.sum(0).to(b.dtype))
        self.reduce_slot_grads(inputs, buffers, grads_in)
        return grads_in

    def _backward_library(self, saved: Sequence[torch.Tensor],
                          grads: Sequence[torch.Tensor | None],
                          needs: Sequence[bool]) -> list[torch.Tensor | None]:
        n_in = self.st["inputs"]
        inputs = saved[:n_in]
        grads_in: list[torch.Tensor | None] = [None] * n_in
        x, w, b, x2, m, n, k = self._operands(inputs)
        need_b = b is not None and bool(needs[self.ib])
        if self.identity_dz:
            return self._backward_added(inputs, grads, needs, grads_in)
        bn = _tile_n(n)
        bm = _loop_rows(bn)
        programs, iters = _row_programs(m, bm)
        dz = torch.empty((m, n), dtype=x.dtype, device=x.device)
        dbp = torch.empty((programs, n), dtype=torch.float32, device=x.device) if need_b else dz
        dargs, buffers = self.slot_grad_buffers(inputs, needs, partial_rows=programs,
                                                written=True)
        self.m.dz[(programs, cdiv(n, bn))](
            dzo=dz, dbp=dbp, HAS_DB=need_b, ITERS=iters, STAGES=LOOP_STAGES, BLOCK_M=bm,
            BLOCK_N=bn, **dargs,
            **self._common(saved, grads, m, n, k))
        if needs[self.ix]:
            grads_in[self.ix] = torch.mm(dz, w).view(x.shape)
        if needs[self.iw]:
            grads_in[self.iw] = torch.mm(dz.t(), x2).to(w.dtype)
        if need_b:
            grads_in[self.ib] = dbp.sum(0).to(b.dtype)
        self.reduce_slot_grads(inputs, buffers, grads_in)
        return grads_in

    def _backward_added(self, inputs: Sequence[torch.Tensor],
                        grads: Sequence[torch.Tensor | None], needs: Sequence[bool],
                        grads_in: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``out = z + r1 + ...``: dz and every added operand's gradient are the output's."""
        x, w, b, x2, m, n, k = self._operands(inputs)
        g = grads[0]
        if g is None:
            g = torch.zeros(self.shapes[self.st["outputs"][0]], dtype=x.dtype, device=x.device)
        for j, slot in enumerate(self.st["slots"]):
            i = slot["input"]
            r = inputs[i]
            if j in self.reached and needs[i] and r.is_floating_point():
                gr = g.sum_to_size(r.shape) if tuple(g.shape) != tuple(r.shape) else g
                grads_in[i] = _add(grads_in[i], gr.to(r.dtype))
        dz = g.reshape(m, n).to(x.dtype)
        if needs[self.ix]:
            grads_in[self.ix] = torch.mm(dz, w).view(x.shape)
        if needs[self.iw]:
            grads_in[self.iw] = torch.mm(dz.t(), x2).to(w.dtype)
        if b is not None and needs[self.ib]:
            grads_in[self.ib] = dz.sum(0, dtype=torch.float32).to(b.dtype)
        return grads_in

    @staticmethod
    def _split(m: int, n: int, k: int) -> int:
        """Row splits of the wgrad: enough programs for every SM, partials within a cap."""
        if INTERPRETED:
            return max(1, min(2, cdiv(m, 64)))
        tiles = cdiv(n, 128) * cdiv(k, 128)
        split = max(1, cdiv(WGRAD_PROGRAMS_PER_SM * sm_count(), tiles))
        split = min(split, max(1, m // 512), max(1, WGRAD_PARTIAL_BYTES // (4 * n * k)))
        return split


def _tile_n(n: int) -> int:
    """Columns of a pass over an ``[M, N]`` operand (whole rows up to 256)."""
    return min(next_pow2(n, 16), 256)


def sm_count() -> int:
    """Streaming multiprocessors of the current CUDA device (132 on an H200), which the
    launch shapes scale with, so a kernel fills another GPU as it fills the H200 it was
    tuned on; ``FALLBACK_SMS`` where no CUDA device is visible."""
    return _sm_count(torch.cuda.current_device() if torch.cuda.is_available() else -1)


@functools.cache
def _sm_count(index: int) -> int:
    if index < 0:
        return FALLBACK_SMS
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _env_int(name: str, default: _D) -> int | _D:
    """An integer launch setting from the environment (unset or empty: ``default``)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected an integer") from None


# The launch shape of the looping backward passes (``bwd``, the library path's ``dz``). Read
# from the environment once, at import, and looked up by the host at every launch, so a
# benchmark can also set them on this module between calls (``benchmarks/bwd_sweep.py``
# does, to sweep them on the GPU). A Triton autotuner caches its choice per (M, N): clear a
# kernel's ``cache`` after changing them, or the choice made for the old shape sticks.
LOOP_TILE = _env_int("GEMC_LOOP_TILE", 8192 if INTERPRETED else 1024)
"""Elements of one tile of a looping backward pass (``GEMC_LOOP_TILE``): 32-93 registers a
thread at 4 warps on Hopper for the fusion benchmark's groups, 2048 already 45-150
(``benchmarks/kernel_resources.py``); the interpreter wants few, large tiles (each is a
numpy op)."""
ROW_PROGRAMS = _env_int("GEMC_ROW_PROGRAMS", 3 if INTERPRETED else None)
"""Programs of a looping backward pass along the rows (``GEMC_ROW_PROGRAMS``; None:
``PROGRAMS_PER_SM`` per SM of the device, 2112 on an H200): 16 per H200 SM, the fastest backward of all three fusion cases in ``benchmarks/bwd_sweep.py`` on the
H200 (2026-12-02, tile 1024: LayerNorm 0.571 ms, pointwise 0.492, masked sum 0.302; at 8 per
SM 0.733 / 0.499 / 0.358; ``benchmarks/results/bwd_sweep_h200.log``); under the interpreter
few, so the tests walk several row blocks per program. 0 (or less): one row block per
program (``ITERS`` = 1), the hardware scheduler then fills the SMs as deep as the registers
allow, at the price of one partial column-sum row per block."""
LOOP_STAGES = _env_int("GEMC_LOOP_STAGES", 1)
"""Software-pipelining depth of the row loop (``GEMC_LOOP_STAGES``; see
``kernels._row_loop``): 1 issues each row block's loads when it starts, 2 or more prefetch
the next blocks' operands through shared memory."""


def _loop_rows(bn: int) -> int:
    """Rows of one tile of a looping backward pass whose tiles are ``bn`` wide."""
    return max(1, min(64, LOOP_TILE // bn))


def _row_programs(m: int, bm: int) -> tuple[int, int]:
    """(programs, row blocks per program) covering ``m`` rows in blocks of ``bm``."""
    blocks = max(1, cdiv(m, bm))
    programs = row_programs()
    if programs <= 0:
        return blocks, 1
    iters = cdiv(blocks, min(blocks, programs))
    return cdiv(blocks, iters), iters


def row_programs() -> int:
    """``ROW_PROGRAMS`` in force: the setting, else ``PROGRAMS_PER_SM`` per SM."""
    return ROW_PROGRAMS if ROW_PROGRAMS is not None else PROGRAMS_PER_SM * sm_count()


def loop_launch() -> dict[str, int]:
    """The looping backward passes' launch settings now in force (for reports)."""
    return {"loop_tile": LOOP_TILE, "row_programs": row_programs(), "loop_stages": LOOP_STAGES}


def _autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for ``t``'s device, or None."""
    dev = t.device.type
    if not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


_LAYER_NORM_AUTOCAST: dict[tuple[str, torch.dtype], torch.dtype] = {}


def _layer_norm_dtype(device: torch.device, auto: torch.dtype | None,
                      x: torch.dtype) -> torch.dtype:
    """What eager ``layer_norm`` returns for an ``x``-typed input under this autocast.

    CUDA autocast runs layer_norm in fp32, CPU autocast (bf16) leaves it alone: asked of
    the installed torch once per device type, not written down here.
    """
    if auto is None:
        return x
    key = (device.type, auto)
    if key not in _LAYER_NORM_AUTOCAST:
        probe = torch.ones(1, 2, dtype=auto, device=device)
        with torch.autocast(device.type, dtype=auto):
            _LAYER_NORM_AUTOCAST[key] = torch.nn.functional.layer_norm(probe, (2,)).dtype
    return torch.float32 if _LAYER_NORM_AUTOCAST[key] == torch.float32 else x


def _add(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else a + b


_IMPLS = {"pointwise": _Pointwise, "norm": _Norm, "reduction": _Reduction,
          "gemm_epilogue": _Gemm}


class _Fused(torch.autograd.Function):
    """One fusion group: generated forward, generated backward, inputs saved."""

    @staticmethod
    def forward(ctx, impl, out_dtypes, *inputs):  # type: ignore[override]
        outs, saved = impl.forward(inputs, out_dtypes)
        ctx.impl = impl
        ctx.save_for_backward(*saved)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        grads_in = ctx.impl.backward(ctx.saved_tensors, grads, ctx.needs_input_grad[2:])
        return (None, None, *grads_in)


def make_runner(source: str | ModuleType, binding: dict[str, Any]
                ) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``run(*inputs, out_dtypes=None) -> outputs`` of a group: its generated kernels as an
    autograd function. ``out_dtypes``: per output, a float dtype to write it in instead of
    eager's (None: eager's); the gradient of such an output arrives in that dtype, the
    inputs' gradients still come back in the inputs' dtypes."""
    module = load_source(source) if isinstance(source, str) else source
    kind = json.loads(module.STRUCTURE)["kind"]
    impl = _IMPLS[kind](module, binding)
    gemm_operands = (impl.ix, impl.iw, impl.ib) if isinstance(impl, _Gemm) else ()

    def run(*inputs: torch.Tensor, out_dtypes: Sequence[torch.dtype | None] | None = None
            ) -> tuple[torch.Tensor, ...]:
        dt = _autocast_dtype(inputs[0]) if gemm_operands else None
        if dt is not None:
            # the GEMM runs in the autocast dtype, as F.linear would; casting outside the
            # autograd function lets autograd cast the gradients back
            inputs = tuple(t.to(dt) if i in gemm_operands and t.is_floating_point() else t
                           for i, t in enumerate(inputs))
        return _Fused.apply(impl, None if out_dtypes is None else tuple(out_dtypes), *inputs)

    run.impl = impl  # type: ignore[attr-defined]  # benchmarks read impl.chosen
    return run
