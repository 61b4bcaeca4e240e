"""Run a linalg-on-tensors module on the CPU through MLIR's ExecutionEngine.

This is the independent check of an export: the same subgraph run by eager PyTorch and by
LLVM code generated from the linalg module must agree. The torch-mlir wheel ships the
reference backend's passes (``refback-*``) but not the Python package around them
(``torch_mlir_e2e_test``), so the lowering pipeline and the calling convention live here,
following that backend: bufferize, rewrite the entry point to take unranked memrefs and to
hand each result to a callback ``refbackend_consume_func_return_<types>``, lower to LLVM,
JIT. Tensors cross as NumPy arrays; results are copied out inside the callback because
their buffers belong to the generated code.

LLVM runs at ``opt_level=0``: at -O1 the JIT spends ~30 s on the tiny GEM graph's ~300
ops against ~0.1 s at -O0, and this is a correctness reference, not a benchmark.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gemc.backends.mlir.lower import LINALG, parse_module, run_pipeline

_CONSUME_PREFIX = "refbackend_consume_func_return_"
_MEMREF_DTYPES = {
    "mrf16": np.float16,
    "mrf32": np.float32,
    "mrf64": np.float64,
    "mri1": np.bool_,
    "mri8": np.int8,
    "mri32": np.int32,
    "mri64": np.int64,
}
_ARG_DTYPES = {np.dtype(t) for t in _MEMREF_DTYPES.values()} | {np.dtype(np.uint8)}

_PASSES = [
    "func.func(linalg-generalize-named-ops)",
    "func.func(linalg-fuse-elementwise-ops)",
    "convert-shape-to-std",
    "func.func(refback-generalize-tensor-pad)",
    "func.func(refback-generalize-tensor-concat)",
    "func.func(tm-tensor-bufferize)",
    "one-shot-bufferize{copy-before-write bufferize-function-boundaries "
    "function-boundary-type-conversion=identity-layout-map}",
    "refback-mlprogram-bufferize",
    "func.func(buffer-deallocation-pipeline)",
    "inline",
    "refback-munge-calling-conventions",
    "func.func(tm-tensor-to-loops)",
    "func.func(refback-munge-memref-copy)",
    "func.func(convert-linalg-to-loops)",
    "func.func(lower-affine)",
    "convert-scf-to-cf",
    "func.func(refback-expand-ops-for-llvm)",
    "func.func(arith-expand)",
    "func.func(convert-math-to-llvm)",
    "convert-math-to-libm",
    "expand-strided-metadata",
    "finalize-memref-to-llvm",
    "lower-affine",
    "convert-bufferization-to-memref",
    "finalize-memref-to-llvm",
    "func.func(convert-arith-to-llvm)",
    "convert-vector-to-llvm",
    "convert-func-to-llvm",
    "convert-cf-to-llvm",
    "convert-complex-to-llvm",
    "reconcile-unrealized-casts",
]
LLVM_PIPELINE = "builtin.module(" + ",".join(_PASSES) + ")"


class ReferenceModule:
    """A JIT-compiled linalg module; call it with tensors, get a tuple of tensors back."""

    def __init__(self, linalg_text: str, func_name: str = "main", opt_level: int = 0) -> None:
        from torch_mlir.execution_engine import ExecutionEngine

        module = parse_module(linalg_text)
        run_pipeline(module, LLVM_PIPELINE, "llvm")
        self.func_name = func_name
        self._result: tuple[np.ndarray, ...] | None = None
        self._callbacks: list[Any] = []  # keep ctypes callbacks alive as long as the engine
        self.engine = ExecutionEngine(module, opt_level=opt_level)
        for name in _consume_funcs(module):
            self._register(name)

    def _register(self, name: str) -> None:
        from torch_mlir.runtime import UnrankedMemRefDescriptor, unranked_memref_to_numpy

        kinds = name[len(_CONSUME_PREFIX) :].split("_")
        for kind in kinds:
            if kind not in _MEMREF_DTYPES:
                raise NotImplementedError(f"result type {kind!r} of {name} (tensors only)")
        proto = ctypes.CFUNCTYPE(None, *[ctypes.POINTER(UnrankedMemRefDescriptor)] * len(kinds))

        def consume(*ptrs: Any) -> None:
            self._result = tuple(
                _copy_out(p, _MEMREF_DTYPES[k], unranked_memref_to_numpy)
                for p, k in zip(ptrs, kinds)
            )

        callback = proto(consume)
        self._callbacks.append(callback)
        self.engine.register_runtime(name, callback)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from torch_mlir.runtime import get_unranked_memref_descriptor

        arrays = [_to_numpy(t) for t in tensors]
        args = [ctypes.pointer(ctypes.pointer(get_unranked_memref_descriptor(a))) for a in arrays]
        self._result = None
        self.engine.invoke(self.func_name, *args)
        result, self._result = self._result, None
        if result is None:
            raise RuntimeError(f"{self.func_name} returned nothing")
        return tuple(torch.from_numpy(r) for r in result)


def compile_reference(linalg_text: str, func_name: str = "main") -> ReferenceModule:
    """Lower a ``linalg`` stage module (text, as written to the dump) and JIT it."""
    return ReferenceModule(linalg_text, func_name)


def _consume_funcs(module: Any) -> list[str]:
    names = []
    for op in module.body.operations:
        attr = op.attributes["sym_name"] if "sym_name" in op.attributes else None
        name = str(attr).strip('"') if attr is not None else ""
        if name.startswith(_CONSUME_PREFIX):
            names.append(name)
    return names


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    array = np.ascontiguousarray(t.detach().cpu().numpy())
    if array.dtype not in _ARG_DTYPES:
        raise TypeError(
            f"the reference backend takes {sorted(map(str, _ARG_DTYPES))}, not {t.dtype}"
        )
    return array


def _copy_out(ptr: Any, dtype: Any, to_numpy: Callable[..., np.ndarray]) -> np.ndarray:
    if ptr[0].rank == 0:  # NumPy cannot view a 0-d descriptor the way the helper expects
        from torch_mlir.runtime import as_ctype, make_zero_d_memref_descriptor

        ctp = as_ctype(np.dtype(dtype))
        desc = ctypes.cast(ptr[0].descriptor, ctypes.POINTER(make_zero_d_memref_descriptor(ctp)))
        value = desc[0].aligned[desc[0].offset]
        return np.array(value, dtype=dtype)
    return np.array(to_numpy(ptr, dtype), copy=True)


__all__ = ["LINALG", "LLVM_PIPELINE", "ReferenceModule", "compile_reference"]
