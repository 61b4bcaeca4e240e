"""Dumps: one text file per pass, readable without gemc, and a manifest.

Each file opens with a header line naming the pass, then one line per node:

    %linear_3 = aten.linear.default(%x, %p_w, %p_b) :: f32[4096,256]  {kind=gemm flops=... region=tower}

so a person can diff two dumps with ordinary tools, and a test can FileCheck them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from gemc import ir

_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPE_SHORT[getattr(torch, _name)] = _name.replace("float8_", "f8")


def type_str(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = _DTYPE_SHORT.get(value.dtype, str(value.dtype).removeprefix("torch."))
        return f"{dtype}[{','.join(str(int(s)) for s in value.shape)}]"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(type_str(v) for v in value) + ")"
    if value is None:
        return "none"
    return type(value).__name__


def _arg_str(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_arg_str(a) for a in arg)
        return f"[{inner}]"
    if isinstance(arg, torch.dtype):
        return _DTYPE_SHORT.get(arg, str(arg))
    return repr(arg)


def _annotation_str(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_annotation_str(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def format_node(node: fx.Node) -> str:
    meta = ir.gemc_meta(node)
    notes = " ".join(f"{k}={_annotation_str(v)}" for k, v in meta.items())
    typ = type_str(node.meta.get("val"))
    if node.op == "placeholder":
        head = f"%{node.name} = input"
    elif node.op == "output":
        head = f"return {_arg_str(node.args[0])}"
    else:
        args = [_arg_str(a) for a in node.args]
        args += [f"{k}={_arg_str(v)}" for k, v in node.kwargs.items()]
        head = f"%{node.name} = {_target_str(node.target)}({', '.join(args)})"
    return f"{head} :: {typ}" + (f"  {{{notes}}}" if notes else "")


def _target_str(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def format_graph(gm: fx.GraphModule, header: str) -> str:
    lines = [f"# {header}"]
    lines.extend(format_node(n) for n in gm.graph.nodes)
    return "\n".join(lines) + "\n"
