"""The kernel spec: what a fusion group computes, in the form the code generator reads.

A spec has two halves, so that one generated source serves every group of the same
structure (the two MLPs of a block, every block of a stack):

``structure`` (hashed into the source; no shapes, no node names)::

    {"kind": "pointwise" | "norm" | "reduction" | "gemm_epilogue",
     "inputs": n,                         # external tensors, in binding order
     "slots": [{"input": i, "consumer": k, "bcast": [bool, ...]}, ...],
     "ops": [{"op": name, "args": [ref | None, ...], "attrs": {...}}, ...],
     "classes": [c, ...],                 # shape class of each op value (equal shapes)
     "ranks": [r, ...],                   # rank of each shape class
     "outputs": [k, ...]}                 # op values the kernel stores

A ``ref`` is ``["v", k]`` (op value k), ``["s", j]`` (slot j: input ``i`` loaded as a tile
of its consumer's shape, broadcast over the dims flagged in ``bcast``), ``["c", x]`` (a
float constant) or ``["i", i]`` (an input taken whole: the GEMM's x, w, b). Every op value
is an ``[M, N]`` tile of the group's iteration space (N the last dim), except a
reduction's result.

Root ops, one per kind besides pointwise: ``linear`` (op 0 of a gemm_epilogue: args x, w,
bias-or-None), ``layer_norm`` (args x, weight-or-None, bias-or-None; attrs eps; over the
last dim) and ``sum``/``mean`` (last op of a reduction, over dim -2 of its argument).

``binding`` (per group, kept in the plan next to the source hash)::

    {"inputs": [node, ...], "outputs": [node, ...],
     "shapes": [[...] per op value], "dtypes": [dtype of each output]}

This module also owns the kernel parameter names, which the emitters write into kernel
signatures and the host passes back by keyword, so the two cannot drift apart.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

KINDS = ("pointwise", "norm", "reduction", "gemm_epilogue")
ROOTS = {"linear", "layer_norm", "sum", "mean"}


def canonical(obj: Any) -> str:
    """Stable JSON text: the hash of a spec must not depend on dict order."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def lead_rank(slot: dict[str, Any]) -> int:
    """Leading (non-last) dims of a slot's consumer shape."""
    return len(slot["bcast"]) - 1


def grad_mode(kind: str, bcast: list[bool]) -> str:
    """How a kernel returns the gradient of a slot.

    ``full``: the slot is not broadcast, its gradient is stored element for element.
    ``col``: a per-column operand (a LayerNorm weight, a bias, a per-feature scale): each
    program stores its tile's column sums, one partial row per row-program, added up on
    the host.
    ``row``: a per-row operand (a ``[B, L, 1]`` mask or scale): each program stores its
    tile's row sums, one partial column per column-program.
    ``expand``: any other broadcast operand (and every broadcast operand of a GEMM
    epilogue, whose fused path walks rows in autotuned blocks): the elementwise gradient
    is stored at the consumer's shape and summed to the operand's shape on the host.
    Why the partial sums: storing a broadcast operand's gradient at full shape in fp32
    writes and reads back twice the bytes of the whole activation.
    """
    if not any(bcast):
        return "full"
    if kind == "gemm_epilogue":
        return "expand"
    if all(bcast[:-1]) and not bcast[-1]:
        return "col"
    if not any(bcast[:-1]) and bcast[-1]:
        return "row"
    return "expand"


def reduced_value(structure: dict[str, Any]) -> int | None:
    """The op value a reduction kernel reduces (its last op), or None for other kinds."""
    return len(structure["ops"]) - 1 if structure["kind"] == "reduction" else None


def kernel_classes(structure: dict[str, Any], *, backward: bool) -> list[int]:
    """Shape classes whose leading sizes a kernel takes (to address operands by row).

    Forward kernels address slots; backward kernels also the output gradients. A
    reduction's own (reduced) class is never addressed: its gradient is read through the
    class of the reduced argument, broadcast over dim -2.
    """
    classes = {structure["classes"][s["consumer"]] for s in structure["slots"]}
    if backward:
        red = reduced_value(structure)
        for k in structure["outputs"]:
            if k == red:
                classes.add(structure["classes"][structure["ops"][k]["args"][0][1]])
            else:
                classes.add(structure["classes"][k])
    return sorted(classes)


def validate(structure: dict[str, Any]) -> None:
    """Structural checks the emitters rely on; raises ValueError naming the fault."""
    if structure.get("kind") not in KINDS:
        raise ValueError(f"unknown kernel kind {structure.get('kind')!r}")
    ops = structure["ops"]
    if len(structure["classes"]) != len(ops):
        raise ValueError("one shape class per op value is required")
    if any(not 0 <= c < len(structure["ranks"]) for c in structure["classes"]):
        raise ValueError("every shape class needs a rank")
    for j, slot in enumerate(structure["slots"]):
        if not 0 <= slot["input"] < structure["inputs"]:
            raise ValueError(f"slot {j} names input {slot['input']}")
        if not 0 <= slot["consumer"] < len(ops):
            raise ValueError(f"slot {j} names consumer {slot['consumer']}")
    for k, op in enumerate(ops):
        for ref in op["args"]:
            if ref is None:
                continue
            tag, idx = ref
            if tag == "v" and not 0 <= idx < k:
                raise ValueError(f"op {k} reads value {idx} before it exists")
            if tag == "s" and not 0 <= idx < len(structure["slots"]):
                raise ValueError(f"op {k} reads unknown slot {idx}")
    if not structure["outputs"]:
        raise ValueError("a kernel must store at least one output")
