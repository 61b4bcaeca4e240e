"""gemc's kernels as ``torch.library`` custom ops, so Inductor compiles the graph around them.

Why custom ops: the runner trains the rewritten graph through ``torch.compile``. An
``autograd.Function`` that launches Triton kernels from Python is opaque to Dynamo (it
breaks the graph or traces into the launcher); a custom op with a fake (meta)
implementation and an autograd formula is one node of an ordinary ATen graph: Dynamo and
AOTAutograd trace it by its fake, Inductor fuses everything around it and calls the kernel.

One op per kernel *kind*, not per kernel:

* ``gemc::fused_group(kernel, inputs, autocast)`` and ``gemc::fused_group_backward``: every
  generated group (GEMM epilogue, norm, pointwise, reduction). Its source is generated per
  group at compile time, so the op is keyed by a string ``kernel`` id, the hash of the
  group's source digest and binding, under which :func:`register_group` puts the loaded
  launcher when the runner builds its graph (the plan carries the sources). The op's schema
  is the same in every process and torch version; what varies is data in a registry.
* ``gemc::jagged_attention`` / ``gemc::jagged_attention_backward``: padded ``[B, H, L, D]``
  in, padded out (plus the row logsumexp, padded, for the backward): the values + offsets
  kernels run inside, so the op's shapes depend on shapes only (no data-dependent sizes for
  the compiler to trace, no host read of the token count).
* ``gemc::jagged_attention_values`` (and its backward): the same kernels on the ``[T, H, D]``
  values of a packed token region, in place (with an additive bias per key: a region
  with padding representatives' attention, ``packed_tokens.rep_attention``).
* ``gemc::padded_silu_attention`` (and its backward): HSTU's pointwise attention on the
  padded ``[B, L, H, D]`` layout read in place, only each row's real positions computed;
  ``gemc::jagged_silu_attention_values`` (and its backward): the same kernels on the
  ``[T, H, D]`` values of a packed token region.
* ``gemc::jagged_query_attention`` (and its backward) with ``gemc::query_prefix_lengths``:
  padded history queries over dense keys, only the real query rows computed; the lengths
  from a mask checked on the device (a row that is no prefix computes every query row).
* ``gemc::rep_key_bias``: that attention's per-key bias from its key mask and the layout's
  offsets, one kernel (:mod:`.rep_key_bias`, defined there: a ``triton_op`` on a GPU,
  whose launch Inductor compiles into its own code).
* ``gemc::gather_tokens``, ``gemc::segment_sum`` (and ``gemc::segment_sum_rows``, the
  gather's backward): a packed region's entries and its sums over a row's tokens, whose
  gradients add up in fp32 without atomics.
* ``gemc::embedding_bag`` / ``gemc::embedding_bag_update``: the batched lookup, and its
  backward, the fused optimizer step, which writes the registered module's flat weight
  buffer and optimizer state (module state the op owns, not arguments: see
  :func:`embedding_bag_update`; a ``0-d`` anchor that requires grad keeps the lookup in the
  autograd graph, its gradient a zero the optimizer never reads). Traced into the compiled
  graph like any op: the lookup is no eager island.
* ``gemc::table_lookup`` / ``gemc::table_lookup_backward``: one table's lookup by its
  registered one-rank table module (the sparse route), whose backward hands the output
  gradient to the module; the module makes the table's sparse gradient from it before the
  sparse optimizer's step (``ShardedEmbedding.replay_deferred``). No eager island either.

Outputs are allocated contiguous in the real and the fake implementation alike: Inductor
indexes a custom op's outputs with the fake's strides.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .jagged_attention import (
    _attention_backward,
    _attention_forward,
    _meta,
    bias_grad_buffer,
    bias_grad_sum,
    broadcast_bias,
    last_dim_contiguous,
)
from .packed_tokens import TokenLayout
from .rep_key_bias import rep_key_bias_op as rep_key_bias_op  # noqa: F401 - registers it
from .segment_sum import segment_sum_rows as _segment_sum_rows
from .varlen_key_attention import attention_backward as _varlen_backward
from .varlen_key_attention import attention_forward as _varlen_forward

__all__ = ["group_key", "register_group", "register_table", "register_lookup", "dtype_name"]

_HOST_SIDE: dict[str, Any] = (
    {"tags": (torch.Tag.cudagraph_unsafe,)}
    if hasattr(torch.Tag, "cudagraph_unsafe")
    and "tags" in inspect.signature(torch.library.custom_op).parameters else {})
"""For ops that keep host state (the optimizer's step count): a CUDA graph replay would skip
that Python, so Inductor must not capture them (it splits the graph around them, or leaves
it uncaptured)."""

_GROUPS: dict[str, Any] = {}  # kernel id -> codegen.host._Impl (the group's launcher)
_TABLES: dict[str, Any] = {}  # table group id -> BatchedEmbeddingBag
_LOOKUPS: dict[str, Any] = {}  # table fqn -> the ShardedEmbedding answering its lookups


def dtype_name(dtype: torch.dtype | None) -> str:
    """The op-argument spelling of an autocast dtype ("" for none)."""
    return "" if dtype is None else str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype | None:
    return getattr(torch, name) if name else None


def group_key(entry: dict[str, Any]) -> str:
    """The kernel id of a generated group: its source's sha256 and its binding (shapes,
    dtypes), hashed. Two groups with one source and one binding share a launcher."""
    blob = json.dumps([entry["sha256"], entry["binding"]], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def register_group(entry: dict[str, Any], impl: Any) -> str:
    """Make ``gemc::fused_group`` run ``impl`` (a group's launcher) under its kernel id."""
    key = group_key(entry)
    _GROUPS.setdefault(key, impl)
    return key


def register_table(name: str, module: Any) -> None:
    """Make ``gemc::embedding_bag`` run ``module`` (a BatchedEmbeddingBag) under ``name``,
    its launch layout made now, ahead of any graph. Why: the module makes its layout's five
    small tensors at its first lookup and keeps them; made inside a compiled graph's first
    run under CUDA graphs (``torch.compile(mode="reduce-overhead")``), they were tensors of
    the graph's memory pool that outlive the run without being its outputs, which the
    CUDA-graph trees refuse (TransAct's gemc-cudagraphs step on an H100, twenty-ninth
    session: "Detected 5 tensor(s) in the cudagraph pool not tracked as outputs")."""
    module.layout()
    _TABLES[name] = module


def register_lookup(name: str, module: Any) -> None:
    """Make ``gemc::table_lookup`` answer table ``name`` with ``module`` (a one-rank
    ShardedEmbedding: its lookup, its sparse gradient, the sparse optimizer's update)."""
    _LOOKUPS[name] = module


def _group(kernel: str) -> Any:
    try:
        return _GROUPS[kernel]
    except KeyError:
        raise KeyError(f"gemc: no generated kernel registered under id {kernel!r}; the "
                       "runner registers a plan's groups when it builds its graph") from None


# ---- generated groups -----------------------------------------------------------------------


def _extra_saved(impl: Any) -> bool:
    """Whether the forward returns a buffer only its backward reads (a GEMM's pre-epilogue
    ``z`` that is not itself an output)."""
    return bool(getattr(impl, "save_z", False)) and not getattr(impl, "z_out", False)


def _out_specs(impl: Any, inputs: Sequence[Tensor], autocast: str
               ) -> list[tuple[tuple[int, ...], torch.dtype]]:
    dts = impl._out_dtypes(inputs, _dtype(autocast), None)
    specs = [(impl.shapes[k], dts[j]) for j, k in enumerate(impl.st["outputs"])]
    if _extra_saved(impl):
        specs.append((impl.shapes[0], inputs[impl.ix].dtype))
    return specs


@torch.library.custom_op("gemc::fused_group", mutates_args=())
def fused_group(kernel: str, inputs: list[Tensor], autocast: str) -> list[Tensor]:
    """A generated group's forward: its outputs (then ``z`` where the backward needs it)."""
    impl = _group(kernel)
    specs = _out_specs(impl, inputs, autocast)
    outs, saved = impl.forward(inputs, [dt for _, dt in specs[:len(impl.st["outputs"])]])
    result = list(outs)
    if _extra_saved(impl):
        z = saved[len(inputs)]
        result.append(z.reshape(specs[-1][0]))
    return [t if t.is_contiguous() else t.contiguous() for t in result]


@fused_group.register_fake
def _fused_group_fake(kernel: str, inputs: list[Tensor], autocast: str) -> list[Tensor]:
    impl = _group(kernel)
    return [inputs[0].new_empty(shape, dtype=dt) for shape, dt in
            _out_specs(impl, inputs, autocast)]


@torch.library.custom_op("gemc::fused_group_backward", mutates_args=())
def fused_group_backward(kernel: str, saved: list[Tensor], grads: list[Tensor | None],
                         needs: list[bool]) -> list[Tensor]:
    """The generated backward: the gradients of the inputs in ``needs`` (in their dtypes)."""
    impl = _group(kernel)
    n_in = len(needs)
    grads_in = impl.backward(saved, grads, tuple(needs))
    # a gradient the backward passes through (an input's gradient is an output's) would
    # alias an argument or another return, which a custom op may not do: copy it then
    taken = {t.untyped_storage().data_ptr() for t in (*saved, *grads) if t is not None}
    out = []
    for i in range(n_in):
        if not needs[i]:
            continue
        g = grads_in[i]
        x = saved[i]
        g = torch.zeros(x.shape, dtype=x.dtype, device=x.device) if g is None \
            else g.to(x.dtype).reshape(x.shape)
        if not g.is_contiguous() or g.untyped_storage().data_ptr() in taken:
            g = g.contiguous() if not g.is_contiguous() else g.clone()
        taken.add(g.untyped_storage().data_ptr())
        out.append(g)
    return out


@fused_group_backward.register_fake
def _fused_group_backward_fake(kernel: str, saved: list[Tensor], grads: list[Tensor | None],
                               needs: list[bool]) -> list[Tensor]:
    return [saved[i].new_empty(saved[i].shape) for i in range(len(needs)) if needs[i]]


def _fused_setup(ctx: Any, inputs: tuple[Any, ...], output: list[Tensor]) -> None:
    kernel, tensors, _ = inputs
    impl = _group(kernel)
    n_out = len(impl.st["outputs"])
    if _extra_saved(impl):
        extra = [output[n_out]]
    elif getattr(impl, "save_z", False):  # z is one of the outputs
        extra = [output[impl.st["outputs"].index(0)]]
    else:
        extra = [output[j] for j in getattr(impl, "reloaded", ())]
    ctx.kernel = kernel
    ctx.n_out = n_out
    ctx.needs = [bool(t.requires_grad) and t.is_floating_point() for t in tensors]
    ctx.save_for_backward(*tensors, *extra)


def _fused_backward(ctx: Any, grads: list[Tensor | None]) -> tuple[Any, ...]:
    saved = list(ctx.saved_tensors)
    grads = list(grads)[:ctx.n_out]
    needs = ctx.needs
    result: list[Tensor | None] = [None] * len(needs)
    if any(needs):
        got = iter(torch.ops.gemc.fused_group_backward(ctx.kernel, saved, grads, needs))
        result = [next(got) if need else None for need in needs]
    return None, result, None


fused_group.register_autograd(_fused_backward, setup_context=_fused_setup)


# ---- jagged attention over padded values ----------------------------------------------------


class _Slots:
    """Where the real tokens of a padded ``[B, L, ...]`` batch go, without reading their
    count on the host: room for ``B * max_len`` tokens (every length is clamped to at most
    ``max_len``), the attention's offsets, and per slot the padded position it comes from
    and goes to (a spare slot reads position 0 and writes one past the end, a row that is
    dropped). Why: the exact count is data, and reading it drains the GPU's queue twice per
    attention and step (forward and backward) and keeps CUDA graphs out."""

    def __init__(self, offsets: Tensor, clamp_min: int, max_len: int) -> None:
        batch = offsets.shape[0] - 1
        self.layout = TokenLayout(TokenLayout._offsets(offsets, clamp_min, max_len),
                                  batch * max_len, batch, max_len)
        self.offsets = self.layout.offsets
        self.batch = batch

    def _flat(self, length: int, out: bool) -> Tensor:
        row, pos = self.layout.index("row_out" if out else "row"), self.layout.index("pos")
        if not out:
            return row * length + pos
        return torch.where(row < self.batch, row * length + pos, self.batch * length)

    def values(self, x: Tensor) -> Tensor:
        """``[B, L, *f]`` padded -> ``[room, *f]`` values (spare slots: copies of row 0)."""
        flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
        return flat.index_select(0, self._flat(x.shape[1], False))

    def padded(self, values: Tensor, length: int) -> Tensor:
        """``[room, *f]`` values -> ``[B, length, *f]``, zeros where no token is."""
        full = values.new_zeros((self.batch * length + 1, *values.shape[1:]))
        full = full.index_copy(0, self._flat(length, True), values)[:-1]
        return full.view(self.batch, length, *values.shape[1:])


@torch.library.custom_op("gemc::jagged_attention", mutates_args=())
def jagged_attention(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, clamp_min: int,
                     max_len: int, scale: float) -> tuple[Tensor, Tensor]:
    """Attention within each row's real tokens of padded ``q, k, v [B, H, L, D]``: the
    output ``[B, max_len, H, D]`` (zero past a row's length) and the row logsumexp
    ``[B, max_len, H]`` (for the backward)."""
    slots = _Slots(offsets, clamp_min, max_len)
    qj, kj, vj = (slots.values(x.transpose(1, 2)) for x in (q, k, v))
    out, lse = _attention_forward(qj, kj, vj, slots.offsets, max_len, scale,
                                  _meta(qj, False, "softmax", "max_len", max_len))
    return (slots.padded(out, max_len).contiguous(),
            slots.padded(lse.t(), max_len).contiguous())


@jagged_attention.register_fake
def _jagged_attention_fake(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, clamp_min: int,
                           max_len: int, scale: float) -> tuple[Tensor, Tensor]:
    b, h, _, d = q.shape
    return q.new_empty((b, max_len, h, d)), q.new_empty((b, max_len, h), dtype=torch.float32)


@torch.library.custom_op("gemc::jagged_attention_backward", mutates_args=())
def jagged_attention_backward(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, out: Tensor,
                              lse: Tensor, grad: Tensor, clamp_min: int, max_len: int,
                              scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of padded ``q, k, v`` (zero at padding: it never reached the output)."""
    slots = _Slots(offsets, clamp_min, max_len)
    qj, kj, vj = (slots.values(x.transpose(1, 2)) for x in (q, k, v))
    outj, doj = slots.values(out), slots.values(grad)
    lsej = slots.values(lse).t().contiguous()
    grads = _attention_backward(qj, kj, vj, outj, lsej, doj, slots.offsets, max_len, scale,
                                _meta(qj, False, "softmax", "max_len", max_len))
    length = q.shape[2]
    return tuple(slots.padded(g, length).transpose(1, 2).contiguous()
                 for g in grads)  # type: ignore[return-value]


@jagged_attention_backward.register_fake
def _jagged_attention_backward_fake(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor,
                                    out: Tensor, lse: Tensor, grad: Tensor, clamp_min: int,
                                    max_len: int, scale: float
                                    ) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _logsumexp_takes_no_gradient(ctx: Any, lse: Tensor) -> None:
    """An attention op's row logsumexp is an output for its backward, not a value to
    differentiate: marked so, its gradient is never taken, and with gradients not
    materialised eager autograd passes the backward ``None`` for it where it zero-filled a
    tensor of its size (for the values op at TransAct's shape an fp32 ``[H, T]``: a ~1.3 us
    launch and its host issue a step, thirty-fourth session's call 1; torch.compile dropped
    it). Not materialised, the output's gradient may be ``None`` too (a function downstream
    that gives none for it): the backwards are wrapped in :func:`_without_output_grad`."""
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _without_output_grad(backward: Callable[..., tuple[Any, ...]]
                         ) -> Callable[..., tuple[Any, ...]]:
    """An attention backward that answers no gradient for any input when its output's
    gradient is ``None`` (:func:`_logsumexp_takes_no_gradient`), instead of launching its
    kernels on ``None``."""
    @functools.wraps(backward)
    def run(ctx: Any, grad_out: Tensor | None, grad_lse: None) -> tuple[Any, ...]:
        if grad_out is None:
            return (None,) * len(ctx.needs_input_grad)
        return backward(ctx, grad_out, grad_lse)
    return run


def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, offsets, clamp_min, max_len, scale = inputs
    ctx.args = (int(clamp_min), int(max_len), float(scale))
    ctx.save_for_backward(q, k, v, offsets, *output)
    _logsumexp_takes_no_gradient(ctx, output[1])


@_without_output_grad
def _attention_backward_formula(ctx: Any, grad_out: Tensor, grad_lse: None
                                ) -> tuple[Any, ...]:
    q, k, v, offsets, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.gemc.jagged_attention_backward(q, k, v, offsets, out, lse, grad_out,
                                                          *ctx.args)
    return dq, dk, dv, None, None, None, None


jagged_attention.register_autograd(_attention_backward_formula, setup_context=_attention_setup)


# ---- jagged attention over packed values (inside a packed token region) ---------------------


def _values_meta(q: Tensor, offsets: Tensor, causal: bool, key_bias: Tensor | None,
                 max_len: int) -> tuple[dict[str, Any], Tensor | None]:
    """The kernels' meta-parameters and ``[B, H, Lb, Lb]`` bias view of a values call: a
    per-key bias ``[B, Lb]`` is the same for every head and query (strides 0)."""
    meta = _meta(q, causal, "softmax", "max_len", max_len)
    if key_bias is None:
        return meta, None
    bias = broadcast_bias(key_bias.float()[:, None, None, :], int(offsets.numel() - 1),
                          q.shape[1])
    return {**meta, "HAS_BIAS": True, "KEY_BIAS": True}, bias


@torch.library.custom_op("gemc::jagged_attention_values", mutates_args=())
def jagged_attention_values(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_len: int,
                            scale: float, causal: bool = False,
                            key_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention within each sequence of ``[T, H, D]`` values (``offsets`` the attention's
    lengths; slots past ``offsets[-1]`` are spare, never read), a query seeing only the
    keys up to its own position when ``causal``: the output and the row logsumexp
    ``[H, T]``. ``key_bias`` (``[B, Lb]``, fp32, by position within each sequence; no
    gradient, a mask): an additive score bias per key (``-inf``: a key no query sees; a
    query with none gives 0), a region with padding representatives' attention, each
    representative key biased by the log of the kept keys it stands for
    (``packed_tokens.rep_key_bias``)."""
    q, k, v = map(last_dim_contiguous, (q, k, v))
    meta, bias = _values_meta(q, offsets, causal, key_bias, max_len)
    out, lse = _attention_forward(q, k, v, offsets, max_len, scale, meta, bias)
    return out.contiguous(), lse.contiguous()


@jagged_attention_values.register_fake
def _jagged_attention_values_fake(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor,
                                  max_len: int, scale: float, causal: bool = False,
                                  key_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("gemc::jagged_attention_values_backward", mutates_args=())
def jagged_attention_values_backward(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor,
                                     out: Tensor, lse: Tensor, grad: Tensor, max_len: int,
                                     scale: float, causal: bool = False,
                                     key_bias: Tensor | None = None
                                     ) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = map(last_dim_contiguous, (q, k, v))
    meta, bias = _values_meta(q, offsets, causal, key_bias, max_len)
    grads = _attention_backward(q, k, v, out, lse, last_dim_contiguous(grad), offsets,
                                max_len, scale, meta, bias)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


@jagged_attention_values_backward.register_fake
def _jagged_attention_values_backward_fake(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor,
                                           out: Tensor, lse: Tensor, grad: Tensor,
                                           max_len: int, scale: float, causal: bool = False,
                                           key_bias: Tensor | None = None
                                           ) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _values_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, offsets, max_len, scale, causal, key_bias = inputs
    ctx.args = (int(max_len), float(scale), bool(causal))
    ctx.save_for_backward(q, k, v, offsets, key_bias, *output)
    _logsumexp_takes_no_gradient(ctx, output[1])


@_without_output_grad
def _values_backward(ctx: Any, grad_out: Tensor, grad_lse: None) -> tuple[Any, ...]:
    q, k, v, offsets, key_bias, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.gemc.jagged_attention_values_backward(
        q, k, v, offsets, out, lse, grad_out, *ctx.args, key_bias)
    return dq, dk, dv, None, None, None, None, None


jagged_attention_values.register_autograd(_values_backward, setup_context=_values_setup)




# ---- HSTU pointwise (SiLU) attention over padded rows, read in place ------------------------


def _padded_rows(x: Tensor) -> Tensor:
    """``[B, L, H, D]`` -> ``[B * L, H, D]``: a view where the layout allows (the model's
    projection output usually does), its last dimension contiguous."""
    return last_dim_contiguous(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]))


def _silu_operands(rows: Tensor, batch: int, bias: Tensor | None, causal: bool,
                   bias_grad: bool, max_len: int) -> tuple[dict[str, Any], Tensor | None]:
    """The kernels' meta-parameters (of ``rows [N, H, D]``: padded rows or packed values)
    and the bias broadcast to ``[B, H, Lb, Lb]`` (a view)."""
    meta = _meta(rows, causal, "silu", "max_len", max_len)
    meta["HAS_BIAS"], meta["BIAS_GRAD"] = bias is not None, bias is not None and bias_grad
    return meta, broadcast_bias(bias, batch, rows.shape[1])


def _silu_forward(rows: list[Tensor], offsets: Tensor, bias: Tensor | None, norm: int,
                  scale: float, causal: bool, pad_len: int) -> Tensor:
    """The silu attention of ``rows`` (q, k, v as ``[N, H, D]``: padded rows read in place
    when ``pad_len > 0``, else packed values over ``offsets``), counted in the guarded
    attentions' ``STATS`` as a jagged call (it runs per call under Inductor too: Inductor
    calls the op, not a trace)."""
    from .key_padding_attention import STATS  # the run report's attention counts

    STATS.calls += 1
    STATS.jagged += 1
    meta, bias4 = _silu_operands(rows[0], offsets.shape[0] - 1, bias, causal, False,
                                 int(norm))
    out, _ = _attention_forward(*rows, offsets, int(norm), scale, meta, bias4,
                                pad_len=pad_len)
    return out


def _silu_grads(rows: list[Tensor], grad: Tensor, offsets: Tensor, bias: Tensor | None,
                norm: int, scale: float, causal: bool, bias_grad: bool, pad_len: int
                ) -> tuple[list[Tensor], Tensor | None]:
    """dq, dk, dv as ``[N, H, D]`` rows and, with ``bias_grad``, the bias's gradient in its
    own shape and dtype (written once per visible score into :func:`bias_grad_buffer`'s
    fp32 buffer, summed down to the bias's broadcast shape)."""
    meta, bias4 = _silu_operands(rows[0], offsets.shape[0] - 1, bias, causal, bias_grad,
                                 int(norm))
    meta, buffer, dbias4 = bias_grad_buffer(bias4, meta)
    lse = torch.zeros((rows[0].shape[1], 0), device=grad.device, dtype=torch.float32)
    # the silu backward reads no output or logsumexp (rows[0] stands in for the output)
    grads = _attention_backward(*rows, rows[0], lse, grad, offsets, int(norm), scale, meta,
                                bias4, dbias4, pad_len=pad_len)
    if buffer is None or bias is None:
        return list(grads), None
    return list(grads), bias_grad_sum(buffer, bias)


def _check_silu(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, bias: Tensor | None,
                norm: int) -> None:
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError("q, k, v must be one [B, L, H, D] shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if offsets.shape != (q.shape[0] + 1,):
        raise ValueError(f"offsets must be [B + 1] = [{q.shape[0] + 1}], got "
                         f"{tuple(offsets.shape)}")
    if norm < q.shape[1]:
        raise ValueError(f"norm must be >= L={q.shape[1]}, got {norm}")
    if bias is not None and (bias.dim() > 4 or bias.shape[-1] != bias.shape[-2]
                             or bias.shape[-1] < q.shape[1]):
        raise ValueError(f"bias must broadcast to [B, H, Lb, Lb] with Lb >= L={q.shape[1]}, "
                         f"got {tuple(bias.shape)}")


@torch.library.custom_op("gemc::padded_silu_attention", mutates_args=())
def padded_silu_attention(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor,
                          bias: Tensor | None, norm: int, scale: float, causal: bool
                          ) -> Tensor:
    """HSTU's ``silu(scale * q k^T + bias) / norm`` attention of padded ``q, k, v
    [B, L, H, D]`` within each row's first ``offsets[b+1] - offsets[b]`` positions (clamped
    to ``L``), computed on those rows only, in place: the jagged kernel reads the padded
    layout (no gather into packed values, no host read of the token count, static shapes),
    so the op is one node of the compiled graph. Rows past a row's length come back zero."""
    _check_silu(q, k, v, offsets, bias, norm)
    rows = [_padded_rows(x.to(q.dtype)) for x in (q, k, v)]
    return _silu_forward(rows, offsets, bias, norm, scale, causal, q.shape[1]).view(q.shape)


@padded_silu_attention.register_fake
def _padded_silu_attention_fake(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor,
                                bias: Tensor | None, norm: int, scale: float, causal: bool
                                ) -> Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op("gemc::padded_silu_attention_backward", mutates_args=())
def padded_silu_attention_backward(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor,
                                   bias: Tensor | None, grad: Tensor, norm: int, scale: float,
                                   causal: bool, bias_grad: bool
                                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``q, k, v`` (zero past each row's length) and, with ``bias_grad``, of
    ``bias`` (else an empty tensor)."""
    rows = [_padded_rows(x.to(q.dtype)) for x in (q, k, v)]
    grads, dbias = _silu_grads(rows, _padded_rows(grad.to(q.dtype)), offsets, bias, norm,
                               scale, causal, bias_grad, q.shape[1])
    dq, dk, dv = (g.view(q.shape).to(x.dtype) for g, x in zip(grads, (q, k, v)))
    return dq, dk, dv, q.new_empty(0) if dbias is None else dbias


@padded_silu_attention_backward.register_fake
def _padded_silu_attention_backward_fake(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor,
                                         bias: Tensor | None, grad: Tensor, norm: int,
                                         scale: float, causal: bool, bias_grad: bool
                                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _silu_grads_fake(q, k, v, bias, bias_grad)


def _silu_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    q, k, v, offsets, bias, norm, scale, causal = inputs
    ctx.args = (int(norm), float(scale), bool(causal))
    ctx.save_for_backward(q, k, v, offsets, bias)


def _silu_backward_through(op: str) -> Any:
    """The autograd formula of a silu attention op whose backward is ``gemc::<op>`` (the
    padded op's and the packed values' take the same arguments)."""
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        q, k, v, offsets, bias = ctx.saved_tensors
        norm, scale, causal = ctx.args
        bias_grad = bias is not None and bool(ctx.needs_input_grad[4])
        dq, dk, dv, dbias = getattr(torch.ops.gemc, op)(
            q, k, v, offsets, bias, grad, norm, scale, causal, bias_grad)
        return dq, dk, dv, None, dbias if bias_grad else None, None, None, None

    return backward


def _silu_grads_fake(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, bias_grad: bool
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dbias = bias.new_empty(bias.shape) if bias is not None and bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


padded_silu_attention.register_autograd(
    _silu_backward_through("padded_silu_attention_backward"), setup_context=_silu_setup)


# ---- HSTU pointwise (SiLU) attention over packed values (inside a packed token region) ------


def _check_silu_values(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor) -> None:
    if q.dim() != 3 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError("q, k, v must be one [T, H, D] shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if offsets.dim() != 1 or offsets.shape[0] < 1:
        raise ValueError(f"offsets must be [B + 1], got {tuple(offsets.shape)}")


@torch.library.custom_op("gemc::jagged_silu_attention_values", mutates_args=())
def jagged_silu_attention_values(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor,
                                 bias: Tensor | None, norm: int, scale: float, causal: bool
                                 ) -> Tensor:
    """HSTU's ``silu(scale * q k^T + bias) / norm`` attention within each sequence of the
    ``[T, H, D]`` values of a packed token region (``offsets`` its lengths, at most
    ``norm``; slots past ``offsets[-1]`` are spare, never read, zero out). ``bias``
    broadcasts to ``[B, H, Lb, Lb]``, indexed by positions within each sequence. Why a
    values op next to the padded one: inside a region q, k, v already are the real tokens,
    so no padded tensor is read or written around the attention."""
    _check_silu_values(q, k, v, offsets)
    rows = [last_dim_contiguous(x).to(q.dtype) for x in (q, k, v)]
    return _silu_forward(rows, offsets, bias, norm, scale, causal, 0)


@jagged_silu_attention_values.register_fake
def _jagged_silu_attention_values_fake(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor,
                                       bias: Tensor | None, norm: int, scale: float,
                                       causal: bool) -> Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op("gemc::jagged_silu_attention_values_backward", mutates_args=())
def jagged_silu_attention_values_backward(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor,
                                          bias: Tensor | None, grad: Tensor, norm: int,
                                          scale: float, causal: bool, bias_grad: bool
                                          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the values ``q, k, v`` (zero on spare slots) and, with ``bias_grad``,
    of ``bias`` (else an empty tensor)."""
    rows = [last_dim_contiguous(x).to(q.dtype) for x in (q, k, v)]
    grads, dbias = _silu_grads(rows, last_dim_contiguous(grad.to(q.dtype)), offsets, bias,
                               norm, scale, causal, bias_grad, 0)
    dq, dk, dv = (g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
    return dq, dk, dv, q.new_empty(0) if dbias is None else dbias


@jagged_silu_attention_values_backward.register_fake
def _jagged_silu_attention_values_backward_fake(q: Tensor, k: Tensor, v: Tensor,
                                                offsets: Tensor, bias: Tensor | None,
                                                grad: Tensor, norm: int, scale: float,
                                                causal: bool, bias_grad: bool
                                                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _silu_grads_fake(q, k, v, bias, bias_grad)


jagged_silu_attention_values.register_autograd(
    _silu_backward_through("jagged_silu_attention_values_backward"),
    setup_context=_silu_setup)


# ---- padded history queries over dense keys -------------------------------------------------


@torch.library.custom_op("gemc::query_prefix_lengths", mutates_args=())
def query_prefix_lengths(keep: Tensor) -> Tensor:
    """Per row of a bool ``[B, L]`` keep mask, the query rows to compute: the kept count
    where it is a prefix, else ``L`` (the row's padded attention; counted on the device in
    ``jagged_query_attention.STATS``)."""
    from .jagged_query_attention import mask_query_lengths

    return mask_query_lengths(keep)


@query_prefix_lengths.register_fake
def _query_prefix_lengths_fake(keep: Tensor) -> Tensor:
    return keep.new_empty((keep.shape[0],), dtype=torch.int32)


@torch.library.custom_op("gemc::jagged_query_attention", mutates_args=())
def jagged_query_attention(q: Tensor, k: Tensor, v: Tensor, query_lengths: Tensor,
                           scale: float) -> tuple[Tensor, Tensor]:
    """Padded queries ``[B, H, L, D]`` (rows ``< query_lengths[b]`` real) over dense ``k, v
    [B, H, M, D]``: the output (zero on padding rows) and the row logsumexp ``[B * H, L]``."""
    keys = _dense_keys(q, k)
    q, k, v = map(last_dim_contiguous, (q, k, v))
    out, lse = _varlen_forward(q, k, v, keys, query_lengths.to(torch.int32), scale)
    return out.contiguous(), lse.contiguous()


def _dense_keys(q: Tensor, k: Tensor) -> Tensor:
    return torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)


@jagged_query_attention.register_fake
def _jagged_query_attention_fake(q: Tensor, k: Tensor, v: Tensor, query_lengths: Tensor,
                                 scale: float) -> tuple[Tensor, Tensor]:
    b, h, length, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b * h, length), dtype=torch.float32)


@torch.library.custom_op("gemc::jagged_query_attention_backward", mutates_args=())
def jagged_query_attention_backward(q: Tensor, k: Tensor, v: Tensor, query_lengths: Tensor,
                                    out: Tensor, lse: Tensor, grad: Tensor, scale: float
                                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``q, k, v`` (zero on padding query rows: their output is a constant)."""
    q, k, v = map(last_dim_contiguous, (q, k, v))
    grads = _varlen_backward(q, k, v, _dense_keys(q, k), query_lengths.to(torch.int32), out,
                             lse, grad, scale)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


@jagged_query_attention_backward.register_fake
def _jagged_query_attention_backward_fake(q: Tensor, k: Tensor, v: Tensor,
                                          query_lengths: Tensor, out: Tensor, lse: Tensor,
                                          grad: Tensor, scale: float
                                          ) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _query_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, query_lengths, scale = inputs
    ctx.scale = float(scale)
    ctx.save_for_backward(q, k, v, query_lengths, *output)
    _logsumexp_takes_no_gradient(ctx, output[1])


@_without_output_grad
def _query_backward(ctx: Any, grad_out: Tensor, grad_lse: None) -> tuple[Any, ...]:
    q, k, v, query_lengths, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.gemc.jagged_query_attention_backward(q, k, v, query_lengths, out,
                                                                lse, grad_out, ctx.scale)
    return dq, dk, dv, None, None


jagged_query_attention.register_autograd(_query_backward, setup_context=_query_setup)


@torch.library.custom_op("gemc::key_lengths_attention", mutates_args=())
def key_lengths_attention(q: Tensor, k: Tensor, v: Tensor, key_lengths: Tensor,
                          scale: float) -> tuple[Tensor, Tensor]:
    """Dense queries ``[B, H, M, D]`` over the first ``key_lengths[b]`` keys of padded
    ``k, v [B, H, L, D]``: the output and the row logsumexp ``[B * H, M]``. A guarded
    key-padding attention whose mask the check ahead of the compiled graph found a prefix
    (or compacted to one): static shapes, no host read, so Inductor compiles around it."""
    q, k, v = map(last_dim_contiguous, (q, k, v))
    out, lse = _varlen_forward(q, k, v, key_lengths.to(torch.int32), None, scale)
    return out.contiguous(), lse.contiguous()


@key_lengths_attention.register_fake
def _key_lengths_attention_fake(q: Tensor, k: Tensor, v: Tensor, key_lengths: Tensor,
                                scale: float) -> tuple[Tensor, Tensor]:
    return _jagged_query_attention_fake(q, k, v, key_lengths, scale)


@torch.library.custom_op("gemc::key_lengths_attention_backward", mutates_args=())
def key_lengths_attention_backward(q: Tensor, k: Tensor, v: Tensor, key_lengths: Tensor,
                                   out: Tensor, lse: Tensor, grad: Tensor, scale: float
                                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``q, k, v`` (keys past a row's length get zero)."""
    q, k, v = map(last_dim_contiguous, (q, k, v))
    grads = _varlen_backward(q, k, v, key_lengths.to(torch.int32), None, out, lse, grad,
                             scale)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


@key_lengths_attention_backward.register_fake
def _key_lengths_attention_backward_fake(q: Tensor, k: Tensor, v: Tensor, key_lengths: Tensor,
                                         out: Tensor, lse: Tensor, grad: Tensor, scale: float
                                         ) -> tuple[Tensor, Tensor, Tensor]:
    return _jagged_query_attention_backward_fake(q, k, v, key_lengths, out, lse, grad, scale)


@_without_output_grad
def _key_lengths_backward(ctx: Any, grad_out: Tensor, grad_lse: None) -> tuple[Any, ...]:
    q, k, v, key_lengths, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.gemc.key_lengths_attention_backward(q, k, v, key_lengths, out, lse,
                                                               grad_out, ctx.scale)
    return dq, dk, dv, None, None


# the same inputs as the padded-query op's (q, k, v, lengths, scale): its setup saves alike
key_lengths_attention.register_autograd(_key_lengths_backward, setup_context=_query_setup)


# ---- packed token regions: gathers to tokens and sums over a row's tokens ------------------


@torch.library.custom_op("gemc::segment_sum", mutates_args=())
def segment_sum(tokens: Tensor, offsets: Tensor, row_out: Tensor) -> Tensor:
    """Each row's tokens of ``tokens [T, ...]`` added up in fp32, in the input's dtype:
    ``[B, ...]``. ``row_out``: per token slot its row, ``B`` for a spare slot (the
    backward's scatter)."""
    return _segment_sum_rows(tokens, offsets).contiguous()


@segment_sum.register_fake
def _segment_sum_fake(tokens: Tensor, offsets: Tensor, row_out: Tensor) -> Tensor:
    return tokens.new_empty((offsets.shape[0] - 1, *tokens.shape[1:]))


def _segment_sum_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(inputs[2])


def _segment_sum_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    (row_out,) = ctx.saved_tensors  # a spare slot reads the zero row appended here
    padded = torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))])
    return padded.index_select(0, row_out), None, None


segment_sum.register_autograd(_segment_sum_backward, setup_context=_segment_sum_setup)


@torch.library.custom_op("gemc::segment_sum_rows", mutates_args=())
def segment_sum_rows(x: Tensor, offsets: Tensor, dtype: torch.dtype) -> Tensor:
    """Not differentiable: the backward of a gather by row (see ``packed_tokens._Gather``)."""
    return _segment_sum_rows(x, offsets, dtype).contiguous()


@segment_sum_rows.register_fake
def _segment_sum_rows_fake(x: Tensor, offsets: Tensor, dtype: torch.dtype) -> Tensor:
    return x.new_empty((offsets.shape[0] - 1, *x.shape[1:]), dtype=dtype)


@torch.library.custom_op("gemc::gather_tokens", mutates_args=())
def gather_tokens(src: Tensor, index: Tensor, offsets: Tensor | None) -> Tensor:
    """``src[index]``; its gradient is added up in fp32 (by row with ``offsets``: one pass
    per row's contiguous tokens), as ``packed_tokens._Gather``'s is."""
    return src.index_select(0, index)


@gather_tokens.register_fake
def _gather_tokens_fake(src: Tensor, index: Tensor, offsets: Tensor | None) -> Tensor:
    return src.new_empty((index.shape[0], *src.shape[1:]))


def _gather_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    src, index, offsets = inputs
    ctx.rows, ctx.dtype, ctx.by_row = src.shape[0], src.dtype, offsets is not None
    ctx.save_for_backward(index, offsets if offsets is not None else index)


def _gather_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    index, offsets = ctx.saved_tensors
    if ctx.by_row:  # spare slots past offsets[-1] are not read
        return torch.ops.gemc.segment_sum_rows(grad, offsets, ctx.dtype), None, None
    acc = grad.new_zeros((ctx.rows, *grad.shape[1:]), dtype=torch.float32)
    return acc.index_add(0, index, grad.float()).to(ctx.dtype), None, None


gather_tokens.register_autograd(_gather_backward, setup_context=_gather_setup)


# ---- batched embedding lookup with the optimizer in its backward ---------------------------


@torch.library.custom_op("gemc::bag_inputs", mutates_args=())
def bag_inputs(ids: list[Tensor], offsets: list[Tensor], include_last: list[bool],
               mean: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """The batched lookup's flat ids, offsets and per-id weights (empty when no table is
    mean-pooled) from each table's ids and offsets (``GraphRunner._bag_layout``).

    Why an op and not its ATen ops in the compiled graph: with a table per sparse feature
    (hundreds), Inductor writes and autotunes a copy kernel per table for the ``cat``s and
    the per-table offsets (measured on the H200 when the lookup first compiled into the
    graph: Wukong's first step 29.4 -> 39.2 s, its runtime autotuning runs 58 -> 123), for
    a few microseconds of work it does not speed up. As one opaque op those launches are a
    handful, as in eager."""
    from .graph_runner import GraphRunner

    flat_ids, flat_offsets, psw = GraphRunner.bag_inputs(ids, offsets, include_last, mean)
    return flat_ids, flat_offsets, psw if psw is not None else flat_ids.new_empty(
        0, dtype=torch.float32)


@bag_inputs.register_fake
def _bag_inputs_fake(ids: list[Tensor], offsets: list[Tensor], include_last: list[bool],
                     mean: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    total = sum(t.numel() for t in ids)
    bags = sum(o.shape[0] - (1 if last else 0) for o, last in zip(offsets, include_last))
    first = ids[0]
    return (first.new_empty(total, dtype=torch.int64),
            first.new_empty(bags + 1, dtype=torch.int64),
            first.new_empty(total if any(mean) else 0, dtype=torch.float32))


@torch.library.custom_op("gemc::embedding_bag", mutates_args=())
def embedding_bag(table: str, weights: Tensor, momentum1: Tensor, momentum2: Tensor,
                  ids: Tensor, offsets: Tensor, per_sample_weights: Tensor | None,
                  anchor: Tensor) -> Tensor:
    """Pooled lookups of every table of group ``table``: ``[B, sum(dims)]`` (fp32). The
    optimizer state is an argument only so that the backward can name what it mutates."""
    module = _TABLES[table]
    return module._pooled(ids, offsets, per_sample_weights)


@embedding_bag.register_fake
def _embedding_bag_fake(table: str, weights: Tensor, momentum1: Tensor, momentum2: Tensor,
                        ids: Tensor, offsets: Tensor, per_sample_weights: Tensor | None,
                        anchor: Tensor) -> Tensor:
    module = _TABLES[table]
    batch = (offsets.shape[0] - 1) // module.num_tables
    return weights.new_empty((batch, module.total_dim), dtype=torch.float32)


@torch.library.custom_op("gemc::embedding_bag_update", mutates_args=(), **_HOST_SIDE)
def embedding_bag_update(table: str, grad: Tensor, ids: Tensor, offsets: Tensor,
                         per_sample_weights: Tensor | None, anchor: Tensor) -> Tensor:
    """The fused optimizer step of group ``table``: writes the registered module's weights
    and optimizer state in place, as an optimizer's ``step()`` writes its parameters, and
    returns the anchor's gradient (a zero).

    Why the tables are not arguments (declared mutated): the step runs in the backward, and
    AOTAutograd cannot carry a mutation of a tensor the backward received as a saved
    activation back to the module (it updated a functional copy, and the step was lost:
    measured on GEM tiny, the tables never moved). As module state the op owns, like the
    step count it keeps on the host, the update lands wherever the backward runs (eager,
    or compiled into the same graph as the rest of the model: no eager island, no graph
    break). Nothing in the backward reads the tables after the update, and the next
    forward is a later call, so the order is the data's (grad, ids) alone."""
    _TABLES[table]._fused_update(grad, ids, offsets, per_sample_weights)
    return torch.zeros_like(anchor)


@embedding_bag_update.register_fake
def _embedding_bag_update_fake(table: str, grad: Tensor, ids: Tensor, offsets: Tensor,
                               per_sample_weights: Tensor | None, anchor: Tensor) -> Tensor:
    return torch.empty_like(anchor)


def _embedding_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    table, weights, m1, m2, ids, offsets, psw, anchor = inputs
    ctx.table = table
    ctx.has_psw = psw is not None
    ctx.save_for_backward(ids, offsets, psw if psw is not None else ids, anchor)


def _embedding_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    ids, offsets, psw, anchor = ctx.saved_tensors
    g_anchor = torch.ops.gemc.embedding_bag_update(
        ctx.table, grad, ids, offsets, psw if ctx.has_psw else None, anchor)
    return None, None, None, None, None, None, None, g_anchor


embedding_bag.register_autograd(_embedding_backward, setup_context=_embedding_setup)


# ---- one table's lookup on one rank, its sparse gradient left to the sparse optimizer -------


@torch.library.custom_op("gemc::table_lookup", mutates_args=())
def table_lookup(table: str, ids: Tensor, offsets: Tensor | None,
                 per_sample_weights: Tensor | None, anchor: Tensor) -> Tensor:
    """Table ``table``'s lookup by its registered module (``register_lookup``), as the
    module answers it in eager code: the rows (pooled for a bag), the table's storage
    precision decoded.

    Why an op: the lookup's gradient is sparse (one row per id, summed by the sparse
    optimizer), which AOTAutograd does not trace, so the lookup was an eager island and
    Dynamo broke the compiled graph around it (MMoE h200's 4M-row user table, priced
    cheaper sparse than dense: one break, a second Dynamo frame and Inductor compile in
    the first step). As an opaque op with its own backward the graph compiles whole."""
    with torch.no_grad():  # the gradient is made from the backward's (table_lookup_backward)
        return _LOOKUPS[table](ids, offsets, per_sample_weights).contiguous()


@table_lookup.register_fake
def _table_lookup_fake(table: str, ids: Tensor, offsets: Tensor | None,
                       per_sample_weights: Tensor | None, anchor: Tensor) -> Tensor:
    module = _LOOKUPS[table]
    if not module.is_bag:
        rows: tuple[Any, ...] = tuple(ids.shape)
    elif offsets is None:  # a 2-D ids tensor: one bag a row
        rows = (ids.shape[0],)
    else:
        rows = (offsets.shape[0] - int(bool(module.include_last_offset)),)
    dtype = module.dtype if module.precision == "fp32" else torch.float32
    return ids.new_empty((*rows, module.embedding_dim), dtype=dtype)


@torch.library.custom_op("gemc::table_lookup_backward", mutates_args=(), **_HOST_SIDE)
def table_lookup_backward(table: str, grad: Tensor, ids: Tensor, offsets: Tensor | None,
                          per_sample_weights: Tensor | None, anchor: Tensor,
                          weights_grad: bool) -> tuple[Tensor, Tensor]:
    """The lookup's backward: hands the output gradient to the table module, which makes
    the table's sparse gradient from it before the sparse optimizer's ``step()`` reads it
    (``ShardedEmbedding.defer_backward``: autograd records nothing inside an op). Returns
    the anchor's gradient (a zero) and the per-sample weights' (empty unless
    ``weights_grad``: autograd wants it).
    Module state the op owns, not arguments, as for ``gemc::embedding_bag_update``: a
    gradient AOTAutograd does not see."""
    module = _LOOKUPS[table]
    module.defer_backward(grad, ids, offsets, per_sample_weights)
    g_psw = grad.new_empty(0) if per_sample_weights is None or not weights_grad else \
        module.per_sample_weight_grad(grad, ids, offsets, per_sample_weights)
    return torch.zeros_like(anchor), g_psw


@table_lookup_backward.register_fake
def _table_lookup_backward_fake(table: str, grad: Tensor, ids: Tensor, offsets: Tensor | None,
                                per_sample_weights: Tensor | None, anchor: Tensor,
                                weights_grad: bool) -> tuple[Tensor, Tensor]:
    psw = per_sample_weights
    return (torch.empty_like(anchor),
            torch.empty_like(psw) if psw is not None and weights_grad else grad.new_empty(0))


def _lookup_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    table, ids, offsets, psw, anchor = inputs
    ctx.table = table
    ctx.has = (offsets is not None, psw is not None)
    ctx.save_for_backward(ids, offsets if offsets is not None else ids,
                          psw if psw is not None else ids, anchor)


def _lookup_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    ids, offsets, psw, anchor = ctx.saved_tensors
    has_offsets, has_psw = ctx.has
    weights_grad = has_psw and ctx.needs_input_grad[3]
    g_anchor, g_psw = torch.ops.gemc.table_lookup_backward(
        ctx.table, grad, ids, offsets if has_offsets else None, psw if has_psw else None,
        anchor, weights_grad)
    return None, None, None, g_psw if weights_grad else None, g_anchor


table_lookup.register_autograd(_lookup_backward, setup_context=_lookup_setup)


# ---- which kernels each op launches, for the warm-up ahead of the first step ----------------


def _meta_module(module: Any) -> Any:
    """A shallow copy of a kernel module whose tensors are ``meta`` tensors of the same
    shapes, strides and dtypes: its host code then runs on them without touching the real
    state (the fused update's step count included)."""
    import copy

    from .warm import meta_like

    twin = copy.copy(module)
    state = dict(module.__dict__)
    for name in ("_parameters", "_buffers"):
        if isinstance(state.get(name), dict):
            state[name] = {k: meta_like(v) if v is not None else None
                           for k, v in state[name].items()}
    twin.__dict__ = {k: meta_like(v) if isinstance(v, Tensor) else v for k, v in state.items()}
    return twin


def _warm_attention_pair(forward: Any, backward: Any) -> Any:
    """The warm-up of an attention op whose backward op takes its first four arguments,
    then its output, row logsumexp and output gradient, then its other arguments."""
    def warm(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, *rest: Any,
             **kw: Any) -> None:
        out, lse = forward._init_fn(q, k, v, lengths, *rest, **kw)
        backward._init_fn(q, k, v, lengths, out, lse, torch.empty_like(out), *rest, **kw)
    return warm


def _warm_silu(forward: Any, backward: Any) -> Any:
    """The warm-up of a silu attention op (padded or packed values): its backward computes
    the bias's gradient where the bias requires one (as the autograd formula asks)."""
    def warm(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, bias: Tensor | None,
             norm: int, scale: float, causal: bool) -> None:
        forward._init_fn(q, k, v, offsets, bias, norm, scale, causal)
        backward._init_fn(q, k, v, offsets, bias, torch.empty_like(q), norm, scale, causal,
                          bias is not None and bias.requires_grad)
    return warm


def _warm_segment_sum(tokens: Tensor, offsets: Tensor, row_out: Tensor) -> None:
    segment_sum._init_fn(tokens, offsets, row_out)  # the backward is an index_select


def _warm_gather_tokens(src: Tensor, index: Tensor, offsets: Tensor | None) -> None:
    # the forward is an index_select; the backward sums by row only with offsets
    if offsets is not None and src.requires_grad:
        grad = src.new_empty((index.shape[0], *src.shape[1:]))
        segment_sum_rows._init_fn(grad, offsets, src.dtype)


def _warm_gather_rows(weight: Tensor, index: Tensor) -> None:
    from .small_table_gather import gather_rows_backward

    if weight.requires_grad:  # the forward is ATen's gather (weight[index])
        grad = weight.new_empty((*index.shape, *weight.shape[1:]))
        gather_rows_backward._init_fn(grad, index, weight.shape[0], weight.dtype)


def _warm_embedding_bag(table: str, weights: Tensor, momentum1: Tensor, momentum2: Tensor,
                        ids: Tensor, offsets: Tensor, per_sample_weights: Tensor | None,
                        anchor: Tensor) -> None:
    from .warm import variant

    module = _meta_module(_TABLES[table])
    out = module._pooled(ids, offsets, per_sample_weights)
    # the output gradient's row stride is the backward graph's: its own width, or a wider
    # buffer's when the output fed a concatenation (the gradient is then a column slice)
    width = out.shape[1]
    for stride in (width, width + 1 if width % 16 == 0 else width + 16 - width % 16):
        with variant(f"output gradient row stride {stride}"):
            grad = out.new_empty((out.shape[0], stride))[:, :width]
            module._fused_update(grad, ids, offsets, per_sample_weights)


WARM: dict[str, Any] = {
    "jagged_attention": _warm_attention_pair(jagged_attention, jagged_attention_backward),
    "jagged_attention_values": _warm_attention_pair(jagged_attention_values,
                                                    jagged_attention_values_backward),
    "key_lengths_attention": _warm_attention_pair(key_lengths_attention,
                                                  key_lengths_attention_backward),
    "jagged_query_attention": _warm_attention_pair(jagged_query_attention,
                                                   jagged_query_attention_backward),
    "query_prefix_lengths": lambda keep: query_prefix_lengths._init_fn(keep),
    "padded_silu_attention": _warm_silu(padded_silu_attention,
                                        padded_silu_attention_backward),
    "jagged_silu_attention_values": _warm_silu(jagged_silu_attention_values,
                                               jagged_silu_attention_values_backward),
    "segment_sum": _warm_segment_sum,
    "gather_tokens": _warm_gather_tokens,
    "gather_rows": _warm_gather_rows,
    "embedding_bag": _warm_embedding_bag,
}
"""Per gemc op (forward), the host code of its forward and backward, run on ``meta``
tensors by :func:`warm_graph` to find the kernel launches the first step will make (the
op's backward is the autograd formula's op, with the forward's outputs' shapes; it runs
where the formula would: a bias or a gathered table that requires grad)."""

NO_KERNELS: dict[str, str] = {
    "bag_inputs": "ATen ops (GraphRunner.bag_inputs)",
    "table_lookup": "ATen lookups; the sparse gradient's update is the sparse optimizer's "
                    "(its dense-gradient kernel is derived from the optimizer)",
    "fp8_linear": "ATen GEMMs; the triton quantiser's kernels are triton_ops, which "
                  "Inductor compiles with the graph's own kernels",
    "fp8_scaled_mm": "an ATen GEMM (torch._scaled_mm)",
    "wide_mm": "an ATen GEMM",
    "fp8_quantize_rows": "a triton_op: Inductor compiles its kernel with the graph's own",
    "fp8_quantize_cols": "a triton_op: Inductor compiles its kernel with the graph's own",
    "rep_key_bias": "a triton_op: Inductor compiles its kernel with the graph's own",
}
"""gemc ops whose host code launches none of gemc's own kernels (nothing to warm), and
why. The generated groups' ``fused_group`` is in neither table: its kernels are modules
imported from files in the kernel cache (``codegen.host.load_source``), which a worker
cannot import by name; they compile at their first launch (``ops_not_derived``)."""


@contextlib.contextmanager
def _counts_kept() -> Iterator[None]:
    """The run report's attention counts as they were before: a derivation runs the ops'
    host code, which counts its calls."""
    from .jagged_query_attention import STATS as query_stats
    from .key_padding_attention import STATS as key_stats

    saved, counts = dict(key_stats.__dict__), dict(query_stats._counts)
    try:
        yield
    finally:
        key_stats.__dict__.update(saved)
        query_stats._counts.clear()
        query_stats._counts.update(counts)


def gemc_op_name(target: Any) -> str | None:
    """The gemc op a graph node calls (``torch.ops.gemc.<name>.<overload>``), else None."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "gemc":
        return target._schema.name.split("::", 1)[1]
    if isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name \
            .startswith("gemc::"):
        return target._qualified_op_name.split("::", 1)[1]
    return None


def warm_graph(gm: torch.fx.GraphModule, warm: Any) -> dict[str, int]:
    """Submit to ``warm`` (a :class:`~.warm.WarmUp`) the launches of every gemc op node of
    ``gm`` (a Dynamo graph: each node's fake value in ``meta["example_value"]``), once per
    variant of the symbolic sizes its arguments hold (:func:`~.warm.size_variants`).
    Returns the gemc ops seen without a :data:`WARM` entry whose host code launches gemc
    kernels (they compile at first launch: the generated groups'), by name."""
    from .warm import meta_like, size_variants, symbols_of

    def fake(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return a.meta.get("example_value", a.meta.get("val"))
        if isinstance(a, (list, tuple)):
            return type(a)(fake(x) for x in a)
        return a

    def value(v: Any, sizes: dict[Any, int]) -> Any:
        if isinstance(v, (list, tuple)):
            return type(v)(value(x, sizes) for x in v)
        return meta_like(v, sizes, grad=True)

    def derive(fn: Any, args: list[Any], kwargs: dict[str, Any],
               sizes: dict[Any, int]) -> None:
        with torch.no_grad(), _counts_kept():
            fn(*value(args, sizes), **{k: value(a, sizes) for k, a in kwargs.items()})

    other: dict[str, int] = {}
    for node in gm.graph.nodes:
        name = gemc_op_name(node.target) if node.op == "call_function" else None
        if name is None or name in NO_KERNELS:
            continue
        fn = WARM.get(name)
        if fn is None:
            if not name.endswith("_backward"):
                other[name] = other.get(name, 0) + 1
            continue
        args, kwargs = fake(list(node.args)), {k: fake(a) for k, a in node.kwargs.items()}
        try:
            variants = size_variants(symbols_of([args, list(kwargs.values())]))
        except Exception as exc:  # noqa: BLE001 - the hints alone are still a warm-up
            warnings.warn(f"gemc warm-up: the symbolic sizes of gemc::{name} ({node.name}) "
                          f"could not be varied ({type(exc).__name__}: {exc}); only their "
                          "hints are warmed, the other specialisations compile at their "
                          "first launch", stacklevel=2)
            variants = [({}, "")]
        for sizes, label in variants:
            warm.derive(f"gemc::{name} ({node.name})",
                        lambda fn=fn, args=args, kwargs=kwargs, sizes=sizes:
                        derive(fn, args, kwargs, sizes), label)
    return other
