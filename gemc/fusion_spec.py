"""From ATen nodes to kernel specs: which ops a fusion group may hold, and its spec.

Not a pass: the vocabulary the ``fuse`` pass consults when it forms groups, and the
function that writes a group as the ``structure`` + ``binding`` the code generator reads
(see ``gemc.backends.triton.codegen.spec`` for the format). Keeping the ATen-side
translation here and the Triton-side rules in ``codegen.ops`` means a test can check the
two agree: every op this module emits has a forward and a backward there.

In the core (imports torch and gemc.ir only): the passes that form groups, the plan
builder that writes them and the runner that decides what runs on packed tokens
(``backends/triton/packed_tokens.is_pointwise``) all read the one vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from gemc import ir

aten = torch.ops.aten

# pow exponents the code generator writes exactly (codegen.ops.POW_EXPONENTS)
POW_EXPONENTS = (-1.0, -0.5, 0.5, 1.0, 2.0, 3.0)

_UNARY = {
    aten.neg.default: "neg",
    aten.silu.default: "silu",
    aten.relu.default: "relu",
    aten.sigmoid.default: "sigmoid",
    aten.tanh.default: "tanh",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.abs.default: "abs",
    aten.clone.default: "identity",
    aten.alias.default: "identity",
}
_BINARY = {
    aten.add.Tensor: "add",
    aten.add.Scalar: "add",
    aten.sub.Tensor: "sub",
    aten.sub.Scalar: "sub",
    aten.mul.Tensor: "mul",
    aten.mul.Scalar: "mul",
    aten.div.Tensor: "div",
    aten.div.Scalar: "div",
    aten.rsub.Scalar: "rsub",
    aten.rsub.Tensor: "rsub",
}
_FLOATS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

Arg = Any  # fx.Node | float | None


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    value = float(x)
    return value if math.isfinite(value) else None


def _arg(x: Any) -> Arg:
    """A node (a tensor), a finite number, or the sentinel ``False`` (not fusible)."""
    if isinstance(x, fx.Node):
        return x if ir.tensor_vals(x) else False
    number = _number(x)
    return number if number is not None else False


def translate(node: fx.Node) -> tuple[str, list[Arg], dict[str, Any]] | None:
    """``(spec op, args, attrs)`` of a pointwise node the code generator can compute, or
    None. Args are tensor nodes or float constants."""
    if node.op != "call_function":
        return None
    t = node.target
    kw = node.kwargs
    if t in _UNARY and len(node.args) == 1 and not (kw.keys() - {"memory_format"}):
        if t is aten.clone.default and kw.get("memory_format") not in (None,
                                                                        torch.contiguous_format):
            return None
        return _checked(_UNARY[t], [node.args[0]], {})
    if t is aten.gelu.default:
        approx = kw.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return _checked("gelu", [node.args[0]], {"approximate": approx})
    if t in _BINARY:
        alpha = _number(kw.get("alpha", node.args[2] if len(node.args) > 2 else 1))
        if alpha is None:
            return None
        attrs = {"alpha": alpha} if alpha != 1.0 else {}
        return _checked(_BINARY[t], list(node.args[:2]), attrs)
    if t is aten.div.Tensor_mode:
        mode = kw.get("rounding_mode", node.args[2] if len(node.args) > 2 else None)
        return _checked("div", list(node.args[:2]), {}) if mode is None else None
    if t is aten.pow.Tensor_Scalar:
        p = _number(node.args[1])
        return _checked("pow", [node.args[0]], {"exponent": p}) if p in POW_EXPONENTS else None
    if t in (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
        return _clamp(node)
    if t is aten.to.dtype or t is aten._to_copy.default:
        return _cast(node)
    if t is aten.where.self:
        return _checked("where", list(node.args[:3]), {})
    return None


UNTAGGED_POINTWISE = frozenset({
    "leaky_relu", "hardtanh", "relu6", "elu", "celu", "selu", "softplus", "hardswish",
    "hardsigmoid", "mish", "silu", "gelu", "threshold", "logit",
    "__and__", "__or__", "__xor__",
})
"""ATen activations that compute each output element from the same input element, for the
torch versions whose ``pointwise`` tag misses them. torch 2.11 exports ``leaky_relu``
untagged (the H200's plan for BST named it "of unknown kind" and pack-jagged-tokens stopped
at it), torch 2.13 tags it. The Python operators on tensors (``mask & keep``) export as
``aten.__and__`` and friends, untagged where ``bitwise_and`` is tagged. The tag stays the
rule; this only fills its gaps."""


def pointwise_op(target: Any) -> bool:
    """Whether ``target`` is an ATen op that ATen tags ``pointwise`` or that is one of
    :data:`UNTAGGED_POINTWISE` (read by classify-ops and by :func:`elementwise`)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target._opname in UNTAGGED_POINTWISE


def elementwise(node: fx.Node) -> bool:
    """Whether ``node`` computes each output element from the same element of its (broadcast)
    tensor operands: an op the code generator computes (:func:`translate`), or any
    functional ATen op tagged ``pointwise`` (``leaky_relu``, ``elu``, ``masked_fill``...;
    :func:`pointwise_op`). Why the tag and not a list: the padding follower and the packed
    runner need only that property (an op per token keeps a token's padding its own), which
    ATen states for every op it has; a list would miss the activation a model happens to
    use."""
    if translate(node) is not None:
        return True
    t = node.target if node.op == "call_function" else None
    if not pointwise_op(t) or t._schema.is_mutable:
        return False
    return any(isinstance(a, fx.Node) for a in node.args)


def _checked(op: str, raw: list[Any], attrs: dict[str, Any]) -> tuple[str, list[Arg], dict] | None:
    args = [_arg(a) for a in raw]
    if any(a is False for a in args) or not any(isinstance(a, fx.Node) for a in args):
        return None
    return op, args, attrs


def _clamp(node: fx.Node) -> tuple[str, list[Arg], dict] | None:
    t = node.target
    names = {aten.clamp.default: ("min", "max"), aten.clamp_min.default: ("min",),
             aten.clamp_max.default: ("max",)}[t]
    attrs: dict[str, Any] = {}
    for i, name in enumerate(names):
        raw = node.kwargs.get(name, node.args[i + 1] if len(node.args) > i + 1 else None)
        if raw is None:
            continue
        value = _number(raw)
        if value is None:
            return None
        attrs[name] = value
    return _checked("clamp", [node.args[0]], attrs)


def _cast(node: fx.Node) -> tuple[str, list[Arg], dict] | None:
    if node.target is aten.to.dtype:
        dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
        extra = {k: v for k, v in node.kwargs.items() if k not in ("dtype", "non_blocking",
                                                                   "copy")}
    else:
        dtype = node.kwargs.get("dtype")
        extra = {k: v for k, v in node.kwargs.items() if k not in ("dtype",) and v is not None
                 and k != "non_blocking"}
        if len(node.args) > 1:
            return None
    if extra or dtype not in _FLOATS:
        return None
    return _checked("cast", [node.args[0]], {"dtype": _FLOATS[dtype]})


def dtype_str(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def broadcast_flags(operand: tuple[int, ...], consumer: tuple[int, ...]) -> list[bool] | None:
    """Per dim of ``consumer``, whether ``operand`` is broadcast along it (None: it does not
    broadcast to that shape)."""
    if len(operand) > len(consumer):
        return None
    padded = (1,) * (len(consumer) - len(operand)) + tuple(operand)
    flags = []
    for o, c in zip(padded, consumer):
        if o == c:
            flags.append(False)
        elif o == 1:
            flags.append(True)
        else:
            return None
    return flags


class _Builder:
    def __init__(self, members: list[fx.Node]) -> None:
        self.members = members
        self.index = {n: k for k, n in enumerate(members)}
        self.inputs: list[fx.Node] = []
        self.slots: list[dict[str, Any]] = []
        self.slot_keys: dict[tuple, int] = {}
        self.ops: list[dict[str, Any]] = []

    def input(self, node: fx.Node) -> int:
        if node not in self.inputs:
            self.inputs.append(node)
        return self.inputs.index(node)

    def ref(self, arg: Arg, consumer: int) -> list[Any] | None:
        if arg is None:
            return None
        if not isinstance(arg, fx.Node):
            return ["c", float(arg)]
        if arg in self.index:
            return ["v", self.index[arg]]
        i = self.input(arg)
        shape = ir.shape_of(self.members[consumer])
        flags = broadcast_flags(ir.shape_of(arg) or (), shape)
        if flags is None:
            raise ValueError(f"{arg.name} does not broadcast to {shape}")
        key = (i, shape, tuple(flags))
        if key not in self.slot_keys:
            self.slot_keys[key] = len(self.slots)
            self.slots.append({"input": i, "consumer": consumer, "bcast": flags})
        return ["s", self.slot_keys[key]]

    def whole(self, arg: Arg) -> list[Any] | None:
        return None if arg is None else ["i", self.input(arg)]


def root_args(node: fx.Node) -> tuple[str, list[Arg], dict[str, Any]]:
    """The root op of a norm / reduction / GEMM group, as (op, args, attrs)."""
    t = node.target
    args = list(node.args) + [None] * 6
    if t is aten.linear.default:
        return "linear", [args[0], args[1], node.kwargs.get("bias", args[2])], {}
    if t is aten.layer_norm.default:
        eps = node.kwargs.get("eps", args[4] if args[4] is not None else 1e-5)
        return "layer_norm", [args[0], node.kwargs.get("weight", args[2]),
                              node.kwargs.get("bias", args[3])], {"eps": float(eps)}
    if t in (aten.sum.dim_IntList, aten.mean.dim):
        return ("sum" if t is aten.sum.dim_IntList else "mean"), [args[0]], {}
    raise ValueError(f"{node.name} is not a root op")


def build(kind: str, members: list[fx.Node], outputs: list[fx.Node]
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(structure, binding)`` of a group whose nodes are ``members`` (topological order)."""
    b = _Builder(members)
    for k, node in enumerate(members):
        tr = translate(node)
        if tr is None:
            op, args, attrs = root_args(node)
        else:
            op, args, attrs = tr
        if op == "linear":
            refs = [b.whole(a) for a in args]
        elif op == "layer_norm":
            refs = [b.ref(args[0], k), b.ref(args[1], k) if args[1] is not None else None,
                    b.ref(args[2], k) if args[2] is not None else None]
        else:
            refs = [b.ref(a, k) for a in args]
        entry: dict[str, Any] = {"op": op, "args": refs}
        if attrs:
            entry["attrs"] = attrs
        b.ops.append(entry)
    shapes = [tuple(ir.shape_of(n) or ()) for n in members]
    class_of: dict[tuple[int, ...], int] = {}
    classes = [class_of.setdefault(s, len(class_of)) for s in shapes]
    structure = {
        "kind": kind,
        "inputs": len(b.inputs),
        "slots": b.slots,
        "ops": b.ops,
        "classes": classes,
        "ranks": [len(s) for s in class_of],
        "outputs": [b.index[n] for n in outputs],
    }
    binding = {
        "inputs": [n.name for n in b.inputs],
        "outputs": [n.name for n in outputs],
        "shapes": [list(s) for s in shapes],
        "dtypes": [dtype_str(ir.dtype_of(n)) for n in outputs],
    }
    return structure, binding
