"""classify-ops: give every node a kind, and GEMM / attention nodes their problem shape.

The kind decides how the cost model prices a node and which fusions and precisions apply,
so an op we do not know is kept (kind ``other``, priced by bytes) and named in a warning
rather than dropped.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext
from gemc.fusion_spec import pointwise_op
from gemc.ir import OpKind

_GEMM = {"linear", "mm", "addmm", "bmm", "matmul", "baddbmm", "addbmm", "_scaled_mm", "einsum"}
_CONV = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution",
         "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}
"""Convolutions run as implicit GEMMs (cuDNN): SASRec-family feed-forwards are
``Conv1d(d, d, kernel_size=1)``, which is a Linear over the channels of every position."""
_ATTENTION = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
}
_EMBEDDING = {"embedding", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only"}
_NORM = {
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "_fused_rms_norm",
    "batch_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "group_norm",
    "native_group_norm",
    "softmax",
    "_softmax",
    "log_softmax",
    "_log_softmax",
    "normalize",
}
_LOSS = {
    "binary_cross_entropy_with_logits",
    "binary_cross_entropy",
    "cross_entropy",
    "cross_entropy_loss",  # F.cross_entropy as export keeps it (HSTU's next-item loss)
    "nll_loss",
    "nll_loss2d",
    "nll_loss_nd",
    "nll_loss_forward",
    "mse_loss",
    "smooth_l1_loss",
    "huber_loss",
    "l1_loss",
}
_REDUCTION = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "prod",
    "var",
    "std",
    "var_mean",
    "logsumexp",
    "norm",
    "linalg_vector_norm",
    "cumsum",
    "argmax",
    "argmin",
    "any",
    "all",
    "count_nonzero",
}
_VIEW = {
    "view",
    "reshape",
    "_unsafe_view",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "expand",
    "broadcast_tensors",  # nn.MSELoss's decomposition: expands, one view per input
    "t",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "alias",
    "detach",
    "flatten",
    "unflatten",
    "narrow",
    "as_strided",
    "view_as",
    "expand_as",
    "movedim",
    "contiguous",
    "lift_fresh_copy",
    "_assert_tensor_metadata",
    "sym_size",
    "sym_numel",
}
_INDEX = {
    # FBGEMM's jagged <-> padded ops (generative-recommenders, TorchRec): gathers and scatters
    # over offsets, priced as the bytes they move
    "jagged_to_padded_dense",
    "dense_to_jagged",
    "jagged_to_padded_dense_forward",
    "dense_to_jagged_forward",
    "index",
    "index_put",
    "index_put_",
    "_index_put_impl_",
    "index_select",
    "gather",
    "scatter",
    "scatter_add",
    "scatter_reduce",
    "repeat_interleave",
    "nonzero",
    "masked_select",
    "index_add",
    "index_copy",
    "index_fill",
    "take",
    "searchsorted",
    "bucketize",
    "segment_reduce",
    "_segment_reduce",
}
# Ops that write memory like an elementwise op but carry no pointwise tag.
_COPY_LIKE = {
    "cat",
    "stack",
    "clone",
    "copy",
    "copy_",
    "_to_copy",
    "to",
    "pad",
    "constant_pad_nd",
    "zeros",
    "zeros_like",
    "new_zeros",
    "ones",
    "ones_like",
    "new_ones",
    "full",
    "full_like",
    "new_full",
    "empty",
    "empty_like",
    "new_empty",
    "arange",
    "eye",
    "fill",
    "fill_",
    "zero_",
    "tril",
    "triu",
    "repeat",
    "tile",
    "dropout",
    "native_dropout",
    "roll",
    "flip",
    "where",
    "masked_fill",
    "clamp",
    "clamp_min",
    "clamp_max",
    "type_as",
    "scalar_tensor",
    "lerp",
    "embedding_renorm_",
    "_local_scalar_dense", "triu_indices", "tril_indices",
}


def op_name(node: fx.Node) -> str:
    """The ATen packet name of a call_function node ('linear' for aten.linear.default)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    return getattr(target, "__name__", str(target))


def classify(node: fx.Node) -> OpKind:
    if node.op == "placeholder":
        return OpKind.INPUT
    if node.op == "get_attr":
        return OpKind.PARAM
    if node.op == "output":
        return OpKind.OUTPUT
    if node.op != "call_function":
        return OpKind.OTHER
    if node.target is operator.getitem:
        return OpKind.VIEW
    name = op_name(node)
    names_of_node = {name, name.rstrip("_")}  # in-place variants (add_) classify as their op
    for names, kind in (
        (_GEMM | _CONV, OpKind.GEMM),
        (_ATTENTION, OpKind.ATTENTION),
        (_EMBEDDING, OpKind.EMBEDDING),
        (_NORM, OpKind.NORM),
        (_LOSS, OpKind.LOSS),
        (_VIEW, OpKind.VIEW),
        (_INDEX, OpKind.INDEX),
        (_REDUCTION, OpKind.REDUCTION),
    ):
        if names_of_node & names:
            return kind
    target = node.target
    if pointwise_op(target):
        return OpKind.POINTWISE
    if names_of_node & _COPY_LIKE:
        return OpKind.POINTWISE
    if _returns_a_view(target):
        return OpKind.VIEW
    if not isinstance(target, torch._ops.OpOverload):
        return OpKind.VIEW if _is_symbolic(node) else OpKind.OTHER
    return OpKind.OTHER


def _returns_a_view(target: object) -> bool:
    """The op's schema says its result aliases an input it does not write
    (``Tensor(a) self -> Tensor(a)``): a view whatever its name (``x.T`` exports as
    ``numpy_T``, ``x.mT`` as ``_mT``'s decomposition, ``swapaxes``, ``diagonal``...)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    rets = schema.returns
    if len(rets) != 1 or rets[0].alias_info is None or rets[0].alias_info.is_write:
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _is_symbolic(node: fx.Node) -> bool:
    """Python-level arithmetic on sizes (operator.mul on SymInts) costs nothing on the GPU."""
    return not ir.tensor_vals(node)


def _shape(arg: object) -> tuple[int, ...] | None:
    return ir.shape_of(arg) if isinstance(arg, fx.Node) else None


def gemm_problem(node: fx.Node) -> dict[str, int] | None:
    """(batch, m, n, k) of a GEMM node, from its operands and result shapes."""
    out = ir.shape_of(node)
    name = op_name(node)
    args = node.args
    if out is None:
        return None
    if name == "linear":
        x, w = _shape(args[0]), _shape(args[1])
        if x is None or w is None:
            return None
        m = 1
        for s in x[:-1]:
            m *= s
        return {"batch": 1, "m": m, "n": w[0], "k": w[1]}
    if name in ("mm", "addmm", "_scaled_mm"):
        a = _shape(args[1] if name == "addmm" else args[0])
        return {"batch": 1, "m": out[0], "n": out[1], "k": a[-1] if a else 0}
    if name in ("bmm", "baddbmm", "matmul", "addbmm"):
        a = _shape(args[1] if name in ("baddbmm", "addbmm") else args[0])
        k = a[-1] if a else 0
        if len(out) == 1:
            return {"batch": 1, "m": 1, "n": out[0], "k": k}
        batch = 1
        for s in out[:-2]:
            batch *= s
        return {"batch": batch, "m": out[-2], "n": out[-1], "k": k}
    if name == "einsum":
        return _einsum_problem(node)
    if name in _CONV:
        return _conv_problem(node, out)
    return None


def _conv_problem(node: fx.Node, out: tuple[int, ...]) -> dict[str, int] | None:
    """A convolution as the implicit GEMM cuDNN runs: per group, (batch x output positions)
    rows, the group's output channels as columns, (input channels of the group x kernel
    positions) contracted. A transposed convolution contracts the same products."""
    w = _shape(node.args[1]) if len(node.args) > 1 else None
    if w is None or len(out) < 2 or len(w) != len(out):
        return None
    name = op_name(node)
    at = 8 if name in ("convolution", "_convolution") else 6  # groups' position in the schema
    groups = node.args[at] if len(node.args) > at else node.kwargs.get("groups", 1)
    if not isinstance(groups, int) or groups < 1:
        return None
    positions = 1
    for s in out[2:]:
        positions *= s
    kernel = 1
    for s in w[2:]:
        kernel *= s
    transposed = name.startswith("conv_transpose") or (
        name in ("convolution", "_convolution") and len(node.args) > 6 and node.args[6] is True)
    # weight [C_out, C_in / g, *k]; transposed: [C_in, C_out / g, *k]
    n = w[1] if transposed else w[0] // groups
    k = (w[0] // groups if transposed else w[1]) * kernel
    return {"batch": groups, "m": out[0] * positions, "n": n, "k": k}


def _einsum_problem(node: fx.Node) -> dict[str, int] | None:
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or len(operands) != 2 or "->" not in equation:
        return None
    lhs, out_labels = equation.replace(" ", "").split("->")
    a_labels, b_labels = lhs.split(",")
    sizes: dict[str, int] = {}
    for labels, operand in ((a_labels, operands[0]), (b_labels, operands[1])):
        shape = _shape(operand)
        if shape is None or len(shape) != len(labels):
            return None
        sizes.update(zip(labels, shape))
    contracted = [c for c in sizes if c not in out_labels]
    batch_labels = [c for c in out_labels if c in a_labels and c in b_labels]
    m_labels = [c for c in out_labels if c in a_labels and c not in b_labels]
    n_labels = [c for c in out_labels if c in b_labels and c not in a_labels]

    def prod(labels: list[str]) -> int:
        p = 1
        for c in labels:
            p *= sizes[c]
        return p

    return {
        "batch": prod(batch_labels),
        "m": prod(m_labels),
        "n": prod(n_labels),
        "k": prod(contracted),
    }


def attention_problem(node: fx.Node) -> dict[str, object] | None:
    q, k = _shape(node.args[0]), _shape(node.args[1])
    if q is None or k is None or len(q) < 3:
        return None
    batch = 1
    for s in q[:-3]:
        batch *= s
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    return {
        "batch": batch,
        "heads": q[-3],
        "q_len": q[-2],
        "kv_len": k[-2],
        "head_dim": q[-1],
        "causal": bool(causal),
        "masked": mask is not None,
    }


@dataclass(frozen=True)
class ClassifyOps:
    """Annotates ``gemc.kind`` on every node, ``gemc.gemm``/``gemc.attention`` shapes, and
    ``gemc.param`` (the FQN) on placeholders that carry weights, ``gemc.constant`` on the
    lifted tensor constants'."""

    name: ClassVar[str] = "classify-ops"
    requires: ClassVar[tuple[str, ...]] = ()

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        unknown: set[str] = set()
        for node in gm.graph.nodes:
            kind = classify(node)
            if node.op == "placeholder" and node.name in ctx.param_fqns:
                kind = OpKind.PARAM
                node.meta[ir.PARAM] = ctx.param_fqns[node.name]
            elif node.op == "placeholder" and node.name in ctx.constant_fqns:
                node.meta[ir.CONSTANT] = ctx.constant_fqns[node.name]
            node.meta[ir.KIND] = kind.value
            if kind is OpKind.GEMM:
                problem = gemm_problem(node)
                if problem is not None:
                    node.meta[ir.GEMM] = problem
            elif kind is OpKind.ATTENTION:
                problem = attention_problem(node)
                if problem is not None:
                    node.meta[ir.ATTENTION] = problem
            elif kind is OpKind.OTHER and node.op == "call_function":
                unknown.add(str(node.target))
        if unknown:
            ctx.warn(
                "classify-ops: ops of unknown kind, priced by bytes moved only (no fusion, no "
                f"precision change): {', '.join(sorted(unknown))}"
            )
        return PassResult(gm, True)
