"""Capture: torch.export of the user's model on meta/fake tensors into gemc's IR.

The IR is the exported ATen-level ``torch.fx.GraphModule`` (pre-dispatch training IR, so
``linear`` and ``scaled_dot_product_attention`` stay whole for pattern matching), with a
FakeTensor ``val`` on every node. Parameters are placeholders; we keep their FQNs.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import logging
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from gemc.batch_structure import flat_spec
from gemc.capture_idioms import undetermined_causal_hint, untraceable_call
from gemc.data_dependent import bound_unbacked_sizes
from gemc.errors import CaptureError, user_frame
from gemc.host_randomness import watch as host_randomness_watch
from gemc.spec import ModelSpec, batch_size_of


@dataclass
class Captured:
    """An exported model: the graph plus what the passes need to name parameters."""

    gm: fx.GraphModule
    param_fqns: dict[str, str]  # placeholder name -> parameter / buffer FQN
    param_shapes: dict[str, tuple[int, ...]]
    param_dtypes: dict[str, str]
    fingerprint: str
    # the batch it was captured with: real tensors where the author built them on the CPU,
    # the one sample of the data the compiler has (a guarded region's fill is priced on it)
    example_inputs: tuple[Any, ...] = ()
    # the samples per batch the model states (gemc.spec.batch_size_of); None: it states none
    batch_size: int | None = None
    # where the forward drew from Python's / NumPy's generators while traced, the values
    # kept as constants (only with host_randomness="freeze": gemc.host_randomness)
    frozen_draws: tuple[str, ...] = ()
    # nodes whose size depends on the batch's values, priced at its upper bound
    # (gemc.data_dependent)
    bounded_sizes: tuple[str, ...] = ()
    # FQN -> the other names of the same tensor (tied weights: ``out.weight = emb.weight``)
    param_aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # placeholder name -> value of each tensor the forward builds from Python data
    # (``x.new_tensor(np_array)``, ``x[:, [0, 0, 1]]``), which torch.export lifts to an
    # input of the graph: on the CPU, or meta where no capture could recover it
    # (:func:`lifted_constants`)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    # placeholder name -> the constant's name in the export: a plain tensor attribute's
    # FQN (``self.li = torch.tensor(...)``), which the runner's materialized model holds
    constant_fqns: dict[str, str] = field(default_factory=dict)


def capture(spec: ModelSpec, *, entrypoint: str = "model",
            host_randomness: str = "error", constant_values: bool = False) -> Captured:
    """Export ``spec.model`` on ``spec.example_inputs``; a failure is a named CaptureError.
    A structured batch (a spec not built through an entrypoint) is flattened first, as
    the entrypoint does (gemc.batch_structure). A forward that draws from Python's or
    NumPy's generator is refused (``host_randomness="error"``: the traced value would be
    a constant of every step) or kept with its draws listed in ``frozen_draws``
    (``"freeze"``), see :mod:`gemc.host_randomness`. ``constant_values``: recover the
    values of lifted constants the capture on meta lost (graph mode runs the graph and
    needs them; the compile reads only their shapes), see :func:`lifted_constants`."""
    spec = flat_spec(spec, entrypoint)
    model = spec.model
    inputs = _inputs_on_model_device(model, spec.example_inputs)
    model.train()
    try:
        with warnings.catch_warnings(), _no_gc(), host_randomness_watch() as draws, \
                undetermined_causal_hint(), _quiet_export_noise():
            warnings.simplefilter("ignore")
            exported = torch.export.export(model, inputs, strict=False)
    except Exception as exc:  # any export failure is the user's model not being capturable
        if is_device_mismatch(exc):
            raise _device_error(exc, model, spec.example_inputs, entrypoint) from exc
        if (call := untraceable_call(exc)) is not None:
            api, site, fix = call
            raise CaptureError(
                f"torch.export cannot trace {api}, which the model's forward calls "
                f"({_first_line(exc)})", where=site, fix=fix) from exc
        raise CaptureError(
            f"torch.export could not capture the model: {_first_line(exc)}",
            where=_where(exc, entrypoint),
            fix=(
                "make the forward traceable: no Python branching on tensor values, no .item()/"
                ".tolist() on data, no unsupported ops (see torch.export's docs on "
                "data-dependent control flow); pass output_size= to repeat_interleave"
            ),
        ) from exc

    if draws and host_randomness != "freeze":
        raise _host_randomness_error(draws, entrypoint)
    gm = exported.graph_module
    _check_scalar_loss(gm, entrypoint, exported.call_spec.out_spec)
    bounded = bound_unbacked_sizes(gm, entrypoint)
    sig = exported.graph_signature
    param_fqns = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    shapes = {
        fqn: tuple(int(s) for s in state[fqn].shape) for fqn in param_fqns.values() if fqn in state
    }
    dtypes = {fqn: str(state[fqn].dtype).removeprefix("torch.") for fqn in shapes}
    every = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    names: dict[int, list[str]] = {}
    for name, tensor in every.items():
        names.setdefault(id(tensor), []).append(name)
    aliases = {fqn: tuple(n for n in names[id(every[fqn])] if n != fqn)
               for fqn in param_fqns.values() if fqn in every}
    return Captured(
        gm=gm,
        param_fqns=dict(param_fqns),
        param_shapes=shapes,
        param_dtypes=dtypes,
        fingerprint=fingerprint(gm, shapes, dtypes),
        example_inputs=tuple(spec.example_inputs),
        batch_size=batch_size_of(spec)[0],
        frozen_draws=tuple(draws.sites) if draws else (),
        bounded_sizes=tuple(bounded),
        param_aliases={fqn: a for fqn, a in aliases.items() if a},
        constants=lifted_constants(exported, model, inputs, recover=constant_values),
        constant_fqns=dict(sig.inputs_to_lifted_tensor_constants),
    )


def lifted_constants(exported: torch.export.ExportedProgram, model: torch.nn.Module,
                     inputs: tuple[torch.Tensor, ...], *, recover: bool = True
                     ) -> dict[str, torch.Tensor]:
    """Placeholder name -> value of each lifted tensor constant of ``exported``.

    Why: the graph takes such a tensor as an input like a parameter, so whoever runs the
    graph must pass its value, which is no state of the model. Captured on meta, a constant
    made on the inputs' device (``x[:, row_list]``, ``torch.tensor(row, device=x.device)``)
    has no value; with ``recover`` it is recovered by exporting once more with the model's
    state and the inputs as fake CPU tensors (nothing allocated), where torch builds it on
    the CPU (a second export: only where a meta constant is, and only when asked)."""
    sig = exported.graph_signature
    values = {ph: exported.constants[name]
              for ph, name in sig.inputs_to_lifted_tensor_constants.items()
              if isinstance(exported.constants.get(name), torch.Tensor)}
    if recover and any(v.is_meta for v in values.values()):
        again = _constants_on_fake_cpu(model, inputs)
        names = sig.inputs_to_lifted_tensor_constants
        values = {ph: again.get(names[ph], v) for ph, v in values.items()}
    return {ph: v.detach().cpu() if not v.is_meta else v for ph, v in values.items()}


def _constants_on_fake_cpu(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]
                           ) -> dict[str, torch.Tensor]:
    """Constant name -> value from an export of ``model`` whose parameters, buffers and
    inputs are swapped for fake CPU tensors (restored after); empty if that fails."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        return FakeTensor(mode, torch.empty(t.shape, dtype=t.dtype, device="meta"),
                          torch.device("cpu"))

    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    try:
        for m, params, buffers in saved:
            for name, t in params.items():
                if t is not None:
                    m._parameters[name] = torch.nn.Parameter(fake(t), t.requires_grad)
            for name, t in buffers.items():
                if t is not None:
                    m._buffers[name] = fake(t)
        with warnings.catch_warnings(), _no_gc(), _quiet_export_noise():
            warnings.simplefilter("ignore")
            again = torch.export.export(model, tuple(fake(t) for t in inputs), strict=False)
        return {n: v for n, v in again.constants.items()
                if isinstance(v, torch.Tensor) and not v.is_meta}
    except Exception:  # kept meta: graph mode names the constant
        return {}
    finally:
        for m, params, buffers in saved:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)


def frozen_draws_warning(captured: Captured) -> str:
    """The warning of a capture that kept host draws as constants (empty: none)."""
    if not captured.frozen_draws:
        return ""
    return ("capture: the forward draws from Python's or NumPy's random generator ("
            + "; ".join(captured.frozen_draws) + "); --host-randomness freeze keeps the "
            "values drawn at capture (seeded with gemc.host_randomness.CAPTURE_SEED) as "
            "constants of every compiled step, where eager PyTorch draws anew each step")


def _host_randomness_error(draws: Any, entrypoint: str) -> CaptureError:
    return CaptureError(
        "the model's forward draws from Python's or NumPy's random generator while "
        f"traced ({draws.describe()}): torch.export records the value drawn at capture as "
        "a constant, so every compiled step would reuse it where eager PyTorch draws a "
        "fresh one",
        where=f"{entrypoint}'s forward",
        fix="draw it with torch on the tensors' device (e.g. torch.randint(0, n + 1, (1,), "
            "device=x.device)) or make it part of the batch, so each step draws anew; or "
            "compile with --host-randomness freeze (CompileConfig.host_randomness) to keep "
            "the traced value, listed in the plan's warnings",
    )


def _devices(tensors: Iterable[torch.Tensor]) -> list[str]:
    return sorted({t.device.type for t in tensors})


def _inputs_on_model_device(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """Example inputs moved to the device of the model's state when that is meta.

    A user's example batch is often real (built on the CPU), while gemc builds the model on
    meta; only shapes and dtypes matter to capture, so the inputs follow the model there.
    A model holding tensors on several devices is moved to meta whole first (capture
    never reads a value). A model wholly on a real device keeps its inputs as given: that
    is a real capture, and a mismatch there is the model's to fix.
    """
    state = [*model.parameters(), *model.buffers()]
    state_devices = _devices(state)
    if "meta" in state_devices and len(state_devices) > 1:
        model.to("meta")
        state_devices = ["meta"]
    if state_devices in ([], ["meta"]) and any(not t.is_meta for t in inputs):
        return tuple(t.to("meta") for t in inputs)
    return inputs


_DEVICE_MISMATCH_TEXTS = ("Expected all tensors to be on the same device",
                          "found two different devices")
"""How a device mismatch reads where torch has no ``FakeTensorDeviceMismatchError`` (torch
2.11 raises a bare ``RuntimeError``: "Unhandled FakeTensor Device Propagation for
aten.mul.Tensor, found two different devices cpu, cuda:0") or the error is eager's."""


def is_device_mismatch(exc: BaseException) -> bool:
    """Whether a capture failure (or one it was raised from) is two tensors meeting on
    different devices, in the words of the torch that runs (public: the test pins both
    versions' words)."""
    from torch._subclasses import fake_tensor

    mismatch = getattr(fake_tensor, "FakeTensorDeviceMismatchError", None)
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if (mismatch is not None and isinstance(cur, mismatch)) \
                or any(text in str(cur) for text in _DEVICE_MISMATCH_TEXTS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _device_error(
    exc: BaseException,
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    entrypoint: str,
) -> CaptureError:
    """A device mismatch named as one: which devices met, and what gemc expects."""
    state = _devices([*model.parameters(), *model.buffers()]) or ["(none)"]
    given = _devices(inputs)
    moved = " (moved to meta for capture)" if state == ["meta"] and given != ["meta"] else ""
    return CaptureError(
        "the model's forward combined tensors on different devices: example inputs given "
        f"on {', '.join(given)}{moved}, parameters and buffers on {', '.join(state)} "
        f"({_first_line(exc)})",
        where=_where(exc, entrypoint),
        fix=(
            "gemc captures on the meta device: it moves example inputs, parameters and "
            "buffers there itself, but not a tensor the forward makes with an explicit "
            "device= or with none (torch.arange(n) is made on the CPU, torch's default; "
            "use device=x.device of an input) nor a tensor kept as a plain module "
            "attribute (register it with self.register_buffer(...))"
        ),
    )


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Export allocates millions of short-lived Python objects at GEM scale; the cyclic
    collector rescanning them costs about a third of the export time, for nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _quiet_export_noise() -> Iterator[None]:
    """What torch prints ahead of a failed capture, left out: its symbolic-shapes logger's
    "Unable to find user code corresponding to {u0}" warning, the fake-tensor logger's
    traceback of a failing op, and the partial traced graph
    torch.export prints to stderr (``partial_fx_graph``), dozens of lines per failure
    (three times over for SASRec's causal mask) ahead of the one CaptureError that names
    the line and the fix. Anything else written to stderr meanwhile is written after."""
    from torch._subclasses import fake_tensor
    from torch.fx.experimental import symbolic_shapes

    # the shape logger's warnings; the fake-tensor logger's traceback of the op that
    # failed ("failed while attempting to run meta for ..."), raised and named after
    muted = {symbolic_shapes.log: logging.ERROR, fake_tensor.log: logging.CRITICAL}
    levels = {log: log.level for log in muted}
    for log, level in muted.items():
        log.setLevel(max(log.level, level))
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except BaseException as exc:
        graph = getattr(exc, "partial_fx_graph", None)
        text = buffer.getvalue()
        sys.stderr.write(text.replace(f"{graph}\n", "") if graph else text)
        raise
    else:
        sys.stderr.write(buffer.getvalue())
    finally:
        for log, level in levels.items():
            log.setLevel(level)


def _check_scalar_loss(gm: fx.GraphModule, entrypoint: str, out_spec: Any = None) -> None:
    """The forward returns one floating-point scalar. A multi-task forward often returns a
    dict of per-task losses or ``(loss, logits)``: the error then names that structure
    (``out_spec``: the forward's output pytree, its dict keys) and how to reduce it."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    results = out.args[0]
    results = results if isinstance(results, (list, tuple)) else [results]
    vals = [r.meta.get("val") if isinstance(r, fx.Node) else r for r in results]
    ok = (
        len(vals) == 1
        and isinstance(vals[0], torch.Tensor)
        and vals[0].dim() == 0
        and vals[0].is_floating_point()
    )
    if not ok:
        got = ", ".join(
            f"{'x'.join(map(str, v.shape)) or 'scalar'} {v.dtype}"
            if isinstance(v, torch.Tensor)
            else type(v).__name__
            for v in vals
        )
        kind = getattr(out_spec, "type", None)
        if kind is dict:
            shape = f"a dict {{{', '.join(map(repr, out_spec.context))}}} of"
            fix = ("return one loss: the sum (or your weighting) of the dict's losses, e.g. "
                   "sum(losses.values()); gemc trains on that scalar")
        elif kind in (tuple, list):
            shape = f"a {kind.__name__} of"
            fix = ("return only the training loss (e.g. a wrapper module whose forward "
                   "returns model(...)[0]); logits for metrics come from another method")
        else:
            shape = ""
            fix = "reduce to one floating-point scalar (e.g. loss.mean()) and return only that"
        raise CaptureError(
            f"the model's forward must return the scalar training loss; it returned {shape}"
            f"{' ' if shape else ''}{len(vals)} value(s): {got}",
            where=f"{entrypoint} -> model.forward",
            fix=fix,
        )


def fingerprint(
    gm: fx.GraphModule, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]
) -> str:
    """A hash of the graph's ops and shapes and of the parameter shapes.

    The runner refuses a plan whose fingerprint differs from the model it builds, so a plan
    never runs against a model it was not compiled for.
    """
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
        h.update(f"{node.op}|{node.target}|{shape}\n".encode())
    for fqn in sorted(shapes):
        h.update(f"{fqn}|{shapes[fqn]}|{dtypes[fqn]}\n".encode())
    return "sha256:" + h.hexdigest()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0][:400]}"


def _where(exc: BaseException, entrypoint: str) -> str:
    return user_frame(exc) or f"{entrypoint} -> model.forward"
